"""The merge of split-K attention partials that ``decode_attention`` and ``tree_attention`` leave to XLA.

Each split of a row's keys gives a partial: an accumulator (the exp-weighted values), its running max and, for
``decode_attention``, its running sum (``tree_attention`` stores a base-2 log-sum-exp instead, max and sum in one:
its sums are 1 and its weights exp2). The row's output is the partials weighted by exp(max_s - the largest max),
normalised.
"""

from __future__ import annotations

import jax.numpy as jnp


def merge_splits(acc, m, l, exp=jnp.exp):
    """sum_s w_s acc_s / sum_s w_s l_s with w_s = exp(m_s - max_s m_s), over the static split axis 1 of acc [N, S,
    ...] and m, l [N, S, ...], written as one elementwise expression per split rather than as reductions over the
    axis, so that XLA makes it one kernel with what follows it (with reductions it was two: H200, twenty-eighth run,
    Qwen3-4B AR at prompt 2k 0.032 ms a token shorter, Qwen3-8B ddtree-64 rounds 0.064 ms; nothing slower). The sums
    run in split order."""
    top = m[:, 0]
    for s in range(1, m.shape[1]):
        top = jnp.maximum(top, m[:, s])
    num = den = None
    for s in range(m.shape[1]):
        w = exp(m[:, s] - top)
        num = w[..., None] * acc[:, s] if num is None else num + w[..., None] * acc[:, s]
        den = w * l[:, s] if den is None else den + w * l[:, s]
    return num / den[..., None]
