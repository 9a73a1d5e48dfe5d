"""The MoE layer and the Qwen3-Coder-30B-A3B grid on one H200, in one command (issue 52).

    PYTHONPATH=. python3 benchmarks/moe_h200.py --out "$OUT"            (about 7 minutes from a bare machine)

1. check   ``pallas_kernels.grouped_matmul`` against its reference at the real shapes (one layer's gate|up
           [128, 1536, 2048] and down [128, 2048, 768], 520 (token, slot) rows routed at random); the whole MoE layer
           with the kernels against XLA's forms at 65 tokens (grouped), and its gather form (XLA's, the decoder's at
           1 token) against the grouped kernel's form of the same token; the probe the decoder runs
           (``moe.kernel_works``).
2. forms   one layer's gate|up (0.81 GB for its 128 experts) at 1, 8, 72, 520 and 2056 (token, slot) rows (the rows of
           1, 1, 9, 65 and 257 tokens of 8 experts each: a token's single expert, an AR step, a chain of 8, ddtree 64,
           ddtree 256): the grouped kernel, XLA's gather form (row reductions over the routed experts' matrices, one
           pass over each pair's expert: the decoder's up to 16 pairs) and XLA's ragged dot (the grouped kernel's
           fallback), each against the time to read the distinct experts the rows route to once, at the measured
           copy bandwidth. Device time per call: the calls in one jitted loop over 8 different routings (the experts
           are not left in the L2 cache by the previous call), median of 5.
   layer   the whole MoE layer (route, sort, gate|up, down, combine) at 1, 9, 65 and 257 tokens, as the decoder runs
           it (kernel: XLA's gather form up to 16 pairs, the grouped kernel above) and with the 'xla' attention
           (ragged_dot: XLA's ragged dot above 16 pairs, the same gather form up to them), against reading its
           distinct experts' gate|up and down once.
3. grid    ``bench models --models qwen3-coder-30b-a3b --prompts 512 --batches 1`` with AR, DFlash and DDTree at
           budgets 8, 16, 32, 64, 128 and 256 (stage breakdowns for AR, DFlash and DDTree 64), random bf16 weights built
           on the device: ms per round, AR against its routed-bytes roofline, each round against its floor, and the
           experts each round touches per layer (measured from the router's choices) with the uniform-routing figure;
           then ``bench project`` on those records: the DDTree paper's acceptance lengths for this model x the
           measured round costs, per budget the grid measured (a projection: random weights accept about one token
           a round), and the form ``--tree-budget auto`` would pick from those costs with those lengths.

Writes ``OUT/moe_h200.json`` (checks, forms, layer timings, the grid's records) and the bench's own files under
``OUT/bench``; prints a short table of each part. Each part is guarded: a failure is recorded and the next part runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import bench, moe, policy, projection, shapes
from ddtree_jax.bench.records import now
from ddtree_jax.bench.roofline import measure_ceilings
from ddtree_jax.tuning import Tuning
from pallas_kernels import grouped_matmul as gmm

PAPER_MODEL = "qwen3-coder-30b-a3b"  # the paper's pair this script measures (benchmarks/paper_tau.json)
SHAPE = shapes.SHAPES[PAPER_MODEL]
ROWS = (1, 8, 72, 520, 2056)
TOKENS = (1, 9, 65, 257)
ROUTINGS = 8  # different routings per timed loop
KERNEL = "pallas"  # the attention implementation that selects the kernel ("pallas-interpret" on CPU: --quick)


def use(shape) -> None:
    """Set the shape the parts measure (E experts of width F, K per token, hidden D)."""
    global SHAPE, E, K, F, D
    SHAPE = shape
    E, K, F, D = shape.experts, shape.experts_per_token, shape.expert_intermediate, shape.hidden


use(SHAPE)


def log(msg: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def device_ms(fn, inputs, weights) -> float:
    """Median over 5 timings of one jitted loop calling ``fn(input, weights)`` on each of the [R, ...] ``inputs`` in
    turn (3 passes), per call. The loop carries a sum of one output element so that no call is dropped; the weights are
    arguments (a closed-over array would be compiled in as a constant)."""
    n = jax.tree.leaves(inputs)[0].shape[0]
    calls = 3 * n

    def loop(inputs, weights):
        def body(i, acc):
            out = fn(jax.tree.map(lambda a: a[i % n], inputs), weights)
            return acc + jax.tree.leaves(out)[0].reshape(-1)[0].astype(jnp.float32)

        return jax.lax.fori_loop(0, calls, body, jnp.float32(0))

    loop = jax.jit(loop)
    loop(inputs, weights).block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        loop(inputs, weights).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times) / calls


def routings(key, tokens: int, rows: int):
    """ROUTINGS random routings of ``tokens`` tokens (k distinct experts each, uniform), the first ``rows`` (token,
    slot) pairs of each: (ids [R, rows], tokens' rows x [R, tokens, D] bf16)."""
    kx, ke = jax.random.split(key)
    ids = jnp.argsort(jax.random.uniform(ke, (ROUTINGS, tokens, E)), axis=-1)[..., :K].reshape(ROUTINGS, -1)[:, :rows]
    x = jax.random.normal(kx, (ROUTINGS, tokens, D), jnp.float32).astype(jnp.bfloat16)
    return ids.astype(jnp.int32), x


def sorted_rows(ids, x):
    """One routing's pairs sorted by expert: (rows [P, D], group sizes [E])."""
    order = jnp.argsort(ids, stable=True)
    return jnp.take(x, order // K, axis=0), jnp.zeros((E,), jnp.int32).at[ids].add(1)


def check(weights, key) -> dict:
    gate_up, down = weights
    interpret = KERNEL.endswith("interpret")
    ids, x = routings(key, 65, 65 * K)
    rows, sizes = sorted_rows(ids[0], x[0])
    out = {"probe_passed": interpret or moe.kernel_works("grouped_matmul")}
    h = jax.random.normal(key, (65 * K, F), jnp.float32).astype(jnp.bfloat16)
    for name, w, inp in (("gate_up", gate_up, rows), ("down", down, h)):
        got = jax.jit(lambda a, w, s: gmm.grouped_matmul(a, w, s, out_dtype=jnp.float32, interpret=interpret))(
            inp, w, sizes)
        want = jax.jit(lambda a, w, s: gmm.reference(a, w, s, 0, jnp.float32))(inp, w, sizes)
        out[name] = {"max_err": float(jnp.max(jnp.abs(got - want))), "scale": float(jnp.max(jnp.abs(want)))}
    cfg, _ = shapes.model_configs(SHAPE)
    layer = _layer(weights, key)
    # the layer with the kernels against XLA's forms (grouped, 65 tokens); its gather form (1 token) against the
    # grouped kernel's form of that token
    for name, xs, base in (("layer", x[0][None], ("xla", Tuning())),
                           ("layer_gather", x[0][None, :1], (KERNEL, Tuning(moe_gather_pairs=1)))):
        ys = [np.asarray(jax.jit(lambda x, w, impl=impl, tuning=tuning: moe.block(x, w, cfg, impl, tuning=tuning))(
            xs, layer)) for impl, tuning in ((KERNEL, Tuning()), base)]
        out[name] = {"max_err": float(np.abs(ys[0] - ys[1]).max()), "scale": float(np.abs(ys[1]).max())}
    out["ok"] = out["probe_passed"] and all(out[k]["max_err"] <= 0.02 * out[k]["scale"]
                                            for k in ("gate_up", "down", "layer", "layer_gather"))
    return out


def _layer(weights, key):
    from ddtree_jax.params import LayerWeights

    router = (0.02 * jax.random.normal(key, (D, E), jnp.float32)).astype(jnp.bfloat16)
    none = dict.fromkeys(("attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "mlp_norm", "w_gate", "w_up",
                          "w_down"))
    return LayerWeights(**none, router=router, experts_gate_up=weights[0], experts_down=weights[1])


def forms(weights, key, bw_gbps: float) -> list[dict]:
    """One layer's gate|up by each form at each row count."""
    gate_up = weights[0]
    per_expert = 2 * F * D * 2
    out = []
    for r in ROWS:
        ids, x = routings(jax.random.fold_in(key, r), max(1, math.ceil(r / K)), r)
        sorted_ = jax.vmap(sorted_rows)(ids, x)
        distinct = float(np.mean([len(np.unique(np.asarray(i))) for i in ids]))
        row = {"rows": r, "distinct_experts": distinct, "bytes": distinct * per_expert,
               "floor_ms": distinct * per_expert / bw_gbps / 1e6}
        pairs_x = jax.vmap(lambda x, i: jnp.take(x, jnp.arange(i.shape[0]) // K, axis=0))(x, ids)  # [R, rows, D]
        interpret = KERNEL.endswith("interpret")
        cases = {
            "kernel": (lambda a, w: gmm.grouped_matmul(a[0], w, a[1], interpret=interpret), sorted_),
            "ragged_dot": (lambda a, w: moe._ragged(a[0], w, a[1], 0, jnp.bfloat16), sorted_),
            "gather": (lambda a, w: moe._gather_product(a[0], w, a[1]), (pairs_x, ids)),
        }
        for name, (fn, inputs) in cases.items():
            try:
                row[f"{name}_ms"] = device_ms(fn, inputs, gate_up)
                row[f"{name}_over_floor"] = row[f"{name}_ms"] / row["floor_ms"]
            except Exception as e:  # noqa: BLE001 - record and go on
                row[f"{name}_error"] = repr(e)[:300]
        log(f"  gate|up {r} rows ({distinct:.0f} experts, floor {row['floor_ms']:.3f} ms): " + ", ".join(
            f"{n} {row[n + '_ms']:.3f}" for n in cases if n + "_ms" in row))
        out.append(row)
    return out


def layer_times(weights, key, bw_gbps: float) -> list[dict]:
    """The whole MoE layer as the decoder runs it with the kernels and with the 'xla' attention, at each token
    count."""
    cfg, _ = shapes.model_configs(SHAPE)
    layer = _layer(weights, key)
    per_expert = 3 * F * D * 2
    out = []
    for t in TOKENS:
        x = jax.random.normal(jax.random.fold_in(key, t), (ROUTINGS, 1, t, D), jnp.float32).astype(jnp.bfloat16)
        _, ids = jax.vmap(lambda x: moe.route(x[0], layer.router, K, True))(x)
        distinct = float(np.mean([len(np.unique(np.asarray(i))) for i in ids]))
        row = {"tokens": t, "pairs": t * K, "distinct_experts": distinct,
               "floor_ms": distinct * per_expert / bw_gbps / 1e6,
               "form": "gather" if t * K <= moe.GATHER_MAX_PAIRS else "grouped"}
        forms = [("kernel", KERNEL, Tuning()), ("ragged_dot", "xla", Tuning())]
        for name, impl, tuning in forms:
            try:
                row[f"{name}_ms"] = device_ms(lambda x, w, impl=impl, tuning=tuning: moe.block(x, w, cfg, impl,
                                                                                             tuning=tuning), x, layer)
                row[f"{name}_over_floor"] = row[f"{name}_ms"] / row["floor_ms"]
            except Exception as e:  # noqa: BLE001
                row[f"{name}_error"] = repr(e)[:300]
        log(f"  layer {t} tokens ({distinct:.0f} experts, floor {row['floor_ms']:.3f} ms): " + ", ".join(
            f"{n} {row[n + '_ms']:.3f}" for n, _, _ in forms if n + "_ms" in row))
        out.append(row)
    return out


def project(records: str, out: str, budgets: str) -> dict:
    """``bench project`` on the grid's own records (prompt 512, batch 1, greedy: the paper's temperature 0) at the
    budgets the grid measured (a time box may cut the largest): the paper's acceptance lengths for
    Qwen3-Coder-30B-A3B x these round costs. A shape other than the paper's (--quick) takes that model's lengths
    from a copy of the table under its own name."""
    with open(records) as f:
        measured = {r.get("budget") for r in json.load(f) if r.get("model") == SHAPE.name
                    and r.get("method") == "ddtree" and r.get("ms_per_round")}
    asked = [int(b) for b in budgets.split(",")]
    done = [b for b in asked if b in measured]
    tau = str(projection.PAPER_TAU)
    if SHAPE.name != PAPER_MODEL:
        tau = os.path.join(out, "paper_tau_as_" + SHAPE.name + ".json")
        table = json.loads(projection.PAPER_TAU.read_text())
        table["temperatures"] = {"0.0": {SHAPE.name: table["temperatures"]["0.0"][PAPER_MODEL]}}
        with open(tau, "w") as f:
            json.dump(table, f, indent=1)
    path = os.path.join(out, "projection.json")
    if bench.main(["project", "--results", records, "--tau", tau, "--models", SHAPE.name, "--temperature", "0.0",
                   "--budgets", ",".join(map(str, done)), "--json", path]) != 0:
        raise RuntimeError("bench project failed (its error is printed above)")
    with open(path) as f:
        (rows,) = json.load(f)
    return {"note": "a projection, not a measurement: the DDTree paper's mean acceptance length tau (temperature 0, "
                    f"{PAPER_MODEL}, its best budget per dataset) x AR ms / round ms measured here",
            "tau_of": PAPER_MODEL, "budgets": done, "not_measured": [b for b in asked if b not in done], **rows}


def policy_choices(grid: list[dict]) -> dict:
    """The form ``--tree-budget auto`` picks among an MoE target's GPU candidates (policy.candidates) from the grid's
    round costs with the paper's tau as every form's expected acceptance (projection.choices): a projection."""
    ms = {("ar" if r["method"] == "ar" else "chain" if r["method"] == "dflash" else str(r["budget"])): r["ms_per_round"]
          for r in grid if r.get("model") == SHAPE.name and r.get("ms_per_round")}
    candidates = policy.candidates("ddtree", "gpu", moe=True)
    forms = [f for f in candidates if f in ms]
    taus = projection.load_tau()["0.0"][PAPER_MODEL]
    return {"note": "a projection, not a measurement: the form ddtree_jax.policy.Policy.choose picks (--tree-budget "
                    "auto, a mixture-of-experts target's GPU candidates) with the measured round costs above as its "
                    "cost table and every form's expected acceptance set to the paper's tau (the chain: dflash's; "
                    "every tree: ddtree's, which the paper reports at its best budget, so small trees are credited "
                    "with more than they accept)",
            "candidates": list(candidates), "costs_ms": {f: round(ms[f], 3) for f in forms},
            "choices": projection.choices(taus, {f: ms[f] for f in forms})}


def table(rows: list[dict], cols: list[str]) -> str:
    cells = [[f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c, "-")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    return "\n".join(["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
                     + ["  ".join(v.ljust(w) for v, w in zip(x, widths)) for x in cells])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/moe_h200.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (created): moe_h200.json and bench/")
    p.add_argument("--time-budget-s", type=float, default=450.0,
                   help="seconds for the whole script; the grid gets what parts 1-2 leave (default: 450)")
    p.add_argument("--budgets", default="8,16,32,64,128,256", help="ddtree budgets of the grid (default: %(default)s)")
    p.add_argument("--skip-grid", action="store_true", help="parts 1 and 2 only")
    p.add_argument("--tuning", default="", metavar="KEY=VALUE,...",
                   help="the grid's tuning (bench models --tuning), e.g. grouped_matmul=0 (XLA's ragged dot) or "
                        "moe_gather_pairs=1 (no gather form)")
    p.add_argument("--quick", action="store_true",
                   help="a CPU rehearsal: the tiny-moe shape, the kernel interpreted, small rows, bench models --quick")
    args = p.parse_args(argv)
    global ROWS, TOKENS, KERNEL
    if args.quick:
        use(shapes.SHAPES["tiny-moe"])
        ROWS, TOKENS, KERNEL = (1, 8, 40), (1, 9), "pallas-interpret"
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)
    result: dict = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "date": now(),
                    "command": " ".join(sys.argv), "gather_max_pairs": moe.GATHER_MAX_PAIRS}
    path = os.path.join(args.out, "moe_h200.json")

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1, default=str)

    def part(name, fn, *a):
        log(f"{name} ({args.time_budget_s - (time.time() - t_start):.0f}s left)")
        t0 = time.time()
        try:
            result[name] = fn(*a)
        except Exception as e:  # noqa: BLE001 - record and go on
            traceback.print_exc()
            result[name] = {"error": repr(e)[:1000]}
        result.setdefault("seconds", {})[name] = time.time() - t0
        save()
        return result[name]

    key = jax.random.key(0)
    kg, kd, kc, kf, kl = jax.random.split(key, 5)
    weights = jax.block_until_ready((
        (0.02 * jax.random.normal(kg, (E, 2 * F, D), jnp.float32)).astype(jnp.bfloat16),
        (0.02 * jax.random.normal(kd, (E, D, F), jnp.float32)).astype(jnp.bfloat16)))
    ceilings = part("ceilings", measure_ceilings, args.quick)
    bw = ceilings.get("copy_gbps") or 4.1e3
    chk = part("check", check, weights, kc)
    fm = part("forms", forms, weights, kf, bw)
    lt = part("layer", layer_times, weights, kl, bw)
    del weights
    print(f"\n== check: {json.dumps(chk)}")
    if isinstance(fm, list):
        print("\n== one layer's gate|up (ms; floor = distinct experts' bytes / copy bandwidth "
              f"{bw / 1e3:.2f} TB/s)\n" + table(fm, ["rows", "distinct_experts", "floor_ms", "kernel_ms", "gather_ms",
                                                      "ragged_dot_ms", "kernel_over_floor", "gather_over_floor"]))
    if isinstance(lt, list):
        print("\n== the whole MoE layer (ms)\n" + table(lt, ["tokens", "distinct_experts", "floor_ms", "form",
                                                               "kernel_ms", "ragged_dot_ms", "kernel_over_floor"]))
    if not args.skip_grid:
        left = args.time_budget_s - (time.time() - t_start)
        budgets, key = ("4,16", "16") if args.quick else (args.budgets, "64")
        grid = ["models", "--models", SHAPE.name, "--prompts", "512", "--batches", "1", "--methods", "ar,dflash,ddtree",
                "--budgets", budgets, "--key-budgets", key, "--no-hlo", "--no-profile", "--no-tree-micro",
                "--repeats", "3", "--stage-iters", "5", "--time-budget-s", str(max(60.0, left - 20)),
                "--out", os.path.join(args.out, "bench"), "--results-name", "moe_grid.json"]
        if args.tuning:
            grid += ["--tuning", args.tuning]
        if args.quick:
            grid += ["--quick"]
        log(f"grid: python -m ddtree_jax.bench {' '.join(grid)}")
        result["grid_command"] = grid
        records = os.path.join(args.out, "bench", "moe_grid.json")
        try:
            bench.main(grid)
            with open(records) as f:
                result["grid"] = json.load(f)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            result["grid"] = {"error": repr(e)[:1000]}
        print("\n== projected speedup over AR (a projection, not a measurement)")
        try:
            result["projection"] = project(records, args.out, budgets)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            result["projection"] = {"error": repr(e)[:1000]}
        try:
            result["policy"] = policy_choices(result["grid"])
            print("auto's pick per dataset (a projection): " + ", ".join(
                f"{d} {c['choice']}" for d, c in result["policy"]["choices"].items()))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            result["policy"] = {"error": repr(e)[:1000]}
    result["seconds"]["total"] = time.time() - t_start
    save()
    log(f"wrote {path} ({result['seconds']['total']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
