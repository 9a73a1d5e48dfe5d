"""The DFlash block-diffusion drafter (z-lab), as pure functions over a context-only KV cache.

Every drafter layer attends, without a mask, from the block [bonus, mask x (bs-1)] to
[context ; block]. The context is the target's tapped hidden states projected once (``fc`` then
``hidden_norm``) and fed to every layer's k/v projections (with k_norm and RoPE at the tokens'
positions). Only the context K/V persists: :func:`extend` appends it as tokens are committed;
:func:`propose` writes the block's K/V in scratch slots past the committed length and drops it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ddtree_jax import cache as kvcache
from ddtree_jax import model
from ddtree_jax.config import DraftConfig
from ddtree_jax.params import DraftParams, TargetParams
from ddtree_jax.tuning import Tuning
from pallas_kernels.bitmask import full_bits

Array = jax.Array


def extend(
    params: DraftParams, cfg: DraftConfig, dcache: kvcache.KVCache, features: Array, count: Array
) -> kvcache.KVCache:
    """Append context: features [B, C, taps*D] of the next C tokens (the first count[b] valid).

    Their positions are dcache.length[b] + c. Returns the cache with length += count.
    """
    lc = cfg.layers
    b, c, _ = features.shape
    ctx = jnp.einsum("bcf,fd->bcd", features.astype(params.fc.dtype), params.fc, preferred_element_type=jnp.float32)
    ctx = model.rms_norm(ctx, params.hidden_norm, lc.rms_norm_eps)
    positions = dcache.length[:, None] + jnp.arange(c)[None, :]
    cos, sin = model.rope_tables(lc, positions)
    w = params.layers

    om = (w[0] if isinstance(w, (tuple, list)) else w).output_major

    def kv(ctx, wk, wv, k_norm):  # one layer's context K/V, vmapped over the stacked layers below
        k = model.rms_norm(model.linear(ctx, wk, "bcd,dhk->bchk", om), k_norm, lc.rms_norm_eps)
        return model.apply_rope(k, cos, sin), model.linear(ctx, wv, "bcd,dhk->bchk", om)

    if isinstance(w, (tuple, list)):  # unstacked layers (params.unstack_layers)
        per_layer = [kv(ctx, lw.wk, lw.wv, lw.k_norm) for lw in w]
        k, v = jnp.stack([a for a, _ in per_layer]), jnp.stack([c for _, c in per_layer])
    else:  # ctx batched over the layers too: a batched GEMM reading each layer's [D, K, hd] ([K, hd, D]) in place,
        # where a shared ctx lets XLA merge the layers into one GEMM over [D, L * K * hd], a transposed copy of wk, wv
        ctx_l = jnp.broadcast_to(ctx[None], (w.wk.shape[0], *ctx.shape))
        k, v = jax.vmap(kv)(ctx_l, w.wk, w.wv, w.k_norm)  # [L, B, C, K, hd]
    return kvcache.KVCache(
        kvcache.write_all(dcache.k, k, dcache.length),
        kvcache.write_all(dcache.v, v, dcache.length),
        dcache.length + count,
    )


def window_mask(cfg: DraftConfig, positions: Array, capacity: int) -> Array | None:
    """[B, T, S] bool for sliding-window layers (key slot s visible iff pos - s < window)."""
    if cfg.sliding_window is None or "sliding_attention" not in cfg.layer_types:
        return None
    slot = jnp.arange(capacity)[None, None, :]
    return positions[:, :, None] - slot < cfg.sliding_window


def propose(
    params: DraftParams,
    cfg: DraftConfig,
    target: TargetParams,
    dcache: kvcache.KVCache,
    bonus: Array,
    *,
    attention: str = "xla",
    tuning: Tuning = Tuning(),
    return_cache: bool = False,
    depths: int | None = None,
) -> Array | tuple[Array, kvcache.KVCache]:
    """Draft logits [B, depths, V] (f32) for the first ``depths`` (default all bs-1) positions after ``bonus`` [B]:
    the whole block runs; only the output head is cut to those rows.

    The block [bonus, mask x (bs-1)] sits at positions dcache.length[b] + i. The committed cache is
    not changed: the block's K/V go to scratch slots (>= length) that the next :func:`extend`
    overwrites before they can be seen. ``attention`` and ``tuning`` as for ``model.forward``. With
    ``return_cache`` the cache holding those scratch writes is returned too, as (logits, cache): a caller
    that keeps it instead of its input lets XLA write in place rather than copy the whole draft cache
    every round (the copy shows in the HLO).
    """
    lc, bs = cfg.layers, cfg.block_size
    b = bonus.shape[0]
    tokens = jnp.concatenate([bonus[:, None], jnp.full((b, bs - 1), cfg.mask_token_id, bonus.dtype)], axis=1)
    positions = dcache.length[:, None] + jnp.arange(bs)[None, :]
    cos, sin = model.rope_tables(lc, positions)
    x = jnp.take(target.embed, tokens, axis=0).astype(jnp.float32)  # f32 residual stream, as the target
    bits = full_bits(b, bs)
    start = dcache.length
    window = window_mask(cfg, positions, dcache.capacity)
    sliding = jnp.asarray([t == "sliding_attention" for t in (cfg.layer_types or ("full_attention",) * lc.num_layers)])
    attend = model.attention_fn(attention, tuning)
    stacked = None if isinstance(params.layers, (tuple, list)) else params.layers  # q/k norms read in place
    mask = model.layer_mask(attention, bits, start, lc.num_heads, dcache.k, tuning)

    def layer(carry, inputs):
        x, k_all, v_all = carry
        w, i = inputs
        h = model.rms_norm(x, w.attn_norm, lc.rms_norm_eps)
        q, k_all, v_all = model.attention_inputs(h, w, lc.rms_norm_eps, cos, sin, k_all, v_all, i, start, attention,
                                                 stacked, tuning)
        if window is None:
            o = attend(q, k_all, v_all, start, mask, layer=i)
        else:
            extra = jnp.where(sliding[i], window, True)
            o = attend(q, k_all, v_all, start, bits, layer=i, extra_mask=extra)  # the reference (q unpacked)
        x = x + model.linear(o, w.wo, "bthk,hkd->btd", w.output_major, jnp.float32)
        x = x + model.mlp(model.rms_norm(x, w.mlp_norm, lc.rms_norm_eps), w)
        return (x, k_all, v_all), None

    carry = (x, dcache.k, dcache.v)
    if isinstance(params.layers, (tuple, list)):  # unstacked (params.unstack_layers): an unrolled loop
        for i, w in enumerate(params.layers):
            carry, _ = layer(carry, (w, i))
    else:
        carry, _ = jax.lax.scan(layer, carry, (params.layers, jnp.arange(lc.num_layers)))
    x, k_all, v_all = carry
    hidden = model.rms_norm(x, params.final_norm, lc.rms_norm_eps)
    logits = model.logits(target, hidden[:, 1 : bs if depths is None else 1 + depths])
    if return_cache:
        return logits, kvcache.KVCache(k_all, v_all, dcache.length)
    return logits
