"""How a decode runs on the device, never what it computes: the weights' layout, the layer kernels, the verify
block's padding, the layer loop's unroll and the prefill chunk.

``Tuning`` is frozen and hashable: ``spec.Spec`` carries it (static under jit) and hands it to ``model.forward``
and the drafter, which read nothing else (no environment variable) when they are traced. Every field has a default
that suits the backend; a command line sets fields with ``--tuning KEY=VALUE,...`` (:func:`parse`), e.g. for an
A/B of a kernel against XLA's ops. No choice here changes the outputs beyond a float's last bit (the kernels'
own rounding order).
"""

from __future__ import annotations

import dataclasses

# weight_layout.device_layout's forms of the weights: "auto" picks one per backend and method; "-out-major" matrices
# stored [out, in] (else [in, out]); "-fused" q/k/v and gate/up concatenated; "unstacked" per-layer buffers (else
# [L, ...]); "-dual" a target's layers also held output-major for forwards of one row (a second copy)
LAYOUTS = ("auto", "stacked", "unstacked", "stacked-out-major", "unstacked-out-major", "stacked-out-major-fused",
           "unstacked-out-major-fused", "stacked-fused", "stacked-fused-dual")


@dataclasses.dataclass(frozen=True)
class Tuning:
    layout: str = "auto"  # the weights' layout, one of LAYOUTS (weight_layout.device_layout; target and drafter alike)
    qkv_write: bool = True  # pallas_kernels.qkv_write where it applies (model.qkv_kernel_applies); False: XLA's ops
    add_norm: bool = True  # pallas_kernels.add_norm where it applies (model.residual_norm); False: XLA's ops
    decode_attention: bool = True  # one-row steps by pallas_kernels.decode_attention (False: the tree kernel)
    verify_align: int | None = None  # verify rows padded to a multiple of this (None: spec.default_verify_align)
    layer_unroll: int | None = None  # target layers per layer-loop iteration (None: spec.default_layer_unroll)
    prefill_chunk: int = 512  # prompt tokens per prefill forward
    grouped_matmul: bool = True  # an MoE layer's grouped products by pallas_kernels.grouped_matmul where it applies
    # (ddtree_jax.moe.grouped_matmul_fn); False: XLA's ragged dot
    moe_gather_pairs: int | None = None  # (token, slot) pairs up to which an MoE layer takes its gather form
    # (None: ddtree_jax.moe.GATHER_MAX_PAIRS)
    live_spans: bool = True  # on one CPU device, XLA's attention over the shortest key span holding the live slots
    # (model.live_spans: a lax.switch a layer); False: over the whole cache. Inert on GPU and on meshes

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"tuning layout={self.layout!r}: expected one of {', '.join(LAYOUTS)}")
        for name in SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"tuning {name}={getattr(self, name)!r}: expected a bool")
        for name in COUNTS:
            value = getattr(self, name)
            if not (value is None and name != "prefill_chunk" or type(value) is int and value >= 1):
                raise ValueError(f"tuning {name}={value!r}: expected a positive integer")


SWITCHES = ("qkv_write", "add_norm", "decode_attention", "grouped_matmul", "live_spans")
COUNTS = ("verify_align", "layer_unroll", "prefill_chunk", "moe_gather_pairs")
FIELDS = ("layout", *SWITCHES, *COUNTS)
HELP = ("how the decode runs on the device, never what it computes: comma-separated KEY=VALUE among layout (one of "
        f"{', '.join(LAYOUTS)}; the weights' form), qkv_write, add_norm, decode_attention, grouped_matmul "
        "(0 or 1: the layer kernels; 0 gives XLA's ops, or the tree kernel for one-row steps), live_spans (0 or 1: CPU "
        "attention over the live key span or the whole cache), verify_align, "
        "layer_unroll, prefill_chunk, moe_gather_pairs (positive integers); unset: the backend's defaults "
        "(ddtree_jax.tuning)")


def parse(text: str, base: Tuning = Tuning()) -> Tuning:
    """``"KEY=VALUE,..."`` -> ``base`` with those fields set (bools as 0/1/true/false, integers, the layout by name);
    a ValueError of one line for an unknown key or a bad value."""
    values: dict[str, object] = {}
    for piece in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = piece.partition("=")
        if not eq or key not in FIELDS:
            raise ValueError(f"tuning {piece!r}: expected KEY=VALUE with KEY one of {', '.join(FIELDS)}")
        if key in SWITCHES:
            if value.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"tuning {key}={value!r}: expected 0 or 1")
            values[key] = value.lower() in ("1", "true")
        elif key in COUNTS:
            values[key] = int(value) if value.isdigit() else value  # a bad one fails in Tuning's check
        else:
            values[key] = value
    return dataclasses.replace(base, **values)
