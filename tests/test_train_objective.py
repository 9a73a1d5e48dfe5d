"""The DFlash objective on the tiny fixture pair: packed rows give each sequence its own features, the training
forward equals the inference drafter block by block, the loss is the published one computed naively, anchors are
what the objective allows, and the memory of a step at 2,048 tokens x 512 anchors stays far below the dense form."""

from __future__ import annotations

import dataclasses
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import cache as kvcache
from ddtree_jax import draft, model
from ddtree_jax import params as params_lib
from ddtree_jax.shapes import SHAPES, build_params, model_configs
from ddtree_jax.training import objective as O
from pallas_kernels import tree_attention
from pallas_kernels.bitmask import pack_bits

# row 0 packs a sequence of 25 tokens and one of 15 (prompts of 6 and 4); row 1 holds one sequence of 40 (prompt 10)
LENS, PROMPTS = ((25, 15), (40,)), ((6, 4), (10,))


def packed_batch(seed: int = 0) -> O.Batch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 255, (2, 40)).astype(np.int32)
    positions = np.stack([np.concatenate([np.arange(n) for n in lens]) for lens in LENS]).astype(np.int32)
    supervised = np.stack([np.concatenate([np.arange(n) >= p for n, p in zip(lens, ps)])
                           for lens, ps in zip(LENS, PROMPTS)])
    return O.Batch(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(supervised))


def test_segment_bits_are_causal_within_each_sequence():
    batch = packed_batch()
    i, j = np.arange(40)[:, None], np.arange(40)[None, :]
    for r in range(2):
        start = np.asarray(batch.segment_start[r])
        dense = (j <= i) & (j >= start[:, None])
        np.testing.assert_array_equal(np.asarray(O.segment_bits(batch.positions)[r]), np.asarray(pack_bits(dense)))


def test_packed_rows_give_each_sequence_its_own_features(target, drafter):
    batch = packed_batch()
    feats, _ = O.target_features(target, drafter[0].target_layer_ids, batch)
    for lo, hi in ((0, 25), (25, 40)):
        alone = O.Batch(batch.tokens[:1, lo:hi], jnp.arange(hi - lo)[None], batch.supervised[:1, lo:hi])
        want, _ = O.target_features(target, drafter[0].target_layer_ids, alone)
        np.testing.assert_allclose(np.asarray(feats[0, lo:hi]), np.asarray(want[0]), atol=1e-4, rtol=1e-4)


def test_the_tree_kernel_gives_the_packed_rows_features_of_xla():
    """The trainer's target forward may run through the tree-attention kernel over the segment mask's bits (bf16,
    head_dim 64: random weights of the tiny shape, two layers): the features of XLA's attention, packing and all."""
    tcfg, dcfg = model_configs(dataclasses.replace(SHAPES["tiny"], layers=2, taps=(0, 1)))
    tparams, _ = build_params(tcfg, dcfg, jnp.bfloat16)
    batch, taps = packed_batch(1), dcfg.target_layer_ids

    def features(attention):
        return jax.jit(lambda b: O.target_features((tcfg, tparams), taps, b, attention=attention))

    want = np.asarray(features("xla")(batch)[0], np.float32)
    with mock.patch.object(tree_attention, "tree_attention", wraps=tree_attention.tree_attention) as kernel:
        got = np.asarray(features("pallas-interpret")(batch)[0], np.float32)
    assert kernel.called  # the kernel, not XLA's attention
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)


def _inference_logits(target, drafter, feats, batch, anchors):
    """Per anchor: draft.extend with the context of its own sequence strictly before it, then draft.propose."""
    dcfg, dp = drafter
    tp = target[1]

    @jax.jit
    def propose(ctx, n, token):
        dc = kvcache.init(dcfg.layers.num_layers, 1, 64, dcfg.layers.num_kv_heads, dcfg.layers.head_dim, jnp.float32)
        return draft.propose(dp, dcfg, tp, draft.extend(dp, dcfg, dc, ctx, n[None]), token[None])[0]

    out = np.zeros((*anchors.shape, dcfg.block_size - 1, tp.embed.shape[0]), np.float32)
    for r in range(anchors.shape[0]):
        for i, a in enumerate(np.asarray(anchors[r])):
            lo = a - int(batch.positions[r, a])
            ctx = np.zeros((1, 40, feats.shape[-1]), np.float32)
            ctx[0, : a - lo] = np.asarray(feats[r, lo:a])
            out[r, i] = propose(jnp.asarray(ctx), jnp.int32(a - lo), batch.tokens[r, a])
    return out


