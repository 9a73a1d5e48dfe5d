"""Drafter training on the tiny fixture pair: the training forward equals the inference drafter, a few steps
reduce the loss, the export loads with weights.load_draft and decodes losslessly, and resuming is exact."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import cache as kvcache
from ddtree_jax import config, decode, draft, model, weights
from ddtree_jax import train_draft as td
from tests.conftest import fixture_path


@pytest.fixture(scope="module")
def data(target):
    """The fixture target's greedy continuations of random prompts, with its features at taps (1, 4)."""
    prompts, _ = td.make_prompts_without_tokenizer(256, 12, 12, seed=0)
    return td.build_data(target, prompts[:8], taps=(1, 4), max_new_tokens=20, seq_len=32, stop_ids=(), batch=8)


def tiny_draft_config(target_cfg, layers=1):
    raw = td.draft_raw_config(target_cfg, num_layers=layers, block_size=8, mask_token_id=255,
                              target_layer_ids=(1, 4))
    return raw, config.draft_config(raw)


def test_training_forward_equals_the_inference_drafter(target, drafter):
    """draft_hidden with its block-sparse mask == draft.extend + draft.propose with the KV cache, anchor by anchor."""
    tcfg, tp = target
    dcfg, dp = drafter
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 256, (2, 40)).astype(np.int32)
    feats = td.target_features(target, dcfg.target_layer_ids, toks, 2)
    anchors = np.array([[5, 17, 30], [12, 3, 25]], np.int32)
    at = np.take_along_axis(toks, anchors, 1)
    got = model.logits(tp, td.draft_hidden(dp, dcfg, tp.embed, jnp.asarray(feats), jnp.asarray(anchors),
                                           jnp.asarray(at))[:, :, 1:])

    @jax.jit
    def reference(feats, a, anchor_token):  # one compiled shape: the context padded, count = a
        dc = kvcache.init(dcfg.layers.num_layers, 1, 64, dcfg.layers.num_kv_heads, dcfg.layers.head_dim, jnp.float32)
        dc = draft.extend(dp, dcfg, dc, feats, a[None])
        return draft.propose(dp, dcfg, tp, dc, anchor_token[None])[0]

    for b in range(2):
        for i, a in enumerate(anchors[b]):
            masked = np.where(np.arange(40)[None, :, None] < a, feats[b:b + 1], 0)
            want = reference(jnp.asarray(masked), jnp.int32(a), jnp.int32(at[b, i]))
            np.testing.assert_allclose(np.asarray(got[b, i]), np.asarray(want), atol=2e-5)


def test_data_holds_the_targets_greedy_continuations(target, data):
    assert data.features.shape[:2] == data.tokens.shape and data.features.shape[2] == 2 * target[0].hidden_size
    i = 0
    p = data.tokens[i, : data.starts[i]].tolist()
    res = decode.generate(target, [p], decode.GenerateOptions(max_new_tokens=int(data.lengths[i] - data.starts[i])))
    assert res.output_ids[0] == data.tokens[i, : data.lengths[i]].tolist()
    want = td.target_features(target, (1, 4), data.tokens[i:i + 1, : data.lengths[i]], 1)
    np.testing.assert_allclose(data.features[i, : data.lengths[i]], want[0], atol=3e-4, rtol=1e-3)


def test_steps_reduce_the_loss(target, data):
    tcfg, tp = target
    _, dcfg = tiny_draft_config(tcfg)
    tc = td.TrainConfig(steps=25, batch=4, anchors=8, lr=3e-3, warmup=2)
    opt = td.make_optimizer(tc)
    step = td.make_step(dcfg, tc, opt)
    params = td.init_params(dcfg, jax.random.key(0))
    state = opt.init(params)
    i = td.batch_indices(len(data.lengths), 4, 0, 0)
    batch = tuple(jnp.asarray(x[i]) for x in (data.tokens, data.lengths, data.starts, data.features))
    key = jax.random.key(1)  # the same anchors every step: the loss must fall
    losses = []
    for _ in range(25):
        params, state, loss, acc = step(params, state, tp.head(), tp.embed, batch, key)
        losses.append(float(loss))
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.8 * losses[0], losses


