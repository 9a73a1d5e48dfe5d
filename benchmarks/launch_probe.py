"""What a dependent step costs between the programs of a GPU: a chain of N trivial Pallas (Triton) kernels in one
jit (a kernel boundary per step) against one persistent kernel whose programs meet at an atomic grid barrier N times.
Each step, every program reads what all programs wrote in the step before (so the steps really depend on each
other) and writes its own slice; the result is checked against numpy.

    PYTHONPATH=. python benchmarks/launch_probe.py OUT.json [--programs 32,64] [--steps 1,16,64]

Microseconds per step = the slope of a call's time over N (median of 20 calls each, after a warm-up). The barrier:
each program's threads store, a block barrier, one atomic add (acq_rel, gpu scope) on a counter, then atomic reads
until every program has arrived; cross-program data is loaded volatile (not from the SM's L1; jax 0.11's Triton lowering refuses every cache modifier).
"""

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

W = 128  # entries per program


def _step_values(prev, g, n):
    """Program g's new slice from the whole previous array: sum of everything + g, wrapped to stay small."""
    return (jnp.max(prev) + g + 1.0) % 1000.0


def _chain_kernel(x_ref, o_ref, *, n, interpret):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    g = pl.program_id(0)
    prev = pltriton.load(x_ref.at[jnp.arange(n * W)])
    out = _step_values(prev, g, n) + jnp.zeros((W,), jnp.float32)
    pltriton.store(o_ref.at[g * W + jnp.arange(W)], out)


def chain(x, steps, interpret=False):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    n = x.shape[0] // W
    call = pl.pallas_call(functools.partial(_chain_kernel, n=n, interpret=interpret), grid=(n,),
                          out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32), interpret=interpret,
                          compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1), name="chain_step")
    for _ in range(steps):
        x = call(x)
    return x


def _persistent_kernel(x_ref, cnt_in, o_ref, buf_ref, cnt_ref, *, n, steps):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    del cnt_in
    g = pl.program_id(0)
    mine = g * W + jnp.arange(W)
    pltriton.store(buf_ref.at[0, mine], pltriton.load(x_ref.at[mine]))

    def barrier(k):
        pltriton.debug_barrier()
        pltriton.atomic_add(cnt_ref, 0, 1)
        target = n * k
        jax.lax.while_loop(lambda v: v < target, lambda v: pltriton.atomic_add(cnt_ref, 0, 0),
                           pltriton.atomic_add(cnt_ref, 0, 0))
        pltriton.debug_barrier()

    def step(s, carry):
        barrier(s + 1)
        src = jax.lax.bitwise_and(s, 1)
        dst = 1 - src
        prev = pltriton.load(buf_ref.at[src, jnp.arange(n * W)], volatile=True)
        pltriton.store(buf_ref.at[dst, mine], _step_values(prev, g, n) + jnp.zeros((W,), jnp.float32))
        return carry

    jax.lax.fori_loop(0, steps, step, 0)
    pltriton.store(o_ref.at[mine], pltriton.load(buf_ref.at[steps % 2, mine]))


def persistent(x, steps):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    n = x.shape[0] // W
    out, _, _ = pl.pallas_call(
        functools.partial(_persistent_kernel, n=n, steps=steps), grid=(n,),
        out_shape=(jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct((2, n * W), jnp.float32),
                   jax.ShapeDtypeStruct((1,), jnp.int32)),
        input_output_aliases={1: 2},
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1), name="persistent_steps",
    )(x, jnp.zeros((1,), jnp.int32))
    return out


def expected(x, steps):
    x = np.asarray(x, np.float32)
    n = x.shape[0] // W
    for _ in range(steps):
        m = x.max()
        x = np.repeat(((m + np.arange(n, dtype=np.float32) + 1.0) % 1000.0).astype(np.float32), W)
    return x


def time_us(f, x, reps=20):
    f(x).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(ts)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--programs", default="32,64,128")
    p.add_argument("--steps", default="1,16,64")
    args = p.parse_args(argv)
    steps = [int(s) for s in args.steps.split(",")]
    res = {"device": jax.devices()[0].device_kind}
    for n in [int(s) for s in args.programs.split(",")]:
        x = jax.random.uniform(jax.random.key(n), (n * W,), jnp.float32, 0, 100)
        for name, fn in (("chain", chain), ("persistent", persistent)):
            row = {}
            for s in steps:
                f = jax.jit(functools.partial(fn, steps=s))
                ok = bool(np.array_equal(np.asarray(f(x)), expected(x, s)))
                row[f"steps{s}_us"] = time_us(f, x)
                row[f"steps{s}_exact"] = ok
            lo, hi = min(steps), max(steps)
            row["us_per_step"] = (row[f"steps{hi}_us"] - row[f"steps{lo}_us"]) / (hi - lo)
            res[f"{name}_programs{n}"] = row
            print(name, n, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
