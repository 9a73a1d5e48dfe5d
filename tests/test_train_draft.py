"""Drafter training on the tiny fixture pair: steps reduce the loss, the export loads with weights.load_draft and
decodes losslessly, a run resumes exactly from its checkpoint moved elsewhere, a warm start from exported parts, the
schedule and the time box, and the command line end to end."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import config, decode, weights
from ddtree_jax import train_draft as td
from ddtree_jax.training import dataset, export, objective, trainer
from tests.conftest import fixture_path


@pytest.fixture(scope="module")
def seqs(target):
    """The fixture target's greedy continuations (20 tokens) of 10 random prompts, two held out."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 255, 12).tolist() for _ in range(10)]
    out = decode.generate(target, prompts, decode.GenerateOptions(max_new_tokens=20)).output_ids
    return dataset.Sequences.build([(o, 12, dataset.HELD_OUT if i >= 8 else dataset.TRAIN, 0.0, "random")
                                    for i, o in enumerate(out)])


def tiny(target_cfg, layers=1):
    raw = td.draft_raw_config(target_cfg, num_layers=layers, block_size=8, mask_token_id=255, target_layer_ids=(1, 4))
    return raw, config.draft_config(raw)


def rows_of(seqs, split=dataset.TRAIN):
    return dataset.pack(seqs.subset(seqs.split == split), 64)


TC = trainer.TrainConfig(steps=6, batch=2, lr=3e-3, warmup=1, compute_dtype="float32",
                         objective=objective.Objective(anchors=16, group=8))


def test_steps_reduce_the_loss(target, seqs, tmp_path):
    raw, dcfg = tiny(target[0])
    tr = trainer.Trainer(target, dcfg, raw, trainer.TrainConfig(**{**TC.__dict__, "steps": 40}), str(tmp_path))
    tr.start(log=lambda *_: None)
    tr.fit(rows_of(seqs), evals=0, log_every=5, log=lambda *_: None)
    losses = [h["loss"] for h in tr.history if "loss" in h]
    assert np.isfinite(losses).all() and losses[-1] < 0.7 * losses[0], losses
    assert tr.history[-1]["chain_tau"] > tr.history[0]["chain_tau"]


def test_export_decodes_losslessly_and_a_moved_run_resumes_exactly(target, seqs, tmp_path):
    """Train 6 steps straight; separately 3 steps, the work directory moved (another machine), 3 more: the same
    parameters; the export loads, equals the parameters in bf16, and decodes exactly as the target alone."""
    raw, dcfg = tiny(target[0])
    rows, held = rows_of(seqs), rows_of(seqs, dataset.HELD_OUT)
    evals = []

    def evaluate(params):
        evals.append(1)
        return {"tau": 1.0}

    full = trainer.Trainer(target, dcfg, raw, TC, str(tmp_path / "a"))
    full.start(log=lambda *_: None)
    fit = full.fit(rows, held, evals=2, log_every=3, evaluate=evaluate, log=lambda *_: None)
    assert fit["steps"] == 6 and len(evals) == 2  # at step 3 and at the end
    assert [h["step"] for h in full.history if "held_out_loss" in h] == [3, 6]

    half = trainer.Trainer(target, dcfg, raw, trainer.TrainConfig(**{**TC.__dict__}), str(tmp_path / "b"))
    half.start(log=lambda *_: None)
    half.fit(rows, evals=0, log_every=3, should_stop=lambda: half.step >= 3, log=lambda *_: None)
    assert half.step == 3
    shutil.move(str(tmp_path / "b"), str(tmp_path / "c"))
    logs = []
    resumed = trainer.Trainer(target, dcfg, raw, TC, str(tmp_path / "c"))
    resumed.start(log=logs.append)
    assert logs == ["resumed from step 3"]
    resumed.fit(rows, evals=0, log_every=3, log=lambda *_: None)
    for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(resumed.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)

    d = export.export(full.params, raw, str(tmp_path / "drafter"))
    got_cfg, got = weights.load_draft(d)
    assert got_cfg == dcfg
    bf16 = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32)), full.params)
    for a, b in zip(jax.tree.leaves(bf16), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(b), a)
    prompt = [seqs[0][:12].tolist()]
    spec = decode.generate(target, prompt, decode.GenerateOptions(method="ddtree", tree_budget=4, max_new_tokens=10),
                           draft=(got_cfg, got))
    assert spec.output_ids == decode.generate(target, prompt, decode.GenerateOptions(max_new_tokens=10)).output_ids


