"""``tree_budget="auto"`` in decode: the forms of a round (AR step, chain, best-first tree) share one state, AR steps
keep the drafter's context complete, a tree built large gives every smaller one as its prefix with the drafter's
predictions, and whatever forms run, greedy output is AR's and sampled output AR's for the same seed (f32 fixtures)."""

import dataclasses
import itertools
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import accept, autorun, costs, decode, policy
from ddtree_jax import tree as trees
from ddtree_jax.round import draft_logits, predictions
from tests.test_decode import tree_paths
from tests.test_oracle import check_caches, oracle

FORMS = ("ar", "chain", "4")


class Scripted(policy.Policy):
    """A policy that runs the given forms in turn, whatever the statistics say; with ``expects=False`` it expects
    nothing of any form, so generate's groups keep their sizes (no group takes the rest of a decode)."""

    def __init__(self, order, *args, expects=True):
        super().__init__(*args)
        self.order = itertools.cycle(order)
        self.chosen = []
        self.expects = expects

    def choose(self, seqs, options):
        form = next(self.order)
        self.chosen.append(form)
        return next(k for k in options if k[0] == form)

    def expected(self, seq, form):
        return super().expected(seq, form) if self.expects else None


def test_a_large_trees_prefix_is_the_smaller_tree_and_its_scores_are_the_drafters():
    """best_first at budget P, cut to its first b nodes, is best_first at budget b (as path sets; random logits have
    no ties); each node's score is the sum of the drafter's log-probabilities along its path, sorted descending, and
    the predictions are 1 + the summed path probabilities of the best c nodes (the chain: of its argmax path)."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((2, 5, 48)) * 3, jnp.float32)
    big, scores, top1 = jax.jit(trees.scored_best_first, static_argnums=1)(logits, 24)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    for b in range(2):
        tokens, parents = np.asarray(big.tokens[b]), np.asarray(big.parents[b])
        depths = np.asarray(big.depths[b])
        for size in (1, 6, 13):
            small = jax.jit(trees.best_first, static_argnums=1)(logits, size)
            cut = trees.prefix(big, size)
            assert tree_paths(cut.tokens[b], cut.parents[b]) == tree_paths(small.tokens[b], small.parents[b])
            want_bits = trees.ancestor_bits(cut.parents, 4)
            np.testing.assert_array_equal(cut.bits, want_bits)
        brute = []
        for k in range(24):
            total, j = 0.0, k + 1
            while j > 0:
                total += logp[b, depths[j - 1] - 1, tokens[j - 1]]
                j = parents[j]
            brute.append(total)
        np.testing.assert_allclose(scores[b], brute, rtol=1e-5, atol=1e-5)
        assert (np.diff(np.asarray(scores[b])) <= 1e-6).all()
        np.testing.assert_allclose(top1[b], logp[b].max(-1), rtol=1e-6, atol=1e-6)
    few = jnp.asarray(rng.standard_normal((1, 2, 3)), jnp.float32)  # 3 + 9 paths for 20 nodes: 8 unused
    tiny, tiny_scores, _ = jax.jit(trees.scored_best_first, static_argnums=1)(few, 20)
    used = np.asarray(tiny.tokens[0]) >= 0
    assert used.sum() == 12 and np.isneginf(np.asarray(tiny_scores[0])[~used]).all()
    assert np.isfinite(np.asarray(tiny_scores[0])[used]).all()

    spec = dataclasses.replace(_spec_stub(), predict=(4, 24, 64), tree="best_first", budget=6)
    pred = np.asarray(predictions(spec, top1, scores))
    mass = np.cumsum(np.exp(np.asarray(scores)), axis=1)
    chain = 1 + np.cumsum(np.exp(np.cumsum(np.asarray(top1), axis=1)), axis=1)[:, -1]
    np.testing.assert_allclose(pred, np.stack([1 + mass[:, 5], chain, 1 + mass[:, 3], 1 + mass[:, 23],
                                               np.zeros(2)], axis=1), rtol=1e-5)


def _spec_stub():
    from ddtree_jax.config import DraftConfig, ModelConfig

    return decode.Spec(target=ModelConfig.__new__(ModelConfig), draft=DraftConfig.__new__(DraftConfig),
                       method="ddtree", budget=1, max_rounds=1, auto=True)


def _copy(state):
    return jax.tree.map(jnp.copy, state)


def test_ar_steps_keep_the_drafters_context(target, drafter, reference_runs):
    """Three AR steps of a speculative run commit what three chain rounds commit (the fixture drafter's first chain
    rounds accept the root alone): the same tokens, the same draft cache up to its length (every committed token),
    hence the same draft logits for the next round, and the same tokens after it."""
    (tcfg, tparams), (dcfg, dparams) = target, drafter
    run = reference_runs[0]
    assert run["dflash"]["acceptance_lengths"][:4] == [1, 1, 1, 1]
    opts = decode.GenerateOptions(method="dflash", tree_budget="auto", max_new_tokens=run["max_new_tokens"])
    spec = decode.make_spec(tcfg, dcfg, opts)
    assert spec.auto and spec.form == "chain" and spec.with_form("ar").form == "ar"
    state, tokens = decode.start(spec, [run["prompt"]], [opts], opts.max_new_tokens, tparams.embed.dtype)
    state = decode.compiled(decode.prefill, spec, tparams, dparams, state, tokens)(tparams, dparams, state, tokens)
    three = jnp.int32(3)
    steps = {form: decode.compiled(decode.run_rounds, spec.with_form(form), tparams, dparams, state, three)
             for form in ("ar", "chain")}
    by_ar = steps["ar"](tparams, dparams, _copy(state), three)
    by_chain = steps["chain"](tparams, dparams, _copy(state), three)
    n = len(run["prompt"])
    for s in (by_ar, by_chain):
        assert np.asarray(s.out[0, : n + 4]).tolist() == run["ar"][: n + 4]
    assert np.asarray(by_ar.forms[0, :3]).tolist() == [0, 0, 0] and float(by_ar.stats[0, policy.ROUNDS]) == 0
    assert np.asarray(by_chain.forms[0, :3]).tolist() == [-1, -1, -1]
    assert float(by_chain.stats[0, policy.ROUNDS]) == 3
    length = int(by_ar.dcache.length[0])
    assert length == int(by_chain.dcache.length[0]) == int(by_ar.cache.length[0]) == n + 3
    for a, b in ((by_ar.dcache.k, by_chain.dcache.k), (by_ar.dcache.v, by_chain.dcache.v)):
        np.testing.assert_allclose(a[:, :, :length], b[:, :, :length], rtol=1e-5, atol=1e-5)
    draft = jax.jit(lambda s: draft_logits(spec, tparams, dparams, s)[0])
    np.testing.assert_allclose(draft(by_ar), draft(by_chain), rtol=1e-4, atol=1e-4)
    one = jnp.int32(1)
    after = decode.compiled(decode.run_rounds, spec.with_form("chain"), tparams, dparams, by_ar, one)
    a, b = after(tparams, dparams, by_ar, one), after(tparams, dparams, by_chain, one)
    np.testing.assert_array_equal(a.out, b.out)
    np.testing.assert_array_equal(a.accept_hist[0, 3], b.accept_hist[0, 3])


def test_more_ar_steps_than_path_len_leave_the_drafters_cache_complete(target, drafter, reference_runs):
    """AR steps of a speculative run hand the drafter their tokens path_len steps at a time: over more steps than that
    in one loop (and rows that finish inside one), both caches equal a fresh causal pass over the tokens, and the
    output is AR's."""
    (tcfg, tparams), (dcfg, dparams) = target, drafter
    runs = reference_runs[:2]
    prompts = [r["prompt"] for r in runs]
    opts = [decode.GenerateOptions(method="ddtree", max_new_tokens=n) for n in (2 * dcfg.block_size + 3, 5)]
    spec = decode.make_spec(tcfg, dcfg, opts[0], batch=2).with_form("ar", 2)
    state, tokens = decode.start(spec, prompts, opts, opts[0].max_new_tokens, tparams.embed.dtype)
    state = decode.compiled(decode.prefill, spec, tparams, dparams, state, tokens)(tparams, dparams, state, tokens)
    rounds = jnp.int32(opts[0].max_new_tokens)
    state = decode.compiled(decode.run_rounds, spec, tparams, dparams, state, rounds)(tparams, dparams, state, rounds)
    assert np.asarray(state.done).all() and np.asarray(state.n_rounds).tolist() == [o.max_new_tokens for o in opts]
    for run, out, o in zip(runs, np.asarray(state.out), opts):
        n = len(run["prompt"]) + o.max_new_tokens
        assert out[:n].tolist() == run["ar"][:n]
    check_caches(target, drafter, state)


