"""Smoke test of ``python -m ddtree_jax.bench fixtures`` (CPU, the tiny reference pair): records come out,
with per-round times, acceptance lengths and parity with the reference output. Kept well under a minute."""

import argparse
import dataclasses
import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_jax import bench, decode, projection, weight_layout
from ddtree_jax.bench import analysis


def test_fixtures_mode_smoke(tmp_path, capsys):
    out = tmp_path / "fixtures.json"
    code = bench.main(["fixtures", "--methods", "ar,ddtree", "--budgets", "4", "--prompts", "1",
                       "--max-new-tokens", "12", "--repeats", "1", "--json", str(out)])
    assert code == 0
    records = json.loads(out.read_text())
    assert [(r["method"], r["budget"]) for r in records] == [("ar", None), ("ddtree", 4)]
    for r in records:
        assert r["matches_reference"] is True
        assert r["ms_per_round"] > 0 and r["rounds"] >= 1
        assert r["batch"] == 1 and r["max_new_tokens"] == 12
        assert r["command"].startswith("python -m ddtree_jax.bench fixtures")
    ar, tree = records
    assert ar["mean_acceptance_length"] is None and ar["rounds"] == 12
    assert tree["mean_acceptance_length"] >= 1.0
    assert tree["tokens_per_round"] >= 1.0
    table = capsys.readouterr().out
    assert "ms_per_round" in table and "ddtree" in table


def test_fixtures_mode_on_a_mesh(tmp_path):
    """--mesh runs decode.generate's sharded path (one CPU device here: 1x1; tests/test_sharding.py has 8) and
    still gives the reference's tokens; the mesh is recorded."""
    out = tmp_path / "mesh.json"
    assert bench.main(["fixtures", "--methods", "ddtree", "--budgets", "4", "--prompts", "1", "--max-new-tokens",
                       "8", "--repeats", "1", "--mesh", "1x1", "--json", str(out)]) == 0
    (rec,) = json.loads(out.read_text())
    assert rec["mesh"] == "1x1" and rec["matches_reference"] is True


def test_pair_mode_on_the_fixture_pair(tmp_path, capsys, monkeypatch):
    """``bench pair`` with an explicit pair: held-out prompts, every method (ddtree at a fixed budget and under auto,
    whose costs go to the cache directory's table), acceptance and speed vs AR; --tuning applies to every method."""
    from tests.conftest import fixture_path

    from ddtree_jax import decode

    monkeypatch.setenv("DDTREE_JAX_CACHE", str(tmp_path))
    methods, generate = [], decode.generate
    monkeypatch.setattr(decode, "generate", lambda t, p, o, **kw: methods.append(o.method) or generate(t, p, o, **kw))
    out = tmp_path / "pair.json"
    code = bench.main(["pair", "--target", fixture_path("target"), "--draft", fixture_path("draft"),
                       "--budgets", "4,auto", "--forms", "ar,4", "--prompts", "2", "--max-new-tokens", "8",
                       "--dtype", "float32", "--check", "--tuning", "layer_unroll=2", "--json", str(out)])
    assert code == 0
    res = json.loads(out.read_text())
    assert list(res["methods"]) == ["ar", "dflash", "ddtree-4", "ddtree-auto"] and res["prompts"] == 2
    assert res["tuning"]["layer_unroll"] == 2
    forms = res["methods"]["ddtree-auto"]["forms"]
    assert res["batch"] == 1 and set(forms) <= {"ar", "4"} and sum(forms.values()) >= 2
    costs = res["methods"]["ddtree-auto"]["costs_ms"]  # the costs auto weighed, per prompt: every form timed
    assert set(costs) == {"ar", "4"} and all(len(c["timed"]) == len(c["decode"]) == 2 for c in costs.values())
    calls = res["methods"]["ddtree-auto"]["calls"]  # each prompt's decode: its groups, a device call each
    assert len(calls) == 2 and min(calls) >= 1 and sum(calls) <= sum(forms.values())  # a call runs a round at least
    assert all(x > 0 for c in costs.values() for x in c["timed"] + c["decode"])
    assert (tmp_path / "costs.json").exists()
    assert res["methods"]["ar"]["speedup"] == 1.0
    assert res["methods"]["ddtree-4"]["mean_acceptance_length"] >= 1.0
    assert res["methods"]["dflash"]["min_acceptance_length"] >= 1 and res["methods"]["ar"]["min_acceptance_length"] is None
    for name in ("dflash", "ddtree-4", "ddtree-auto"):  # --check: f32 greedy equals ar; traced walks replay on the host
        row = res["methods"][name]
        assert row["same_as_ar"] == 2 and row["first_divergence"] is None and row["traced_same_as_untraced"]
        assert row["walk_mismatches"] == 0 and row["traced_rounds"] >= 2  # a round per prompt at least
    assert "walk mismatches" in capsys.readouterr().out
    assert methods.count("ar") == 2  # one AR decode a prompt: auto's check reuses it
    assert bench.main(["pair", "--target", str(tmp_path / "nope")]) == 2


