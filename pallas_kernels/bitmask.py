"""Bit-packed visibility masks: bit j of row t says whether query t may see block key j.

Word w of a row holds keys 32*w .. 32*w+31, least significant bit first. Packed rows are what the attention
(``tree_attention``, kernel and reference) reads (a 1024-node tree row is 32 words instead of 1024 bytes); the tree
build, the decoder and the drafter make them with these functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def num_words(n: int) -> int:
    return (n + 31) // 32


def pack_bits(mask: jax.Array) -> jax.Array:
    """[..., n] bool -> [..., ceil(n/32)] uint32."""
    n = mask.shape[-1]
    w = num_words(n)
    padded = jnp.pad(mask, [(0, 0)] * (mask.ndim - 1) + [(0, 32 * w - n)])
    bits = padded.reshape(*mask.shape[:-1], w, 32).astype(jnp.uint32)
    return jnp.sum(bits << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


def unpack_bits(words: jax.Array, n: int) -> jax.Array:
    """[..., W] uint32 -> [..., n] bool."""
    bits = (words[..., :, None] >> jnp.arange(32, dtype=jnp.uint32)) & jnp.uint32(1)
    return bits.reshape(*words.shape[:-1], -1)[..., :n].astype(bool)


def causal_bits(batch: int, t: int) -> jax.Array:
    """Packed lower-triangular mask [batch, t, ceil(t/32)]: prefill and AR steps."""
    tri = jnp.tril(jnp.ones((t, t), dtype=bool))
    return jnp.broadcast_to(pack_bits(tri), (batch, t, num_words(t)))


def full_bits(batch: int, t: int) -> jax.Array:
    """Packed all-visible mask [batch, t, ceil(t/32)]: the drafter's non-causal block."""
    return jnp.broadcast_to(pack_bits(jnp.ones((t, t), dtype=bool)), (batch, t, num_words(t)))


def pad_rows(words: jax.Array, t: int) -> jax.Array:
    """A packed mask [B, n, ceil(n/32)] grown to [B, t, ceil(t/32)]: the n rows unchanged (they see no new key),
    each added row seeing itself only."""
    b, n, w = words.shape
    if t == n:
        return words
    own = pack_bits(jnp.eye(t, dtype=bool)[n:])  # [t - n, ceil(t/32)], a constant
    grown = jnp.pad(words, [(0, 0), (0, 0), (0, num_words(t) - w)])
    return jnp.concatenate([grown, jnp.broadcast_to(own, (b, *own.shape))], axis=1)
