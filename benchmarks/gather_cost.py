"""What a smaller slot batch costs the server for being gathered: one program's rounds on a batch state of n sequences
of its own (in place) against the same n sequences gathered out of a slot batch of --of and scattered back
(``slots.run_group_rows``, what the engine runs for a step at slot batch n < --max-batch), interleaved in one process.
The gathered call copies its rows' whole caches out and back (their capacity, not their live length).

    PYTHONPATH=. python benchmarks/gather_cost.py --model qwen3-8b --method ar --batch 8 --of 32 --json OUT/gather.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ddtree_jax import cli, decode, slots  # noqa: E402
from ddtree_jax.bench import records, timing  # noqa: E402
from ddtree_jax.shapes import SHAPES, build_params, model_configs  # noqa: E402
from ddtree_jax.weight_layout import device_layout  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--method", default="ar", choices=("ar", "ddtree"))
    p.add_argument("--budget", type=cli.positive_int, default=16, help="ddtree's tree budget (default: 16)")
    p.add_argument("--batch", type=cli.positive_int, default=8, help="the slot batch timed (default: 8)")
    p.add_argument("--of", type=cli.positive_int, default=32, help="the slot batch it is gathered from (default: 32)")
    p.add_argument("--prompt", type=cli.positive_int, default=128, help="each sequence's prompt length")
    p.add_argument("--max-len", type=cli.positive_int, default=1024,
                   help="the server's --max-len: the caches' capacity follows from it (default: 1024)")
    p.add_argument("--rounds", type=cli.positive_int, default=4, help="rounds a call (the server's --rounds-per-step)")
    p.add_argument("--pairs", type=cli.positive_int, default=8, help="alternating timed calls of each")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if not args.batch < args.of:
        p.error(f"--batch {args.batch} must be smaller than --of {args.of}")

    shape = SHAPES[args.model]
    tcfg, dcfg = model_configs(shape)
    tp, dp = build_params(tcfg, dcfg, jnp.bfloat16)
    spec = timing.make_spec(tcfg, dcfg, args.method, args.budget, "auto")
    tp = device_layout(tp, method=args.method)
    dp = device_layout(dp) if args.method != "ar" else None
    layout = slots.Layout.of(spec, args.max_len)
    n, r = args.batch, jnp.int32(args.rounds)
    own = timing.make_state(spec, shape.vocab, n, args.prompt, layout.capacity, layout.out_len, jnp.bfloat16)
    whole = timing.make_state(spec, shape.vocab, args.of, args.prompt, layout.capacity, layout.out_len, jnp.bfloat16)
    caches = [own.cache] + ([own.dcache] if own.dcache is not None else [])
    kv = sum(c.k.nbytes + c.v.nbytes for c in caches) // n  # a sequence's K and V, target's and drafter's
    rows = jnp.arange(n, dtype=jnp.int32) * (args.of // n)
    starts = jnp.full((n,), args.prompt, jnp.int32)
    calls = {
        "in place": (decode.run_group.lower(spec, tp, dp, own, starts, r, args.rounds).compile(),
                     lambda fn, s: fn(tp, dp, s, starts, r), own),
        "gathered": (slots.run_group_rows.lower(spec, tp, dp, whole, rows, starts, r, args.rounds).compile(),
                     lambda fn, s: fn(tp, dp, s, rows, starts, r), whole),
    }
    states = {name: c[2] for name, c in calls.items()}
    ms = {name: [] for name in calls}
    for i in range(args.pairs + 1):  # the first pair warms up
        for name in (list(calls) if i % 2 == 0 else list(calls)[::-1]):
            fn, call, _ = calls[name]
            state = jax.block_until_ready(timing.reset(states[name], args.prompt))
            t0 = time.perf_counter()
            states[name], _ = jax.block_until_ready(call(fn, state))
            if i:
                ms[name].append(1e3 * (time.perf_counter() - t0) / args.rounds)
    out = {"model": args.model, "method": args.method, "budget": args.budget if args.method == "ddtree" else None,
           "batch": n, "of": args.of, "prompt": args.prompt, "capacity": layout.capacity, "rounds": args.rounds,
           "pairs": args.pairs, "device": jax.devices()[0].device_kind, "date": records.now(),
           "cache_bytes_per_sequence": kv, "gathered_bytes_a_call": 4 * n * kv,  # rows read and written, out and back
           "median_ms_a_round": {k: statistics.median(v) for k, v in ms.items()}, "ms_a_round": ms}
    a, b = out["median_ms_a_round"]["in place"], out["median_ms_a_round"]["gathered"]
    print(f"{args.model} {args.method}, slot batch {n}: in place {a:.3f} ms a round, gathered out of {args.of} "
          f"{b:.3f} ({b / a:.2f}x); the gather and scatter move {4 * n * kv / 1e9:.2f} GB a call of {args.rounds} "
          f"rounds (caches of {layout.capacity} slots)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