def test_ar_steps_stop_at_the_round_count_beyond_path_len(target, drafter, reference_runs):
    """run_rounds(max_rounds=N) runs N AR steps of a speculative run, also when N exceeds path_len (the steps run
    path_len at a time: the count once restarted at each batch of them, and the loop ran until every row was done);
    a second call finishes the output as AR's."""
    (tcfg, tparams), (dcfg, dparams) = target, drafter
    run = reference_runs[0]
    opts = decode.GenerateOptions(method="ddtree", max_new_tokens=2 * dcfg.block_size + 3)
    spec = decode.make_spec(tcfg, dcfg, opts).with_form("ar")
    state, tokens = decode.start(spec, [run["prompt"]], [opts], opts.max_new_tokens, tparams.embed.dtype)
    state = decode.compiled(decode.prefill, spec, tparams, dparams, state, tokens)(tparams, dparams, state, tokens)
    step = decode.compiled(decode.run_rounds, spec, tparams, dparams, state, jnp.int32(1))
    first = spec.path_len + 3
    state = step(tparams, dparams, state, jnp.int32(first))
    assert int(state.n_rounds[0]) == first and not bool(state.done[0])
    state = step(tparams, dparams, state, jnp.int32(opts.max_new_tokens))
    n = len(run["prompt"]) + opts.max_new_tokens
    assert bool(state.done[0]) and np.asarray(state.out)[0, :n].tolist() == run["ar"][:n]


