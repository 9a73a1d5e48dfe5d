"""Attention of one new token per sequence (an autoregressive step) in a Pallas (Triton) kernel, split over keys.

``tree_attention``'s semantics for T = 1: the token sees the cache's slots [0, prefix_len) and, where bit 0 of its
mask row is set (always, for an AR step: a node sees itself), its own slot prefix_len. The Mosaic GPU tree kernel
pads the G = H / K query heads of a KV head to its 64-row tiles, and with the pad before it and the combine after it
an AR step's attention is three kernels of about 8 µs together per layer on an H200 (Qwen3-4B, prompt 512;
benchmarks/PERF.md, seventeenth run). Here: a grid of (sequence x KV head, split); each program takes the G query rows
(padded to 16, the smallest dot), walks its share of the visible slots in blocks of 64 with an online softmax, and
writes its partial (accumulator, running max, running sum); XLA combines the splits (two small kernels in that
profile).

Shapes: q [B, 1, H, hd] (16-bit float), k, v the stacked caches [L, B, S, K, hd] read in place at ``layer``,
prefix_len [B] int32, tree_bits [B, 1, W] uint32 -> [B, 1, H, hd] in q's dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_BLOCK = 64  # keys per step
_MIN_ROWS = 16  # the smallest M of a Triton dot


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# batch x cache slots up to which it was measured faster than the tree kernel (H200, Qwen3-8B heads: batch 1 at 8.5k
# slots 14.3 against 17.0 µs, at 33k 45.0 against 42.7; batch 8 at 832 slots 10.6 against 13.3, at 2.4k 32.1 against
# 29.1; benchmarks/PERF.md, seventeenth run)
MAX_KEYS = 16384


def default_splits(slots: int) -> int:
    """Programs per (sequence, KV head): one per 64 slots of the cache (one block of keys each), 2 to 32."""
    return max(2, min(32, slots // _BLOCK))


def supports(q, k) -> bool:
    """One query row, 16-bit floats, a power-of-two head_dim of at least 16, whole GQA groups (k: [..., S, K, hd])."""
    return (q.ndim == 4 and q.shape[1] == 1 and q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype
            and q.shape[-1] >= 16 and q.shape[-1] & (q.shape[-1] - 1) == 0 and q.shape[2] % k.shape[-2] == 0)


def _kernel(q_ref, k_ref, v_ref, lens_ref, bits_ref, o_ref, m_ref, l_ref, *, batch: int, kv: int, g: int, gp: int,
            hd: int, splits: int, scale: float):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    bk, sp = pl.program_id(0), pl.program_id(1)
    b, kh = bk // kv, bk % kv
    layer = pltriton.load(lens_ref.at[jnp.int32(batch)])  # lens = [prefix_len (B), layer]: qkv_write's operand too
    n = pltriton.load(lens_ref.at[b]) + (pltriton.load(bits_ref.at[b, jnp.int32(0)]) & 1)  # visible slots [0, n)
    per = (n + splits * _BLOCK - 1) // (splits * _BLOCK) * _BLOCK  # slots per split, whole blocks
    lo = sp * per
    hi = jnp.minimum(lo + per, n)
    d = jnp.arange(hd, dtype=jnp.int32)[None, :]
    rows = jnp.arange(gp, dtype=jnp.int32)[:, None]
    q = pltriton.load(q_ref.at[b, 0, kh * g + rows, d], mask=rows < g, other=0)  # [gp, hd]

    def step(i, carry):
        m, l, acc = carry
        idx = lo + i * _BLOCK + jnp.arange(_BLOCK, dtype=jnp.int32)[:, None]  # [BLOCK, 1]
        ok = idx < hi
        k = pltriton.load(k_ref.at[layer, b, idx, kh, d], mask=ok, other=0)  # [BLOCK, hd]
        v = pltriton.load(v_ref.at[layer, b, idx, kh, d], mask=ok, other=0)  # issued with k's: one wait for both
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        s = jnp.where(ok[:, 0][None, :], s, -jnp.inf)  # [gp, BLOCK]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    blocks = (jnp.maximum(hi - lo, 0) + _BLOCK - 1) // _BLOCK
    init = (jnp.full((gp,), -jnp.inf, jnp.float32), jnp.zeros((gp,), jnp.float32), jnp.zeros((gp, hd), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, blocks, step, init)
    pltriton.store(o_ref.at[bk, sp, rows, d], acc)
    pltriton.store(m_ref.at[bk, sp, rows[:, 0]], m)
    pltriton.store(l_ref.at[bk, sp, rows[:, 0]], l)


@functools.partial(jax.jit, static_argnames=("scale", "splits", "interpret"))
def decode_attention(q, k, v, prefix_len, tree_bits, layer, *, scale: float | None = None, splits: int | None = None,
                     interpret: bool = False):
    """See the module doc. ``splits``: programs per (sequence, KV head) (default :func:`default_splits`);
    ``interpret``: the Pallas interpreter (CPU)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    b, t, h, hd = q.shape
    s, kv = k.shape[2], k.shape[3]
    if not supports(q, k) or k.ndim != 5 or k.shape[1] != b or v.shape != k.shape:
        raise ValueError(f"decode_attention takes q [B, 1, H, hd] and stacked caches [L, B, S, K, hd] of its 16-bit "
                         f"dtype, got q {q.shape} {q.dtype}, k {k.shape} {k.dtype}")
    g = h // kv
    gp = max(_MIN_ROWS, _pow2(g))
    splits = splits or default_splits(s)
    scale = hd**-0.5 if scale is None else scale
    lens = jnp.concatenate([prefix_len.astype(jnp.int32), jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))])
    acc, m, l = pl.pallas_call(
        functools.partial(_kernel, batch=b, kv=kv, g=g, gp=gp, hd=hd, splits=splits, scale=float(scale)),
        grid=(b * kv, splits),
        out_shape=(jax.ShapeDtypeStruct((b * kv, splits, gp, hd), jnp.float32),
                   jax.ShapeDtypeStruct((b * kv, splits, gp), jnp.float32),
                   jax.ShapeDtypeStruct((b * kv, splits, gp), jnp.float32)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
        name="decode_attention",
    )(q, k, v, lens, jax.lax.bitcast_convert_type(tree_bits.reshape(b, -1), jnp.int32))
    top = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - top)  # splits with no slots: m = -inf, weight 0
    out = jnp.sum(w[..., None] * acc, axis=1) / jnp.sum(w * l, axis=1)[..., None]  # [B * K, gp, hd]
    return out[:, :g].reshape(b, 1, h, hd).astype(q.dtype)
