"""End-to-end parity with the official DDTree code on the tiny pair (generate.json), single and batched."""

import dataclasses
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ddtree_jax import accept, autorun, decode, projection, slots, tuning, weight_layout
from ddtree_jax import round as round_lib, spec as spec_lib
from ddtree_jax.params import LayerWeights
from ddtree_jax.round import draft_logits
from ddtree_jax.tuning import Tuning
from tests.conftest import blocking_like_a_gpu


def tree_paths(tokens, parents):
    """A tree as the set of its root-to-node token paths (node order is best-first, ties arbitrary)."""
    out = set()
    for k in range(len(tokens)):
        path, j = [], k + 1
        while j > 0:
            path.append(int(tokens[j - 1]))
            j = int(parents[j])
        out.add(tuple(reversed(path)))
    return out


def accepted_tokens(round_):
    toks = round_["tree"]["node_token_ids"]
    return [toks[i - 1] for i in round_["accepted_indices"][1:]]


def options(method, run, **kw):
    return decode.GenerateOptions(method=method, max_new_tokens=run["max_new_tokens"], **kw)


def test_ar_single_and_batched(target, reference_runs):
    for run in reference_runs:
        res = decode.generate(target, [run["prompt"]], options("ar", run))
        assert res.output_ids[0] == run["ar"]
        assert res.num_generated[0] == run["max_new_tokens"]
    n = min(r["max_new_tokens"] for r in reference_runs)
    batch = decode.generate(target, [r["prompt"] for r in reference_runs], decode.GenerateOptions(max_new_tokens=n))
    for run, out in zip(reference_runs, batch.output_ids):
        assert out == run["ar"][: len(run["prompt"]) + n]


def rows_with_their_own_limits(target, drafter, reference_runs, opts):
    """The reference prompts in one batch, each row with its own max_new_tokens (40, 64, 48: its reference run's),
    through decode.generate's steps (decode.start, the compiled prefill and round loop, trace_rounds):
    (outputs, acceptance lengths, traced rounds) per row. One compiled prefill and round loop for the three runs
    instead of one each (their prompt lengths and limits differ); rows of a batch are independent (the batched tests
    below compare a batch with the reference too)."""
    (tcfg, tparams), (dcfg, dparams) = target, drafter
    prompts = [r["prompt"] for r in reference_runs]
    limits = [r["max_new_tokens"] for r in reference_runs]
    spec = decode.make_spec(tcfg, dcfg, dataclasses.replace(opts, max_new_tokens=max(limits)))
    per_row = [dataclasses.replace(opts, max_new_tokens=n) for n in limits]
    state, tokens = decode.start(spec, prompts, per_row, max(limits), tparams.embed.dtype)
    rounds = jnp.int32(max(limits) + 1)
    state = decode.compiled(decode.prefill, spec, tparams, dparams, state, tokens)(tparams, dparams, state, tokens)
    state = decode.compiled(decode.run_rounds, spec, tparams, dparams, state, rounds)(tparams, dparams, state, rounds)
    assert bool(jnp.all(state.done))
    ends, out = decode.final_length(state), np.asarray(state.out)
    hist, n = np.asarray(state.accept_hist), np.asarray(state.n_rounds)
    assert decode.round_statistics_problem(spec, n, hist) is None
    rows = range(len(prompts))
    return ([out[i, : ends[i]].tolist() for i in rows], [hist[i, : n[i]].tolist() for i in rows],
            [decode.trace_rounds(spec, state, i) for i in rows] if spec.trace else None)


