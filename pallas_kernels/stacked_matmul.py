"""A few rows times one layer of stacked output-major weights, the layer read in place (Pallas, Mosaic GPU).

    y[r, n] = sum_k x[r, k] * w[layer, n, k]        x [R, K], w [L, N, K] 16-bit floats; layer an int32 scalar
                                                     (may be traced)  ->  y [R, N], f32 accumulation

The verify's projections (R = the tree's rows, 72 at budget 64), the drafter's (R = 16) and batched AR steps
(R = the batch) are such products: a weight read far larger than the rows, so their speed is the weights' read
bandwidth. XLA's cuBLAS GEMMs read a 72-row layer of Qwen3-8B at 2.5-3.8 TB/s against 4.0 for one row as a
reduction (benchmarks/PERF.md, eighth and fifteenth runs), and a custom call given ``w[layer]`` gets a copy of the
slice; here the kernel takes the whole stack and the layer's row offset, so nothing is copied.

**Not used by the decoder**: on an H200 it is exact but not faster than cuBLAS (fifteenth run, ``python -m
pallas_kernels.bench_kernels --stages matmul``: faster in 3 of 24 shapes x rows, by at most 10%; 2 µs of a 117 µs
Qwen3-8B layer at 72 rows). Each CTA's step is a serial chain (wait for the tiles, wgmma, release the slot) that
streams ~30-50 GB/s, so the kernel needs every SM busy to approach HBM speed, and the layer shapes do not divide
into the SMs evenly (benchmarks/KERNELS.md). Kept as the measured starting point for that lever.

Schedule. The output features are cut into tiles of 64 x ``wgs`` (one compute warpgroup per 64: the wgmma M, the
weights as its A operand in SMEM) and, with ``splits`` > 1, the reduction axis into shares; (tile, share) items are
dealt round-robin to ``ctas`` persistent CTAs (default: as many as fit on the SMs). In each CTA one memory
warpgroup streams [64 wgs, bk] weight tiles and the matching [R, bk] row tiles by TMA through a ring of ``stages``
SMEM slots, running ahead across items; each compute warpgroup accumulates its [64, R] block of y^T (R is the wgmma
N: a multiple of 8 up to 256), one product in flight, and stores it. Split shares are f32 partials the wrapper sums.

Interpret mode (CPU) runs the same program in the Mosaic GPU interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_BM = 64  # output features per compute warpgroup (the wgmma M)
_NUM_SMS = 132  # H100 / H200


def supports(rows: int, n: int, k: int, dtype) -> bool:
    """Whether the kernel takes x [rows, k] against w [L, n, k] of ``dtype``."""
    return (0 < rows <= 256 and rows % 8 == 0 and n % _BM == 0 and k % 64 == 0
            and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)))


def _smem_bytes(rows: int, wgs: int, bk: int, stages: int, itemsize: int = 2) -> int:
    return stages * (rows + _BM * wgs) * bk * itemsize + wgs * _BM * rows * 4


_SMEM = 220_000  # bytes of SMEM a CTA may use (227 KB on an H100 / H200, less the barriers)


def default_config(rows: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(wgs, bk, stages, splits): a ring of up to 6 weight tiles per CTA that fits SMEM; splits of the reduction axis
    only where the output tiles alone are fewer than the SMs. (The best config measured differs per shape:
    benchmarks/KERNELS.md.)"""
    def deepest_ring(wgs):
        return max((s for s in range(2, 7) if _smem_bytes(rows, wgs, 64, s) <= _SMEM), default=0)

    wgs = 2 if n % (2 * _BM) == 0 and n // (2 * _BM) >= _NUM_SMS and deepest_ring(2) else 1
    stages = deepest_ring(wgs)
    tiles = n // (_BM * wgs)
    splits = 1
    while tiles * splits < _NUM_SMS and k // 64 // (2 * splits) >= 8:
        splits *= 2
    return wgs, 64, stages, splits


