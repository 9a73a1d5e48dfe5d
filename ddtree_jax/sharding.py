"""Logical axes -> mesh axes: one rules table; the model code names logical axes only.

Meshes are 2-D, ``data x model`` (``--mesh DxM``).

Data parallelism (``data``): the decode steps (prefill, the loop of rounds) run under a ``shard_map`` over the
data axis (:func:`on_spec_mesh`): each data shard decodes its own rows with no communication at all, and
leaves its loop of rounds when its own rows are done. (XLA's automatic partitioning of the batch axis
gathers the scatter indices and updates of every cache write over the data axis; the explicit split has
none: an 8x1 round compiles to zero collectives.)

Tensor parallelism (``model``), inside each data shard, by XLA's SPMD partitioner from the rules table:

    wq, wk, wv, w_gate, w_up   column-parallel (heads / kv_heads / mlp split): no communication
    wo, w_down                 row-parallel: a partial sum per device, one all-reduce each
    MoE experts                expert-parallel (experts split): each device runs its experts' share of the pairs,
                               one all-reduce (ddtree_jax.moe)
    embed [V, D]               vocabulary-parallel: each device looks up its own rows, one all-reduce
    lm_head [D, V]             vocabulary-parallel: logits stay split over the vocabulary
    KV caches [L, B, S, K, hd] split on batch (data) and KV heads (model)

The vocabulary is never gathered (``vocab_parallel.py``: argmax, the tree's top-k and sampling's filter per
vocabulary shard).

KV heads. When the model axis is larger than the number of KV heads (Qwen3 MoE models have 4, Qwen3-8B 8),
the KV heads are replicated at load time: :func:`shard_model` repeats every KV head ``M / K`` times in
``wk`` / ``wv`` (head j becomes heads j*r .. j*r + r-1) and sets ``num_kv_heads = M`` in the config. Query
head h then reads KV head h // (H / M), a copy of the original head h // (H / K), so the attention code and
the Pallas kernels are unchanged and every device holds exactly the KV heads its query heads read (the KV
cache costs M / K times more memory in total, the same per device as K = M). ``k_norm`` is one [hd] vector
per layer shared by all heads: nothing to repeat. Stored checkpoints keep the original K heads; the
repetition happens after reading (:func:`load_target`, :func:`load_draft`).

The Pallas kernels run per device under ``shard_map`` (:func:`per_device_attention`), each seeing its rows
and its heads.

Without an active mesh (:func:`use_mesh`), :func:`constrain` is the identity and the vocabulary helpers are
the plain single-device ops, so single-device code pays nothing and computes exactly what it did before.
A 1x1 mesh runs the same ops as no mesh (the split helpers engage only when an axis has more than one
device), plus sharding annotations that are no-ops on one device.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ddtree_jax import params as params_lib
from ddtree_jax.config import DraftConfig, ModelConfig

Array = jax.Array
AXES = ("data", "model")
CACHE_AXES = ("layers", "batch", "cache_seq", "kv_heads", "head_dim")  # KVCache.k / .v [L, B, S, K, hd]


class ShardingError(ValueError):
    """A mesh that cannot run this model (one line, saying why)."""


@dataclasses.dataclass(frozen=True)
class Rules:
    """Which mesh axis (or None) each logical axis is split over."""

    batch: str | None = "data"
    seq: str | None = None
    embed: str | None = None
    heads: str | None = "model"
    kv_heads: str | None = "model"
    head_dim: str | None = None
    mlp: str | None = "model"
    vocab: str | None = "model"
    layers: str | None = None
    taps: str | None = None
    cache_seq: str | None = None
    nodes: str | None = None
    experts: str | None = "model"
    expert_mlp: str | None = None

    def spec(self, axes: tuple[str | None, ...]) -> P:
        return P(*(None if a is None else getattr(self, a) for a in axes))


# ---------------------------------------------------------------------------------------------- meshes


def parse_mesh(text: str) -> tuple[int, int]:
    """'DxM' -> (D, M), e.g. '1x8' (one sequence over 8 devices) or '8x1' (8-way data parallel)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", str(text))
    if not m:
        raise ShardingError(f"mesh {text!r}: expected DxM (data x model), e.g. 1x8 or 2x4")
    d, mm = int(m.group(1)), int(m.group(2))
    if d < 1 or mm < 1:
        raise ShardingError(f"mesh {text!r}: both axes need at least one device")
    return d, mm