def test_dflash_chain(target, drafter, reference_runs):
    outputs, acceptance, _ = rows_with_their_own_limits(target, drafter, reference_runs,
                                                        decode.GenerateOptions(method="dflash"))
    for run, output, accepted in zip(reference_runs, outputs, acceptance):
        assert output == run["dflash"]["output"] == run["ar"]
        assert accepted == run["dflash"]["acceptance_lengths"]


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_ddtree_matches_reference_round_by_round(target, drafter, reference_runs, budget):
    opts = decode.GenerateOptions(method="ddtree", tree_budget=budget, trace=True)
    outputs, acceptance, traced = rows_with_their_own_limits(target, drafter, reference_runs, opts)
    for run, output, accepted, rounds in zip(reference_runs, outputs, acceptance, traced):
        ref = run["ddtree"][str(budget)]
        assert output == ref["output"] == run["ar"]
        assert accepted == ref["acceptance_lengths"]
        assert len(rounds) == len(ref["rounds"])
        # The reference slices its draft block out of an output buffer of max_length + 1 + budget tokens:
        # in the last rounds of a small budget the block is cut short and its bonus row becomes "depth 1".
        # Our drafter always sees a whole block, so those rounds' trees are excluded (outputs still equal).
        limit = len(run["prompt"]) + run["max_new_tokens"] + 1 + budget
        starts = len(run["prompt"]) + np.concatenate([[0], np.cumsum(ref["acceptance_lengths"])[:-1]])
        whole = starts + drafter[0].block_size <= limit
        same = compared = 0
        for mine, theirs, ok in zip(rounds, ref["rounds"], whole):
            assert mine["tree"]["parents"][0] == -1 and len(mine["tree"]["node_token_ids"]) == budget
            assert accepted_tokens(mine) == accepted_tokens(theirs)
            # the traced target choices replay the round's walk on the host
            tree, path = mine["tree"], mine["accepted_indices"]
            assert accept.walk_host(tree["node_token_ids"], tree["parents"], mine["target_choices"]) == path
            if not ok:
                continue
            compared += 1
            same += tree_paths(mine["tree"]["node_token_ids"], mine["tree"]["parents"]) == tree_paths(
                theirs["tree"]["node_token_ids"], theirs["tree"]["parents"]
            )
        assert compared >= len(rounds) - drafter[0].block_size
        share = same / compared
        assert share == 1.0 if budget <= 16 else share >= 0.9, share


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 4), ("ddtree", 64)])
def test_batched_prompts_of_different_lengths(target, drafter, reference_runs, method, budget):
    """All three prompts (5, 23 and 64 tokens) in one batch: same outputs and per-round lengths."""
    n = min(r["max_new_tokens"] for r in reference_runs)
    kw = {"tree_budget": budget or 1}  # dflash: a fixed budget runs the chain every round
    res = decode.generate(
        target, [r["prompt"] for r in reference_runs], decode.GenerateOptions(method=method, max_new_tokens=n, **kw),
        draft=drafter,
    )
    for run, out, acc in zip(reference_runs, res.output_ids, res.acceptance_lengths):
        assert out == run["ar"][: len(run["prompt"]) + n]
        ref = run["dflash"] if method == "dflash" else run["ddtree"][str(budget)]
        # the reference ran to its own max_new_tokens: compare the rounds that fit in n tokens
        assert acc == ref["acceptance_lengths"][: len(acc)]
        assert sum(acc[:-1]) < n <= sum(acc)  # rounds run while the committed length is under the limit


def test_stop_token_and_max_tokens(target, drafter, reference_runs):
    run = reference_runs[2]
    gen = run["ar"][len(run["prompt"]) :]
    stop = gen[5]
    first = gen.index(stop)
    for method in ("ar", "ddtree"):  # ddtree under auto, AR steps or trees of 8 nodes
        res = decode.generate(
            target, [run["prompt"]], decode.GenerateOptions(method=method, max_new_tokens=30, stop_token_ids=(stop,),
                                                            forms=("ar", "8")),
            draft=drafter,
        )
        assert res.output_ids[0] == run["prompt"] + gen[: first + 1], method
    res = decode.generate(target, [run["prompt"]], decode.GenerateOptions(method="dflash", max_new_tokens=3,
                                                                           tree_budget=1), draft=drafter)
    assert res.output_ids[0] == run["prompt"] + gen[:3]


def test_one_shape_compiles_once(target, drafter, reference_runs, monkeypatch):
    """generate keeps its ahead-of-time compiled programs: a second call at the same shapes compiles nothing and
    decodes the same; another prompt whose buffers round to the same sizes but whose padded length differs (5 and 23
    tokens: 16 and 32) compiles its own prefill and reuses the round loop."""
    lowered = []
    for fn in (decode.prefill, decode.run_rounds):
        real = fn.lower
        monkeypatch.setattr(fn, "lower", lambda *a, real=real, name=fn.__name__, **k: lowered.append(name) or real(
            *a, **k), raising=False)
    decode._COMPILED.clear()
    a, b = (r["prompt"] for r in reference_runs[:2])
    opts = decode.GenerateOptions(method="ddtree", tree_budget=4, max_new_tokens=8)
    first = decode.generate(target, [a], opts, draft=drafter)
    again = decode.generate(target, [a], opts, draft=drafter)
    assert again.output_ids == first.output_ids
    assert sorted(lowered) == ["prefill", "run_rounds"]
    layouts = [decode.layout(decode.make_spec(target[0], drafter[0], opts), [len(p)], 8) for p in (a, b)]
    assert layouts[0][0] != layouts[1][0] and layouts[0][1:] == layouts[1][1:]  # pads differ, buffers do not
    decode.generate(target, [b], opts, draft=drafter)
    assert sorted(lowered) == ["prefill", "prefill", "run_rounds"]


