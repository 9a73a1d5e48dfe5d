"""End-to-end: DDTree greedy decoding with the Pallas kernels (verify attention + tree walk) gives the same
tokens as the XLA path, on a random bf16 model whose heads the kernel supports (head_dim 64).

    PYTHONPATH=. python benchmarks/check_kernels_e2e.py [--attention pallas] [--budget auto]   # CPU: interpret
Prints one JSON line: tokens compared, tokens equal, first difference.
"""

import argparse
import json

import jax
import jax.numpy as jnp

from ddtree_jax import cli, decode, shapes
from ddtree_jax.spec import GenerateOptions


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--attention", default="pallas")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--budget", type=cli.tree_budget, default=16, help="a tree budget, or auto (AR steps with the "
                   "drafter's taps, chains and trees built large and cut: --tree-budget auto's rounds)")
    a = p.parse_args()
    tcfg, dcfg = shapes.model_configs(shapes.SHAPES["tiny"])
    tp, dp = shapes.build_params(tcfg, dcfg, jnp.bfloat16)
    tp = jax.tree.map(lambda x: x * 4 if x.ndim == 2 and x.shape[-1] == tcfg.vocab_size else x, tp)  # sharper
    prompts = [[(7 * i + 3) % tcfg.vocab_size for i in range(n)] for n in (5, 37, 130)]
    out = {}
    for attention in ("xla", a.attention):
        opts = GenerateOptions(method="ddtree", tree_budget=a.budget, max_new_tokens=a.tokens, attention=attention)
        res = decode.generate((tcfg, tp), prompts, opts, draft=(dcfg, dp))
        out[attention] = res.output_ids
    pairs = [(x, y) for r1, r2 in zip(out["xla"], out[a.attention]) for x, y in zip(r1, r2)]
    first = next((i for i, (x, y) in enumerate(pairs) if x != y), None)
    print(json.dumps({"backend": jax.default_backend(), "attention": a.attention, "compared": len(pairs),
                      "equal": sum(x == y for x, y in pairs), "first_difference": first}))


if __name__ == "__main__":
    main()
