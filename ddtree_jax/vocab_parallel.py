"""Vocabulary-parallel argmax, top-k and top-k / top-p filtering over logits [B, ..., V]: under an active mesh
(``sharding.use_mesh``) whose vocabulary axis has more than one device, each device works on its own shard and the
vocabulary is never gathered; otherwise the plain single-device ops.

The greedy argmax is a per-shard argmax + a gather of one (value, index) pair per shard (:func:`argmax`); the tree's
per-depth top-k is a per-shard top-k + a gather of k candidates per shard (:func:`top_k`); top-p / top-k filtering for
sampling finds its cutoff by a 16-step search over the float's bit pattern (``FILTER_BITS`` = 2 bits a step), each step
one all-reduce of the counts and masses above three thresholds, [B, T, 3] each (:func:`filter_logits`); the Gumbel
noise is generated in place (partitionable threefry), so a sampled token is the same on every mesh.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from ddtree_jax import sharding
from ddtree_jax.sharding import Rules

Array = jax.Array


def _vocab_split() -> tuple[Mesh, Rules] | None:
    """The active (mesh, rules) when the vocabulary is split over more than one device, else None."""
    act = sharding.active()
    if act is None or sharding.axis_size(act[0], act[1].vocab) == 1:
        return None
    return act


def _vocab_specs(ndim: int, rules: Rules) -> tuple[P, P]:
    """(split, replicated-over-vocab) specs of [B, ..., V] arrays."""
    mid = (None,) * (ndim - 2)
    return P(rules.batch, *mid, rules.vocab), P(rules.batch, *mid, None)


def gather_shards(x: Array, axis: str) -> Array:
    """Inside shard_map: [..., k] on each device along mesh axis ``axis`` -> [..., M * k], the devices' parts in axis
    order, on every device (a tiled all-gather)."""
    return jax.lax.all_gather(x, axis, axis=x.ndim - 1, tiled=True)


def _from_shard_candidates(x: Array, local: Callable, pick: Callable, n_out: int) -> tuple[Array, ...]:
    """Under a vocabulary split of x [B, ..., V]: on each device ``local(shard) -> (vals, ids)`` [..., k] (ids within
    the shard), the devices' candidates gathered in shard order with global ids (:func:`gather_shards`), then
    ``pick(vals, ids)`` on every device: ``n_out`` arrays [B, ..., k'], replicated over the vocabulary axis."""
    mesh, rules = _vocab_split()
    split, rep = _vocab_specs(x.ndim, rules)

    def shard(x):
        vals, ids = local(x)
        ids = ids + jax.lax.axis_index(rules.vocab).astype(ids.dtype) * x.shape[-1]
        return pick(gather_shards(vals, rules.vocab), gather_shards(ids, rules.vocab))

    # the gathered candidates are the same on every vocabulary shard, which check_vma cannot infer
    return sharding.shard_map_open(shard, mesh, (split,), (rep,) * n_out, check_vma=False)(x)


def top_k(x: Array, k: int, local: Callable = jax.lax.top_k) -> tuple[Array, Array]:
    """``local(x, k)`` (lax.top_k or an exact equivalent) over the last axis [B, ..., V]; vocabulary-parallel
    under a mesh: each device takes the top k of its shard with ``local``, the k * M candidates are gathered
    (not the V logits) and reduced. Same result and tie order (lower index first) as lax.top_k."""
    if _vocab_split() is None:
        return local(x, k)

    def pick(vals, ids):
        best, pos = jax.lax.top_k(vals, k)
        return best, jnp.take_along_axis(ids, pos, axis=-1)

    return _from_shard_candidates(x, lambda s: local(s, min(k, s.shape[-1])), pick, 2)


def argmax(x: Array) -> Array:
    """``jnp.argmax(x, axis=-1)`` as int32 (the first of equal maxima, NaN above all); vocabulary-parallel under a
    mesh: each device's (max, first index) over its shard, gathered, then the first best of those: the same index."""
    if _vocab_split() is None:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)

    def local(s):
        ids = jnp.argmax(s, axis=-1).astype(jnp.int32)[..., None]  # [..., 1]
        return jnp.take_along_axis(s, ids, axis=-1), ids

    def pick(vals, ids):
        return (jnp.take_along_axis(ids, jnp.argmax(vals, axis=-1)[..., None], axis=-1),)

    (ids,) = _from_shard_candidates(x, local, pick, 1)
    return ids[..., 0]


def _ordered(x: Array) -> Array:
    """float32 -> uint32 with the same order (-0.0 folded into +0.0)."""
    b = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x).astype(jnp.float32), jnp.uint32)
    return jnp.where(b >> 31 == 1, ~b, b | jnp.uint32(1 << 31))


