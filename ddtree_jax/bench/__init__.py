"""``python -m ddtree_jax.bench``: speed of ar / dflash / ddtree, on the fixtures (CPU) or at real shapes (GPU).

Subcommands
  fixtures  the tiny reference pair of tests/fixtures/ddtree_reference (any backend; float32): ar, dflash and
            ddtree at a few budgets on the fixture prompts: per-round time, acceptance length, and whether
            the output equals the reference's. Quick; a smoke test of the whole pipeline.
  models    random-weight models of real shapes (Qwen3-8B, Qwen3-4B, the MoE Qwen3-Coder-30B-A3B, each with its
            DFlash drafter shape), built directly on the device under jit (no weights travel), bf16. For each prompt
            length and batch: AR ms per token with its HBM roofline; dflash and ddtree ms per round at tree budgets,
            each with a breakdown (draft, tree, verify, accept+commit: every stage its own compiled function
            on the same state), the ratio to an AR step and the two-number floor. Extras on the first
            configuration: HLO checks (host transfers, big copies), N rounds in one call vs N calls, a
            profiler trace summary, tree-build micro-benchmarks. Writes JSON records (the format of
            benchmarks/results/*.json) and a details file. ``--quick`` runs a tiny shape (CPU-friendly).
            Weights are laid out as decode.device_layout does on GPU for each method (without ``--layout``:
            stacked layers under lax.scan, q/k/v and gate/up fused, the target's matrices input-major for dflash
            and ddtree and output-major for ar, the drafter's output-major); the round loop and the stages compile
            with decode.XLA_OPTIONS, and the verify rows are padded as decode.default_verify_align says.
            ``--tuning KEY=VALUE,...`` (ddtree_jax.tuning) changes how the rounds run, e.g. a layer kernel
            against XLA's ops (qkv_write=0), the verify's padding or the layer loop's unroll. An MoE target's
            records also hold the distinct experts one more round touches per layer (measured from the router's
            choices, ``ddtree_jax.moe_cost``; random weights route about uniformly), and its rooflines and floors
            count the bytes of those experts only.
  pair      a trained pair (default: the default pair) on the shipped held-out Python prompts, one at a time or
            as one batch: mean acceptance length and decode tokens/s of ar, dflash and ddtree at budgets.
  project   the projected speedup over AR of dflash and ddtree: the DDTree paper's mean acceptance lengths
            (benchmarks/paper_tau.json) x our recorded round costs (benchmarks/results/h200.json), per dataset.
            A projection, not a measurement (ddtree_jax.projection).
  table     README's performance tables (ms per round, the stage breakdown) and the ratios to the official
            PyTorch code, from the recorded results (ddtree_jax.tables).
  kernels   pallas_kernels.bench_kernels, if present, with the remaining arguments.

The KV caches are filled with random values and their lengths set to the prompt length (no prefill is
timed). With random weights the drafter almost never agrees with the target, so rounds accept about one
token; the timings do not depend on that (every shape is static), the acceptance lengths do.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Sequence

from ddtree_jax import cli, projection, tables
from ddtree_jax.bench import models
from ddtree_jax.bench.records import ARGV, command, log, now, print_table, write_json
from ddtree_jax.shapes import SHAPES
from ddtree_jax.tuning import LAYOUTS


# =============================================================================================== fixtures
def _fixtures(args) -> int:
    import jax
    import jax.numpy as jnp

    from ddtree_jax import decode, weights

    root = args.fixtures
    cli.existing_dir("--fixtures", root)
    target = weights.load_target(os.path.join(root, "target"), dtype=jnp.float32)
    draft = weights.load_draft(os.path.join(root, "draft"), dtype=jnp.float32)
    with open(os.path.join(root, "generate.json")) as f:
        runs = json.load(f)["runs"][: args.prompts]
    mesh = None
    if args.mesh:  # the weights placed once (decode.generate would place them again on every call)
        from ddtree_jax import sharding

        mesh = sharding.make_mesh(args.mesh)
        target, draft = sharding.shard_model(target, mesh), sharding.shard_model(draft, mesh)
    configs = []
    for m in args.methods:
        if m == "ddtree":
            configs += [("ddtree", b) for b in args.budgets]
        else:
            configs.append((m, None))
    groups = [[r] for r in runs] + ([runs] if args.batched and len(runs) > 1 else [])
    records = []
    for method, budget in configs:
        for group in groups:
            n = min(r["max_new_tokens"] for r in group) if args.max_new_tokens is None else args.max_new_tokens
            opts = decode.GenerateOptions(method=method, max_new_tokens=n, tree_budget=budget or 1)
            prompts = [r["prompt"] for r in group]
            dr = draft if method != "ar" else None
            t0 = time.perf_counter()
            decode.generate(target, prompts, opts, draft=dr, mesh=mesh, tuning=args.tuning)  # compiles
            compile_s = time.perf_counter() - t0
            per_round, res = [], None
            for _ in range(args.repeats):
                res = decode.generate(target, prompts, opts, draft=dr, mesh=mesh, tuning=args.tuning)
                rounds = max(len(a) for a in res.acceptance_lengths) if method != "ar" else max(res.num_generated)
                per_round.append(1e3 * res.decode_s / max(rounds, 1))
            acc = [a for seq in res.acceptance_lengths for a in seq]
            parity = all(out == r["ar"][: len(out)] and len(out) == len(r["prompt"]) + n
                         for out, r in zip(res.output_ids, group))
            rec = {
                "model": "fixture-tiny", "method": method, "budget": budget, "batch": len(group),
                "prompt_len": max(len(p) for p in prompts), "max_new_tokens": n,
                "ms_per_round": statistics.median(per_round),
                "rounds": rounds, "mean_acceptance_length": (sum(acc) / len(acc)) if acc else None,
                "tokens_per_round": sum(res.num_generated) / len(group) / max(rounds, 1),
                "matches_reference": parity, "attention": res.attention, "compile_s": compile_s,
                "mesh": args.mesh, "device": jax.devices()[0].device_kind, "date": now(), "command": command(),
            }
            records.append(rec)
            log(f"{method:6s} budget={budget} batch={len(group)}: {rec['ms_per_round']:.2f} ms/round, "
                 f"acceptance {rec['mean_acceptance_length']}, parity {parity}")
    print_table(records, ["method", "budget", "batch", "prompt_len", "ms_per_round", "mean_acceptance_length",
                           "tokens_per_round", "matches_reference"])
    if args.json:
        write_json(args.json, records)
    if not all(r["matches_reference"] for r in records):
        cli.warn("some outputs differ from the reference AR output")
        return 1
    return 0


# =============================================================================================== kernels
def _kernels(rest: list[str]) -> int:
    try:
        from pallas_kernels import bench_kernels
    except ImportError as e:
        raise cli.UsageError(f"pallas_kernels.bench_kernels is not available here ({e})") from None
    code = bench_kernels.main(rest)
    return 0 if code is None else int(code)


# =============================================================================================== CLI
def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers")
    return vals


def _budgets(text: str) -> list:
    """'16,64,auto' -> [16, 64, 'auto'] (argparse type)."""
    parts = [x.strip().lower() for x in text.split(",") if x.strip()]
    nums = [x for x in parts if x != "auto"]
    return (_ints(",".join(nums)) if nums else []) + (["auto"] if "auto" in parts else [])


def xla_options(text: str) -> dict | None:
    """``KEY=VALUE,...`` -> {KEY: VALUE} (None if malformed); true/false become bools, integers ints. A piece
    without "=" continues the previous value, for list-valued options (``xla_gpu_enable_command_buffer=FUSION,WHILE``)."""
    pairs: list[list[str]] = []
    for piece in filter(None, text.split(",")):
        if "=" in piece:
            pairs.append(piece.split("=", 1))
        elif pairs:
            pairs[-1][1] += "," + piece
        else:
            return None
    if not pairs or not all(k and v for k, v in pairs):
        return None
    return {k: {"true": True, "false": False}.get(v.lower(), int(v) if v.lstrip("-").isdigit() else v)
            for k, v in pairs}


def _ab(text: str) -> tuple[str, dict]:
    """``NAME:KEY=VALUE,...`` -> (NAME, {KEY: VALUE}) (:func:`xla_options`)."""
    name, colon, opts = text.partition(":")
    options = xla_options(opts)
    if not (name and colon and options):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME:KEY=VALUE,... (e.g. pdl:xla_gpu_enable_pdl=true)")
    return name, options


def _names(text: str) -> list[str]:
    vals = [x.strip() for x in text.split(",") if x.strip()]
    if not vals:
        raise argparse.ArgumentTypeError("empty list")
    return vals


LAYOUT_CHOICES = tuple(x for x in LAYOUTS if x != "auto")  # --layout, --draft-layout


def build_parser() -> cli.ArgumentParser:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    fixtures_default = os.path.join(repo, "tests", "fixtures", "ddtree_reference")
    p = cli.ArgumentParser(prog="python -m ddtree_jax.bench", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True, parser_class=cli.ArgumentParser)

    f = sub.add_parser("fixtures", help="the tiny reference pair (CPU): per-round time, acceptance, parity",
                       description="ar / dflash / ddtree on the fixture pair and prompts; per-round time "
                                   "(decode time / rounds, compile excluded), acceptance length, parity with "
                                   "the reference output.")
    f.add_argument("--fixtures", default=fixtures_default, help="fixture directory (default: %(default)s)")
    f.add_argument("--methods", type=_names, default=["ar", "dflash", "ddtree"],
                   help="comma-separated methods among ar,dflash,ddtree (default: all)")
    f.add_argument("--budgets", type=_ints, default=[1, 4, 16, 64], help="ddtree tree budgets (default: 1,4,16,64)")
    f.add_argument("--prompts", type=int, default=3, help="how many fixture prompts to run (default: 3)")
    f.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens per prompt (default: the fixture's max_new_tokens)")
    f.add_argument("--batched", action="store_true", help="also run all prompts as one batch")
    f.add_argument("--repeats", type=int, default=2, help="timed runs per configuration; median (default: 2)")
    f.add_argument("--mesh", default=None, metavar="DxM",
                   help="run on a data x model mesh of every visible device (ddtree_jax.sharding; e.g. 1x2: each "
                        "layer split over 2 devices, 2x1: the prompts split); default: one device")
    cli.add_tuning(f)
    f.add_argument("--json", default=None, help="write the records (a JSON list) to this file")

    m = sub.add_parser("models", help="random-weight models of real shapes, built on the device",
                       description="Qwen3-8B / Qwen3-4B shapes with their DFlash drafter (5 layers, block 16, "
                                   "taps 1,9,17,25,33), random bf16 weights made on the device. Times AR, "
                                   "dflash and ddtree rounds with per-stage breakdowns; see the module doc.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("--models", type=_names, default=None,
                   help=f"comma-separated among {', '.join(SHAPES)} (default: qwen3-8b,qwen3-4b; tiny with --quick)")
    m.add_argument("--prompts", dest="prompts_set", type=_ints, default=None,
                   help="prompt lengths = cache prefix (default: 512,2048; --quick: 64)")
    m.add_argument("--batches", dest="batches_set", type=_ints, default=None,
                   help="batch sizes (default: 1,8; --quick: 1,2)")
    m.add_argument("--budgets", dest="budgets_set", type=_ints, default=None,
                   help="ddtree tree budgets (default: 16,32,64,128,256,512; --quick: 4,16)")
    m.add_argument("--key-budgets", dest="key_budgets_set", type=_ints, default=None,
                   help="budgets run first for every prompt/batch (the rest come after) (default: 64,256; "
                        "--quick: 16)")
    m.add_argument("--methods", type=_names, default=["ar", "dflash", "ddtree"],
                   help="methods; ar always runs (the ratios need it); ddtree runs --budgets (default: ar,dflash,ddtree)")
    m.add_argument("--rounds", type=int, default=10, help="rounds per timed run_rounds call (default: 10)")
    m.add_argument("--repeats", type=int, default=3, help="timed repeats; the median is kept (default: 3)")
    m.add_argument("--stage-iters", type=int, default=10,
                   help="chained calls per timed repeat of a stage (the tree: 4x) (default: 10)")
    m.add_argument("--no-breakdown", dest="breakdown", action="store_false", help="skip the stage breakdown")
    m.add_argument("--breakdown-first-only", action="store_true",
                   help="break down only the first prompt/batch configuration (saves compiles)")
    m.add_argument("--layout", choices=LAYOUT_CHOICES,
                   default=None,
                   help="the target's layer weights for every method: separate per-layer arrays (an unrolled layer "
                        "loop) or stacked [L, ...] arrays under lax.scan; -out-major: the matrices stored [out, in], "
                        "so a one-row step is a row reduction (else [in, out], which cuBLAS reads faster at 2 rows "
                        "and more); -fused: also q/k/v and gate/up as one matrix each (default: --tuning's layout "
                        "if set, else as decode.device_layout lays it out on GPU for each method, decode.GPU_LAYOUT "
                        "stacked-fused for dflash and ddtree, decode.GPU_AR_LAYOUT stacked-out-major-fused for ar)")
    m.add_argument("--draft-layout", choices=LAYOUT_CHOICES,
                   default=None,
                   help="the drafter's layer weights, in the same forms as --layout (its fc stays input-major; a "
                        "fused drafter keeps its k and v matrices for the context projection) (default: "
                        "--tuning's layout if set, else decode.DRAFT_GPU_LAYOUT, stacked-out-major-fused)")
    cli.add_tuning(m)  # its layout: the default of --layout and --draft-layout
    m.add_argument("--breakdown-all", action="store_true",
                   help="break down every ddtree budget (default: only the --key-budgets)")
    m.add_argument("--ab", action="append", type=_ab, default=[], metavar="NAME:KEY=VAL,...",
                   help="on the first configuration, also compile run_rounds with decode.XLA_OPTIONS updated by "
                        "these XLA options and time it (repeatable), e.g. merge:xla_gpu_dot_merger_threshold_mb=32; "
                        "a list value continues after commas (cb:xla_gpu_enable_command_buffer=FUSION,WHILE)")
    m.add_argument("--no-hlo", dest="hlo", action="store_false", help="skip the HLO checks")
    m.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiler trace")
    m.add_argument("--profile-rounds", type=int, default=5, help="rounds inside the profiler trace (default: 5)")
    m.add_argument("--no-tree-micro", dest="tree_micro", action="store_false",
                   help="skip the tree-build micro-benchmarks")
    m.add_argument("--tree-budgets", type=_ints, default=[64, 256, 512],
                   help="budgets of the tree micro-benchmarks (default: 64,256,512)")
    m.add_argument("--tree-iters", type=int, default=16, help="trees per micro-benchmark loop (default: 16)")
    m.add_argument("--attention", choices=cli.ATTENTIONS, default="auto", help=cli.ATTENTION_HELP)
    m.add_argument("--dtype", choices=cli.DTYPES, default="bfloat16", help="weights and caches")
    m.add_argument("--mesh", default=None, metavar="DxM",
                   help="run_rounds on a data x model mesh (ddtree_jax.sharding); --mesh 1x1 against the default "
                        "measures the sharded path's overhead on one device (the stage breakdown stays unsharded)")
    m.add_argument("--quick", action="store_true", help="a tiny model and few sizes (a CPU rehearsal)")
    m.add_argument("--time-budget-s", type=float, default=480.0,
                   help="start no new item after this many seconds (default: 480)")
    m.add_argument("--out", default="bench_out", help="output directory (default: %(default)s)")
    m.add_argument("--results-name", default="results.json", help="records file name in --out")
    m.add_argument("--compile-cache", default=None, help="a persistent JAX compilation cache directory")

    q = sub.add_parser("pair", help="a trained pair (default: the default pair) on held-out prompts: mean "
                                    "acceptance length and decode speed of ar, dflash and ddtree budgets")
    q.add_argument("--target", default="default", metavar="PATH",
                   help="target directory (default: the default pair's SmolLM2-135M-Instruct)")
    q.add_argument("--draft", default=None, metavar="PATH", help="drafter directory (default: the shipped one)")
    q.add_argument("--budgets", type=_budgets, default=[16, 32, 64, 128, 256, "auto"],
                   help="ddtree tree budgets, auto among them for --tree-budget auto (each prompt's rounds take the "
                        "form with the most expected tokens per second; the record lists the forms that ran) "
                        "(default: 16,32,64,128,256,auto)")
    q.add_argument("--forms", type=cli.form_list, default=None, metavar="LIST", help=cli.FORMS_HELP)
    q.add_argument("--prompts", type=cli.positive_int, default=4,
                   help="held-out prompts (the shipped held-out Python questions, ddtree_jax/data/prompts) "
                        "(default: 4)")
    q.add_argument("--max-new-tokens", type=cli.positive_int, default=64, help="tokens per prompt (default: 64)")
    q.add_argument("--batched", action="store_true",
                   help="all prompts as one batch (default: one prompt at a time, batch 1)")
    q.add_argument("--dtype", choices=cli.DTYPES, default="bfloat16", help="(default: bfloat16)")
    q.add_argument("--attention", choices=cli.ATTENTIONS, default="auto", help=cli.ATTENTION_HELP)
    q.add_argument("--check", action="store_true",
                   help="also compare every method's tokens with ar's and replay each round's tree walk on the host "
                        "from a traced run (columns same-as-ar, first divergence, walk mismatches)")
    q.add_argument("--json", default=None, help="write the results (a JSON object) to this file")

    j = sub.add_parser("project", help="projected speedup over AR: the paper's acceptance lengths x our round costs",
                       description="Projected speedup over AR of dflash and ddtree per dataset: the DDTree paper's "
                                   "mean acceptance length tau x (AR ms per token / round ms), the round costs from "
                                   "recorded `models` runs (the latest record of the current GPU layout). A "
                                   "projection, not a measurement; see ddtree_jax/projection.py.")
    j.add_argument("--results", default=str(projection.RESULTS),
                   help="records of `bench models` (a JSON list) (default: %(default)s)")
    j.add_argument("--tau", default=str(projection.PAPER_TAU),
                   help="the paper's acceptance lengths and speedups (default: %(default)s)")
    j.add_argument("--models", type=_names, default=["qwen3-8b", "qwen3-4b"],
                   help="comma-separated models of both files (default: qwen3-8b,qwen3-4b)")
    j.add_argument("--temperature", default="0.0", help="the paper's temperature, 0.0 or 1.0 (default: 0.0)")
    j.add_argument("--prompt", type=cli.positive_int, default=512, help="the records' prompt length (default: 512)")
    j.add_argument("--batch", type=cli.positive_int, default=1, help="the records' batch (default: 1)")
    j.add_argument("--budgets", type=_ints, default=[64, 256], help="ddtree budgets to project (default: 64,256)")
    j.add_argument("--json", default=None, help="write the rows (a JSON list, one object per model) to this file")

    t = sub.add_parser("table", help="README's performance tables from the recorded results",
                       description="ms per round and the stage breakdown per model, prompt, batch and method, as "
                                   "markdown, from the latest record of each configuration in the current GPU layout "
                                   "(ddtree_jax/tables.py); README's tables are this output.")
    t.add_argument("--results", default=str(projection.RESULTS),
                   help="records of `bench models` (a JSON list) (default: %(default)s)")
    t.add_argument("--models", type=_names, default=["qwen3-8b", "qwen3-4b"],
                   help="comma-separated models (default: qwen3-8b,qwen3-4b)")
    t.add_argument("--prompts", type=_ints, default=[512, 2048], help="prompt lengths (default: 512,2048)")
    t.add_argument("--batches", type=_ints, default=[1, 8], help="batch sizes (default: 1,8)")
    t.add_argument("--budgets", type=_ints, default=[16, 32, 64, 128, 256, 512],
                   help="ddtree budgets (default: 16,32,64,128,256,512)")

    sub.add_parser("kernels", help="pallas_kernels.bench_kernels with the remaining arguments", add_help=False)
    return p


# =============================================================================================== pair
def _pair(args) -> int:
    """training.evaluate.benchmark on held-out prompts, one at a time (batch 1) or as one batch; per method the mean
    acceptance length over all rounds and the mean decode tokens/s, compilation excluded."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax import decode, defaults, weights
    from ddtree_jax.tokenizer import load_tokenizer
    from ddtree_jax.training import evaluate, prompts as curated

    target_path = defaults.target_path() if args.target == "default" else cli.existing_dir("--target", args.target)
    draft_path = cli.existing_dir("--draft", args.draft or defaults.draft_path())
    dtype = jnp.dtype(args.dtype)
    # laid out once for the backend here, for the rounds (device_layout is idempotent: each dflash / ddtree call below
    # then has nothing to do; on GPU each ar call turns the target output-major again, before its timed decode), not
    # once per prompt
    target, draft = ((cfg, decode.device_layout(p)) for cfg, p in (weights.load_target(target_path, dtype),
                                                                  weights.load_draft(draft_path, dtype)))
    tok = load_tokenizer(target_path)
    if tok is None:
        raise cli.UsageError(f"{target_path} has no tokenizer: the held-out prompts are text")
    held_out = [curated.chat_ids(tok, m) for m in curated.held_out_set("python")]
    prompts = held_out[: args.prompts]
    stop = tuple(dict.fromkeys(tok.eos_token_ids + target[0].eos_token_ids))
    groups = [prompts] if args.batched else [[p] for p in prompts]
    fixed = [b for b in args.budgets if b != decode.AUTO]
    runs = [evaluate.benchmark(target, draft, g, budgets=fixed, max_new_tokens=args.max_new_tokens,
                               stop_ids=stop, attention=args.attention, check=args.check, log=lambda m: None)
            for g in groups]
    if decode.AUTO in args.budgets:
        for run, g in zip(runs, groups):
            run["ddtree-auto"] = _auto_run(target, draft, g, args, stop, run["ar"]["tokens_per_s"])
    table = {}
    for name in runs[0]:
        acc = [r[name]["mean_acceptance_length"] for r in runs if r[name]["mean_acceptance_length"] is not None]
        tps = [r[name]["tokens_per_s"] for r in runs if r[name]["tokens_per_s"]]
        mins = [r[name]["min_acceptance_length"] for r in runs if r[name]["min_acceptance_length"] is not None]
        table[name] = {"mean_acceptance_length": statistics.fmean(acc) if acc else None,
                       "min_acceptance_length": min(mins) if mins else None,  # >= 1: generate checks it
                       "tokens_per_s": statistics.fmean(tps) if tps else None,
                       "attention": sorted({r[name]["attention"] for r in runs})}
        if name == "ddtree-auto":  # the forms its rounds took, over every prompt
            table[name]["forms"] = dict(sum((collections.Counter(r[name]["forms"]) for r in runs),
                                            collections.Counter()).most_common())
        if args.check and name != "ar":
            firsts = [r[name]["first_divergence"] for r in runs if r[name]["first_divergence"] is not None]
            table[name].update({k: sum(r[name][k] for r in runs) for k in ("same_as_ar", "walk_mismatches",
                                                                             "traced_rounds")})
            table[name]["first_divergence"] = min(firsts, default=None)
            table[name]["traced_same_as_untraced"] = all(r[name]["traced_same_as_untraced"] for r in runs)
    for name, row in table.items():
        ar = table["ar"]["tokens_per_s"]
        row["speedup"] = row["tokens_per_s"] / ar if ar and row["tokens_per_s"] else None
    out = {"date": now(), "command": command(), "device": jax.devices()[0].device_kind,
           "backend": jax.default_backend(), "target": target_path, "draft": draft_path, "dtype": args.dtype,
           "prompts": len(prompts), "batch": len(prompts) if args.batched else 1,
           "max_new_tokens": args.max_new_tokens, "attention": args.attention, "methods": table}
    extra = f" {'min':>4} {'same-as-ar':>10} {'diverges at':>11} {'walk mismatches':>15}" if args.check else ""
    print(f"{'method':<12} {'acceptance':>10} {'tok/s':>8} {'vs ar':>6}{extra}")
    for name, row in table.items():
        acc = "-" if row["mean_acceptance_length"] is None or name == "ar" else f"{row['mean_acceptance_length']:.2f}"
        line = f"{name:<12} {acc:>10} {row['tokens_per_s']:>8.1f} {row['speedup']:>5.2f}x"
        if args.check and name != "ar":
            div = "-" if row["first_divergence"] is None else str(row["first_divergence"])
            line += (f" {row['min_acceptance_length']:>4} {row['same_as_ar']:>4}/{len(prompts):<5} {div:>11} "
                     f"{row['walk_mismatches']:>6}/{row['traced_rounds']:<8}")
        print(line)
    if "ddtree-auto" in table:
        print("ddtree-auto's rounds: " + ", ".join(f"{f} x{n}" for f, n in table["ddtree-auto"]["forms"].items()))
    if args.json:
        write_json(args.json, out)
    return 0


