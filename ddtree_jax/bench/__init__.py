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
            Weights are laid out as weight_layout.device_layout does on GPU for each method (without ``--layout``:
            stacked layers under lax.scan, q/k/v and gate/up fused, the target's matrices input-major for dflash
            and ddtree and output-major for ar, the drafter's output-major); the round loop and the stages compile
            with decode.XLA_OPTIONS, and the verify rows are padded as spec.default_verify_align says.
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
import os
import sys
from typing import Sequence

from ddtree_jax import cli, projection
from ddtree_jax.bench import fixtures, models, pair, recorded, records
from ddtree_jax.shapes import SHAPES
from ddtree_jax.tuning import LAYOUTS

# The command line and its dispatch. Each subcommand runs in its own module (fixtures, models, pair; project and table
# in recorded); what they share: timing (caches, stages, timers), analysis (HLO, traces), roofline (ceilings, floors),
# tree_micro (tree-build micro-benchmarks), records (logs, JSON, tables).


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
    if not parts or not all(x.isdigit() and int(x) >= 1 for x in nums):
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of budgets (integers >= 1, or auto)")
    return [int(x) for x in nums] + (["auto"] if "auto" in parts else [])


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
                        "if set, else as weight_layout.device_layout lays it out on GPU for each method, "
                        "weight_layout.GPU_LAYOUT stacked-fused for dflash and ddtree, weight_layout.GPU_AR_LAYOUT "
                        "stacked-out-major-fused for ar)")
    m.add_argument("--draft-layout", choices=LAYOUT_CHOICES,
                   default=None,
                   help="the drafter's layer weights, in the same forms as --layout (its fc stays input-major; a "
                        "fused drafter keeps its k and v matrices for the context projection) (default: "
                        "--tuning's layout if set, else weight_layout.DRAFT_GPU_LAYOUT, stacked-out-major-fused)")
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
                        "form with the most expected tokens per second; the record lists the forms that ran, "
                        "each form's cost, as timed before each decode and as the decode left it, and each "
                        "decode's device calls) "
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
    cli.add_tuning(q)
    q.add_argument("--check", action="store_true",
                   help="also compare every method's tokens with ar's and replay each round's tree walk on the host "
                        "from a traced run (columns same-as-ar, first divergence, walk mismatches)")
    q.add_argument("--json", default=None,
                   help="write the results (a JSON object) to this file, again after every prompt (prompts_done: "
                        "how many it covers), so that a run cut short keeps what it measured")

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


def _kernels(rest: list[str]) -> int:
    try:
        from pallas_kernels import bench_kernels
    except ImportError as e:
        raise cli.UsageError(f"pallas_kernels.bench_kernels is not available here ({e})") from None
    code = bench_kernels.main(rest)
    return 0 if code is None else int(code)


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    records.ARGV[:] = argv
    if argv and argv[0] == "kernels":
        return _kernels(argv[1:])
    args = build_parser().parse_args(argv)
    if args.mode == "fixtures":
        return fixtures.run(args)
    if args.mode == "pair":
        return pair.run(args)
    if args.mode == "table":
        return recorded.table(args)
    if args.mode == "project":
        return recorded.project(args)
    return models.run(args)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ddtree_jax.bench ARGV``: the exit status (2 and a one-line error for bad input)."""
    return cli.run(_main, argv)
