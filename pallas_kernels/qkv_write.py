"""A layer's attention inputs in one Pallas (Triton) kernel: q/k RMSNorm, RoPE, and the K/V cache write.

After a layer's fused q|k|v projection, XLA's form (``model.qkv`` then ``cache.write_layer`` twice) is five or six
small kernels per layer: the q norm with RoPE, the k norm with RoPE, the two cache writes (scatters, with a read and
select of the old slot for rows past the cache) and a slice; this kernel takes about 60% of their time on an H200
(docs/KERNELS.md). Programs (sequence x row, 8 heads each: Qwen3's 32 + 8 + 8 heads of a token in 6) read their heads
of the row's q|k|v, normalise and rotate q and k, and write q, or store k or v into the stacked caches in place (the
caches are aliased to the outputs: no copy, the other slots untouched). Used by ``ddtree_jax.model.attention_inputs``
in the target's and drafter's layer loops (where ``model.qkv_kernel_applies``).

Semantics (``reference``): exactly the math of ``model.qkv`` + ``cache.write_layer`` with each operation rounded to
the cache's 16-bit float type as written there (and as PyTorch computes it): n = round(w * (x * rsqrt(mean(x^2) +
eps))), then round(round(n * round(cos)) + round(rotate_half(n) * round(sin))). XLA may keep f32 between those
operations (its excess-precision default), so the two forms can differ in the last bit of a value.

Shapes (H query heads, K key/value heads, hd a power of two):
    qkv [B, T, H + 2K, hd] (rows q heads, then k, then v), q_norm / k_norm [hd], or every layer's [L, hd] (the
    kernel reads row ``layer`` in place: no slice kernel), or None, cos / sin [B, T, hd] f32,
    k_all / v_all [L, B, S, K, hd], layer int32 scalar, start [B] int32
    -> q [B, T, H, hd] (or packed for the tree kernel: ``q_rows``), and k_all / v_all with layer ``layer``'s slots
       start[b] + t written (slots >= S dropped)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.lengths import lengths
from pallas_kernels.tree_attention import PackedQ

_ROWS = 8  # heads per program (a power of two): Qwen3-8B's 32 + 8 + 8 heads of a token in 6 programs


def supports(dtype, head_dim: int) -> bool:
    """Whether the kernel takes q|k|v and caches of ``dtype`` (16-bit floats) and ``head_dim`` (a power of two)."""
    return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim >= 16 and head_dim & (head_dim - 1) == 0


def _norm_rope(x, xr, w, wr, c, s, sign, dtype, eps, normed: bool):
    """x [n, hd] f32 (raw), xr its rotate-half partner columns; w / wr the norm weight at those columns (f32);
    -> the normed, rotated rows in ``dtype`` (per-operation rounding, see the module doc)."""
    rnd = lambda a: a.astype(dtype).astype(jnp.float32)  # noqa: E731
    if normed:
        r = jax.lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True) + eps)
        x, xr = rnd(w * (x * r)), rnd(wr * (xr * r))
    return rnd(rnd(x * c) + rnd(sign * xr * s)).astype(dtype)


def _kernel(qkv_ref, qn_ref, kn_ref, cos_ref, sin_ref, lens_ref, k_in, v_in, q_ref, k_ref, v_ref, *,
            batch: int, t: int, h: int, kv: int, hd: int, slots: int, eps: float, normed: bool, stacked: bool,
            rows: int, packed: bool):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    del k_in, v_in  # aliased to k_ref, v_ref
    r, j = pl.program_id(0), pl.program_id(1)  # (sequence, row) and which ``rows`` heads: q's, then k's, then v's
    b, row = r // t, r % t
    nq, nk = -(-h // rows), -(-kv // rows)
    dtype = q_ref.dtype
    d = jnp.arange(hd, dtype=jnp.int32)
    half = hd // 2
    dr = jnp.where(d < half, d + half, d - half)  # rotate_half's source column
    sign = jnp.where(d < half, -1.0, 1.0).astype(jnp.float32)[None, :]
    layer = pltriton.load(lens_ref.at[jnp.int32(batch)])  # lens = [start_0 .. start_{B-1}, layer]
    slot = pltriton.load(lens_ref.at[b]) + row

    def heads(first: int, n: int, block):  # [rows] head indices of this program within a segment of n heads
        i = block * rows + jnp.arange(rows, dtype=jnp.int32)[:, None]
        ok = i < n
        x = pltriton.load(qkv_ref.at[b, row, first + i, d[None, :]], mask=ok, other=0).astype(jnp.float32)
        return i, ok, x

    def rotated(first: int, n: int, block, w_ref):
        i, ok, x = heads(first, n, block)
        xr = pltriton.load(qkv_ref.at[b, row, first + i, dr[None, :]], mask=ok, other=0).astype(jnp.float32)
        c, s = (pltriton.load(ref.at[b, row, d]).astype(dtype).astype(jnp.float32)[None, :]  # rounded as model's
                for ref in (cos_ref, sin_ref))
        w = wr = None
        if normed:
            # every layer's weights: the layer's row, read in place (one indexer: the Triton lowering takes no more)
            w, wr = (pltriton.load(w_ref.at[layer, a] if stacked else w_ref.at[a]).astype(jnp.float32)[None, :]
                     for a in (d, dr))
        return i, ok, _norm_rope(x, xr, w, wr, c, s, sign, dtype, eps, normed)

    @pl.when(j < nq)
    def _():
        i, ok, y = rotated(0, h, j, qn_ref)
        if packed:  # the tree kernel's rows: head i = kh * G + g of this token at row (kh, row * G + g)
            g = h // kv
            pltriton.store(q_ref.at[b, i // g, row * g + i % g, d[None, :]], y, mask=ok)
        else:
            pltriton.store(q_ref.at[b, row, i, d[None, :]], y, mask=ok)

    @pl.when((j >= nq) & (j < nq + nk))
    def _():
        i, ok, y = rotated(h, kv, j - nq, kn_ref)
        ok = ok & (slot < slots)  # out-of-range rows are dropped, as cache.write_layer's scatter drops them
        pltriton.store(k_ref.at[layer, b, slot, i, d[None, :]], y, mask=ok)

    @pl.when(j >= nq + nk)
    def _():
        i, ok, x = heads(h + kv, kv, j - nq - nk)
        pltriton.store(v_ref.at[layer, b, slot, i, d[None, :]], x.astype(dtype), mask=ok & (slot < slots))


@functools.partial(jax.jit, static_argnames=("heads", "eps", "interpret", "q_rows"))
def qkv_write(qkv, q_norm, k_norm, cos, sin, k_all, v_all, layer, start, *, heads: int, eps: float,
              interpret: bool = False, q_rows: int | None = None):
    """(q [B, T, H, hd], k_all, v_all): see the module doc. ``heads`` = H; q_norm and k_norm both arrays or both
    None (no q/k norm, e.g. Llama); ``interpret``: the Pallas interpreter (CPU). ``q_rows`` (R_pad >= T * G, G = H /
    K): q is written in ``tree_attention``'s row layout instead, a ``tree_attention.PackedQ`` of rows [B, K, R_pad,
    hd] (rows past T * G not written)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    b, t, n, hd = qkv.shape
    kv = (n - heads) // 2
    if n != heads + 2 * kv or k_all.shape[1:] != (b, k_all.shape[2], kv, hd) or v_all.shape != k_all.shape:
        raise ValueError(f"qkv_write: qkv {qkv.shape} with {heads} query heads does not match the cache {k_all.shape}")
    if k_all.dtype != qkv.dtype or not supports(qkv.dtype, hd):
        raise ValueError(f"qkv_write takes 16-bit floats and a power-of-two head_dim, got {qkv.dtype} / "
                         f"{k_all.dtype}, head_dim {hd}")
    normed = q_norm is not None
    if not normed:  # placeholders, never read
        q_norm = k_norm = jnp.zeros((hd,), qkv.dtype)
    stacked = q_norm.ndim == 2
    if q_norm.shape[-1:] != (hd,) or k_norm.shape != q_norm.shape or q_norm.ndim > 2:
        raise ValueError(f"qkv_write: q_norm and k_norm must both be [hd] or both [L, hd], got {q_norm.shape} and "
                         f"{k_norm.shape} for head_dim {hd}")
    if q_rows is not None and (heads % kv or q_rows < t * (heads // max(kv, 1))):
        raise ValueError(f"qkv_write: q_rows {q_rows} must hold T x G = {t} x {heads}/{kv} rows of whole GQA groups")
    q_shape = (b, t, heads, hd) if q_rows is None else (b, kv, q_rows, hd)
    lens = lengths(start, layer)  # [B + 1], the array decode_attention and add_norm take too
    q, k_all, v_all = pl.pallas_call(
        functools.partial(_kernel, batch=b, t=t, h=heads, kv=kv, hd=hd, slots=k_all.shape[2], eps=eps, normed=normed,
                          stacked=stacked, rows=_ROWS, packed=q_rows is not None),
        grid=(b * t, -(-heads // _ROWS) + 2 * -(-kv // _ROWS)),
        out_shape=(jax.ShapeDtypeStruct(q_shape, qkv.dtype),
                   jax.ShapeDtypeStruct(k_all.shape, k_all.dtype), jax.ShapeDtypeStruct(v_all.shape, v_all.dtype)),
        input_output_aliases={6: 1, 7: 2},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="qkv_write",
    )(qkv, q_norm, k_norm, cos.astype(jnp.float32), sin.astype(jnp.float32), lens, k_all, v_all)
    return (q if q_rows is None else PackedQ(q, t, heads)), k_all, v_all


def reference(qkv, q_norm, k_norm, cos, sin, k_all, v_all, layer, start, *, heads: int, eps: float):
    """The kernel's result by jnp, each operation rounded to the cache dtype as the module doc says."""
    b, t, n, hd = qkv.shape
    kv = (n - heads) // 2
    dtype = qkv.dtype
    rnd = lambda a: a.astype(dtype).astype(jnp.float32)  # noqa: E731
    c, s = rnd(cos)[:, :, None, :], rnd(sin)[:, :, None, :]
    half = hd // 2

    def norm_rope(x, w):
        x = x.astype(jnp.float32)
        if w is not None:
            x = rnd(w.astype(jnp.float32) * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)))
        rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        return rnd(rnd(x * c) + rnd(rot * s)).astype(dtype)

    q = norm_rope(qkv[:, :, :heads], q_norm)
    k = norm_rope(qkv[:, :, heads:heads + kv], k_norm)
    v = qkv[:, :, heads + kv:]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    slots = start[:, None] + jnp.arange(t)[None, :]
    return (q, k_all.at[layer, rows, slots].set(k.astype(k_all.dtype), mode="drop"),
            v_all.at[layer, rows, slots].set(v.astype(v_all.dtype), mode="drop"))