def test_warm_start_from_exported_parts(target, seqs, tmp_path):
    """A drafter split into parts (what a device call brings back) loads whole, starts the next run's parameters,
    and a part missing is a one-line error."""
    dcfg, dp = weights.load_draft(fixture_path("draft"))
    raw = weights.read_config(fixture_path("draft"))
    export.export(dp, raw, str(tmp_path / "d"), dtype="float32")
    names = export.split(str(tmp_path / "d"), str(tmp_path / "parts"), max_bytes=40_000)
    assert len(names) > 2 and all(os.path.getsize(tmp_path / "parts" / n) <= 40_000 for n in names)
    init = export.load(str(tmp_path / "parts"))
    tr = trainer.Trainer(target, dcfg, raw, TC, str(tmp_path / "w"))
    assert tr.start(init, log=lambda *_: None) == "warm start from exported weights"
    for a, b in zip(jax.tree.leaves(dp), jax.tree.leaves(tr.params)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    os.remove(tmp_path / "parts" / names[1])
    with pytest.raises(ValueError, match="weights_sha256"):
        export.load(str(tmp_path / "parts"))


def test_a_drafter_grows_deeper_computing_what_it_did(target, tmp_path):
    """Warm-starting a deeper drafter from a shallower one appends layers that start as the identity: the grown
    drafter drafts the same trees (the same outputs and per-round acceptance lengths) until training moves them;
    every config field but the depth must match."""
    dcfg, dp = weights.load_draft(fixture_path("draft"))
    raw = weights.read_config(fixture_path("draft"))
    deep_raw = {**raw, "num_hidden_layers": 4, "layer_types": ["full_attention"] * 4}
    deep_cfg = config.draft_config(deep_raw)
    tr = trainer.Trainer(target, deep_cfg, deep_raw, TC, str(tmp_path / "w"))
    assert tr.start((dcfg, dp), log=lambda *_: None).endswith("grown from 2 to 4 layers")
    assert tr.params.layers.wq.shape[0] == 4 and not np.asarray(tr.params.layers.wo[2:]).any()
    assert np.asarray(tr.params.layers.wq[2:]).std() > 0  # the new layers' other weights are random
    np.testing.assert_array_equal(np.asarray(tr.params.layers.w_up[:2]), np.asarray(dp.layers.w_up))
    prompt = [[5, 17, 42, 99, 7, 3, 250, 12]]
    opts = decode.GenerateOptions(method="ddtree", tree_budget=16, max_new_tokens=24)
    shallow = decode.generate(target, prompt, opts, draft=(dcfg, dp))
    deep = decode.generate(target, prompt, opts, draft=(deep_cfg, tr.params))
    assert deep.output_ids == shallow.output_ids and deep.acceptance_lengths == shallow.acceptance_lengths
    assert max(shallow.acceptance_lengths[0]) > 1  # the drafter's trees matter here
    with pytest.raises(ValueError, match="config differs"):  # shallower, and another block size: no growth
        trainer.Trainer(target, deep_cfg, deep_raw, TC, str(tmp_path / "x")).start(
            (dataclasses.replace(dcfg, block_size=dcfg.block_size + 1), dp), log=lambda *_: None)


def test_the_target_forward_takes_the_kernel_on_one_gpu_only(target, seqs, tmp_path, monkeypatch):
    """The trainer's step runs the target's forward with TrainConfig.target_attention; train_draft picks the tree
    kernel where --attention resolves to a Pallas one and no mesh splits the rows, XLA's attention otherwise."""
    from ddtree_jax import kernels

    seen = []
    real = objective.target_features
    monkeypatch.setattr(objective, "target_features", lambda *a: seen.append(a[3]) or real(*a))
    raw, dcfg = tiny(target[0])
    tr = trainer.Trainer(target, dcfg, raw, dataclasses.replace(TC, target_attention="pallas-interpret"),
                         str(tmp_path / "run"))
    tr.start()
    tr.fit(rows_of(seqs), evals=0)
    assert seen and set(seen) == {"pallas-interpret"}

    assert td._target_attention("auto", None) == "xla"  # CPU: XLA's attention
    for resolved, mesh, want in (("pallas-inplace", None, "pallas"), ("pallas", None, "pallas"),
                                 ("pallas-inplace", "a mesh", "xla"), ("pallas-interpret", None, "xla"),
                                 ("xla", None, "xla")):
        monkeypatch.setattr(kernels, "resolve_attention", lambda choice, r=resolved: r)
        assert td._target_attention("auto", mesh) == want, (resolved, mesh)


def test_schedule_warms_up_then_decays_to_zero_at_the_planned_end():
    tc = trainer.TrainConfig(lr=1.0, warmup=10)
    lrs = [trainer.learning_rate(tc, s, 110) for s in range(111)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:])) and lrs[110] == pytest.approx(0.0, abs=1e-12)


