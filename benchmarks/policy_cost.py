"""What ``--tree-budget auto``'s choice costs the serving engine's host a step: ``policy.Policy`` alone, no device.

Each step the engine thread hands the policy the step's statistics (``Policy.observe``, once a live slot), then
chooses the next step's form among the programs ready at the slot batch (``Policy.choose``); every SUMMARY_S it also
sets the policy's gauges (``Policy.summary``). The engine thread's time is the server's at high concurrency (on an H100
it worked 59-65% of each level at 32 requests: docs/SERVING.md), and it shares the process's GIL with the thread that
launches the steps. This times the three calls at slot batches --batches, with the forms ``policy.allowed`` there
among the GPU candidates and statistics of a tree of 16 that accepts about 3 tokens a round (the choice is then a
tree: the speculative path): the median of --repeats passes of --steps steps each. Writes OUT/policy_cost.json.

    PYTHONPATH=. python benchmarks/policy_cost.py OUT
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ddtree_jax import cli, policy  # noqa: E402
from ddtree_jax.bench import records  # noqa: E402

BLOCK = 16  # the drafter's block (the chain's nodes + 1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output directory (created)")
    p.add_argument("--batches", type=cli.int_list, default=[1, 8, 32],
                   help="slot batches, comma-separated (default: 1,8,32)")
    p.add_argument("--steps", type=cli.positive_int, default=200, help="steps a pass (default: %(default)s)")
    p.add_argument("--repeats", type=cli.positive_int, default=5,
                   help="passes; the median is kept (default: %(default)s)")
    args = p.parse_args(argv)
    if min(args.batches) < 1:
        p.error(f"--batches: slot batches are at least 1, got {min(args.batches)}")
    return args


def group_stats(trees: tuple[int, ...], rounds: int, rng: np.random.Generator, batch: int) -> np.ndarray:
    """[batch, width] statistics of ``rounds`` rounds of a tree of 16 (the columns' predictions up to 32, what the
    trees up to 16 would have accepted), acceptance about 3 a round, varying by slot."""
    out = np.zeros((batch, policy.width(trees)), np.float32)
    accepted = rounds * rng.uniform(2.0, 4.0, batch)
    out[:, policy.ROUNDS], out[:, policy.ACCEPTED] = rounds, accepted
    out[:, policy.USED], out[:, policy.CHAIN_PRED] = rounds * 3.4, rounds * 2.2
    for i, b in enumerate(trees):
        if b <= 32:
            out[:, policy.STATS + i] = rounds * (3.0 + 0.02 * b)
        if b <= 16:
            out[:, policy.seen_column(trees, i)] = accepted * (0.9 + 0.1 * b / 16)
    return out


def time_batch(batch: int, steps: int, repeats: int) -> dict:
    """Median milliseconds a step of observe, choose and summary at slot batch ``batch``."""
    forms = policy.allowed(policy.candidates("ddtree", "gpu"), batch, BLOCK)
    trees = policy.trees(forms)
    costs = {(f, batch): 1e-3 * (1 + 0.1 * i) for i, f in enumerate(forms)}
    rng = np.random.default_rng(0)
    rows = [group_stats(trees, 4, rng, batch) for _ in range(steps)]
    seqs = list(range(batch))
    times = {"observe": [], "choose": [], "summary": []}
    choice = None
    for _ in range(repeats):
        p = policy.Policy(forms, trees)
        for s in seqs:
            p.start(s)
        t = {k: 0.0 for k in times}
        for sums in rows:
            t0 = time.perf_counter()
            for s in seqs:  # as the engine does: one call a live slot
                p.observe(s, "16", sums[s])
            t1 = time.perf_counter()
            choice = p.choose(seqs, costs)[0]
            t2 = time.perf_counter()
            p.summary(seqs, "16")
            t["observe"] += t1 - t0
            t["choose"] += t2 - t1
            t["summary"] += time.perf_counter() - t2
        for k in times:
            times[k].append(1e3 * t[k] / steps)
    out = {k: round(statistics.median(v), 4) for k, v in times.items()}
    out["step_ms"] = round(out["observe"] + out["choose"], 4)  # summary: at most every SUMMARY_S
    return {"batch": batch, "forms": list(forms), "choice": choice, "ms": out}


def main(argv=None) -> int:
    args = parse_args(argv)
    results = [time_batch(b, args.steps, args.repeats) for b in args.batches]
    for r in results:
        ms = r["ms"]
        print(f"slot batch {r['batch']:>3} ({len(r['forms'])} forms, chose {r['choice']}): observe "
              f"{ms['observe']:.3f} ms, choose {ms['choose']:.3f} ms, summary {ms['summary']:.3f} ms a step")
    record = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": "PYTHONPATH=. python benchmarks/policy_cost.py " + " ".join(sys.argv[1:] if argv is None
                                                                                    else argv),
              "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "python": sys.version.split()[0], "numpy": np.__version__, "results": results}
    records.write_json(os.path.join(args.out, "policy_cost.json"), record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
