"""The speculative round and the on-device loop of rounds: methods ar, dflash and ddtree.

One round, for a batch of sequences, all on device:

    draft   the DFlash drafter proposes logits for the bs-1 positions after the last token
    tree    DDTree's best-first tree (ddtree), the argmax chain (dflash) or the bare root (ar)
    verify  one target forward over [root + tree nodes] with the ancestor-only mask
    accept  the target's choice at every node, then the walk down the agreeing path
    commit  accepted K/V moved next to the prefix, their hidden taps appended to the drafter's context, tokens appended

The loop runs rounds under ``lax.while_loop`` until every sequence is done (or a round count is
reached, so a host can stream every few rounds); no host synchronisation inside. :func:`generate` runs it for a
batch of prompts; under ``--tree-budget auto`` its groups of rounds and their timing are ``autorun.py``'s, and the
engine's slot batch (sequences entering and leaving rows of one State) is ``slots.py``'s.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import accept, draft as dflash, kernels, model, policy, tree as trees
from ddtree_jax import cache as kvcache, sharding
from ddtree_jax.config import DraftConfig, ModelConfig, check_pair
from ddtree_jax.params import (DraftParams, TargetParams, fuse_projections, input_major, output_major,
                               unstack_layers)
from ddtree_jax.tuning import LAYOUTS, Tuning
from pallas_kernels.bitmask import causal_bits, pad_rows

Array = jax.Array

AUTO = "auto"  # tree_budget: the form of every group of rounds chosen on the host (policy.py)
DEFAULT_TREE_BUDGET = AUTO
METHODS = ("ar", "dflash", "ddtree")
MAX_STOP_IDS = 8
NEVER = np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    method: str = "ar"  # "ar" | "dflash" | "ddtree"
    max_new_tokens: int = 128
    tree_budget: int | str = DEFAULT_TREE_BUDGET  # nodes of a ddtree round, or "auto" (dflash: ar or the chain)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()
    attention: str = "auto"  # "auto" | "pallas" | "pallas-inplace" | "xla"
    trace: bool = False
    seed: int = 0
    forms: tuple[str, ...] = ()  # with tree_budget "auto", the forms to choose among (default: policy.candidates)


@dataclasses.dataclass
class GenerateResult:
    output_ids: list[list[int]]  # per prompt: prompt + generated ids
    num_generated: list[int]
    acceptance_lengths: list[list[int]]  # per prompt, per round (empty for ar)
    rounds: list[list[dict]] | None  # with trace: per prompt, per round {tree, accepted_indices, target_choices}
    prefill_s: float
    decode_s: float
    compile_s: float = 0.0  # ahead-of-time compilation of prefill and the round loop (not in the two above;
    # about 0 when an earlier call of this process compiled the same shapes: see ``compiled``)
    attention: str = ""  # the attention implementation that produced the outputs (Spec.attention; 'auto' resolved)
    round_forms: list[list[str]] | None = None  # with tree_budget "auto": per prompt, per round, the form it ran


TREES = ("root", "chain", "best_first")  # Spec.tree: what one round verifies
METHOD_TREE = {"ar": "root", "dflash": "chain", "ddtree": "best_first"}  # a fixed budget's form


@dataclasses.dataclass(frozen=True)
class Spec:
    """Everything static about one compiled program of a decoding run: what the jitted functions specialise on.

    ``method`` says whether there is a drafter (ar: none); ``tree`` what one round verifies: "root" (an AR step;
    with a drafter it still hands the drafter its token's context, so drafting may resume in any later round), "chain"
    (DFlash's argmax chain) or "best_first" (DDTree's tree of ``budget`` nodes). Under ``--tree-budget auto``
    (``auto``) every program of a run shares one State layout (``room``: scratch slots and trace rows for the largest
    form) and records, per round, its form and the drafter's predictions (``State.forms``, ``State.stats``)."""

    target: ModelConfig
    draft: DraftConfig | None
    method: str
    budget: int  # tree nodes besides the root (0 for an AR step)
    max_rounds: int  # per-sequence statistics buffer length
    attention: str = "xla"
    trace: bool = False
    proposer: Callable | None = None  # replaces the DFlash drafter's propose (same signature), e.g. an oracle
    mesh: jax.sharding.Mesh | None = None  # data x model mesh: traced under sharding.use_mesh (None: one device)
    tuning: Tuning = Tuning()  # how the round runs on the device (make_spec fills in verify_align)
    sampling: bool = True  # some sequence may sample (temperature > 0); False compiles the greedy choice alone
    filtering: bool = True  # some sampled sequence may use top-k / top-p; False compiles no filter pass
    # (accept.choose: both static, so no data-dependent branch, whose predicate the GPU runtime would read on the host)
    tree: str = "best_first"  # TREES
    auto: bool = False  # rounds record their form and the drafter's predictions (State.forms, State.stats)
    room: int = 0  # nodes of the largest form sharing this State (auto): sizes the scratch slots and the trace
    predict: tuple[int, ...] = ()  # tree budgets whose expected acceptance a round records (State.stats' columns)
    build_budget: int = 0  # (auto, with a drafter) the best-first tree is built at this budget for the predictions;
    # a best_first round verifies its top ``budget`` nodes (a prefix: parents first), a chain round the chain

    @property
    def verify_len(self) -> int:
        """Rows of the verify forward: the root and the tree, padded to a multiple of ``tuning.verify_align``."""
        return round_up(1 + self.budget, self.tuning.verify_align or 1)

    @property
    def nodes_room(self) -> int:
        """Tree nodes the State's trace and scratch slots are sized for: this program's, or the run's largest."""
        return max(self.budget, self.room)

    @property
    def round_positions(self) -> int:
        """Positions past a sequence's length that a round may reach, as the engine and the server check them
        against max_position_embeddings: the root, the tree or chain, and the drafter's block (padding rows of
        the verify block sit at the root's position)."""
        return 1 + self.nodes_room + (self.draft.block_size if self.draft else 0)

    @property
    def scratch_slots(self) -> int:
        """Cache slots past the committed length that a round writes: the verify block and the drafter's (under
        auto, those of the largest form, padded as a GPU verify is, so that every program of a run fits)."""
        rows = round_up(1 + self.room, max(GPU_VERIFY_ALIGN, self.tuning.verify_align or 1)) if self.auto else 0
        return max(self.verify_len, rows) + (self.draft.block_size if self.draft else 0)

    @property
    def max_depth(self) -> int:
        return 0 if self.draft is None else self.draft.block_size - 1

    @property
    def path_len(self) -> int:
        return self.max_depth + 1

    @property
    def commit_len(self) -> int:
        """Tokens one round of this program may commit: the accepted path (``path_len``), or the root alone for an
        AR step (tree "root"), whose walk, output write, KV move and drafter context then take one position, not
        ``path_len``."""
        return 1 if self.tree == "root" else self.path_len

    @property
    def taps(self) -> tuple[int, ...]:
        return () if self.draft is None else self.draft.target_layer_ids

    @property
    def form(self) -> str:
        """This program's form, as policy.py names it: "ar", "chain" or the tree budget."""
        return {"root": policy.AR, "chain": policy.CHAIN}.get(self.tree, str(self.budget))

    def with_form(self, form: str, batch: int = 1) -> "Spec":
        """The program of ``form`` in this run (auto) at slot batch ``batch``: the same State layout; trees built at
        the largest tree budget allowed at that batch (policy.allowed) when there are predictions to record."""
        tree = {policy.AR: "root", policy.CHAIN: "chain"}.get(form, "best_first")
        budget = policy.nodes(form, self.draft.block_size) if self.draft else 0
        build = max((b for b in self.predict if policy.allowed((str(b),), batch, self.draft.block_size)),
                    default=0) if self.draft and tree != "root" else 0
        if tree == "best_first" and build < budget:
            raise ValueError(f"a tree of {budget} nodes is not allowed at slot batch {batch}")
        tuning = self.tuning
        if tuning.verify_align == default_verify_align(self.tree):  # the default: the form's own
            tuning = dataclasses.replace(tuning, verify_align=default_verify_align(tree))
        return dataclasses.replace(self, tree=tree, budget=budget, build_budget=build, tuning=tuning)


def run_forms(options: GenerateOptions) -> tuple[str, ...]:
    """The forms a run may take: one for a fixed budget (the method's), the candidates of ``auto`` otherwise
    (``options.forms`` or policy.candidates), checked against the method."""
    if options.tree_budget != AUTO or options.method == "ar":
        return (policy.AR if options.method == "ar" else policy.CHAIN if options.method == "dflash"
                else str(options.tree_budget),)
    forms = policy.parse_forms(options.forms) if options.forms else policy.candidates(options.method,
                                                                                     jax.default_backend())
    if options.method == "dflash" and policy.trees(forms):
        raise ValueError(f"method dflash takes the forms ar and chain, not trees ({', '.join(forms)})")
    return forms


def layout_method(options: GenerateOptions) -> str:
    """The method whose weight layout a run takes (:func:`device_layout`): AR's when AR steps are among its forms (a
    one-row step reads output-major matrices 4x faster; the rounds lose about 1%), else the method's."""
    return "ar" if policy.AR in run_forms(options) else options.method


def make_spec(target_cfg: ModelConfig, draft_cfg: DraftConfig | None, options: GenerateOptions,
              tuning: Tuning = Tuning(), *, batch: int = 1, **kw) -> Spec:
    """The Spec of a run's first program. A fixed tree budget: the method's form. ``tree_budget="auto"`` (methods
    dflash and ddtree): the State layout of every form allowed at slot batch ``batch`` (the smallest a run uses:
    policy.allowed), as the program of the largest; :meth:`Spec.with_form` gives the others. ``kw``: further Spec
    fields; ``tuning.verify_align`` unset becomes :func:`default_verify_align`'s for the form."""
    if options.method not in METHODS:
        raise ValueError(f"unknown method {options.method!r} (choose from {', '.join(METHODS)})")
    if options.method != "ar":
        if draft_cfg is None:
            raise ValueError(f"method {options.method} needs a drafter (--draft PATH)")
        check_pair(target_cfg, draft_cfg)
    budget = options.tree_budget
    if budget != AUTO and not (isinstance(budget, int) and not isinstance(budget, bool)):
        raise ValueError(f"tree budget must be a positive integer or 'auto', got {budget!r}")
    if options.method == "ddtree" and budget != AUTO and budget < 1:
        raise ValueError(f"tree budget must be at least 1, got {budget}")
    kw.setdefault("sampling", options.temperature > 0)
    kw.setdefault("filtering", kw["sampling"] and accept.filters(options.top_p, options.top_k))
    draft = draft_cfg if options.method != "ar" else None
    fixed = budget != AUTO or options.method == "ar"
    base = dict(target=target_cfg, draft=draft, method=options.method, max_rounds=options.max_new_tokens,
                attention=kernels.resolve_attention(options.attention), trace=options.trace)
    if tuning.verify_align is None:
        tuning = dataclasses.replace(tuning, verify_align=default_verify_align(
            METHOD_TREE[options.method] if fixed else "best_first"))
    forms = run_forms(options)
    if fixed:
        return Spec(**base, budget=policy.nodes(forms[0], draft.block_size) if draft else 0,
                    tree=METHOD_TREE[options.method], tuning=tuning, **kw)
    fits = policy.allowed(forms, batch, draft.block_size)
    if not fits:
        raise ValueError(f"no form of {', '.join(forms)} fits a verify of {policy.ROW_CAP} rows at slot batch {batch}")
    room = max(policy.nodes(f, draft.block_size) for f in fits)
    largest = max(fits, key=lambda f: policy.nodes(f, draft.block_size))
    spec = Spec(**base, budget=room, tree="best_first", auto=True, room=room, tuning=tuning,
                predict=policy.trees(fits) if options.method == "ddtree" else (), **kw)
    return spec.with_form(largest, batch)


GPU_VERIFY_ALIGN = 8


def default_verify_align(tree: str) -> int:
    """Rows of a verify block are padded to a multiple of this: ``GPU_VERIFY_ALIGN`` on GPU for trees and chains,
    the multiple XLA pads a bf16 cuBLAS GEMM's rows to anyway (otherwise with a copy of every GEMM input of every
    layer). Nothing elsewhere, nor for an AR step (tree "root": one row, row reductions, no GEMMs), where padding
    would only add work."""
    return GPU_VERIFY_ALIGN if jax.default_backend() == "gpu" and tree != "root" else 1


GPU_AR_LAYER_UNROLL = 4


def default_layer_unroll(rows: int) -> int:
    """Target layers per iteration of the layer loop of a verify forward over ``rows`` = batch x block rows:
    ``GPU_AR_LAYER_UNROLL`` for one row on GPU (an AR step at batch 1), where each iteration of the stacked
    layers' loop costs a few microseconds of bookkeeping and the step's row reductions read their layer's weights
    in place either way. 1 otherwise: unrolled, the GEMMs (cuBLAS) of a longer block no longer read the stacked
    weights in place but copy them (docs/PERFORMANCE.md)."""
    return GPU_AR_LAYER_UNROLL if jax.default_backend() == "gpu" and rows == 1 else 1


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


# ----------------------------------------------------------------------------------------- round


def draft_logits(spec: Spec, target: TargetParams, drafter: DraftParams, state: State):
    """The draft stage (dflash/ddtree): (draft logits [B, bs-1, V], the drafter cache with the block's K/V written
    in its scratch slots past the committed length)."""
    if spec.proposer is not None:
        logits = spec.proposer(drafter, spec.draft, target, state.dcache, state.bonus, attention=spec.attention)
        return logits, state.dcache
    # Keep the cache the drafter wrote its block into (scratch slots only): no copy of the draft cache.
    return dflash.propose(drafter, spec.draft, target, state.dcache, state.bonus, attention=spec.attention,
                          tuning=spec.tuning, return_cache=True)


def build_tree(spec: Spec, logits: Array) -> tuple[trees.Tree, Array | None]:
    """The tree stage: the DFlash chain or DDTree's best-first tree from draft logits [B, bs-1, V], and under auto
    the round's predictions [B, 2 + len(spec.predict)] (:func:`predictions`; None otherwise)."""
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
    log-probabilities) and of a tree of each ``spec.predict`` budget c (1 + the summed path probabilities of the c best
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
    context still reaches the drafter (:func:`hand_over`; a chunk of steps at a time, :func:`_ar_steps`), so a later
    round drafts as if every round had been speculative."""
    b = state.bonus.shape[0]
    if spec.tree == "root":
        return trees.root_only(b), state.dcache, None
    logits, dcache = draft_logits(spec, target, drafter, state)
    tree, pred = build_tree(spec, logits)
    return tree, dcache, pred


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
        unroll=spec.tuning.layer_unroll or default_layer_unroll(tokens.shape[0] * spec.verify_len), tuning=spec.tuning,
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
                                   seen_trees(spec, path, length, pred)], axis=1)
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


def seen_trees(spec: Spec, path: Array, length: Array, pred: Array) -> Array:
    """[B, 3 len(spec.predict)]: for each predicted tree of c nodes that this round's tree holds (a best-first tree's
    first c nodes: c <= spec.budget, not for the chain), 1, the acceptance length it would have had (the root and the
    accepted path up to its first node past c: node indices grow along a path) and its prediction; zeros for the
    others (policy.seen_columns). path [B, W] tree indices root-first, length [B], pred [B, 2 + len(spec.predict)]."""
    b = path.shape[0]
    held = [spec.tree == "best_first" and c <= spec.budget for c in spec.predict]
    on_path = jnp.arange(path.shape[1])[None] < length[:, None]
    zero = jnp.zeros((b,), jnp.float32)
    would = [1 + jnp.sum(on_path[:, 1:] & (path[:, 1:] <= c), axis=1).astype(jnp.float32) if h else zero
             for c, h in zip(spec.predict, held)]
    rounds = [jnp.full((b,), float(h)) for h in held]
    preds = [pred[:, 2 + i] if h else zero for i, h in enumerate(held)]
    return jnp.stack(rounds + would + preds, axis=1) if held else jnp.zeros((b, 0), jnp.float32)


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


# XLA options of every top-level compile of the round loop and prefill (``decode.compiled``, the engine's steps,
# the bench; jax takes compiler options on top-level jits only; the GPU ones are inert on CPU; they override
# XLA_FLAGS). Dynamic-slice fusion with cuBLAS GEMMs lets each GEMM read its layer's slice of the stacked weights
# in place, where XLA's Triton GEMMs copy it first (a Qwen3-8B ddtree-64 round: 9.5 against 17.2 ms). A dot-merger
# threshold of 0 stops XLA from concatenating each layer's gate+up and q/k/v weights into new buffers every round to
# merge their products. Concurrent command-buffer scheduling builds each CUDA graph from the data dependencies, so
# small independent kernels may overlap (a few percent). Measurements: docs/PERFORMANCE.md; ``bench models --ab``
# compiles with others.
XLA_OPTIONS = {
    "xla_gpu_enable_dynamic_slice_fusion": True,
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_dot_merger_threshold_mb": 0,
    "xla_gpu_command_buffer_scheduling_mode": "CONCURRENT",
}


# Every jit that donates a State keeps its unused arguments. jax pairs each donated buffer with the first output of its
# shape and dtype; when an argument the program never reads is pruned (prefill overwrites the lengths, bonus and n_out),
# the pairs shift and a pass-through output is given another leaf's buffer (prompt_len's value into n_rounds' buffer).
# XLA on an H200 miscompiled such a pairing: prefill with an input-major drafter returned n_rounds = prompt_len (a
# "decode fault", docs/CORRECTNESS.md). With every argument kept, each output takes its own input's buffer
# (tests/test_decode.py checks the pairs of the compiled programs).
donating_jit = functools.partial(jax.jit, keep_unused=True)


@functools.partial(donating_jit, static_argnums=(0,), donate_argnums=(3,))
@sharding.on_spec_mesh(batched=(3,))
def run_rounds(spec: Spec, target: TargetParams, drafter: DraftParams | None, state: State, max_rounds: Array):
    """Run rounds until every sequence is done or ``max_rounds`` more rounds have run. AR steps of a speculative run
    (tree "root" with a drafter) hand the drafter their tokens ``path_len`` steps at a time (:func:`_ar_steps`)."""

    def cond(carry):
        state, i = carry
        return jnp.any(~state.done) & (i < max_rounds)

    def body(carry):
        state, i = carry
        if spec.tree == "root" and spec.draft is not None:
            return _ar_steps(spec, target, drafter, state, max_rounds - i)
        return round_step(spec, target, drafter, state), i + 1

    state, _ = jax.lax.while_loop(cond, body, (state, jnp.int32(0)))
    return state


def _ar_steps(spec: Spec, target: TargetParams, drafter: DraftParams, state: State, most: Array):
    """Up to ``spec.path_len`` AR steps (at most ``most``, while a sequence runs), then one :func:`hand_over` of their
    tokens' tap features, collected in a buffer [B, path_len, taps*D]: the drafter's input projection and K/V
    products read their weights once for up to path_len steps, not once a step. The same features at the same
    positions as a hand-over a step: the drafter's context stays complete. (state, steps run)."""
    b, rows = state.bonus.shape[0], spec.path_len
    buffer = jnp.zeros((b, rows, spec.draft.num_taps * spec.target.hidden_size), state.dcache.k.dtype)

    def cond(carry):
        state, _, _, j = carry
        return jnp.any(~state.done) & (j < jnp.minimum(rows, most))

    def body(carry):  # a sequence's steps commit one token each until it is done: its rows are a prefix
        state, buffer, n, j = carry
        state, context, count = commit_round(spec, target, drafter, state)
        return state, jax.lax.dynamic_update_slice_in_dim(buffer, context.astype(buffer.dtype), j, 1), n + count, j + 1

    state, buffer, n, steps = jax.lax.while_loop(cond, body, (state, buffer, jnp.zeros((b,), jnp.int32), jnp.int32(0)))
    return hand_over(spec, drafter, state, buffer, n), steps


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Snapshot:
    """What the host reads after a group of rounds, per sequence [B]: one small device->host copy."""

    end: Array  # [B] final output length (cut at the limit and the first stop token)
    window: Array  # [B, W] out[start : start + W]
    done: Array  # [B] bool
    stopped: Array  # [B] bool: a stop token ended the sequence
    new_tokens: Array  # [B] tokens committed by the group's rounds
    new_rounds: Array  # [B] rounds the group ran for the sequence
    new_stats: Array | None  # (Spec.auto) [B, S] the growth of State.stats over the group


