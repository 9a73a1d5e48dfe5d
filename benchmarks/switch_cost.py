"""Where --tree-budget auto chooses a round's form: on the host between groups of rounds, or on the device per round.

The engine and ``decode.generate`` choose on the host: each form (AR step, chain, tree of b nodes) is its own compiled
group of rounds, chosen from the statistics of the groups read so far. The alternative keeps one program whose
round body is a ``lax.switch`` over every form's round, the branch index read from the state each round. This times,
on one random-weight model shape, slot batch and context:

    plain    ``decode.run_rounds`` of one form (the host's way: one program per form)
    switch   the same rounds in a ``lax.while_loop`` whose body is ``lax.switch(index, [round of each form])`` with the
             index (a device value) selecting that form every round

as ms per round (median of --repeats calls of --rounds rounds each, every call from the same prefix) and the compile
seconds of each program. XLA's GPU runtime runs a conditional by reading its predicate on the host (a device-to-host
copy and a wait every round), and the switch's program holds every branch. Writes OUT/switch_cost.json.

    PYTHONPATH=. python benchmarks/switch_cost.py OUT                          # H200: random:qwen3-8b, batch 1
    PYTHONPATH=. python benchmarks/switch_cost.py OUT --shape tiny --forms ar,chain,8 --form 8   # CPU rehearsal
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="output directory (created)")
    p.add_argument("--shape", default="qwen3-8b", help="a shape of ddtree_jax.shapes.SHAPES (default: %(default)s)")
    p.add_argument("--forms", default="ar,chain,16,64,256", help="the switch's branches (default: %(default)s)")
    p.add_argument("--form", default="64", help="the form both programs run (default: %(default)s)")
    p.add_argument("--batch", type=int, default=1, help="slot batch (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=512, help="context length (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=16, help="rounds per call (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=7, help="timed calls of each program (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", help="(default: %(default)s)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp

    from ddtree_jax import decode, policy, shapes
    from ddtree_jax.bench import timing
    from ddtree_jax.round import round_step
    from ddtree_jax.spec import GenerateOptions, make_spec, round_up
    from ddtree_jax.weight_layout import device_layout, layout_method

    forms = policy.parse_forms(args.forms.split(","))
    if args.form not in forms:
        print(f"error: --form {args.form} is not among --forms {args.forms}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    tcfg, dcfg = shapes.model_configs(shapes.SHAPES[args.shape])
    dtype = jnp.dtype(args.dtype)
    tparams, dparams = shapes.build_params(tcfg, dcfg, dtype)
    opts = GenerateOptions(method="ddtree", forms=forms, max_new_tokens=args.rounds * dcfg.block_size)
    base = make_spec(tcfg, dcfg, opts, batch=args.batch)
    tparams = device_layout(tparams, method=layout_method(opts))
    dparams = device_layout(dparams)
    specs = [base.with_form(f, args.batch) for f in forms]
    index = forms.index(args.form)
    capacity = round_up(args.prompt_len + opts.max_new_tokens + base.scratch_slots, 64)
    out_len = round_up(args.prompt_len + opts.max_new_tokens + base.path_len + 1, 64)
    state = timing.make_state(base, tcfg.vocab_size, args.batch, args.prompt_len, capacity, out_len, dtype)

    @jax.jit
    def switch_rounds(target, drafter, state, which, n):
        branches = [lambda t, d, s, sp=sp: round_step(sp, t, d, s) for sp in specs]

        def body(carry):
            s, i = carry
            return jax.lax.switch(which, branches, target, drafter, s), i + 1

        return jax.lax.while_loop(lambda c: jnp.any(~c[0].done) & (c[1] < n), body, (state, jnp.int32(0)))[0]

    n = jnp.int32(args.rounds)
    record = {"shape": args.shape, "batch": args.batch, "prompt_len": args.prompt_len, "forms": list(forms),
              "form": args.form, "rounds_per_call": args.rounds, "device": jax.devices()[0].device_kind,
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": " ".join(sys.argv)}
    which = jnp.int32(index)
    programs = {  # (compiled program, how to call it on a state)
        "plain": (timing.aot(decode.run_rounds, specs[index], tparams, dparams, state, n),
                  lambda exe, s: exe(tparams, dparams, s, n)),
        "switch": (timing.aot(switch_rounds, tparams, dparams, state, which, n),
                   lambda exe, s: exe(tparams, dparams, s, which, n)),
    }
    for name, ((exe, seconds), call) in programs.items():
        times = []
        for _ in range(args.repeats + 1):  # the first call untimed
            state = jax.block_until_ready(timing.reset(state, args.prompt_len))
            t0 = time.perf_counter()
            state = jax.block_until_ready(call(exe, state))
            ran = int(jnp.max(state.n_rounds))
            times.append((time.perf_counter() - t0) / ran * 1e3)
        record[name] = {"ms_per_round": statistics.median(times[1:]), "compile_s": seconds, "rounds_per_call": ran}
        print(f"{name}: {record[name]['ms_per_round']:.3f} ms a round ({args.form} at batch {args.batch}, "
              f"{args.shape}), compiled in {seconds:.1f}s", file=sys.stderr)
    record["switch_over_plain"] = record["switch"]["ms_per_round"] / record["plain"]["ms_per_round"]
    with open(os.path.join(args.out, "switch_cost.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
