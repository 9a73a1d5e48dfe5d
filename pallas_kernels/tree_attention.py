"""Tree attention: T new tokens over a cached prefix and an ancestor-masked tree block, GQA, as one Pallas (Mosaic
GPU, Hopper) kernel, ``tree_attention``, with its jnp reference ``tree_attention_reference`` (the XLA path).

Used through ``ddtree_jax.model.attention_fn`` by the target's verify and prefill and the drafter's block (and by
one-row steps where ``decode_attention`` does not apply) with the 'pallas' attention implementations.

Semantics (shared by the reference and the kernel):
    q           [B, T, H, hd]   the T new tokens (tree nodes, prefill chunk or one AR token)
    k, v        [B, S, K, hd]   the cache, with the T new tokens' K/V already written at slots
                                prefix_len[b] .. prefix_len[b] + T - 1; or, with ``layer``, the stacked
                                cache [L, B, S, K, hd] of which layer ``layer`` (int32, may be traced) is used
    prefix_len  [B] int32       cache slots [0, prefix_len[b]) are visible to every query
    tree_bits   [B, T, W] uint32  query t sees block slot prefix_len[b] + j iff bit j of row t is set
    returns     [B, T, H, hd]   softmax(q k^T * scale) v over the visible slots, f32 accumulation
Query head h reads KV head h // (H // K). Slots beyond prefix_len + T are never visible.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.bitmask import unpack_bits
from pallas_kernels.lengths import lengths
from pallas_kernels.split_merge import merge_splits


def visibility(prefix_len: jax.Array, tree_bits: jax.Array, t: int, s: int) -> jax.Array:
    """[B, T, S] bool: which cache slots each query sees."""
    slot = jnp.arange(s)[None, None, :]
    start = prefix_len[:, None, None]
    rel = slot - start
    block = unpack_bits(tree_bits, t)  # [B, T, T]
    in_block = (rel >= 0) & (rel < t)
    seen = jnp.take_along_axis(block, jnp.clip(rel, 0, t - 1).astype(jnp.int32).repeat(t, axis=1), axis=2)
    return (slot < start) | (in_block & seen)


def tree_attention_reference(q, k, v, prefix_len, tree_bits, *, scale: float | None = None, extra_mask=None,
                             layer=None):
    """Pure-jnp tree attention (the XLA path). ``extra_mask`` [B, T, S] bool further restricts slots."""
    if layer is not None:  # XLA fuses the slice of the stacked cache into its consumers
        k, v = k[layer], v[layer]
    b, t, h, hd = q.shape
    s, kv = k.shape[1], k.shape[2]
    g = h // kv
    scale = hd**-0.5 if scale is None else scale
    qg = q.reshape(b, t, kv, g, hd)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    mask = visibility(prefix_len, tree_bits, t, s)
    if extra_mask is not None:
        mask = mask & extra_mask
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, hd).astype(q.dtype)


# ----------------------------------------------------------------------------------------------------
# Pallas kernel (Mosaic GPU backend: TMA + wgmma, warp-specialised; Hopper sm_90a)
# ----------------------------------------------------------------------------------------------------
#
# Rows. The G = H // K query heads that share KV head kh are packed with the T tokens into R = T * G
# rows (row r = t * G + g), so one K/V tile brought into SMEM serves all of them (GQA packing). A
# compute warpgroup owns BQ = 64 rows (the wgmma M); a CTA holds ``wgs`` compute warpgroups and one
# memory warpgroup that streams K/V tiles by TMA through a ring of ``stages`` SMEM slots.
#
# Key tiles. TMA into the swizzled wgmma layout needs row offsets that are multiples of 8, so with
# prefix p, off = p % 8 and base = p - off, a sequence's key tiles are: ceil(base / BKV) prefix
# tiles at slots i * BKV (the last one masked to slots < base), then ceil((off + T) / BKV) tree
# tiles at slots base + j * BKV. Tree column jj = j * BKV + c (slot base + jj) is visible iff
# jj < off + T and bit jj of the row's shifted mask is set; the wrapper shifts every mask row left
# by off and sets its low off bits (those columns are prefix slots base .. p - 1). Full prefix tiles
# run unmasked; slots >= p + T are never visible (the tail of the last tile is masked, and reads
# past the end of the cache are zero-filled by TMA).
#
# Split-K. With ``splits`` > 1 each CTA takes a contiguous share of its sequence's key tiles and
# writes its normalised f32 partial output and log2-sum-exp; ``split_merge.merge_splits``, fused by XLA
# with the output's unpacking, merges the shares (a Pallas merge kernel was no faster here). The
# partials are staged in SMEM that aliases the K/V ring (plgpu.RefUnion), after a barrier that both
# compute warpgroups pass once their last matmul has retired.
#
# Schedule. Two compute warpgroups alternate (FA3's ping-pong): one's softmax runs under the other's
# matmuls. The scale is folded into the exp2 argument (one FMA per logit).
#
# Interpret mode (CPU) runs the same code except the PV product: the interpreter has no pl.run_state
# and takes wgmma operands from SMEM only, so there P goes through SMEM into a scratch accumulator.
# Measurements and the calibration of ``default_config``: docs/KERNELS.md.

_BQ = 64  # rows per compute warpgroup (the wgmma M)
_ALIGN = 8  # TMA row-offset granule for the (8, 64)-tiled SMEM layout
_LOG2E = 1.4426950408889634
_NUM_SMS = 132  # H100 / H200
_M_INIT = -1e30  # finite running-max start: a fully masked tile gives p = 0, never NaN


def _tree_tiles(t: int, bkv: int) -> int:
    """Static upper bound on the number of tree key tiles (off + T columns, off < 8)."""
    return -(-(t + _ALIGN - 1) // bkv)


# A cost model of the kernel, calibrated on an H200 (docs/KERNELS.md): one CTA per SM; a
# 128-key tile costs a CTA ~2.1 us with two compute warpgroups (128 rows), ~1.5 us with one;
# ~3 us fixed per CTA (either; per warpgroup count so that a refit can tell them apart); HBM at
# ~3.4 TB/s; split-K partials (f32) are written and read once.
_TILE_US = {1: 1.5, 2: 2.1}
_CTA_US = {1: 3.0, 2: 3.0}
_HBM_BYTES_PER_US = 3.4e6


def _config_cost(b: int, rows: int, kv: int, s: int, hd: int, wgs: int, splits: int) -> float:
    """The model's µs for ``rows`` = T * G query rows a KV head, ``wgs`` compute warpgroups a CTA, ``splits``."""
    rows_pad = -(-rows // (_BQ * wgs)) * _BQ * wgs
    ctas = b * kv * rows_pad // (_BQ * wgs)
    tiles = -(-s // 128)
    waves = -(-ctas * splits // _NUM_SMS)
    per_cta = -(-tiles // splits) * _TILE_US[wgs] + _CTA_US[wgs]
    partial_us = 0.0 if splits == 1 else splits * b * kv * rows_pad * (hd + 1) * 8 / _HBM_BYTES_PER_US
    active = min(ctas * splits, _NUM_SMS)
    hbm_us = 2 * b * s * kv * hd * 2 / _HBM_BYTES_PER_US
    return max(waves * per_cta, hbm_us * max(1.0, 100 / active)) + partial_us  # few CTAs: less bandwidth


def default_config(b: int, t: int, h: int, kv: int, s: int, hd: int) -> tuple[int, int, int, int]:
    """(wgs, block_kv, stages, splits) for a problem shape (all static; S stands in for p + T): the cheapest by the
    cost model, over one or two compute warpgroups (one up to 64 rows) and 1-32 splits; keys in tiles of 128 through
    a 2-slot ring. One warpgroup wins for the 160-288 rows of budgets 32-64 over short prefixes (fewer padded rows, a
    cheaper CTA), two for more rows or longer prefixes (measured on an H200: docs/KERNELS.md)."""
    rows = t * (h // kv)
    choices = (1,) if rows <= _BQ else (1, 2)
    _, wgs, splits = min((_config_cost(b, rows, kv, s, hd, w, sp), w, sp) for w in choices for sp in range(1, 33))
    return wgs, 128, 2, splits


def _pack_rows(x: jax.Array, kv: int) -> jax.Array:
    """[B, T, H, d] -> [B, K, T * G, d]: row t * G + g holds head kh * G + g."""
    b, t, h, d = x.shape
    return x.reshape(b, t, kv, h // kv, d).transpose(0, 2, 1, 3, 4).reshape(b, kv, t * (h // kv), d)


def packed_rows(b: int, t: int, h: int, kv: int, s: int, hd: int) -> int:
    """R_pad: the rows of the kernel's q operand [B, K, R_pad, hd] in its default configuration (T * G rows padded to
    whole CTAs), for q [B, T, H, hd] over a cache of S slots."""
    wgs = default_config(b, t, h, kv, s, hd)[0]
    return -(-t * (h // kv) // (_BQ * wgs)) * _BQ * wgs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedQ:
    """q [B, T, H, hd] already in the kernel's row layout: rows [B, K, R_pad, hd], row t * G + g holding head
    kh * G + g of token t, rows past T * G unused (any values: each row's output is its own, and sliced away).
    ``pallas_kernels.qkv_write`` writes it so (its ``q_rows``), which spares the layer a pad kernel between the two;
    ``tree_attention`` takes it where its configuration has R_pad = ``packed_rows``, else unpacks it."""

    rows: jax.Array
    t: int = dataclasses.field(metadata=dict(static=True))
    heads: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, int, int, int]:  # q's: [B, T, H, hd]
        return (self.rows.shape[0], self.t, self.heads, self.rows.shape[-1])

    @property
    def dtype(self):
        return self.rows.dtype

    def unpack(self) -> jax.Array:
        """q [B, T, H, hd]."""
        b, kv, _, hd = self.rows.shape
        g = self.heads // kv
        x = self.rows[:, :, : self.t * g].reshape(b, kv, self.t, g, hd)
        return x.transpose(0, 2, 1, 3, 4).reshape(b, self.t, self.heads, hd)


def _shifted_bits(tree_bits: jax.Array, prefix_len: jax.Array, t: int, words: int) -> jax.Array:
    """[B, T, W] -> [B, T, words]: each row shifted left by off = p % 8, low off bits set."""
    b, _, w_in = tree_bits.shape
    # Clear the bits at or past T (never visible), pad to the kernel's word count.
    valid = jnp.arange(32 * w_in, dtype=jnp.int32).reshape(w_in, 32) < t
    keep = jnp.sum(valid.astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
    x = tree_bits.astype(jnp.uint32) & keep
    x = jnp.pad(x, [(0, 0), (0, 0), (0, max(0, words - w_in))])[..., :words]
    off = (prefix_len % _ALIGN).astype(jnp.uint32)[:, None, None]
    prev = jnp.pad(x, [(0, 0), (0, 0), (1, 0)])[..., :words]
    carry = jnp.where(off == 0, jnp.uint32(0), prev >> (jnp.uint32(32) - off))
    y = (x << off) | carry
    low = (jnp.uint32(1) << off) - jnp.uint32(1)  # [B, 1, 1]
    return y.at[..., 0].set(y[..., 0] | low[..., 0])


def _mask_words(tree_bits: jax.Array, prefix_len: jax.Array, g: int, words: int, rows_pad: int) -> jax.Array:
    """[B, T, W] tree bits -> the kernel's mask operand [B, words, R_pad]: each packed row's visibility words (row
    t * G + g: token t's), shifted by prefix_len % 8, zero rows past T * G."""
    t = tree_bits.shape[1]
    bits = jnp.repeat(_shifted_bits(tree_bits, prefix_len.astype(jnp.int32), t, words), g, axis=1)  # [B, R, words]
    return jnp.pad(bits, [(0, 0), (0, rows_pad - t * g), (0, 0)]).transpose(0, 2, 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KernelMask:
    """tree_bits [B, T, W] with the kernel's mask operand made from them, words [B, words, R_pad] (for the default
    configuration: :func:`kernel_mask`), which ``tree_attention`` takes instead of making it: a layer loop makes it
    once, where XLA would make it in every layer (it does not hoist a loop-invariant result larger than its
    inputs). Paths other than the kernel read ``tree_bits``."""

    tree_bits: jax.Array
    words: jax.Array


def kernel_mask(tree_bits: jax.Array, prefix_len: jax.Array, q_shape: tuple[int, ...], k_shape: tuple[int, ...]
                ) -> KernelMask:
    """The :class:`KernelMask` of tree_bits [B, T, W] and prefix_len [B] for q [B, T, H, hd] over a cache k [..., S,
    K, hd] (the kernel's default configuration for those shapes)."""
    b, t, h, hd = q_shape
    s, kv = k_shape[-3], k_shape[-2]
    bkv = default_config(b, t, h, kv, s, hd)[1]
    words = _tree_tiles(t, bkv) * bkv // 32
    return KernelMask(tree_bits, _mask_words(tree_bits, prefix_len, h // kv, words, packed_rows(b, t, h, kv, s, hd)))


def supports(q, k) -> bool:
    """Whether the kernel handles these shapes and dtypes (head_dim 64/128, 16-bit floats, GQA)."""
    return q.shape[-1] in (64, 128) and q.dtype in (jnp.bfloat16, jnp.float16) and k.dtype == q.dtype and (
        q.shape[2] % k.shape[-2] == 0
    )


def tree_attention(q, k, v, prefix_len, tree_bits, *, scale: float | None = None, interpret=False,
                   config: tuple[int, int, int, int] | None = None, layer=None):
    """Pallas (Mosaic GPU) tree attention with the semantics of ``tree_attention_reference``.

    q [B, T, H, hd] bf16 or f16, or a :class:`PackedQ` of it; k, v [B, S, K, hd] same dtype; prefix_len [B] int32
    with prefix_len + T <= S; tree_bits [B, T, ceil(T/32)] uint32, or a :class:`KernelMask` of them. Returns
    [B, T, H, hd] in q.dtype.
    hd must be 64 or 128. The cache is read in place when S % 8 == 0 (else it is padded: a copy).
    ``layer`` (an int32 scalar, may be traced): k, v are the stacked cache [L, B, S, K, hd] and the kernel reads
    layer ``layer`` in place, as rows layer * B .. of its [L * B, S, K, hd] view (a free reshape), where
    ``k[layer]`` would be a copy of the layer's cache: XLA materialises a slice for a custom call.
    ``interpret=True`` runs the kernel in the Mosaic GPU interpreter (CPU).
    ``config`` = (wgs, block_kv, stages, splits) overrides ``default_config``.
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jax import lax

    packed = q if isinstance(q, PackedQ) else None
    mask = tree_bits if isinstance(tree_bits, KernelMask) else None
    tree_bits = tree_bits if mask is None else mask.tree_bits
    b, t, h, hd = q.shape
    s, kv = k.shape[-3], k.shape[-2]
    if layer is not None and (k.ndim != 5 or k.shape[1] != b):
        raise ValueError(f"with layer, k and v are [L, B, S, K, hd] with B = {b}, got {k.shape}")
    if h % kv:
        raise ValueError(f"{h=} must be a multiple of {kv=}")
    if hd not in (64, 128):
        raise ValueError(f"head_dim {hd} not supported (64 or 128)")
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a 16-bit float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    g = h // kv
    dtype = q.dtype
    scale = hd**-0.5 if scale is None else scale
    wgs, bkv, stages, splits = config or default_config(b, t, h, kv, s, hd)
    pingpong = wgs == 2  # FA3's schedule: one warpgroup's softmax under the other's matmuls
    rows = t * g
    rows_cta = _BQ * wgs
    q_tiles = -(-rows // rows_cta)
    rows_pad = q_tiles * rows_cta
    n_tree_max = _tree_tiles(t, bkv)
    words = n_tree_max * bkv // 32  # mask words per row, whole tiles
    wpt = bkv // 32  # mask words per key tile

    # Kernel layouts. K/V are read in place, with no copy, when S is a multiple of 8 and at least one
    # tile (the TMA descriptor tiles the slot axis by 8); otherwise they are padded (a full copy).
    s_pad = max(-(-s // _ALIGN) * _ALIGN, bkv)
    if layer is not None and s_pad != s:  # a cache shorter than one key tile: slice and pad that layer only
        k, v, layer = k[layer], v[layer], None
    if s_pad != s:
        pad = [(0, 0), (0, s_pad - s), (0, 0), (0, 0)]
        k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    stacked = layer is not None
    prefix_len = prefix_len.astype(jnp.int32)
    lens_in = prefix_len
    # With ``layer`` the stacked cache is viewed as [L * B, S, K, hd] (a bitcast) and the layer index rides in the
    # lengths operand, [B + 1] (``pallas_kernels.lengths``: why not an operand of its own).
    if stacked:
        k, v = (x.reshape(x.shape[0] * b, *x.shape[2:]) for x in (k, v))
        lens_in = lengths(prefix_len, layer)
    if packed is not None and packed.rows.shape[2] != rows_pad:  # packed for another configuration
        q, packed = packed.unpack(), None
    qp = packed.rows if packed is not None else jnp.pad(_pack_rows(q, kv), [(0, 0), (0, 0), (0, rows_pad - rows),
                                                                            (0, 0)])
    if mask is not None and mask.words.shape == (b, words, rows_pad):  # built once for every layer: the same words
        bits = mask.words
    else:
        bits = _mask_words(tree_bits, prefix_len, g, words, rows_pad)
    qk_scale = float(scale) * _LOG2E

    tiling = plgpu.TilingTransform((8, 64))
    swizzle = plgpu.SwizzleTransform(128)
    use_run_state = not interpret  # the interpreter lacks pl.run_state: accumulate via a scratch ACC

    def kernel(q_ref, k_ref, v_ref, p_ref, bits_ref, *rest):
        if splits > 1:
            o_ref, lse_ref, scratch, barriers = rest
        else:
            (o_ref, scratch, barriers), lse_ref = rest, None
        q_smem2, kv_union, bits_smem2, p_smem2 = scratch
        if splits > 1:  # the f32 partial output reuses the K/V ring once the loop is over
            (k_smem, v_smem), (o32_smem2, lse_smem2) = kv_union
        else:
            ((k_smem, v_smem),) = kv_union
        q_bars, bits_bars, k_bars, v_bars, k_free, v_free, loop_done, sched = barriers

        def schedule():
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        qt = lax.axis_index("q")
        split = lax.axis_index("split")
        bk = lax.axis_index("bk")
        bi = lax.div(bk, jnp.int32(kv))
        kh = lax.rem(bk, jnp.int32(kv))
        wg = lax.axis_index("wg")

        kb = p_ref[b] * b + bi if stacked else bi  # this sequence's row of the (stacked) cache
        p = p_ref[bi]
        off = lax.rem(p, jnp.int32(_ALIGN))
        base = pl.multiple_of(p - off, _ALIGN)
        n_pre = lax.div(base + (bkv - 1), jnp.int32(bkv))
        n_full = lax.div(base, jnp.int32(bkv))
        n_tree = lax.div(off + (t + bkv - 1), jnp.int32(bkv))
        total = n_pre + n_tree
        per = lax.div(total + (splits - 1), jnp.int32(splits))
        lo = jnp.minimum(split * per, total)
        hi = jnp.minimum(lo + per, total)
        steps = hi - lo

        def tile_start(i):
            start = jnp.where(i < n_pre, i * bkv, base + (i - n_pre) * bkv)
            return pl.multiple_of(start, _ALIGN)

        @pl.when(wg < wgs)
        def _compute():
            plgpu.set_max_registers(232 if wgs == 2 else 240, action="increase")
            q_smem = q_smem2.at[wg]
            bits_smem = bits_smem2.at[wg]
            row0 = qt * rows_cta + wg * _BQ
            plgpu.copy_gmem_to_smem(q_ref.at[bi, kh, pl.ds(row0, _BQ)], q_smem, q_bars.at[wg])
            plgpu.copy_gmem_to_smem(bits_ref.at[bi, :, pl.ds(row0, _BQ)], bits_smem, bits_bars.at[wg])
            plgpu.barrier_wait(q_bars.at[wg])
            plgpu.barrier_wait(bits_bars.at[wg])

            m_i = plgpu.layout_cast(jnp.full((_BQ,), _M_INIT, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((_BQ,), 0.0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((_BQ, hd), 0.0, jnp.float32), plgpu.Layout.WGMMA)

            def mask_for(i):
                cols = plgpu.broadcasted_iota(jnp.int32, (_BQ, bkv), 1, layout=plgpu.Layout.WGMMA)
                pre_vis = (cols + i * bkv) < base  # all False on tree tiles (i * bkv >= base)
                jt = jnp.maximum(i - n_pre, 0)
                word = None
                for kk in reversed(range(wpt)):
                    wv = plgpu.load(bits_smem.at[jt * wpt + kk], layout=plgpu.Layout.WGMMA.reduce(1))
                    wv = lax.broadcast_in_dim(wv, (_BQ, bkv), [0])
                    word = wv if word is None else jnp.where(cols < 32 * (kk + 1), wv, word)
                bit = lax.shift_right_logical(word, (cols & 31).astype(jnp.uint32)) & jnp.uint32(1)
                lim = jnp.where(i < n_pre, 0, off + t)  # a prefix tile sees no tree columns
                tree_vis = (bit != jnp.uint32(0)) & ((cols + jt * bkv) < lim)
                return pre_vis | tree_vis

            def body(i, carry, masked):
                acc, m_i, l_i = carry
                slot = lax.rem(i - lo, jnp.int32(stages))
                plgpu.barrier_wait(k_bars.at[slot])

                def qk_fn(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                    if pingpong:  # let the other warpgroup's softmax run under this matmul
                        schedule()
                    return acc_ref[...]

                s_ij = pl.run_scoped(qk_fn, plgpu.ACC((_BQ, bkv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                if masked:
                    s_ij = jnp.where(mask_for(i), s_ij, -jnp.inf)
                # Running max in log2 units; the scale folds into the exponent's FMA.
                m_new = jnp.maximum(m_i, s_ij.max(axis=1) * qk_scale)
                alpha = jnp.exp2(m_i - m_new)
                p_ij = jnp.exp2(s_ij * qk_scale - lax.broadcast_in_dim(m_new, s_ij.shape, [0]))
                l_i = l_i * alpha + p_ij.sum(axis=1)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                p16 = p_ij.astype(dtype)
                if pingpong:
                    plgpu.barrier_arrive(sched)  # softmax done
                    plgpu.barrier_wait(v_bars.at[slot])
                    plgpu.barrier_wait(sched)  # the tensor cores are ours again
                else:
                    plgpu.barrier_wait(v_bars.at[slot])
                if use_run_state:
                    def pv_fn(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                    acc = pl.run_state(pv_fn)(plgpu.ACC.init(acc))
                else:  # the interpreter's wgmma takes both operands from SMEM
                    p_smem = p_smem2.at[wg]
                    p_smem[...] = p16
                    plgpu.commit_smem()

                    def pv_scoped(acc_ref):
                        plgpu.wgmma(acc_ref, p_smem, v_smem.at[slot])
                        return acc_ref[...]

                    acc = acc + pl.run_scoped(pv_scoped, plgpu.ACC((_BQ, hd), jnp.float32))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            if pingpong:  # warpgroup 1 starts half a step behind warpgroup 0 (FA3's ping-pong)
                pl.when(wg == 1)(schedule)
            mid = jnp.clip(n_full, lo, hi)
            carry = lax.fori_loop(lo, mid, lambda i, c: body(i, c, False), (acc, m_i, l_i))
            acc, m_i, l_i = lax.fori_loop(mid, hi, lambda i, c: body(i, c, True), carry)
            if pingpong:
                pl.when(wg == 0)(schedule)

            l_safe = jnp.maximum(l_i, 1e-30)  # l >= 1 unless the row saw nothing
            out = acc * lax.broadcast_in_dim(1.0 / l_safe, acc.shape, [0])
            if splits > 1:
                # Every compute warpgroup must be done reading K/V before either overwrites the ring.
                plgpu.barrier_arrive(loop_done)
                plgpu.barrier_wait(loop_done)
                o32_smem = o32_smem2.at[wg]
                lse_smem = lse_smem2.at[wg]
                o32_smem[...] = out
                lse_smem[...] = m_i + jnp.log2(l_safe) + jnp.where(l_i > 0.0, 0.0, -jnp.inf)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o32_smem, o_ref.at[split, bi, kh, pl.ds(row0, _BQ)])
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[split, bi, kh, pl.ds(row0, _BQ)])
            else:
                q_smem[...] = out.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(q_smem, o_ref.at[bi, kh, pl.ds(row0, _BQ)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == wgs)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            def issue(i, slot):
                start = tile_start(i)
                plgpu.copy_gmem_to_smem(k_ref.at[kb, pl.ds(start, bkv), kh], k_smem.at[slot], k_bars.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[kb, pl.ds(start, bkv), kh], v_smem.at[slot], v_bars.at[slot])

            for st in range(stages):
                @pl.when(st < steps)
                def _():
                    issue(lo + st, st)

            @pl.loop(lo + stages, jnp.maximum(hi, lo + stages))
            def _(i):
                slot = lax.rem(i - lo, jnp.int32(stages))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])
                issue(i, slot)

            # Observe the consumers' last releases too, so that every barrier phase is waited on.
            @pl.loop(jnp.maximum(lo, hi - stages), hi)
            def _(i):
                slot = lax.rem(i - lo, jnp.int32(stages))
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

    q_scr = plgpu.SMEM((wgs, _BQ, hd), dtype, transforms=(tiling, swizzle))
    k_scr = plgpu.SMEM((stages, bkv, hd), dtype, transforms=(tiling, swizzle))
    v_scr = plgpu.SMEM((stages, bkv, hd), dtype, transforms=(tiling, swizzle))
    bits_scr = plgpu.SMEM((wgs, words, _BQ), jnp.uint32)
    p_scr = None if use_run_state else plgpu.SMEM((wgs, _BQ, bkv), dtype, transforms=(tiling, swizzle))
    if splits > 1:
        o32_scr = plgpu.SMEM((wgs, _BQ, hd), jnp.float32)
        lse_scr = plgpu.SMEM((wgs, _BQ), jnp.float32)
        kv_union = plgpu.RefUnion((k_scr, v_scr), (o32_scr, lse_scr))
        out_type = (
            jax.ShapeDtypeStruct((splits, b, kv, rows_pad, hd), jnp.float32),
            jax.ShapeDtypeStruct((splits, b, kv, rows_pad), jnp.float32),
        )
    else:
        kv_union = plgpu.RefUnion((k_scr, v_scr))
        out_type = jax.ShapeDtypeStruct((b, kv, rows_pad, hd), dtype)
    barriers = (
        plgpu.Barrier(num_barriers=wgs),  # Q landed
        plgpu.Barrier(num_barriers=wgs),  # mask words landed
        plgpu.Barrier(num_barriers=stages),  # K slot landed
        plgpu.Barrier(num_barriers=stages),  # V slot landed
        plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),  # K slot free
        plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),  # V slot free
        plgpu.Barrier(num_arrivals=wgs),  # every compute warpgroup left the loop
        plgpu.Barrier(num_arrivals=wgs),  # ping-pong schedule between the compute warpgroups
    )
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    call = plgpu.kernel(
        kernel,
        out_type=out_type,
        scratch_types=((q_scr, kv_union, bits_scr, p_scr), barriers),
        grid=(q_tiles, splits, b * kv),
        grid_names=("q", "split", "bk"),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret or None,
    )
    res = call(qp, k, v, lens_in, bits)
    if splits > 1:
        o_part, lse = res  # [S, B, K, R, hd], [S, B, K, R]: merged by XLA, fused with the reshape below
        move = lambda x: jnp.moveaxis(x, 0, 1)  # noqa: E731  the split axis second
        out = merge_splits(move(o_part), move(lse), jnp.ones_like(move(lse)), jnp.exp2)
    else:
        out = res
    out = out[:, :, :rows].reshape(b, kv, t, g, hd).transpose(0, 2, 1, 3, 4).reshape(b, t, h, hd)
    return out.astype(dtype)
