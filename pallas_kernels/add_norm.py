"""The residual add and the RMSNorm after it in one Pallas (Triton) kernel: (x + delta, rms_norm(x + delta) * w).

A transformer layer adds each branch's output to the f32 residual stream and normalises the sum for the next branch.
In an autoregressive step XLA makes that two kernels (a reduction for the mean square, then the scaled copy, each
recomputing the adds it needs) of about 4 µs together per norm (Qwen3-4B on an H200; benchmarks/PERF.md, seventeenth
run). Here one program per row reads x and delta, writes their sum and the normalised row.

Semantics (``reference``): s = x + delta (f32); h = round(w * (s * rsqrt(mean(s^2) + eps))) in w's dtype, as
``model.rms_norm``. The mean square is summed in another order than XLA's, so h can differ from XLA's in a last bit.

Shapes: x, delta [..., D] float32, w [D] -> (s [..., D] float32, h [..., D] in w's dtype). Or w every layer's weights
[L, D] with ``layer`` and ``prefix_len`` [B]: the kernel reads the layer index from the layer kernels' shared integer
operand (``pallas_kernels.lengths``) and that row of w in place. A layer's [D] row as an operand of its own is a slice
that XLA copies in a kernel of its own (the norm weights' slices were four kernels of 1.3-1.5 µs per iteration of the
4-layer loop in the eighteenth run's 4B AR profile; reading them in place took 0.06 ms off a 4B AR step).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.blocks import pow2
from pallas_kernels.lengths import lengths


def _kernel(x_ref, d_ref, w_ref, *refs, dim: int, eps: float, batch: int | None):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    r = pl.program_id(0)
    i = jnp.arange(pow2(dim), dtype=jnp.int32)
    ok = i < dim
    if batch is None:
        s_ref, h_ref = refs
        w = pltriton.load(w_ref.at[i], mask=ok, other=0).astype(jnp.float32)
    else:  # w_ref: [L, D], the layer in the lengths operand
        lens_ref, s_ref, h_ref = refs
        layer = pltriton.load(lens_ref.at[jnp.int32(batch)])
        w = pltriton.load(w_ref.at[layer, i], mask=ok, other=0).astype(jnp.float32)
    s = pltriton.load(x_ref.at[r, i], mask=ok, other=0) + pltriton.load(d_ref.at[r, i], mask=ok, other=0)
    y = s * jax.lax.rsqrt(jnp.sum(s * s) / dim + eps)
    pltriton.store(s_ref.at[r, i], s, mask=ok)
    pltriton.store(h_ref.at[r, i], (w * y).astype(h_ref.dtype), mask=ok)


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_norm(x, delta, w, layer=None, prefix_len=None, *, eps: float, interpret: bool = False):
    """(x + delta, its RMSNorm times w): see the module doc. ``layer`` and ``prefix_len`` with stacked w [L, D];
    ``interpret``: the Pallas interpreter (CPU)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    *lead, dim = x.shape
    stacked = layer is not None
    if (x.dtype != jnp.float32 or delta.dtype != jnp.float32 or delta.shape != x.shape
            or w.shape[-1:] != (dim,) or w.ndim != 1 + stacked or stacked != (prefix_len is not None)):
        raise ValueError(f"add_norm takes float32 x and delta of one shape and w [D] (or [L, D] with layer and "
                         f"prefix_len), got x {x.shape} {x.dtype}, delta {delta.shape} {delta.dtype}, w {w.shape}")
    rows = max(1, x.size // dim)
    warps = 4 if dim <= 4096 else 8
    extra = (lengths(prefix_len, layer),) if stacked else ()
    s, h = pl.pallas_call(
        functools.partial(_kernel, dim=dim, eps=eps, batch=prefix_len.shape[0] if stacked else None),
        grid=(rows,),
        out_shape=(jax.ShapeDtypeStruct((rows, dim), jnp.float32), jax.ShapeDtypeStruct((rows, dim), w.dtype)),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret,
        name="add_norm",
    )(x.reshape(rows, dim), delta.reshape(rows, dim), w, *extra)
    return s.reshape(x.shape), h.reshape(x.shape)


def reference(x, delta, w, *, eps: float):
    """The kernel's result by jnp (``model.rms_norm`` of the sum)."""
    s = x + delta
    y = s * jax.lax.rsqrt(jnp.mean(s * s, axis=-1, keepdims=True) + eps)
    return s, (w.astype(jnp.float32) * y).astype(w.dtype)