def device_final_length(state: State) -> Array:
    """:func:`final_length` on device: [B] int32."""
    cut = jnp.minimum(state.n_out, state.limit)
    return jnp.minimum(cut, jnp.where(state.stop_at < NEVER, state.stop_at + 1, state.n_out))


def group(spec: Spec, target, drafter, state: State, starts: Array, rounds: Array, most: int):
    """Up to ``rounds`` (int32, at most ``most``, static) rounds for the batch: the new state and a :class:`Snapshot`
    whose window holds each sequence's output from ``starts`` [B] (the first undelivered index) on. Traced, not
    jitted: :data:`run_group` jits it alone, ``slots.run_group_rows`` on some rows of a batch."""
    n_out0, rounds0, stats0 = state.n_out, state.n_rounds, state.stats
    state = run_rounds(spec, target, drafter, state, jnp.minimum(rounds, most))
    width = most * spec.commit_len + 1
    idx = jnp.minimum(starts[:, None] + jnp.arange(width)[None], state.out.shape[1] - 1)
    snap = Snapshot(
        end=device_final_length(state),
        window=jnp.take_along_axis(state.out, idx, axis=1),
        done=state.done,
        stopped=state.stop_at < NEVER,
        new_tokens=state.n_out - n_out0,
        new_rounds=state.n_rounds - rounds0,
        new_stats=None if stats0 is None else state.stats - stats0,
    )
    return state, snap


