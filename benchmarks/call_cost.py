"""What one device call of a compiled group of rounds costs, by the thread that makes it: calls of 0-64 rounds of a
tree of 32 (``decode.run_group``, random weights of SmolLM2-135M's shape, one sequence, a 2k-token budget, the weights
in their checkpoint layout) from the main thread, then calls of 8 and 64 rounds from a worker thread while the main
thread reads each call's Snapshot (``worker``), and also spins 1 ms in Python after each read (``worker_busy``),
and the same at a switch interval of 0.1 ms (``worker_busy_si``; CPython's default 5 ms otherwise). Per mode and round
count: the medians of 10 calls (after 2) of when the call returned and when its Snapshot was ready (ms), and for
the worker modes the wall time a call. On a GPU a call returns only once its rounds have run; a worker thread's calls
that take longer than the main thread's, by about the switch interval, wait for the GIL (autorun.quick_handoffs).

    PYTHONPATH=. python benchmarks/call_cost.py OUT/call_cost.json
"""
import concurrent.futures
import json
import sys
import time

sys.path.insert(0, '.')
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ddtree_jax import decode  # noqa: E402
from ddtree_jax.shapes import SHAPES, build_params, model_configs  # noqa: E402
from ddtree_jax.spec import GenerateOptions  # noqa: E402

tcfg, dcfg = model_configs(SHAPES['smollm2-135m'])
tp, dp = build_params(tcfg, dcfg, jnp.bfloat16)
opts = GenerateOptions(method='ddtree', tree_budget=32, max_new_tokens=2048)
prompts = [[1 + i for i in range(128)]]
spec = decode.make_spec(tcfg, dcfg, opts, batch=1)
state0, tokens = decode.start(spec, prompts, [opts], 2048, jnp.bfloat16, None)
starts = jnp.asarray([128], jnp.int32)
fn = decode.compiled(decode.run_group, spec, tp, dp, state0, starts, jnp.int32(0), 64)
pre = decode.compiled(decode.prefill, spec, tp, dp, state0, tokens)
out = {}


def fresh():
    state, _ = decode.start(spec, prompts, [opts], 2048, jnp.bfloat16, None)
    return pre(tp, dp, state, tokens)


def busy(ms):
    t = time.perf_counter()
    while time.perf_counter() - t < ms / 1e3:
        pass


for mode in ('main', 'worker', 'worker_busy', 'worker_busy_si'):
    sys.setswitchinterval(1e-4 if mode.endswith('_si') else 5e-3)
    for r in ((0, 1, 2, 4, 8, 16, 32, 64) if mode == 'main' else (8, 64)):
        box = [fresh()]

        def call():
            t = time.perf_counter()
            box[0], snap = fn(tp, dp, box[0], starts, jnp.int32(r))
            t1 = time.perf_counter()
            jax.block_until_ready(snap)
            return snap, t1 - t, time.perf_counter() - t

        ts = []
        if mode == 'main':
            for i in range(12):
                ts.append(call()[1:])
            wall = None
        else:
            with concurrent.futures.ThreadPoolExecutor(1) as ex:
                q = [ex.submit(call)]
                for i in range(11):
                    q.append(ex.submit(call))
                    snap, a, b = q.pop(0).result()
                    if i == 1:
                        w0 = time.perf_counter()
                    jax.device_get(snap)
                    if mode.startswith('worker_busy'):
                        busy(1.0)
                    ts.append((a, b))
                ts.append(q.pop(0).result()[1:])
            wall = (time.perf_counter() - w0) * 1e3 / 10  # calls 3..12
        ts = np.array(ts[2:]) * 1e3
        ret, ready = float(np.median(ts[:, 0])), float(np.median(ts[:, 1]))
        out.setdefault(mode, {})[str(r)] = {"call_returned_ms": ret, "ready_ms": ready, "wall_ms_per_call": wall}
        print(f"{mode:12s} rounds {r:3d}: call returned {ret:.3f} ms, ready {ready:.3f} ms, per round "
              f"{ready / max(r, 1):.3f}, wall a call {wall}", flush=True)
if len(sys.argv) > 1:
    json.dump({"device": jax.devices()[0].device_kind, "calls": out}, open(sys.argv[1], "w"), indent=1)
