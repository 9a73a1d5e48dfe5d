"""Parameter pytrees: registered dataclasses, layers stacked on a leading axis.

Every weight is declared once, in :data:`LAYER_SPECS` / :data:`TARGET_SPECS` / :data:`DRAFT_SPECS`, as
(shape, logical axes). Shapes, random initialisation, checkpoint conversion and sharding all read these
tables, so a weight's layout is written in exactly one place. Logical axis names:

    layers    stacked decoder layers             embed     the residual width D
    heads     query heads H                      kv_heads  key/value heads K
    head_dim  per-head width hd                  mlp       the SwiGLU width F
    vocab     the vocabulary V                   taps      the drafter's concatenated target features
    experts   a layer's experts E (MoE)          expert_mlp  an expert's SwiGLU width F (``moe_intermediate_size``)

Mixture-of-Experts layers (``ddtree_jax.moe``) hold a router and their experts' matrices instead of w_gate, w_up and
w_down. A stack that mixes dense and sparse MLPs (``mlp_only_layers``, ``decoder_sparse_step``; no released Qwen3-MoE
checkpoint has one) stacks each kind over its own layers (the dense MLPs over the dense layers, the experts over the
sparse ones; ``LayerWeights.sparse_pattern`` says which layer is which) and runs as the unrolled per-layer tuple
(:func:`unstack_layers`), since a ``lax.scan`` needs layers of one kind: the simplest form that keeps every real
checkpoint, all sparse, under the scan of one homogeneous stack.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from ddtree_jax.config import DraftConfig, ModelConfig

Array = jax.Array
Spec = tuple[Callable[[ModelConfig], tuple[int, ...]], tuple[str, ...]]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    """One decoder layer's weights, each stacked to [L, ...] (L = number of layers)."""

    attn_norm: Array  # [L, D]
    wq: Array  # [L, D, H, hd]
    wk: Array  # [L, D, K, hd]
    wv: Array  # [L, D, K, hd]
    wo: Array  # [L, H, hd, D]
    q_norm: Array | None  # [L, hd] (Qwen3 only)
    k_norm: Array | None  # [L, hd] (Qwen3 only)
    mlp_norm: Array  # [L, D]
    w_gate: Array  # [L, D, F]
    w_up: Array  # [L, D, F]
    w_down: Array  # [L, F, D]
    # A sparse MoE MLP (ddtree_jax.moe) instead of w_gate / w_up / w_down (None in a dense layer; these in a sparse one)
    router: Array | None = None  # [L, D, E]
    experts_gate_up: Array | None = None  # [L, E, 2F, D]: each expert's gate and up matrices output-major, gate first
    experts_down: Array | None = None  # [L, E, D, F]: output-major
    # per layer, whether its MLP is sparse, in a stack mixing both kinds (each stacked over its own layers; see the
    # module doc); () when every layer is of one kind
    sparse_pattern: tuple[bool, ...] = dataclasses.field(default=(), metadata=dict(static=True))
    # True: the seven matrices are stored output-major, [L, *out, *in] (e.g. wq [L, H, hd, D]; see output_major)
    output_major: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # True: wq holds q | k | v ([L, H + 2K, hd, D]) and w_gate holds gate | up ([L, 2F, D]), concatenated along
    # their output axis; w_up is None, and wk, wv too in a target, not in a drafter (see fuse_projections;
    # output-major only)
    fused: bool = dataclasses.field(default=False, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetParams:
    embed: Array  # [V, D]
    layers: LayerWeights
    final_norm: Array  # [D]
    lm_head: Array | None  # [D, V] ([V, D] when output_major); None when tied to embed
    output_major: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # lm_head is a float32 copy of the tied embedding (weight_layout.device_layout on CPU) for one-row products;
    # products of several rows read the embedding itself (model.logits)
    head_copy: bool = dataclasses.field(default=False, metadata=dict(static=True))
    # the layers again, output-major, read by forwards of one row (an AR step of one sequence) while ``layers`` serve
    # the others (weight_layout's "-dual" layouts: each product reads the layout it reads fastest); None otherwise
    one_row: LayerWeights | None = None

    def head(self) -> Array:
        """The output projection [D, V] (the transposed embedding when tied)."""
        return self.embed.T if self.lm_head is None else self.lm_head.T if self.output_major else self.lm_head

    def head_output_major(self) -> Array:
        """The output projection as [V, D] (the embedding itself when tied): see :func:`output_major`."""
        return self.embed if self.lm_head is None else self.lm_head if self.output_major else self.lm_head.T


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftParams:
    """A DFlash drafter: no embedding or lm_head of its own (it uses the target's)."""

    fc: Array  # [taps * D, D]
    hidden_norm: Array  # [D]
    layers: LayerWeights
    final_norm: Array  # [D]


LAYER_SPECS: dict[str, Spec] = {
    "attn_norm": (lambda c: (c.num_layers, c.hidden_size), ("layers", "embed")),
    "wq": (lambda c: (c.num_layers, c.hidden_size, c.num_heads, c.head_dim), ("layers", "embed", "heads", "head_dim")),
    "wk": (
        lambda c: (c.num_layers, c.hidden_size, c.num_kv_heads, c.head_dim),
        ("layers", "embed", "kv_heads", "head_dim"),
    ),
    "wv": (
        lambda c: (c.num_layers, c.hidden_size, c.num_kv_heads, c.head_dim),
        ("layers", "embed", "kv_heads", "head_dim"),
    ),
    "wo": (lambda c: (c.num_layers, c.num_heads, c.head_dim, c.hidden_size), ("layers", "heads", "head_dim", "embed")),
    "q_norm": (lambda c: (c.num_layers, c.head_dim), ("layers", "head_dim")),
    "k_norm": (lambda c: (c.num_layers, c.head_dim), ("layers", "head_dim")),
    "mlp_norm": (lambda c: (c.num_layers, c.hidden_size), ("layers", "embed")),
    "w_gate": (lambda c: (len(c.dense_layers), c.hidden_size, c.intermediate_size), ("layers", "embed", "mlp")),
    "w_up": (lambda c: (len(c.dense_layers), c.hidden_size, c.intermediate_size), ("layers", "embed", "mlp")),
    "w_down": (lambda c: (len(c.dense_layers), c.intermediate_size, c.hidden_size), ("layers", "mlp", "embed")),
    # the router's expert axis is replicated: every device routes every token (ddtree_jax.moe)
    "router": (lambda c: (len(c.sparse_layers), c.hidden_size, c.num_experts), ("layers", "embed", None)),
    "experts_gate_up": (lambda c: (len(c.sparse_layers), c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size),
                        ("layers", "experts", "expert_mlp", "embed")),
    "experts_down": (lambda c: (len(c.sparse_layers), c.num_experts, c.hidden_size, c.moe_intermediate_size),
                     ("layers", "experts", "embed", "expert_mlp")),
}
TARGET_SPECS: dict[str, Spec] = {
    "embed": (lambda c: (c.vocab_size, c.hidden_size), ("vocab", "embed")),
    "final_norm": (lambda c: (c.hidden_size,), ("embed",)),
    "lm_head": (lambda c: (c.hidden_size, c.vocab_size), ("embed", "vocab")),
}
DRAFT_SPECS: dict[str, Spec] = {
    "fc": (lambda c: (c.num_taps * c.layers.hidden_size, c.layers.hidden_size), ("taps", "embed")),
    "hidden_norm": (lambda c: (c.layers.hidden_size,), ("embed",)),
    "final_norm": (lambda c: (c.layers.hidden_size,), ("embed",)),
}
# The matrices of a layer and how many of their leading axes (after ``layers``) are inputs (contracted).
MATRIX_INPUTS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}
NORMS = ("attn_norm", "q_norm", "k_norm", "mlp_norm", "final_norm", "hidden_norm")
DENSE_MLP, SPARSE_MLP = ("w_gate", "w_up", "w_down"), ("router", "experts_gate_up", "experts_down")