def test_streaming_callback_sees_every_token_once(target, drafter, reference_runs):
    """Streamed tokens, every 3 rounds; with trace=True, generate's traced rounds (trees, paths, target choices) are
    those the round-by-round test above checks (the batch helper's, here on this one prompt: the same programs)."""
    run = reference_runs[0]
    seen = []
    res = decode.generate(
        target, [run["prompt"]], options("ddtree", run, tree_budget=4, trace=True), draft=drafter,
        on_tokens=lambda new: seen.extend(new[0]), stream_every=3,
    )
    assert run["prompt"] + seen == res.output_ids[0] == run["ar"]
    assert res.acceptance_lengths[0] == run["ddtree"]["4"]["acceptance_lengths"]
    _, _, traced = rows_with_their_own_limits(target, drafter, reference_runs[:1],
                                              decode.GenerateOptions(method="ddtree", tree_budget=4, trace=True))
    assert res.rounds[0] == traced[0] and len(traced[0]) == len(run["ddtree"]["4"]["rounds"])


def test_streamed_tokens_are_delivered_while_the_next_group_runs(target, drafter, reference_runs, monkeypatch):
    """On a GPU a group's dispatch returns only once its rounds have run (XLA's runtime reads the round loop's
    predicate on the host); here every group waits for itself and sleeps 30 ms on top. A worker thread runs the
    groups, so the host delivers each group's tokens while the next one runs (the device never waits for the host's
    delivery, here 10 ms each; nor for the GIL: CPython's switch interval is short meanwhile), and the tokens are
    AR's."""
    run = reference_runs[0]
    groups, delivered, seen = [], [], []  # (began, ended) of each group; when each delivery was done
    intervals, before = [], sys.getswitchinterval()  # CPython's switch interval during each delivery; before
    compiled = decode.compiled

    def blocking(fn, spec, *args):
        exe = compiled(fn, spec, *args)
        return blocking_like_a_gpu(exe, groups, 0.03) if fn is decode.run_group else exe

    def on_tokens(new):  # a slow reader (a terminal, a socket): 10 ms a delivery
        time.sleep(0.01)
        delivered.append(time.perf_counter())
        seen.extend(new[0])
        intervals.append(sys.getswitchinterval())

    monkeypatch.setattr(decode, "compiled", blocking)
    res = decode.generate(target, [run["prompt"]], options("ddtree", run, tree_budget=4), draft=drafter,
                          on_tokens=on_tokens, stream_every=2)
    assert run["prompt"] + seen == res.output_ids[0] == run["ar"]
    assert len(delivered) >= 3
    during = [at for at in delivered if any(a < at < b for a, b in groups)]
    assert 2 * len(during) >= len(delivered), (delivered, groups)  # none was, with the groups run on the host's thread
    # the host's thread hands the GIL back quickly while the groups run (autorun.quick_handoffs), and only then
    assert max(intervals) <= autorun.HANDOFF_S < before == sys.getswitchinterval()


