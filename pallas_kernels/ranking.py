"""Rank counting inside one Pallas (Triton) program: each of a few own entries' place in ``lax.top_k``'s order among
many others (larger key first, ties: lower index first) = the number of them before it.

The others come a tile at a time from memory, in groups whose loads are all issued before their compares (so that
their latencies can overlap rather than add up, one per tile), and the compares of a tile, [own, tile], stay small
([64, 256] tiles were much slower than [32, 64] on an H200, presumably spilling registers). The tiles' compares add
up elementwise in an [own, tile] count, summed over its tile axis once at the end: a sum over that axis is a
reduction across the program's threads (shuffles, and a layout change for the [own] result), which per tile cost
more than the tile's compares (``vocab_top_k``'s rank kernel took a third to a half less time summing at the end).

Used by ``vocab_top_k``'s rank kernel (``rank_count``) and by ``best_first`` and ``ddtree_jax.tree``'s rank counting
(``comes_before``); the order is ``lax.top_k``'s, the reference the callers' tests check against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

def comes_before(keys, idxs, key, idx):
    """Whether entries (keys, idxs) come before (key, idx) in ``lax.top_k``'s order: a larger order key (see
    ``selection.order_key``), or an equal one at a lower index. Any broadcastable shapes (Pallas or XLA)."""
    return (keys > key) | ((keys == key) & (idxs < idx))


def rank_count(key, idx, load_tile, n_tiles, tile: int, group: int):
    """key, idx [own] int32 (order keys, tie-break indices) -> rank [own] int32: the others before each.
    ``load_tile(t)`` -> (keys [tile], indices [tile], valid [tile]) of tile t (traced); ``n_tiles`` (traced): tiles
    to compare, in a loop over groups of ``group`` tiles whose loads are issued together."""

    col, col_idx = key[:, None], idx[:, None]

    def compare(count, tiles):
        for ku, iu, oku in tiles:
            before = comes_before(ku[None, :], iu[None, :], col, col_idx)
            count = count + (before & oku[None, :]).astype(jnp.int32)
        return count

    count = jnp.zeros((key.shape[0], tile), jnp.int32)
    count = jax.lax.fori_loop(0, (n_tiles + group - 1) // group,  # a group's loads first, then its compares
                              lambda g, c: compare(c, [load_tile(g * group + q) for q in range(group)]), count)
    return jnp.sum(count, axis=1)
