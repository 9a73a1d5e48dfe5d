"""Same-process A/B of the tree build's Pallas kernels (the vocabulary top-k, the best_first depth scan and the
ancestor bits) against XLA's forms: ``python -m ddtree_jax.bench`` ARGS run once per variant in ORDER (default
kernels,xla,kernels,xla), each with its own --out directory under $OUT (default bench_ab) for ``models``. "kernels"
turns them on at every batch (without a mesh), "xla" off, "default" leaves ``tree.default_kernels`` as it is,
"xla-scan" is "default" with the depth scan in XLA (``tree.KERNEL_MAX_BUDGET`` = 0).

    PYTHONPATH=. python benchmarks/ab_tree_kernels.py models --models qwen3-8b --methods ddtree --budgets 64,256 \\
        --prompts 512 --batches 1 --no-breakdown --no-profile --no-hlo --no-tree-micro --repeats 5
    ORDER=kernels PYTHONPATH=. python benchmarks/ab_tree_kernels.py fixtures --prompts 2 --budgets 1,4,16,64 --batched
"""
import os
import sys

import jax

from ddtree_jax import bench, decode, sharding, tree

VARIANTS = {  # name: (tree.default_kernels, tree.KERNEL_MAX_BUDGET)
    "default": (tree.default_kernels, tree.KERNEL_MAX_BUDGET),
    "kernels": (lambda batch=1: tree._on_gpu() and sharding.active() is None, tree.KERNEL_MAX_BUDGET),
    "xla": (lambda batch=1: False, tree.KERNEL_MAX_BUDGET),
    "xla-scan": (tree.default_kernels, 0),
}
out = os.environ.get("OUT", "bench_ab")
for i, variant in enumerate(os.environ.get("ORDER", "kernels,xla,kernels,xla").split(",")):
    tree.default_kernels, tree.KERNEL_MAX_BUDGET = VARIANTS[variant]
    jax.clear_caches()
    decode._COMPILED.clear()
    print(f"== {variant} ({i})", flush=True)
    where = ["--out", os.path.join(out, f"{variant}{i}")] if sys.argv[1:2] == ["models"] else []
    bench.main([*sys.argv[1:], *where])
