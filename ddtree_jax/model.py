"""The target transformer (Qwen3 and Llama) as pure functions: ``lax.scan`` over stacked layers.

One forward serves prefill chunks, autoregressive steps and DDTree verification: the T new tokens sit
at arbitrary positions, their K/V are written into the cache at slots ``cache.length ..`` (not yet
committed), and the attention sees the committed prefix plus the block slots allowed by a bit-packed
mask (causal for prefill/AR, ancestor-only for a tree). See ``pallas_kernels.tree_attention``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from ddtree_jax import cache as kvcache, moe, sharding
from ddtree_jax.config import ModelConfig
from ddtree_jax.params import LayerWeights, TargetParams, num_heads, unstack_layers
from ddtree_jax.sharding import constrain, per_device_attention
from ddtree_jax.tuning import Tuning
from pallas_kernels import add_norm, decode_attention, qkv_write, tree_attention as tree_attention_lib

Array = jax.Array


def rms_norm(x: Array, w: Array, eps: float) -> Array:
    """RMSNorm computed in f32, returned in the weight's dtype (the matmul operand dtype)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (w.astype(jnp.float32) * y).astype(w.dtype)


def rope_tables(cfg: ModelConfig, positions: Array) -> tuple[Array, Array]:
    """cos, sin [B, T, hd] (f32) for integer positions [B, T]."""
    inv = jnp.asarray(cfg.rope.inv_freq(cfg.head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: Array, cos: Array, sin: Array) -> Array:
    """x [B, T, heads, hd] rotated by cos/sin [B, T, hd]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


ATTENTION_IMPLS = ("xla", "pallas", "pallas-interpret", "pallas-inplace", "pallas-inplace-interpret")


def _layer_kernels(impl: str) -> bool:
    """Whether ``impl`` takes the layer kernels that run on one device only (qkv_write, add_norm): 'pallas-inplace'
    (on GPU or interpreted) without a mesh."""
    return impl.startswith("pallas-inplace") and sharding.active() is None


def decode_attention_applies(q: Array, k: Array, tuning: Tuning = Tuning()) -> bool:
    """Whether 'pallas-inplace' attention of q [B, T, H, hd] over the stacked cache k takes
    ``pallas_kernels.decode_attention`` (one row per sequence, an AR step; per device under a mesh, as the tree
    kernel) instead of the tree kernel: T = 1, batch x cache slots at most ``decode_attention.MAX_KEYS``, and
    ``tuning.decode_attention``."""
    return (decode_attention.supports(q, k) and q.shape[0] * k.shape[-3] <= decode_attention.MAX_KEYS
            and tuning.decode_attention)


def attention_fn(impl: str, tuning: Tuning = Tuning()):
    """The tree attention implementation ``attend(q, k, v, prefix_len, tree_bits, layer=None, **kw)``: 'xla' (the
    jnp reference), 'pallas' (the kernel), 'pallas-inplace' (the kernel reading the layer's K/V in place from the
    stacked cache; one-row steps by ``pallas_kernels.decode_attention``, see :func:`decode_attention_applies`), each
    '-interpret' in the Pallas interpreters. With ``layer``, k and v are the stacked
    cache [L, B, S, K, hd]: 'pallas' slices it (XLA copies a slice for a custom call), the others do not."""
    if impl == "xla":
        reference = tree_attention_lib.tree_attention_reference
        one_cpu = jax.default_backend() == "cpu" and sharding.active() is None
        return live_spans(reference) if tuning.live_spans and one_cpu else reference
    if impl in ATTENTION_IMPLS:  # per device under shard_map when a mesh is active
        interpret = impl.endswith("-interpret")
        kernel = functools.partial(tree_attention_lib.tree_attention, interpret=interpret)
        sharded = per_device_attention(kernel)
        in_place = per_device_attention(kernel, stacked=True) if impl.startswith("pallas-inplace") else None
        one_row = per_device_attention(functools.partial(decode_attention.decode_attention, interpret=interpret),
                                       stacked=True)

        def attend(q, k, v, prefix_len, tree_bits, layer=None, **kw):
            # The kernel takes 16-bit floats and head_dim 64/128; anything else (e.g. an f32 model on
            # GPU) takes the reference path, decided at trace time from the static dtype and shape.
            # Only the in-place tree kernel takes q packed and the mask made for it (layer_mask); others unpack.
            mask, bits = tree_bits, getattr(tree_bits, "tree_bits", tree_bits)
            if isinstance(q, tree_attention_lib.PackedQ) and (in_place is None or layer is None or kw):
                q = q.unpack()
            if not tree_attention_lib.supports(q, k) or kw:
                return tree_attention_lib.tree_attention_reference(q, k, v, prefix_len, bits, layer=layer, **kw)
            if layer is None:
                return sharded(q, k, v, prefix_len, bits)
            if in_place is not None:
                if decode_attention_applies(q, k, tuning):
                    return one_row(q, k, v, prefix_len, bits, layer)
                return in_place(q, k, v, prefix_len, mask, layer)
            return sharded(q, k[layer], v[layer], prefix_len, bits)

        return attend
    raise ValueError(f"unknown attention implementation {impl!r}")


SPAN_MIN = 128  # the smallest key span of live_spans


def key_spans(capacity: int) -> tuple[int, ...]:
    """The static key spans of :func:`live_spans`: SPAN_MIN, 2 SPAN_MIN, 4 SPAN_MIN, ... below ``capacity``, then
    ``capacity``."""
    spans = []
    while (span := SPAN_MIN << len(spans)) < capacity:
        spans.append(span)
    return (*spans, capacity)


def live_spans(attend):
    """``attend`` (the reference) over the stacked cache's first s slots only, s the smallest of :func:`key_spans`
    holding every sequence's prefix and block (``lax.switch`` on max(prefix_len) + T, one branch a span). The
    reference reads every slot of the cache, however few are live: on 2 CPU cores an AR step of SmolLM2-135M costs
    20 ms without attention and 24, 36 or 57 ms with it at 192, 1088 or 4160 slots
    (benchmarks/results/cpu_attention_spans.md). Slots past the span are invisible to every query (softmax terms of
    exactly 0), so the result is the reference's. Used on one CPU device only (``Tuning.live_spans``): a GPU runtime
    reads a conditional's predicate on the host (a synchronisation a layer), and the GPU kernels read the live prefix
    only anyway; on a mesh the batch's longest sequence would take a collective a layer. Calls without ``layer``, or
    with the reference's keywords, run it whole."""

    def run(q, k, v, prefix_len, tree_bits, layer=None, **kw):
        spans = key_spans(k.shape[-3])
        if layer is None or kw or len(spans) == 1:
            return attend(q, k, v, prefix_len, tree_bits, layer=layer, **kw)

        def over(span):
            def branch(q, k, v, prefix_len, tree_bits, layer):
                size = (1, k.shape[1], span, *k.shape[3:])
                k_span = jax.lax.dynamic_slice(k, (layer, 0, 0, 0, 0), size)[0]
                v_span = jax.lax.dynamic_slice(v, (layer, 0, 0, 0, 0), size)[0]
                return attend(q, k_span, v_span, prefix_len, tree_bits)

            return branch

        need = jnp.max(prefix_len) + q.shape[1]  # slots a query may see: the prefix and the block
        index = jnp.sum(jnp.asarray(spans[:-1]) < need)  # the first span >= need (the capacity always holds it)
        return jax.lax.switch(index, [over(span) for span in spans], q, k, v, prefix_len, tree_bits, layer)

    return run


def linear(x: Array, w: Array, spec: str, output_major: bool = False, out_dtype=None, splits: int = 1) -> Array:
    """``jnp.einsum(spec, x, w)`` for input-major weights, e.g. "btd,dhk->bthk" (w [D, H, hd]); output-major
    weights (``params.output_major``) hold w's output axes first ([H, hd, D]), and the spec is read that way.
    The result is in ``out_dtype`` (default x's dtype), accumulated in f32. ``splits`` > 1 (one contracted axis, a
    multiple of it): the product split over that axis into as many products of its slices, one batched GEMM, whose
    partial sums come back unsummed, [splits, *result] (split-K by hand; ``add_norm`` adds them up).

    One row of x against output-major weights (an autoregressive step at batch 1) is a row reduction: f32
    products summed over the contiguous input axes, which XLA fuses into one read of the weights at GEMV
    bandwidth (an H200: 3.9 TB/s, against 2.2 TB/s for its one-row GEMM). Anything else is a GEMM."""
    xs, rest = spec.split(",")
    ws, ys = rest.split("->")
    ins, outs = "".join(c for c in ws if c in xs), "".join(c for c in ws if c not in xs)
    if splits > 1:  # the contracted axis c as (s, c / s): "btf,fd->btd" becomes "btsf,sfd->sbtd"
        if len(ins) != 1 or x.shape[-1] % splits or xs[-1] != ins:
            raise ValueError(f"linear splits one contracted last axis of x, divisible by {splits}: {spec} {x.shape}")
        c = x.shape[-1]
        xw = x.reshape(*x.shape[:-1], splits, c // splits)
        if output_major:  # [outs..., c]
            wv, w_spec = w.reshape(*w.shape[: len(outs)], splits, c // splits), f"{outs}S{ins}"
        else:  # [c, outs...]
            wv, w_spec = w.reshape(splits, c // splits, *w.shape[1:]), f"S{ins}{outs}"
        return jnp.einsum(f"{xs[:-1]}S{ins},{w_spec}->S{ys}", xw, wv, preferred_element_type=out_dtype)
    if not output_major:
        return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)
    lead = x.shape[: x.ndim - len(ins)]
    if math.prod(lead) == 1:
        out_shape, k = w.shape[: len(outs)], math.prod(w.shape[len(outs):])
        y = jnp.sum(w.reshape(-1, k).astype(jnp.float32) * x.reshape(1, k).astype(jnp.float32), axis=-1)
        return y.reshape(*lead, *out_shape).astype(out_dtype or x.dtype)
    return jnp.einsum(f"{xs},{outs + ins}->{ys}", x, w, preferred_element_type=out_dtype)


def mlp(x: Array, w: LayerWeights, down_splits: int = 1) -> Array:
    """SwiGLU; x [B, T, D] in the weights' dtype, f32 result. gate and up come out of their product in x's dtype, as
    PyTorch's Linear gives them (accumulated in f32, rounded once): the SiLU product then reads half the bytes of f32.
    ``down_splits`` > 1: the down projection's partial sums [down_splits, B, T, D] (:func:`linear`'s splits;
    :func:`product_splits` says when)."""
    om = w.output_major
    if w.fused:  # one product for both (params.fuse_projections)
        gate, up = jnp.split(linear(x, w.w_gate, "btd,df->btf", om, x.dtype), 2, axis=-1)
    else:
        gate, up = (linear(x, m, "btd,df->btf", om, x.dtype) for m in (w.w_gate, w.w_up))
    h = constrain((jax.nn.silu(gate) * up).astype(x.dtype), ("batch", "seq", "mlp"))
    return linear(h, w.w_down, "btf,fd->btd", om, jnp.float32, splits=down_splits)


def output_projection(o: Array, w: LayerWeights, splits: int = 1) -> Array:
    """The attention's output projection: o [B, T, H, hd] -> f32 [B, T, D], or with ``splits`` > 1 its partial sums
    [splits, B, T, D] over as many groups of heads (o and wo viewed with H x hd as one axis, which :func:`linear`
    splits; free reshapes of both layouts)."""
    if splits == 1:
        return linear(o, w.wo, "bthk,hkd->btd", w.output_major, jnp.float32)
    b, t, h, hd = o.shape
    wo = w.wo.reshape(-1, h * hd) if w.output_major else w.wo.reshape(h * hd, -1)  # [D, H x hd] or [H x hd, D]
    return linear(o.reshape(b, t, h * hd), wo, "btf,fd->btd", w.output_major, jnp.float32, splits=splits)


SPLIT_ROWS = (128, 384)  # rows (B x T) at which the verify splits the products add_norm adds up (read when traced)
NARROW_SPLIT_ROWS = (16, 384)  # the same for outputs at most NARROW_WIDTH wide
NARROW_WIDTH = 2560  # Qwen3-4B's hidden size
DOWN_SPLITS = 2  # the MLP's down projection into this many partial products (1: not split)
O_SPLITS = 2  # the attention's output projection likewise


def product_splits(impl: str, rows: int, depth: int, width: int, wanted: int, tuning: Tuning = Tuning()) -> int:
    """How many partial products :func:`forward` splits a product of contracted depth ``depth`` and ``width`` output
    columns that ``add_norm`` adds up (the MLP's down projection, ``DOWN_SPLITS``; the attention's output projection,
    ``O_SPLITS``) into: ``wanted`` where ``add_norm`` (the layer kernels, :func:`residual_norm`) runs and B x T is
    within ``SPLIT_ROWS`` (``NARROW_SPLIT_ROWS`` up to ``NARROW_WIDTH`` columns) and ``wanted`` divides the depth,
    else 1. cuBLAS reads two half-depth products faster than one where the rows are too few to fill the GPU: from
    128 rows for Qwen3-8B's 4096 columns, from 16 for Qwen3-4B's 2560 (docs/PERFORMANCE.md); narrower models (the
    default pair's 576 columns) take the narrow rule, untimed."""
    lo, hi = NARROW_SPLIT_ROWS if width <= NARROW_WIDTH else SPLIT_ROWS
    ok = _layer_kernels(impl) and tuning.add_norm and lo <= rows <= hi and depth % wanted == 0
    return wanted if ok and wanted > 1 else 1


def qkv(x: Array, w: LayerWeights, eps: float, cos: Array, sin: Array) -> tuple[Array, Array, Array]:
    """Project x [B, T, D] to q [B, T, H, hd], k, v [B, T, K, hd] with optional q/k norm and RoPE."""
    if w.fused:  # one product for the three (params.fuse_projections): [B, T, H + 2K, hd]
        heads = num_heads(w)
        qkv_ = linear(x, w.wq, "btd,dhk->bthk", w.output_major)
        kv = (qkv_.shape[2] - heads) // 2
        q, k, v = jnp.split(qkv_, [heads, heads + kv], axis=2)
    else:
        q, k, v = (linear(x, m, "btd,dhk->bthk", w.output_major) for m in (w.wq, w.wk, w.wv))
    if w.q_norm is not None:
        q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def residual_norm(x: Array, delta: Array, w: Array, eps: float, impl: str = "xla",
                  stacked: tuple[Array, Array, Array] | None = None, tap: tuple[Array, Array, Array] | None = None,
                  tuning: Tuning = Tuning()):
    """(x + delta, :func:`rms_norm` of it): the residual add and the norm after it, f32 x and delta [..., D] (or
    partial sums [P, ..., D], added up first: :func:`product_splits`). With
    'pallas-inplace' attention on one device (no mesh) and ``tuning.add_norm``, one kernel
    (``pallas_kernels.add_norm``: the same math, its mean square summed in its own order). ``stacked``: (every
    layer's weights [L, D], the layer, the prefix lengths [B]), which the kernel reads in place instead of w (the
    layer's row of them), so that XLA needs no slice kernel for it. ``tap``: (taps [S, ..., D], slots [L] int32, the
    layer): the sum is also written, in taps' dtype, at taps[slots[layer]], and the taps are returned third (by the
    kernel where it reads ``stacked``, else by an update of their own)."""
    if _layer_kernels(impl) and x.dtype == jnp.float32 and tuning.add_norm:
        kw = dict(eps=eps, interpret=impl.endswith("-interpret"))
        if stacked is not None and tap is not None:
            return add_norm.add_norm(x, delta.astype(jnp.float32), *stacked, tap=tap[:2], **kw)
        x, h = add_norm.add_norm(x, delta.astype(jnp.float32), *(stacked or (w,)), **kw)
    else:
        x = x + add_norm.sum_parts(delta, x.ndim)
        h = rms_norm(x, w, eps)
    if tap is None:
        return x, h
    taps, slots, layer = tap
    return x, h, jax.lax.dynamic_update_index_in_dim(taps, x.astype(taps.dtype), slots[layer], 0)


def qkv_kernel_applies(impl: str, w: LayerWeights, x: Array, k_all: Array, tuning: Tuning = Tuning()) -> bool:
    """Whether :func:`attention_inputs` uses the ``pallas_kernels.qkv_write`` kernel: with the attention reading the
    stacked cache in place ('pallas-inplace', on GPU or interpreted), fused q|k|v weights, 16-bit floats, one device
    (no mesh), and ``tuning.qkv_write``."""
    return (_layer_kernels(impl) and w.fused and x.dtype == k_all.dtype and qkv_write.supports(x.dtype, k_all.shape[-1])
            and tuning.qkv_write)


def layer_mask(impl: str, tree_bits: Array, prefix_len: Array, heads: int, k_all: Array, tuning: Tuning = Tuning()):
    """What a layer loop passes its attention (:func:`attention_fn`) as the mask: where the in-place tree kernel will
    run on one device (:func:`_layer_kernels`, a 16-bit cache, T > 1 or no ``decode_attention``) a
    ``tree_attention.KernelMask``, its operand made here, once for every layer; else tree_bits [B, T, W] as given.
    heads: H; k_all: the stacked cache [L, B, S, K, hd]."""
    b, t, _ = tree_bits.shape
    if not (_layer_kernels(impl) and _tree_kernel_reads(b, t, heads, k_all, tuning)):
        return tree_bits
    return tree_attention_lib.kernel_mask(tree_bits, prefix_len, (b, t, heads, k_all.shape[-1]), k_all.shape)


def _tree_kernel_reads(b: int, t: int, heads: int, k_all: Array, tuning: Tuning) -> bool:
    """Whether the in-place attention gives q [B, T, H, hd] in the cache's dtype to the tree kernel (not to
    ``decode_attention``, nor, for shapes the kernel does not take, to the reference); k_all [L, B, S, K, hd]."""
    q_like = jax.ShapeDtypeStruct((b, t, heads, k_all.shape[-1]), k_all.dtype)
    return tree_attention_lib.supports(q_like, k_all) and not decode_attention_applies(q_like, k_all, tuning)


def attention_inputs(x: Array, w: LayerWeights, eps: float, cos: Array, sin: Array, k_all: Array, v_all: Array,
                     layer: Array, start: Array, impl: str = "xla",
                     stacked: LayerWeights | None = None, tuning: Tuning = Tuning()) -> tuple[Array, Array, Array]:
    """A layer's attention inputs: q [B, T, H, hd] and the stacked caches k_all, v_all [L, B, S, K, hd] with the
    layer's k and v written at slots start[b] + t (:func:`qkv` then ``cache.write_layer``). Where
    :func:`qkv_kernel_applies`, the norms, RoPE and both writes are one kernel (``pallas_kernels.qkv_write``: the
    same math, rounded after each operation; XLA's form may differ in a value's last bit), which reads the q/k norm
    weights of ``stacked`` (every layer's weights, if given) in place at ``layer`` instead of w's, and, where the
    tree kernel will read q (T > 1 or no ``decode_attention``), writes q in that kernel's row layout
    (a ``tree_attention.PackedQ``, which :func:`attention_fn`'s other paths unpack)."""
    if qkv_kernel_applies(impl, w, x, k_all, tuning):
        qkv_ = linear(x, w.wq, "btd,dhk->bthk", w.output_major)  # [B, T, H + 2K, hd]
        norms = stacked if stacked is not None else w
        b, t, heads, hd = x.shape[0], x.shape[1], num_heads(w), qkv_.shape[-1]
        rows = None  # (the kernel writes q in x's dtype, which is the cache's, at the cache's hd)
        if _tree_kernel_reads(b, t, heads, k_all, tuning):
            rows = tree_attention_lib.packed_rows(b, t, heads, k_all.shape[-2], k_all.shape[-3], hd)
        return qkv_write.qkv_write(qkv_, norms.q_norm, norms.k_norm, cos, sin, k_all, v_all, layer, start,
                                   heads=heads, eps=eps, interpret=impl.endswith("-interpret"), q_rows=rows)
    q, k, v = qkv(x, w, eps, cos, sin)
    return q, kvcache.write_layer(k_all, layer, k, start), kvcache.write_layer(v_all, layer, v, start)


def forward(
    params: TargetParams,
    cfg: ModelConfig,
    tokens: Array,
    positions: Array,
    cache: kvcache.KVCache,
    tree_bits: Array,
    *,
    taps: tuple[int, ...] = (),
    attention: str = "xla",
    unroll: int = 1,
    tuning: Tuning = Tuning(),
) -> tuple[Array, kvcache.KVCache, Array | None]:
    """Run the target over T new tokens per sequence.

    tokens, positions [B, T] int32; tree_bits [B, T, ceil(T/32)] uint32 (block visibility, see
    pallas_kernels.tree_attention). Returns (hidden [B, T, D] after the final norm, the cache with the
    block's K/V written at slots cache.length .. cache.length + T - 1 (length unchanged), and the tapped
    hidden states [B, T, len(taps) * D] or None). ``taps`` are transformers' layer ids: tap i reads
    hidden_states[i + 1], the output of decoder layer i (the last layer's is taken after the final norm).
    ``attention`` picks the attention implementation (:func:`attention_fn`); ``unroll`` layers run per iteration
    of the layer loop (``lax.scan``'s unroll); ``tuning`` says which layer kernels run. None changes the math.
    """
    attend = attention_fn(attention, tuning)
    if not isinstance(params.layers, (tuple, list)) and params.layers.sparse_pattern:
        params = unstack_layers(params)  # dense and sparse MLPs mixed: an unrolled loop (params module doc)
    b, t = tokens.shape
    if params.one_row is not None:  # both layouts held: a one-row forward reads the output-major copy
        params = dataclasses.replace(params, layers=params.one_row if b * t == 1 else params.layers, one_row=None)
    # The residual stream stays in f32; matmul operands are in the weights' dtype.
    x = constrain(jnp.take(params.embed, tokens, axis=0).astype(jnp.float32), ("batch", "seq", "embed"))
    cos, sin = rope_tables(cfg, positions)
    start = cache.length
    n_taps = len(taps)
    # Layer i's output is the sum its successor's first norm makes: there it is tapped, at the slot of layer i - 1.
    # n_taps = "not tapped": a spare slot, written and never read (so every layer writes; no predicate).
    prev_slot = [n_taps] * cfg.num_layers
    for j, layer in enumerate(taps):
        if layer + 1 < cfg.num_layers:  # the last layer's output is taken after the final norm
            prev_slot[layer + 1] = j
    prev_slot = jnp.asarray(prev_slot, jnp.int32)

    eps = cfg.rms_norm_eps

    stacked = None if isinstance(params.layers, (tuple, list)) else params.layers  # the kernels read norms in place
    mask = layer_mask(attention, tree_bits, start, cfg.num_heads, cache.k, tuning)

    def layer(carry, inputs):
        x, delta, k_all, v_all, tapped = carry  # the residual stream is x + delta: the MLP's output is added by the
        w, i = inputs  # next norm (residual_norm)

        def at(name):  # a norm weight of every layer, which the kernel reads at layer i
            return None if stacked is None else (getattr(stacked, name), i, start)

        if n_taps:  # the previous layer's output is this sum
            x, h, tapped = residual_norm(x, delta, w.attn_norm, eps, attention, at("attn_norm"),
                                         tap=(tapped, prev_slot, i), tuning=tuning)
        else:
            x, h = residual_norm(x, delta, w.attn_norm, eps, attention, at("attn_norm"), tuning=tuning)
        q, k_all, v_all = attention_inputs(h, w, eps, cos, sin, k_all, v_all, i, start, attention, stacked, tuning)
        o = attend(q, k_all, v_all, start, mask, layer=i)  # [B, T, H, hd]
        x, h = residual_norm(x, output_projection(o, w, o_splits), w.mlp_norm, eps, attention, at("mlp_norm"),
                             tuning=tuning)
        x = constrain(x, ("batch", "seq", "embed"))
        if w.router is None:
            delta = mlp(h, w, splits)  # [B, T, D] or its partial sums [splits, B, T, D] (one device only)
        else:  # the sparse MoE MLP, its experts read in place from the stack
            delta = moe.block(h, w, cfg, attention, stacked, i, tuning)
        delta = constrain(delta, ("batch", "seq", "embed")) if splits == 1 else delta
        return (x, delta, k_all, v_all, tapped), None

    # [taps + 1, B, T, D] in the final norm's dtype (the features' dtype: one rounding, as when cast at the end)
    tapped = jnp.zeros((n_taps + 1, b, t, cfg.hidden_size), params.final_norm.dtype) if n_taps else None
    splits = 1 if cfg.num_experts else product_splits(attention, b * t, cfg.intermediate_size, cfg.hidden_size,
                                                       DOWN_SPLITS, tuning)
    o_splits = product_splits(attention, b * t, cfg.num_heads * cfg.head_dim, cfg.hidden_size, O_SPLITS, tuning)
    delta = jnp.zeros(x.shape if splits == 1 else (splits, *x.shape), x.dtype)  # zeros_like would copy x's sharding
    carry = (x, delta, cache.k, cache.v, tapped)
    if isinstance(params.layers, (tuple, list)):  # unstacked (params.unstack_layers): an unrolled loop
        for i, w in enumerate(params.layers):
            carry, _ = layer(carry, (w, i))
    else:
        carry, _ = jax.lax.scan(layer, carry, (params.layers, jnp.arange(cfg.num_layers)), unroll=unroll)
    x, delta, k_all, v_all, tapped = carry
    _, x = residual_norm(x, delta, params.final_norm, eps, attention, tuning=tuning)
    features = None
    if n_taps:
        tapped = tapped[:n_taps].astype(x.dtype)
        if cfg.num_layers - 1 in taps:  # hidden_states[L] is reported after the final norm
            tapped = tapped.at[taps.index(cfg.num_layers - 1)].set(x)
        features = jnp.concatenate(list(tapped), axis=-1)
    return x, kvcache.KVCache(k_all, v_all, cache.length), features


def logits(params: TargetParams, hidden: Array) -> Array:
    """[..., D] -> [..., V] float32."""
    om = params.lm_head is None or params.output_major  # a [V, D] head: the tied embedding, or output-major
    if params.head_copy and math.prod(hidden.shape[:-1]) > 1:  # CPU: several rows read the bf16 embedding (13%
        out = linear(hidden, params.embed, "...d,dv->...v", True, jnp.float32)  # faster rounds than the f32 copy)
    else:
        out = linear(hidden, params.head_output_major() if om else params.lm_head, "...d,dv->...v", om, jnp.float32)
    return constrain(out, (("batch",) + (None,) * (out.ndim - 2))[: out.ndim - 1] + ("vocab",))
