"""What one device call of a compiled group of rounds costs, by the thread that makes it: calls of 0-64 rounds of a
tree of 32 (``decode.run_group``, random weights of a named shape, one sequence, a 2k-token budget, the weights in
their checkpoint layout) from the main thread, then calls of 8 and 64 rounds from a worker thread while the main
thread reads each call's Snapshot (``worker``), and also spins 1 ms in Python after each read (``worker_busy``), and
the same at a switch interval of 0.1 ms (``worker_busy_si``; CPython's default 5 ms otherwise). Per mode and round
count: the medians of the calls after the first two, of when the call returned and when its Snapshot was ready (ms),
and for the worker modes the wall time a call. On a GPU a call returns only once its rounds have run; a worker
thread's calls that take longer than the main thread's, by about the switch interval, wait for the GIL
(``autorun.quick_handoffs``).

    PYTHONPATH=. python benchmarks/call_cost.py OUT/call_cost.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ddtree_jax import cli  # noqa: E402
from ddtree_jax.shapes import SHAPES  # noqa: E402

MODES = ("main", "worker", "worker_busy", "worker_busy_si")
MAIN_ROUNDS, WORKER_ROUNDS = (0, 1, 2, 4, 8, 16, 32, 64), (8, 64)


def busy(ms: float) -> None:
    """Hold the GIL for ``ms`` milliseconds, as the host's own Python work would."""
    t = time.perf_counter()
    while time.perf_counter() - t < ms / 1e3:
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="write the results here (JSON)")
    p.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES), help="random weights of this shape")
    p.add_argument("--calls", type=cli.positive_int, default=12, help="calls a mode and round count (the first two "
                                                                        "untimed); at least 3")
    p.add_argument("--max-rounds", type=cli.positive_int, default=64, help="round counts above this become this")
    args = p.parse_args(argv)
    if args.calls < 3:
        p.error("--calls must be at least 3")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ddtree_jax import decode
    from ddtree_jax.shapes import build_params, model_configs
    from ddtree_jax.spec import GenerateOptions

    tcfg, dcfg = model_configs(SHAPES[args.model])
    tp, dp = build_params(tcfg, dcfg, jnp.bfloat16)
    opts = GenerateOptions(method="ddtree", tree_budget=32, max_new_tokens=2048)
    prompts = [[1 + i % (tcfg.vocab_size - 1) for i in range(128)]]
    spec = decode.make_spec(tcfg, dcfg, opts, batch=1)
    state0, tokens = decode.start(spec, prompts, [opts], 2048, jnp.bfloat16, None)
    starts = jnp.asarray([128], jnp.int32)
    fn = decode.compiled(decode.run_group, spec, tp, dp, state0, starts, jnp.int32(0), 64)
    prefill = decode.compiled(decode.prefill, spec, tp, dp, state0, tokens)

    def fresh():
        state, _ = decode.start(spec, prompts, [opts], 2048, jnp.bfloat16, None)
        return prefill(tp, dp, state, tokens)

    out: dict[str, dict] = {}
    before = sys.getswitchinterval()
    try:
        for mode in MODES:
            sys.setswitchinterval(1e-4 if mode.endswith("_si") else 5e-3)
            counts = MAIN_ROUNDS if mode == "main" else WORKER_ROUNDS
            for r in sorted({min(r, args.max_rounds) for r in counts}):
                box = [fresh()]

                def call(r=r):
                    """(Snapshot, seconds until the call returned, until its Snapshot was ready)."""
                    t = time.perf_counter()
                    box[0], snap = fn(tp, dp, box[0], starts, jnp.int32(r))
                    t1 = time.perf_counter()
                    jax.block_until_ready(snap)
                    return snap, t1 - t, time.perf_counter() - t

                ts, wall = [], None
                if mode == "main":
                    ts = [call()[1:] for _ in range(args.calls)]
                else:
                    with concurrent.futures.ThreadPoolExecutor(1) as ex:
                        queued = [ex.submit(call)]
                        for i in range(args.calls - 1):
                            queued.append(ex.submit(call))
                            snap, returned, ready = queued.pop(0).result()
                            if i == 1:
                                w0 = time.perf_counter()
                            jax.device_get(snap)
                            if mode.startswith("worker_busy"):
                                busy(1.0)
                            ts.append((returned, ready))
                        ts.append(queued.pop(0).result()[1:])
                    wall = (time.perf_counter() - w0) * 1e3 / (args.calls - 2)  # the calls after the first two
                ms = np.array(ts[2:]) * 1e3
                ret, ready = float(np.median(ms[:, 0])), float(np.median(ms[:, 1]))
                out.setdefault(mode, {})[str(r)] = {"call_returned_ms": ret, "ready_ms": ready,
                                                    "wall_ms_per_call": wall}
                print(f"{mode:14s} rounds {r:3d}: call returned {ret:.3f} ms, ready {ready:.3f} ms, per round "
                      f"{ready / max(r, 1):.3f}, wall a call {wall}", flush=True)
    finally:
        sys.setswitchinterval(before)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "calls": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
