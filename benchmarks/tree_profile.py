"""The GPU time of one tree build (``tree.best_first`` with today's defaults) from a profiler trace, on random
Qwen3-vocabulary draft logits [B, 15, V] (3 x a standard normal, f32); trees checked first against XLA's forms (the
chunked top-k, rank counting, XLA's ancestor bits), on those logits and on rounded ones (heavy ties).

    PYTHONPATH=. python benchmarks/tree_profile.py OUT.json [--budgets 64,256] [--batch 1]

One jitted build is called on 8 distinct inputs, one call at a time (no loop, no host clock in the figure); each
call's device events form one cluster: ``span_us`` = its first kernel's start to its last kernel's end (the build's
latency on the stream, kernel boundaries included), ``busy_us`` = the time some kernel ran, medians over the calls;
``kernels_us``: each kernel's time per call. Results: benchmarks/results/h200_checks.json (``tree_build_profile``).
"""

import argparse
import glob
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import tree as trees
from ddtree_jax.bench.analysis import busy_and_gaps

DEPTHS = 15
R = 8


def fields(t):
    return t.tokens, t.depths, t.parents, t.bits


def default_build(x, budget):
    return fields(trees.best_first(x, budget))


def xla_build(x, budget):
    return fields(trees.best_first(x, budget, chunk=trees.default_topk_chunk(budget), select="count", bits="xla"))


def profile(f, xs):
    """{span_us, busy_us, calls, kernels_us} of one call of jitted f over the inputs xs, from a profiler trace."""
    g = jax.jit(f)
    for x in xs:
        jax.block_until_ready(g(x))
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for x in xs:
                jax.block_until_ready(g(x))
                time.sleep(0.002)
        path = sorted(glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True))[-1]
        pd = jax.profiler.ProfileData.from_file(path)
    evs, names = [], {}
    for plane in pd.planes:
        if plane.name.startswith("/device:"):
            for ln in plane.lines:
                if ln.name.startswith("Stream"):
                    for e in ln.events:
                        evs.append((e.start_ns, e.start_ns + e.duration_ns))
                        names.setdefault(e.name[:60], []).append(e.duration_ns / 1e3)
    if not evs:  # no device streams (a CPU rehearsal)
        return None
    evs.sort()
    clusters = [[evs[0]]]
    for s, e in evs[1:]:
        if s - max(c[1] for c in clusters[-1]) > 500_000:  # calls are >= 2 ms apart
            clusters.append([])
        clusters[-1].append((s, e))
    spans, busys = [], []
    for c in clusters:
        spans.append((max(e for _, e in c) - c[0][0]) / 1e3)
        busys.append(busy_and_gaps(c)[0] / 1e3)
    per_call = {k: round(sum(v) / len(clusters), 2) for k, v in sorted(names.items(), key=lambda kv: -sum(kv[1]))}
    return {"span_us": statistics.median(spans), "busy_us": statistics.median(busys), "calls": len(clusters),
            "kernels_per_call": len(evs) // len(clusters), "kernels_us": per_call}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="JSON file for the results")
    p.add_argument("--budgets", default="64,256", help="tree budgets (default: 64,256)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (default: Qwen3's)")
    p.add_argument("--batch", type=int, default=1, help="sequences per build (default: 1)")
    args = p.parse_args(argv)
    res = {"device": jax.devices()[0].device_kind, "vocab": args.vocab, "depths": DEPTHS, "batch": args.batch}
    xs = [3.0 * jax.random.normal(jax.random.key(i), (args.batch, DEPTHS, args.vocab), jnp.float32) for i in range(R)]
    ties = [jnp.round(x * 2) / 2 for x in xs[:2]]
    forms = {"default": default_build}
    for budget in [int(s) for s in args.budgets.split(",")]:
        want = [jax.jit(xla_build, static_argnums=1)(x, budget) for x in xs[:2] + ties]
        row = {}
        for name, f in forms.items():
            got = [jax.jit(f, static_argnums=1)(x, budget) for x in xs[:2] + ties]
            row[name] = {"trees_equal_xla": all(np.array_equal(np.asarray(a), np.asarray(b))
                                                for ta, tb in zip(got, want) for a, b in zip(ta, tb)),
                         **(profile(lambda x, f=f: f(x, budget), xs) or {})}
            print(f"budget {budget} {name}: {row[name]}", flush=True)
        res[f"budget{budget}"] = row
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
