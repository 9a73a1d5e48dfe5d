"""The residual add and the RMSNorm after it in one Pallas (Triton) kernel: (x + delta, rms_norm(x + delta) * w).

A transformer layer adds each branch's output to the f32 residual stream and normalises the sum for the next branch;
XLA makes that two kernels (a reduction for the mean square, then the scaled copy). Here one program per row reads x
and delta and writes their sum and the normalised row. Used by ``ddtree_jax.model.residual_norm`` in the target's layer
loop (``model.forward``) with 'pallas-inplace' attention.

Semantics (``reference``): s = x + delta (f32); h = round(w * (s * rsqrt(mean(s^2) + eps))) in w's dtype, as
``model.rms_norm``. The mean square is summed in another order than XLA's, so h can differ from XLA's in a last bit.

Shapes: x, delta [..., D] float32, w [D] -> (s [..., D] float32, h [..., D] in w's dtype). Or w every layer's weights
[L, D] with ``layer`` and ``prefix_len`` [B]: the kernel reads the layer index from the layer kernels' shared integer
operand (``pallas_kernels.lengths``) and that row of w in place (a [D] row as an operand of its own is a slice XLA
copies in a kernel of its own).

delta may also come as partial sums [P, ..., D] of a product split over its contraction (``model.product_splits``:
cuBLAS reads some layer products faster so): the kernel adds them up, in order, before the residual
(s = x + (d_0 + d_1 + ...)).

With those, ``tap`` = (taps [S, ..., D], slots [L] int32) also writes s, cast to taps' dtype, into taps[slots[layer]]
in place and returns the taps third: the target's layer loop records the hidden states its drafter reads this way (a
layer's output is the sum its next layer's first norm makes), sparing an update kernel per layer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.blocks import pow2
from pallas_kernels.lengths import lengths


def _kernel(x_ref, d_ref, w_ref, *refs, dim: int, eps: float, batch: int | None, tap: bool, parts: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    r = pl.program_id(0)
    i = jnp.arange(pow2(dim), dtype=jnp.int32)
    ok = i < dim
    d = pltriton.load(d_ref.at[0, r, i], mask=ok, other=0)
    for p in range(1, parts):  # a split product's partial sums, added in order
        d = d + pltriton.load(d_ref.at[p, r, i], mask=ok, other=0)
    s = pltriton.load(x_ref.at[r, i], mask=ok, other=0) + d
    if batch is None:
        s_ref, h_ref = refs
        w = pltriton.load(w_ref.at[i], mask=ok, other=0).astype(jnp.float32)
    else:  # w_ref: [L, D], the layer in the lengths operand
        lens_ref, *refs = refs
        layer = pltriton.load(lens_ref.at[jnp.int32(batch)])
        w = pltriton.load(w_ref.at[layer, i], mask=ok, other=0).astype(jnp.float32)
        if tap:  # taps_ref (the input) and out_ref are one buffer [S, rows, D]
            slots_ref, _, s_ref, h_ref, out_ref = refs
            slot = pltriton.load(slots_ref.at[layer])
            pltriton.store(out_ref.at[slot, r, i], s.astype(out_ref.dtype), mask=ok)
        else:
            s_ref, h_ref = refs
    y = s * jax.lax.rsqrt(jnp.sum(s * s) / dim + eps)
    pltriton.store(s_ref.at[r, i], s, mask=ok)
    pltriton.store(h_ref.at[r, i], (w * y).astype(h_ref.dtype), mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_norm(x, delta, w, layer=None, prefix_len=None, *, eps: float, tap=None, interpret: bool = False):
    """(x + delta, its RMSNorm times w): see the module doc. delta: [*x.shape] or partial sums [P, *x.shape].
    ``layer`` and ``prefix_len`` with stacked w [L, D]; ``tap`` (taps [S, *x.shape], slots [L] int32) with them: the
    taps with the sum written at slots[layer] are returned third. ``interpret``: the Pallas interpreter (CPU)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    *lead, dim = x.shape
    stacked = layer is not None
    parts = delta.shape[0] if delta.ndim == x.ndim + 1 else 1
    if (x.dtype != jnp.float32 or delta.dtype != jnp.float32 or delta.shape[delta.ndim - x.ndim:] != x.shape
            or delta.ndim > x.ndim + 1 or w.shape[-1:] != (dim,) or w.ndim != 1 + stacked
            or stacked != (prefix_len is not None)):
        raise ValueError(f"add_norm takes float32 x and delta of its shape (or [P, *x.shape]) and w [D] (or [L, D] "
                         f"with layer and prefix_len), got x {x.shape} {x.dtype}, delta {delta.shape} {delta.dtype}, "
                         f"w {w.shape}")
    if tap is not None and (not stacked or tap[0].shape[1:] != x.shape or tap[1].shape != w.shape[:1]
                            or tap[1].dtype != jnp.int32):
        raise ValueError(f"add_norm's tap takes stacked w [L, D], taps [S, *{x.shape}] and int32 slots [L], got "
                         f"taps {tap[0].shape} and slots {tap[1].shape} {tap[1].dtype} with w {w.shape}")
    rows = max(1, x.size // dim)
    warps = 4 if dim <= 4096 else 8
    extra = (lengths(prefix_len, layer),) if stacked else ()
    out_shape = [jax.ShapeDtypeStruct((rows, dim), jnp.float32), jax.ShapeDtypeStruct((rows, dim), w.dtype)]
    if tap is not None:
        taps, slots = tap
        taps = taps.reshape(taps.shape[0], rows, dim)
        extra += (slots, taps)
        out_shape.append(jax.ShapeDtypeStruct(taps.shape, taps.dtype))
    out = pl.pallas_call(
        functools.partial(_kernel, dim=dim, eps=eps, batch=prefix_len.shape[0] if stacked else None,
                          tap=tap is not None, parts=parts),
        grid=(rows,),
        out_shape=tuple(out_shape),
        input_output_aliases={5: 2} if tap is not None else {},
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret,
        name="add_norm",
    )(x.reshape(rows, dim), delta.reshape(parts, rows, dim), w, *extra)
    s, h = out[0].reshape(x.shape), out[1].reshape(x.shape)
    return (s, h) if tap is None else (s, h, out[2].reshape(tap[0].shape))


def reference(x, delta, w, *, eps: float):
    """The kernel's result by jnp (``model.rms_norm`` of the sum; without ``tap``, whose write is
    ``jax.lax.dynamic_update_index_in_dim(taps, s.astype(taps.dtype), slots[layer], 0)``)."""
    s = x + sum_parts(delta, x.ndim)
    y = s * jax.lax.rsqrt(jnp.mean(s * s, axis=-1, keepdims=True) + eps)
    return s, (w.astype(jnp.float32) * y).astype(w.dtype)


def sum_parts(delta, ndim: int):
    """delta [..., D] of ``ndim`` axes as given; partial sums [P, ..., D] added up in order (the kernel's order)."""
    if delta.ndim == ndim:
        return delta
    out = delta[0]
    for p in range(1, delta.shape[0]):
        out = out + delta[p]
    return out