def test_bad_requests_are_clear_errors(target, drafter):
    with pytest.raises(ValueError, match="needs a drafter"):
        decode.generate(target, [[1, 2]], decode.GenerateOptions(method="ddtree"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decode.generate(target, [[1, 9999]], decode.GenerateOptions())
    with pytest.raises(ValueError, match="unknown method"):
        decode.generate(target, [[1]], decode.GenerateOptions(method="beam"))


def test_impossible_round_statistics_are_an_error(target, drafter, reference_runs):
    """A round that commits nothing, or more than a path, or more rounds than tokens, cannot happen in a correct
    run: round_statistics_problem names it (and generate then raises: next test, with a simulated fault)."""
    spec = decode.make_spec(target[0], drafter[0], decode.GenerateOptions(method="dflash", max_new_tokens=8))
    ok = np.ones((1, 8), np.int32)
    assert decode.round_statistics_problem(spec, np.array([8]), ok) is None
    assert "9 rounds" in decode.round_statistics_problem(spec, np.array([9]), ok)
    assert "0..1" in decode.round_statistics_problem(spec, np.array([8]), ok * (np.arange(8) != 3))
    too_long = ok.copy()
    too_long[0, 0] = spec.path_len + 1
    assert "outside" in decode.round_statistics_problem(spec, np.array([8]), too_long)


def test_a_faulty_round_makes_generate_raise(target, drafter, reference_runs, faulty_walk):
    run = reference_runs[0]
    with pytest.raises(RuntimeError, match="decode fault") as err:
        decode.generate(target, [run["prompt"]], options("dflash", run), draft=drafter)
    assert "--attention xla" not in str(err.value)  # already the XLA path (the CPU default)
    spec = decode.make_spec(target[0], drafter[0], options("dflash", run, attention="pallas"))
    assert decode.fault_message(spec, "x").endswith("(attention pallas-interpret; --attention xla avoids the kernels)")


def test_a_fault_on_the_kernels_path_raises_and_names_the_xla_path(target, drafter, reference_runs, faulty_walk):
    """A decode fault with the Pallas kernels chosen raises, naming the way out; nothing decodes again behind the
    caller's back."""
    run = reference_runs[0]
    with pytest.raises(RuntimeError, match="decode fault.*--attention xla avoids the kernels"):  # the chain alone
        decode.generate(target, [run["prompt"]], options("dflash", run, attention="pallas", tree_budget=1),
                        draft=drafter)


@pytest.mark.parametrize("layout", ["unstacked", "stacked-out-major", "unstacked-out-major-fused",
                                    "stacked-out-major-fused", "stacked-fused"])
def test_gpu_layouts_give_the_same_rounds(target, drafter, reference_runs, layout):
    """The layouts used on GPU (per-layer buffers in an unrolled loop; output-major matrices, whose one-row AR
    steps are row reductions; q/k/v and gate/up fused into one matrix each), for the target and the drafter,
    compute what the stacked scan does: the reference's ddtree rounds (so ``draft.extend``'s context projections too;
    dflash differs from ddtree only in its tree, which no layout touches) and AR's tokens. The drafter also keeps its
    own k and v matrices when fused."""
    run = reference_runs[0]
    (cfg, tp), (dcfg, dp) = target, drafter
    tl, dl = (decode.device_layout(p, backend="gpu", layout=layout) for p in (tp, dp))
    fused = layout.endswith("-fused")
    for laid, is_target in ((tl, True), (dl, False)):
        layers = laid.layers if isinstance(laid.layers, LayerWeights) else laid.layers[0]
        assert layers.output_major == ("out-major" in layout) and layers.fused == fused
        assert (layers.w_up is None) == fused and (layers.wk is None) == (fused and is_target)
    assert tl.output_major == ("out-major" in layout)
    res = decode.generate((cfg, tl), [run["prompt"]], options("ddtree", run, tree_budget=16), draft=(dcfg, dl))
    ref = run["ddtree"]["16"]
    assert res.output_ids[0] == ref["output"] and res.acceptance_lengths[0] == ref["acceptance_lengths"]
    res = decode.generate((cfg, tl), [run["prompt"]], options("ar", run))
    assert res.output_ids[0] == run["ar"]
    # on GPU by default: the target input-major and fused for the rounds, output-major and fused for AR;
    # weights laid out for one method are turned into the other's layout, and back, losslessly
    auto = decode.device_layout(tp, backend="gpu")
    assert auto.layers.__class__ is LayerWeights and not auto.output_major and auto.layers.fused
    assert weight_layout.GPU_LAYOUT == "stacked-fused" and weight_layout.GPU_AR_LAYOUT == "stacked-out-major-fused"
    ar = decode.device_layout(auto, backend="gpu", method="ar")
    assert ar.output_major and ar.layers.output_major and ar.layers.fused
    back = decode.device_layout(ar, backend="gpu", method="ddtree")
    assert not back.layers.output_major and all(
        np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(auto), jax.tree.leaves(back)))
    dauto = decode.device_layout(dp, backend="gpu")  # a drafter output-major
    assert dauto.layers.output_major and dauto.layers.fused and dauto.layers.wk is not None
    assert weight_layout.DRAFT_GPU_LAYOUT == "stacked-out-major-fused"
    # the README's tables read the records measured in these defaults
    assert projection.LAYOUTS == {"ar": weight_layout.GPU_AR_LAYOUT, "dflash": weight_layout.GPU_LAYOUT, "ddtree": weight_layout.GPU_LAYOUT}
    assert projection.DRAFT_LAYOUTS[0] == weight_layout.DRAFT_GPU_LAYOUT
    assert decode.device_layout(tp, backend="cpu") is tp and decode.device_layout(dp, backend="cpu") is dp


def test_a_dual_layout_gives_one_row_forwards_their_own_output_major_copy(target, drafter, reference_runs):
    """``stacked-fused-dual``: the target's layers input-major and fused, and again output-major (``one_row``) for
    forwards of one row. AR steps of one sequence read the copy and nothing else does: with the copy spoiled, AR's
    tokens change while the ddtree rounds (prefill and verify: several rows each) stay the reference's; with the true
    copy both are the reference's. Laid out again it is kept; any other layout drops the copy; a drafter and an MoE
    target hold none."""
    from ddtree_jax import params as params_lib, shapes

    run = reference_runs[0]
    (cfg, tp), (dcfg, dp) = target, drafter
    dual = decode.device_layout(tp, backend="gpu", layout="stacked-fused-dual")
    assert not dual.layers.output_major and dual.layers.fused and dual.one_row.output_major and dual.one_row.fused
    copy = params_lib.output_major(dataclasses.replace(dual, one_row=None)).layers
    assert all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(copy), jax.tree.leaves(dual.one_row)))
    assert decode.device_layout(dual, backend="gpu", layout="stacked-fused-dual") is dual
    assert decode.device_layout(dual, backend="gpu", layout="stacked-fused").one_row is None
    assert decode.device_layout(dual, backend="gpu", method="ar").one_row is None  # the GPU default for AR
    dl = decode.device_layout(dp, backend="gpu", layout="stacked-fused-dual")
    assert not dl.layers.output_major and dl.layers.fused and not hasattr(dl, "one_row")

    spoiled = dataclasses.replace(dual, one_row=jax.tree.map(jnp.zeros_like, dual.one_row))
    for laid, ar_is_reference in ((dual, True), (spoiled, False)):
        res = decode.generate((cfg, laid), [run["prompt"]], options("ddtree", run, tree_budget=16), draft=(dcfg, dl))
        ref = run["ddtree"]["16"]
        assert res.output_ids[0] == ref["output"] and res.acceptance_lengths[0] == ref["acceptance_lengths"]
        res = decode.generate((cfg, laid), [run["prompt"]], options("ar", run))
        assert (res.output_ids[0] == run["ar"]) == ar_is_reference

    (_, mp), _ = shapes.random_models("tiny-moe", jnp.float32, draft=False)
    assert decode.device_layout(mp, backend="gpu", layout="stacked-fused-dual").one_row is None