def test_training_forward_equals_the_inference_drafter(target, drafter):
    """block_hidden (blocks in a group, the context masked to the anchor's sequence strictly before it) == the
    drafter's KV-cache inference, anchor by anchor, in both sequences of a packed row."""
    dcfg, dp = drafter
    batch = packed_batch()
    feats, _ = O.target_features(target, dcfg.target_layer_ids, batch)
    anchors = jnp.asarray([[5, 17, 30, 26], [12, 3, 25, 38]], jnp.int32)  # 26: the second sequence's first response
    kv = O.context_kv(dp, dcfg, feats, batch.positions)
    got = model.logits(target[1], O.block_hidden(dp, dcfg, target[1].embed, kv, batch, anchors)[:, :, 1:])
    want = _inference_logits(target, drafter, feats, batch, anchors)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_anchors_are_distinct_response_positions_with_a_response_token_next():
    batch = packed_batch()
    sup, pos = np.asarray(batch.supervised), np.asarray(batch.positions)
    for seed in range(5):
        anchors, valid = (np.asarray(x) for x in O.sample_anchors(jax.random.key(seed), batch, 40))
        for r in range(2):
            a = anchors[r][valid[r]]
            assert len(set(a.tolist())) == len(a)
            assert sup[r, a].all() and sup[r, a + 1].all() and (pos[r, a + 1] == pos[r, a] + 1).all()
            allowed = np.flatnonzero(sup[r, :-1] & sup[r, 1:] & (pos[r, 1:] == pos[r, :-1] + 1))
            assert valid[r].sum() == min(40, len(allowed))  # every allowed position, as many as asked


def test_response_offsets_count_each_sequences_earlier_response_tokens():
    batch = packed_batch()
    sup, start = np.asarray(batch.supervised), np.asarray(batch.segment_start)
    got = np.asarray(O.response_offsets(batch))
    for r in range(2):
        for i in range(40):
            assert got[r, i] == sup[r, start[r, i]:i].sum()


def test_anchors_with_a_half_life_are_drawn_in_proportion_to_their_weight():
    """One anchor a row, 4,000 draws: each allowed position's frequency is 2^(-r/H) over the row's sum (r its response
    offset), within 4 standard errors; more anchors are distinct allowed positions as with uniform draws."""
    batch, h, n = packed_batch(), 3, 4000
    sup, pos = np.asarray(batch.supervised), np.asarray(batch.positions)
    offsets = np.asarray(O.response_offsets(batch))
    draws = jax.vmap(lambda k: O.sample_anchors(k, batch, 1, h))(jax.random.split(jax.random.key(0), n))
    anchors, valid = (np.asarray(x)[:, :, 0] for x in draws)
    assert valid.all()
    for r in range(2):
        allowed = np.flatnonzero(sup[r, :-1] & sup[r, 1:] & (pos[r, 1:] == pos[r, :-1] + 1))
        w = 2.0 ** (-offsets[r, allowed] / h)
        want = w / w.sum()
        assert np.isin(anchors[:, r], allowed).all()
        got = np.bincount(anchors[:, r], minlength=40)[allowed] / n
        np.testing.assert_array_less(np.abs(got - want), 4 * np.sqrt(want * (1 - want) / n) + 1e-3)
        a, ok = (np.asarray(x)[r] for x in O.sample_anchors(jax.random.key(1), batch, 40, h))
        assert sorted(a[ok].tolist()) == allowed.tolist()  # asked for more than there are: every allowed one