def test_a_resumed_run_spreads_its_evaluations_over_its_own_steps():
    """The evaluations (where a time-boxed run re-plans) fall at log steps after the resumed step, evenly to the end:
    a run resumed at step 460 of 593 evaluates in between, not at steps 150-440 that are already behind it."""
    assert trainer.Trainer._eval_points(0, 400, 4, 10) == [100, 200, 300]
    assert trainer.Trainer._eval_points(460, 593, 4, 10) == [490, 530, 560]
    assert trainer.Trainer._eval_points(593, 1000, 2, 10) == [800]
    assert trainer.Trainer._eval_points(595, 600, 4, 10) == []  # none left before the final one


def test_a_deadline_stops_training_and_still_saves(target, seqs, tmp_path):
    raw, dcfg = tiny(target[0])
    tr = trainer.Trainer(target, dcfg, raw, trainer.TrainConfig(**{**TC.__dict__, "steps": 100}), str(tmp_path))
    tr.start(log=lambda *_: None)
    fit = tr.fit(rows_of(seqs), evals=0, deadline=time.perf_counter() - 1, log=lambda *_: None)
    assert fit["stopped_by"] == "deadline" and fit["steps"] == 1 and tr.ckpts.latest() == 1
    assert tr._plan(time.perf_counter() + 10.2, 0.5, 4.0) == 1 + 12  # 6.2 s left at 0.5 s a step


def test_cli_end_to_end(tmp_path, monkeypatch, capsys):
    """Data (passage requests and self-instruct turns of the fixture's chat template), training, evaluation on the
    held-out sets, export and the shareable record; rerunning resumes; bad input is one line. Every run here asks for
    the tree kernel in the target's forward, whose step fails to compile here: it trains with XLA's attention."""
    compile_ = trainer.Trainer.compile

    def compile_or_fail(self, seq_len):
        if self.tc.target_attention != "xla":
            raise RuntimeError("Mosaic GPU lowering failed")
        return compile_(self, seq_len)

    monkeypatch.setattr(trainer.Trainer, "compile", compile_or_fail)
    monkeypatch.setattr(td, "_target_attention", lambda choice, mesh: "pallas")
    out, results = str(tmp_path / "run"), str(tmp_path / "results")
    argv = ["--target", fixture_path("target"), "--out", out, "--dtype", "float32", "--layers", "1",
            "--block-size", "4", "--corpus", "pydoc", "--num-prompts", "6", "--held-out-prompts", "2",
            "--self-instruct", "2", "--max-new-tokens", "12", "--max-prompt-tokens", "96", "--seq-len", "128",
            "--gen-batch", "4", "--steps", "4", "--batch", "2", "--anchors", "8", "--anchor-group", "4",
            "--anchor-half-life", "4", "--evals", "1", "--eval-budget", "4", "--eval-tokens", "4", "--results", results]
    assert td.main(argv) == 0
    assert sorted(os.listdir(results)) == ["config.json", "history.jsonl", "model.safetensors.part00", "run.json"]
    with open(os.path.join(out, "run.json")) as f:
        run = json.load(f)
    assert run["data"]["sequences"]["sequences"] >= 6 and run["training"]["steps"] == 4
    assert run["target_attention"] == "xla" and "training with XLA's attention" in capsys.readouterr().err
    assert set(run["evals"][-1]["eval"]) == {"python", "everyday"}
    weights.load_draft(os.path.join(out, "drafter"))
    assert td.main(argv[:-2] + ["--steps", "5"]) == 0  # reuses data.npz, resumes at step 4
    with open(os.path.join(out, "run.json")) as f:
        assert json.load(f)["training"]["steps"] == 5
    warm = str(tmp_path / "warm")  # a new work directory started from the record's parts
    assert td.main(argv[:3] + [warm, *argv[4:-2], "--init", results, "--steps", "1", "--evals", "0",
                               "--layers", "2"]) == 0  # and deeper: 1 layer grown to 2
    with open(os.path.join(warm, "run.json")) as f:
        run = json.load(f)
    assert run["training"]["steps"] == 1 and run["drafter_config"]["num_hidden_layers"] == 2
    assert weights.load_draft(os.path.join(warm, "drafter"))[0].layers.num_layers == 2
    shrink = str(tmp_path / "shrink")
    assert td.main(argv[:3] + [shrink, *argv[4:-2], "--init", os.path.join(warm, "drafter"), "--layers", "1"]) == 2
    assert "fewer than the --init drafter's 2" in capsys.readouterr().err
    assert td.main(["--target", "/no/such/dir", "--out", out]) == 2
    assert td.main(argv + ["--anchor-half-life", "0"]) == 2
    assert td.main(["--target", fixture_path("target"), "--out", out, "--corpus", "wiki"]) == 2
    assert td.main(["--target", fixture_path("target"), "--out", out, "--mesh", "2x2"]) == 2