@pytest.mark.parametrize("out_major", [True, False])
def test_fused_projections_are_the_separate_ones(target, out_major):
    """fuse_projections: wq = [q | k | v] along the heads, w_gate = [gate | up] along the features, in either
    orientation of the matrices; num_heads reads the heads off wo either way; idempotent."""
    from ddtree_jax import params as params_lib

    cfg, tp = target
    plain = params_lib.output_major(tp) if out_major else tp
    fused = params_lib.fuse_projections(plain)
    w, f = plain.layers, fused.layers
    h, k, i = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    heads = (slice(None),) if out_major else (slice(None), slice(None))  # [L, H, hd, D] / [L, D, H, hd]
    feats = heads  # [L, F, D] / [L, D, F]
    for part, got in ((w.wq, f.wq[(*heads, slice(0, h))]), (w.wk, f.wq[(*heads, slice(h, h + k))]),
                      (w.wv, f.wq[(*heads, slice(h + k, None))])):
        np.testing.assert_array_equal(np.asarray(part), np.asarray(got))
    np.testing.assert_array_equal(np.asarray(w.w_gate), np.asarray(f.w_gate[(*feats, slice(0, i))]))
    np.testing.assert_array_equal(np.asarray(w.w_up), np.asarray(f.w_gate[(*feats, slice(i, None))]))
    assert params_lib.num_heads(w) == params_lib.num_heads(f) == h and f.output_major == out_major
    assert params_lib.fuse_projections(fused) is fused or params_lib.fuse_projections(fused).layers is f