def test_ar_steps_hand_the_drafter_their_tokens_once_per_path_len_steps(target, drafter):
    """The AR form of a speculative run, compiled as the engine compiles its group of rounds: the drafter's input
    projection (and so its K/V products and cache writes) runs outside the loop of AR steps, once for up to path_len
    steps, where the target's logits run every step, over the group's rows (3 steps: not path_len's 16, whose padding
    rows cost a large drafter's projections every call); its optimized HLO copies neither KV cache; its Snapshot's
    window is AR's (a token a round)."""
    (tcfg, tparams), (dcfg, dparams) = target, drafter
    b, most = 2, 3
    opts = decode.GenerateOptions(method="ddtree", max_new_tokens=16)
    spec = decode.make_spec(tcfg, dcfg, opts, batch=b).with_form("ar", b)
    state, _ = decode.start(spec, [[1, 2, 3]] * b, [opts] * b, opts.max_new_tokens, tparams.embed.dtype)
    starts = jnp.zeros((b,), jnp.int32)
    hlo = decode.run_group.lower(spec, tparams, dparams, state, starts, jnp.int32(most), most).compile().as_text()

    def loop_depth(einsum):  # how deep in while loops the product of this einsum (draft.py, model.py) runs
        depths = [name.count("while/body") for name in re.findall(r'op_name="([^"]*)"', hlo) if einsum in name]
        assert depths, einsum
        return max(depths)

    assert loop_depth("bcf,fd->bcd") < loop_depth("...d,dv->...v")  # the drafter's fc against the target's logits
    features = dcfg.num_taps * tcfg.hidden_size  # the hand-over's buffer of tap features: [B, steps, taps x D]
    assert f"[{b},{most},{features}]" in hlo and f"[{b},{spec.path_len},{features}]" not in hlo
    for kv in (state.cache.k, state.dcache.k):
        whole = "[" + ",".join(map(str, kv.shape)) + "]"
        assert not [line for line in hlo.splitlines() if " copy(" in line and whole in line.split(" copy(")[0]]
    snap = jax.eval_shape(lambda s: decode.group(spec, tparams, dparams, s, starts, jnp.int32(most), most)[1], state)
    assert snap.window.shape == (b, most + 1)


@pytest.fixture(scope="module")
def batch(reference_runs):
    n = min(r["max_new_tokens"] for r in reference_runs)
    return [r["prompt"] for r in reference_runs], n


