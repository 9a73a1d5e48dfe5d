"""The vocabulary top-k of the tree build: variants of tree.top_k_chunked (chunk levels x selection) on [1, 15, 151936]
f32 draft logits; microseconds per top_log_probs call (16 calls in one jitted loop, median of 5; the loop alone: "empty_loop_us").
Usage (GPU): PYTHONPATH=. python benchmarks/topk_variants.py OUT.json. Eighth run: benchmarks/PERF.md."""
import functools, json, statistics, sys, time
import jax, jax.numpy as jnp, numpy as np
from ddtree_jax import tree as trees

ITERS = 16
xs = 3.0 * jax.random.normal(jax.random.key(11), (ITERS, 1, 15, 151936), jnp.float32)

def loop_us(fn):
    def body(i, acc):
        leaves = jax.tree.leaves(fn(xs[i]))
        return acc + sum(x.reshape(-1)[-1].astype(jnp.int32) for x in leaves)
    f = jax.jit(lambda: jax.lax.fori_loop(0, ITERS, body, jnp.int32(0)))
    f().block_until_ready()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter(); f().block_until_ready(); ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(ts) / ITERS

out = {}
empty = loop_us(lambda x: x[:, :, :1])
out["empty_loop_us"] = empty
for k in (64, 256, 512):
    want = jax.jit(lambda x: jax.lax.top_k(x, k))(xs[0])
    for chunk in (32, (32, 4), (64, 8), (128, 16, 2)):
        for sel in ("sort", "count"):
            name = f"k{k}_chunk{chunk}_{sel}".replace(" ", "")
            try:
                got = jax.jit(lambda x: trees.top_k_chunked(x, k, chunk, trees._selector(sel)))(xs[0])
                exact = all(bool(jnp.array_equal(a, b)) for a, b in zip(want, got))
                us = loop_us(lambda x: trees.top_log_probs(x, k, chunk, sel))
                out[name] = {"us": us, "exact": exact}
                print(f"{name}: {us:.1f} us, exact {exact}", flush=True)
            except Exception as e:
                out[name] = {"error": repr(e)[:300]}
                print(name, "error", repr(e)[:200], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