@pytest.mark.parametrize("align,budget", [(8, 4), (16, 16)])  # 5 rows -> 8, 17 -> 32
def test_a_padded_verify_block_changes_nothing(target, drafter, reference_runs, align, budget):
    """On GPU the verify block's rows are padded to a multiple of 8 (spec.default_verify_align: XLA pads its
    GEMMs so anyway; Tuning.verify_align sets it). Padding rows see the prefix and themselves only and have no
    logits: the rounds are the reference's, whatever the padding."""
    run = reference_runs[0]
    opts, tuned = options("ddtree", run, tree_budget=budget), Tuning(verify_align=align)
    spec = decode.make_spec(target[0], drafter[0], opts, tuned)
    assert spec.verify_len == -(-(1 + budget) // align) * align > 1 + budget
    assert decode.make_spec(target[0], drafter[0], opts).tuning.verify_align == 1  # CPU's default
    res = decode.generate(target, [run["prompt"]], opts, draft=drafter, tuning=tuned)
    ref = run["ddtree"][str(budget)]
    assert res.output_ids[0] == ref["output"] and res.acceptance_lengths[0] == ref["acceptance_lengths"]


@pytest.mark.parametrize("unroll", [2, 4])
def test_an_unrolled_layer_loop_changes_nothing(target, drafter, reference_runs, unroll):
    """The verify's layer loop unrolled (Tuning.layer_unroll; 2 divides the tiny target's 6 layers, 4 does not), for
    every block as the default does for one row on GPU: AR's tokens, and at 4 the reference's ddtree rounds too (a
    block of 17 rows unrolled as one row is: the loop is the same)."""
    run, tuned = reference_runs[0], Tuning(layer_unroll=unroll)
    if unroll == 4:
        res = decode.generate(target, [run["prompt"]], options("ddtree", run, tree_budget=16), draft=drafter,
                              tuning=tuned)
        ref = run["ddtree"]["16"]
        assert res.output_ids[0] == ref["output"] and res.acceptance_lengths[0] == ref["acceptance_lengths"]
    assert decode.generate(target, [run["prompt"]], options("ar", run), tuning=tuned).output_ids[0] == run["ar"]


def test_the_default_unroll_is_for_one_row_or_small_layers_on_gpu_only(target, monkeypatch):
    """On GPU a stack of small layers runs as one iteration (the default pair's target: 30 layers of 7 MB), an AR
    step of large ones GPU_AR_LAYER_UNROLL layers an iteration, a block of several rows one layer; on CPU one layer."""
    big, small = 400 << 20, 7 << 20  # a Qwen3-8B layer, a SmolLM2-135M one
    assert spec_lib.default_layer_unroll(1, small, 30) == spec_lib.default_layer_unroll(1, big, 36) == 1  # CPU
    cfg, params = target
    spec = decode.make_spec(cfg, None, decode.GenerateOptions(method="ar"))
    assert round_lib.layer_unroll(spec, params, 1) == 1
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert spec_lib.default_layer_unroll(1, big, 36) == spec_lib.GPU_AR_LAYER_UNROLL > 1
    assert spec_lib.default_layer_unroll(8, big, 36) == spec_lib.default_layer_unroll(72, big, 36) == 1
    assert spec_lib.default_layer_unroll(1, small, 30) == spec_lib.default_layer_unroll(72, small, 30) == 30
    assert round_lib.layer_unroll(spec, params, 1) == cfg.num_layers  # the tiny target's layers are small
    tuned = dataclasses.replace(spec, tuning=Tuning(layer_unroll=2))
    assert round_lib.layer_unroll(tuned, params, 1) == 2


def test_round_positions_are_the_blocks_a_round_writes_before_padding(target, drafter):
    """What the engine and the server check against max_position_embeddings: root + tree (or chain) + the
    drafter's block, whatever the verify padding (padding rows sit at the root's position)."""
    (cfg, _), (dcfg, _) = target, drafter
    bs = dcfg.block_size
    spec = {m: decode.make_spec(cfg, dcfg if m != "ar" else None, decode.GenerateOptions(method=m, tree_budget=20),
                                Tuning(verify_align=8)) for m in ("ar", "dflash", "ddtree")}
    assert {m: s.round_positions for m, s in spec.items()} == {"ar": 1, "dflash": 2 * bs, "ddtree": 21 + bs}
    assert spec["ddtree"].scratch_slots == 24 + bs > spec["ddtree"].round_positions


def test_a_small_tree_drafts_only_the_depths_it_can_reach(target, drafter, reference_runs):
    """A best-first tree of c nodes reaches depth c at most: its round computes the draft head for the first
    min(c, bs - 1) depths (under auto: those of the tree it builds), the same rows as the chain's round gets."""
    (cfg, tparams), (dcfg, dparams) = target, drafter
    bs = dcfg.block_size

    def spec(budget, method="ddtree"):
        return decode.make_spec(cfg, dcfg, decode.GenerateOptions(method=method, tree_budget=budget))

    assert [spec(b).draft_depths for b in (1, 4, bs - 1, 64)] == [1, 4, bs - 1, bs - 1]
    assert spec(4, "dflash").draft_depths == bs - 1
    auto = decode.make_spec(cfg, dcfg, decode.GenerateOptions(method="ddtree", tree_budget="auto",
                                                              forms=("ar", "chain", "2", "4", "64")))
    assert [auto.with_form(f).draft_depths for f in ("2", "4", "64", "chain")] == [4, bs - 1, bs - 1, bs - 1]
    run = reference_runs[0]
    opts = decode.GenerateOptions(method="ddtree", tree_budget=4)
    state, tokens = decode.start(spec(4), [run["prompt"]], [opts], 8, tparams.embed.dtype)
    state = decode.prefill(spec(4), tparams, dparams, state, tokens)
    small = draft_logits(spec(4), tparams, dparams, state)[0]
    full = draft_logits(spec(4, "dflash"), tparams, dparams, state)[0]
    assert small.shape[1] == 4 and full.shape[1] == bs - 1
    np.testing.assert_allclose(small, full[:, :4], rtol=1e-5, atol=1e-5)


def test_start_builds_the_state_in_one_program_a_shape(target):
    """decode.start's fresh state comes from one jitted program per shape (decode.fresh_state: no trace and no leaf
    by leaf building per call) and equals the state init_state builds."""
    opts = decode.GenerateOptions(temperature=0.7, seed=3)
    spec = decode.make_spec(target[0], None, opts)
    decode.fresh_state.cache_clear()
    state, _ = decode.start(spec, [[1, 2, 3], [4, 5]], [opts, decode.GenerateOptions()], 8, np.float32)
    _, capacity, out_len = decode.layout(spec, [3, 2], 8)
    want = decode.init_state(spec, [3, 2], [opts, decode.GenerateOptions()], capacity, out_len, np.float32)
    raw = lambda x: jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x  # noqa: E731
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(raw(a), raw(b)), state, want)
    decode.start(spec, [[7, 8], [9]], [decode.GenerateOptions()] * 2, 8, np.float32)  # the same shapes: reused
    assert decode.fresh_state.cache_info().misses == 1 and decode.fresh_state.cache_info().hits == 1


