"""The vocabulary top-k of the tree build in four Pallas (Triton) kernels: exactly ``lax.top_k`` of each row.

DDTree's tree build (``ddtree_jax.tree``) starts from the k = budget largest of each depth's draft logits (15 rows
of 151936 for Qwen3), sorted as ``lax.top_k`` sorts (larger first, ties: lower index first). XLA's fastest form,
``tree.top_k_chunked``, is a chain of about fifteen small kernels (sorts, gathers, reductions). Here four:

1. ``chunk maxima`` (grid R x P): the largest key of every chunk of C consecutive entries (C = 64, 32 above k = 256).
2. ``chunk selection`` (grid R): the k chunks of largest maxima (ties: lower chunk first), and tau, the k-th largest
   maximum. Only those chunks can hold the top k: an entry outside them has k larger-or-earlier chunk maxima above
   it, k distinct entries (``tree.top_k_chunked``'s argument). And the top k are all >= tau (k entries are).
3. ``candidates`` (grid R x k / 16): the entries >= tau of the k chunks, appended to the row's list (one atomic add
   per program reserves its places, a cumsum orders them): at least k of the k * C, a few hundred on draft logits.
4. ``ranks`` (grid R x 16): each candidate's rank among the candidates (value, then vocabulary index: a rank count,
   ``pallas_kernels.ranking``); the k ranked first are written at their rank. Within the candidates an entry of the
   top k has its true rank (every entry before it is a candidate too) and any other a rank >= k.

Stage 2 is an exact selection without a sort (``pallas_kernels.selection``: counts and cumsums in one program per
row). Stages 3 and 4 run on many programs per row: one program per row selecting the k among all k * C entries
made tree builds slower on an H200 (docs/KERNELS.md). The stages are separate kernels because each reads what the
one before stored from other programs or threads; a kernel boundary costs about 1.3 µs there.

Used by ``tree.top_k_by_kernel`` (the tree build's per-depth top-k where ``supports`` holds); the reference is
``lax.top_k``.

Shapes (R rows; every tensor a power of two, as the Triton lowering needs):
    x [R, V] float32 or bfloat16  ->  vals [R, k] float32, ids [R, k] int32   (requires ceil(V / C) >= k)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.blocks import pow2
from pallas_kernels.ranking import rank_count
from pallas_kernels.selection import MAX_KEYS, MIN as _MIN, order_key, select_from, threshold

_PROGRAM_ENTRIES = 4096  # entries per program of the chunk-maxima kernel
_CAND_CHUNKS = 16  # chunks a candidates program gathers
_RANK_OWN = 32  # candidates a ranks program ranks at a time
_RANK_TILE = 64  # candidates compared at a time ([_RANK_OWN, _RANK_TILE] compares: more would spill registers)
_RANK_PROGRAMS = 16  # ranks programs per row


def chunk_size(k: int) -> int:
    """C: entries per chunk (the candidates come from k * C entries: 16384 up to k = 512)."""
    return 64 if k <= 256 else 32


def supports(vocab: int, k: int) -> bool:
    """Whether the kernels apply: at least k chunks (otherwise a plain top-k is cheap anyway), and the chunk maxima
    (padded to a power of two) within one selection's ``selection.MAX_KEYS``."""
    c = chunk_size(k)
    return 0 < k and -(-vocab // c) >= k and pow2(-(-vocab // c)) <= MAX_KEYS


def _chunk_max_kernel(x_ref, m_ref, *, vocab: int, c: int, cp: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    r, p = pl.program_id(0), pl.program_id(1)
    chunk = p * cp + jnp.arange(cp, dtype=jnp.int32)
    idx = chunk[:, None] * c + jnp.arange(c, dtype=jnp.int32)[None, :]  # [cp, c]
    ok = idx < vocab
    key = jnp.where(ok, order_key(pltriton.load(x_ref.at[r, idx], mask=ok, other=0)), _MIN)
    pltriton.store(m_ref.at[r, chunk], jnp.max(key, axis=1))


def _chunk_select_kernel(m_ref, cid_ref, tau_ref, cnt_ref, *, k: int, n1p: int):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    r = pl.program_id(0)
    pos = jnp.arange(n1p, dtype=jnp.int32)
    key = pltriton.load(m_ref.at[r, pos])
    tau = threshold(key, k)  # the k-th largest chunk maximum
    sel, slot = select_from(key, k, tau)
    pltriton.store(cid_ref.at[r, slot], pos, mask=sel)
    two = jnp.arange(2, dtype=jnp.int32)
    pltriton.store(tau_ref.at[r, two], jnp.where(two == 0, tau, 0))
    pltriton.store(cnt_ref.at[r, two], jnp.zeros((2,), jnp.int32))  # the candidates' count, from 0


def _candidates_kernel(x_ref, cid_ref, tau_ref, cnt_in, ckey_ref, cval_ref, cidx_ref, cnt_ref, *, vocab: int, k: int,
                       c: int, cap: int):
    """The entries >= tau of the k selected chunks (16 chunks a program), appended to the row's candidates."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    del cnt_in
    r, p = pl.program_id(0), pl.program_id(1)
    e = jnp.arange(_CAND_CHUNKS * c, dtype=jnp.int32)
    slot = p * _CAND_CHUNKS + e // c
    oks = slot < k
    idx = pltriton.load(cid_ref.at[r, jnp.where(oks, slot, 0)], mask=oks, other=0) * c + e % c
    ok = oks & (idx < vocab)
    x = pltriton.load(x_ref.at[r, jnp.where(ok, idx, 0)], mask=ok, other=0).astype(jnp.float32)
    key = order_key(x)
    keep = ok & (key >= pltriton.load(tau_ref.at[r, jnp.int32(0)]))
    base = pltriton.atomic_add(cnt_ref, (r, jnp.int32(0)), jnp.sum(keep.astype(jnp.int32)))
    pos = jnp.where(keep, base + jnp.cumsum(keep.astype(jnp.int32)) - 1, cap)  # column cap: the spare
    pltriton.store(ckey_ref.at[r, pos], key, mask=keep)
    pltriton.store(cval_ref.at[r, pos], x, mask=keep)
    pltriton.store(cidx_ref.at[r, pos], idx, mask=keep)


def _ranks_kernel(cnt_ref, ckey_ref, cval_ref, cidx_ref, val_ref, id_ref, *, k: int):
    """Each candidate's rank among the row's candidates (value, then index); the first k written at their rank."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    load = pltriton.load
    r, g = pl.program_id(0), pl.program_id(1)
    n = load(cnt_ref.at[r, jnp.int32(0)])
    lane = jnp.arange(_RANK_OWN, dtype=jnp.int32)
    cols = jnp.arange(_RANK_TILE, dtype=jnp.int32)

    def candidates(u0):
        u = u0 * _RANK_TILE + cols
        oku = u < n
        at = jnp.where(oku, u, 0)
        return load(ckey_ref.at[r, at], mask=oku, other=0), load(cidx_ref.at[r, at], mask=oku, other=0), oku

    def own_tile(t, carry):
        own = (g + _RANK_PROGRAMS * t) * _RANK_OWN + lane
        ok = own < n
        at = jnp.where(ok, own, 0)
        key, idx = load(ckey_ref.at[r, at], mask=ok, other=0), load(cidx_ref.at[r, at], mask=ok, other=0)
        rank = rank_count(key, idx, candidates, (n + _RANK_TILE - 1) // _RANK_TILE, _RANK_TILE, group=8)
        win = ok & (rank < k)
        out = jnp.where(win, rank, k)  # column k: the spare
        pltriton.store(val_ref.at[r, out], load(cval_ref.at[r, at], mask=ok, other=0), mask=win)
        pltriton.store(id_ref.at[r, out], idx, mask=win)
        return carry

    per = _RANK_PROGRAMS * _RANK_OWN
    jax.lax.fori_loop(0, jnp.maximum((n - g * _RANK_OWN + per - 1) // per, 0), own_tile, 0)


@functools.partial(jax.jit, static_argnames=("k", "interpret", "warps"))
def top_k(x: jax.Array, k: int, *, interpret: bool = False, warps: int = 8) -> tuple[jax.Array, jax.Array]:
    """Exactly ``lax.top_k(x, k)`` over the last axis (values, ids, ties: lower index first), values as float32:
    (vals [..., k] float32, ids [..., k] int32). x [..., V] float32 or bfloat16; ``supports(V, k)`` must hold.
    ``interpret``: run the kernels in the Pallas interpreter (CPU); ``warps``: of the chunk selection."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as pltriton

    *lead, vocab = x.shape
    if x.dtype not in (jnp.float32, jnp.bfloat16) or not supports(vocab, k):
        raise ValueError(f"vocab_top_k takes float32 or bfloat16 rows of at least {k} chunks of {chunk_size(k)} "
                         f"(at most {MAX_KEYS} chunks), got {x.dtype} rows of {vocab}, k={k}")
    x2 = x.reshape(-1, vocab)
    rows = x2.shape[0]
    c = chunk_size(k)
    n1p = pow2(-(-vocab // c))  # chunks, padded (padding chunks have key _MIN)
    cp = min(n1p, _PROGRAM_ENTRIES // c)
    cap = k * c  # candidates at most

    def call(kernel, grid, out, name, warps_, aliases=None, **static):
        return pl.pallas_call(functools.partial(kernel, **static), grid=grid, out_shape=out, interpret=interpret,
                              input_output_aliases=aliases or {},
                              compiler_params=pltriton.CompilerParams(num_warps=warps_, num_stages=1), name=name)

    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    # column k (cap): a spare that masked stores aim at, so that in the interpreter (which writes a masked store's old
    # values back) no masked lane shares a stored one's place
    maxima = call(_chunk_max_kernel, (rows, n1p // cp), i32(rows, n1p), "vocab_chunk_maxima", 4, vocab=vocab, c=c,
                  cp=cp)(x2)
    cid, tau, cnt = call(_chunk_select_kernel, (rows,), (i32(rows, k + 1), i32(rows, 2), i32(rows, 2)),
                         "vocab_chunk_select", warps, k=k, n1p=n1p)(maxima)
    ckey, cval, cidx, cnt = call(_candidates_kernel, (rows, -(-k // _CAND_CHUNKS)),
                                 (i32(rows, cap + 1), f32(rows, cap + 1), i32(rows, cap + 1), i32(rows, 2)),
                                 "vocab_candidates", 4, aliases={3: 3}, vocab=vocab, k=k, c=c, cap=cap)(
                                     x2, cid, tau, cnt)
    vals, ids = call(_ranks_kernel, (rows, _RANK_PROGRAMS), (f32(rows, k + 1), i32(rows, k + 1)), "vocab_ranks", 4,
                     k=k)(cnt, ckey, cval, cidx)
    return vals[:, :k].reshape(*lead, k), ids[:, :k].reshape(*lead, k)