# A group of rounds and its Snapshot: the unit the engine and generate's auto loop dispatch (compiled with
# XLA_OPTIONS through ``compiled`` or ``.lower(...).compile(XLA_OPTIONS)``).
run_group = donating_jit(group, static_argnums=(0, 6), donate_argnums=(3,))


# ----------------------------------------------------------------------------------------- prefill


@functools.partial(donating_jit, static_argnums=(0,), donate_argnums=(3,))
@sharding.on_spec_mesh(batched=(3, 4))
def prefill(spec: Spec, target: TargetParams, drafter: DraftParams | None, state: State, tokens: Array) -> State:
    """Run the prompts [B, P_pad] (P_pad a multiple of the chunk) through the target chunk by chunk,
    fill both caches, and choose the first token. ``state`` comes from :func:`init_state`."""
    b, p_pad = tokens.shape
    chunk = min(spec.tuning.prefill_chunk, p_pad)
    lengths = state.prompt_len
    bits = causal_bits(b, chunk)

    def step(carry, c):
        cache, dcache, last = carry
        start = c * chunk
        toks = jax.lax.dynamic_slice_in_dim(tokens, start, chunk, axis=1)
        positions = start + jnp.broadcast_to(jnp.arange(chunk), (b, chunk))
        cache = dataclasses.replace(cache, length=jnp.full((b,), start, jnp.int32))
        hidden, cache, taps = model.forward(
            target, spec.target, toks, positions, cache, bits, taps=spec.taps, attention=spec.attention,
            tuning=spec.tuning,
        )
        if dcache is not None:
            dcache = dataclasses.replace(dcache, length=jnp.full((b,), start, jnp.int32))
            dcache = dflash.extend(drafter, spec.draft, dcache, taps, jnp.clip(lengths - start, 0, chunk))
        here = (lengths - 1 >= start) & (lengths - 1 < start + chunk)
        pick = jnp.take_along_axis(hidden, jnp.clip(lengths - 1 - start, 0, chunk - 1)[:, None, None], axis=1)[:, 0]
        last = jnp.where(here[:, None], pick, last)
        return (cache, dcache, last), None

    last0 = jnp.zeros((b, spec.target.hidden_size), target.embed.dtype)
    (cache, dcache, last), _ = jax.lax.scan(step, (state.cache, state.dcache, last0), jnp.arange(p_pad // chunk))
    cache = dataclasses.replace(cache, length=lengths)
    if dcache is not None:
        dcache = dataclasses.replace(dcache, length=lengths)

    logits = model.logits(target, last)[:, None]
    keys = accept.node_keys(state.keys, (lengths - 1)[:, None])
    first = accept.choose(logits, keys, state.temperature, state.top_p, state.top_k, spec.sampling,
                          spec.filtering)[:, 0]
    out = state.out.at[:, :p_pad].set(tokens).at[jnp.arange(b), lengths].set(first)
    return dataclasses.replace(state, cache=cache, dcache=dcache, bonus=first, out=out, n_out=lengths + 1)


def init_state(spec: Spec, prompt_lens, options_per_seq, capacity: int, out_len: int, dtype) -> State:
    """Empty caches and per-sequence settings for a batch. options_per_seq: list of GenerateOptions."""
    b = len(prompt_lens)
    tc = spec.target
    cache = kvcache.init(tc.num_layers, b, capacity, tc.num_kv_heads, tc.head_dim, dtype)
    dcache = None
    if spec.draft is not None:
        dc = spec.draft.layers
        dcache = kvcache.init(dc.num_layers, b, capacity, dc.num_kv_heads, dc.head_dim, dtype)
    stop = np.full((b, MAX_STOP_IDS), -1, np.int32)
    for i, o in enumerate(options_per_seq):
        if o.temperature > 0 and not spec.sampling:
            raise ValueError(f"temperature {o.temperature} needs a sampling program (Spec.sampling; make_spec sets "
                             f"it from the options' temperature), this one is greedy-only")
        if o.temperature > 0 and accept.filters(o.top_p, o.top_k) and not spec.filtering:
            raise ValueError(f"top_p {o.top_p} / top_k {o.top_k} need a filtering program (Spec.filtering; make_spec "
                             f"sets it from the options), this one samples without a filter")
        if len(o.stop_token_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids are supported, got {len(o.stop_token_ids)}")
        stop[i, : len(o.stop_token_ids)] = o.stop_token_ids
    prompt_len = jnp.asarray(prompt_lens, jnp.int32)
    trace = None
    if spec.trace:
        r, n = spec.max_rounds, spec.nodes_room
        trace = {
            "tokens": jnp.zeros((b, r, n), jnp.int32),
            "depths": jnp.zeros((b, r, n), jnp.int32),
            "parents": jnp.zeros((b, r, n + 1), jnp.int32),
            "path": jnp.zeros((b, r, spec.path_len), jnp.int32),
            "length": jnp.zeros((b, r), jnp.int32),
            "choice": jnp.zeros((b, r, n + 1), jnp.int32),
        }
    return State(
        cache=cache,
        dcache=dcache,
        bonus=jnp.zeros((b,), jnp.int32),
        out=jnp.zeros((b, out_len), jnp.int32),
        n_out=jnp.asarray(prompt_lens, jnp.int32),  # its own buffer: State leaves are donated
        prompt_len=prompt_len,
        limit=prompt_len + jnp.asarray([o.max_new_tokens for o in options_per_seq], jnp.int32),
        stop_ids=jnp.asarray(stop),
        stop_at=jnp.full((b,), NEVER, jnp.int32),
        done=jnp.zeros((b,), bool),
        keys=jax.vmap(jax.random.key)(jnp.asarray([o.seed for o in options_per_seq], jnp.uint32)),
        temperature=jnp.asarray([o.temperature for o in options_per_seq], jnp.float32),
        top_p=jnp.asarray([o.top_p for o in options_per_seq], jnp.float32),
        top_k=jnp.asarray([o.top_k for o in options_per_seq], jnp.int32),
        n_rounds=jnp.zeros((b,), jnp.int32),
        accept_hist=jnp.zeros((b, spec.max_rounds), jnp.int32),
        trace=trace,
        forms=jnp.zeros((b, spec.max_rounds), jnp.int32) if spec.auto else None,
        stats=jnp.zeros((b, policy.width(spec.predict)), jnp.float32) if spec.auto else None,
    )


# ----------------------------------------------------------------------------------------- host API


def device_layout(params, backend: str | None = None, layout: str = "auto", method: str | None = None):
    """The weights laid out for the backend and the method. On GPU: layers stacked under ``lax.scan`` (with
    ``XLA_OPTIONS`` the GEMMs read each layer's slice in place; the per-layer layout, ``params.unstack_layers``,
    avoids slicing altogether but its unrolled loop compiles for minutes) with q/k/v and gate/up fused into one
    matrix each (``params.fuse_projections``: fewer, larger products); the matrices input-major for the rounds
    (``GPU_LAYOUT``: the verify's products have 16 rows or more, GEMMs that cuBLAS reads faster so), output-major for
    ``method`` "ar" (``GPU_AR_LAYOUT``: a one-row step is then a row reduction at GEMV bandwidth,
    ``params.output_major``); a drafter output-major (``DRAFT_GPU_LAYOUT``). Elsewhere as given (stacked and
    input-major as loaded). Same math.

    ``layout`` (``Tuning.layout``) other than "auto" forces one of ``tuning.LAYOUTS``:
    "-out-major" matrices output-major, else input-major (either turned into the other); "-fused" q/k/v and gate/up
    concatenated (skipped for weights split across devices; never undone); "unstacked" per-layer buffers. A drafter
    takes the same forms (its ``fc`` stays input-major). Idempotent: callers
    that decode many times lay out once at load for their method (``generate`` then has nothing to do; weights laid
    out for the rounds and then decoded by AR are turned output-major in that call, a copy of every matrix).

    On CPU a tied output projection is also materialised once, in float32 ([D, V]): otherwise XLA:CPU
    converts and transposes the embedding outside the round loop of every call (82 ms per call for
    SmolLM2-135M's 49152 x 576, whatever the number of rounds); the math is the same (CPU dots run in f32)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, not {layout!r}")
    if params is None:
        return params
    backend = backend or jax.default_backend()
    target = isinstance(params, TargetParams)
    if layout == "auto" and backend != "gpu":
        layout = None  # as given
    elif layout == "auto":
        layout = (GPU_AR_LAYOUT if method == "ar" else GPU_LAYOUT) if target else DRAFT_GPU_LAYOUT
    if backend == "cpu" and target and params.lm_head is None and "out-major" not in (layout or ""):
        params = dataclasses.replace(params, lm_head=params.embed.T.astype(jnp.float32))
    if layout is None:
        return params
    params = output_major(params) if "out-major" in layout else input_major(params)
    if layout.endswith("-fused") and _replicated(params.layers):
        params = fuse_projections(params)
    return unstack_layers(params) if layout.startswith("unstacked") else params


def _replicated(tree) -> bool:
    """Whether every array of ``tree`` is whole on each of its devices (one device, or replicated)."""
    return all(getattr(getattr(x, "sharding", None), "is_fully_replicated", True) for x in jax.tree.leaves(tree))


# device_layout's choices on GPU (docs/PERFORMANCE.md has the measurements). For the rounds, the target's matrices
# input-major with q/k/v and gate/up fused: cuBLAS reads input-major matrices faster at every row count from 2 to 264
# (benchmarks/gemm_layouts.py), and fewer, larger products are faster.
GPU_LAYOUT = "stacked-fused"
# ... a drafter's (its products have 16 rows per sequence): output-major and fused; input-major is no faster there.
DRAFT_GPU_LAYOUT = "stacked-out-major-fused"
# ... and AR's: output-major, so that a one-row step (batch 1) is a row reduction (input-major, XLA's one-row product
# is 4x slower); batches of AR steps would be faster input-major, but one engine serves every batch size with one
# layout.
GPU_AR_LAYOUT = "stacked-out-major-fused"


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def layout(spec: Spec, prompt_lens: list[int], max_new_tokens: int) -> tuple[int, int, int]:
    """(padded prompt length, cache capacity, output buffer length) for a batch. Capacity and output length are
    rounded up to multiples of 64, so prompts of nearby lengths share shapes (and compiled programs)."""
    longest = max(prompt_lens)
    chunk = min(spec.tuning.prefill_chunk, round_up(longest, 16))
    p_pad = round_up(longest, chunk)
    capacity = round_up(max(p_pad, longest + max_new_tokens + spec.scratch_slots), 64)
    return p_pad, capacity, round_up(max(p_pad, longest + max_new_tokens + spec.path_len + 1), 64)


def round_statistics_problem(spec: Spec, n_rounds: np.ndarray, hist: np.ndarray) -> str | None:
    """What is impossible in a finished run's round statistics (n_rounds [B], accept_hist [B, R]), or None.

    Every round commits its accepted path (the root at least, at most ``path_len`` nodes), so a sequence takes at
    most ``max_new_tokens`` rounds and every recorded length is in [1, path_len]. Anything else means the compiled
    program computed wrong values: on an H200, traced runs under XLA's default GPU options (without
    ``XLA_OPTIONS``) took more rounds than tokens (docs/CORRECTNESS.md). Checked after the loop, on the host."""
    for i, n in enumerate(n_rounds.tolist()):
        if n > spec.max_rounds:
            return f"sequence {i} took {n} rounds for at most {spec.max_rounds} new tokens"
        seen = hist[i, :n]
        if seen.size and not (1 <= seen.min() and seen.max() <= spec.path_len):
            return (f"sequence {i} recorded acceptance lengths {seen.min()}..{seen.max()}, outside "
                    f"[1, {spec.path_len}]")
    return None


def fault_message(spec: Spec, problem: str) -> str:
    """The error of a decode fault; with the Pallas kernels, where to turn."""
    hint = "" if spec.attention == "xla" else f" (attention {spec.attention}; --attention xla avoids the kernels)"
    return f"decode fault, the outputs cannot be trusted: {problem}{hint}"


def final_length(state: State) -> np.ndarray:
    n_out, limit, stop_at = (np.asarray(x) for x in (state.n_out, state.limit, state.stop_at))
    return np.minimum(np.minimum(n_out, limit), np.where(stop_at < NEVER, stop_at + 1, n_out))


def trace_rounds(spec: Spec, state: State, b: int) -> list[dict]:
    """Sequence ``b``'s traced rounds (Spec.trace); under auto each cut to the nodes of the form it ran."""
    t = {k: np.asarray(v[b]) for k, v in state.trace.items()}
    forms = round_forms(spec, state, b)
    rounds = []
    for r in range(int(state.n_rounds[b])):
        n = policy.nodes(forms[r], spec.draft.block_size) if forms else t["tokens"].shape[1]
        rounds.append(
            {
                "tree": {
                    "node_token_ids": t["tokens"][r][:n].tolist(),
                    "node_depths": t["depths"][r][:n].tolist(),
                    "parents": t["parents"][r][: n + 1].tolist(),
                },
                "accepted_indices": t["path"][r][: t["length"][r]].tolist(),
                "target_choices": t["choice"][r][: n + 1].tolist(),
                **({"form": forms[r]} if forms else {}),
            }
        )
    return rounds


def round_forms(spec: Spec, state: State, b: int) -> list[str] | None:
    """The form each of sequence ``b``'s rounds ran (policy names), or None for a fixed budget."""
    if not spec.auto:
        return None
    return [policy.name(c) for c in np.asarray(state.forms[b, : int(state.n_rounds[b])]).tolist()]


_COMPILED: collections.OrderedDict = collections.OrderedDict()  # (fn, spec, abstract args) -> executable
_COMPILED_MAX = 32


def compiled(fn, spec: Spec, *args):
    """``fn.lower(spec, *args).compile(XLA_OPTIONS)``, kept for later calls with the same spec and the same
    shapes, dtypes and shardings (what ``jax.jit`` keys on): ahead-of-time compilation is never cached by jax
    itself, and a caller that decodes many times at one shape (evaluations while training, a benchmark's prompts one at a
    time) would otherwise compile every call. Least recently used beyond ``_COMPILED_MAX`` are dropped."""
    leaves, treedef = jax.tree.flatten(args)
    key = (fn, spec, treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) if hasattr(x, "shape") else x
                                    for x in leaves))  # static arguments (ints) by value
    if key in _COMPILED:
        _COMPILED.move_to_end(key)
        return _COMPILED[key]
    exe = _COMPILED[key] = fn.lower(spec, *args).compile(XLA_OPTIONS)
    if len(_COMPILED) > _COMPILED_MAX:
        _COMPILED.popitem(last=False)
    return exe


