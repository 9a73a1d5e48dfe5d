"""The merge of the attention kernels' split-K partials: ``merge_splits``, jnp written for XLA to fuse (used by
``tree_attention``), and ``merge_splits_kernel``, the same as one Pallas (Triton) kernel (used by ``decode_attention``;
its reference is ``merge_splits``).

Each split of a row's keys gives a partial: an accumulator (the exp-weighted values), its running max and, for
``decode_attention``, its running sum (``tree_attention`` stores a base-2 log-sum-exp instead, max and sum in one:
its sums are 1 and its weights exp2). The row's output is the partials weighted by exp(max_s - the largest max),
normalised.

Shapes: ``merge_splits`` acc [N, S, ..., hd], m, l [N, S, ...] -> [N, ..., hd]; ``merge_splits_kernel`` acc [S, N, g,
hd], m, l [S, N, g] -> [batch, 1, K x g, hd] (N = batch x K).
"""

from __future__ import annotations

import jax.numpy as jnp


def merge_splits(acc, m, l, exp=jnp.exp):
    """sum_s w_s acc_s / sum_s w_s l_s with w_s = exp(m_s - max_s m_s), over the static split axis 1 of acc [N, S,
    ..., hd] and m, l [N, S, ...] -> [N, ..., hd]. Written as one elementwise expression per split rather than as
    reductions over the axis, so that XLA can fuse it with what follows it (as reductions it took a kernel more).
    The sums run in split order."""
    top = m[:, 0]
    for s in range(1, m.shape[1]):
        top = jnp.maximum(top, m[:, s])
    num = den = None
    for s in range(m.shape[1]):
        w = exp(m[:, s] - top)
        num = w[..., None] * acc[:, s] if num is None else num + w[..., None] * acc[:, s]
        den = w * l[:, s] if den is None else den + w * l[:, s]
    return num / den[..., None]


def _merge_kernel(acc_ref, m_ref, l_ref, o_ref, *, splits: int, sp: int, kv: int, g: int, hd: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    n, r = pl.program_id(0), pl.program_id(1)  # (sequence x KV head, head of the group)
    s = jnp.arange(sp, dtype=jnp.int32)
    d = jnp.arange(hd, dtype=jnp.int32)
    real = s < splits
    m = pltriton.load(m_ref.at[s, n, r], mask=real, other=-jnp.inf)  # [sp]
    l = pltriton.load(l_ref.at[s, n, r], mask=real, other=0)
    acc = pltriton.load(acc_ref.at[s[:, None], n, r, d[None, :]], mask=real[:, None], other=0)  # [sp, hd]
    w = jnp.where(real, jnp.exp(m - jnp.max(m)), 0.0)  # a split that saw no key (max -inf, sum 0) weighs 0
    out = jnp.sum(w[:, None] * acc, axis=0) / jnp.sum(w * l)
    pltriton.store(o_ref.at[n // kv, 0, n % kv * g + r, d], out.astype(o_ref.dtype))


def merge_splits_kernel(acc, m, l, *, batch: int, dtype, interpret: bool = False):
    """``merge_splits`` as one Pallas (Triton) kernel that writes the attention's output: acc [S, N, g, hd], m and l
    [S, N, g] (f32, the split axis first as ``decode_attention`` writes them) for N = batch x KV heads and g query heads
    a KV head -> [batch, 1, KV heads x g, hd] in ``dtype``. A grid of N x g programs, each reading its row's S partials
    at once. Every row must have seen a key in some split (an AR step's row sees at least itself). On an H200 it is
    one kernel where XLA's fusion of ``merge_splits`` made two at 22 splits, about half the time
    (docs/KERNELS.md)."""
    import functools

    import jax
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    from pallas_kernels.blocks import pow2

    splits, n, g, hd = acc.shape
    kv = n // batch
    return pl.pallas_call(
        functools.partial(_merge_kernel, splits=splits, sp=pow2(splits), kv=kv, g=g, hd=hd),
        grid=(n, g),
        out_shape=jax.ShapeDtypeStruct((batch, 1, kv * g, hd), dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="split_merge",
    )(acc, m, l)