def test_train_exports_a_loadable_drafter_and_resumes_exactly(target, data, tmp_path):
    tcfg, _ = target
    raw, dcfg = tiny_draft_config(tcfg)
    tc = td.TrainConfig(steps=6, batch=4, anchors=8, lr=3e-3, warmup=1)
    prompts = [data.tokens[0, : data.starts[0]].tolist()]
    full, hist = td.train(target, data, dcfg, raw, str(tmp_path / "a"), tc, eval_prompts=prompts, eval_budget=4,
                          eval_tokens=8, save_every=2, log=lambda *_: None)
    assert any("eval_acceptance" in h for h in hist) and any("loss" in h for h in hist)

    d = str(tmp_path / "a" / "drafter")
    with open(os.path.join(d, "config.json")) as f:
        assert json.load(f)["dflash_config"]["target_layer_ids"] == [1, 4]
    got_cfg, got = weights.load_draft(d)
    assert got_cfg == dcfg
    bf16 = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)), full)
    for a, b in zip(jax.tree.leaves(bf16), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(b), a)
    opts = decode.GenerateOptions(method="ddtree", tree_budget=4, max_new_tokens=10)
    spec = decode.generate(target, prompts, opts, draft=(got_cfg, got))
    plain = decode.generate(target, prompts, decode.GenerateOptions(max_new_tokens=10))
    assert spec.output_ids == plain.output_ids  # lossless with the trained drafter

    logs = []
    td.train(target, data, dcfg, raw, str(tmp_path / "b"), tc, save_every=2, until=3, log=logs.append)
    resumed, _ = td.train(target, data, dcfg, raw, str(tmp_path / "b"), tc, save_every=2, log=logs.append)
    assert any("resumed from step 3" in m for m in logs)
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def test_online_features_train_as_the_stored_ones(target, data, tmp_path):
    """--online-features: the step computes the features with the target; same parameters after 3 steps, and
    data.npz then holds tokens only."""
    import dataclasses

    tcfg, _ = target
    raw, dcfg = tiny_draft_config(tcfg)
    tc = td.TrainConfig(steps=3, batch=4, anchors=8, lr=3e-3, warmup=1)
    online = dataclasses.replace(data, features=None)
    stored, _ = td.train(target, data, dcfg, raw, str(tmp_path / "s"), tc, save_every=10, log=lambda *_: None)
    got, _ = td.train(target, online, dcfg, raw, str(tmp_path / "o"), tc, save_every=10, log=lambda *_: None)
    for a, b in zip(jax.tree.leaves(stored), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-3, atol=2e-5)
    online.save(str(tmp_path / "d.npz"))
    back = td.Data.load(str(tmp_path / "d.npz"))
    assert back.features is None and (back.tokens == data.tokens).all()


def test_keep_best_exports_the_best_evaluation(target, data, tmp_path, monkeypatch):
    tcfg, _ = target
    raw, dcfg = tiny_draft_config(tcfg)
    tc = td.TrainConfig(steps=6, batch=4, anchors=8, lr=3e-3, warmup=1)
    taus = iter([1.5, 2.5, 1.2])  # evaluations at steps 2, 4, 6: step 4 is the best
    monkeypatch.setattr(td, "acceptance", lambda *a, **k: next(taus))
    logs = []
    prompts = [data.tokens[0, : data.starts[0]].tolist()]
    td.train(target, data, dcfg, raw, str(tmp_path / "k"), tc, eval_prompts=prompts, eval_every=2, save_every=10,
             keep_best=True, log=logs.append)
    assert any("exporting step 4's parameters" in m for m in logs), logs
    ref, _ = td.train(target, data, dcfg, raw, str(tmp_path / "r"), tc, save_every=10, until=4, log=lambda *_: None)
    _, got = weights.load_draft(str(tmp_path / "k" / "drafter"))
    bf16 = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)), ref)
    for a, b in zip(jax.tree.leaves(bf16), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(b), a)


def test_export_round_trips_through_the_z_lab_layout(drafter, tmp_path):
    dcfg, dp = drafter
    raw = weights.read_config(fixture_path("draft"))
    td.export(dp, raw, str(tmp_path / "d"), dtype="float32")
    _, got = weights.load_draft(str(tmp_path / "d"))
    for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_cli_end_to_end(tmp_path):
    out = str(tmp_path / "run")
    argv = ["--target", fixture_path("target"), "--out", out, "--dtype", "float32", "--layers", "1",
            "--block-size", "4", "--num-prompts", "4", "--max-new-tokens", "8", "--max-prompt-tokens", "200",
            "--seq-len", "256", "--gen-batch", "4", "--steps", "3", "--batch", "2", "--anchors", "4",
            "--eval-every", "0", "--eval-prompts", "1", "--eval-budget", "2", "--eval-tokens", "4"]
    assert td.main(argv) == 0
    assert os.path.isfile(os.path.join(out, "drafter", "model.safetensors"))
    assert td.main(["--target", "/no/such/dir", "--out", out]) == 2


class _BytesTokenizer:
    """A stand-in tokenizer (UTF-8 bytes, no chat template) for the prompt builders."""

    has_chat_template = False

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())


def test_prompt_corpora_hold_out_whole_topics():
    """pydoc and stdlib prompts: every 8th topic of each corpus is held out whole, the two sets never share
    a prompt, stdlib adds thousands of passages, and an unknown corpus is a clear argparse error."""
    tok = _BytesTokenizer()
    passages = td.stdlib_passages()
    modules = sorted({t for t, _ in passages})
    assert len(passages) > 3000 and len(modules) > 200 and all(t.startswith("stdlib:") for t in modules)
    assert all(200 <= len(p) <= 700 for _, p in passages)
    train, test = td.make_prompts(tok, 10_000, corpora=("stdlib",))
    assert len(train) > 2000 and len(test) > 200
    assert not {tuple(p) for p in train} & {tuple(p) for p in test}
    held = {modules[i] for i in range(td.HELD_OUT_EVERY - 1, len(modules), td.HELD_OUT_EVERY)}
    held_heads = {p.encode()[:64] for t, p in passages if t in held}
    assert {bytes(p) for p in test} <= held_heads  # without a chat template a prompt is a passage's opening
    both, _ = td.make_prompts(tok, 10_000, corpora=("pydoc", "stdlib"))
    alone, _ = td.make_prompts(tok, 10_000, corpora=("pydoc",))
    assert len(both) > len(train) + len(alone) // 2
    with pytest.raises(Exception, match="unknown corpus wiki"):
        td._corpora("pydoc,wiki")