def test_greedy_runs_compile_the_greedy_choice_alone(target):
    """make_spec specialises on the options' temperature and filters (Spec.sampling, Spec.filtering), and a state
    asking for a sample from a greedy-only program, or for a filter from one without, is a clear error, not a silent
    argmax or an unfiltered sample."""
    greedy = decode.make_spec(target[0], None, decode.GenerateOptions())
    sampled = decode.make_spec(target[0], None, decode.GenerateOptions(temperature=0.7))
    assert not greedy.sampling and sampled.sampling
    hot = decode.GenerateOptions(temperature=0.7)
    with pytest.raises(ValueError, match="needs a sampling program"):
        decode.init_state(greedy, [3], [hot], 16, 8, np.float32)
    decode.init_state(sampled, [3, 3], [hot, decode.GenerateOptions()], 16, 8, np.float32)  # mixed rows: fine
    assert not sampled.filtering  # top-k / top-p: a filtering program, and a clear error without one
    nucleus = decode.GenerateOptions(temperature=0.7, top_p=0.9)
    assert decode.make_spec(target[0], None, nucleus).filtering
    assert decode.make_spec(target[0], None, decode.GenerateOptions(temperature=0.7, top_k=5)).filtering
    assert not decode.make_spec(target[0], None, decode.GenerateOptions(top_p=0.9)).filtering  # greedy: moot
    with pytest.raises(ValueError, match="need a filtering program"):
        decode.init_state(sampled, [3], [nucleus], 16, 8, np.float32)
    decode.init_state(sampled, [3], [decode.GenerateOptions(top_k=5)], 16, 8, np.float32)  # greedy rows: fine


def test_tuning_is_parsed_and_checked():
    """--tuning KEY=VALUE,... (tuning.parse) sets fields over a base; an unknown key or a bad value is a one-line
    ValueError, as is a bad field given to Tuning itself."""
    got = tuning.parse("qkv_write=0, layer_unroll=2,layout=stacked", Tuning(add_norm=False))
    assert got == Tuning(layout="stacked", qkv_write=False, add_norm=False, layer_unroll=2)
    assert tuning.parse("") == Tuning() and hash(got) == hash(dataclasses.replace(got))
    for text, msg in (("unroll=2", "expected KEY=VALUE with KEY one of layout,"), ("add_norm=xla", "expected 0 or 1"),
                      ("prefill_chunk=0", "expected a positive integer"), ("verify_align=x", "a positive integer"),
                      ("layout=rolled", "expected one of auto, stacked,"), ("qkv_write", "expected KEY=VALUE")):
        with pytest.raises(ValueError, match=msg):
            tuning.parse(text)
    with pytest.raises(ValueError, match="layer_unroll=True: expected a positive integer"):
        Tuning(layer_unroll=True)


