"""The tree-build micro-benchmarks of ``bench models``: DDTree's best-first tree from random draft logits, whole
(each selection, with and without the kernels) and by parts (top log-probabilities, the tree from the sorted lists,
the ancestor bits), each timed as device microseconds per build (``timing.loop_us``)."""

from __future__ import annotations

import functools
from typing import Any, Callable

from ddtree_jax.bench.records import log
from ddtree_jax.bench.timing import loop_us


def tree_build(shape, dcfg, batches: list[int], budgets: list[int], iters: int, save: Callable[[dict], None]) -> dict:
    """Device time of the tree build (its parts, and variants that must give the same tree) from ``iters`` (K)
    distinct random draft logits inside one jitted fori_loop (static trip count): t / K, with the loop's own cost per
    iteration ('empty_loop') measured the same way. Every budget at the first batch, 256 (if asked) at the others;
    ``save(results)`` after each (results: {"b{batch}_budget{budget}": {measurement: value}})."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ddtree_jax import tree as trees

    dp_ = dcfg.block_size - 1
    res = {}
    for b in batches:
        xs = 3.0 * jax.random.normal(jax.random.key(11), (iters, b, dp_, shape.vocab), jnp.float32)
        for budget in budgets if b == batches[0] else [x for x in budgets if x == 256][:1]:
            kk = min(budget, shape.vocab)
            row: dict[str, Any] = {}
            row["empty_loop_us"] = loop_us(lambda x: x[:, :, :1], xs)
            variants = {  # the defaults (on GPU the kernels; an unrolled depth loop), each selection
                f"best_first_{sel}": lambda x, bb=budget, sel=sel: trees.best_first(x, bb, select=sel)
                for sel in trees.SELECTS
            }
            chunks = {"xla": trees.default_topk_chunk(kk), "kernel": "kernel"}
            variants["best_first_count_no_kernels"] = lambda x, bb=budget: trees.best_first(
                x, bb, select="count", chunk=chunks["xla"], bits="xla")
            for how, chunk in chunks.items():
                variants[f"part_top_log_probs_{how}"] = lambda x, kk=kk, c=chunk: trees.top_log_probs(x, kk, c)
            for name, fn in variants.items():
                row[name + "_us"] = loop_us(fn, xs)
            lp, ids = jax.jit(trees.top_log_probs, static_argnums=(1, 2))(xs, kk, chunks["xla"])
            for sel in trees.SELECTS:  # the tree from the sorted lists (with its ancestor bits)
                core = functools.partial(trees.tree_from_lists, budget=budget, select=sel)
                row[f"part_tree_from_lists_{sel}_us"] = loop_us(lambda p, c=core: c(p[0], p[1]), (lp, ids))
            par = jax.jit(jax.vmap(lambda x, bb=budget: trees.best_first(x, bb).parents))(xs)
            for how in trees.BITS:
                row[f"part_ancestor_bits_{how}_us"] = loop_us(lambda p, h=how: trees.ancestor_bits(p, dp_, h), par)
            same = [f"best_first_{sel}" for sel in trees.SELECTS] + ["best_first_count_no_kernels"]
            got = jax.jit(lambda x: [variants[name](x) for name in same])(xs[1])
            row["selects_equal"] = bool(all(
                np.array_equal(np.asarray(getattr(got[0], f)), np.asarray(getattr(other, f)))
                for other in got[1:] for f in ("tokens", "depths", "parents", "bits")))
            res[f"b{b}_budget{budget}"] = row
            log(f"  tree b{b} budget {budget}: " + ", ".join(
                f"{kk_}={v:.1f}" if isinstance(v, float) else f"{kk_}={v}" for kk_, v in row.items()))
            save(res)
        del xs
    return res
