"""The weights' layout on the device: which form of the matrices (stacked or per layer, input- or output-major,
fused or not: ``tuning.LAYOUTS``) each backend and method reads fastest, and the transform to it (``params.py``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax import policy
from ddtree_jax.params import TargetParams, fuse_projections, input_major, output_major, unstack_layers
from ddtree_jax.spec import GenerateOptions, run_forms
from ddtree_jax.tuning import LAYOUTS


def device_layout(params, backend: str | None = None, layout: str = "auto", method: str | None = None):
    """The weights laid out for the backend and the method. On GPU: layers stacked under ``lax.scan`` (with
    ``decode.XLA_OPTIONS`` the GEMMs read each layer's slice in place; the per-layer layout, ``params.unstack_layers``,
    avoids slicing altogether but its unrolled loop compiles for minutes) with q/k/v and gate/up fused into one
    matrix each (``params.fuse_projections``: fewer, larger products); the matrices input-major for the rounds
    (``GPU_LAYOUT``: the verify's products have 16 rows or more, GEMMs that cuBLAS reads faster so), output-major for
    ``method`` "ar" (``GPU_AR_LAYOUT``: a one-row step is then a row reduction at GEMV bandwidth,
    ``params.output_major``); a drafter output-major (``DRAFT_GPU_LAYOUT``). Elsewhere as given (stacked and
    input-major as loaded). Same math.

    ``layout`` (``Tuning.layout``) other than "auto" forces one of ``tuning.LAYOUTS``:
    "-out-major" matrices output-major, else input-major (either turned into the other); "-fused" q/k/v and gate/up
    concatenated (skipped for weights split across devices; never undone); "unstacked" per-layer buffers; "-dual" a
    dense target's layers held twice, input-major for every forward of several rows and output-major for those of one
    row (``TargetParams.one_row``: a second copy of the layers, so that AR steps of one sequence read their row
    reductions and every other forward its GEMMs; skipped for weights split across devices and for MoE targets). A
    drafter takes the same forms (its ``fc`` stays input-major; no second copy). Idempotent: callers
    that decode many times lay out once at load for their method (``generate`` then has nothing to do; weights laid
    out for the rounds and then decoded by AR are turned output-major in that call, a copy of every matrix).

    On CPU a tied output projection is also materialised once, in float32 ([D, V]), for one-row products:
    otherwise XLA:CPU converts and transposes the embedding outside the round loop of every call (82 ms per call for
    SmolLM2-135M's 49152 x 576, whatever the number of rounds), and its one-row bf16 product is 10x slower than
    the f32 one; products of several rows (a verify, the drafter's block) read the bf16 embedding, 1.6-1.9x faster
    there (``TargetParams.head_copy``, model.logits). The math is the same."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    if params is None:
        return params
    backend = backend or jax.default_backend()
    target = isinstance(params, TargetParams)
    if layout == "auto" and backend != "gpu":
        layout = None  # as given
    elif layout == "auto":
        layout = (GPU_AR_LAYOUT if method == "ar" else GPU_LAYOUT) if target else DRAFT_GPU_LAYOUT
    dual = bool(layout) and layout.endswith("-dual") and target and _dense_replicated(params)
    if dual and params.one_row is not None:
        return params  # laid out so already
    if backend == "cpu" and target and params.lm_head is None and "out-major" not in (layout or ""):
        params = dataclasses.replace(params, lm_head=params.embed.T.astype(jnp.float32), head_copy=True)
    if layout is None:
        return params
    if target and params.one_row is not None:  # another layout: the copy goes
        params = dataclasses.replace(params, one_row=None)
    params = output_major(params) if "out-major" in layout else input_major(params)
    if "-fused" in layout and _replicated(params.layers):
        params = fuse_projections(params)
    if dual:
        params = dataclasses.replace(params, one_row=output_major(params).layers)
    return unstack_layers(params) if layout.startswith("unstacked") else params


def _dense_replicated(params: TargetParams) -> bool:
    """Whether a target's layers are stacked, dense (no MoE layer) and whole on each of their devices."""
    layers = params.layers
    return (not isinstance(layers, (tuple, list)) and layers.router is None and not layers.sparse_pattern
            and _replicated(layers))


def _replicated(tree) -> bool:
    """Whether every array of ``tree`` is whole on each of its devices (one device, or replicated)."""
    return all(getattr(getattr(x, "sharding", None), "is_fully_replicated", True) for x in jax.tree.leaves(tree))


# device_layout's choices on GPU (docs/PERFORMANCE.md has the measurements). For the rounds, the target's matrices
# input-major with q/k/v and gate/up fused: cuBLAS reads input-major matrices faster at every row count from 2 to 264
# (benchmarks/gemm_layouts.py), and fewer, larger products are faster.
GPU_LAYOUT = "stacked-fused"
# ... a drafter's (its products have 16 rows per sequence): output-major and fused; input-major is no faster there.
DRAFT_GPU_LAYOUT = "stacked-out-major-fused"
# ... and AR's: output-major, so that a one-row step (batch 1) is a row reduction (input-major, XLA's one-row product
# is 4x slower); batches of AR steps would be faster input-major, but one engine serves every batch size with one
# layout.
GPU_AR_LAYOUT = "stacked-out-major-fused"


def layout_method(options: GenerateOptions) -> str:
    """The method whose weight layout a run takes (:func:`device_layout`): AR's when AR steps are among its forms (a
    one-row step reads output-major matrices 4x faster; the rounds lose about 1%), else the method's."""
    return "ar" if policy.AR in run_forms(options) else options.method
