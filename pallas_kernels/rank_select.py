"""Top-k by rank counting, one Pallas kernel (the Triton lowering) per selection: the tree build's selections.

DDTree's tree build (``ddtree_jax.tree``) selects, at each depth after the first, the best W of about W ln W
candidate paths (candidate c extends frontier slot ``ii[c]`` by the token of rank ``jj[c]``: score
``frontier[ii[c]] + lp[jj[c]]``), then the best N over all depths. XLA makes each selection a chain of three or four
small kernels (the scores, their ranks, the one-hot pick, the gathers) and the chain is what the build's time is
made of. Here a selection is one kernel: program (b, g) computes the scores of all of row b's candidates (gathers
from L2), counts for each of its own S candidates how many come before it (a larger score, or an equal one at a
lower index: ``lax.top_k``'s order), and writes every candidate to the slot of its rank (the first k are kept).
The ranks are a permutation, so every slot gets exactly one writer: exactly ``lax.top_k`` (values, indices and ties; the tests
check it bit for bit). Scores are compared as ``tree.top_k_by_count`` does, through their bits in float order.

Shapes (B rows, n candidates, padded to Np, a power of two, for the Triton lowering's power-of-two tensors):
    rank_top_k    x [B, n] f32                                              -> vals, ids [B, k]
    expand_top_k  frontier [B, W] f32, lp [B, K] f32, ids [B, K] int32,
                  ii, jj [n] static int32 (candidate c = (ii[c], jj[c]))     -> vals, ids[jj[pick]], ii[pick] [B, k]
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

_TILE = 256  # candidates compared per step of a program's (unrolled) loop
_PROGRAMS = 128  # programs per row, at most: S = Np / 128 candidates each, at least 16


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _order_key(s):
    """int32 keys in the float total order (-0.0 below +0.0), as ``tree.top_k_by_count``."""
    bits = jax.lax.bitcast_convert_type(s, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _select(arrays, n: int, k: int, expand: bool, interpret: bool):
    """One pallas_call; ``arrays``: (x,) or (frontier, lp, ids, ii, jj), padded. Returns (vals, a, b) [B, k]."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    b = arrays[0].shape[0]
    np_ = _pow2(n)
    per = max(16, np_ // _PROGRAMS)  # S
    tile = min(_TILE, np_)
    grid = (b, -(-np_ // per))

    def kernel(*refs):
        row, g = pl.program_id(0), pl.program_id(1)
        if expand:
            base_ref, lp_ref, ids_ref, ii_ref, jj_ref, val_ref, tok_ref, slot_ref = refs
        else:
            base_ref, val_ref, slot_ref = refs

        def scores(c):  # candidate indices c [m] (< Np) -> their scores [m] f32 (and, expanding, ii[c], jj[c])
            if not expand:
                return pltriton.load(base_ref.at[row, c]), c, None
            i, j = pltriton.load(ii_ref.at[c]), pltriton.load(jj_ref.at[c])
            return pltriton.load(base_ref.at[row, i]) + pltriton.load(lp_ref.at[row, j]), i, j

        mine = g * per + jnp.arange(per, dtype=jnp.int32)
        s_mine, slot_mine, j_mine = scores(mine)
        key_mine = _order_key(s_mine)[:, None]
        rank = jnp.zeros((per,), jnp.int32)
        for t in range(np_ // tile):  # unrolled: every tile's loads can be in flight at once
            c = t * tile + jnp.arange(tile, dtype=jnp.int32)
            key_c = _order_key(scores(c)[0])[None, :]
            before = (key_c > key_mine) | ((key_c == key_mine) & (c[None, :] < mine[:, None]))
            rank = rank + jnp.sum((before & (c < n)[None, :]).astype(jnp.int32), axis=1)
        # Every candidate goes to its rank, each padding entry to its own index (>= n): Np distinct slots, no
        # masked stores (the caller keeps the first k).
        to = jnp.where(mine < n, rank, mine)
        val_ref[row, to] = s_mine
        slot_ref[row, to] = slot_mine
        if expand:
            tok_ref[row, to] = pltriton.load(ids_ref.at[row, j_mine])

    out = [jax.ShapeDtypeStruct((b, np_), jnp.float32), jax.ShapeDtypeStruct((b, np_), jnp.int32)]
    if expand:
        out.insert(1, jax.ShapeDtypeStruct((b, np_), jnp.int32))
    res = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=tuple(out),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="expand_top_k" if expand else "rank_top_k",
    )(*arrays)
    return tuple(r[:, :k] for r in res)


@functools.partial(jax.jit, static_argnames=("k", "interpret"))
def rank_top_k(x: jax.Array, k: int, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """Exactly ``lax.top_k(x, k)`` for x [B, n] float32 (values and int32 ids [B, k], ties: lower index first)."""
    if x.ndim != 2 or x.dtype != jnp.float32 or not 0 < k <= x.shape[1]:
        raise ValueError(f"rank_top_k takes x [B, n] float32 and 0 < k <= n, got {x.shape} {x.dtype}, k={k}")
    n = x.shape[1]
    xp = jnp.pad(x, ((0, 0), (0, _pow2(n) - n)), constant_values=-jnp.inf)
    return _select((xp,), n, k, False, interpret)


def expand_top_k(frontier: jax.Array, lp: jax.Array, ids: jax.Array, ii: np.ndarray, jj: np.ndarray, k: int, *,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One depth of the tree build: the top k of the candidates ``frontier[:, ii] + lp[:, jj]`` (frontier [B, W]
    f32, lp [B, K] f32, ids [B, K] int32; ii, jj [n] static, n >= k), as (scores [B, k] f32, ids[:, jj[pick]],
    ii[pick]): exactly ``lax.top_k`` over the candidates in their given order, then the two gathers."""
    ii, jj = np.asarray(ii, np.int32), np.asarray(jj, np.int32)
    n = len(ii)
    if not 0 < k <= n or len(jj) != n or ii.max() >= frontier.shape[1] or jj.max() >= lp.shape[1]:
        raise ValueError(f"expand_top_k: k={k} of {n} candidates, ii < {frontier.shape[1]}, jj < {lp.shape[1]}")
    pad = (0, _pow2(n) - n)
    tables = (jnp.asarray(np.pad(ii, pad)), jnp.asarray(np.pad(jj, pad)))
    return _select((frontier.astype(jnp.float32), lp.astype(jnp.float32), ids.astype(jnp.int32), *tables),
                   n, k, True, interpret)
