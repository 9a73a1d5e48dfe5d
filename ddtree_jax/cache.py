"""Static KV caches: one array per K and V, every layer stacked, per-sequence committed lengths.

A cache slot s of sequence b holds the token at position s. Forward passes write their new tokens'
K/V at slots ``length[b] ..`` without committing them; the caller commits (advances ``length``),
after the tree walk has moved the accepted path's K/V next to the prefix (:func:`compact`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: Array  # [L, B, S, K, hd]
    v: Array  # [L, B, S, K, hd]
    length: Array  # [B] int32: committed slots

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


def init(num_layers: int, batch: int, capacity: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
    shape = (num_layers, batch, capacity, kv_heads, head_dim)
    return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))


def write_layer(kv: Array, layer: Array | int, new: Array, start: Array) -> Array:
    """Scatter ``new`` [B, T, K, hd] into ``kv`` [L, B, S, K, hd] at layer ``layer``, slots start[b] + t."""
    b, t = new.shape[:2]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    slots = start[:, None] + jnp.arange(t)[None, :]
    return kv.at[layer, rows, slots].set(new.astype(kv.dtype), mode="drop")


def write_all(kv: Array, new: Array, start: Array) -> Array:
    """Scatter ``new`` [L, B, T, K, hd] into every layer at slots start[b] + t."""
    _, b, t = new.shape[:3]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    slots = start[:, None] + jnp.arange(t)[None, :]
    return kv.at[:, rows, slots].set(new.astype(kv.dtype), mode="drop")


def compact(cache: KVCache, keep: Array, count: Array) -> KVCache:
    """Commit an accepted path written as a block at slots length ...

    keep  [B, P] int32  block-relative indices of the accepted nodes, root first (padded entries repeat
                        a valid index); count [B] int32 how many of them are accepted.
    The K/V of block slot keep[b, i] moves to slot length[b] + i, and length grows by count.
    """
    b, p = keep.shape
    src = cache.length[:, None] + keep  # [B, P]
    rows = jnp.arange(b)[:, None]

    def move(kv):
        picked = kv[:, rows, src]  # [L, B, P, K, hd]
        return write_all(kv, picked, cache.length)

    return KVCache(move(cache.k), move(cache.v), cache.length + count)
