"""DDTree's best-first tree from sorted per-depth lists in one Pallas (Triton) program per sequence.

The same tokens, depths and parents as ``ddtree_jax.tree``'s depth scan (``tree._best_first_one``, see its module
doc for the method): the frontier of depth 0 is the first list's best; each later depth takes the ``budget`` best of
the candidate pairs (frontier slot i, token rank j) with (i + 1)(j + 1) <= budget, sorted as ``lax.top_k`` sorts;
a last selection takes the ``budget`` best paths over all depths (ties: shallower, then lower slot first) and maps
each node's parent slot to its tree index. XLA's forms of this are two or three kernels per depth (a sort, or a rank
count and a one-hot gather; 15 depths for DFlash's block of 16); here the whole scan is one launch, and a depth is
an exact selection (``pallas_kernels.selection``: block-wide counts cutting the threshold's interval to a third each,
bounded by the sorted lists, then a cumsum), a compaction through memory and a rank count of the ``budget`` selected.
One SM runs it all: faster than XLA's forms up to budget 96 on an H200, slower above (benchmarks/PERF.md,
nineteenth and twenty-fifth runs).

Each depth reads what other threads of the program stored (the frontier before it, the compacted selection), so
a block barrier (``pallas.triton.debug_barrier``) separates the stores from the loads: one after depth 0, two per
later depth, two at the end. The Pallas interpreter, which runs these kernels on CPU (the tests), runs a program as
one sequence of whole-array operations and has no rule for the barrier, so there it is left out: the interpreter
checks the arithmetic, the GPU (``benchmarks/tree_kernels.py``, trees equal to XLA's) the barriers. Sizes: see
``supports`` (each selection at most ``selection.MAX_KEYS`` keys: budgets up to 1024 at 15 depths).

Shapes (B sequences, Dp depths, K <= W list entries, W = budget; P padded to a power of two):
    lp [B, Dp, K] float32, ids [B, Dp, K] int32 (each row sorted descending, as tree.top_log_probs gives them)
    -> tokens [B, W] int32 (-1: an unused slot), depths [B, W] int32 (1-based), parents [B, W] int32 (tree indices)
    scratch outputs: the frontiers [B, Dp, P(W) + 1] (scores, tokens, parent slots), the compacted selection
    [B, P(W) + 1] (values, two payloads), each path's place in the tree [B, P(Dp * P(W)) + 1]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.blocks import pow2
from pallas_kernels.selection import MAX_KEYS, MIN, order_key, ranks, select

_RANK_TILE = 32  # columns of the rank count at a time


@functools.lru_cache(maxsize=None)
def candidate_pairs(budget: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Static (frontier slot, token rank) pairs that can reach the top ``budget``: (i + 1)(j + 1) <= budget, j < k,
    in (i, j) order. The frontier and the lists are sorted, so pair (i, j) has (i + 1)(j + 1) - 1 pairs above it."""
    ii, jj = [], []
    for i in range(budget):
        for j in range(min(k, budget // (i + 1))):
            ii.append(i)
            jj.append(j)
    return np.asarray(ii, np.int32), np.asarray(jj, np.int32)


def _kernel(lp_ref, ids_ref, ii_ref, jj_ref,  # inputs
            tok_ref, dep_ref, par_ref,  # outputs [B, wp + 1]
            score_ref, htok_ref, hpar_ref,  # the frontiers [B, dp, wp + 1]
            cval_ref, cpay_ref, cpay2_ref,  # the compacted selection [B, wp + 1]
            place_ref,  # [B, fp + 1]: each selected path's node index
            *, w: int, wp: int, k: int, dp: int, n: int, np_: int, fp: int, interpret: bool):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    load, store = pltriton.load, pltriton.store
    b = pl.program_id(0)
    sync = (lambda: None) if interpret else pltriton.debug_barrier
    s = jnp.arange(wp, dtype=jnp.int32)
    oks = s < w

    def best(x, key, pay, pay2, lo, hi):
        """x, key, payloads [m] in index order -> the w best (lax.top_k's), compacted in index order, and their
        ranks (``selection.ranks``): (x [wp], pay [wp], pay2 [wp], rank [wp]; entries s >= w padding). ``lo``, ``hi``:
        bounds of the w-th largest key (``selection.select``)."""
        sel, slot = select(key, w, lo, hi)
        store(cval_ref.at[b, slot], x, mask=sel)
        store(cpay_ref.at[b, slot], pay, mask=sel)
        store(cpay2_ref.at[b, slot], pay2, mask=sel)
        sync()
        xs = load(cval_ref.at[b, s], mask=oks, other=0)

        def load_key(j):
            return jnp.where(j < w, order_key(load(cval_ref.at[b, j], mask=j < w, other=0)), MIN)

        rank = ranks(jnp.where(oks, order_key(xs), MIN), load_key, w, wp, min(wp, _RANK_TILE))
        return xs, load(cpay_ref.at[b, s], mask=oks, other=0), load(cpay2_ref.at[b, s], mask=oks, other=0), rank

    # Depth 0: the first list's best min(k, w); the other slots -inf.
    first = s < min(k, w)
    store(score_ref.at[b, 0, s], jnp.where(first, load(lp_ref.at[b, 0, s], mask=first, other=0), -jnp.inf))
    store(htok_ref.at[b, 0, s], jnp.where(first, load(ids_ref.at[b, 0, s], mask=first, other=0), -1))
    store(hpar_ref.at[b, 0, s], jnp.full((wp,), -1, jnp.int32))
    sync()

    # Depths 1 .. dp-1: the w best candidate pairs, written to the frontier in lax.top_k's order.
    c = jnp.arange(np_, dtype=jnp.int32)
    okc = c < n
    ii = load(ii_ref.at[c], mask=okc, other=0)
    jj = load(jj_ref.at[c], mask=okc, other=0)

    # Bounds of the w-th best pair: pair (0, 0) is the largest; the a x (w / a) pairs (i < a, j < w / a) are all
    # candidates and none below pair (a - 1, w / a - 1), so the w-th best is at least the largest of those.
    corners = [(a - 1, w // a - 1) for a in range(1, w + 1) if w % a == 0 and w // a <= k]

    def depth(d, carry):
        x = load(score_ref.at[b, d - 1, ii], mask=okc, other=0) + load(lp_ref.at[b, d, jj], mask=okc, other=0)
        tok = load(ids_ref.at[b, d, jj], mask=okc, other=0)
        def pair(i, j):  # the key of one candidate pair (scalar loads; Python ints as int32 for the interpreter)
            return order_key(load(score_ref.at[b, d - 1, jnp.int32(i)]) + load(lp_ref.at[b, d, jnp.int32(j)]))

        lo = functools.reduce(jnp.maximum, [pair(i, j) for i, j in corners]) if corners else None
        xs, tok, parent_slot, rank = best(x, jnp.where(okc, order_key(x), MIN), tok, ii, lo, pair(0, 0))
        store(score_ref.at[b, d, rank], xs, mask=oks)
        store(htok_ref.at[b, d, rank], tok, mask=oks)
        store(hpar_ref.at[b, d, rank], parent_slot, mask=oks)
        sync()
        return carry

    jax.lax.fori_loop(1, dp, depth, 0)

    # The w best paths over all depths (flat index q = depth * wp + slot: ties shallower, then lower slot first).
    q = jnp.arange(fp, dtype=jnp.int32)
    qd, qs = q // wp, q % wp
    okq = (qd < dp) & (qs < w)
    x = jnp.where(okq, load(score_ref.at[b, qd, qs], mask=okq, other=0), -jnp.inf)
    key = jnp.where(okq, order_key(x), MIN)
    # depth 0 holds w paths at least as good as its w-th
    lo = order_key(load(score_ref.at[b, jnp.int32(0), jnp.int32(w - 1)])) if k >= w else None
    xs, qf, _, rank = best(x, key, q, q, lo, jnp.max(key))
    store(place_ref.at[b, jnp.where(oks, qf, fp)], rank, mask=oks)  # padding to the spare column (see select)
    sync()
    dq, sq = qf // wp, qf % wp
    valid = oks & (xs > -jnp.inf)
    tok = load(htok_ref.at[b, dq, sq], mask=oks, other=0)
    parent_slot = load(hpar_ref.at[b, dq, sq], mask=oks, other=0)
    has_parent = valid & (dq > 0)
    parent = load(place_ref.at[b, jnp.maximum((dq - 1) * wp + parent_slot, 0)], mask=has_parent, other=0) + 1
    store(tok_ref.at[b, rank], jnp.where(valid, tok, -1), mask=oks)
    store(dep_ref.at[b, rank], jnp.where(valid, dq + 1, 1), mask=oks)
    store(par_ref.at[b, rank], jnp.where(has_parent, parent, 0), mask=oks)


def supports(budget: int, k: int, depths: int) -> bool:
    """Whether the kernel takes lists of ``depths`` x k for a tree of ``budget``: 0 < k <= budget, at least budget
    candidate pairs, and both selections (a depth's pairs, every depth's paths, each padded to a power of two) within
    ``selection.MAX_KEYS`` (at 15 depths: budgets up to 1024)."""
    if not 0 < k <= budget or depths < 1:
        return False
    n = len(candidate_pairs(budget, k)[0])
    return n >= budget and max(pow2(n), pow2(depths * pow2(budget))) <= MAX_KEYS


@functools.partial(jax.jit, static_argnames=("budget", "interpret", "warps"))
def best_first(lp: jax.Array, ids: jax.Array, budget: int, *, interpret: bool = False,
               warps: int = 8) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(tokens, depths, parents) [B, budget] of DDTree's tree from lp [B, Dp, K] float32 and ids [B, Dp, K] int32
    sorted descending per depth (K <= budget), as ``tree._best_first_one`` gives them (parents: tree indices, the
    root 0). ``interpret``: the Pallas interpreter (CPU); ``warps``: of the program."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    b, dp, k = lp.shape
    if lp.dtype != jnp.float32 or ids.shape != lp.shape or not supports(budget, k, dp):
        raise ValueError(f"best_first takes float32 lists [B, Dp, K] with 0 < K <= budget, at least budget candidate "
                         f"pairs and at most {MAX_KEYS} keys per selection (supports()), got {lp.dtype} {lp.shape}, "
                         f"ids {ids.shape}, budget {budget}")
    ii, jj = candidate_pairs(budget, k)
    w, wp = budget, pow2(budget)
    np_, fp = pow2(len(ii)), pow2(dp * wp)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    outs = pl.pallas_call(
        functools.partial(_kernel, w=w, wp=wp, k=k, dp=dp, n=len(ii), np_=np_, fp=fp, interpret=interpret),
        grid=(b,),
        out_shape=(i32(b, wp + 1), i32(b, wp + 1), i32(b, wp + 1),
                   f32(b, dp, wp + 1), i32(b, dp, wp + 1), i32(b, dp, wp + 1),
                   f32(b, wp + 1), i32(b, wp + 1), i32(b, wp + 1), i32(b, fp + 1)),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret,
        name="best_first",
    )(lp, ids.astype(jnp.int32), jnp.asarray(ii), jnp.asarray(jj))
    return tuple(o[:, :w] for o in outs[:3])