def make_mesh(shape: str | tuple[int, int] | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``data x model`` mesh over ``devices`` (default: every device; shape default: all on ``model``).

    The mesh must use exactly the given devices: to run on fewer, pass ``devices`` (or restrict the visible
    devices, e.g. ``CUDA_VISIBLE_DEVICES=0,1``).
    """
    devices = list(jax.devices() if devices is None else devices)
    if shape is None:
        shape = (1, len(devices))
    d, m = parse_mesh(shape) if isinstance(shape, str) else (int(shape[0]), int(shape[1]))
    if d < 1 or m < 1:
        raise ShardingError(f"mesh {d}x{m}: both axes need at least one device")
    if d * m != len(devices):
        n = len(devices)
        raise ShardingError(
            f"mesh {d}x{m} needs {d * m} devices, but {n} {'is' if n == 1 else 'are'} visible "
            f"(use a DxM with D*M = {n}, or restrict the visible devices, e.g. CUDA_VISIBLE_DEVICES)"
        )
    return jax.make_mesh((d, m), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devices)


def axis_size(mesh: Mesh, name: str | None) -> int:
    return 1 if name is None else mesh.shape[name]


def kv_copies(cfg: ModelConfig, mesh: Mesh, rules: Rules = Rules()) -> int:
    """How many times each KV head is repeated for this mesh (1: the KV heads split evenly)."""
    m, k = axis_size(mesh, rules.kv_heads), cfg.num_kv_heads
    return 1 if k % m == 0 else m // k


def check_model(cfg: ModelConfig, mesh: Mesh, what: str = "target", rules: Rules = Rules()) -> None:
    """Raise ShardingError (one line) when ``cfg``'s layers cannot be split over the mesh's model axis."""
    m = axis_size(mesh, rules.heads)
    shape = "x".join(str(mesh.shape[a]) for a in mesh.axis_names)
    where = f"mesh {shape}: the {what}"
    if cfg.num_heads % m:
        raise ShardingError(f"{where} has {cfg.num_heads} query heads, not divisible by the model axis ({m})")
    k = cfg.num_kv_heads
    if k % m and m % k:
        raise ShardingError(
            f"{where} has {k} KV heads: the model axis ({m}) must divide them or be a multiple of them"
        )
    if cfg.num_experts % axis_size(mesh, rules.experts):
        raise ShardingError(f"{where} has {cfg.num_experts} experts, not divisible by the model axis ({m})")
    if cfg.dense_layers and cfg.intermediate_size % axis_size(mesh, rules.mlp):
        raise ShardingError(
            f"{where} has intermediate_size {cfg.intermediate_size}, not divisible by the model axis ({m})"
        )
    if cfg.vocab_size % axis_size(mesh, rules.vocab):
        raise ShardingError(f"{where} has vocab_size {cfg.vocab_size}, not divisible by the model axis ({m})")


def check(mesh: Mesh, target_cfg: ModelConfig, draft_cfg: DraftConfig | None = None, rules: Rules = Rules()):
    """Every check a run on ``mesh`` needs, before any weight is read (one-line ShardingError)."""
    check_model(target_cfg, mesh, "target", rules)
    if draft_cfg is not None:
        check_model(draft_cfg.layers, mesh, "drafter", rules)


def padded_batch(batch: int, mesh: Mesh | None, rules: Rules = Rules()) -> int:
    """The batch rounded up to a multiple of the data axis (decode pads with dummy sequences)."""
    d = 1 if mesh is None else axis_size(mesh, rules.batch)
    return -(-batch // d) * d


# ---------------------------------------------------------------------------------------------- activation


_ACTIVE: list[tuple[Mesh, Rules]] = []


@contextlib.contextmanager
def use_mesh(mesh: Mesh | None, rules: Rules = Rules()):
    """Make ``constrain`` (and the vocabulary helpers) place arrays on ``mesh`` while tracing in this block.

    ``mesh=None`` is a no-op, so callers can write ``with use_mesh(spec.mesh):`` unconditionally.
    """
    if mesh is None:
        yield
        return
    _ACTIVE.append((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.pop()


def active() -> tuple[Mesh, Rules] | None:
    return _ACTIVE[-1] if _ACTIVE else None


def constrain(x: Array, axes: tuple[str | None, ...]) -> Array:
    """with_sharding_constraint by logical axis names; identity when no mesh is active."""
    if not _ACTIVE:
        return x
    mesh, rules = _ACTIVE[-1]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rules.spec(axes)))


# ---------------------------------------------------------------------------------------------- params


def param_shardings(params, mesh: Mesh, rules: Rules = Rules()):
    """NamedShardings shaped like ``params`` (a params pytree or its shapes), from params.logical_axes."""
    return jax.tree.map(
        lambda axes: NamedSharding(mesh, rules.spec(axes)),
        params_lib.logical_axes(params),
        is_leaf=lambda a: isinstance(a, tuple),
    )


def _load_rules(cfg: ModelConfig, mesh: Mesh, rules: Rules) -> Rules:
    """Rules for the stored layout: KV heads that will be repeated are read whole (replicated)."""
    return dataclasses.replace(rules, kv_heads=None) if kv_copies(cfg, mesh, rules) > 1 else rules


def _layers_cfg(cfg):
    return cfg.layers if isinstance(cfg, DraftConfig) else cfg


def _with_kv_heads(cfg, k: int):
    if isinstance(cfg, DraftConfig):
        return dataclasses.replace(cfg, layers=dataclasses.replace(cfg.layers, num_kv_heads=k))
    return dataclasses.replace(cfg, num_kv_heads=k)


def _shapes(cfg, dtype):
    return (params_lib.draft_shapes if isinstance(cfg, DraftConfig) else params_lib.target_shapes)(cfg, dtype)


def load_shardings(cfg: ModelConfig | DraftConfig, mesh: Mesh, rules: Rules = Rules(), dtype=jnp.float32):
    """Shardings for reading a stored checkpoint of ``cfg`` (weights.load_* / checkpoint.restore)."""
    lc = _layers_cfg(cfg)
    return param_shardings(_shapes(cfg, dtype), mesh, _load_rules(lc, mesh, rules))


def expand_kv_heads(layers: params_lib.LayerWeights, copies: int) -> params_lib.LayerWeights:
    """wk, wv [L, D, K, hd] -> [L, D, K * copies, hd] (output-major [L, K, hd, D] -> [L, K * copies, hd, D]):
    head j becomes heads j*copies .. j*copies + copies-1."""
    if copies == 1:
        return layers
    rep = functools.partial(jnp.repeat, repeats=copies, axis=1 if layers.output_major else 2)
    return dataclasses.replace(layers, wk=rep(layers.wk), wv=rep(layers.wv))


def shard_model(model: tuple[Any, Any], mesh: Mesh, rules: Rules = Rules()):
    """(config, params) of a target or drafter -> the same on ``mesh``: KV heads repeated when the model
    axis exceeds them (config.num_kv_heads updated), every weight placed per the rules. Idempotent."""
    cfg, params = model
    lc = _layers_cfg(cfg)
    check_model(lc, mesh, "drafter" if isinstance(cfg, DraftConfig) else "target", rules)
    layers = params.layers if isinstance(params.layers, params_lib.LayerWeights) else params.layers[0]
    if layers.fused:
        raise ValueError("shard_model takes unfused weights: shard first, then lay out (weight_layout.device_layout "
                         "fuses only weights whole on each device)")
    copies = kv_copies(lc, mesh, rules)
    params = jax.device_put(params, param_shardings(params, mesh, _load_rules(lc, mesh, rules)))
    if copies == 1:
        return cfg, params
    cfg = _with_kv_heads(cfg, lc.num_kv_heads * copies)
    out = param_shardings(params, mesh, rules)
    expand = jax.jit(lambda p: dataclasses.replace(p, layers=expand_kv_heads(p.layers, copies)), out_shardings=out)
    return cfg, expand(params)


def load_target(path: str, mesh: Mesh, dtype=jnp.float32, rules: Rules = Rules()):
    """A target read straight into the sharded layout (each device reads its part of a converted checkpoint)."""
    from ddtree_jax import config, weights

    cfg = config.model_config(path)
    check_model(cfg, mesh, "target", rules)
    loaded = weights.load_target(path, dtype, shardings=load_shardings(cfg, mesh, rules, dtype))
    return shard_model(loaded, mesh, rules)


def load_draft(path: str, mesh: Mesh, dtype=jnp.float32, rules: Rules = Rules()):
    """A DFlash drafter read straight into the sharded layout."""
    from ddtree_jax import config, weights

    cfg = config.draft_config(path)
    check_model(cfg.layers, mesh, "drafter", rules)
    loaded = weights.load_draft(path, dtype, shardings=load_shardings(cfg, mesh, rules, dtype))
    return shard_model(loaded, mesh, rules)


# ---------------------------------------------------------------------------------------------- decode state


def _leaf_axes(path, x) -> tuple[str | None, ...]:
    """KV cache arrays (fields k / v, 5-D) are [L, B, S, K, hd]; every other state leaf has the batch first."""
    name = getattr(path[-1], "name", None) if path else None
    if name in ("k", "v") and len(x.shape) == 5:
        return CACHE_AXES
    return ("batch",) + (None,) * (len(x.shape) - 1) if len(x.shape) else ()


def state_shardings(state, mesh: Mesh, rules: Rules = Rules()):
    """NamedShardings for a decode State (or its shapes): caches on batch + KV heads, the rest on batch."""
    return jax.tree.map_with_path(lambda p, x: NamedSharding(mesh, rules.spec(_leaf_axes(p, x))), state)


def constrain_state(state):
    """Pin a decode State to its layout inside jit (identity without an active mesh)."""
    if not _ACTIVE:
        return state
    return jax.tree.map_with_path(lambda p, x: constrain(x, _leaf_axes(p, x)), state)


def create(make: Callable[[], Any], mesh: Mesh | None, rules: Rules = Rules()):
    """Run ``make()`` (e.g. decode.init_state) so its arrays are born sharded (no full copy on one device)."""
    if mesh is None:
        return make()
    return born_sharded(make, mesh, rules=rules)()


def born_sharded(fn: Callable[..., Any], mesh: Mesh, *example, rules: Rules = Rules()) -> Callable[..., Any]:
    """``fn`` (returning a decode State) jitted so that its State comes out laid out on ``mesh``; ``example``: arguments
    of the shapes it will be called with."""
    return jax.jit(fn, out_shardings=state_shardings(jax.eval_shape(fn, *example), mesh, rules))


def batch_sharding(mesh: Mesh, ndim: int, rules: Rules = Rules()) -> NamedSharding:
    """An input with the batch on axis 0 (prompt tokens)."""
    return NamedSharding(mesh, rules.spec(("batch",) + (None,) * (ndim - 1)))


# ---------------------------------------------------------------------------------------------- per device


def shard_map_open(fn: Callable, mesh: Mesh, in_specs, out_specs, check_vma: bool = True) -> Callable:
    """shard_map over every mesh axis not already manual (inside the data-parallel shard_map of
    :func:`on_spec_mesh` the data axis is, and the context's abstract mesh stands for ``mesh``)."""
    context = jax.sharding.get_abstract_mesh()
    if context.empty:
        context, names = mesh, set(mesh.axis_names)
    else:
        manual = jax.sharding.AxisType.Manual
        names = {a for a, t in zip(context.axis_names, context.axis_types) if t != manual}
    return jax.shard_map(_jit_body(fn), mesh=context, in_specs=in_specs, out_specs=out_specs, axis_names=names,
                         check_vma=check_vma)


def _jit_body(fn: Callable) -> Callable:
    """A shard_map body wrapped in jit. Without it, constants that jnp captures (e.g. the empty index array
    of a static-slice ``.at[:, :n].set``) become operands of the manual computation, and Shardy's
    canonicalizer (jax 0.11.2) segfaults when such an operand turns unused (a full-width update folds)."""
    return jax.jit(fn)


def per_device(fn: Callable, in_axes: tuple, out_axes) -> Callable:
    """``fn(*arrays, **kw)`` run per device under ``shard_map`` when a mesh is active (identity without one):
    argument i is split by the logical axes ``in_axes[i]`` and the results by ``out_axes`` (a tuple of
    logical names, or a tuple of them for several results); an axis not named is whole on every device.
    For custom kernels (Pallas), which XLA cannot partition."""
    act = active()
    if act is None:
        return fn
    mesh, rules = act
    in_specs = tuple(rules.spec(a) for a in in_axes)
    several = bool(out_axes) and isinstance(out_axes[0], tuple)
    out_specs = tuple(rules.spec(a) for a in out_axes) if several else rules.spec(out_axes)

    @functools.wraps(fn)
    def sharded(*args, **kw):
        body = functools.partial(fn, **kw) if kw else fn
        return shard_map_open(body, mesh, in_specs, out_specs, check_vma=False)(*args)

    return sharded


def per_device_attention(fn: Callable, stacked: bool = False) -> Callable:
    """A tree-attention function (q, k, v, prefix_len, tree_bits, **kw) per device (:func:`per_device`):
    each device sees its batch rows and its heads (q [b, T, H/M, hd], k/v [b, S, K/M, hd]), all it needs
    (query head h reads KV head h // (H/K) on the same device). For the Pallas kernels; XLA partitions the
    jnp reference by itself. ``stacked``: (q, k, v, prefix_len, tree_bits, layer) with the stacked cache
    k/v [L, b, S, K/M, hd] and the layer index (the same on every device)."""
    q, kv = ("batch", None, "heads", None), ("batch", None, "kv_heads", None)
    if not stacked:
        return per_device(fn, (q, kv, kv, ("batch",), ("batch", None, None)), q)
    kv = (None, *kv)
    return per_device(lambda q, k, v, p, bits, layer: fn(q, k, v, p, bits, layer=layer),
                      (q, kv, kv, ("batch",), ("batch", None, None), ()), q)


def per_device_walk(fn: Callable) -> Callable:
    """A tree-walk function (node_tokens, parents, target_tokens [B, 1+N], **kw) -> (path [B, P], length [B],
    bonus [B]) per device (:func:`per_device`): split on the batch, the same on every model device."""
    rows = ("batch", None)
    return per_device(fn, (rows, rows, rows), (rows, ("batch",), ("batch",)))


def _batch_specs(tree, rules: Rules):
    """shard_map specs splitting only the batch axis of every leaf (State layout, see _leaf_axes)."""
    return jax.tree.map_with_path(
        lambda p, x: P(*(rules.batch if a == "batch" else None for a in _leaf_axes(p, x))), tree
    )


def on_spec_mesh(batched: tuple[int, ...]) -> Callable:
    """Decorator for the jitted decode steps ``fn(spec, ...) -> State`` (``batched``: positions of the
    arguments that carry the batch; the first is the State, which the step returns updated).

    Without ``spec.mesh``: ``fn`` as is. With one: data parallelism is a ``shard_map`` over the data axis,
    so each data shard runs its own sequences with no communication at all (its own while-loop exit too);
    inside, tensor parallelism over the model axis is XLA's SPMD partitioning driven by the rules table.
    The returned State is pinned to its layout, so every call of the compiled step sees the same shardings.
    """

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapped(spec, *args):
            mesh = getattr(spec, "mesh", None)
            if mesh is None:
                return fn(spec, *args)
            rules = Rules()
            if axis_size(mesh, rules.batch) == 1:
                with use_mesh(mesh, rules):
                    return constrain_state(fn(spec, *args))
            local = dataclasses.replace(rules, batch=None)  # inside: the batch axis is manual (per shard)

            def body(*args):
                with use_mesh(mesh, local):
                    return constrain_state(fn(spec, *args))

            specs = tuple(
                _batch_specs(a, rules) if i + 1 in batched else jax.tree.map(lambda _: P(), a)
                for i, a in enumerate(args)
            )
            out = specs[batched[0] - 1]
            return jax.shard_map(_jit_body(body), mesh=mesh, in_specs=specs, out_specs=out, axis_names={rules.batch},
                                 check_vma=False)(*args)

        return wrapped

    return deco


# ---------------------------------------------------------------------------------------------- inspection

_COLLECTIVE = re.compile(
    r"= (?P<shapes>.+?) (?P<op>all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
)


def collectives(hlo_text: str) -> list[dict]:
    """The collectives of a compiled HLO module (``compiled.as_text()``), for tests and benchmarks: one
    {"op", "shapes": [(dtype, dims), ...], "dimensions": [...] (gathered/scattered axes), "source": op_name}
    per instruction. Collectives inside loop bodies are listed once."""
    out = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        shapes = [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in
                  re.findall(r"(\w+)\[([\d,]*)\]", m.group("shapes"))]
        dims = re.search(r"dimensions=\{([\d,]*)\}", line)
        src = re.search(r'op_name="([^"]*)"', line)
        out.append({
            "op": m.group("op"),
            "shapes": shapes,
            "dimensions": [int(d) for d in dims.group(1).split(",") if d] if dims else [],
            "source": src.group(1) if src else "",
        })
    return out
