"""The sparse Mixture-of-Experts MLP of Qwen3-MoE, as transformers' ``Qwen3MoeSparseMoeBlock`` computes it.

    logits  = x @ router                      [N, E] in x's dtype (the weights'), as PyTorch's Linear rounds them
    probs   = softmax(logits) in f32 over all E experts; the k largest (``lax.top_k``: ties to the lower id)
    weights = those k, divided by their sum when ``norm_topk_prob`` (computed as the softmax of the k largest logits)
    out     = sum over the k of weight * down(silu(gate x) * up x)      f32 [N, D]; no shared expert

The expert matrices are output-major (``params.LayerWeights``: ``experts_gate_up`` [E, 2F, D], gate rows first,
``experts_down`` [E, D, F]; transformers 5's in-memory layout), stacked over layers or not. No form multiplies a row by
an expert it is not routed to. Two forms, chosen by the (token, slot) pairs at trace time, the same math:

- gather (up to ``GATHER_MAX_PAIRS`` pairs, or ``Tuning.moe_gather_pairs``: AR steps at small batches): each pair's
  token times its expert's gate|up, and its swiglu output times its expert's down, as a batched GEMV that reads only
  the routed experts, in XLA's form (:func:`_gather_product`: the matrices taken inside a row reduction, f32 products
  summed over the contiguous input axis, which XLA fuses into one pass: ``model.linear``'s one-row form, per pair).
  A Pallas GEMV for it gained nothing and was removed: on an H200 (2026-12-06, benchmarks/results/moe_ar_ab_h200.json)
  a whole AR step of Qwen3-Coder-30B-A3B took 3.328 ms with XLA's form against 3.422 ms with the kernel (faster in 8
  of 8 interleaved pairs), and inside the step both read the routed experts at 3.0-3.2 TB/s.
- grouped (more pairs: trees, chains, prefill, batches): the pairs sorted by expert (a stable argsort of the flattened
  ids), group sizes by counting, the sorted rows through a grouped matmul for gate|up and one for down, each pair's
  result scaled by its weight and gathered back to its token (a gather, not a scatter-add: deterministic). The grouped
  matmul is ``pallas_kernels.grouped_matmul`` (each touched expert read once, the others never) with the layer kernels
  (a 'pallas*' attention and ``Tuning.grouped_matmul``: on GPU once :func:`kernel_works` passed, else interpreted),
  otherwise XLA's ``jax.lax.ragged_dot_general`` (exact, but it reads every expert: the fallback).

Stacked weights are read in place: the grouped kernel and the gather index the [L x E, ...] view of the whole stack at
layer x E + expert, so no layer's experts are sliced out (XLA copies a slice that a custom call reads).

Expert parallelism. Under a mesh whose model axis splits the experts (the sharding rule ``experts``), each device holds
E / M of them. The tokens are already on every model device (the residual stream is replicated over the model axis, as
for the dense MLP), so each device routes every token (the router is replicated), computes the pairs routed to its
own experts (the others are sorted past its groups and never computed; in the gather form their weight is 0), and
one all-reduce sums the partial outputs: the dense row-parallel MLP's collective, and no all-to-all. At decode sizes
the tokens are tiny next to the experts (257 tokens x 2048 values: 2 MB in f32 against 1.2 GB of one layer's
experts), so sending each token only to its experts' devices would save nothing worth a second collective.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from ddtree_jax import sharding
from ddtree_jax.config import ModelConfig
from ddtree_jax.params import LayerWeights
from ddtree_jax.tuning import Tuning
from pallas_kernels import grouped_matmul as gmm

Array = jax.Array

GATHER_MAX_PAIRS = 16  # (token, slot) pairs up to which the gather form runs by default (Tuning.moe_gather_pairs): 2
# tokens of Qwen3-Coder-30B-A3B's 8 experts, 8 of the fixture's 2


def route(x: Array, router: Array, k: int, norm: bool) -> tuple[Array, Array]:
    """x [N, D], router [D, E] -> (weights [N, k] f32, expert ids [N, k] int32), the k best first."""
    logits = jnp.einsum("nd,de->ne", x, router, preferred_element_type=jnp.float32)
    logits = logits.astype(x.dtype).astype(jnp.float32)  # rounded as PyTorch's Linear rounds them
    if norm:  # the softmax over all E renormalised over the k is the softmax over the k's logits: no pass over E
        top, ids = jax.lax.top_k(logits, k)  # exp is monotone: the same k, ties (equal logits) to the lower id
        return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    return weights, ids.astype(jnp.int32)


def _swiglu(gate_up: Array, dtype) -> Array:
    """[..., 2F] (gate | up) -> silu(gate) * up [..., F], gate and up rounded to ``dtype`` first (PyTorch's Linear)."""
    gate, up = jnp.split(gate_up.astype(dtype), 2, axis=-1)
    return (jax.nn.silu(gate) * up).astype(dtype)


def _gather_product(x: Array, w: Array, ids: Array, offset=0, out_dtype=None) -> Array:
    """The gather form's batched GEMV: x [P, D], w [W, N, D] (output-major), ids [P] int32 (offset + ids in
    0 .. W - 1), offset (may be traced) -> y [P, N] in ``out_dtype`` (default x's), y[p] = w[offset + ids[p]] x[p].
    Each pair's matrix is taken inside a row reduction over D (f32 products summed), which XLA fuses into one pass
    over the picked matrices; two pairs of one expert read it twice."""
    mats = jnp.take(w, offset + ids, axis=0).astype(jnp.float32)  # [P, N, D], fused into the reduction
    return jnp.sum(mats * x[:, None, :].astype(jnp.float32), axis=-1).astype(out_dtype or x.dtype)


def _gather_form(x: Array, ids: Array, gate_up: Array, down: Array, offset) -> Array:
    """x [N, D], ids [N, k] -> each pair's expert output f32 [N, k, D]: each pair's row times its expert offset + id of
    gate_up / down (the [G, 2F, D] / [G, D, F] views; :func:`_gather_product`)."""
    n, k = ids.shape
    flat = ids.reshape(-1)  # [N k]
    rows = jnp.broadcast_to(x[:, None, :], (n, k, x.shape[-1])).reshape(n * k, -1)  # each pair's token [N k, D]
    h = _swiglu(_gather_product(rows, gate_up, flat, offset, jnp.float32), x.dtype)  # [N k, F]
    return _gather_product(h, down, flat, offset, jnp.float32).reshape(n, k, -1)


def _grouped_form(x: Array, ids: Array, groups: int, gate_up: Array, down: Array, matmul) -> Array:
    """x [N, D], ids [N, k] in [0, groups] (``groups``: a pair computed nowhere) -> each pair's expert output f32
    [N, k, D] (0 for the uncomputed pairs). ``matmul(rows, w, sizes, out_dtype)``: a grouped matmul over the first
    ``groups`` groups of w."""
    n, k = ids.shape
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # [N k]: the pairs by expert
    sizes = jnp.zeros((groups + 1,), jnp.int32).at[flat].add(1)[:groups]
    rows = jnp.take(x, order // k, axis=0)  # [N k, D]
    h = _swiglu(matmul(rows, gate_up, sizes, x.dtype), x.dtype)  # [N k, F]
    y = matmul(h, down, sizes, jnp.float32)  # [N k, D], 0 past the groups
    back = jnp.zeros_like(order).at[order].set(jnp.arange(n * k, dtype=order.dtype), unique_indices=True)
    return jnp.take(y, back, axis=0).reshape(n, k, -1)


def _ragged(rows: Array, w: Array, sizes: Array, offset, out_dtype) -> Array:
    """XLA's grouped matmul of rows [R, K] by the groups offset .. offset + G - 1 of w [W, N, K] (output-major), sizes
    [G]: exact, but it reads every one of the G matrices (the layer's experts are sliced out first: a copy)."""
    w = jax.lax.dynamic_slice_in_dim(w, offset, sizes.shape[0])
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    return jax.lax.ragged_dot_general(rows, w, sizes, dims, preferred_element_type=jnp.float32).astype(out_dtype)


def grouped_matmul_fn(impl: str, x: Array, w: Array, tuning: Tuning = Tuning()):
    """The grouped matmul ``(rows, w, sizes, offset, out_dtype)`` for the attention implementation ``impl``:
    ``pallas_kernels.grouped_matmul`` with the layer kernels (a 'pallas*' attention), ``tuning.grouped_matmul`` on,
    on 16-bit weights the kernel takes, and on GPU once :func:`kernel_works` (with '-interpret': in the Pallas
    interpreter); else XLA's ragged dot."""
    if (impl.startswith("pallas") and tuning.grouped_matmul and gmm.supports(x, w)
            and (impl.endswith("-interpret") or kernel_works("grouped_matmul"))):
        interpret = impl.endswith("-interpret")

        def kernel(rows, mat, sizes, offset, out_dtype):
            return gmm.grouped_matmul(rows, mat, sizes, offset, out_dtype=out_dtype, interpret=interpret)

        return kernel
    return _ragged


@functools.lru_cache(maxsize=None)
def kernel_works(name: str) -> bool:
    """Whether the Pallas kernel ``name`` ('grouped_matmul') compiles here and matches its reference
    (:func:`kernel_mismatch`). Checked once per process and kernel, when a layer first asks; False: XLA's form, with a
    warning. A layer asks while it is traced, so the check runs on a thread of its own: jax's tracing state is per
    thread, and there the check's arrays are computed, not staged into the layer's program."""
    import concurrent.futures
    import warnings

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            problem = pool.submit(kernel_mismatch, name).result()
    except Exception as e:  # noqa: BLE001 - any failure means: do not use the kernel
        problem = str(e)
    if problem:
        warnings.warn(f"Pallas {name} unavailable here ({problem[:300]}): MoE layers use XLA's form instead")
    return not problem


def kernel_mismatch(name: str, interpret: bool = False) -> str | None:
    """Run the Pallas kernel ``name`` ('grouped_matmul') once on a bf16 problem and compare it with its reference: a
    description of the mismatch, or None. Ragged groups (empty ones, one over several tiles, rows past the groups) at
    an offset into the matrices. Not while tracing (see :func:`kernel_works`)."""
    import numpy as np

    if name != "grouped_matmul":
        raise ValueError(f"no Pallas MoE kernel {name!r}: expected 'grouped_matmul'")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(60, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(12, 128, 256)) / 16, jnp.bfloat16)
    sizes = jnp.asarray([3, 0, 0, 40, 1, 0, 7, 0], jnp.int32)
    run = jax.jit(functools.partial(gmm.grouped_matmul, out_dtype=jnp.float32, block_rows=16, interpret=interpret))
    got, want = run(x, w, sizes, jnp.int32(3)), gmm.reference(x, w, sizes, 3, jnp.float32)
    err, scale = float(jnp.max(jnp.abs(got - want))), float(jnp.max(jnp.abs(want)))
    return None if err < 2e-2 * scale else f"off by {err:.3g} from its reference (largest value {scale:.3g})"


_RECORDERS: list = []


@contextlib.contextmanager
def recording(sink: list):
    """While functions are traced in this block, every MoE layer they run appends its routed expert ids (numpy [N, k],
    in layer order) to ``sink`` when it executes (a host callback: for measuring which experts rounds touch, not for
    timed programs)."""
    _RECORDERS.append(sink)
    try:
        yield
    finally:
        _RECORDERS.pop()


def _experts(x: Array, router: Array, gate_up: Array, down: Array, offset, first, experts: int, cfg: ModelConfig,
             impl: str, tuning: Tuning) -> Array:
    """The block's output from the experts first .. first + experts - 1 alone (every expert without a mesh), whose
    matrices are gate_up [W, 2F, D] and down [W, D, F] at offset .. offset + experts - 1: x [N, D] -> f32 [N, D]."""
    weights, ids = route(x, router, cfg.experts_per_token, cfg.norm_topk_prob)
    if _RECORDERS:
        sink = _RECORDERS[-1]
        jax.debug.callback(sink.append, ids, ordered=True)
    local = ids - first
    mine = (local >= 0) & (local < experts)
    if ids.size <= (tuning.moe_gather_pairs or GATHER_MAX_PAIRS):
        y = _gather_form(x, jnp.clip(local, 0, experts - 1), gate_up, down, offset)
    else:
        matmul = grouped_matmul_fn(impl, x, gate_up, tuning)
        y = _grouped_form(x, jnp.where(mine, local, experts), experts, gate_up, down,
                          lambda rows, w, sizes, dtype: matmul(rows, w, sizes, offset, dtype))
    return jnp.sum(jnp.where(mine, weights, 0.0)[..., None] * y, axis=1)


def _flat(w: Array) -> Array:
    """[L, E, ...] -> [L x E, ...] (a free reshape)."""
    return w.reshape(-1, *w.shape[2:])


def block(x: Array, w: LayerWeights, cfg: ModelConfig, impl: str = "xla", stacked: LayerWeights | None = None,
          layer=None, tuning: Tuning = Tuning()) -> Array:
    """The sparse MoE MLP of one layer: x [B, T, D] (the normed residual, in the weights' dtype) -> f32 [B, T, D].
    w: the layer's weights (``router`` [D, E], ``experts_gate_up`` [E, 2F, D], ``experts_down`` [E, D, F]);
    ``stacked`` / ``layer``: every layer's weights ([L, E, ...]) and this layer's index (may be traced), whose experts
    are then read in place. ``impl`` (the attention implementation) and ``tuning`` pick the form and the grouped
    form's kernel (:func:`grouped_matmul_fn`). Expert parallel under a mesh whose model axis splits the experts
    (module doc)."""
    b, t, d = x.shape
    e = w.router.shape[-1]
    src = w if stacked is None else stacked
    act = sharding.active()
    axis = None if act is None else act[1].experts
    shards = 1 if act is None else sharding.axis_size(act[0], axis)

    def run(x, router, gate_up, down, layer, first, experts):
        if stacked is None:
            return _experts(x, router, gate_up, down, 0, first, experts, cfg, impl, tuning)
        return _experts(x, router, _flat(gate_up), _flat(down), layer * experts, first, experts, cfg, impl, tuning)

    layer = jnp.int32(0) if layer is None else layer
    if shards == 1:
        y = run(x.reshape(b * t, d), w.router, src.experts_gate_up, src.experts_down, layer, 0, e)
        return y.reshape(b, t, d)

    def part(x, router, gate_up, down, layer):  # one device: its E / M experts, every token
        mine = e // shards
        y = run(x.reshape(-1, d), router, gate_up, down, layer, jax.lax.axis_index(axis) * mine, mine)
        return jax.lax.psum(y.reshape(x.shape), axis)

    lead = () if stacked is None else (None,)
    tokens = ("batch", "seq", "embed")
    per_device = sharding.per_device(part, (tokens, (None, None), (*lead, "experts", "expert_mlp", "embed"),
                                            (*lead, "experts", "embed", "expert_mlp"), ()), tokens)
    return per_device(x, w.router, src.experts_gate_up, src.experts_down, layer)