def test_any_sequence_of_forms_gives_ars_tokens_and_traces_each_rounds_own_tree(target, drafter, reference_runs,
                                                                              batch):
    """Forced forms (AR steps, the chain, trees of 4 nodes, in turn) and the default policy, on the reference prompts
    as one batch: AR's tokens; each round's traced tree is cut to its form's nodes, and its walk replays on the
    host; the statistics count the rounds that drafted."""
    prompts, n = batch
    opts = decode.GenerateOptions(method="ddtree", max_new_tokens=n, forms=FORMS, trace=True)
    dcfg = drafter[0]
    chooser = Scripted(["ar", "ar", "4", "chain", "4"], FORMS, (4,), expects=False)
    forced = decode.generate(target, prompts, opts, draft=drafter, chooser=chooser)
    default = decode.generate(target, prompts, opts, draft=drafter)
    for res in (forced, default):
        for run, out, forms, rounds in zip(reference_runs, res.output_ids, res.round_forms, res.rounds):
            assert out == run["ar"][: len(run["prompt"]) + n]
            assert len(forms) == len(rounds) and set(forms) <= set(FORMS)
            for form, r in zip(forms, rounds):
                assert r["form"] == form
                size = policy.nodes(form, dcfg.block_size)
                assert len(r["tree"]["node_token_ids"]) == size and len(r["target_choices"]) == size + 1
                assert accept.walk_host(r["tree"]["node_token_ids"], r["tree"]["parents"],
                                        r["target_choices"]) == r["accepted_indices"]
    assert {f for seq in forced.round_forms for f in seq} == set(FORMS)
    # groups of rounds of one form: the first of FIRST_GROUP rounds, then of GROUP_ROUNDS
    a, c = autorun.FIRST_GROUP, autorun.GROUP_ROUNDS
    assert forced.round_forms[0][: a + 2 * c] == ["ar"] * (a + c) + ["4"] * c


def test_groups_double_while_speculative_forms_follow_one_another(target, drafter, batch):
    """generate's groups under auto double while speculative forms follow one another, whichever (up to
    autorun.MAX_GROUP_ROUNDS: each device call costs the host's turn, and on a GPU about a round of a small model),
    and start again at autorun.GROUP_ROUNDS after AR; AR groups, which teach the policy nothing, stay short;
    streaming keeps groups of stream_every rounds."""
    cases = (("4", "4", 8), ("4", "4", 64), ("chain", "chain", 16), ("4", "chain", 16), ("8", "4", 32),
             ("ar", "ar", 8), ("ar", "4", 32), ("4", "ar", 8), ("4", None, 2))
    assert [autorun.group_rounds(f, p, r, 8, 64) for f, p, r in cases] == [16, 64, 32, 32, 64, 8, 8, 8, 8]
    prompts, n = batch
    opts = decode.GenerateOptions(method="ddtree", max_new_tokens=n, forms=FORMS)

    def runs(res):  # (form, rounds in a row) of the sequence that ran longest
        return [(f, len(list(g))) for f, g in itertools.groupby(max(res.round_forms, key=len))]

    a, c = autorun.FIRST_GROUP, autorun.GROUP_ROUNDS
    n = 2 * n  # (the policies below expect nothing, so no group takes the rest of the decode)
    opts = dataclasses.replace(opts, max_new_tokens=n)
    assert a == c // 2 and 4 * c <= autorun.MAX_GROUP_ROUNDS and a + 3 * c < n  # AR steps: a round, a token
    speculative = decode.generate(target, prompts, opts, draft=drafter,
                                  chooser=Scripted(["4"] * 4 + ["ar"], FORMS, (4,), expects=False))
    assert runs(speculative)[0] == ("4", a + c + 2 * c + 4 * c) and runs(speculative)[1][0] == "ar"
    ar = decode.generate(target, prompts, opts, draft=drafter,
                         chooser=Scripted(["ar"] * 4 + ["4"], FORMS, (4,), expects=False))
    assert runs(ar)[0] == ("ar", a + 3 * c) and runs(ar)[1][0] == "4"
    streamed = decode.generate(target, prompts, opts, draft=drafter, on_tokens=lambda _: None, stream_every=4,
                               chooser=Scripted(["4"] * 4 + ["ar"], FORMS, (4,), expects=False))
    assert runs(streamed)[0] == ("4", 4 * 4) and runs(streamed)[1][0] == "ar"
    assert speculative.output_ids == ar.output_ids == streamed.output_ids