def _has(cfg: ModelConfig, name: str) -> bool:
    if name in DENSE_MLP:
        return bool(cfg.dense_layers)
    if name in SPARSE_MLP:
        return bool(cfg.sparse_layers)
    return cfg.qk_norm or name not in ("q_norm", "k_norm")


def stacked_layers(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """The model layers whose weights a layer field's stack holds, in order (its rows): every layer, or for a stack
    mixing dense and sparse MLPs, the dense layers for the dense MLP's weights and the sparse ones for the experts'."""
    if name in DENSE_MLP:
        return cfg.dense_layers
    return cfg.sparse_layers if name in SPARSE_MLP else tuple(range(cfg.num_layers))


def layer_shapes(cfg: ModelConfig, dtype=jnp.bfloat16) -> LayerWeights:
    """A LayerWeights of jax.ShapeDtypeStruct (None for absent weights)."""
    sparse = set(cfg.sparse_layers)
    mixed = 0 < len(sparse) < cfg.num_layers
    return LayerWeights(
        **{n: jax.ShapeDtypeStruct(f(cfg), dtype) if _has(cfg, n) else None for n, (f, _) in LAYER_SPECS.items()},
        sparse_pattern=tuple(i in sparse for i in range(cfg.num_layers)) if mixed else (),
    )


def target_shapes(cfg: ModelConfig, dtype=jnp.bfloat16) -> TargetParams:
    s = {n: jax.ShapeDtypeStruct(f(cfg), dtype) for n, (f, _) in TARGET_SPECS.items()}
    if cfg.tie_word_embeddings:
        s["lm_head"] = None
    return TargetParams(layers=layer_shapes(cfg, dtype), **s)


def draft_shapes(cfg: DraftConfig, dtype=jnp.bfloat16) -> DraftParams:
    s = {n: jax.ShapeDtypeStruct(f(cfg), dtype) for n, (f, _) in DRAFT_SPECS.items()}
    return DraftParams(layers=layer_shapes(cfg.layers, dtype), **s)


def logical_axes(params: TargetParams | DraftParams) -> TargetParams | DraftParams:
    """The same pytree with each array replaced by its tuple of logical axis names."""
    specs = {**LAYER_SPECS, **TARGET_SPECS, **DRAFT_SPECS}

    def axes(obj):
        fields = {}
        om = getattr(obj, "output_major", False)
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if f.metadata.get("static"):
                fields[f.name] = v
            elif isinstance(v, LayerWeights):
                fields[f.name] = axes(v)
            else:
                a = None if v is None else specs[f.name][1]
                fields[f.name] = _out_major_axes(f.name, a) if om and a is not None else a
        return type(obj)(**fields)

    return axes(params)


def init_random(shapes, key: Array, scale: float = 0.02):
    """Random parameters for a shape tree: norms near 1, matrices N(0, scale^2). For tests and benchmarks."""
    leaves, treedef = jax.tree.flatten_with_path(shapes)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [random_leaf(p, s, k, scale) for (p, s), k in zip(leaves, keys)])


