"""A server's device steps, level by level: ``serve --step-log`` lines (``load_bench.py --step-logs``) summarised.

Per level (with the level records of CONFIG.json, its window from started_at to ended_at, which holds loadtest's
untimed warm-up request too; else the whole log as one):
its steps and rounds, the share of the level's wall time the steps took, the device's idle time between a step's end
and the next one's dispatch, then per program (form@slot batch): its steps, the steps beside admissions' prefills
(``shared``), the mean live requests and tokens a step, its milliseconds a round, all steps and the clean ones
(no prefill beside, no compilation running): what the policy's cost table should hold, and the median milliseconds
a step's program call took to return (launch: the host's share of a step on a CPU, most of it on a GPU, whose call
returns once its round loop has run; logs without it show -). Prints Markdown.

    python benchmarks/step_summary.py OUT/ddtree.steps.jsonl OUT/ddtree.json
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics


def _ms(xs: list[float]) -> str:
    return f"{1e3 * statistics.median(xs):.3f}" if xs else "-"


def summarize_level(steps: list[dict], wall: float | None) -> list[str]:
    """The Markdown lines of one level's ``steps`` (dicts of the step log, in order); ``wall``: its seconds."""
    ran = [s for s in steps if s["rounds"]]
    busy = sum(s["elapsed"] for s in steps)
    gaps = [b["t"] - (a["t"] + a["elapsed"]) for a, b in zip(steps, steps[1:])]
    lines = [f"{len(steps)} steps ({len(steps) - len(ran)} of no round), {sum(s['rounds'] for s in ran)} rounds, "
             f"{sum(s['tokens'] for s in steps)} tokens; steps {busy:.2f} s"
             + (f" of {wall:.2f} s ({busy / wall:.0%})" if wall else "")
             + (f"; between steps {1e3 * statistics.median(gaps):.2f} ms median, {1e3 * statistics.fmean(gaps):.2f} "
                f"mean" if gaps else ""), "",
             "| program | steps | beside prefills | live | tokens a step | ms a round | clean ms a round | launch ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    by: dict[str, list[dict]] = collections.defaultdict(list)
    for s in ran:
        by[f"{s['form']}@{s['batch']}"].append(s)
    for name, group in sorted(by.items(), key=lambda kv: -len(kv[1])):
        per_round = [s["elapsed"] / s["rounds"] for s in group]
        clean = [s["elapsed"] / s["rounds"] for s in group if not s["shared"] and s["quiet"]]
        lines.append(f"| {name} | {len(group)} | {sum(s['shared'] for s in group)} | "
                     f"{statistics.fmean(s['live'] for s in group):.1f} | "
                     f"{statistics.fmean(s['tokens'] for s in group):.1f} | {_ms(per_round)} | {_ms(clean)} | "
                     f"{_ms([s['launch'] for s in group if 'launch' in s])} |")
    return lines + [""]


def summarize(steps: list[dict], levels: list[dict] | None = None) -> str:
    if not levels:
        return "\n".join(["### all steps", ""] + summarize_level(steps, None))
    out = []
    for level in levels:
        t0, t1 = level["started_at"], level["ended_at"]
        inside = [s for s in steps if t0 <= s["t"] < t1]
        out += [f"### concurrency {level['concurrency']}", ""] + summarize_level(inside, t1 - t0)
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("steps", help="a step log (serve --step-log; load_bench.py --step-logs: OUT/CONFIG.steps.jsonl)")
    p.add_argument("levels", nargs="?", default=None,
                   help="the configuration's level records (OUT/CONFIG.json), to split the steps by level")
    args = p.parse_args(argv)
    with open(args.steps) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    levels = None
    if args.levels:
        with open(args.levels) as f:
            levels = [lv for lv in json.load(f) if "started_at" in lv]
    print(summarize(steps, levels))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