def test_layout_can_be_forced(target):
    """layout= (Tuning.layout) overrides the per-backend choice; a bad value is a clear error."""
    _, tp = target
    assert decode.device_layout(tp, backend="gpu", layout="stacked") is tp
    assert decode.device_layout(tp, backend="cpu", layout="unstacked").layers.__class__ is tuple
    with pytest.raises(ValueError, match="layout must be one of"):
        decode.device_layout(tp, layout="rolled")


def test_cpu_layout_materialises_a_tied_head_in_f32(llama, target):
    """On CPU a tied lm_head is made once in f32 for one-row products (XLA:CPU would relayout the embedding on
    every call); products of several rows read the embedding itself (a bf16 GEMM: 13% faster rounds at SmolLM2's
    shape than the f32 copy's); the logits are the same, untied models and other backends are untouched."""
    from ddtree_jax import model

    cfg, tp = llama
    assert tp.lm_head is None
    laid = decode.device_layout(tp, backend="cpu")
    assert laid.lm_head.dtype == jnp.float32 and laid.lm_head.shape == tp.embed.T.shape and laid.head_copy
    h = jax.random.normal(jax.random.key(0), (2, 3, cfg.hidden_size), tp.embed.dtype)
    np.testing.assert_array_equal(np.asarray(model.logits(laid, h)), np.asarray(model.logits(tp, h)))
    one = h[:1, :1]
    np.testing.assert_allclose(np.asarray(model.logits(laid, one)), np.asarray(model.logits(tp, one)), rtol=1e-5,
                               atol=1e-5)
    blank = dataclasses.replace(laid, lm_head=jnp.zeros_like(laid.lm_head))  # which weights each product reads
    assert not np.any(np.asarray(model.logits(blank, one)))
    np.testing.assert_array_equal(np.asarray(model.logits(blank, h)), np.asarray(model.logits(tp, h)))
    assert decode.device_layout(tp, backend="gpu", layout="stacked").lm_head is None
    assert decode.device_layout(target[1], backend="cpu") is target[1]


def output_buffers(exe) -> dict[int, int]:
    """A compiled program's donations: output index -> the parameter whose buffer it takes (input_output_alias)."""
    head = exe.as_text().split("\n", 1)[0]
    return {int(o): int(p) for o, p in re.findall(r"\{(\d+)\}: \((\d+), \{\}", head)}


def test_donated_state_leaves_keep_their_own_buffers(target, drafter, reference_runs):
    """Each State leaf of a program that donates the State comes back in that leaf's own buffer. jax pairs a donated
    buffer with the first output of its shape; prefill never reads the lengths, bonus or n_out, and once jax pruned
    them the pairs shifted (prompt_len's value went into n_rounds' buffer), which XLA on an H200 miscompiled
    (decode.donating_jit keeps every argument)."""
    run = reference_runs[0]
    opts = options("ddtree", run, tree_budget=4)
    (tcfg, tparams), (dcfg, dparams) = target, drafter
    spec = decode.make_spec(tcfg, dcfg, opts)
    p_pad, capacity, out_len = decode.layout(spec, [len(run["prompt"])], opts.max_new_tokens)
    state = decode.init_state(spec, [len(run["prompt"])], [opts], capacity, out_len, jnp.float32)
    first, n = len(jax.tree.leaves((tparams, dparams))), len(jax.tree.leaves(state))
    programs = {
        "prefill": decode.compiled(decode.prefill, spec, tparams, dparams, state, jnp.zeros((1, p_pad), jnp.int32)),
        "run_rounds": decode.compiled(decode.run_rounds, spec, tparams, dparams, state, jnp.int32(1)),
        "run_group": decode.run_group.lower(spec, tparams, dparams, state, jnp.zeros((1,), jnp.int32), jnp.int32(2),
                                            2).compile(),
    }
    for name, exe in programs.items():
        assert output_buffers(exe) == {i: first + i for i in range(n)}, name
    # an auto run's State (with its forms and statistics), through the engine's group of a smaller slot batch
    auto = decode.make_spec(tcfg, dcfg, dataclasses.replace(opts, tree_budget="auto", forms=("ar", "4")))
    state = decode.init_state(auto, [len(run["prompt"])] * 2, [opts] * 2, capacity, out_len, jnp.float32)
    n = len(jax.tree.leaves(state))
    one = jnp.zeros((1,), jnp.int32)
    exe = slots.run_group_rows.lower(auto.with_form("ar"), tparams, dparams, state, one, one, jnp.int32(2), 2).compile()
    assert output_buffers(exe) == {i: first + i for i in range(n)}
