"""Draft trees with static shapes: DDTree's best-first tree, the DFlash chain, and the bare root (AR).

Tree index 0 is the root (the last emitted token, not yet in the cache); node k of ``tokens`` /
``depths`` is tree index k + 1, as in the reference. Parents come before children.

DDTree (Ringel & Romano, Algorithm 1) pops a heap of paths by cumulative draft log-probability until
``budget`` nodes are taken. A child never scores above its parent, so the result is the top-``budget``
paths over all depths, ancestor-closed. We compute that with a ``lax.scan`` over depths carrying a
width-``budget`` frontier (the best paths of the current depth): the paths of depth d+1 in the
answer extend frontier paths of depth d. Frontier and per-depth top-k lists are sorted, so candidate
(i, j) = frontier i + token rank j has at least (i+1)(j+1)-1 candidates above it; only pairs with
(i+1)(j+1) <= budget can make the cut (about budget * ln(budget) pairs instead of budget^2).

Each depth then selects the best ``budget`` of those candidates, and a last selection takes the best ``budget``
over all depths. ``select="sort"`` does it with ``lax.top_k`` (a sort on GPU: 15 dependent sorts per tree);
``select="count"`` ranks every candidate by counting the candidates before it (one compare-and-sum fusion, no
sort), the same result bit for bit; ``select="kernel"`` runs the scan, the last selection and the ancestor bits as
a chain of Pallas kernels, one per depth, of many programs each (``pallas_kernels.best_first``), the same result again.
Defaults (:func:`default_select`): on GPU up to batch 8 the kernels up to budget 256; at batch 1 "count" up to
512; "sort" otherwise (each measured fastest there on an H200: docs/PERFORMANCE.md).

Before the depths, the per-depth top-k over the vocabulary; after them, the packed ancestor mask. Both have Pallas
kernels (``pallas_kernels.vocab_top_k``, ``pallas_kernels.ancestor_bits``) beside their XLA forms here, the GPU
defaults up to batch 8 (:func:`default_kernels`); the same trees either way. With ``select="kernel"`` the mask
comes from ``best_first``'s own last kernel.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from ddtree_jax import sharding, vocab_parallel
from pallas_kernels import ancestor_bits as bits_kernel, best_first as best_first_kernel, selection, vocab_top_k
from pallas_kernels.bitmask import pack_bits, unpack_bits
from pallas_kernels.ranking import comes_before

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Tree:
    tokens: Array  # [B, N] int32 node tokens (-1 marks an unused slot, never accepted)
    depths: Array  # [B, N] int32, 1-based
    parents: Array  # [B, 1 + N] int32 tree indices; parents[:, 0] == -1
    bits: Array  # [B, 1 + N, ceil((1+N)/32)] uint32 ancestor-or-self visibility

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


BITS = ("xla", "kernel")


def ancestor_bits(parents: Array, max_depth: int, how: str = "xla") -> Array:
    """parents [B, M] (root -1, at index 0) -> packed ancestor-or-self mask [B, M, ceil(M/32)].

    ``how="kernel"``: one Pallas kernel (``pallas_kernels.ancestor_bits``; its interpreter off the GPU), the same
    words. ``"xla"``, below:

    Pointer doubling: start from each node and its parent; then ceil(log2(max_depth)) times OR in the rows of
    the 2^k-th ancestor (whose rows hold distances 0..2^k) and jump up 2^k. Four dependent gathers at depth 15
    instead of fifteen: a long chain of gathers fused into one loop sends LLVM's loop vectorizer into minutes
    of compilation on CPU."""
    if how not in BITS:
        raise ValueError(f"ancestor bits: how must be one of {BITS}, got {how!r}")
    if how == "kernel":
        return bits_kernel.ancestor_bits(parents, max_depth, interpret=not _on_gpu())
    m = parents.shape[1]
    up = jnp.maximum(parents, 0)  # the root is its own parent
    words = pack_bits(jnp.eye(m, dtype=bool)[None] | jax.nn.one_hot(up, m, dtype=bool))  # distances 0 and 1
    for _ in range(max(0, math.ceil(math.log2(max(max_depth, 1))))):
        words = words | jnp.take_along_axis(words, up[..., None], axis=1)
        up = jnp.take_along_axis(up, up, axis=1)
    return words


def count_ranks(x: Array) -> Array:
    """Each entry's place [..., n] int32 in ``lax.top_k``'s order over the last axis of x [..., n] float32 (larger
    first, ties: lower index first): the number of entries before it, in one compare-and-sum over [n, n]. Floats
    are compared in top_k's total order (-0.0 below +0.0) through their bits: float32 only."""
    if x.dtype != jnp.float32:
        raise ValueError(f"rank counting takes float32, got {x.dtype}")
    idx = jnp.arange(x.shape[-1], dtype=jnp.int32)
    key = selection.order_key(x)  # int32 order = float total order
    xi, xj = key[..., :, None], key[..., None, :]
    before = comes_before(xj, idx[None, :], xi, idx[:, None])  # [..., n, n]: j comes before i
    return jnp.sum(before, axis=-1, dtype=jnp.int32)


