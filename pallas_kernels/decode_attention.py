"""Attention of one new token per sequence (an autoregressive step) in a Pallas (Triton) kernel, split over keys.

``tree_attention``'s semantics for T = 1: the token sees the cache's slots [0, prefix_len) and, where bit 0 of its
mask row is set (always, for an AR step: a node sees itself), its own slot prefix_len. The Mosaic GPU tree kernel
pads the G = H / K query heads of a KV head to its 64-row tiles, and with the pad before it and the combine after it
an AR step's attention is three kernels of about 8 µs together per layer on an H200 (Qwen3-4B, prompt 512;
benchmarks/PERF.md, seventeenth run). Here: a grid of (sequence x KV head, split); each program takes the G query rows
(padded to 16, the smallest dot), walks its share of the visible slots in blocks (of 64) with an online softmax, and
stores its partial (accumulator [S, B x K, G, hd], running max and sum [S, B x K, G]) for the G rows; a second
Pallas kernel merges the splits (``split_merge.merge_splits_kernel``, a program per query row reading its S partials
at once; a split that saw no slot, max -inf and sum 0, weighs 0). With one split the kernel writes the output itself.
XLA's fusion of the merge made two kernels at 22 splits, 3.6 µs against 1.8, and AR steps
at prompt 2k 0.08 ms longer (H200, twenty-ninth run).

Merging in the kernel instead (the last program of a sequence x KV head, found by an atomic count, reads the others'
partials) made the kernel 2.5-4 µs longer, more than XLA's kernels after it cost, and AR steps 0.02-0.03 ms slower
(eighteenth run; ``benchmarks/decode_combine_in_kernel.patch``).

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

# keys per step; warps of a program; Triton's software-pipeline stages, None: 3 at batch 1, 2 above. At batch 1, 3
# stages rather than 2 made AR steps 0.021-0.029 ms shorter on both models at prompts 512 and 2k (blocks of 128 with 2
# stages, the other candidate of the kernel's sweep over ten tilings, 0.012 ms shorter at 2k and 0.038 at 512,
# Qwen3-4B); at batch 8, prompt 2k, 0.070-0.075 ms longer (H200, twenty-ninth run, benchmarks/PERF.md)
BLOCK, WARPS, STAGES = 64, 4, None
SLOTS_PER_SPLIT = 128  # default_splits' cache slots per program (read when traced)
_MIN_ROWS = 16  # the smallest M of a Triton dot


# batch x cache slots up to which it takes the one-row steps, a limit set between measured points (H200, Qwen3-8B
# heads, µs with XLA's combine, against the tree kernel: batch 1 at 8.5k slots 13.8 against 17.5, at 33k 43.5 against
# 42.1; batch 8 at 2.4k and 2.9k slots 23.4 and 23.1 against 29.2 and 29.3; benchmarks/PERF.md, eighteenth run)
MAX_KEYS = 24576


def default_splits(slots: int, rows: int = 1) -> int:
    """Programs per (sequence, KV head) for a cache of ``slots`` and ``rows`` = batch x KV heads: one per
    ``SLOTS_PER_SPLIT`` (128) slots, 2 to 32, at most 512 programs in all unless that leaves fewer than 2. Each
    split's share of the visible slots is set at run time (whole blocks), and the merge reads every split: more splits
    shorten the kernel and lengthen the combine (eighteenth run's sweep, H200, Qwen3-8B heads, with XLA's reduction as
    the combine: batch 1 best at 4-8 splits for 513 visible slots, 16-32 for 2k, 32 for 8k; batch 8 at 4-8). With
    XLA's combine written split by split (twenty-eighth run: one kernel at 11 splits; at 22 it was two, twenty-ninth
    run), one split per 128 slots instead of 256 made AR steps at prompt 512 0.9-1.4% shorter (both models at batch 1,
    Qwen3-8B at batch 8) and changed nothing at 2k; one per 64 or 32 was 0.05-0.06 ms slower at 2k. With the Pallas
    merge kernel (thirtieth run, AR A/Bs): 64 slots a split -0.021 ms on Qwen3-8B at 512, on Qwen3-4B -0.041 and
    -0.002 at 512 in two processes, +0.019 at batch 8, +0.006 at 2k (8B +0.001); 256 +0.031 at 2k (4B): kept at 128."""
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
    """See the module doc. ``splits``: programs per (sequence, KV head) (default :func:`default_splits`);
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