def test_loss_is_the_weighted_cross_entropy_of_the_inference_drafter(target, drafter):
    """draft_loss == sum over anchors and slots k >= 1 (labels inside the anchor's response) of exp(-(k-1)/gamma) x
    the inference drafter's cross-entropy of the token at a + k, over the weights' sum; the KL form likewise against
    the target's own next-token distributions; groups of any size give the same value."""
    dcfg, dp = drafter
    bs = dcfg.block_size
    batch = packed_batch(1)
    key = jax.random.key(3)
    feats, final = O.target_features(target, dcfg.target_layer_ids, batch)
    anchors, valid = (np.asarray(x) for x in O.sample_anchors(key, batch, 12))
    ref = _inference_logits(target, drafter, feats, batch, jnp.asarray(anchors))
    teacher = np.asarray(jax.nn.log_softmax(model.logits(target[1], final), axis=-1))
    w = O.depth_weights(bs, O.gamma_for(bs))
    toks, sup, pos = (np.asarray(x) for x in (batch.tokens, batch.supervised, batch.positions))
    num = {"ce": 0.0, "kl": 0.0}
    den, labels = 0.0, 0
    for r in range(2):
        for i, a in enumerate(anchors[r]):
            for k in range(1, bs):
                at = a + k
                if not valid[r, i] or at >= 40 or pos[r, at] != pos[r, a] + k or not sup[r, at]:
                    continue
                logq = np.asarray(jax.nn.log_softmax(ref[r, i, k - 1]))
                num["ce"] -= w[k - 1] * logq[toks[r, at]]
                logp = teacher[r, at - 1]
                num["kl"] += w[k - 1] * np.sum(np.exp(logp) * (logp - logq))
                den += w[k - 1]
                labels += 1
    for loss in ("ce", "kl"):
        for group in (4, 12):
            got, metrics = O.draft_loss(dp, dcfg, target[1], feats, final, batch, key,
                                        O.Objective(anchors=12, group=group, loss=loss))
            np.testing.assert_allclose(float(got), num[loss] / den, rtol=2e-5)
            assert int(metrics["labels"]) == labels > 20


def test_memory_at_2048_tokens_and_512_anchors_is_bounded():
    """The compiled gradient of a row of 2,048 tokens with 512 anchors (groups of 32) needs less temporary memory
    than the dense form's attention scores of one layer alone ([512 x bs, 2048] per head, f32)."""
    from ddtree_jax import weights
    from tests.conftest import fixture_path

    tcfg = weights.load_target(fixture_path("target"))[0]
    dcfg = weights.load_draft(fixture_path("draft"))[0]
    t, a = 2048, 512
    s = jax.ShapeDtypeStruct
    batch = O.Batch(s((1, t), jnp.int32), s((1, t), jnp.int32), s((1, t), jnp.bool_))
    feats = s((1, t, dcfg.num_taps * tcfg.hidden_size), jnp.bfloat16)

    def temp(group):
        def grad(dp, tp, feats, batch):
            obj = O.Objective(anchors=a, group=group)
            return jax.grad(lambda p: O.draft_loss(p, dcfg, tp, feats, None, batch, jax.random.key(0), obj)[0])(dp)

        shapes = (params_lib.draft_shapes(dcfg), params_lib.target_shapes(tcfg), feats, batch)
        return jax.jit(grad).lower(*shapes).compile().memory_analysis().temp_size_in_bytes

    dense_scores = a * dcfg.block_size * t * dcfg.layers.num_heads * 4
    grouped = temp(32)
    assert grouped < dense_scores / 2, (grouped, dense_scores)


def test_label_nll_equals_the_log_softmax_form_with_its_gradient():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 4, (3, 5, 300)).astype(np.float32))
    labels = jnp.asarray(rng.integers(0, 300, (3, 5)).astype(np.int32))
    w = jnp.asarray(rng.uniform(0, 1, (3, 5)).astype(np.float32))

    def log_softmax_form(x):
        return -jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), labels[..., None], axis=-1)[..., 0]

    def logsumexp_form(x):
        return O.label_nll(x, labels)

    assert logsumexp_form(logits).shape == (3, 5)
    np.testing.assert_allclose(logsumexp_form(logits), log_softmax_form(logits), rtol=1e-6, atol=1e-5)
    grads = [jax.grad(lambda x, f=f: jnp.sum(f(x) * w))(logits) for f in (logsumexp_form, log_softmax_form)]
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6)