@pytest.mark.skipif(not __import__("ddtree_jax.defaults").defaults.target_cached(),
                    reason="the converted SmolLM2 target is not cached (python -m convert.gguf_to_orbax --default)")
def test_default_pair_script_end_to_end(tmp_path):
    """benchmarks/train_default_pair.sh at a tiny scale on the real SmolLM2 target (a few prompts, a few steps; the
    decode-loop evaluations left to test_cli_end_to_end): the record a device call brings back, and the drafter whole
    again from its parts (in the shipped shape)."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    small = ["--corpus", "pydoc", "--self-instruct", "4", "--num-prompts", "4", "--held-out-prompts", "1",
             "--max-new-tokens", "16", "--gen-batch", "4", "--steps", "2", "--batch", "2", "--seq-len", "256",
             "--anchors", "16", "--anchor-group", "8", "--evals", "0"]
    env = dict(os.environ, OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), MINUTES="20", PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(repo, "benchmarks", "train_default_pair.sh"), *small], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["config.json", "history.jsonl", "log.txt", "model.safetensors.part00",
                                       "model.safetensors.part01", "run.json"]
    assert all(os.path.getsize(out / n) < 16 << 20 for n in os.listdir(out))
    run = json.loads((out / "run.json").read_text())
    assert run["training"]["steps"] == 2 and run["data"]["generation"]["tokens_per_s"] > 0
    assert "held_out_loss" in run["evals"][-1] and "wrote" in (out / "log.txt").read_text()
    dcfg, dp = export.load(str(out))
    assert dcfg.target_layer_ids == (1, 10, 18, 27) and dcfg.block_size == 16 and dcfg.mask_token_id == 16


def test_held_out_check_runs_generate_json_per_set(tmp_path, capsys):
    """python -m ddtree_jax.training.evaluate: one `generate --json` per held-out set, the pooled mean of its rounds
    (every round of every prompt counts once) and the command on stdout as JSON; an unknown set is one line."""
    from ddtree_jax.training import evaluate as ev

    argv = ["--target", fixture_path("target"), "--draft", fixture_path("draft"), "--sets", "everyday",
            "--tree-budget", "4", "--max-new-tokens", "6", "--dtype", "float32"]
    assert ev.main(argv) == 0
    got = json.loads(capsys.readouterr().out)["sets"]["everyday"]
    assert got["prompts"] == 20 and got["generated_tokens"] == 120 and 1 <= got["mean_acceptance_length"] <= 8
    assert got["command"].startswith("python -m ddtree_jax.generate --target") and "--tree-budget 4" in got["command"]
    report = {"results": [{"acceptance_lengths": [1, 3], "mean_acceptance_length": 2.0, "num_generated": 4},
                          {"acceptance_lengths": [2], "mean_acceptance_length": 2.0, "num_generated": 2}]}
    assert ev.set_acceptance(report)["mean_acceptance_length"] == 2.0 and ev.set_acceptance(report)["rounds"] == 3
    assert got["by_output_position"] == {"0-127": {"mean_acceptance_length": got["mean_acceptance_length"],
                                                   "rounds": got["rounds"]}}  # 6 tokens: one band
    # rounds start at output tokens 0, 1, 4 (the first sequence's, accepting 1, 3, 2) and 0, 2 (the second's): bands
    # of 2 tokens pool (1, 3, 2), (4) and (2)
    assert ev.by_position([[1, 3, 2], [2, 4]], band=2) == {
        "0-1": {"mean_acceptance_length": 2.0, "rounds": 3}, "2-3": {"mean_acceptance_length": 4.0, "rounds": 1},
        "4-5": {"mean_acceptance_length": 2.0, "rounds": 1}}
    assert ev.main(argv[:4] + ["--sets", "wiki"]) == 2
    parts = tmp_path / "parts"  # a drafter as a device call returns it, not joined: generate's one line, exit 2
    export.split(fixture_path("draft"), str(parts), max_bytes=1 << 16)
    capsys.readouterr()
    assert ev.main(argv[:2] + ["--draft", str(parts), *argv[4:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: generate failed on the everyday set: ") and "only its parts" in err, err


def test_sigterm_keeps_what_exists(tmp_path):
    """benchmarks/train_default_pair.sh (here on the fixture target: later flags override the recipe's) sent SIGTERM
    while training: it forwards the signal, the run stops at its next step, exports, and $OUT holds the record."""
    import signal
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    work, out = tmp_path / "work", tmp_path / "out"
    tiny_flags = ["--target", fixture_path("target"), "--dtype", "float32", "--layers", "1", "--block-size", "4",
                  "--corpus", "pydoc", "--num-prompts", "6", "--held-out-prompts", "2", "--self-instruct", "0",
                  "--max-new-tokens", "12", "--max-prompt-tokens", "96", "--seq-len", "128", "--gen-batch", "4",
                  "--steps", "100000", "--batch", "2", "--anchors", "8", "--anchor-group", "4", "--evals", "0"]
    env = dict(os.environ, OUT=str(out), WORK=str(work), PYTHON=sys.executable)
    proc = subprocess.Popen(["bash", os.path.join(repo, "benchmarks", "train_default_pair.sh"), *tiny_flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 600
    while not (work / "history.jsonl").exists() or not (work / "history.jsonl").read_text().strip():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert run["stopped_by_signal"] == "SIGTERM" and run["training"]["stopped_by"] == "signal"
    assert 10 <= run["training"]["steps"] < 100000
    export.load(str(out))  # the drafter, whole from its parts


def test_a_resumed_run_plans_its_schedule_to_the_deadline(target, seqs, tmp_path, monkeypatch):
    """Resumed at a step that is not a multiple of log_every, a time-boxed run still plans its total from the
    measured step time, so that the learning rate decays to the deadline instead of staying near its peak."""
    raw, dcfg = tiny(target[0])
    tc = trainer.TrainConfig(**{**TC.__dict__, "steps": 10**6})
    tr = trainer.Trainer(target, dcfg, raw, tc, str(tmp_path))
    tr.start(log=lambda *_: None)
    tr.fit(rows_of(seqs), evals=0, log_every=5, deadline=time.perf_counter() - 1, log=lambda *_: None)
    assert tr.step == 1
    again = trainer.Trainer(target, dcfg, raw, tc, str(tmp_path))
    assert again.start(log=lambda *_: None) == "resumed from step 1"
    clock = itertools.count(0.0, 0.5)  # every reading of the clock half a second later: a deterministic step time
    monkeypatch.setattr(trainer.time, "perf_counter", lambda: next(clock))
    fit = again.fit(rows_of(seqs), evals=0, log_every=5, deadline=60.0, log=lambda *_: None)
    assert fit["planned_steps"] < 200 and fit["steps"] <= fit["planned_steps"], fit
    assert again.history[-1]["lr"] < 0.2 * tc.lr, again.history[-1]
