"""One speculative round for a batch of sequences, all on device, as the stages of the method:

    draft   the DFlash drafter proposes logits for the positions after the last token (those the round's tree can
            reach: ``Spec.draft_depths``)
    tree    DDTree's best-first tree (ddtree), the argmax chain (dflash) or the bare root (an AR step)
    verify  one target forward over [root + tree nodes] with the ancestor-only mask
    accept  the target's choice at every node, then the walk down the agreeing path
    commit  accepted K/V moved next to the prefix, tokens appended, the path's hidden taps handed to the drafter

:func:`round_step` is the whole round, :class:`State` what it reads and returns. The loop of rounds, prefill and the
host API are ``decode.py``'s; what a round is (the static Spec of each program) is ``spec.py``'s.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ddtree_jax import accept, draft as dflash, model, policy, tree as trees
from ddtree_jax import cache as kvcache
from ddtree_jax.params import DraftParams, TargetParams
from ddtree_jax.spec import NEVER, Spec, default_layer_unroll
from pallas_kernels.bitmask import pad_rows

Array = jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class State:
    """Per-batch decoding state; every leaf but the caches has the batch on axis 0."""

    cache: kvcache.KVCache  # target; length = committed tokens
    dcache: kvcache.KVCache | None  # drafter context K/V of the same committed tokens (None for ar)
    bonus: Array  # [B] last emitted token: the root of the next tree, not yet in the cache
    out: Array  # [B, S_out] prompt + generated tokens
    n_out: Array  # [B] tokens in out
    prompt_len: Array  # [B]
    limit: Array  # [B] prompt_len + max_new_tokens: the output is cut here
    stop_ids: Array  # [B, MAX_STOP_IDS] stop tokens, -1 padded
    stop_at: Array  # [B] index in out of the first stop token (NEVER if none)
    done: Array  # [B] bool
    keys: Array  # [B] PRNG keys, one per sequence
    temperature: Array  # [B] f32 (0 = greedy)
    top_p: Array  # [B] f32
    top_k: Array  # [B] int32 (0 = off)
    n_rounds: Array  # [B] rounds taken
    accept_hist: Array  # [B, R] acceptance length of each round (accepted nodes incl. the root)
    trace: dict | None  # with Spec.trace: per round trees and paths, [B, R, ...]
    forms: Array | None = None  # (Spec.auto) [B, R] int32 the form of each round (policy.code)
    stats: Array | None = None  # (Spec.auto) [B, policy.width(Spec.predict)] f32 sums over rounds (policy.py)


def draft_logits(spec: Spec, target: TargetParams, drafter: DraftParams, state: State):
    """The draft stage (dflash/ddtree): (draft logits [B, spec.draft_depths, V] (the depths the round's tree can
    reach), the drafter cache with the block's K/V written in its scratch slots past the committed length)."""
    if spec.proposer is not None:
        logits = spec.proposer(drafter, spec.draft, target, state.dcache, state.bonus, attention=spec.attention)
        return logits[:, : spec.draft_depths], state.dcache
    # Keep the cache the drafter wrote its block into (scratch slots only): no copy of the draft cache.
    return dflash.propose(drafter, spec.draft, target, state.dcache, state.bonus, attention=spec.attention,
                          tuning=spec.tuning, return_cache=True, depths=spec.draft_depths)


def build_tree(spec: Spec, logits: Array) -> tuple[trees.Tree, Array | None]:
    """The tree stage: the DFlash chain or DDTree's best-first tree from draft logits [B, Dp, V] (Dp =
    ``spec.draft_depths``), and under auto the round's predictions [B, 2 + len(spec.predict)] (:func:`predictions`;
    None otherwise)."""
    if not spec.auto:
        return (trees.chain(logits) if spec.tree == "chain" else trees.best_first(logits, spec.budget)), None
    if not spec.build_budget:  # dflash: the chain's prediction alone
        top1 = jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
        return trees.chain(logits), predictions(spec, top1, None)
    big, scores, top1 = trees.scored_best_first(logits, spec.build_budget)
    tree = trees.chain(logits) if spec.tree == "chain" else trees.prefix(big, spec.budget)
    return tree, predictions(spec, top1, scores)


def predictions(spec: Spec, top1: Array, scores: Array | None) -> Array:
    """[B, 2 + len(spec.predict)]: the expected acceptance length (if the target behaved like the drafter) of the
    form this round runs, of the chain (1 + sum_d prod_{j<=d} p_top1(j), top1 [B, Dp] the per-depth best
    log-probabilities of the depths drafted: spec.draft_depths, a lower bound where a small tree's round drafts fewer
    than the chain's) and of a tree of each ``spec.predict`` budget c (1 + the summed path probabilities of the c best
    nodes, from ``scores`` [B, P] sorted descending; 0 for c > P: not predicted)."""
    chain = 1 + jnp.sum(jnp.exp(jnp.cumsum(top1.astype(jnp.float32), axis=1)), axis=1)  # [B]
    if scores is None:
        return jnp.stack([chain, chain], axis=1)
    mass = jnp.cumsum(jnp.exp(scores), axis=1)  # [B, P]: 1 + mass[c - 1] for c nodes
    p = scores.shape[1]
    trees_ = [1 + mass[:, c - 1] if c <= p else jnp.zeros_like(chain) for c in spec.predict]
    used = chain if spec.tree == "chain" else 1 + mass[:, spec.budget - 1]
    return jnp.stack([used, chain, *trees_], axis=1)


def draft_step(spec: Spec, target: TargetParams, drafter: DraftParams | None, state: State):
    """draft + tree: (tree, drafter cache, predictions or None). An AR step (tree "root") drafts nothing; its token's
    context still reaches the drafter (:func:`hand_over`; a chunk of steps at a time, ``decode._ar_steps``), so a
    later round drafts as if every round had been speculative."""
    b = state.bonus.shape[0]
    if spec.tree == "root":
        return trees.root_only(b), state.dcache, None
    logits, dcache = draft_logits(spec, target, drafter, state)
    tree, pred = build_tree(spec, logits)
    return tree, dcache, pred


def layer_unroll(spec: Spec, target: TargetParams, rows: int) -> int:
    """Layers per iteration of the verify's layer loop: ``Tuning.layer_unroll``, else the backend's default for
    ``rows`` rows and the stacked layers' weights (spec.default_layer_unroll; unstacked layers run unrolled anyway)."""
    if spec.tuning.layer_unroll:
        return spec.tuning.layer_unroll
    if isinstance(target.layers, (tuple, list)):
        return 1
    layers = spec.target.num_layers
    nbytes = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(target.layers))
    return default_layer_unroll(rows, nbytes // layers, layers)


def verify(spec: Spec, target: TargetParams, state: State, tree: trees.Tree):
    """Target forward over [root + nodes] at positions length + depth: (logits [B, 1+N, V], cache, taps
    [B, T, taps*D], tokens [B, 1+N]). The block has T = ``spec.verify_len`` rows: after the 1+N real ones,
    padding rows (token 0 at the root's position) that see the prefix and themselves only; no real row sees
    them, their K/V land in scratch slots, and they have no logits."""
    n = 1 + tree.size
    pad = spec.verify_len - n
    tokens = jnp.concatenate([state.bonus[:, None], jnp.maximum(tree.tokens, 0)], axis=1)
    depths = jnp.concatenate([jnp.zeros_like(state.bonus)[:, None], tree.depths], axis=1)
    positions = state.cache.length[:, None] + jnp.pad(depths, [(0, 0), (0, pad)])
    hidden, cache, taps = model.forward(
        target, spec.target, jnp.pad(tokens, [(0, 0), (0, pad)]), positions, state.cache,
        pad_rows(tree.bits, spec.verify_len), taps=spec.taps, attention=spec.attention,
        unroll=layer_unroll(spec, target, tokens.shape[0] * spec.verify_len), tuning=spec.tuning,
    )
    return model.logits(target, hidden[:, :n]), cache, taps, tokens, depths


def round_step(spec: Spec, target: TargetParams, drafter: DraftParams | None, state: State) -> State:
    """One round, its accepted path handed to the drafter at once (:func:`hand_over`)."""
    return hand_over(spec, drafter, *commit_round(spec, target, drafter, state))


def commit_round(spec: Spec, target: TargetParams, drafter: DraftParams | None, state: State):
    """One round up to its commit (draft, tree, verify, accept + commit): (state, context, count) as
    :func:`accept_commit` returns them, the drafter's cache not yet holding the committed tokens."""
    tree, dcache, pred = draft_step(spec, target, drafter, state)
    logits, cache, taps, tokens, depths = verify(spec, target, state, tree)
    return accept_commit(spec, state, tree, dcache, logits, cache, taps, tokens, depths, pred)


def hand_over(spec: Spec, drafter: DraftParams | None, state: State, context: Array | None, count: Array) -> State:
    """Append the tap features of the last ``count`` [B] committed tokens, context [B, C, taps*D] (C >= count), to the
    drafter's cache (``dflash.extend``): both caches then hold the same tokens. No-op without a drafter."""
    if spec.draft is None:
        return state
    return dataclasses.replace(state, dcache=dflash.extend(drafter, spec.draft, state.dcache, context, count))


def accept_commit(spec: Spec, state: State, tree: trees.Tree, dcache, logits, cache, taps, tokens, depths,
                  pred: Array | None = None) -> tuple[State, Array | None, Array]:
    """The accept + commit stage: the target's choice at every node, the walk, the KV compaction and the bookkeeping
    (outputs, stop tokens, statistics). ``depths`` [B, 1+N] (the root's 0) place each node's sampling key
    (accept.node_keys); ``pred`` the round's predictions (auto). Positions along the path: ``spec.commit_len`` (one
    for an AR step). Returns (state, context: the accepted path's tap features [B, commit_len, taps*D] (None without
    a drafter), count [B]: tokens committed), for :func:`hand_over`."""
    active = ~state.done
    b = state.bonus.shape[0]
    width = spec.commit_len

    keys = accept.node_keys(state.keys, state.cache.length[:, None] + depths)
    choice = accept.choose(logits, keys, state.temperature, state.top_p, state.top_k, spec.sampling, spec.filtering)
    path, length, bonus = accept.walk(tree, choice, width - 1, impl=spec.attention)

    count = jnp.where(active, length, 0)
    cache = kvcache.compact(cache, path, count)
    emitted = jnp.take_along_axis(tokens, path, axis=1)
    emitted = jnp.concatenate([emitted[:, 1:], bonus[:, None]], axis=1)  # [B, width]: path tokens after the root
    emitted = jnp.where(jnp.arange(width)[None] < (length - 1)[:, None], emitted, bonus[:, None])
    rows = jnp.arange(b)[:, None]
    cols = state.n_out[:, None] + jnp.arange(width)[None]
    cols = jnp.where((jnp.arange(width)[None] < count[:, None]), cols, state.out.shape[1])
    out = state.out.at[rows, cols].set(emitted, mode="drop")
    n_out = state.n_out + count

    stop_at = first_stop(out, state, n_out)
    done = state.done | (cache.length >= state.limit) | (stop_at < NEVER)

    at = jnp.where(active, state.n_rounds, spec.max_rounds)  # this round's index; out of range (dropped) if done
    hist = state.accept_hist.at[jnp.arange(b), at].set(length, mode="drop")
    trace = state.trace
    if spec.trace:
        new = {"tokens": tree.tokens, "depths": tree.depths, "parents": tree.parents, "path": path, "length": length,
               "choice": choice}
        trace = {k: v.at[jnp.arange(b), at].set(_pad_nodes(new[k], v.shape[2]) if v.ndim == 3 else new[k],
                                                mode="drop") for k, v in state.trace.items()}
    forms, stats = state.forms, state.stats
    if spec.auto:
        forms = forms.at[jnp.arange(b), at].set(policy.code(spec.form), mode="drop")
        if pred is not None:  # ROUNDS, ACCEPTED, the predictions (USED, CHAIN_PRED, the trees), what trees saw
            row = jnp.concatenate([jnp.ones((b, 1)), length[:, None].astype(jnp.float32), pred,
                                   seen_trees(spec, path, length)], axis=1)
            stats = stats + jnp.where(active[:, None], row, 0.0)

    context = None if spec.draft is None else jnp.take_along_axis(taps, path[:, :, None], axis=1)
    return dataclasses.replace(
        state,
        cache=cache,
        dcache=dcache,
        bonus=jnp.where(active, bonus, state.bonus),
        out=out,
        n_out=n_out,
        stop_at=stop_at,
        done=done,
        n_rounds=state.n_rounds + active.astype(jnp.int32),
        accept_hist=hist,
        trace=trace,
        forms=forms,
        stats=stats,
    ), context, count


def seen_trees(spec: Spec, path: Array, length: Array) -> Array:
    """[B, len(spec.predict)] f32: for each predicted tree of c nodes that this round's tree holds (a best-first tree's
    first c nodes: c <= spec.budget, not for the chain), the acceptance length it would have had: the root and the
    accepted path up to its first node past c (node indices grow along a path); 0 for the others
    (policy.seen_column). path [B, W] tree indices root-first, length [B]."""
    on_path = (jnp.arange(path.shape[1])[None] < length[:, None])[:, 1:, None]  # [B, W-1, 1]
    budgets = jnp.asarray(spec.predict, jnp.int32)  # [T]
    held = (spec.tree == "best_first") & (budgets <= spec.budget)
    would = 1 + jnp.sum(on_path & (path[:, 1:, None] <= budgets), axis=1)  # [B, T]
    return jnp.where(held, would, 0).astype(jnp.float32)


def _pad_nodes(x: Array, width: int) -> Array:
    """x [B, n] padded with zeros to [B, width] (a smaller form's tree, or an AR step's one-position path, in a
    trace sized for the run's largest)."""
    return jnp.pad(x, [(0, 0), (0, width - x.shape[1])])


def first_stop(out: Array, state: State, n_out: Array) -> Array:
    """The first stop token among the generated tokens that count (before the limit), or NEVER."""
    idx = jnp.arange(out.shape[1])[None, :]
    in_range = (idx >= state.prompt_len[:, None]) & (idx < jnp.minimum(n_out, state.limit)[:, None])
    is_stop = jnp.any(out[:, :, None] == state.stop_ids[:, None, :], axis=-1) & in_range
    found = jnp.min(jnp.where(is_stop, idx, NEVER), axis=1)
    return jnp.minimum(state.stop_at, found)