def test_the_last_group_takes_the_rest_and_no_call_runs_no_round(target, drafter, batch, monkeypatch):
    """Each device call costs the host about a round of a small model on a GPU, so a decode makes few: its first group
    is read before the second is chosen, and once the rest of the decode fits in a group, the next group takes every
    round the policy expects it to need, twice over (a group stops when its sequences are done); no group is queued
    behind one expected to finish the decode (it would be a call of no round). A 40-token decode: two calls."""
    calls = []
    run = autorun.Chain.run

    def counted(self, fn, rounds):
        snap, seconds = run(self, fn, rounds)
        calls.append((rounds, int(np.max(np.asarray(snap.new_rounds)))))
        return snap, seconds

    monkeypatch.setattr(autorun.Chain, "run", counted)
    prompts, n = batch
    opts = decode.GenerateOptions(method="ddtree", max_new_tokens=n, forms=FORMS)
    res = decode.generate(target, prompts, opts, draft=drafter, chooser=Scripted(["4"], FORMS, (4,)))
    total = max(len(f) for f in res.round_forms)
    assert sum(ran for _, ran in calls) == total and all(ran for _, ran in calls), calls
    assert res.groups == [ran for _, ran in calls]  # what the result reports: the rounds of each call
    assert total > autorun.FIRST_GROUP + autorun.GROUP_ROUNDS  # doubling groups would have made three calls or more
    assert len(calls) == 2 and calls[0][0] == autorun.FIRST_GROUP and calls[-1][0] > calls[-1][1], calls
    assert res.output_ids == decode.generate(target, prompts, dataclasses.replace(opts, method="ar")).output_ids


def test_sampled_output_is_ars_for_the_same_seed_whatever_the_forms(target, drafter, batch):
    """Each token is drawn with the noise of (seed, position) (accept.node_keys), so a sampled run's tokens are AR's
    with the same seed, whichever forms ran: here samples through forced trees, chains and AR steps whose
    drafter (an oracle peaked on AR's sampled continuation, with decoys) makes them accept long paths."""
    prompts, n = batch
    opts = decode.GenerateOptions(method="ddtree", max_new_tokens=n, forms=FORMS, temperature=0.9, seed=5)
    extra = drafter[0].block_size
    ar = decode.generate(target, prompts, dataclasses.replace(opts, method="ar", max_new_tokens=n + extra))
    proposer = oracle(ar.output_ids, peak=[8.0] * 3, noise=[1.0] * 3, decoy_rate=[0.2, 0.0, 0.4])
    chooser = Scripted(["ar", "4", "chain"], FORMS, (4,))
    auto = decode.generate(target, prompts, opts, draft=drafter, chooser=chooser, proposer=proposer)
    for mine, theirs, prompt in zip(auto.output_ids, ar.output_ids, prompts):
        assert mine == theirs[: len(prompt) + n]
    assert {f for seq in auto.round_forms for f in seq} == set(FORMS)
    deep = [a for seq, forms in zip(auto.acceptance_lengths, auto.round_forms) for a, f in zip(seq, forms) if f != "ar"]
    assert max(deep) >= 4 and np.mean(deep) > 2, deep