FILTER_BITS = 2  # bits of the cutoff found per step of the search: 2^2 - 1 thresholds, 16 steps
FILTER_SEARCH_MAX_BYTES = 48 << 20  # one device searches logits up to this size (about an H200's L2), sorts larger


def filter_logits(x: Array, top_p: Array, top_k_: Array) -> Array:
    """Top-k / top-p filtering of tempered logits x [B, T, V] (top_k_ [B]: 0 = off; top_p [B]: 1 = off), on one device
    or over a vocabulary split by the active mesh.

    x is kept iff fewer than k tokens score strictly higher and their probability mass is below top_p (or top_p >= 1):
    the kept set of a sort and a cumulative sum. Both counts fall as x grows, so the kept set is {x >= cutoff}.
    Logits of up to ``FILTER_SEARCH_MAX_BYTES`` on one device, and every shard of a split vocabulary, find the cutoff
    without a sort: a search over x's order-preserving uint32 bit pattern, ``FILTER_BITS`` bits per step (2^bits - 1
    thresholds, each one's count and mass summed over the vocabulary, all-reduced under a mesh; XLA reduces each
    threshold as its own row, reading the logits again). Larger logits on one device are sorted: on an H200 the
    search was faster while the logits fit the 50 MB L2 and the sort beyond (docs/PERFORMANCE.md). Probability sums
    run in a different order in the two forms, so a token whose mass boundary lies within float rounding of top_p may
    fall on either side.
    """
    act = _vocab_split()
    if act is None:
        if x.size * x.dtype.itemsize > FILTER_SEARCH_MAX_BYTES:
            return _filtered_by_sort(x, top_p, top_k_)
        return _filtered_by_search(x, top_p, top_k_, x.shape[-1], lambda v: v, lambda v: v)
    mesh, rules = act
    split, _ = _vocab_specs(x.ndim, rules)
    ax = rules.vocab

    def local(x, top_p, top_k_):
        return _filtered_by_search(x, top_p, top_k_, x.shape[-1] * sharding.axis_size(mesh, ax),
                                   lambda v: jax.lax.psum(v, ax), lambda v: jax.lax.pmax(v, ax))

    return sharding.shard_map_open(local, mesh, (split, P(rules.batch), P(rules.batch)), split)(x, top_p, top_k_)


def _filtered_by_search(x: Array, top_p: Array, top_k_: Array, vocab: int, total: Callable, most: Callable) -> Array:
    """:func:`filter_logits` by a search over (a shard of) the vocabulary; ``total`` / ``most``: sum / max over all."""
    top = most(jnp.max(x, axis=-1, keepdims=True))
    denom = total(jnp.sum(jnp.exp(x - top), axis=-1, keepdims=True))
    k = jnp.where(top_k_ > 0, jnp.minimum(top_k_, vocab), vocab)[:, None, None]
    p = top_p[:, None, None]
    parts = 1 << FILTER_BITS
    cut = jnp.zeros(top.shape, jnp.uint32)  # [B, T, 1]: the cutoff is at least cut
    for step in range(32 // FILTER_BITS):
        width = jnp.uint32(1 << (32 - FILTER_BITS * (step + 1)))  # the search interval's parts
        trial = cut + jnp.arange(1, parts, dtype=jnp.uint32) * width - jnp.uint32(1)  # [B, T, parts - 1]
        above = _ordered(x)[..., None, :] > trial[..., None]  # [B, T, parts - 1, V], fused into the sums
        count, mass = total((jnp.sum(above, axis=-1, dtype=jnp.int32),  # one all-reduce of both under a mesh
                             jnp.sum(jnp.where(above, jnp.exp(x - top)[..., None, :], 0.0), axis=-1)))
        mass = mass / denom
        below = ~((count < k) & ((mass < p) | (p >= 1.0)))  # the trial is below the cutoff (monotone in j)
        cut = cut + jnp.sum(below, axis=-1, keepdims=True, dtype=jnp.uint32) * width
    return jnp.where(_ordered(x) >= cut, x, -jnp.inf)


def _filtered_by_sort(x: Array, top_p: Array, top_k_: Array) -> Array:
    """:func:`filter_logits` on one device by sorting each row and summing the sorted probabilities."""
    vocab = x.shape[-1]
    srt = jnp.sort(x, axis=-1)[..., ::-1]
    k = jnp.where(top_k_ > 0, jnp.minimum(top_k_, vocab), vocab)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None, None].astype(jnp.int32), axis=-1)
    probs = jax.nn.softmax(srt, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted entry
    p = top_p[:, None, None]
    keep_sorted = ((before < p) | (p >= 1.0)) & (jnp.arange(vocab) < k[:, None, None])
    cutoff = jnp.min(jnp.where(keep_sorted, srt, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((x >= cutoff) & (x >= kth), x, -jnp.inf)