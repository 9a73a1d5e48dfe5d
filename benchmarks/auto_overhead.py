"""What ``--tree-budget auto`` adds to a decode, whole: ``decode.generate`` with a fixed budget against auto runs of
given forms and group sizes, on random weights of one shape, timed interleaved in one process.

A round of a random drafter almost always accepts one token, so the runs have about ``--tokens`` rounds each and
their decode time per round (decode time over the rounds run) compares directly: the fixed budget's one device call of
every round against auto's groups (the host's reading and choosing between them, each form's program taking the decode
state) and auto's rounds (the tree built at the largest tree form for the predictions, their bookkeeping). A variant
is NAME:forms=F+F+...[,group=N][,max=M][,si=S] (auto among those forms, groups of N rounds, ``autorun.GROUP_ROUNDS``,
default 8, doubling while speculative forms follow one another up to M, ``autorun.MAX_GROUP_ROUNDS``, default 64; the
first group stays ``autorun.FIRST_GROUP``; CPython's switch interval S seconds while the groups run,
``autorun.HANDOFF_S``, default 1e-4). Reports each variant's median ms a round and its ratio to the fixed budget's;
the record keeps, per auto variant and timed pass, each form's cost as timed before the decode and as the decode's own
timings moved it (``costs_ms``): whether auto chose by the costs its decode then paid.

    PYTHONPATH=. python benchmarks/auto_overhead.py --model smollm2-135m --budget 32 --variant one:forms=32 \\
        --variant one-g8:forms=32,max=8 --variant two:forms=32+256 --json OUT/auto_overhead.json
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import shlex
import statistics
import sys
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ddtree_jax import autorun, cli, costs, decode, policy  # noqa: E402
from ddtree_jax.bench import analysis, records  # noqa: E402
from ddtree_jax.shapes import SHAPES, build_params, model_configs  # noqa: E402
from ddtree_jax.spec import AUTO, GenerateOptions  # noqa: E402


def variant(text: str) -> tuple[str, tuple[str, ...], int, int, float]:
    """NAME:forms=F+F...[,group=N][,max=M][,si=S] -> (NAME, forms, group rounds, largest group, switch interval)."""
    name, colon, rest = text.partition(":")
    fields = dict(x.split("=", 1) for x in rest.split(",") if "=" in x)
    if not (name and colon and "forms" in fields) or set(fields) - {"forms", "group", "max", "si"}:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME:forms=F+F...[,group=N][,max=M][,si=S]")
    try:
        forms = policy.parse_forms(fields["forms"].split("+"))
        group = int(fields.get("group", autorun.GROUP_ROUNDS))
        largest = int(fields.get("max", max(group, autorun.MAX_GROUP_ROUNDS)))
        if not 1 <= group <= largest:
            raise ValueError(f"group={group}, max={largest}: 1 <= group <= max")
        si = float(fields.get("si", autorun.HANDOFF_S))
        if not si > 0:
            raise ValueError(f"si={si}: the switch interval must be positive")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name, forms, group, largest, si


class RecordingTable(costs.CostTable):
    """An in-memory cost table that keeps, per program key, the seconds a round its forms were timed at before the
    decode (``measured``: autorun.AutoRun._warm) and the estimate after each of the decode's own timings
    (``observe``), with the context it was observed at (tokens before the group: on random weights a round commits
    one, so the next observation's context, of any form, gives the group's rounds): whether auto chose by costs the
    decode then paid."""

    def __init__(self, sig: str):
        super().__init__(sig, None)
        self.log: dict[str, dict[str, list[float]]] = collections.defaultdict(
            lambda: {"warm_ms": [], "observed_ms": [], "estimate_ms": [], "context": []})

    def measured(self, key: str, seconds: float, context: int) -> None:
        super().measured(key, seconds, context)
        self.log[key]["warm_ms"].append(1e3 * seconds)

    def observe(self, key: str, seconds: float, context: int) -> None:
        super().observe(key, seconds, context)
        self.log[key]["observed_ms"].append(1e3 * seconds)
        self.log[key]["estimate_ms"].append(1e3 * self.get(key))
        self.log[key]["context"].append(context)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES), help="random weights of this shape")
    p.add_argument("--budget", type=cli.positive_int, default=32, help="the fixed budget compared against (ddtree)")
    p.add_argument("--tokens", type=cli.positive_int, default=256, help="tokens a decode (about as many rounds)")
    p.add_argument("--prompt-len", type=cli.positive_int, default=128, help="prompt tokens")
    p.add_argument("--reps", type=cli.positive_int, default=3,
                   help="timed passes over the variants (after one untimed)")
    p.add_argument("--variant", type=variant, action="append", required=True,
                   help="NAME:forms=F+F...[,group=N][,max=M][,si=S]")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--profile", help="a directory: also trace one decode of each variant (jax.profiler) and record "
                                     "its programs' executions in time order and the device's idle gaps")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    tcfg, dcfg = model_configs(SHAPES[args.model])
    tp, dp = build_params(tcfg, dcfg, jnp.bfloat16)
    target, draft = (tcfg, tp), (dcfg, dp)
    prompts = [[1 + i % (tcfg.vocab_size - 1) for i in range(args.prompt_len)]]
    runs = {"fixed": (GenerateOptions(method="ddtree", tree_budget=args.budget, max_new_tokens=args.tokens),
                      autorun.GROUP_ROUNDS, autorun.MAX_GROUP_ROUNDS, autorun.HANDOFF_S)}
    for name, forms, group, largest, si in args.variant:
        runs[name] = (GenerateOptions(method="ddtree", tree_budget=AUTO, forms=forms, max_new_tokens=args.tokens),
                      group, largest, si)
    ms: dict[str, list[float]] = {k: [] for k in runs}
    forms_run: dict[str, dict] = {}
    cost_logs: dict[str, list[dict]] = {k: [] for k in runs}  # per timed pass: program key -> RecordingTable.log

    def run(name: str):
        """One decode of a variant: (GenerateResult, its RecordingTable or None)."""
        options, group, largest, si = runs[name]
        tables: list[RecordingTable] = []

        def table_for(spec, dtype, persist=True, _real=autorun.cost_table_for):
            tables.append(RecordingTable(_real(spec, dtype, persist=False).signature))
            return tables[-1]

        with mock.patch.object(autorun, "GROUP_ROUNDS", group), \
                mock.patch.object(autorun, "MAX_GROUP_ROUNDS", largest), \
                mock.patch.object(autorun, "HANDOFF_S", si), \
                mock.patch.object(autorun, "cost_table_for", table_for):
            return decode.generate(target, prompts, options, draft=draft), (tables[-1] if tables else None)

    for rep in range(args.reps + 1):  # the first pass compiles and loads every program
        for name in (list(runs) if rep % 2 == 0 else list(runs)[::-1]):
            res, table = run(name)
            rounds = len(res.acceptance_lengths[0])
            if rep:
                ms[name].append(1e3 * res.decode_s / rounds)
                if table is not None:
                    cost_logs[name].append(dict(table.log))
            if res.round_forms:
                forms_run[name] = dict(collections.Counter(res.round_forms[0]))
    base = statistics.median(ms["fixed"])
    command = " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    out = {"model": args.model, "budget": args.budget, "tokens": args.tokens, "prompt_len": args.prompt_len,
           "reps": args.reps, "device": jax.devices()[0].device_kind, "date": records.now(),
           "command": f"PYTHONPATH=. python benchmarks/auto_overhead.py {command}", "variants": {}}
    for name, (options, group, largest, si) in runs.items():
        med = statistics.median(ms[name])
        out["variants"][name] = {"forms": list(options.forms) or [str(args.budget)], "group_rounds": group,
                                 "max_group_rounds": largest, "switch_interval_s": si, "ms_per_round": ms[name],
                                 "median_ms": med, "vs_fixed": med / base, "forms_run": forms_run.get(name),
                                 "costs_ms": cost_logs[name] or None}
        print(f"{name:>12}: {med:.3f} ms a round ({med / base:.3f}x fixed {args.budget}), runs "
              f"{[round(x, 3) for x in ms[name]]}", flush=True)
    if args.profile:  # one more decode of each variant, traced: its programs' executions in time order, the gaps
        out["profiles"] = {}
        for name in runs:
            d = os.path.join(args.profile, name)
            with jax.profiler.trace(d):
                res, _ = run(name)
            path = sorted(glob.glob(f"{d}/**/*.xplane.pb", recursive=True))[-1]
            out["profiles"][name] = {"decode_ms": 1e3 * res.decode_s, "xplane": os.path.relpath(path, args.profile),
                                     **analysis.profile_summary(path, top=12, modules_kept=400)}
    if args.json:
        records.write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
