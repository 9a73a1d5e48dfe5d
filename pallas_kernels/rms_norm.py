"""Residual add + RMSNorm in one Pallas kernel (the Triton lowering): one GPU kernel where XLA makes four to six.

A decoder layer starts each half with ``x = x + delta; h = rms_norm(x)``. XLA on an H200 compiles that, for one
row, into a grid-1 reduction, two grid-1 elementwise kernels and the normalising convert, plus the add: each
about 1.3 us, mostly launch (benchmarks/PERF.md). Here one program per row loads the row's x and delta, writes
their sum (f32) and its normalised form (the weight's dtype), keeping the row in registers in between.

Rows longer than 4096 or not a power of two are processed in power-of-two chunks (the Triton lowering loads
and stores power-of-two shapes only): 2560 (Qwen3-4B) is five chunks of 512. Same math as ``model.rms_norm``
(f32; ``w * (s * rsqrt(mean(s^2) + eps))`` rounded once); the sum of squares is added in another order, so
results can differ from XLA's in the last bit.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

MAX_CHUNK = 4096


def chunk_size(d: int) -> int:
    """The largest power of two dividing ``d``, at most ``MAX_CHUNK``."""
    return min(d & -d, MAX_CHUNK)


def supports(d: int) -> bool:
    """Rows the kernel takes: chunks of at least 32 and at most 16 of them (the row stays in registers)."""
    c = chunk_size(d)
    return c >= 32 and d // c <= 16


@functools.partial(jax.jit, static_argnames=("eps", "interpret"))
def add_rms_norm(x: jax.Array, delta: jax.Array, w: jax.Array, eps: float, *, interpret: bool = False):
    """x, delta [..., D] f32; w [D] -> (s = x + delta [..., D] f32, rms_norm(s) * w [..., D] in w.dtype)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    *lead, d = x.shape
    if not supports(d):
        raise ValueError(f"add_rms_norm: hidden size {d} not supported (power-of-two chunks of 32 to 4096)")
    rows = math.prod(lead)
    c = chunk_size(d)
    n = d // c

    def kernel(x_ref, d_ref, w_ref, s_ref, h_ref):
        i = pl.program_id(0)
        parts, acc = [], jnp.zeros((c,), jnp.float32)
        for j in range(n):
            cols = pl.ds(j * c, c)
            s = x_ref[i, cols] + d_ref[i, cols]
            s_ref[i, cols] = s
            parts.append(s)
            acc = acc + s * s
        r = jax.lax.rsqrt(jnp.sum(acc) / d + eps)
        for j, s in enumerate(parts):
            cols = pl.ds(j * c, c)
            h_ref[i, cols] = (w_ref[cols].astype(jnp.float32) * (s * r)).astype(h_ref.dtype)

    s, h = pl.pallas_call(
        kernel,
        grid=(rows,),
        out_shape=(jax.ShapeDtypeStruct((rows, d), jnp.float32), jax.ShapeDtypeStruct((rows, d), w.dtype)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(x.reshape(rows, d).astype(jnp.float32), delta.reshape(rows, d).astype(jnp.float32), w)
    return s.reshape(*lead, d), h.reshape(*lead, d)
