"""The DFlash training objective (arXiv 2602.06036) over packed rows, with block-sparse attention in groups.

A training row holds whole sequences one after another (:mod:`ddtree_jax.training.dataset`): tokens, their
positions within their own sequence, and which tokens are the target's response (the supervised ones). Per row:

    features   the target's hidden taps at every position (one causal forward, each sequence seeing only itself)
    anchors    up to A positions drawn without replacement among response tokens followed by another response
               token of the same sequence, redrawn every step: uniformly, or with a half-life H weighted
               2^(-r/H) at the r-th token of its response (more blocks early in answers)
    blocks     block i = [x_a, MASK x (bs-1)] at positions pos(a) .. pos(a)+bs-1; bidirectional inside the block;
               it sees the context features of its own sequence strictly before a, never another block
    labels     slot k predicts the token at a + k (slot 0, the anchor itself, has no loss); the cross-entropy of
               slot k weighs exp(-(k-1)/gamma), and the loss is the weighted sum over the weights' sum

The drafter's layers are :mod:`ddtree_jax.draft`'s (``model.qkv``, ``model.mlp``, ``model.rms_norm``, the target's
embedding and lm_head): the context K/V of every layer are computed once per row, and the blocks run through the
layers in groups of ``group`` anchors under ``jax.checkpoint``, so no array of [A x bs, T] scores or [A x bs, V]
logits is ever alive for all anchors at once (the memory of a step grows with the group, not with A).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import cache as kvcache
from ddtree_jax import model
from ddtree_jax.config import DraftConfig
from ddtree_jax.params import DraftParams, TargetParams
from pallas_kernels.bitmask import num_words

Array = jax.Array
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # DFlash's loss-decay constants by block size
LOSSES = ("ce", "kl")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    """Packed training rows (:func:`ddtree_jax.training.dataset.pack`)."""

    tokens: Array  # [B, T] int32
    positions: Array  # [B, T] int32: position within the token's own sequence (0 at each sequence's first token)
    supervised: Array  # [B, T] bool: the target's response tokens

    @property
    def segment_start(self) -> Array:
        """[B, T] the row index where each token's sequence starts."""
        return jnp.arange(self.tokens.shape[1])[None, :] - self.positions


def gamma_for(block_size: int, gamma: float | None = None) -> float:
    return gamma or DEFAULT_GAMMA.get(block_size, block_size / 2.3)


def depth_weights(block_size: int, gamma: float) -> np.ndarray:
    """[bs-1] the loss weight of slots 1 .. bs-1: exp(-(k-1)/gamma)."""
    return np.exp(-np.arange(block_size - 1) / gamma).astype(np.float32)


# ---------------------------------------------------------------------------------------------- target features


def segment_bits(positions: Array) -> Array:
    """The packed causal mask of rows of whole sequences, [B, T, ceil(T/32)] uint32: token i sees tokens j of its
    own sequence with j <= i (``pallas_kernels.bitmask``'s layout: bit j % 32 of word j // 32)."""
    b, t = positions.shape
    i = jnp.arange(t)[None, :, None]
    lo = (i - positions[:, :, None])  # [B, T, 1] the sequence's first index
    word = 32 * jnp.arange(num_words(t))[None, None, :]

    def low_bits(n):  # the n lowest bits set, n in [0, 32]
        n = jnp.clip(n, 0, 32).astype(jnp.uint32)
        return jnp.where(n >= 32, jnp.uint32(0xFFFFFFFF), (jnp.uint32(1) << jnp.minimum(n, 31)) - jnp.uint32(1))

    return low_bits(i + 1 - word) & ~low_bits(lo - word)


def target_features(target: tuple, taps: tuple[int, ...], batch: Batch,
                    attention: str = "xla") -> tuple[Array, Array]:
    """The target over packed rows: (hidden taps [B, T, taps*D], final hidden [B, T, D]), each sequence of a row
    computed as if alone (its own positions, attention within itself). No gradient flows into the target.
    ``attention``: the decoder's implementation (``model.attention_fn``; 'xla' materialises the [B, H, T, T] scores,
    'pallas' is the tree-attention kernel over the segment mask's bits)."""
    cfg, params = target
    b, t = batch.tokens.shape
    cache = kvcache.init(cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim, params.embed.dtype)
    hidden, _, feats = model.forward(params, cfg, batch.tokens, batch.positions, cache, segment_bits(batch.positions),
                                     taps=taps, attention=attention)
    return jax.lax.stop_gradient(feats), jax.lax.stop_gradient(hidden)