def top_k_by_count(x: Array, k: int) -> tuple[Array, Array]:
    """Exactly ``lax.top_k(x, k)`` over the last axis (values, ids, ties: lower index first), without a sort:
    slot r takes the entry whose rank (:func:`count_ranks`, a permutation of 0..n-1) is r, by a scatter (ranks past
    k dropped; :func:`_top_with`). O(n^2) work in two kernels: for the few thousand candidates of a tree, far less
    time on a GPU than a sort's many passes; on CPU a sort is cheaper. float32 only."""
    if x.ndim > 1:
        return jax.vmap(functools.partial(top_k_by_count, k=k))(x)
    vals, (ids,) = _top_with(x, (jnp.arange(x.shape[0], dtype=jnp.int32),), k, "count")
    return vals, ids


SELECTS = ("sort", "count", "kernel")


def _top_with(x: Array, payloads: tuple[Array, ...], k: int, select: str) -> tuple[Array, tuple[Array, ...]]:
    """x [n] float32, int32 payloads [n] -> ``lax.top_k(x, k)``'s values and the payloads at its ids. "sort":
    ``lax.top_k`` and gathers; otherwise (``select`` "count", or "kernel" past the kernel's sizes) each entry's rank
    (:func:`count_ranks`) and one scatter of its row (value bits, payloads) to that slot, held in memory (fused into
    their uses, a depth's rows had every later depth recompute the gathers of all before it). The same result."""
    if select not in SELECTS:
        raise ValueError(f"select must be one of {SELECTS}, got {select!r}")
    if select == "sort":
        vals, ids = jax.lax.top_k(x, k)
        return vals, tuple(p[ids] for p in payloads)
    rows = jnp.stack([jax.lax.bitcast_convert_type(x, jnp.int32), *payloads], axis=-1)  # [n, 1 + P]
    rank = jax.lax.optimization_barrier(count_ranks(x))  # its own kernel: fused into the scatter, 4-7x slower
    top = jnp.zeros((k, rows.shape[1]), jnp.int32).at[rank].set(rows, mode="drop")
    top = jax.lax.optimization_barrier(top)
    return jax.lax.bitcast_convert_type(top[:, 0], jnp.float32), tuple(top[:, 1 + i] for i in range(len(payloads)))


