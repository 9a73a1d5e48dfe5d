"""The tree build's Pallas kernels against XLA's forms, on random Qwen3-vocabulary draft logits [B, 15, 151936]:
exactness first (the kernels' top-k against ``lax.top_k``, f32 and bf16 logits; the ancestor bits and whole trees
against the XLA forms), then microseconds per call (``bench.loop_us``: 16 distinct inputs in one jitted loop, the
loop's own cost, "empty_loop_us", included in every figure).

    PYTHONPATH=. python benchmarks/tree_kernels.py OUT.json [--budgets 64,256,512] [--batches 1] [--warps 4,8,16]

Results: benchmarks/PERF.md (thirteenth run), benchmarks/results/h200_details.json.
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import tree as trees
from ddtree_jax.bench import loop_us
from pallas_kernels import vocab_top_k

DEPTHS = 15


def _ints(s):
    return [int(x) for x in s.split(",")]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="JSON file for the results")
    p.add_argument("--budgets", type=_ints, default=[64, 256, 512], help="tree budgets (k = budget)")
    p.add_argument("--batches", type=_ints, default=[1], help="sequences per tree build")
    p.add_argument("--warps", type=_ints, default=[4, 8, 16], help="warps of the selection kernels to time")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary size (default: Qwen3's)")
    p.add_argument("--iters", type=int, default=16, help="distinct inputs per timed loop (default: 16)")
    args = p.parse_args(argv)
    res = {"device": jax.devices()[0].device_kind, "vocab": args.vocab, "depths": DEPTHS, "iters": args.iters}
    for b in args.batches:
        xs = 3.0 * jax.random.normal(jax.random.key(11), (args.iters, b, DEPTHS, args.vocab), jnp.float32)
        res[f"b{b}_empty_loop_us"] = loop_us(lambda x: x[:, :, :1], xs)
        for budget in args.budgets:
            k, row = budget, {}
            for dtype in (jnp.float32, jnp.bfloat16):
                x = xs[0].astype(dtype)
                want = jax.lax.top_k(x.astype(jnp.float32), k)
                got = jax.jit(trees.top_k_by_kernel, static_argnums=1)(x, k)
                row[f"top_k_exact_{jnp.dtype(dtype).name}"] = all(
                    np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want))
            chunk = trees.default_topk_chunk(k)
            row["top_log_probs_xla_us"] = loop_us(lambda x, c=chunk: trees.top_log_probs(x, k, c), xs)
            row["top_log_probs_kernel_us"] = loop_us(lambda x: trees.top_log_probs(x, k, "kernel"), xs)
            for w in args.warps:
                row[f"top_k_warps{w}_us"] = loop_us(lambda x, w=w: vocab_top_k.top_k(
                    x, k, warps=w, interpret=jax.default_backend() != "gpu"), xs)
            par = jax.jit(jax.vmap(lambda x: trees.best_first(x, budget, chunk=chunk, bits="xla").parents))(xs)
            bits = {h: jax.jit(trees.ancestor_bits, static_argnums=(1, 2))(par[0], DEPTHS, h) for h in trees.BITS}
            row["ancestor_bits_equal"] = bool(np.array_equal(np.asarray(bits["xla"]), np.asarray(bits["kernel"])))
            for h in trees.BITS:
                row[f"ancestor_bits_{h}_us"] = loop_us(lambda p, h=h: trees.ancestor_bits(p, DEPTHS, h), par)
            select = trees.default_select(budget, b)
            forms = {
                "xla": lambda x: trees.best_first(x, budget, chunk=chunk, bits="xla", select=select),
                "kernels": lambda x: trees.best_first(x, budget, chunk="kernel", bits="kernel", select=select),
            }
            built = {name: jax.jit(f)(xs[1]) for name, f in forms.items()}
            row["trees_equal"] = bool(all(np.array_equal(np.asarray(getattr(built["xla"], f)),
                                                         np.asarray(getattr(built["kernels"], f)))
                                          for f in ("tokens", "depths", "parents", "bits")))
            for name, f in forms.items():
                row[f"best_first_{name}_us"] = loop_us(f, xs)
            res[f"b{b}_budget{budget}"] = row
            print(f"b{b} budget {budget}: " + ", ".join(
                f"{n}={v:.1f}" if isinstance(v, float) else f"{n}={v}" for n, v in row.items()), flush=True)
        del xs
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
