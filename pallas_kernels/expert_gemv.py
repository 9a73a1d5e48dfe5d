"""A few rows, each times the output-major matrix its id picks: a batched GEMV with indirection (Pallas, Triton).

    y[p, n] = sum_d x[p, d] * w[o + ids[p], n, d]   x [P, D], ids [P] int32, w [W, N, D] (output-major), o an offset
                                                     (may be traced) -> y [P, N], f32 accumulation

The gather form of a Mixture-of-Experts layer (``ddtree_jax.moe``) at an AR step: P (token, slot) pairs (8 for one
token of Qwen3-Coder-30B-A3B), w the stacked experts' gate|up (x: each pair's token, N = 2F) or down (x: each pair's
swiglu output, N = D, reducing over F), read in place (W = layers x experts, o = layer x experts). Each pair's product
reads its expert's whole matrix (6.3 MB for gate|up at that shape, against 4 KB of x), so the kernel is a stream of
the routed experts' bytes. XLA's form of it (:func:`reference`: the matrices gathered inside a row reduction) streamed
them at about 1.4 TB/s on an H200, where a batch-1 GEMV reaches about 4 (docs/MOE.md).

The grid is (pair, output block): each program streams its pair's expert's [block_n, D] slab once, in chunks of
``block_d`` along the contiguous D axis, multiplies each chunk by x[p]'s and accumulates the products in f32
[block_n, block_d], summed over the chunk's axis at the end (a row reduction; no ``tl.dot``, whose M is 16 rows at
least, for what is one row per matrix). Two pairs routed to one expert read it twice, as XLA's form does; many pairs
are the grouped form's (``pallas_kernels.grouped_matmul``: each expert read once).

Triton lowering (``pl.pallas_call``'s default on GPU, as ``grouped_matmul``); ``interpret=True`` runs the same kernel
in the Pallas interpreter (CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

Array = jax.Array
BLOCK_N = (64, 32, 16)  # output rows per program, largest first (powers of two: Triton's block shapes)
PROGRAMS = 256  # programs wanted per call: about two per SM of an H200 (132), so that every SM streams


def reference(x: Array, w: Array, ids: Array, offset=0, out_dtype=None) -> Array:
    """:func:`expert_gemv` in jnp, XLA's form: each pair's matrix taken inside a row reduction over D, which XLA fuses
    into one pass over the picked matrices (f32 products summed). The MoE layer's fallback, and the kernel's reference
    in the tests and the GPU probe."""
    mats = jnp.take(w, offset + ids, axis=0).astype(jnp.float32)  # [P, N, D], fused into the reduction
    return jnp.sum(mats * x[:, None, :].astype(jnp.float32), axis=-1).astype(out_dtype or x.dtype)


def default_block_n(pairs: int, n: int) -> int:
    """Output rows per program: the largest of ``BLOCK_N`` dividing N that still gives ``PROGRAMS`` programs (the
    smallest dividing N when none does). Few pairs need small blocks to occupy the GPU: one pair's gate|up at
    Qwen3-Coder-30B-A3B's shape is 96 programs of 16 rows; eight pairs' are 384 of 32."""
    fits = [b for b in BLOCK_N if n % b == 0]
    return next((b for b in fits if pairs * (n // b) >= PROGRAMS), fits[-1] if fits else n)


def default_block_d(d: int) -> int:
    """Input values per chunk of a program's slab: 256 (16 KB of bf16 at 32 rows), or the largest power of two below
    it that divides D."""
    return next((b for b in (256, 128, 64, 32) if d % b == 0), d)


def supports(x: Array, w: Array) -> bool:
    """Whether the kernel takes x [P, D] against w [W, N, D]: 16-bit floats (those of the probe), N a multiple of 16 and
    D of 32."""
    n, d = w.shape[1], w.shape[2]
    return (x.dtype == w.dtype and x.dtype in (jnp.bfloat16, jnp.float16) and n % 16 == 0 and d % 32 == 0
            and x.shape[1] == d)


def _kernel(ids_ref, x_ref, w_ref, o_ref, *, block_n: int, block_d: int, steps: int):
    p, j = pl.program_id(0), pl.program_id(1)
    e = ids_ref[p]
    cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)

    def step(i, acc):
        ds = pl.ds(pl.multiple_of(i * block_d, block_d), block_d)
        xd = x_ref[p, ds].astype(jnp.float32)  # [bd]
        wd = w_ref[e, cols, ds].astype(jnp.float32)  # [bn, bd]
        return acc + wd * xd[None, :]

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_n, block_d), jnp.float32))
    o_ref[p, cols] = jnp.sum(acc, axis=1).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_n", "block_d", "warps", "stages", "interpret"))
def expert_gemv(x: Array, w: Array, ids: Array, offset=0, *, out_dtype=None, block_n: int | None = None,
                block_d: int | None = None, warps: int | None = None, stages: int | None = None,
                interpret: bool = False) -> Array:
    """x [P, D], w [W, N, D], ids [P] int32 (offset + ids in 0 .. W - 1), offset (int32, may be traced) -> y [P, N] in
    ``out_dtype`` (default x's): row p times w[offset + ids[p]] (f32 accumulation). See the module doc. ``warps`` and
    ``stages`` set Triton's warps per program and software-pipeline stages (default: Pallas's)."""
    pairs, d = x.shape
    n = w.shape[1]
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    bn = block_n or default_block_n(pairs, n)
    bd = block_d or default_block_d(d)
    if n % bn or d % bd or w.shape[2] != d:
        raise ValueError(f"expert_gemv: N={n} must be a multiple of block_n={bn}, D={d} of block_d={bd}, and w "
                         f"{tuple(w.shape)} must be [W, N, D]")
    picked = jnp.asarray(offset, jnp.int32) + ids.astype(jnp.int32)  # [P]
    kernel = functools.partial(_kernel, block_n=bn, block_d=bd, steps=d // bd)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((pairs, n), out_dtype),
        grid=(pairs, n // bn),
        compiler_params=None if warps is None and stages is None else pltriton.CompilerParams(
            num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="expert_gemv",
    )(picked, x, w)
