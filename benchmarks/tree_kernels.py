"""The tree build's Pallas kernels against XLA's forms, on random Qwen3-vocabulary draft logits [B, 15, 151936]:
exactness first (the kernels' top-k against ``lax.top_k``, f32 and bf16 logits; the ancestor bits and whole trees
against the XLA forms), then microseconds per call (``bench.timing.loop_us``: 16 distinct inputs in one jitted loop, the
loop's own cost, "empty_loop_us", included in every figure).

    PYTHONPATH=. python benchmarks/tree_kernels.py OUT.json [--budgets 64,256,512] [--batches 1] [--warps 4,8,16]
        [--parts topk,bits,lists,whole]

Parts: "topk" the vocabulary top-k, "bits" the ancestor bits, "lists" the tree from the sorted lists
(``tree.tree_from_lists``' depth scan: XLA's selections against the ``best_first`` kernel at each of ``--warps``),
"whole" the whole tree build (XLA's forms against the top-k and bits kernels, both with XLA's selection; with
"lists" also the build with all three kernels, the default at budgets up to ``tree.KERNEL_MAX_BUDGET``).
Results: docs/KERNELS.md.
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import tree as trees
from ddtree_jax.bench.timing import loop_us
from pallas_kernels import best_first as best_first_kernel, vocab_top_k

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
    p.add_argument("--parts", type=lambda s: s.split(","), default=["topk", "bits", "lists", "whole"],
                   help="what to time (default: topk,bits,lists,whole; see the module doc)")
    args = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    res = {"device": jax.devices()[0].device_kind, "vocab": args.vocab, "depths": DEPTHS, "iters": args.iters}
    for b in args.batches:
        xs = 3.0 * jax.random.normal(jax.random.key(11), (args.iters, b, DEPTHS, args.vocab), jnp.float32)
        res[f"b{b}_empty_loop_us"] = loop_us(lambda x: x[:, :, :1], xs)
        for budget in args.budgets:
            k, row = budget, {}
            chunk = trees.default_topk_chunk(k)
            if "topk" in args.parts:
                for dtype in (jnp.float32, jnp.bfloat16):
                    x = xs[0].astype(dtype)
                    want = jax.lax.top_k(x.astype(jnp.float32), k)
                    got = jax.jit(trees.top_k_by_kernel, static_argnums=1)(x, k)
                    row[f"top_k_exact_{jnp.dtype(dtype).name}"] = all(
                        np.array_equal(np.asarray(g), np.asarray(w)) for g, w in zip(got, want))
                row["top_log_probs_xla_us"] = loop_us(lambda x, c=chunk: trees.top_log_probs(x, k, c), xs)
                row["top_log_probs_kernel_us"] = loop_us(lambda x: trees.top_log_probs(x, k, "kernel"), xs)
                for w in args.warps:
                    row[f"top_k_warps{w}_us"] = loop_us(
                        lambda x, w=w: vocab_top_k.top_k(x, k, warps=w, interpret=not gpu), xs)
            if "bits" in args.parts:
                par = jax.jit(jax.vmap(lambda x: trees.best_first(x, budget, chunk=chunk, bits="xla").parents))(xs)
                bits = {h: jax.jit(trees.ancestor_bits, static_argnums=(1, 2))(par[0], DEPTHS, h) for h in trees.BITS}
                row["ancestor_bits_equal"] = bool(np.array_equal(np.asarray(bits["xla"]), np.asarray(bits["kernel"])))
                for h in trees.BITS:
                    row[f"ancestor_bits_{h}_us"] = loop_us(lambda p, h=h: trees.ancestor_bits(p, DEPTHS, h), par)
            select = trees.default_select(budget, b)
            xla_select = "count" if select == "kernel" else select  # XLA's selection where the kernel is the default
            if "lists" in args.parts:  # the depth scan from the sorted lists, without the ancestor bits
                lists = jax.jit(jax.vmap(lambda x: trees.top_log_probs(x, k, chunk)))(xs)
                one = lambda lp_, ids_: trees._best_first_one(lp_, ids_, budget, True, xla_select)  # noqa: E731
                xla = jax.jit(jax.vmap(one))
                want = xla(lists[0][1], lists[1][1])
                row["lists_xla_select"] = xla_select
                row["lists_xla_us"] = loop_us(lambda li: xla(*li), lists)
                for w in args.warps:
                    kern = jax.jit(lambda lp, ids, w=w: best_first_kernel.best_first(lp, ids, budget, warps=w,
                                                                                     interpret=not gpu))
                    got = kern(lists[0][1], lists[1][1])
                    row[f"lists_kernel_warps{w}_equal"] = all(np.array_equal(np.asarray(g), np.asarray(x))
                                                             for g, x in zip(got, want))
                    row[f"lists_kernel_warps{w}_us"] = loop_us(lambda li, kern=kern: kern(*li), lists)
            if "whole" in args.parts:
                forms = {
                    "xla": lambda x: trees.best_first(x, budget, chunk=chunk, bits="xla", select=xla_select),
                    "kernels": lambda x: trees.best_first(x, budget, chunk="kernel", bits="kernel", select=xla_select),
                }
                if "lists" in args.parts:
                    forms["kernels_best_first"] = lambda x: trees.best_first(x, budget, chunk="kernel", bits="kernel",
                                                                             select="kernel")
                built = {name: jax.jit(f)(xs[1]) for name, f in forms.items()}
                for name in list(built)[1:]:
                    row["trees_equal" if name == "kernels" else f"trees_equal_{name}"] = bool(all(
                        np.array_equal(np.asarray(getattr(built["xla"], f)), np.asarray(getattr(built[name], f)))
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