def _best_first_one(
    log_probs: Array, token_ids: Array, budget: int, unroll: int | bool = 1, select: str = "sort"
):
    """One sequence. log_probs, token_ids [Dp, K] sorted descending per depth. ``unroll``: of the scan;
    ``select``: how each top-``budget`` selection is made (see the module doc)."""
    depth_count, k = log_probs.shape
    width = budget
    ii, jj = (jnp.asarray(a) for a in best_first_kernel.candidate_pairs(budget, k))

    first = jnp.full((width,), -jnp.inf).at[: min(k, width)].set(log_probs[0, :width])
    first_tok = jnp.full((width,), -1, jnp.int32).at[: min(k, width)].set(token_ids[0, :width])
    first_parent = jnp.full((width,), -1, jnp.int32)

    def step(frontier, row):
        lp, ids = row
        best, (tok, parent_slot) = _top_with(frontier[ii] + lp[jj], (ids[jj], ii), width, select)
        return best, (best, tok, parent_slot)

    _, (scores, toks, parent_slot) = jax.lax.scan(step, first, (log_probs[1:], token_ids[1:]), unroll=unroll)
    scores = jnp.concatenate([first[None], scores])  # [Dp, W]
    toks = jnp.concatenate([first_tok[None], toks])
    parent_slot = jnp.concatenate([first_parent[None], parent_slot])

    flat_scores = scores.reshape(-1)
    flat = jnp.arange(flat_scores.shape[0], dtype=jnp.int32)
    top_scores, (chosen,) = _top_with(flat_scores, (flat,), budget, select)  # ties: shallower first: parents precede
    depth = chosen // width
    valid = top_scores > -jnp.inf
    rank_of = jnp.full((depth_count * width,), -1, jnp.int32).at[chosen].set(jnp.arange(budget, dtype=jnp.int32))
    parent_flat = (depth - 1) * width + parent_slot.reshape(-1)[chosen]
    parent = jnp.where(depth == 0, 0, rank_of[jnp.maximum(parent_flat, 0)] + 1)
    parent = jnp.where(valid, parent, 0)
    tokens = jnp.where(valid, toks.reshape(-1)[chosen], -1)
    depths = jnp.where(valid, depth + 1, 1)
    return tokens, depths.astype(jnp.int32), parent.astype(jnp.int32)


