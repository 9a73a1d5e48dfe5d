"""Rows sorted by group times their group's output-major matrix, reading each touched matrix once (Pallas, Triton).

    y[r, n] = sum_k x[r, k] * w[o + g(r), n, k]   x [R, K], w [W, N, K] (output-major), sizes [G] int32 (rows of
                                                   each group, in order; rows past their sum belong to none), o an
                                                   offset (the groups are w's o .. o + G - 1; may be traced) ->
                                                   y [R, N] (rows of no group are 0), f32 accumulation

A Mixture-of-Experts layer's expert products (``ddtree_jax.moe``): the (token, slot) pairs sorted by expert, w the
experts' gate|up or down matrices (W = layers x experts for a stack, read in place: o = layer x experts). At decode
sizes the rows per expert are few (a 64-node tree of Qwen3-Coder-30B-A3B: 520 pairs over ~125 of 128 experts, about 4
each), so the product is a read of the touched experts' weights; XLA's ``jax.lax.ragged_dot`` reads every expert
whatever the routing (on an H200, one token's 8 experts took as long as all 128: issue 52). Here the grid is (tile,
output block): a tile is up to ``block_rows`` consecutive rows of one group (a group of more rows has several), listed
by :func:`schedule` for the non-empty groups only, so an expert no row routes to is never read, and a group of at most
``block_rows`` rows streams its matrix exactly once (each output block of it by one program). Tiles past the schedule's
count (the static grid is a bound) return at once.

Triton lowering (``pl.pallas_call``'s default on GPU; under jax 0.11 it still runs on the H200, with a deprecation
warning): masked loads and stores of the ragged rows, ``tl.dot`` on [block_rows, bk] x [bk, bn] tiles (16 rows at
least). ``interpret=True`` runs the same kernel in the Pallas interpreter (CPU). The rows are padded by ``block_rows``
so that no tile's slice reaches past the arrays (the interpreter would clamp such a slice's start).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

Array = jax.Array
MIN_BLOCK_ROWS = 16  # tl.dot's smallest M


def group_ids(sizes: Array, rows: int) -> Array:
    """The group of each of ``rows`` sorted rows [R] int32 (G for rows past every group)."""
    return jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows, dtype=sizes.dtype), side="right").astype(jnp.int32)


def reference(x: Array, w: Array, sizes: Array, offset=0, out_dtype=None) -> Array:
    """:func:`grouped_matmul` in jnp: each row times its own group's matrix (gathered per row). For tests and the GPU
    probe (it reads one matrix per row)."""
    g = group_ids(sizes, x.shape[0])
    mats = jnp.take(w, offset + jnp.minimum(g, sizes.shape[0] - 1), axis=0)  # [R, N, K]
    y = jnp.einsum("rk,rnk->rn", x, mats, preferred_element_type=jnp.float32)
    return jnp.where((g < sizes.shape[0])[:, None], y, 0.0).astype(out_dtype or x.dtype)


def max_tiles(rows: int, groups: int, block_rows: int) -> int:
    """A bound on the tiles of any ``sizes`` summing to at most ``rows``: each non-empty group adds at most one partial
    tile to the rows' full ones."""
    return rows // block_rows + min(groups, rows)


def schedule(sizes: Array, rows: int, block_rows: int, offset=0) -> Array:
    """The tiles [max_tiles, 3] int32 of (offset + group, first row, end row) in row order: each non-empty group's rows
    cut into tiles of ``block_rows``; the tiles past the last are (offset, 0, 0) (no rows)."""
    g_count = sizes.shape[0]
    tiles = (sizes + block_rows - 1) // block_rows  # [G], 0 for an empty group
    tile_end = jnp.cumsum(tiles)
    t = jnp.arange(max_tiles(rows, g_count, block_rows), dtype=jnp.int32)
    g = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)  # G past the last tile
    gc = jnp.minimum(g, g_count - 1)
    start = jnp.cumsum(sizes) - sizes
    first = start[gc] + (t - (tile_end[gc] - tiles[gc])) * block_rows
    end = jnp.minimum(first + block_rows, start[gc] + sizes[gc])
    live = g < g_count
    return jnp.stack([offset + jnp.where(live, g, 0), jnp.where(live, first, 0), jnp.where(live, end, 0)], axis=1)


def default_block_rows(rows: int, groups: int) -> int:
    """Rows per tile: the power of two (16 to 128) at or above twice the mean rows of a group, so that most groups
    fit one tile (their matrix read once) without tiles mostly empty."""
    want = max(1, -(-2 * rows // groups))
    return min(128, max(MIN_BLOCK_ROWS, 1 << (want - 1).bit_length()))


def supports(x: Array, w: Array) -> bool:
    """Whether the kernel takes x [R, K] against w [G, N, K]: 16-bit floats, N a multiple of 64 and K of 32."""
    n, k = w.shape[1], w.shape[2]
    return (x.dtype == w.dtype and x.dtype in (jnp.bfloat16, jnp.float16) and n % 64 == 0 and k % 32 == 0
            and x.shape[1] == k)


def _kernel(sched_ref, x_ref, w_ref, _zeros_ref, o_ref, *, block_rows: int, block_n: int, block_k: int, steps: int):
    t, j = pl.program_id(0), pl.program_id(1)
    g, first, end = sched_ref[t, 0], sched_ref[t, 1], sched_ref[t, 2]

    @pl.when(end > first)
    def _():
        live = (first + jnp.arange(block_rows)) < end  # [bm]
        cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)

        def step(i, acc):
            ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
            xk = x_ref[pl.ds(first, block_rows), ks]  # [bm, bk]
            wk = w_ref[g, cols, ks]  # [bn, bk]
            return acc + jax.lax.dot_general(xk, wk, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_rows, block_n), jnp.float32))
        plt.store(o_ref.at[pl.ds(first, block_rows), cols], acc.astype(o_ref.dtype), mask=live[:, None])


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_rows", "block_n", "block_k", "interpret"))
def grouped_matmul(x: Array, w: Array, sizes: Array, offset=0, *, out_dtype=None, block_rows: int | None = None,
                   block_n: int = 64, block_k: int | None = None, interpret: bool = False) -> Array:
    """x [R, K] sorted by group, w [W, N, K], sizes [G] int32 (G <= W), offset (int32, may be traced: the groups are w's
    offset .. offset + G - 1) -> y [R, N] in ``out_dtype`` (default x's): row r of group g times w[offset + g] (f32
    accumulation); rows past sum(sizes) are 0. See the module doc."""
    rows, k = x.shape
    g_count, n = sizes.shape[0], w.shape[1]
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    bm = block_rows or default_block_rows(rows, g_count)
    bk = block_k or next(b for b in (128, 64, 32, k) if k % b == 0)
    bn = min(block_n, n)
    if n % bn or k % bk:
        raise ValueError(f"grouped_matmul: N={n} must be a multiple of block_n={bn} and K={k} of block_k={bk}")
    sched = schedule(sizes.astype(jnp.int32), rows, bm, jnp.asarray(offset, jnp.int32))
    xp = jnp.pad(x, ((0, bm), (0, 0)))  # no tile's slice reaches past the rows
    zeros = jnp.zeros((rows + bm, n), out_dtype)  # the output's buffer: rows of no tile stay 0
    kernel = functools.partial(_kernel, block_rows=bm, block_n=bn, block_k=bk, steps=k // bk)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows + bm, n), out_dtype),
        grid=(sched.shape[0], n // bn),
        input_output_aliases={3: 0},
        interpret=interpret,
        name="grouped_matmul",
    )(sched, xp, w, zeros)
    return y[:rows]
