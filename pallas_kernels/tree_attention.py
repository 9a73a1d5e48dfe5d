"""Tree attention for the verify step: cached prefix + ancestor-masked tree block, GQA.

Semantics (shared by the reference below and the Pallas kernel):
    q           [B, T, H, hd]   the T new tokens (tree nodes, prefill chunk or one AR token)
    k, v        [B, S, K, hd]   the cache, with the T new tokens' K/V already written at slots
                                prefix_len[b] .. prefix_len[b] + T - 1
    prefix_len  [B] int32       cache slots [0, prefix_len[b]) are visible to every query
    tree_bits   [B, T, W] uint32  query t sees block slot prefix_len[b] + j iff bit j of row t is set
    returns     [B, T, H, hd]   softmax(q k^T * scale) v over the visible slots, f32 accumulation
Query head h reads KV head h // (H // K). Slots beyond prefix_len + T are never visible.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.bitmask import unpack_bits


def visibility(prefix_len: jax.Array, tree_bits: jax.Array, t: int, s: int) -> jax.Array:
    """[B, T, S] bool: which cache slots each query sees."""
    slot = jnp.arange(s)[None, None, :]
    start = prefix_len[:, None, None]
    rel = slot - start
    block = unpack_bits(tree_bits, t)  # [B, T, T]
    in_block = (rel >= 0) & (rel < t)
    seen = jnp.take_along_axis(block, jnp.clip(rel, 0, t - 1).astype(jnp.int32).repeat(t, axis=1), axis=2)
    return (slot < start) | (in_block & seen)


def tree_attention_reference(q, k, v, prefix_len, tree_bits, *, scale: float | None = None, extra_mask=None):
    """Pure-jnp tree attention (the XLA path). ``extra_mask`` [B, T, S] bool further restricts slots."""
    b, t, h, hd = q.shape
    s, kv = k.shape[1], k.shape[2]
    g = h // kv
    scale = hd**-0.5 if scale is None else scale
    qg = q.reshape(b, t, kv, g, hd)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    mask = visibility(prefix_len, tree_bits, t, s)
    if extra_mask is not None:
        mask = mask & extra_mask
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, hd).astype(q.dtype)