def top_k_chunked(x: Array, k: int, chunk: int | tuple[int, ...], top=jax.lax.top_k) -> tuple[Array, Array]:
    """Exactly ``lax.top_k(x, k)`` over the last axis (same values, ids and tie order: lower index first),
    selecting from far fewer entries of a long row: only the k chunks of ``chunk`` entries with the largest maxima
    can hold the top k (an entry outside them has k chunk maxima, k distinct entries, ranking above it).
    So: chunk maxima -> top k chunks -> their k * chunk entries, in index order -> top k. A tuple of chunk sizes
    applies the same step again to those entries (e.g. (64, 8): 151936 -> 2374 chunk maxima, 16384 entries ->
    2048 maxima of 8, 2048 entries -> top k). ``top``: the selection each step makes (``lax.top_k``, a sort on
    GPU, or :func:`top_k_by_count`); same result."""
    chunk, *rest = chunk if isinstance(chunk, tuple) else (chunk,)
    *lead, n = x.shape
    n_chunks = -(-n // chunk)
    if n_chunks <= k:
        return top(x, k)
    xp = jnp.pad(x, [(0, 0)] * len(lead) + [(0, n_chunks * chunk - n)], constant_values=-jnp.inf)
    xc = xp.reshape(*lead, n_chunks, chunk)
    _, best = top(jnp.max(xc, axis=-1), k)  # ties: lower chunk first, as lax.top_k
    best = jnp.sort(best, axis=-1)  # candidates in index order, so ties below break as in a full top_k
    cand = jnp.take_along_axis(xc, best[..., None], axis=-2).reshape(*lead, k * chunk)
    ids = (best[..., None] * chunk + jnp.arange(chunk, dtype=best.dtype)).reshape(*lead, k * chunk)
    vals, pos = top_k_chunked(cand, k, tuple(rest), top) if rest else top(cand, k)
    return vals, jnp.take_along_axis(ids, pos, axis=-1)


def top_k_by_kernel(x: Array, k: int, fallback=jax.lax.top_k) -> tuple[Array, Array]:
    """Exactly ``lax.top_k(x, k)`` over the last axis (x float32 or bfloat16; values float32) by the Pallas kernels
    of ``pallas_kernels.vocab_top_k`` (on GPU; their interpreter elsewhere). Rows too short for them (fewer than k
    chunks) take ``fallback``."""
    if not vocab_top_k.supports(x.shape[-1], k):
        return fallback(x.astype(jnp.float32), k)
    return vocab_top_k.top_k(x, k, interpret=not _on_gpu())


def top_log_probs(draft_logits: Array, k: int, chunk: int | tuple[int, ...] | str | None = None,
                  select=jax.lax.top_k) -> tuple[Array, Array]:
    """Per-depth top-k of the log-softmax: ([B, Dp, k] f32, [B, Dp, k] int32), sorted descending.
    ``chunk``: take the top k through :func:`top_k_chunked` (same result) instead of one ``select`` over the whole
    row, or, "kernel", through :func:`top_k_by_kernel` (same result); ``select``: the selection (``lax.top_k`` or
    :func:`top_k_by_count`; same result)."""
    logits = draft_logits.astype(jnp.float32)
    if chunk == "kernel":  # the kernels read the logits as they are (converting them exactly)
        top, logits_in = functools.partial(top_k_by_kernel, fallback=select), draft_logits
    else:
        top = functools.partial(top_k_chunked, chunk=chunk, top=select) if chunk else select
        logits_in = logits
    vals, ids = vocab_parallel.top_k(logits_in, k, top)  # top(logits, k); per vocabulary shard under a mesh
    return vals - jax.nn.logsumexp(logits, axis=-1, keepdims=True), ids.astype(jnp.int32)


KERNEL_MAX_K = 512  # the largest vocabulary top-k at which the kernels were measured faster (H200)


def default_topk_chunk(k: int, kernels: bool = False) -> int | tuple[int, ...] | str:
    """:func:`top_log_probs`' vocabulary chunks unless told: with ``kernels`` (on GPU: :func:`default_kernels`) and
    k <= ``KERNEL_MAX_K``, "kernel"; else two levels, (64, 8), up to k = 256, one of 32 above: each the fastest
    measured there on an H200 at Qwen3's vocabulary (an unchunked top-k is several times slower; docs/PERFORMANCE.md).
    Every choice gives the same result."""
    if kernels and k <= KERNEL_MAX_K:
        return "kernel"
    return (64, 8) if k <= 256 else 32


KERNEL_MAX_BATCH = 8  # the largest batch at which the kernels were measured faster (H200)


def default_kernels(batch: int = 1) -> bool:
    """Whether the tree build uses its Pallas kernels (the vocabulary top-k up to ``KERNEL_MAX_K``, the depth scan up
    to ``KERNEL_MAX_BUDGET``, the ancestor bits up to ``pallas_kernels.ancestor_bits.MAX_NODES``) unless told: on GPU
    up to ``KERNEL_MAX_BATCH`` sequences without a mesh: measured faster there on an H200, at Qwen3's vocabulary and
    the default pair's, at every budget up to 512 at batch 8 and not always at batch 16 (docs/PERFORMANCE.md). Meshes
    not timed, though the top-k kernels run per vocabulary shard: tests/test_sharding.py."""
    return _on_gpu() and batch <= KERNEL_MAX_BATCH and sharding.active() is None


COUNT_MAX_BUDGET = 512  # the largest budget at which rank counting was measured faster (H200, batch 1)
KERNEL_MAX_BUDGET = 256  # the largest budget at which the best_first kernels were measured faster (H200, batch 1)


def default_select(budget: int, batch: int = 1) -> str:
    """The selection :func:`best_first` uses unless told: on GPU the ``best_first`` kernels up to
    ``KERNEL_MAX_BUDGET`` where :func:`default_kernels` (up to batch 8), then for one sequence rank counting up to
    ``COUNT_MAX_BUDGET``, ``lax.top_k`` otherwise. On an H200 the kernels built a tree fastest up to budget 256 (at 512
    no faster than rank counting); rank counting's O(n^2) compares grow with the budget squared and with the batch,
    faster than ``lax.top_k`` at batch 1 up to budget 512 and slower at batch 8 (docs/PERFORMANCE.md)."""
    if default_kernels(batch) and budget <= KERNEL_MAX_BUDGET:
        return "kernel"
    return "count" if _on_gpu() and batch == 1 and budget <= COUNT_MAX_BUDGET else "sort"


def default_bits(nodes: int, batch: int = 1) -> str:
    """How :func:`ancestor_bits` runs unless told, for ``batch`` trees of ``nodes`` tree indices: "kernel" where
    :func:`default_kernels` and up to ``pallas_kernels.ancestor_bits.MAX_NODES`` (H200, budgets 64-256: 17-23 against
    26-34 us; at 512 the words spill out of registers: 426 against 30), else "xla"."""
    return "kernel" if default_kernels(batch) and nodes <= bits_kernel.MAX_NODES else "xla"


def best_first(
    draft_logits: Array,
    budget: int,
    *,
    chunk: int | tuple[int, ...] | str | None = None,
    unroll: int | bool = True,
    select: str | None = None,
    bits: str | None = None,
) -> Tree:
    """DDTree's tree of ``budget`` nodes from draft logits [B, Dp, V] (untempered, as the reference).
    ``chunk``, ``unroll``, ``select`` and ``bits`` change how, never what: see :func:`top_log_probs`, the depth
    scan, the module doc and :func:`ancestor_bits`. Defaults: on GPU the Pallas kernels (:func:`default_kernels`:
    the vocabulary top-k, the depth scan through :func:`default_select`, the ancestor bits), elsewhere the chunked
    top-k (:func:`default_topk_chunk`; on each vocabulary shard under a mesh, see ``vocab_parallel.top_k``) and XLA's
    ancestor bits; a fully unrolled depth loop and :func:`default_select`; each measured faster on an H200
    (docs/PERFORMANCE.md)."""
    b = draft_logits.shape[0]
    if select is None:
        select = default_select(budget, b)
    lp, ids = _lists(draft_logits, budget, chunk)
    return tree_from_lists(lp, ids, budget, select=select, unroll=unroll, bits=bits)


def _lists(draft_logits: Array, budget: int, chunk=None) -> tuple[Array, Array]:
    """The per-depth top-min(budget, V) lists a tree of ``budget`` nodes is built from (:func:`top_log_probs`)."""
    b, _, vocab = draft_logits.shape
    k = min(budget, vocab)
    return top_log_probs(draft_logits, k, default_topk_chunk(k, default_kernels(b)) if chunk is None else chunk)


def scored_best_first(draft_logits: Array, budget: int) -> tuple[Tree, Array, Array]:
    """:func:`best_first` (its defaults) with what the drafter expects of it: (tree, each node's path log-probability
    [B, N] f32 (:func:`path_log_probs`; sorted descending, as the nodes are), the best log-probability of each depth
    [B, Dp] f32). The c best paths are the tree's first c nodes (:func:`prefix`): their probabilities summed, plus
    the root, are the acceptance length a tree of c nodes expects if the target behaves as the drafter."""
    lp, ids = _lists(draft_logits, budget)
    tree = tree_from_lists(lp, ids, budget, select=default_select(budget, draft_logits.shape[0]))
    return tree, path_log_probs(tree, lp, ids), lp[:, :, 0]


def path_log_probs(tree: Tree, lp: Array, ids: Array) -> Array:
    """[B, N] f32: each node's path log-probability, the sum of its own and its ancestors' draft log-probabilities,
    each looked up in its depth's list (lp, ids [B, Dp, K]); -inf for an unused node (token -1). Computed apart from
    the build (whose kernels keep their scores to themselves): the same sums up to the order of the additions. One
    masked sum over the tree's ancestor-or-self bits [B, 1 + N, 1 + N], not a gather a depth (on a GPU, each of those
    is a dependent kernel of the round)."""
    b, n = tree.tokens.shape
    k = ids.shape[2]
    at = jnp.broadcast_to(jnp.maximum(tree.depths - 1, 0)[..., None], (b, n, k))
    match = jnp.take_along_axis(ids, at, axis=1) == tree.tokens[..., None]  # [B, N, K]
    own = jnp.where(jnp.any(match, -1), jnp.sum(jnp.where(match, jnp.take_along_axis(lp, at, axis=1), 0.0), -1),
                    -jnp.inf)
    own = jnp.concatenate([jnp.zeros((b, 1), jnp.float32), own], axis=1)  # [B, 1 + N]; the root's: 0
    seen = unpack_bits(tree.bits, n + 1)  # [B, 1 + N, 1 + N]: node j is node i or above it
    return jnp.sum(jnp.where(seen, own[:, None, :], 0.0), axis=-1)[:, 1:]


def prefix(tree: Tree, size: int) -> Tree:
    """The first ``size`` nodes of a best-first tree: its ``size`` best paths (nodes are sorted by path score, parents
    first on ties, so the prefix holds every node's ancestors), the same tree as :func:`best_first` at that budget up
    to ties."""
    words = -(-(1 + size) // 32)
    return Tree(tree.tokens[:, :size], tree.depths[:, :size], tree.parents[:, : size + 1],
                tree.bits[:, : size + 1, :words])


def tree_from_lists(lp: Array, ids: Array, budget: int, *, select: str, unroll: int | bool = True,
                    bits: str | None = None) -> Tree:
    """The best-first tree of ``budget`` nodes from per-depth lists sorted descending, lp [B, Dp, K] f32 and ids
    [B, Dp, K] int32 (:func:`top_log_probs`): the tree build proper, after the vocabulary top-k. ``bits``: how the
    ancestor bits are made (:func:`ancestor_bits`; default: by the kernels with ``select="kernel"``, else
    :func:`default_bits`). ``select="kernel"`` beyond the kernels' sizes (``pallas_kernels.best_first.supports``:
    budgets above 1024 at 15 depths) takes "count": the same tree."""
    b, depth_count, k = lp.shape
    words = None
    if select == "kernel" and best_first_kernel.supports(budget, k, depth_count):
        tokens, depths, parents, words = best_first_kernel.best_first(lp, ids, budget, interpret=not _on_gpu())
    else:
        one = functools.partial(_best_first_one, budget=budget, unroll=unroll, select=select)
        tokens, depths, parents = jax.vmap(one)(lp, ids)
    parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), parents], axis=1)
    if words is None or bits is not None:
        words = ancestor_bits(parents, depth_count, bits or default_bits(budget + 1, b))
    return Tree(tokens, depths, parents, words)


def chain(draft_logits: Array) -> Tree:
    """Chain DFlash: one path of the draft argmax tokens, depths 1..Dp."""
    b, depth_count, _ = draft_logits.shape
    tokens = vocab_parallel.argmax(draft_logits)
    depths = jnp.broadcast_to(jnp.arange(1, depth_count + 1, dtype=jnp.int32), (b, depth_count))
    parents = jnp.broadcast_to(jnp.arange(-1, depth_count, dtype=jnp.int32), (b, depth_count + 1))
    bits = pack_bits(jnp.tril(jnp.ones((depth_count + 1, depth_count + 1), bool)))
    return Tree(tokens, depths, parents, jnp.broadcast_to(bits, (b, *bits.shape)))


def root_only(batch: int) -> Tree:
    """Autoregressive decoding: the tree is the root alone."""
    return Tree(
        jnp.zeros((batch, 0), jnp.int32),
        jnp.zeros((batch, 0), jnp.int32),
        jnp.full((batch, 1), -1, jnp.int32),
        jnp.ones((batch, 1, 1), jnp.uint32),
    )