def start(spec: Spec, prompts: list[list[int]], per_row: list[GenerateOptions], max_new_tokens: int, dtype,
          mesh: jax.sharding.Mesh | None = None) -> tuple[State, Array]:
    """A batch laid out (:func:`layout`) for :func:`prefill` and :func:`run_rounds` under ``spec``: (the initial
    State, the padded prompt tokens [B, P] int32), each row with its own options (seed, sampling, max_new_tokens up
    to ``max_new_tokens``); on ``mesh``, placed there (the batch a multiple of its data axis:
    ``sharding.padded_batch``). The spec is not fitted to the batch (prefill cuts its chunk to P itself), so prompts
    whose buffers round to the same sizes share the compiled round loop whatever their padded lengths."""
    lens = [len(p) for p in prompts]
    p_pad, capacity, out_len = layout(spec, lens, max_new_tokens)
    tokens = np.zeros((len(prompts), p_pad), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    state = sharding.create(functools.partial(init_state, spec, lens, per_row, capacity, out_len, dtype), mesh)
    tokens = jnp.asarray(tokens) if mesh is None else jax.device_put(tokens, sharding.batch_sharding(mesh, 2))
    return state, tokens


def generate(
    target,
    prompts: list[list[int]],
    options: GenerateOptions,
    *,
    draft=None,
    on_tokens: Callable[[list[list[int]]], None] | None = None,
    stream_every: int = 4,
    proposer: Callable | None = None,
    mesh: jax.sharding.Mesh | None = None,
    tuning: Tuning = Tuning(),
    persist_costs: bool = False,
    chooser: policy.Policy | None = None,
) -> GenerateResult:
    """Generate for a batch of prompts. target: (ModelConfig, TargetParams); draft: (DraftConfig, DraftParams).

    on_tokens, when given, is called every ``stream_every`` rounds with the tokens each sequence gained.
    proposer, when given, replaces ``draft.propose`` (same signature): a research hook for other drafters.
    mesh, when given (``sharding.make_mesh``), runs tensor/data parallel: the weights are placed on it (KV
    heads repeated when the model axis exceeds them) and the batch is padded to a multiple of its data axis.
    tuning: how the decode runs on the device (its layout applied to the weights here; ``ddtree_jax.tuning``).

    ``options.tree_budget="auto"`` (dflash, ddtree): groups of rounds (``autorun.GROUP_ROUNDS``, or ``stream_every``
    when streaming; the first ones ``autorun.FIRST_GROUPS``), each of the form a :class:`policy.Policy` (``chooser``,
    default a new one) picks from the statistics of the groups read so far, weighed against each program's seconds
    per round (timed here unless known; with ``persist_costs`` read from and kept in the cache directory's cost table,
    ``autorun.cost_table_for``). Group g + 1 is dispatched before group g's statistics are read, so the device never
    waits for the host's choice (:class:`autorun.AutoRun`).

    A decode fault (round statistics no correct program gives: ``round_statistics_problem``) raises RuntimeError.
    """
    if mesh is not None:
        target = sharding.shard_model(target, mesh)
        draft = sharding.shard_model(draft, mesh) if draft is not None and options.method != "ar" else draft
    tcfg, tparams = target
    dcfg, dparams = draft if draft is not None else (None, None)
    auto = options.tree_budget == AUTO and options.method != "ar"
    tparams = device_layout(tparams, layout=tuning.layout, method=layout_method(options))
    dparams = device_layout(dparams, layout=tuning.layout)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if options.max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    for p in prompts:
        bad = [t for t in p if not 0 <= t < tcfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} outside the vocabulary (size {tcfg.vocab_size})")
    rows = prompts + [prompts[0][:1]] * (sharding.padded_batch(len(prompts), mesh) - len(prompts))  # + dummies
    spec = make_spec(tcfg, dcfg, options, tuning, proposer=proposer, mesh=mesh, batch=len(rows))
    if spec.method == "ar":
        dparams = None
    lens = [len(p) for p in rows]
    per_row = [dataclasses.replace(options, seed=options.seed + i) for i in range(len(prompts))]  # row i: seed + i
    per_row += [dataclasses.replace(options, max_new_tokens=1)] * (len(rows) - len(prompts))
    state, tokens = start(spec, rows, per_row, options.max_new_tokens, tparams.embed.dtype, mesh)

    t0 = time.perf_counter()  # compile ahead of time so that the timings below are execution only
    prefill_fn = compiled(prefill, spec, tparams, dparams, state, tokens)
    if auto:
        from ddtree_jax import autorun  # here: autorun builds on this module (its State, programs and run_group)

        def fresh():
            return start(spec, rows, per_row, options.max_new_tokens, tparams.embed.dtype, mesh)[0]

        table = autorun.cost_table_for(spec, tparams.embed.dtype, persist=persist_costs)
        run = autorun.AutoRun(spec, options, tparams, dparams, fresh, len(prompts), stream_every if on_tokens else
                              autorun.GROUP_ROUNDS, table, chooser)
    else:
        per_call = stream_every if on_tokens else options.max_new_tokens + 1  # rounds per run_rounds call
        budget_rounds = jnp.int32(per_call)
        rounds_fn = compiled(run_rounds, spec, tparams, dparams, state, budget_rounds)
    compile_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    state = prefill_fn(tparams, dparams, state, tokens)
    jax.block_until_ready(state.bonus)
    prefill_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    if auto:
        state = run.decode(state, lens, on_tokens)
    else:
        emitted = np.asarray(lens)
        for _ in range(-(-spec.max_rounds // per_call)):  # every round commits a token: enough calls
            state = rounds_fn(tparams, dparams, state, budget_rounds)
            if on_tokens is not None:
                ends = final_length(state)
                out = np.asarray(state.out)
                on_tokens([out[i, emitted[i] : ends[i]].tolist() for i in range(len(prompts))])
                emitted = np.maximum(emitted, ends)
            if bool(jnp.all(state.done)):
                break
        else:
            raise RuntimeError(fault_message(spec, f"unfinished after {spec.max_rounds} rounds"))
    jax.block_until_ready(state.out)
    decode_s = time.perf_counter() - t0 - (run.measure_s if auto else 0.0)  # warming and timing forms count as compiling

    ends = final_length(state)
    out = np.asarray(state.out)
    hist = np.asarray(state.accept_hist)
    n_rounds = np.asarray(state.n_rounds)
    problem = round_statistics_problem(spec, n_rounds[: len(prompts)], hist[: len(prompts)])
    if problem:
        raise RuntimeError(fault_message(spec, problem))
    return GenerateResult(
        output_ids=[out[i, : ends[i]].tolist() for i in range(len(prompts))],
        num_generated=[int(ends[i] - lens[i]) for i in range(len(prompts))],
        acceptance_lengths=[[] if spec.method == "ar" else hist[i, : n_rounds[i]].tolist() for i in range(len(prompts))],
        rounds=[trace_rounds(spec, state, i) for i in range(len(prompts))] if spec.trace else None,
        prefill_s=prefill_s,
        decode_s=decode_s,
        compile_s=compile_s + (run.measure_s if auto else 0.0),
        attention=spec.attention,
        round_forms=[round_forms(spec, state, i) for i in range(len(prompts))] if auto else None,
    )