# ---------------------------------------------------------------------------------------------- anchors


def response_offsets(batch: Batch) -> Array:
    """[B, T] int32: how many response tokens of its own sequence precede each token (a response token's index in
    its response)."""
    sup = batch.supervised.astype(jnp.int32)
    before = jnp.cumsum(sup, axis=1) - sup  # response tokens of the row strictly before each token
    return before - jnp.take_along_axis(before, batch.segment_start, axis=1)


def sample_anchors(key: Array, batch: Batch, num: int, half_life: int | None = None) -> tuple[Array, Array]:
    """(anchors [B, num] int32, valid [B, num] bool): distinct positions drawn among the response tokens followed by
    another response token of the same sequence: uniformly, or with ``half_life`` H without replacement in proportion
    to 2^(-r/H), r the position's :func:`response_offsets` (Gumbel top-k); rows with fewer such positions get
    invalid extras (anchor 0, no loss)."""
    sup, pos = batch.supervised, batch.positions
    ok = sup[:, :-1] & sup[:, 1:] & (pos[:, 1:] == pos[:, :-1] + 1)
    ok = jnp.pad(ok, ((0, 0), (0, 1)))  # [B, T]
    if half_life:
        score = jax.random.gumbel(key, ok.shape) - response_offsets(batch) * (math.log(2.0) / half_life)
    else:
        score = -jax.random.uniform(key, ok.shape)
    top, idx = jax.lax.top_k(jnp.where(ok, score, -jnp.inf), num)  # the num highest scores among the valid positions
    valid = top > -jnp.inf
    return jnp.where(valid, idx, 0).astype(jnp.int32), valid


# ---------------------------------------------------------------------------------------------- the drafter


def context_kv(params: DraftParams, cfg: DraftConfig, features: Array, positions: Array) -> tuple[Array, Array]:
    """Every layer's context K and V [L, B, T, K, hd] from the target features [B, T, taps*D] (``fc``, ``hidden_norm``,
    each layer's k/v projections, k_norm and RoPE at the tokens' positions): what ``draft.extend`` caches."""
    lc = cfg.layers
    dt = params.fc.dtype
    ctx = jnp.einsum("btf,fd->btd", features.astype(dt), params.fc, preferred_element_type=jnp.float32)
    ctx = model.rms_norm(ctx, params.hidden_norm, lc.rms_norm_eps)
    cos, sin = model.rope_tables(lc, positions)

    def kv(w):
        _, k, v = model.qkv(ctx, w, lc.rms_norm_eps, cos, sin)
        return k, v

    return jax.vmap(kv)(params.layers)