def _auto_run(target, draft, prompts, args, stop, ar_tokens_per_s) -> dict:
    """``bench pair``'s ddtree under --tree-budget auto (the cost table of the cache directory, kept there): what
    training.evaluate.benchmark records of a fixed budget, and the forms the rounds took ({form: rounds})."""
    from ddtree_jax import accept, decode

    opts = decode.GenerateOptions(method="ddtree", tree_budget=decode.AUTO, max_new_tokens=args.max_new_tokens,
                                  stop_token_ids=stop, attention=args.attention, forms=args.forms or ())
    res = decode.generate(target, prompts, opts, draft=draft, persist_costs=True)
    acc = [a for seq in res.acceptance_lengths for a in seq]
    tps = sum(res.num_generated) / res.decode_s if res.decode_s > 0 else None
    row = {"mean_acceptance_length": statistics.fmean(acc) if acc else None,
           "min_acceptance_length": min(acc) if acc else None, "rounds": len(acc), "tokens_per_s": tps,
           "attention": res.attention,
           "forms": dict(collections.Counter(f for seq in res.round_forms for f in seq).most_common())}
    if tps and ar_tokens_per_s:
        row["speedup"] = tps / ar_tokens_per_s
    if args.check:  # as training.evaluate.benchmark's check: AR's tokens, and every traced round's walk replayed
        ar_ids = decode.generate(target, prompts, dataclasses.replace(opts, method="ar")).output_ids
        firsts = [next((i - len(p) for i, (x, y) in enumerate(zip(mine, theirs)) if i >= len(p) and x != y),
                       None if len(mine) == len(theirs) else min(len(mine), len(theirs)) - len(p))
                  for p, mine, theirs in zip(prompts, res.output_ids, ar_ids)]
        traced = decode.generate(target, prompts, dataclasses.replace(opts, trace=True), draft=draft,
                                 persist_costs=True)
        rounds = [r for seq in traced.rounds for r in seq]
        row.update(same_as_ar=sum(f is None for f in firsts), traced_rounds=len(rounds),
                   first_divergence=min((f for f in firsts if f is not None), default=None),
                   walk_mismatches=sum(accept.walk_host(r["tree"]["node_token_ids"], r["tree"]["parents"],
                                                        r["target_choices"]) != r["accepted_indices"] for r in rounds),
                   traced_same_as_untraced=traced.output_ids == res.output_ids)
    return row