def random_leaf(path, s, key: Array, scale: float = 0.02) -> Array:
    """One leaf of :func:`init_random` (its path, its ShapeDtypeStruct): near 1 for a norm, else N(0, scale^2)."""
    if getattr(path[-1], "name", "") in NORMS:
        return (1.0 + 0.1 * jax.random.normal(key, s.shape)).astype(s.dtype)
    return (scale * jax.random.normal(key, s.shape)).astype(s.dtype)


def unstack_layers(params):
    """The same parameters with ``layers`` as a tuple of per-layer LayerWeights (leaves without the
    leading L axis). ``model.forward`` and the drafter run such a tuple as an unrolled loop over layers,
    each layer's matrices their own buffers. With the stacked layout, a ``lax.scan`` slices layer i out
    of every [L, ...] weight, and XLA on GPU materialises those slices (an async copy of each layer's
    weights every step: measured 3x the HBM traffic of a decode step on an H200). Same math either way."""
    if isinstance(params.layers, (tuple, list)):
        return params
    n = params.layers.attn_norm.shape[0]
    return dataclasses.replace(params, layers=tuple(layer(params.layers, i) for i in range(n)))


def layer(stack: LayerWeights, i: int) -> LayerWeights:
    """Layer i of a stack, its leaves without the L axis; of a stack mixing dense and sparse MLPs (``sparse_pattern``),
    with its own kind's row of that kind's weights and None for the other kind's."""
    if not stack.sparse_pattern:
        return jax.tree.map(lambda a: a[i], stack)
    sparse = stack.sparse_pattern[i]
    row = sum(stack.sparse_pattern[:i]) if sparse else i - sum(stack.sparse_pattern[:i])
    fields = {}
    for name in LAYER_SPECS:
        a = getattr(stack, name)
        mine = name in (SPARSE_MLP if sparse else DENSE_MLP)
        other = name in (DENSE_MLP if sparse else SPARSE_MLP)
        fields[name] = None if a is None or other else a[row] if mine else a[i]
    return dataclasses.replace(stack, sparse_pattern=(), **fields)


def _out_major_axes(name: str, axes: tuple) -> tuple:
    """A weight's axes (or shape) in the output-major order: [layers?] + outputs + inputs (norms and the
    embedding as they are)."""
    if name == "lm_head":
        return axes[::-1]
    if name not in MATRIX_INPUTS:
        return axes
    n_in, lead = MATRIX_INPUTS[name], len(axes) - len(LAYER_SPECS[name][1]) + 1  # lead: 1 if stacked, else 0
    return axes[:lead] + axes[lead + n_in:] + axes[lead:lead + n_in]