@functools.partial(jax.jit, static_argnames=("out_dtype", "config", "interpret"))
def stacked_matmul(x: jax.Array, w: jax.Array, layer, *, out_dtype=None,
                   config: tuple[int, ...] | None = None, interpret: bool = False) -> jax.Array:
    """x [R, K] @ w[layer]^T -> [R, N] in ``out_dtype`` (default x's), for w [L, N, K] read in place.
    ``supports(R, N, K, x.dtype)`` must hold (the caller pads R to a multiple of 8). ``config`` = (wgs, bk, stages,
    splits[, ctas]) overrides :func:`default_config` (ctas: the persistent CTAs, default as many as fit the SMs);
    ``interpret``: the Mosaic GPU interpreter (CPU)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    r, k = x.shape
    n_layers, n, k2 = w.shape
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if k2 != k or w.dtype != x.dtype or not supports(r, n, k, x.dtype):
        raise ValueError(f"stacked_matmul takes x [R, K] and w [L, N, K] of one 16-bit float dtype with R a multiple "
                         f"of 8 up to 256, N of {_BM}, K of 64; got {x.shape} {x.dtype}, {w.shape} {w.dtype}")
    wgs, bk, stages, splits, *rest = config or default_config(r, n, k)
    bm = _BM * wgs
    if n % bm or k % bk:
        raise ValueError(f"config {(wgs, bk, stages, splits)} does not tile N = {n}, K = {k}")
    k_steps = k // bk
    per = -(-k_steps // splits)  # reduction steps per share (the last may have fewer)
    items = n // bm * splits  # (tile, share) pairs; item = tile * splits + share
    per_sm = max(1, _SMEM // _smem_bytes(r, wgs, bk, stages))
    ctas = min(items, rest[0] if rest else _NUM_SMS * per_sm)
    part_dtype = out_dtype if splits == 1 else jnp.dtype(jnp.float32)
    swizzle = plgpu.find_swizzle(bk * x.dtype.itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // x.dtype.itemsize)), plgpu.SwizzleTransform(swizzle))
    # The layer's first row of the [L * N, K] view (a free reshape), in an operand computed by a fusion: an int32
    # operand that was a bare slice of the layer loop's indices miscompiled on an H200 (tree_attention's note).
    offset = jnp.stack([jnp.asarray(layer, jnp.int32) * n, jnp.int32(0)])

    def kernel(x_ref, w_ref, off_ref, o_ref, scratch, barriers):
        x_smem, w_smem, o_smem = scratch
        x_bars, w_bars, free = barriers
        cta = lax.axis_index("cta")
        wg = lax.axis_index("wg")
        n_items = lax.div(items - cta + (ctas - 1), jnp.int32(ctas))  # this CTA's: cta, cta + ctas, ...

        def item_range(j):
            item = cta + j * ctas
            tile, share = lax.div(item, jnp.int32(splits)), lax.rem(item, jnp.int32(splits))
            lo = share * per
            return tile, share, lo, jnp.minimum(lo + per, k_steps)

        # Both warpgroups walk the same flat sequence of steps g = 0, 1, ... over this CTA's items; slot g % stages.
        @pl.when(wg < wgs)
        def _compute():
            def one_item(j, g):
                tile, share, lo, hi = item_range(j)

                def accumulate(acc_ref):
                    def body(i, g):
                        slot = lax.rem(g, jnp.int32(stages))
                        plgpu.barrier_wait(w_bars.at[slot])
                        plgpu.barrier_wait(x_bars.at[slot])
                        plgpu.wgmma(acc_ref, w_smem.at[slot].at[pl.ds(wg * _BM, _BM)],
                                    x_smem.at[slot].transpose((1, 0)))
                        plgpu.wgmma_wait(1)  # the previous step's product is done: its slot may be refilled

                        @pl.when(i > lo)
                        def _():
                            plgpu.barrier_arrive(free.at[lax.rem(g - 1, jnp.int32(stages))])

                        return g + 1

                    g_out = lax.fori_loop(lo, hi, body, g)
                    plgpu.wgmma_wait(0)

                    @pl.when(hi > lo)
                    def _():
                        plgpu.barrier_arrive(free.at[lax.rem(g_out - 1, jnp.int32(stages))])

                    return acc_ref[...], g_out

                acc, g = pl.run_scoped(accumulate, plgpu.ACC((_BM, r), jnp.float32))
                plgpu.wait_smem_to_gmem(0)  # the previous item's store has read the staging buffer
                o_smem.at[wg][...] = acc.astype(part_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[share, pl.ds(tile * bm + wg * _BM, _BM)])
                return g

            lax.fori_loop(0, n_items, one_item, jnp.int32(0))
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == wgs)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def one_item(j, g):
                tile, _, lo, hi = item_range(j)
                row0 = pl.multiple_of(off_ref[0] + tile * bm, _BM)

                def body(i, g):
                    slot = lax.rem(g, jnp.int32(stages))

                    @pl.when(g >= stages)
                    def _():
                        plgpu.barrier_wait(free.at[slot])

                    k0 = pl.multiple_of(i * bk, bk)
                    plgpu.copy_gmem_to_smem(w_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], w_smem.at[slot],
                                            w_bars.at[slot])
                    plgpu.copy_gmem_to_smem(x_ref.at[:, pl.ds(k0, bk)], x_smem.at[slot], x_bars.at[slot])
                    return g + 1

                return lax.fori_loop(lo, hi, body, g)

            total = lax.fori_loop(0, n_items, one_item, jnp.int32(0))

            @pl.loop(jnp.maximum(total - stages, 0), total)  # observe the last releases: every phase is waited on
            def _(g):
                plgpu.barrier_wait(free.at[lax.rem(g, jnp.int32(stages))])

    scratch = (
        plgpu.SMEM((stages, r, bk), x.dtype, transforms=transforms),
        plgpu.SMEM((stages, bm, bk), x.dtype, transforms=transforms),
        plgpu.SMEM((wgs, _BM, r), part_dtype),
    )
    barriers = (
        plgpu.Barrier(num_barriers=stages),  # row tile landed
        plgpu.Barrier(num_barriers=stages),  # weight tile landed
        plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),  # slot free
    )
    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((splits, n, r), part_dtype),
        scratch_types=(scratch, barriers),
        grid=(ctas,),
        grid_names=("cta",),
        num_threads=wgs + 1,
        thread_name="wg",
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    parts = call(x, w.reshape(n_layers * n, k), offset)
    y_t = parts[0] if splits == 1 else jnp.sum(parts, axis=0)
    return y_t.T.astype(out_dtype)