def test_pair_mode_keeps_the_prompts_done_when_cut_short(tmp_path, capsys, monkeypatch):
    """``bench pair --json`` writes its record after every prompt: a run cut short (here the second prompt's
    benchmark fails; on a device, a call's time limit) leaves the first prompt's methods, counted in prompts_done, and
    each prompt's line of progress on stderr."""
    from tests.conftest import fixture_path

    from ddtree_jax.training import evaluate

    calls, benchmark = [], evaluate.benchmark

    def cut(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a time limit's signal would
        return benchmark(*a, **kw)

    monkeypatch.setattr(evaluate, "benchmark", cut)
    out = tmp_path / "pair.json"
    code = bench.main(["pair", "--target", fixture_path("target"), "--draft", fixture_path("draft"), "--budgets", "4",
                       "--prompts", "2", "--max-new-tokens", "4", "--dtype", "float32", "--json", str(out)])
    assert code != 0  # interrupted: one line, no traceback
    res = json.loads(out.read_text())
    assert res["prompts"] == 2 and res["prompts_done"] == 1
    assert list(res["methods"]) == ["ar", "dflash", "ddtree-4"] and res["methods"]["ar"]["tokens_per_s"] > 0
    err = capsys.readouterr().err
    assert "prompt 1/2: ar " in err and "prompt 2/2" not in err


def test_models_mode_writes_the_issue_records(tmp_path):
    """``bench models`` on the tiny shape (CPU): one record per method with the fields the results files hold
    (model, method, budget, batch, prompt_len, ms_per_round, breakdown_ms, roofline_ms, date, command), AR against
    its roofline, rounds against AR, the stage breakdown of the breakdown configurations (ddtree's: the key budgets,
    which --quick keeps when given), each under the --tuning asked."""
    code = bench.main(["models", "--quick", "--batches", "1", "--budgets", "4", "--key-budgets", "4", "--no-hlo",
                       "--no-profile", "--no-tree-micro", "--tuning", "verify_align=4", "--out", str(tmp_path)])
    assert code == 0
    records = json.loads((tmp_path / "results.json").read_text())
    assert sorted((r["method"], r["budget"]) for r in records) == [("ar", None), ("ddtree", 4), ("dflash", None)]
    for r in records:
        assert {"model", "method", "budget", "batch", "prompt_len", "ms_per_round", "breakdown_ms", "roofline_ms",
                "date", "command"} <= set(r)
        assert r["model"] == "tiny" and r["batch"] == 1 and r["prompt_len"] == 64 and r["ms_per_round"] > 0
        assert r["command"].startswith("python -m ddtree_jax.bench models")
        assert r["details"]["tuning"]["verify_align"] == 4 and r["details"]["tuning"]["add_norm"] is True
    by = {r["method"]: r for r in records}
    assert by["ar"]["roofline_ms"] > 0 and by["ar"]["ratio_to_roofline"] > 0
    assert set(by["ar"]["breakdown_ms"]) >= {"verify", "accept_commit"}
    for m in ("dflash", "ddtree"):
        assert set(by[m]["breakdown_ms"]) >= {"draft", "tree", "verify", "accept_commit"}
        assert by[m]["roofline_ms"] is None and by[m]["ratio_to_ar"] > 0 and by[m]["floor_ms"] > 0
    assert "ceilings" in json.loads((tmp_path / "bench_details.json").read_text())
    for r in records:  # --draft-layout's default, at the top level where projection.round_costs reads it; without
        # --layout, the target laid out as decode does for each method (AR output-major), what the tables read
        assert r["draft_layout"] == r["details"]["draft_layout"] == weight_layout.DRAFT_GPU_LAYOUT
        assert r["layout"] == r["details"]["layout"] == (weight_layout.GPU_AR_LAYOUT if r["method"] == "ar"
                                                         else weight_layout.GPU_LAYOUT) == projection.LAYOUTS[r["method"]]


def _script(name: str):
    """benchmarks/NAME.py loaded as a module in this process."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_interleaved_ab_script(tmp_path):
    """benchmarks/ab_interleaved.py on the tiny shape (CPU): each variant's layouts, tuning, module constants, XLA
    options and auto's forms as asked (auto's round at the fixed budget's form: the same tokens), one timing per pair
    each, the paired differences against the first; a malformed variant is a one-line error."""
    root = Path(__file__).resolve().parents[1]
    script, out = root / "benchmarks" / "ab_interleaved.py", tmp_path / "ab.json"
    env = {**os.environ, "PYTHONPATH": str(root)}
    args = [sys.executable, str(script), "--model", "tiny", "--method", "ddtree", "--budget", "4", "--prompt", "16",
            "--rounds", "2", "--pairs", "3", "--variant", "base:", "--variant", "auto:forms=ar+chain+4+64",
            "--variant", "dom:draft=stacked-out-major,layer_unroll=2",
            "--variant", "tuned:qkv_write=0,sampling=1,pallas_kernels.decode_attention.BLOCK=32",
            "--json", str(out), "--hlo", str(tmp_path / "hlo"), "--profile", str(tmp_path / "prof")]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(out.read_text())
    base, dom = got["variants"]["base"], got["variants"]["dom"]
    assert got["model"] == "tiny" and got["budget"] == 4 and got["pairs"] == 3
    assert base["draft_layout"] == "stacked-out-major-fused" and dom["draft_layout"] == "stacked-out-major"
    assert base["tuning"]["layer_unroll"] is None and dom["tuning"]["layer_unroll"] == 2  # None: decode's default
    assert len(base["ms"]) == len(dom["ms"]) == 3 and min(base["ms"] + dom["ms"]) > 0
    assert base["median_diff_ms_vs_first"] == 0 and base["pairs_faster_than_first"] == 0
    assert all(v["same_tokens_as_first"] for v in got["variants"].values())  # none changes the math (nor prompts)
    assert got["variants"]["tuned"]["tuning"]["qkv_write"] is False and base["tuning"]["qkv_write"] is True
    assert got["variants"]["tuned"]["constants"] == {"pallas_kernels.decode_attention.BLOCK": 32}
    assert base["constants"] == {}
    assert got["variants"]["auto"]["forms"] == ["ar", "chain", "4", "64"] and base["forms"] == []
    assert got["variants"]["auto"]["cache_capacity"] > base["cache_capacity"] > 16  # its scratch fits the tree of 64
    assert got["variants"]["tuned"]["sampling"] and not base["sampling"] and not base["filtering"]
    hlo = {name: gzip.open(tmp_path / "hlo" / f"{name}.hlo.txt.gz", "rt").read() for name in ("base", "dom", "tuned")}
    assert all(text.startswith("HloModule") for text in hlo.values())  # --hlo: each variant's optimized HLO module
    assert set(got["profiles"]) == set(got["variants"])  # --profile: each variant traced after the timings
    assert hlo["tuned"].count(" xor(") > hlo["base"].count(" xor(")  # the sampling program draws (threefry's xors)
    for variant, msg in (("nocolon", "is not NAME:FIELD=VALUE"), ("x:draft=rolled", "draft='rolled': expected one of"),
                         ("x:forms=ar+tree", "forms=ar+tree: unknown form 'tree'")):
        bad = subprocess.run(args[:-8] + ["--variant", variant], capture_output=True, text=True, env=env, timeout=120)
        assert bad.returncode == 2 and msg in bad.stderr.strip().splitlines()[-1], bad.stderr
    module = _script("ab_interleaved")  # the same parser, in this process
    with pytest.raises(argparse.ArgumentTypeError, match="sampling='yes': expected 0 or 1"):
        module.variant("x:sampling=yes")
    with pytest.raises(argparse.ArgumentTypeError, match="filtering='2': expected 0 or 1"):
        module.variant("x:filtering=2")
    _, laid = module.variant("x:forms=ar+chain+4,smallest=1,form=ar")  # auto's AR step, its State laid out for 1
    assert laid["forms"] == ("ar", "chain", "4") and laid["smallest"] == "1" and laid["form"] == "ar"
    for bad, msg in (("x:smallest=2", "smallest=2: a positive slot batch, with forms="),
                     ("x:forms=ar+4,smallest=0", "smallest=0: a positive slot batch"),
                     ("x:forms=ar+4,form=8", "form=8: one of the variant's forms=")):
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            module.variant(bad)
    for bad_unroll in ("0", "two"):
        with pytest.raises(argparse.ArgumentTypeError, match="layer_unroll=.*: expected a positive integer"):
            module.variant(f"x:layer_unroll={bad_unroll}")
    from pallas_kernels import decode_attention as da  # module constants: set while a variant compiles, then restored

    _, fields = module.variant("x:pallas_kernels.decode_attention.BLOCK=128,ddtree_jax.tree.KERNEL_MAX_BATCH=4")
    assert fields["options"] == {} and fields["constants"] == {
        "pallas_kernels.decode_attention.BLOCK": 128, "ddtree_jax.tree.KERNEL_MAX_BATCH": 4}
    _, tupled = module.variant("x:ddtree_jax.model.SPLIT_ROWS=(64, 384),ddtree_jax.model.O_SPLITS=1")  # commas in ()
    assert tupled["constants"] == {"ddtree_jax.model.SPLIT_ROWS": (64, 384), "ddtree_jax.model.O_SPLITS": 1}
    _, braced = module.variant("x:pallas_kernels.tree_attention._CTA_US={1: 3.8, 2: 6.0},ddtree_jax.model.O_SPLITS=1")
    assert braced["constants"] == {"pallas_kernels.tree_attention._CTA_US": {1: 3.8, 2: 6.0},
                                   "ddtree_jax.model.O_SPLITS": 1}
    with module.constants_set(fields["constants"]):
        assert da.BLOCK == 128
    assert da.BLOCK == 64
    for bad in ("pallas_kernels.decode_attention.NOPE=1", "pallas_kernels.nope.X=1",
                "pallas_kernels.decode_attention.BLOCK=abc"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected an existing module constant and a Python"):
            module.variant(f"x:{bad}")


def test_auto_overhead_script(tmp_path):
    """benchmarks/auto_overhead.py on the tiny shape (CPU, in this process): the fixed budget and each auto variant
    decoded alike, auto's rounds taking only the variant's forms in groups of the asked size, restored after; each
    variant's decode traced; a malformed variant is refused."""
    from ddtree_jax import autorun

    module = _script("auto_overhead")
    out = tmp_path / "ao.json"
    assert module.main(["--model", "tiny", "--budget", "4", "--tokens", "6", "--prompt-len", "8", "--reps", "1",
                        "--variant", "one:forms=4,group=2,max=2,si=0.005", "--variant", "two:forms=4+8", "--json",
                        str(out), "--profile", str(tmp_path / "prof")]) == 0
    record = json.loads(out.read_text())
    got = record["variants"]
    assert list(got) == ["fixed", "one", "two"] and (autorun.GROUP_ROUNDS, autorun.MAX_GROUP_ROUNDS) == (8, 64)
    assert set(record["profiles"]) == set(got) and all(p["decode_ms"] > 0 for p in record["profiles"].values())
    # the host's own events too: where a call's time goes before and between its device work
    host = record["profiles"]["one"]["host"]["top_events"]
    assert any("Execute" in e["name"] for e in host) and all(e["total_us"] > 0 and e["count"] > 0 for e in host)
    assert got["fixed"]["forms_run"] is None and got["fixed"]["vs_fixed"] == 1.0
    one = got["one"]
    assert set(one["forms_run"]) == {"4"} and (one["group_rounds"], one["max_group_rounds"]) == (2, 2)
    assert (one["switch_interval_s"], got["two"]["switch_interval_s"]) == (0.005, autorun.HANDOFF_S)
    assert set(got["two"]["forms_run"]) <= {"4", "8"} and got["two"]["group_rounds"] == 8
    assert all(len(v["ms_per_round"]) == 1 and v["median_ms"] > 0 for v in got.values())
    assert got["fixed"]["costs_ms"] is None  # each auto pass's costs: both forms timed before the decode, the run
    (costs,) = got["two"]["costs_ms"]  # form's moved by the decode's own timings
    assert set(costs) == {"4@1/greedy", "8@1/greedy"} and all(len(c["warm_ms"]) >= 1 for c in costs.values())
    ran = [k for k, c in costs.items() if c["observed_ms"]]
    assert ran and all(len(costs[k]["estimate_ms"]) == len(costs[k]["observed_ms"]) for k in ran)
    for bad, msg in (("x:forms=4,rounds=2", "is not NAME:forms"), ("x:forms=tree", "unknown form"),
                     ("x:forms=4,group=0", "1 <= group <= max"), ("x:forms=4,group=8,max=4", "1 <= group <= max"),
                     ("x:forms=4,ahead=1", "is not NAME:forms"), ("x:forms=4,si=0", "must be positive")):
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            module.variant(bad)


def test_call_cost_script(tmp_path):
    """benchmarks/call_cost.py on the tiny shape (CPU, in this process): every mode timed at its round counts (those
    above --max-rounds cut to it), each call's Snapshot ready no sooner than the call returned, the worker modes' wall
    time a call recorded, and CPython's switch interval restored afterwards."""
    module = _script("call_cost")
    before, out = sys.getswitchinterval(), tmp_path / "cc.json"
    assert module.main([str(out), "--model", "tiny", "--calls", "3", "--max-rounds", "4"]) == 0
    assert sys.getswitchinterval() == before
    calls = json.loads(out.read_text())["calls"]
    assert set(calls) == set(module.MODES) and list(calls["main"]) == ["0", "1", "2", "4"]
    assert all(list(calls[m]) == ["4"] and calls[m]["4"]["wall_ms_per_call"] > 0 for m in module.MODES[1:])
    assert all(c["ready_ms"] >= c["call_returned_ms"] > 0 for m in calls.values() for c in m.values())


def test_policy_cost_script(tmp_path):
    """benchmarks/policy_cost.py (no device): each slot batch's forms are those auto may take there, its statistics make
    the policy choose a tree (the path a server with a useful drafter takes), and every call is timed."""
    from ddtree_jax import policy

    module = _script("policy_cost")
    assert module.main([str(tmp_path), "--batches", "1,32", "--steps", "3", "--repeats", "1"]) == 0
    got = json.loads((tmp_path / "policy_cost.json").read_text())["results"]
    assert [r["batch"] for r in got] == [1, 32]
    assert got[1]["forms"] == list(policy.allowed(policy.candidates("ddtree", "gpu"), 32, module.BLOCK))
    assert all(r["choice"] not in ("ar", "chain") for r in got)
    assert all(r["ms"][k] > 0 for r in got for k in ("observe", "choose", "summary"))


def test_gather_cost_script(tmp_path):
    """benchmarks/gather_cost.py on the tiny shape (CPU, in this process): both calls timed each pass, the bytes the
    gather moves from the caches' capacity; a slot batch no smaller than the one it is gathered from is refused."""
    module = _script("gather_cost")
    out = tmp_path / "g.json"
    module.main(["--model", "tiny", "--batch", "2", "--of", "4", "--prompt", "16", "--max-len", "64", "--rounds", "2",
                 "--pairs", "2", "--json", str(out)])
    got = json.loads(out.read_text())
    assert set(got["median_ms_a_round"]) == {"in place", "gathered"}
    assert all(len(v) == 2 for v in got["ms_a_round"].values())
    assert got["capacity"] >= 64 and got["gathered_bytes_a_call"] == 4 * 2 * got["cache_bytes_per_sequence"] > 0
    with pytest.raises(SystemExit):
        module.main(["--model", "tiny", "--batch", "4", "--of", "4"])


def test_the_recorded_h200_results_hold_issue_5s_fields_and_grid():
    """benchmarks/results/h200.json as issue 5 asks: every record has its fields (budget null exactly for ar and
    dflash, a roofline for every ar record); the current layout covers both models at prompts 512 and 2k, batches 1
    and 8, with the stage breakdown of ar, dflash and ddtree at every budget from 16 to 512 at each."""
    records = json.loads((Path(__file__).parents[1] / "benchmarks" / "results" / "h200.json").read_text())
    fields = {"model", "method", "budget", "batch", "prompt_len", "ms_per_round", "breakdown_ms", "roofline_ms",
              "date", "command"}
    for r in records:
        assert fields <= set(r) and r["method"] in ("ar", "dflash", "ddtree"), r
        assert (r["budget"] is None) == (r["method"] != "ddtree") and r["ms_per_round"] > 0
        assert "python -m ddtree_jax.bench models" in r["command"] and r["device"] == "NVIDIA H200"
        assert r["method"] != "ar" or r["roofline_ms"] > 0
    for model in ("qwen3-8b", "qwen3-4b"):
        for prompt in (512, 2048):
            for batch in (1, 8):  # the latest record of each, in the current layout (as `bench project` reads them)
                budgets = [16, 32, 64, 128, 256, 512]
                for name, latest in projection.round_costs(records, model, prompt, batch, budgets).items():
                    stages = {"verify", "accept_commit"} | ({"draft", "tree"} if name != "ar" else set())
                    assert stages <= set(latest["breakdown_ms"] or {}), (model, prompt, batch, name)


@pytest.mark.parametrize("argv", [["--help"], ["fixtures", "--help"], ["models", "--help"], ["pair", "--help"],
                                  ["project", "--help"], ["table", "--help"]])
def test_help(argv, capsys):
    assert bench.main(argv) == 0
    assert "usage" in capsys.readouterr().out


def test_ab_options_parse_list_values():
    """``--ab NAME:KEY=VALUE,...``: booleans and integers typed, and a list-valued option keeps its commas."""
    assert bench._ab("x:xla_gpu_enable_pdl=true,xla_gpu_dot_merger_threshold_mb=32,m=CONCURRENT") == (
        "x", {"xla_gpu_enable_pdl": True, "xla_gpu_dot_merger_threshold_mb": 32, "m": "CONCURRENT"})
    assert bench._ab("cb:xla_gpu_enable_command_buffer=FUSION,CUBLAS,WHILE,xla_gpu_enable_pdl=false") == (
        "cb", {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,WHILE", "xla_gpu_enable_pdl": False})


@pytest.mark.parametrize("argv", [["models", "--budgets", "0"], ["models", "--tuning", "verify_align=0"],
                                  ["models", "--tuning", "unroll=2"], ["models", "--ab", "noname"],
                                  ["models", "--ab", "x:FUSION,a=b"], ["models", "--ab", "x:a="],
                                  ["fixtures", "--mesh", "3x3"], ["fixtures", "--mesh", "two"],
                                  ["pair", "--budgets", "0,auto"], ["pair", "--budgets", "x"],
                                  ["pair", "--budgets", ","]])
def test_bad_flag_is_one_line_error(argv, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")


def test_the_round_loop_has_no_host_round_trip(target, drafter):
    """Issue 5's profile must-show, the part a CPU can check: ``hlo_summary`` (the bench's HLO check) finds a host
    callback and a conditional where there is one, and finds no host transfer, callback or conditional in the
    compiled ddtree round loop (on GPU the runtime reads a conditional's predicate on the host: a copy and a wait inside
    every round), for greedy decoding, sampling, and sampling with a top-k / top-p filter."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax.tuning import Tuning

    def with_callback(x):
        return jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct((3,), jnp.float32), x) + 1

    probe = jax.jit(with_callback).lower(jnp.ones(3, jnp.float32)).compile().as_text()
    assert analysis.hlo_summary(probe)["host_callbacks"]
    branch = jax.jit(lambda x: jax.lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x)).lower(jnp.ones(3, jnp.float32))
    assert analysis.hlo_summary(branch.compile().as_text())["conditionals"] == 1
    options = decode.GenerateOptions(method="ddtree", tree_budget=8, max_new_tokens=8)
    # (the CPU attention's key spans are a lax.switch a layer by design, and CPU-only: the program as on a GPU)
    spec = decode.make_spec(target[0], drafter[0], options, Tuning(live_spans=False))
    _, capacity, out_len = decode.layout(spec, [5], 8)
    state = decode.init_state(spec, [5], [options], capacity, out_len, jnp.float32)
    text = decode.run_rounds.lower(spec, target[1], drafter[1], state, jnp.int32(4)).compile().as_text()
    hlo = analysis.hlo_summary(text)
    assert not any(hlo["host_transfer_ops"].values()) and not hlo["host_callbacks"], hlo
    assert hlo["while_loops"] >= 1  # the rounds run as one device loop
    assert not spec.sampling and hlo["conditionals"] == 0, hlo["conditionals"]
    hot = dataclasses.replace(options, temperature=0.8, top_p=0.9)
    state = decode.init_state(dataclasses.replace(spec, sampling=True, filtering=True), [5], [hot], capacity, out_len,
                              jnp.float32)
    for flags in ({"sampling": True, "filtering": False}, {"sampling": True, "filtering": True}):
        program = decode.run_rounds.lower(dataclasses.replace(spec, **flags), target[1], drafter[1], state,
                                          jnp.int32(4)).compile().as_text()
        h = analysis.hlo_summary(program)
        assert h["conditionals"] == 0 and not any(h["host_transfer_ops"].values()) and not h["host_callbacks"], flags
        assert program.count(" xor(") > text.count(" xor("), flags  # it samples (threefry's xors)


def test_busy_time_merges_overlapping_kernels():
    """The profile summaries' busy time: overlapping kernels counted once, the idle gaps between them listed."""
    assert analysis.busy_and_gaps([(0, 10), (5, 12), (12, 14), (20, 25)]) == (19, [6])
    assert analysis.busy_and_gaps([(0, 10), (2, 3)]) == (10, [])


def test_load_bench_interleave_runs_each_level_on_every_server_in_alternating_order(monkeypatch):
    """benchmarks/load_bench.py --interleave: every configuration's server starts at once (each given 1/N of an
    accelerator's memory), then each level runs on every server that came up, the order reversed every other level;
    a server that failed to start runs no level; all are stopped and their logs closed."""
    import threading

    module = _script("load_bench")
    calls = []
    together = threading.Barrier(3, timeout=10)  # broken (an error) unless the three starts overlap

    class Fake:
        def __init__(self, args, config):
            self.config, self.info = config, {"config": config}

        def start(self, deadline, env=None):
            together.wait()
            calls.append(("start", self.config, env["XLA_PYTHON_CLIENT_MEM_FRACTION"]))
            return self.config != "broken"

        def level(self, c, deadline):
            calls.append((c, self.config))

        def stop(self):
            calls.append(("stop", self.config))

        def close(self):
            calls.append(("close", self.config))

    monkeypatch.setattr(module, "Served", Fake)
    args = argparse.Namespace(methods=["ar", "broken", "ddtree"], concurrency=[1, 2, 4])
    infos = module.run_interleaved(args, deadline=0.0)
    assert [i["config"] for i in infos] == ["ar", "broken", "ddtree"] and all("wall_s" in i for i in infos)
    assert sorted(calls[:3]) == [("start", m, "0.300") for m in ("ar", "broken", "ddtree")]
    assert [c for c in calls if isinstance(c[0], int)] == [(1, "ar"), (1, "ddtree"), (2, "ddtree"), (2, "ar"),
                                                          (4, "ar"), (4, "ddtree")]
    assert [c for c in calls if c[0] in ("stop", "close")] == [(w, m) for m in ("ar", "broken", "ddtree")
                                                               for w in ("stop", "close")]


def test_load_bench_summary_keeps_a_repeated_level(tmp_path):
    """--concurrency 8,1,8: summary.md shows both runs of level 8 in run order, each against ar's run of the same
    rank (the summary once keyed rows by concurrency and dropped the first)."""
    lb = _script("load_bench")

    def level(c, tps):
        return {"concurrency": c, "requests": 4, "errors": 0, "requests_per_s": 1.0, "output_tokens_per_s": tps,
                "latency_s": {"p50": 1.0, "p90": 1.0, "p99": 1.0}, "ttft_s": {"p50": 0.1}, "tpot_s": {"p50": 0.03},
                "mean_acceptance_length": None}

    for name, rows in (("ar", [level(1, 40.0), level(8, 100.0), level(8, 200.0)]),
                       ("ddtree", [level(1, 60.0), level(8, 50.0), level(8, 180.0)])):
        (tmp_path / f"{name}.json").write_text(json.dumps(rows))
    text = lb.summarize(str(tmp_path))
    rows = [line.split(" | ")[:7] for line in text.splitlines() if line.startswith("| ddtree |")]
    assert [(r[1], r[5], r[6]) for r in rows] == [("1", "60.0", "1.50"), ("8", "50.0", "0.50"), ("8", "180.0", "0.90")]


def test_load_bench_py_spy_samples_the_server_at_its_level_only(tmp_path, monkeypatch):
    """--py-spy 1,32: at levels 1 and 32 (and no other) py-spy records the server's process, GIL-holding stacks of every
    thread, into CONFIG.cC.speedscope.json; a py-spy that cannot start is a recorded failure, not the run's."""
    lb = _script("load_bench")
    started = []

    class Popen:
        def __init__(self, cmd, **kw):
            started.append(cmd)

    monkeypatch.setattr(lb.subprocess, "Popen", Popen)
    args = argparse.Namespace(out=str(tmp_path), py_spy=[1, 32])
    served = lb.Served.__new__(lb.Served)
    served.args, served.name, served.info = args, "ddtree-16", {"failures": []}
    served.proc = argparse.Namespace(pid=4242)
    served.llog = open(tmp_path / "log", "w")
    assert served._py_spy(16) is None and not started
    assert isinstance(served._py_spy(32), Popen) and isinstance(served._py_spy(1), Popen)
    cmd = started[0]
    assert cmd[:4] == ["py-spy", "record", "--pid", "4242"] and "--gil" in cmd and "--threads" in cmd
    assert "--nonblocking" in cmd  # the server is never paused to be sampled
    assert cmd[cmd.index("--output") + 1] == str(tmp_path / "ddtree-16.c32.speedscope.json")

    def missing(cmd, **kw):
        raise FileNotFoundError("py-spy")

    monkeypatch.setattr(lb.subprocess, "Popen", missing)
    assert served._py_spy(32) is None and served.info["failures"] == ["py-spy: py-spy"]
    served.llog.close()


def test_profile_summary_counts_each_function_once_a_sample():
    """benchmarks/profile_summary.py: per thread, the seconds sampled and each matching function's inclusive time,
    a function on a stack twice (recursion, or two of its lines) counted once; other files' functions left out."""
    ps = _script("profile_summary")
    frames = [{"name": "_run", "file": "/x/ddtree_jax/engine.py", "line": 1},
              {"name": "_finish", "file": "/x/ddtree_jax/engine.py", "line": 2},
              {"name": "_finish", "file": "/x/ddtree_jax/engine.py", "line": 3},
              {"name": "wait", "file": "/usr/lib/threading.py", "line": 4}]
    profile = {"shared": {"frames": frames}, "profiles": [
        {"name": "engine", "samples": [[0, 1, 2], [0, 3], [0]], "weights": [0.5, 0.25, 0.25]}]}
    text = ps.summarize(profile)
    assert "### engine: 1.00 s holding the GIL" in text
    assert "| _run (engine.py) | 1.00 | 100% |" in text and "| _finish (engine.py) | 0.50 | 50% |" in text
    assert "wait" not in text


def test_step_summary_splits_the_steps_by_level_and_program():
    """benchmarks/step_summary.py: the steps inside each level's window only; per program its steps, those beside
    prefills, the median ms a round of all its steps and of the clean ones, and the median launch a step; the device's
    idle time between steps; a step of no round counted apart."""
    ss = _script("step_summary")

    def step(t, elapsed, form="16", batch=4, rounds=4, shared=False, live=4, tokens=40):
        return {"t": t, "elapsed": elapsed, "form": form, "batch": batch, "variant": "greedy", "reason": "policy",
                "rounds": rounds, "live": live, "tokens": tokens, "shared": shared, "quiet": True, "waited": 0.0,
                "launch": elapsed / 4}

    steps = [step(0.0, 0.5), step(10.0, 0.008), step(10.01, 0.012, shared=True), step(10.022, 0.010, form="64"),
             step(10.034, 0.001, rounds=0, live=0, tokens=0), step(20.0, 0.5)]
    text = ss.summarize(steps, [{"concurrency": 4, "started_at": 9.0, "ended_at": 11.0}])
    assert "### concurrency 4" in text and "4 steps (1 of no round), 12 rounds, 120 tokens" in text
    assert "(2%)" in text  # 31 ms of steps in the level's 2 s
    assert "| 16@4 | 2 | 1 | 4.0 | 40.0 | 2.500 | 2.000 | 2.500 |" in text  # all: median of 2 and 3 ms; clean: 2 ms
    assert "| 64@4 | 1 | 0 |" in text
    assert "between steps 2.00 ms median" in text
