"""DDTree's best-first tree from sorted per-depth lists as a chain of short Pallas (Triton) kernels of many programs.

The same tokens, depths and parents as ``ddtree_jax.tree``'s depth scan (``tree._best_first_one``; see its module doc
for the method), and the ancestor bits of ``tree.ancestor_bits`` with them. The frontier of depth 0 is the first
list's best; the frontier of depth d is the ``budget`` best candidate pairs (slot i of frontier d-1, rank j of list
d), (i + 1)(j + 1) <= budget, in ``lax.top_k``'s order (value, then pair index); the tree is the ``budget`` best
paths over all depths (value, then depth, then slot). No step iterates a selection: every order is a rank count (a
pair's rank = the pairs before it), spread over the programs of one kernel, and a kernel boundary is the only
synchronisation (about 1.3 µs on an H200, cheaper than an atomic barrier between programs).
Used by ``tree.tree_from_lists`` (select='kernel', chosen by ``tree.default_select``); the reference is
``tree._best_first_one`` with ``tree.ancestor_bits``.

Kernel ``depth`` runs once per depth d = 1 .. Dp (the same compiled program from d = 2; d is an operand):
  - for d < Dp, each program ranks a few candidate pairs of depth d (``own_per_program``), each a scalar compared
    with every pair, whose keys the program loads itself (the pairs' slots and ranks, then the frontier's and the
    list's values: two dependent loads, not one per tile), and writes the winners (rank < budget) at their rank:
    frontier d, with each winner's parent slot and its ancestors' slots (its parent's, then the parent);
  - every call merges frontier d - 1 into the running best paths (the ``budget`` best of depths < d - 1, sorted):
    an element's place = its own position + the other list's elements before it (the shallower list first on
    ties), kept if < budget, and written to ``place`` (flat depth * budget + slot -> its tree position; the last
    merge writes every tree node's final place).
Kernel ``nodes`` then gives each tree position its token, depth, parent (its parent's place + 1) and ancestor-or-self
bits (one gather per ancestor, all independent).

On an H200 a depth kernel takes a few µs; the whole build is faster than XLA's rank counting up to budget 256 and
no faster at 512 (docs/KERNELS.md).

Shapes (B sequences, Dp depths, K <= W list entries, W = budget):
    lp [B, Dp, K] float32, ids [B, Dp, K] int32 (each row sorted descending, as tree.top_log_probs gives them)
    -> tokens [B, W] int32 (-1: an unused slot), depths [B, W] int32 (1-based), parents [B, W] int32 (tree indices),
       bits [B, 1 + W, ceil((1 + W) / 32)] uint32
    scratch: frontiers [B, Dp, W + 1] (score, token, parent slot), ancestor slots [B, Dp, W + 1, P(Dp)], the best
    paths [B, 2, W + 1] (score, flat index; two buffers, one read and one written per call), places [B, Dp * W + 1]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.blocks import pow2
from pallas_kernels.ranking import comes_before
from pallas_kernels.selection import order_key

NODES_OWN = 32  # tree nodes per program of the nodes kernel
WARPS = 4  # of each program (2 and 8 no faster at budgets 64-256 on an H200)
MAX_PAIRS = 8192  # candidate pairs (padded to a power of two) one program loads at most: budgets up to 1024


def own_per_program(pairs: int) -> int:
    """Pairs (and merge elements) one program of the depth kernel ranks, for ``pairs`` candidate pairs: each program
    loads every pair's key, so fewer programs load less, but each rank is a reduction over all pairs. The fastest
    whole builds on an H200: 1 up to 1024 padded pairs (budgets up to 128), 2 at 2048 (256), 3 at 4096 (512)."""
    padded = pow2(pairs)
    return 1 if padded <= 1024 else 2 if padded <= 2048 else 3


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


def _count_before(key, idx, keys, idxs, oks):
    """Scalars key, idx -> how many of keys, idxs, oks [all] come before them (larger key, ties: lower index)."""
    return jnp.sum((comes_before(keys, idxs, key, idx) & oks).astype(jnp.int32))


def _depth_kernel(d_ref, lp_ref, ids_ref, ii_ref, jj_ref, *refs, w: int, k: int, dp: int, dpp: int, n: int,
                  own_p: int, own_m: int, progs_p: int, first: bool):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    load, store = pltriton.load, pltriton.store
    score_ref, tok_ref, par_ref, anc_ref, rs_ref, rq_ref, place_ref = refs[-7:]  # after the aliased inputs, if any
    b, t = pl.program_id(0), pl.program_id(1)
    d = load(d_ref.at[jnp.int32(0)])
    m = d - 1  # the frontier this call reads (and merges)
    wp, np_ = pow2(w), pow2(n)
    neg = jnp.float32(-jnp.inf)
    i32 = jnp.int32

    def frontier(s, ok):
        """Scores of frontier m's slots s [...] or a scalar: the first list itself at depth 0 (-inf past its k
        entries; ``first``: this call reads depth 0)."""
        if first:
            ok = ok & (s < k)
            return jnp.where(ok, load(lp_ref.at[b, i32(0), jnp.where(ok, s, 0)], mask=ok, other=neg), neg)
        return load(score_ref.at[b, m, jnp.where(ok, s, 0)], mask=ok, other=neg)

    dd = jnp.minimum(d, dp - 1)

    def pair_keys(u, ok):  # pairs u [...] or a scalar -> (x, i, j)
        i = load(ii_ref.at[jnp.where(ok, u, 0)], mask=ok, other=0)
        j = load(jj_ref.at[jnp.where(ok, u, 0)], mask=ok, other=0)
        return frontier(i, ok) + load(lp_ref.at[b, dd, jnp.where(ok, j, 0)], mask=ok, other=0), i, j

    # ---- frontier d from frontier d - 1 (d < dp): rank every pair, write the winners at their rank
    @pl.when((t < progs_p) & (d < dp))
    def _():
        u = jnp.arange(np_, dtype=i32)
        oku = u < n
        xu, _, _ = pair_keys(u, oku)
        keys = order_key(xu)
        e = jnp.arange(dpp, dtype=i32)
        for o in range(own_p):
            own = t * own_p + o
            okp = own < n
            x, i, j = pair_keys(own, okp)
            rank = _count_before(order_key(x), own, keys, u, oku)
            win = okp & (rank < w)
            at = jnp.where(win, rank, w)  # column w: a spare (the interpreter writes masked stores' old values back)
            store(score_ref.at[b, dd, at], x, mask=win)
            store(tok_ref.at[b, dd, at], load(ids_ref.at[b, dd, jnp.where(okp, j, 0)], mask=okp, other=0), mask=win)
            store(par_ref.at[b, dd, at], i, mask=win)
            up = win & (e < m)  # the parent's ancestors, then the parent
            anc = load(anc_ref.at[b, jnp.maximum(m, 0), jnp.where(up, i, 0), jnp.where(up, e, 0)], mask=up, other=0)
            store(anc_ref.at[b, dd, at, e], jnp.where(e == m, i, anc), mask=win & (e <= m))

    # ---- merge frontier m into the best paths: R (depths < m, sorted) and F (frontier m, sorted) -> the w best
    @pl.when(t < -(-2 * w // own_m))
    def _():
        src, dst = jax.lax.bitwise_and(m + 1, 1), jax.lax.bitwise_and(m, 1)
        u = jnp.arange(wp, dtype=i32)
        oku = u < w
        f_all = order_key(frontier(u, oku))
        okr = oku & (m > 0)
        r_all = order_key(load(rs_ref.at[b, src, jnp.where(okr, u, 0)], mask=okr, other=neg))
        for o in range(own_m):
            el = t * own_m + o
            is_r = el < w
            pos = jnp.where(is_r, el, el - w)
            okm = (el < 2 * w) & ((~is_r) | (m > 0))  # no R before depth 0
            r_val = load(rs_ref.at[b, src, jnp.where(okm & is_r, pos, 0)], mask=okm & is_r, other=neg)
            f_val = frontier(pos, okm & ~is_r)
            val = jnp.where(is_r, r_val, f_val)
            kv = order_key(val)
            # F's elements before an R element: strictly larger (index 1 against 0); R's before an F: not smaller
            other = jnp.where(is_r, _count_before(kv, i32(0), f_all, jnp.ones_like(u), oku),
                              _count_before(kv, i32(1), r_all, jnp.zeros_like(u), okr))
            place = pos + other
            keep = okm & (place < w)
            q = jnp.where(is_r, load(rq_ref.at[b, src, jnp.where(okm & is_r, pos, 0)], mask=okm & is_r, other=0),
                          m * w + pos)
            at = jnp.where(keep, place, w)
            store(rs_ref.at[b, dst, at], val, mask=keep)
            store(rq_ref.at[b, dst, at], q, mask=keep)
            store(place_ref.at[b, jnp.where(keep, q, dp * w)], place, mask=keep)
            if first:  # frontier 0 is the first list: written by the call that merges it
                first_row = okm & ~is_r
                s0 = jnp.where(first_row, pos, w)
                store(score_ref.at[b, i32(0), s0], val, mask=first_row)
                tok0 = load(ids_ref.at[b, i32(0), jnp.where(first_row & (pos < k), pos, 0)],
                            mask=first_row & (pos < k), other=-1)
                store(tok_ref.at[b, i32(0), s0], tok0, mask=first_row)
                store(par_ref.at[b, i32(0), s0], i32(-1), mask=first_row)


def _nodes_kernel(score_ref, tok_ref, anc_ref, rs_ref, rq_ref, place_ref, tok_out, dep_out, par_out, bits_out,
                  *, w: int, dp: int, dpp: int, nw: int, fin: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    load, store = pltriton.load, pltriton.store
    b, t = pl.program_id(0), pl.program_id(1)
    p = t * NODES_OWN + jnp.arange(NODES_OWN, dtype=jnp.int32)
    ok = p < w
    x = load(rs_ref.at[b, jnp.int32(fin), jnp.where(ok, p, 0)], mask=ok, other=0)
    q = load(rq_ref.at[b, jnp.int32(fin), jnp.where(ok, p, 0)], mask=ok, other=0)
    valid = ok & (x > -jnp.inf)
    d, s = q // w, q % w
    tok = load(tok_ref.at[b, jnp.where(valid, d, 0), jnp.where(valid, s, 0)], mask=valid, other=-1)
    word = jnp.arange(nw, dtype=jnp.int32)[None, :]

    def bit(idx, on):  # [NODES_OWN] tree indices -> their bits in the words [NODES_OWN, nw]
        return jnp.where(on[:, None] & (word == (idx >> 5)[:, None]), jnp.left_shift(1, idx & 31)[:, None], 0)

    words = bit(p + 1, ok) | bit(jnp.zeros_like(p), ok)  # self and the root
    parent = jnp.zeros_like(p)
    for e in range(dp - 1):  # every ancestor's tree index: independent gathers
        has = valid & (d > e)
        a = load(anc_ref.at[b, jnp.where(has, d, 0), jnp.where(has, s, 0), jnp.int32(e)], mask=has, other=0)
        idx = load(place_ref.at[b, jnp.where(has, e * w + a, 0)], mask=has, other=0) + 1
        words = words | bit(idx, has)
        parent = jnp.where(has & (d == e + 1), idx, parent)
    out = jnp.where(ok, p, w)
    store(tok_out.at[b, out], jnp.where(valid, tok, -1), mask=ok)
    store(dep_out.at[b, out], jnp.where(valid, d + 1, 1), mask=ok)
    store(par_out.at[b, out], parent, mask=ok)
    store(bits_out.at[b, (out + 1)[:, None], word], words, mask=ok[:, None] & (word >= 0))
    first = (t == 0) & (word[0] >= 0)  # the root's row: itself only
    store(bits_out.at[b, jnp.int32(0), word[0]], jnp.where(word[0] == 0, 1, 0), mask=first)


def supports(budget: int, k: int, depths: int) -> bool:
    """Whether the kernels take lists of ``depths`` x k for a tree of ``budget``: 0 < k <= budget, depths >= 1, at
    most ``MAX_PAIRS`` candidate pairs (padded; budgets up to 1024; timed on a GPU up to 512)."""
    return 0 < k <= budget and depths >= 1 and pow2(len(candidate_pairs(budget, k)[0])) <= MAX_PAIRS


@functools.partial(jax.jit, static_argnames=("budget", "k", "interpret", "warps"))
def best_first(lp: jax.Array, ids: jax.Array, budget: int, k: int | None = None, *, interpret: bool = False,
               warps: int = WARPS):
    """(tokens, depths, parents) [B, budget] and bits [B, 1 + budget, ceil((1 + budget) / 32)] uint32 of DDTree's tree
    from lp [B, Dp, K] float32 and ids [B, Dp, K] int32 sorted descending per depth in their first k <= K columns
    (default K; k <= budget), as ``tree._best_first_one`` and ``tree.ancestor_bits`` give them (parents: tree indices,
    the root 0). ``interpret``: the Pallas interpreter (CPU); ``warps``: of each program."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    b, dp, kk = lp.shape
    k = kk if k is None else k
    if lp.dtype != jnp.float32 or ids.shape != lp.shape or k > kk or not supports(budget, k, dp):
        raise ValueError(f"best_first takes float32 lists [B, Dp, K] with 0 < K <= budget and at most {MAX_PAIRS} "
                         f"candidate pairs (supports()), got {lp.dtype} {lp.shape}, ids {ids.shape}, k {k}, "
                         f"budget {budget}")
    w = budget
    ii, jj = candidate_pairs(w, k)
    n, dpp, nw = len(ii), pow2(dp), pow2(-(-(w + 1) // 32))
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    params = pltriton.CompilerParams(num_warps=warps, num_stages=1)
    scratch = (f32(b, dp, w + 1), i32(b, dp, w + 1), i32(b, dp, w + 1), i32(b, dp, w + 1, dpp), f32(b, 2, w + 1),
               i32(b, 2, w + 1), i32(b, dp * w + 1))

    own_p = own_m = own_per_program(n)
    progs_p = -(-n // own_p)

    def depth(first: bool):  # the first call reads none of the scratch: fresh (unwritten) buffers, no zero fill
        return pl.pallas_call(
            functools.partial(_depth_kernel, w=w, k=k, dp=dp, dpp=dpp, n=n, own_p=own_p, own_m=own_m, progs_p=progs_p,
                              first=first),
            grid=(b, max(progs_p, -(-2 * w // own_m))), out_shape=scratch,
            input_output_aliases={} if first else {5 + a: a for a in range(len(scratch))}, compiler_params=params,
            interpret=interpret, name="best_first_depth")

    args = (lp, ids.astype(jnp.int32), jnp.asarray(ii), jnp.asarray(jj))
    bufs = depth(True)(jnp.ones((1,), jnp.int32), *args)
    for d in range(2, dp + 1):
        bufs = depth(False)(jnp.full((1,), d, jnp.int32), *args, *bufs)
    score, tok, _, anc, rs, rq, place = bufs
    tokens, depths, parents, bits = pl.pallas_call(
        functools.partial(_nodes_kernel, w=w, dp=dp, dpp=dpp, nw=nw, fin=(dp - 1) % 2),
        grid=(b, -(-w // NODES_OWN)), out_shape=(i32(b, w + 1), i32(b, w + 1), i32(b, w + 1), i32(b, w + 2, nw)),
        compiler_params=params, interpret=interpret, name="best_first_nodes",
    )(score, tok, anc, rs, rq, place)
    words = -(-(w + 1) // 32)
    return (tokens[:, :w], depths[:, :w], parents[:, :w],
            jax.lax.bitcast_convert_type(bits[:, : w + 1, :words], jnp.uint32))