def output_major(params: TargetParams | DraftParams) -> TargetParams | DraftParams:
    """The target with its layer matrices and lm_head stored output-major ([*out, *in], PyTorch's layout); a
    drafter with its layer matrices so (its ``fc`` stays input-major).

    Same math; what changes is how a product reads the weights. An autoregressive step at batch 1
    multiplies one row by every matrix, and ``model.linear`` then takes a row reduction (f32 products summed
    over the contiguous input axes), which XLA fuses into one pass over the weights: measured on an H200
    (benchmarks/gemv_ab.py) 3.9 TB/s, where XLA's one-row GEMM over [in, out] weights reads at 2.2 TB/s.
    Products of two rows or more are GEMMs, which cuBLAS reads faster input-major (docs/PERFORMANCE.md): see
    :func:`input_major`. Idempotent; stacked or not, fused or not."""
    return _orient(params, True)


def input_major(params: TargetParams | DraftParams) -> TargetParams | DraftParams:
    """The inverse of :func:`output_major`: the matrices as loaded, [*in, *out]. Idempotent."""
    return _orient(params, False)


def _orient(params, out_major: bool):
    first = params.layers[0] if isinstance(params.layers, (tuple, list)) else params.layers
    if first.output_major == out_major:
        return params

    def move(w: LayerWeights) -> LayerWeights:
        moved = {}
        for name in MATRIX_INPUTS:
            x = getattr(w, name)
            if x is None:  # the parts a fused layer no longer holds
                continue
            axes = _out_major_axes(name, tuple(range(x.ndim)))  # in-major -> out-major; its inverse the other way
            moved[name] = jnp.transpose(x, axes if out_major else tuple(sorted(axes, key=axes.__getitem__)))
        return dataclasses.replace(w, output_major=out_major, **moved)

    layers = tuple(map(move, params.layers)) if isinstance(params.layers, (tuple, list)) else move(params.layers)
    if isinstance(params, DraftParams):
        return dataclasses.replace(params, layers=layers)
    lm_head = None if params.lm_head is None else params.lm_head.T
    return dataclasses.replace(params, layers=layers, lm_head=lm_head, output_major=out_major)


def fuse_projections(params: TargetParams | DraftParams) -> TargetParams | DraftParams:
    """The target or drafter with each layer's q, k and v matrices as one matrix (``wq``: [L, D, H + 2K, hd], or
    [L, H + 2K, hd, D] output-major) and its gate and up matrices as one (``w_gate``: [L, D, 2F], or [L, 2F, D]).

    Same math; fewer, larger products. At 65 rows (a DDTree verify) cuBLAS reads the 8 MB k and v matrices of
    Qwen3-8B at about 1 TB/s each, against 3.4 TB/s for the 100 MB gate and up (docs/PERFORMANCE.md);
    XLA's dot merger would concatenate them at run time, copying the weights every step. Here they are
    concatenated once, at load. A drafter keeps its separate ``wk`` and ``wv`` too: ``draft.extend`` projects the
    context with them alone (a product over a slice of the fused matrix would copy it). Not for sharded weights:
    a column split of [q | k | v] would not be a split of the heads. Idempotent; stacked or not."""
    keep_kv = isinstance(params, DraftParams)

    def fuse(w: LayerWeights) -> LayerWeights:
        if w.fused:
            return w
        # the heads axis of [L?, H, hd, D] / [L?, D, H, hd], the features axis of [L?, F, D] / [L?, D, F]
        heads_axis = w.wq.ndim - 3 if w.output_major else w.wq.ndim - 2
        mlp = {}
        if w.w_gate is not None:  # (a sparse layer's experts are fused already: experts_gate_up)
            mlp_axis = w.w_gate.ndim - 2 if w.output_major else -1
            mlp = dict(w_up=None, w_gate=jnp.concatenate([w.w_gate, w.w_up], axis=mlp_axis))
        return dataclasses.replace(
            w, fused=True, **({} if keep_kv else dict(wk=None, wv=None)),
            wq=jnp.concatenate([w.wq, w.wk, w.wv], axis=heads_axis), **mlp,
        )

    layers = tuple(map(fuse, params.layers)) if isinstance(params.layers, (tuple, list)) else fuse(params.layers)
    return dataclasses.replace(params, layers=layers)


def num_heads(w: LayerWeights) -> int:
    """The query heads of a layer's weights, read off ``wo`` ([L?, H, hd, D], or [L?, D, H, hd] output-major)."""
    return w.wo.shape[-2] if w.output_major else w.wo.shape[-3]


@functools.partial(jax.jit, donate_argnums=0)
def write_layer(stack: Array, row: Array, i) -> Array:
    """stack [L, ...] with layer i set to row [...] (cast to the stack's dtype), in place: the stack is donated (for
    filling a large stack layer by layer: the loader, random weights)."""
    return jax.lax.dynamic_update_index_in_dim(stack, row.astype(stack.dtype), i, 0)


def cast(params, dtype):
    """Cast every floating leaf to ``dtype``."""
    return jax.tree.map(lambda x: x.astype(dtype), params)
