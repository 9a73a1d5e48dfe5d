"""What a collection of Python's oldest generation costs a serving engine, with and without its objects frozen.

Every compiled program keeps tens of thousands of Python objects alive (its traced program, in jax's caches). Each
collection of the oldest generation by Python's cyclic garbage collector scans every object it tracks, with every
thread stopped (the engine's steps, the HTTP server); ``programs.freeze`` takes them out of its scans. This builds
the serving engine of a random-weight shape (--tree-budget auto, --max-batch), compiles --programs of its greedy
programs in the background compiler's order, and times full collections (the median of --repeats) with those
objects unfrozen (``gc.unfreeze``: as before the engine froze them) and frozen again. Writes OUT/gc_pause.json.

    PYTHONPATH=. python benchmarks/gc_pause.py OUT                     # the default pair's shape, 8 programs
    PYTHONPATH=. python benchmarks/gc_pause.py OUT --programs 33      # all of auto's at --max-batch 32 on a GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output directory (created)")
    p.add_argument("--shape", default="smollm2-135m", help="a shape of ddtree_jax.shapes.SHAPES (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=32, help="the engine's slots (default: %(default)s)")
    p.add_argument("--programs", type=int, default=8, help="greedy programs to compile (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="full collections timed each way (default: %(default)s)")
    return p.parse_args(argv)


def full_collections(repeats: int) -> float:
    """Median seconds of a collection of every generation."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    from ddtree_jax import engine as engines, programs, shapes

    target, draft = shapes.random_models(args.shape, jnp.bfloat16, draft=True)
    eng = engines.Engine(target, draft, engines.EngineConfig(method="ddtree", max_batch=args.max_batch, max_len=1024))
    todo = sorted((p for p in eng.programs.values() if p.variant == "greedy"), key=programs._rank)[: args.programs]
    rows = []
    for p in todo:
        t = time.perf_counter()
        eng.programs.compile(p)  # frozen once compiled
        compile_s = time.perf_counter() - t
        gc.unfreeze()
        rows.append({"program": p.cost_key, "compile_s": round(compile_s, 2), "tracked": len(gc.get_objects())})
        gc.freeze()
        print(f"{p.cost_key}: compiled in {compile_s:.1f}s, {rows[-1]['tracked']} objects tracked unfrozen", flush=True)
    gc.unfreeze()
    unfrozen = {"tracked": len(gc.get_objects()), "full_collection_s": full_collections(args.repeats)}
    programs.freeze()
    frozen = {"tracked": len(gc.get_objects()), "full_collection_s": full_collections(args.repeats)}
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": "python benchmarks/gc_pause.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(), "cpus": os.cpu_count(),
              "python": sys.version.split()[0], "jax": jax.__version__,
              "programs": rows, "unfrozen": unfrozen, "frozen": frozen}
    print(f"unfrozen: {unfrozen['tracked']} objects, a full collection {1e3 * unfrozen['full_collection_s']:.0f} ms; "
          f"frozen: {frozen['tracked']}, {1e3 * frozen['full_collection_s']:.1f} ms")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gc_pause.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