def test_every_form_is_timed_afresh_before_the_decode(target, drafter, batch, monkeypatch, tmp_path):
    """A program's first execution in a process loads it onto the device, so AutoRun runs each form before decoding,
    and times it there: autorun.MEASURE_CALLS calls when the cost table does not know it, one when it does (another
    generate call reading the costs the earlier one kept on disk), replacing the cost kept: a stale cost (a run in a
    slower phase of the machine) must not keep a form out of later runs. The forms' calls are interleaved in
    alternating order, so that a drift of the device's speed falls on every form alike. (Traced: the programs of the
    forced-forms test above, compiled once.)"""
    monkeypatch.setenv("DDTREE_JAX_CACHE", str(tmp_path))
    prompts, n = batch
    opts = decode.GenerateOptions(method="ddtree", max_new_tokens=n, forms=FORMS, trace=True)
    seen, timing = [], []  # the form of each program call made while timing; whether timing now
    measure = autorun.measure

    def spy(fn, state, rewind, calls=autorun.MEASURE_CALLS, first=None):
        assert calls == 1  # one call a form at a time, interleaved
        timing.append(True)
        try:
            return measure(fn, state, rewind, calls, first)
        finally:
            timing.pop()

    class Spied(autorun.AutoRun):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.fns = {f: self._spied(f, fn) for f, fn in self.fns.items()}

        @staticmethod
        def _spied(form, fn):
            def call(*args):
                if timing:
                    seen.append(form)
                return fn(*args)
            return call

    monkeypatch.setattr(autorun, "measure", spy)
    monkeypatch.setattr(autorun, "AutoRun", Spied)
    first = decode.generate(target, prompts, opts, draft=drafter, persist_costs=True)
    assert seen[::2] == seen[1::2]  # each timed call after an untimed one-round call of the same program
    forms = seen[: 2 * len(FORMS): 2]
    assert sorted(forms) == sorted(FORMS)
    assert seen[::2] == [f for i in range(autorun.MEASURE_CALLS) for f in (forms if i % 2 == 0 else forms[::-1])]
    seen.clear()
    spec = decode.make_spec(target[0], drafter[0], opts, batch=len(prompts))
    key = costs.program_key("4", len(prompts), "greedy")
    table = autorun.cost_table_for(spec, target[1].embed.dtype)
    assert table.get(key) is not None
    table.measured(key, 1e3, 64)  # a stale cost: 1000 s a round
    table.save()
    second = decode.generate(target, prompts, opts, draft=drafter, persist_costs=True)
    assert seen[::2] == forms  # known costs: each form timed once
    assert second.output_ids == first.output_ids
    assert autorun.cost_table_for(spec, target[1].embed.dtype).get(key) < 1.0


def test_a_groups_cost_is_its_own_when_a_dispatch_waits_for_the_group(target, drafter, batch, monkeypatch):
    """On a GPU, XLA's runtime reads a round loop's predicate on the host, so a group's dispatch returns only once
    its rounds have run (here every dispatch waits for its group and sleeps 30 ms a round on top). AutoRun's worker
    thread dispatches the groups, so the host chooses each group after the second while the one before it still runs
    (the device never waits for the choice; the second is chosen from the first's statistics). Each group's cost per
    round, as the cost table observes it, must be that group's own, not the next group's: groups double, so that
    would be twice it."""
    prompts, n = batch
    opts = decode.GenerateOptions(method="ddtree", max_new_tokens=2 * n, forms=("4",))
    calls, seen = [], []  # (rounds asked, run, seconds, when it ended) of each dispatch; seconds a round observed

    class Blocking(autorun.AutoRun):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.fns = {f: self._blocking(fn) for f, fn in self.fns.items()}

        @staticmethod
        def _blocking(fn):
            def call(tparams, dparams, state, starts, rounds):
                t0 = time.perf_counter()
                out = jax.block_until_ready(fn(tparams, dparams, state, starts, rounds))
                ran = int(out[1].new_rounds.max())
                time.sleep(0.03 * ran)
                calls.append((int(rounds), ran, time.perf_counter() - t0, time.perf_counter()))
                return out
            return call

    class Spying(costs.CostTable):
        def observe(self, key, seconds, context):
            seen.append(seconds)
            super().observe(key, seconds, context)

    class Timed(Scripted):
        def choose(self, seqs, options):
            chosen_at.append(time.perf_counter())
            return super().choose(seqs, options)

    chosen_at = []
    monkeypatch.setattr(autorun, "AutoRun", Blocking)
    monkeypatch.setattr(autorun, "cost_table_for", lambda spec, dtype, persist=True: Spying("test", None))
    decode.generate(target, prompts, opts, draft=drafter, chooser=Timed(["4"], ("4",), (4,), expects=False))
    decode_calls = calls[-len(chosen_at):]  # after the timing calls
    assert [c[0] for c in decode_calls[:3]] == [4, 8, 16], decode_calls
    assert chosen_at[1] > decode_calls[0][3], (chosen_at, decode_calls)
    assert all(at < before[3] for at, before in zip(chosen_at[2:], decode_calls[1:])), (chosen_at, decode_calls)
    ran = [c for c in decode_calls if c[1]]  # (expecting nothing, the policy may queue a group behind the last)
    assert len(seen) == len(ran) >= 3
    for seconds, (_, ran, took, _) in zip(seen, ran):
        assert took / ran * 0.8 < seconds < took / ran * 1.25, (seen, decode_calls)


