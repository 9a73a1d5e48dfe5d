"""What an AR step costs inside a speculative serving engine, against the AR engine's own step, at every slot batch.

Builds random weights of one shape (default Qwen3-8B's) on the device, then for each configuration in turn starts a
serving engine (``ddtree_jax.engine.Engine``, as ``serve`` does with --max-batch and --max-len), waits until every
greedy program is compiled and timed on free slots with no compilation running, and reads the engine's own cost
table (seconds per round of each form at each slot batch: what its policy weighs). A configuration is

    ar                   method ar
    ddtree               method ddtree, --tree-budget auto with the default forms
    ddtree:FORMS         auto with only FORMS ('+'-separated, e.g. ddtree:ar+chain: the state laid out for the
                         chain's verify, not for a 256-node tree's, so its KV cache has fewer slots)

Prints, per slot batch, each configuration's AR step (form ar) in ms and over the AR engine's, and its cheapest
speculative form (the probe a useless drafter gets) over its AR step; writes OUT/ar_step_cost.json (every program's
cost, each engine's KV capacity, compile and wait times).

    PYTHONPATH=. python benchmarks/ar_step_cost.py OUT                              # H200: qwen3-8b, max-batch 32
    PYTHONPATH=. python benchmarks/ar_step_cost.py OUT --shape tiny --max-batch 4 --max-len 256    # CPU rehearsal
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output directory (created)")
    p.add_argument("--shape", default="qwen3-8b", help="a shape of ddtree_jax.shapes.SHAPES (default: %(default)s)")
    p.add_argument("--configs", default="ar,ddtree,ddtree:ar+chain",
                   help="engines to time, in turn; the first is the reference (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=32, help="slots, as serve's --max-batch (default: %(default)s)")
    p.add_argument("--max-len", type=int, default=1024, help="tokens per slot, as serve's (default: %(default)s)")
    p.add_argument("--rounds-per-step", type=int, default=4, help="as serve's (default: %(default)s)")
    p.add_argument("--wait", type=float, default=240.0,
                   help="seconds to wait for one engine's programs to be compiled and timed (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", help="(default: %(default)s)")
    return p.parse_args(argv)


def config(text: str) -> tuple[str, tuple[str, ...]]:
    """'ddtree:ar+chain' -> ('ddtree', ('ar', 'chain')); 'ar' -> ('ar', ())."""
    method, _, forms = text.partition(":")
    if method not in ("ar", "dflash", "ddtree"):
        raise ValueError(f"unknown method {method!r} in --configs")
    return method, tuple(f for f in forms.split("+") if f)


def settled(engine) -> bool:
    """Every greedy program compiled and timed with no compilation running (Programs.to_time has nothing left)."""
    greedy = [p for p in engine.programs.values() if p.variant == "greedy"]
    return all(p.fn is not None for p in greedy) and engine.programs.quiet() and all(p.clean for p in greedy)


def time_engine(name: str, target, draft, args) -> dict:
    from ddtree_jax import engine as engines

    method, forms = config(name)
    cfg = engines.EngineConfig(method=method, max_batch=args.max_batch, max_len=args.max_len,
                               rounds_per_step=args.rounds_per_step, forms=forms)
    t0 = time.perf_counter()
    eng = engines.Engine(target, draft, cfg).start()
    started = time.perf_counter() - t0
    while not settled(eng) and time.perf_counter() - t0 < args.wait:
        time.sleep(1.0)
    waited = time.perf_counter() - t0
    costs = {f"{p.form}@{p.size}": (1e3 * c if (c := eng.costs.get(p.cost_key)) is not None else None)
             for p in eng.programs.values() if p.variant == "greedy"}
    rec = dict(config=name, capacity=eng.layout.capacity, started_s=round(started, 1), settled=settled(eng),
               waited_s=round(waited, 1), ms_per_round=costs)
    eng.stop()
    del eng
    gc.collect()
    print(f"{name}: capacity {rec['capacity']} slots, {len(costs)} greedy programs, "
          f"{'settled' if rec['settled'] else 'NOT settled'} after {waited:.0f} s", file=sys.stderr, flush=True)
    return rec


def table(records: list[dict], sizes: list[int]) -> str:
    """Markdown: per slot batch, each config's AR step (ms, x the first config's) and its cheapest probe over it."""
    ref = records[0]["ms_per_round"]
    head = ["slot batch"] + [f"{r['config']} ar (ms, x {records[0]['config']})" for r in records]
    head += [f"{r['config']} probe / ar" for r in records if r["config"] != "ar"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in sizes:
        row = [str(n)]
        for r in records:
            ms, base = r["ms_per_round"].get(f"ar@{n}"), ref.get(f"ar@{n}")
            row.append("-" if ms is None else f"{ms:.2f}" + (f" ({ms / base:.3f})" if base else ""))
        for r in records:
            if r["config"] == "ar":
                continue
            c = r["ms_per_round"]
            probes = [v for k, v in c.items() if k.endswith(f"@{n}") and not k.startswith("ar@") and v]
            row.append(f"{min(probes) / c[f'ar@{n}']:.2f}" if probes and c.get(f"ar@{n}") else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        names = [x.strip() for x in args.configs.split(",") if x.strip()]
        for n in names:
            config(n)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import jax
    import jax.numpy as jnp

    from ddtree_jax import shapes
    from ddtree_jax.weight_layout import device_layout

    if args.shape not in shapes.SHAPES:
        print(f"error: unknown --shape {args.shape!r} (choose from {', '.join(shapes.SHAPES)})", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    tcfg, dcfg = shapes.model_configs(shapes.SHAPES[args.shape])
    tparams, dparams = shapes.build_params(tcfg, dcfg, jnp.dtype(args.dtype))
    # laid out once, as every engine here wants them (AR steps are among each one's forms): no copy per engine
    tparams = device_layout(tparams, method="ar")
    dparams = device_layout(dparams)
    records = [time_engine(n, (tcfg, tparams), (dcfg, dparams), args) for n in names]
    sizes = sorted({int(k.split("@")[1]) for r in records for k in r["ms_per_round"]})
    text = table(records, sizes)
    print(text)
    with open(os.path.join(args.out, "ar_step_cost.json"), "w") as f:
        json.dump(dict(args=vars(args), device=jax.devices()[0].device_kind, records=records, table=text), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
