"""Same-process A/B of the tree build's Pallas kernels (``tree.default_kernels``: the vocabulary top-k and the
ancestor bits) against XLA's forms: ``python -m ddtree_jax.bench`` ARGS run once per variant in ORDER (default
kernels,xla,kernels,xla), each with its own --out directory under $OUT (default bench_ab).

    PYTHONPATH=. python benchmarks/ab_tree_kernels.py models --models qwen3-8b --methods ddtree --budgets 64,256 \\
        --prompts 512 --batches 1 --no-breakdown --no-profile --no-hlo --no-tree-micro --repeats 5
"""
import os
import sys

import jax

from ddtree_jax import bench, decode, tree

kernels = tree.default_kernels
out = os.environ.get("OUT", "bench_ab")
for i, variant in enumerate(os.environ.get("ORDER", "kernels,xla,kernels,xla").split(",")):
    tree.default_kernels = kernels if variant == "kernels" else (lambda: False)
    jax.clear_caches()
    decode._COMPILED.clear()
    print(f"== {variant} ({i})", flush=True)
    bench.main([*sys.argv[1:], "--out", os.path.join(out, f"{variant}{i}")])