def _load_records(path: str) -> list[dict]:
    records = projection.load_json(path, "the results file")
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise cli.UsageError(f"{path} is not a JSON list of records (the output of `bench models`)")
    return records


def _project(args) -> int:
    """Print the projection tables (markdown) of ddtree_jax.projection for each model; --json writes the rows."""
    temps = projection.load_tau(args.tau)
    if args.temperature not in temps:
        raise cli.UsageError(f"--temperature {args.temperature} is not in {args.tau} (has {', '.join(temps)})")
    records = _load_records(args.results)
    out = []
    for model in args.models:
        if model not in temps[args.temperature]:
            raise cli.UsageError(f"{args.tau} has no {model} (has {', '.join(temps[args.temperature])})")
        costs = projection.round_costs(records, model, args.prompt, args.batch, args.budgets)
        rows = projection.project(temps[args.temperature][model], costs, args.budgets)
        print(projection.markdown(model, costs, rows, args.budgets) + "\n")
        out.append({"model": model, "temperature": args.temperature, "prompt_len": args.prompt, "batch": args.batch,
                    "round_ms": {k: r["ms_per_round"] for k, r in costs.items()},
                    "round_dates": {k: r["date"] for k, r in costs.items()}, "rows": rows})
    print(f"A projection, not a measurement: tau (the paper's, temperature {args.temperature}) x AR ms / round ms "
          f"from {args.results}; the paper's ddtree tau is at its best budget per dataset.")
    if args.json:
        write_json(args.json, out)
    return 0


def _table(args) -> int:
    """Print the grid table of each model, the breakdown table and the peer ratios (ddtree_jax.tables)."""
    records = _load_records(args.results)
    for model in args.models:
        print(tables.grid(records, model, args.prompts, args.batches, args.budgets) + "\n")
    print(tables.breakdown(records, args.models, args.prompts, args.batches, args.budgets))
    print("\nAgainst the official PyTorch code (qwen3-8b, prompt 512, batch 1): " + tables.peer(records))
    return 0


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ARGV[:] = argv
    if argv and argv[0] == "kernels":
        return _kernels(argv[1:])
    args = build_parser().parse_args(argv)
    if args.mode == "fixtures":
        return _fixtures(args)
    if args.mode == "pair":
        return _pair(args)
    if args.mode == "table":
        return _table(args)
    if args.mode == "project":
        return _project(args)
    return models.run(args)


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(_main, argv)