def test_a_tree_round_shows_what_each_smaller_tree_would_have_accepted(target, drafter, batch):
    """From one state, a round of a tree of 8 nodes records, for the trees of 2 and 4 nodes it holds, the acceptance
    length a round of that tree accepts from the same state, and that tree's prediction; nothing for the chain. Each
    round predicts the trees up to the next size above its own. An oracle drafter with decoys makes the three trees
    accept different lengths."""
    prompts, n = batch
    (tcfg, tparams), (dcfg, dparams) = target, drafter
    ar = decode.generate(target, prompts, decode.GenerateOptions(max_new_tokens=n + dcfg.block_size))
    proposer = oracle(ar.output_ids, peak=[4.0] * 3, noise=[1.0] * 3, decoy_rate=[0.3] * 3)
    opts = decode.GenerateOptions(method="ddtree", max_new_tokens=n, forms=("ar", "chain", "2", "4", "8"))
    spec = decode.make_spec(tcfg, dcfg, opts, proposer=proposer, batch=len(prompts))
    assert spec.predict == (2, 4, 8)
    state, tokens = decode.start(spec, prompts, [opts] * len(prompts), n, tparams.embed.dtype)
    state = decode.compiled(decode.prefill, spec, tparams, dparams, state, tokens)(tparams, dparams, state, tokens)
    one, rounds, seen = jnp.int32(1), {}, {}
    for form in ("chain", "2", "4", "8"):
        fn = decode.compiled(decode.run_rounds, spec.with_form(form), tparams, dparams, state, one)
        after = fn(tparams, dparams, _copy(state), one)
        rounds[form] = np.asarray(after.accept_hist[:, 0])
        seen[form] = np.asarray(after.stats)
    t = len(spec.predict)
    for i, c in enumerate(spec.predict):
        col = policy.seen_column(spec.predict, i)
        np.testing.assert_array_equal(seen["8"][:, col], rounds[str(c)])  # what that tree's own round accepted
        # ... and its prediction there is the one that tree's own round used
        np.testing.assert_allclose(seen["8"][:, policy.STATS + i], seen[str(c)][:, policy.USED], rtol=1e-6)
    np.testing.assert_array_equal(seen["2"][:, policy.seen_column(spec.predict, 0)], rounds["2"])
    assert not seen["2"][:, policy.seen_column(spec.predict, 2)].any()  # a tree of 2 does not hold 8 nodes
    assert seen["chain"].shape[1] == policy.width(spec.predict) and not seen["chain"][:, policy.STATS + t:].any()
    assert len({tuple(r) for r in rounds.values()}) >= 3, rounds  # the trees accepted differently
    # A round predicts the trees up to the one it builds: a tree's next size up (the largest: itself), the chain's
    # every tree; the same predictions wherever made (a best-first tree's first c nodes are the c-node tree).
    assert [spec.with_form(f).build_budget for f in ("ar", "chain", "2", "4", "8")] == [0, 8, 4, 8, 8]
    pred = {f: seen[f][:, policy.STATS : policy.STATS + t] for f in seen}
    assert pred["2"][:, :2].all() and not pred["2"][:, 2].any() and pred["4"].all() and pred["chain"].all()
    np.testing.assert_allclose(pred["2"][:, :2], pred["8"][:, :2], rtol=1e-6)
    np.testing.assert_allclose(pred["chain"], pred["8"], rtol=1e-6)


def test_quick_handoffs_restore_the_interval_after_the_last_closes_in_any_order():
    """Two users of autorun.quick_handoffs (two engines, an engine and a generate) may close in either order: the
    switch interval stays short until the last one closes, then is what it was before the first."""
    before = sys.getswitchinterval()
    a, b = autorun.quick_handoffs(), autorun.quick_handoffs()
    a.__enter__()
    b.__enter__()
    assert sys.getswitchinterval() <= autorun.HANDOFF_S < before
    a.__exit__(None, None, None)  # the first to open closes first
    assert sys.getswitchinterval() <= autorun.HANDOFF_S
    b.__exit__(None, None, None)
    assert sys.getswitchinterval() == before
