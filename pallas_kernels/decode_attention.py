"""Attention of one new token per sequence (an autoregressive step) over the stacked cache, as a Pallas (Triton)
kernel split over the keys.

``tree_attention``'s semantics for T = 1 (its reference: ``tree_attention.tree_attention_reference`` at T = 1): the
token sees the cache's slots [0, prefix_len) and, where bit 0 of its mask row is set (always, for an AR step: a node
sees itself), its own slot prefix_len. Used by ``ddtree_jax.model.attention_fn`` ('pallas-inplace') for AR steps up
to ``MAX_KEYS`` batch x cache slots, where the tree kernel, which pads a KV head's G query rows to 64-row tiles, is
slower.

A grid of (sequence x KV head, split): each program takes the G query rows (padded to 16, the smallest dot), walks
its share of the visible slots in blocks with an online softmax, and stores its partial (accumulator [S, B x K, G, hd],
running max and sum [S, B x K, G]); ``split_merge.merge_splits_kernel`` merges the splits (a split that saw no slot,
max -inf and sum 0, weighs 0). With one split the kernel writes the output itself. A merge in XLA's fusion was two
kernels at 22 splits, and a merge inside this kernel (its last program per row) lengthened it more than the
separate merge costs (docs/KERNELS.md).

Shapes: q [B, 1, H, hd] (16-bit float), k, v the stacked caches [L, B, S, K, hd] read in place at ``layer``,
prefix_len [B] int32, tree_bits [B, 1, W] uint32 -> [B, 1, H, hd] in q's dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.blocks import pow2
from pallas_kernels.lengths import lengths
from pallas_kernels.split_merge import merge_splits_kernel

# keys per step; warps of a program; Triton's software-pipeline stages, None: 3 at batch 1, 2 above (on an H200 the
# deeper pipeline shortens batch-1 AR steps and lengthens batch-8 ones; the sweep over tilings: docs/KERNELS.md)
BLOCK, WARPS, STAGES = 64, 4, None
SLOTS_PER_SPLIT = 128  # default_splits' cache slots per program (read when traced)
_MIN_ROWS = 16  # the smallest M of a Triton dot


# batch x cache slots up to which it takes the one-row steps, set between measured points on an H200 (Qwen3-8B heads:
# faster than the tree kernel at 8.5k slots at batch 1 and 2.9k at batch 8, no faster at 33k; docs/KERNELS.md)
MAX_KEYS = 24576


def default_splits(slots: int, rows: int = 1) -> int:
    """Programs per (sequence, KV head) for a cache of ``slots`` and ``rows`` = batch x KV heads: one per
    ``SLOTS_PER_SPLIT`` (128) slots, 2 to 32, at most 512 programs in all unless that leaves fewer than 2. Each
    split's share of the visible slots is set at run time (whole blocks), and the merge reads every split: more splits
    shorten the kernel and lengthen the merge. Of 32-256 slots a split, none was faster than 128 across models,
    prompts and batches in AR steps on an H200 (docs/KERNELS.md)."""
    return max(2, min(32, slots // SLOTS_PER_SPLIT, 512 // max(rows, 1)))


def supports(q, k) -> bool:
    """One query row, 16-bit floats, a power-of-two head_dim of at least 16, whole GQA groups (k: [..., S, K, hd])."""
    return (len(q.shape) == 4 and q.shape[1] == 1 and q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype
            and q.shape[-1] >= 16 and q.shape[-1] & (q.shape[-1] - 1) == 0 and q.shape[2] % k.shape[-2] == 0)


def _kernel(q_ref, k_ref, v_ref, lens_ref, bits_ref, *out_refs, batch: int, kv: int, g: int, gp: int, hd: int,
            splits: int, scale: float, block: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    bk, sp = pl.program_id(0), pl.program_id(1)
    b, kh = bk // kv, bk % kv
    layer = pltriton.load(lens_ref.at[jnp.int32(batch)])  # lens = [prefix_len (B), layer]: qkv_write's operand too
    n = pltriton.load(lens_ref.at[b]) + (pltriton.load(bits_ref.at[b, jnp.int32(0)]) & 1)  # visible slots [0, n)
    per = (n + splits * block - 1) // (splits * block) * block  # slots per split, whole blocks
    lo = sp * per
    hi = jnp.minimum(lo + per, n)
    d = jnp.arange(hd, dtype=jnp.int32)[None, :]
    rows = jnp.arange(gp, dtype=jnp.int32)[:, None]
    real = rows < g
    q = pltriton.load(q_ref.at[b, 0, kh * g + rows, d], mask=real, other=0)  # [gp, hd]

    def step(i, carry):
        m, l, acc = carry
        idx = lo + i * block + jnp.arange(block, dtype=jnp.int32)[:, None]  # [block, 1]
        ok = idx < hi
        k = pltriton.load(k_ref.at[layer, b, idx, kh, d], mask=ok, other=0)  # [block, hd]
        v = pltriton.load(v_ref.at[layer, b, idx, kh, d], mask=ok, other=0)  # issued with k's: one wait for both
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        s = jnp.where(ok[:, 0][None, :], s, -jnp.inf)  # [gp, block]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    blocks = (jnp.maximum(hi - lo, 0) + block - 1) // block
    init = (jnp.full((gp,), -jnp.inf, jnp.float32), jnp.zeros((gp,), jnp.float32), jnp.zeros((gp, hd), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, blocks, step, init)
    if splits == 1:  # the whole row here: the output
        (o_ref,) = out_refs
        pltriton.store(o_ref.at[b, 0, kh * g + rows, d], (acc / l[:, None]).astype(o_ref.dtype), mask=real)
        return
    acc_ref, m_ref, l_ref = out_refs
    pltriton.store(acc_ref.at[sp, bk, rows, d], acc, mask=real)
    pltriton.store(m_ref.at[sp, bk, rows[:, 0]], m, mask=real[:, 0])
    pltriton.store(l_ref.at[sp, bk, rows[:, 0]], l, mask=real[:, 0])


@functools.partial(jax.jit, static_argnames=("scale", "splits", "interpret", "block", "warps", "stages"))
def decode_attention(q, k, v, prefix_len, tree_bits, layer, *, scale: float | None = None, splits: int | None = None,
                     interpret: bool = False, block: int | None = None, warps: int | None = None,
                     stages: int | None = None):
    """q [B, 1, H, hd], k, v [L, B, S, K, hd], prefix_len [B] int32, tree_bits [B, 1, W] uint32, layer (an int32
    scalar, may be traced) -> [B, 1, H, hd] in q's dtype (see the module doc).
    ``splits``: programs per (sequence, KV head) (default :func:`default_splits`);
    ``interpret``: the Pallas interpreter (CPU); ``block`` (keys per step, a power of two of at least 16),
    ``warps``, ``stages``: the tiling (default the module's ``BLOCK``, ``WARPS``, ``STAGES``, read when traced,
    ``STAGES`` None: 3 at batch 1, 2 above; the same output up to the sums' order; ``pallas_kernels.bench_kernels``'
    decode stage times them). The splits' partials are merged by ``split_merge.merge_splits_kernel``."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    block = BLOCK if block is None else block  # the module's tiling, read when traced
    warps = WARPS if warps is None else warps
    b, t, h, hd = q.shape
    stages = (STAGES or (3 if b == 1 else 2)) if stages is None else stages
    s, kv = k.shape[2], k.shape[3]
    if (not supports(q, k) or k.ndim != 5 or k.shape[1] != b or v.shape != k.shape or block < 16
            or block & (block - 1)):
        raise ValueError(f"decode_attention takes q [B, 1, H, hd] and stacked caches [L, B, S, K, hd] of its 16-bit "
                         f"dtype and a block of a power of two >= 16, got q {q.shape} {q.dtype}, k {k.shape} "
                         f"{k.dtype}, block {block}")
    g = h // kv
    gp = max(_MIN_ROWS, pow2(g))
    splits = splits or default_splits(s, b * kv)
    scale = hd**-0.5 if scale is None else scale
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)] if splits == 1 else [
        jax.ShapeDtypeStruct((splits, b * kv, g, hd), jnp.float32),
        jax.ShapeDtypeStruct((splits, b * kv, g), jnp.float32), jax.ShapeDtypeStruct((splits, b * kv, g), jnp.float32)]
    outs = pl.pallas_call(
        functools.partial(_kernel, batch=b, kv=kv, g=g, gp=gp, hd=hd, splits=splits, scale=float(scale), block=block),
        grid=(b * kv, splits),
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="decode_attention",
    )(q, k, v, lengths(prefix_len, layer), jax.lax.bitcast_convert_type(tree_bits.reshape(b, -1), jnp.int32))
    if splits == 1:
        return outs[0]
    return merge_splits_kernel(*outs, batch=b, dtype=q.dtype, interpret=interpret)