def block_attention(q: Array, kc: Array, vc: Array, kb: Array, vb: Array, visible: Array) -> Array:
    """Block queries over their context and their own block.

    q [B, G, S, H, hd]; kc, vc [B, T, K, hd] (the row's context); kb, vb [B, G, S, K, hd] (each block's own keys);
    visible [B, G, T] bool (the context keys each block sees) -> [B, G, S, H, hd]. Softmax in f32 over T + S keys.
    """
    b, g, s, h, hd = q.shape
    kh = kc.shape[2]
    qg = q.reshape(b, g, s, kh, h // kh, hd)
    scale = 1.0 / math.sqrt(hd)
    sc = jnp.einsum("bgskqd,btkd->bgskqt", qg, kc, preferred_element_type=jnp.float32) * scale
    sb = jnp.einsum("bgskqd,bgjkd->bgskqj", qg, kb, preferred_element_type=jnp.float32) * scale
    sc = jnp.where(visible[:, :, None, None, None, :], sc, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.maximum(jnp.max(sc, axis=-1), jnp.max(sb, axis=-1)))[..., None]  # finite: a block
    # always sees itself
    pc, pb = jnp.exp(sc - m), jnp.exp(sb - m)
    denom = jnp.sum(pc, axis=-1, keepdims=True) + jnp.sum(pb, axis=-1, keepdims=True)
    o = (jnp.einsum("bgskqt,btkd->bgskqd", pc.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
         + jnp.einsum("bgskqj,bgjkd->bgskqd", pb.astype(vb.dtype), vb, preferred_element_type=jnp.float32))
    return (o / denom[..., 0, None]).reshape(b, g, s, h, hd).astype(q.dtype)


def block_hidden(params: DraftParams, cfg: DraftConfig, embed: Array, kv: tuple[Array, Array], batch: Batch,
                 anchors: Array) -> Array:
    """The drafter's output (after its final norm) for the blocks at ``anchors`` [B, G]: [B, G, bs, D] f32.
    kv: :func:`context_kv`'s [L, B, T, K, hd] pair."""
    lc, bs = cfg.layers, cfg.block_size
    b, g = anchors.shape
    t = batch.tokens.shape[1]
    first = jnp.take_along_axis(batch.tokens, anchors, axis=1)
    tokens = jnp.concatenate([first[..., None], jnp.full((b, g, bs - 1), cfg.mask_token_id, jnp.int32)], -1)
    start = jnp.take_along_axis(batch.positions, anchors, axis=1)  # the anchor's position in its sequence
    cos, sin = model.rope_tables(lc, (start[..., None] + jnp.arange(bs)).reshape(b, g * bs))
    lo = jnp.take_along_axis(batch.segment_start, anchors, axis=1)
    key = jnp.arange(t)[None, None, :]
    visible = (key >= lo[..., None]) & (key < anchors[..., None])  # [B, G, T]: its sequence, strictly before a
    x = jnp.take(embed, tokens.reshape(b, g * bs), axis=0).astype(jnp.float32)  # [B, G*bs, D]

    def layer(x, inputs):
        w, kc, vc = inputs
        h = model.rms_norm(x, w.attn_norm, lc.rms_norm_eps)
        q, kb, vb = model.qkv(h, w, lc.rms_norm_eps, cos, sin)  # [B, G*bs, ...]
        split = lambda z: z.reshape(b, g, bs, *z.shape[2:])  # noqa: E731
        o = block_attention(split(q), kc, vc, split(kb), split(vb), visible)
        x = x + jnp.einsum("bthk,hkd->btd", o.reshape(b, g * bs, *o.shape[3:]), w.wo,
                           preferred_element_type=jnp.float32)
        x = x + model.mlp(model.rms_norm(x, w.mlp_norm, lc.rms_norm_eps), w)
        return x, None

    x, _ = jax.lax.scan(layer, x, (params.layers, *kv))
    return model.rms_norm(x, params.final_norm, lc.rms_norm_eps).reshape(b, g, bs, -1).astype(jnp.float32)


# ---------------------------------------------------------------------------------------------- the loss


def label_nll(logits: Array, labels: Array) -> Array:
    """-log softmax(logits)[label]: logits [..., V] f32, labels [...] int -> [...] f32, as logsumexp minus the
    label's logit (the [..., V] log-probabilities are never formed)."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]


@dataclasses.dataclass(frozen=True)
class Objective:
    """Static settings of the loss: anchors per row, anchors per group, how they are drawn, the decay, hard labels
    or KL."""

    anchors: int = 512
    group: int = 32
    half_life: int | None = None  # anchors weighted 2^(-r/half_life) at response offset r (None: uniform)
    gamma: float | None = None
    loss: str = "ce"  # "ce": cross-entropy on the target's tokens; "kl": KL(target || drafter) per slot


def loss_terms(params: DraftParams, cfg: DraftConfig, target: tuple, batch: Batch, key: Array, obj: Objective,
               attention: str = "xla"):
    """(loss, metrics) of one step over packed rows, for ``jax.value_and_grad(..., has_aux=True)``: the target's
    features (:func:`target_features`, its forward with ``attention``), then :func:`draft_loss`. params: the drafter
    in its compute dtype; target: (ModelConfig, TargetParams), frozen."""
    feats, final = target_features(target, cfg.target_layer_ids, batch, attention)
    return draft_loss(params, cfg, target[1], feats, final if obj.loss == "kl" else None, batch, key, obj)


def draft_loss(params: DraftParams, cfg: DraftConfig, tparams: TargetParams, feats: Array, final: Array | None,
               batch: Batch, key: Array, obj: Objective):
    """The drafter's loss given the target's features [B, T, taps*D] (and, for ``obj.loss`` "kl", its final hidden
    states [B, T, D]). metrics: label count, per-slot correct counts and label counts [bs-1], and the greedy chain's
    expected acceptance length (1 + the leading run of correct slots, averaged over blocks): the training-side
    estimate of dflash's tau."""
    bs = cfg.block_size
    head, embed = tparams.head(), tparams.embed
    kv = context_kv(params, cfg, feats, batch.positions)
    b, t = batch.tokens.shape
    num, size = min(obj.anchors, t), min(obj.group, obj.anchors, t)
    anchors, valid = sample_anchors(key, batch, num, obj.half_life)
    groups = -(-num // size)
    anchors, valid = (jnp.pad(x, ((0, 0), (0, groups * size - num))) for x in (anchors, valid))
    w_depth = jnp.asarray(depth_weights(bs, gamma_for(bs, obj.gamma)))

    @jax.checkpoint
    def group_terms(carry, xs):
        a, ok = xs  # [B, G]
        hidden = block_hidden(params, cfg, embed, kv, batch, a)[:, :, 1:]  # [B, G, bs-1, D]
        label_at = a[..., None] + 1 + jnp.arange(bs - 1)  # [B, G, bs-1]
        at = jnp.minimum(label_at, t - 1).reshape(b, -1)
        gather = lambda z: jnp.take_along_axis(z, at, axis=1).reshape(label_at.shape)  # noqa: E731
        same_seq = gather(batch.positions) == jnp.take_along_axis(batch.positions, a, 1)[..., None] + 1 + jnp.arange(
            bs - 1)
        live = ok[..., None] & (label_at < t) & same_seq & gather(batch.supervised)
        labels = gather(batch.tokens)
        logits = jnp.einsum("bgkd,dv->bgkv", hidden.astype(head.dtype), head, preferred_element_type=jnp.float32)
        if obj.loss == "kl":  # the target's distribution of the token at a+k comes from its hidden state at a+k-1
            logq = jax.nn.log_softmax(logits, axis=-1)
            prev = jnp.take_along_axis(final, (at - 1)[..., None], axis=1)  # [B, G*(bs-1), D]
            logp = jax.nn.log_softmax(model.logits(tparams, prev).reshape(logq.shape), axis=-1)
            per = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
        else:
            per = label_nll(logits, labels)
        w = w_depth * live
        correct = (jnp.argmax(logits, axis=-1) == labels) & live
        run = jnp.cumprod((correct | ~live).astype(jnp.float32), axis=-1) * live  # the greedy chain's accepted slots
        f32 = functools.partial(jnp.sum, dtype=jnp.float32)
        loss_sum, w_sum, hits, counts, accepted, blocks = carry
        carry = (loss_sum + f32(per * w), w_sum + f32(w), hits + f32(correct, axis=(0, 1)),
                 counts + f32(live, axis=(0, 1)), accepted + f32(run), blocks + f32(ok))
        return carry, None

    zeros = jnp.zeros((bs - 1,), jnp.float32)
    init = (jnp.float32(0), jnp.float32(0), zeros, zeros, jnp.float32(0), jnp.float32(0))
    xs = tuple(x.reshape(b, groups, size).transpose(1, 0, 2) for x in (anchors, valid))
    (loss_sum, w_sum, hits, counts, accepted, blocks), _ = jax.lax.scan(group_terms, init, xs)
    loss = loss_sum / jnp.maximum(w_sum, 1e-6)
    return loss, {"labels": jnp.sum(counts), "hits": hits, "counts": counts,
                  "chain_tau": 1.0 + accepted / jnp.maximum(blocks, 1.0)}


def flops_per_row(target_cfg, cfg: DraftConfig, seq_len: int, anchors: int) -> float:
    """Model FLOPs of one training row (an estimate for the run record, matmuls only, the work as computed): the
    target's forward (its attention over the whole row, as the XLA path computes it), and the drafter's groups run
    forward, again under ``jax.checkpoint``, and backward (layers: weights and inputs; the frozen head: inputs)."""
    def layer_params(c):
        return c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * \
            c.hidden_size + 3 * c.hidden_size * c.intermediate_size

    tc, lc, bs = target_cfg, cfg.layers, cfg.block_size
    target = (2 * tc.num_layers * layer_params(tc) * seq_len
              + 4 * tc.num_layers * tc.num_heads * tc.head_dim * seq_len ** 2)
    rows = anchors * bs
    layers = 2 * lc.num_layers * layer_params(lc) * rows + 4 * lc.num_layers * lc.num_heads * lc.head_dim * rows * (
        seq_len + bs)
    head = 2 * lc.hidden_size * lc.vocab_size * anchors * (bs - 1)
    context = 2 * (cfg.num_taps * tc.hidden_size * lc.hidden_size + lc.num_layers * 2 * lc.hidden_size
                   * lc.num_kv_heads * lc.head_dim) * seq_len
    return target + 4 * layers + 3 * head + 3 * context
