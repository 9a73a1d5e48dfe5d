"""Exact selection inside one Pallas (Triton) program, without a sort: ``lax.top_k``'s entries (larger first, ties:
lower index first; the reference the tests check against) from counts and cumsums. ``vocab_top_k``'s chunk selection
builds on these, and ``best_first`` and ``ddtree_jax.tree``'s rank counting on ``order_key``.

Keys are the float32 bits mapped to int32 in the float total order (-0.0 below +0.0; ``order_key``). The largest key
t with count(key >= t) >= k is found by a search that cuts its interval to a third per count (two thresholds
counted at once: at most 21 counts); every key > t is taken, then the first
k - count(key > t) keys equal to t in index order (a cumsum): exactly the k entries ``lax.top_k`` returns.
Positions among them come from a cumsum too.

Everything here is one-dimensional where it can be: the Triton lowering reduces a 2-D tensor axis by axis, with a
layout change in between.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

MIN = np.int32(-(2**31))  # below every key: padding
MAX_KEYS = 2**15 - 1  # keys one select takes at most (its counts share an int32, 16 bits each)


def order_key(x):
    """float32 (or bfloat16, converted exactly) -> int32 keys in the float total order (-0.0 below +0.0)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _unsigned(key):
    """int32 keys -> uint32 in the same order."""
    return jax.lax.bitcast_convert_type(key ^ MIN, jnp.uint32)


def threshold(key, k: int):
    """key [n] int32 -> the k-th largest key t (the largest t with count(key >= t) >= k), by a search that cuts its
    interval to a third per count. n < 2^15 (two counts share an int32)."""
    if key.shape[0] > MAX_KEYS:
        raise ValueError(f"select takes at most {MAX_KEYS} keys, got {key.shape[0]}")
    u = _unsigned(key)

    def third(bounds):  # two thresholds per count: [lo, hi] shrinks to about a third
        lo, hi = bounds
        d = (hi - lo) // 3 + 1  # 1 <= d <= hi - lo
        m1 = lo + d
        m2 = m1 + jnp.minimum(d, hi - m1)  # m1 <= m2 <= hi
        both = jnp.sum((u >= m1).astype(jnp.int32) + ((u >= m2).astype(jnp.int32) << 16))
        c1, c2 = both & 0xFFFF, both >> 16  # c1 >= c2
        return (jnp.where(c2 >= k, m2, jnp.where(c1 >= k, m1, lo)),
                jnp.where(c2 >= k, hi, jnp.where(c1 >= k, m2 - 1, m1 - 1)))

    t, _ = jax.lax.while_loop(lambda b: b[0] < b[1], third, (jnp.uint32(0), jnp.uint32(2**32 - 1)))
    return jax.lax.bitcast_convert_type(t, jnp.int32) ^ MIN


def select(key, k: int):
    """key [n] int32, in index order -> (sel [n] bool: lax.top_k's k entries; slot [n] int32: each selected entry's
    position among them in index order, k for the others). Stores go to ``slot`` with mask ``sel``: an output has a
    spare column k, so that in the interpreter (which writes a masked store's old values back) no unselected entry
    shares a selected one's slot. n < 2^15 (two counts share an int32)."""
    return select_from(key, k, threshold(key, k))


def select_from(key, k: int, t):
    """:func:`select` given t = :func:`threshold`'s: every key > t, then the first keys = t in index order."""
    gt = key > t
    eq = key == t
    need = k - jnp.sum(gt.astype(jnp.int32))
    both = jnp.cumsum(eq.astype(jnp.int32) + (gt.astype(jnp.int32) << 16))  # one scan: counts of eq and gt so far
    eq_so_far, gt_so_far = both & 0xFFFF, both >> 16
    sel = gt | (eq & (eq_so_far <= need))
    return sel, jnp.where(sel, gt_so_far + jnp.minimum(eq_so_far, need) - 1, k)
