"""The vocabulary top-k of the tree build in four Pallas (Triton) kernels: exactly ``lax.top_k`` of each row.

DDTree's tree build (``ddtree_jax.tree``) starts from the k = budget largest of each depth's draft logits (15 rows
of 151936 for Qwen3), sorted as ``lax.top_k`` sorts (larger first, ties: lower index first). XLA's fastest form,
``tree.top_k_chunked``, is a chain of about fifteen small kernels (sorts, gathers, reductions). Here four:

1. ``chunk maxima`` (grid R x P): the largest key of every chunk of C consecutive entries (C = 64, 32 above k = 256).
2. ``chunk selection`` (grid R): the k chunks of largest maxima (ties: lower chunk first). Only they can hold the
   top k: an entry outside them has k larger-or-earlier chunk maxima above it, k distinct entries
   (``tree.top_k_chunked``'s argument). Their ids are written in ascending order.
3. ``entry selection`` (grid R): the k * C entries of those chunks are gathered, the k largest (ties: lower index
   first) selected the same way, and written, values and ids, in index order.
4. ``sort`` (grid R): each of the k is written to its rank (the number of the k before it in lax.top_k's order).

Selection without a sort (``pallas_kernels.selection``: counts and cumsums, the result ``lax.top_k``'s exactly).
The stages are separate kernels because each reads what the one before stored from other threads: within one
program that needs a block barrier (``pallas.triton.debug_barrier``), which the Pallas interpreter the CPU tests
run cannot execute (no CPU rule for it in jax 0.11), so the barriers of a fused program would go untested off the
GPU (``best_first`` does that for the depth scan, its barriers checked on the GPU only; untried here).

Shapes (R rows; every tensor a power of two, as the Triton lowering needs):
    x [R, V] float32 or bfloat16  ->  vals [R, k] float32, ids [R, k] int32   (requires ceil(V / C) >= k)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.blocks import pow2
from pallas_kernels.selection import MAX_KEYS, MIN as _MIN, order_key, ranks, select as _select

_PROGRAM_ENTRIES = 4096  # entries per program of the chunk-maxima kernel
_SORT_TILE = 32  # columns of the sort kernel's rank count at a time


def chunk_size(k: int) -> int:
    """C: entries per chunk (the stage-3 gather is k * C entries: 16384 up to k = 512)."""
    return 64 if k <= 256 else 32


def supports(vocab: int, k: int) -> bool:
    """Whether the kernels apply: at least k chunks (otherwise a plain top-k is cheap anyway), and both selections
    within ``selection.MAX_KEYS`` (the chunk maxima padded to a power of two; the k * C entries: k <= 512)."""
    c = chunk_size(k)
    return 0 < k and -(-vocab // c) >= k and max(pow2(-(-vocab // c)), pow2(k) * c) <= MAX_KEYS


def _chunk_max_kernel(x_ref, m_ref, *, vocab: int, c: int, cp: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    r, p = pl.program_id(0), pl.program_id(1)
    chunk = p * cp + jnp.arange(cp, dtype=jnp.int32)
    idx = chunk[:, None] * c + jnp.arange(c, dtype=jnp.int32)[None, :]  # [cp, c]
    ok = idx < vocab
    key = jnp.where(ok, order_key(pltriton.load(x_ref.at[r, idx], mask=ok, other=0)), _MIN)
    pltriton.store(m_ref.at[r, chunk], jnp.max(key, axis=1))


def _chunk_select_kernel(m_ref, cid_ref, *, k: int, n1p: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    r = pl.program_id(0)
    pos = jnp.arange(n1p, dtype=jnp.int32)
    sel, slot = _select(pltriton.load(m_ref.at[r, pos]), k)
    pltriton.store(cid_ref.at[r, slot], pos, mask=sel)


def _entry_select_kernel(x_ref, cid_ref, val_ref, id_ref, *, vocab: int, k: int, kp: int, c: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    r = pl.program_id(0)
    e = jnp.arange(kp * c, dtype=jnp.int32)  # entry e: offset e % c of the (e // c)-th selected chunk
    row = e // c
    idx = pltriton.load(cid_ref.at[r, row], mask=row < k, other=0) * c + e % c  # ascending where row < k
    ok = (row < k) & (idx < vocab)
    x = pltriton.load(x_ref.at[r, idx], mask=ok, other=0).astype(jnp.float32)
    sel, slot = _select(jnp.where(ok, order_key(x), _MIN), k)
    pltriton.store(val_ref.at[r, slot], x, mask=sel)
    pltriton.store(id_ref.at[r, slot], idx, mask=sel)


def _sort_kernel(val_ref, id_ref, out_val_ref, out_id_ref, *, k: int, kp: int, tile: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    r = pl.program_id(0)
    i = jnp.arange(kp, dtype=jnp.int32)
    ok = i < k
    x = pltriton.load(val_ref.at[r, i], mask=ok, other=0)

    def load_key(j):
        return jnp.where(j < k, order_key(pltriton.load(val_ref.at[r, j], mask=j < k, other=0)), _MIN)

    rank = ranks(jnp.where(ok, order_key(x), _MIN), load_key, k, kp, tile)  # padding to the spare column
    pltriton.store(out_val_ref.at[r, rank], x, mask=ok)
    pltriton.store(out_id_ref.at[r, rank], pltriton.load(id_ref.at[r, i], mask=ok, other=0), mask=ok)


@functools.partial(jax.jit, static_argnames=("k", "interpret", "warps"))
def top_k(x: jax.Array, k: int, *, interpret: bool = False, warps: int = 8) -> tuple[jax.Array, jax.Array]:
    """Exactly ``lax.top_k(x, k)`` over the last axis (values, ids, ties: lower index first), values as float32:
    (vals [..., k] float32, ids [..., k] int32). x [..., V] float32 or bfloat16; ``supports(V, k)`` must hold.
    ``interpret``: run the kernels in the Pallas interpreter (CPU); ``warps``: of the selection kernels."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    *lead, vocab = x.shape
    if x.dtype not in (jnp.float32, jnp.bfloat16) or not supports(vocab, k):
        raise ValueError(f"vocab_top_k takes float32 or bfloat16 rows of at least {k} chunks of {chunk_size(k)} "
                         f"(k <= 512, at most {MAX_KEYS} chunks), got {x.dtype} rows of {vocab}, k={k}")
    x2 = x.reshape(-1, vocab)
    rows = x2.shape[0]
    c = chunk_size(k)
    n1p = pow2(-(-vocab // c))  # chunks, padded (padding chunks have key _MIN)
    cp = min(n1p, _PROGRAM_ENTRIES // c)
    kp = pow2(k)

    def call(kernel, grid, out, name, w, **static):
        return pl.pallas_call(functools.partial(kernel, **static), grid=grid, out_shape=out, interpret=interpret,
                              compiler_params=pltriton.CompilerParams(num_warps=w, num_stages=1), name=name)

    spare = lambda dtype: jax.ShapeDtypeStruct((rows, k + 1), dtype)  # noqa: E731 - column k: see _select
    maxima = call(_chunk_max_kernel, (rows, n1p // cp), jax.ShapeDtypeStruct((rows, n1p), jnp.int32),
                  "vocab_chunk_maxima", 4, vocab=vocab, c=c, cp=cp)(x2)
    cid = call(_chunk_select_kernel, (rows,), spare(jnp.int32), "vocab_chunk_select", warps, k=k, n1p=n1p)(maxima)
    vals, ids = call(_entry_select_kernel, (rows,), (spare(jnp.float32), spare(jnp.int32)), "vocab_entry_select",
                     warps, vocab=vocab, k=k, kp=kp, c=c)(x2, cid)
    vals, ids = call(_sort_kernel, (rows,), (spare(jnp.float32), spare(jnp.int32)), "vocab_top_k_sort", 4, k=k,
                     kp=kp, tile=min(kp, _SORT_TILE))(vals, ids)
    return vals[:, :k].reshape(*lead, k), ids[:, :k].reshape(*lead, k)
