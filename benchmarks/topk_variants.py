"""The vocabulary top-k of the tree build, variants of ``tree.top_k_chunked`` (chunk levels x selection), on
[1, 15, 151936] f32 draft logits (Qwen3's vocabulary, 15 depths): microseconds per call of the top-k plus the
log-softmax normaliser (``tree.top_log_probs``), 16 calls in one jitted loop, median of 5 timings
(``bench.loop_us``); the loop alone is "empty_loop_us". Each variant is first checked equal to ``lax.top_k``
(values and ids).

Usage (GPU): PYTHONPATH=. python benchmarks/topk_variants.py OUT.json
Results of the eighth run: benchmarks/results/h200_details.json (run_2026-11-30T01:38_eighth), PERF.md.
"""

import json
import sys

import jax
import jax.numpy as jnp

from ddtree_jax import tree as trees
from ddtree_jax.bench import loop_us

ITERS = 16
CHUNKS = (32, (32, 4), (64, 8), (128, 16, 2))


def main(path: str, vocab: int = 151936) -> None:
    xs = 3.0 * jax.random.normal(jax.random.key(11), (ITERS, 1, 15, vocab), jnp.float32)
    out = {"empty_loop_us": loop_us(lambda x: x[:, :, :1], xs)}
    for k in (64, 256, 512):
        want = jax.jit(lambda x, k=k: jax.lax.top_k(x, k))(xs[0])
        for chunk in CHUNKS:
            for select in trees.SELECTS:
                name = f"k{k}_chunk{chunk}_{select}".replace(" ", "")
                fn = jax.jit(lambda x, k=k, chunk=chunk, select=select: trees.top_log_probs(
                    x, k, chunk, trees._selector(select)))
                got = fn(xs[0])
                exact = bool(jnp.array_equal(want[1], got[1])) and bool(
                    jnp.array_equal(want[0] - jax.nn.logsumexp(xs[0], axis=-1, keepdims=True), got[0]))
                out[name] = {"us": loop_us(fn, xs), "exact": exact}
                print(f"{name}: {out[name]['us']:.1f} us, exact {exact}", flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "topk_variants.json")
