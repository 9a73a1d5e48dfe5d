"""What a decoding run is, before anything runs: the user's options and the static Spec of each compiled program.

:class:`GenerateOptions` are what a caller asks for (method, tree budget, sampling, stop tokens); :func:`make_spec`
turns them into the :class:`Spec` of a run's first program (``Spec.with_form`` gives the others under
``--tree-budget auto``), checking them on the way, with the per-form defaults of how the verify runs on the device
(:func:`default_verify_align`, :func:`default_layer_unroll`). ``round.py`` and ``decode.py`` run the programs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from ddtree_jax import accept, kernels, policy
from ddtree_jax.config import DraftConfig, ModelConfig, check_pair
from ddtree_jax.tuning import Tuning

AUTO = "auto"  # tree_budget: the form of every group of rounds chosen on the host (policy.py)
DEFAULT_TREE_BUDGET = AUTO
METHODS = ("ar", "dflash", "ddtree")
MAX_STOP_IDS = 8  # stop token ids per sequence: the width of round.State.stop_ids
NEVER = np.iinfo(np.int32).max  # round.State.stop_at of a sequence that met no stop token


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
    hand_over_rows: int = 0  # (AR steps with a drafter) steps whose tap features one hand-over gives the drafter, at
    # most (0: path_len); decode.group sets its call's rounds, so a call of fewer steps projects no padding rows

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
    def draft_depths(self) -> int:
        """Depths of draft logits a round uses (the rows of the drafter's output head): the chain's every depth; a
        best-first tree of c nodes (the one built: ``build_budget`` under auto) reaches depth c at most, so only its
        first min(c, max_depth) depths. The drafter still runs its whole block (its attention inside the block is
        bidirectional); only the vocabulary product, the largest part of a draft on CPU, is cut."""
        if self.tree != "best_first":
            return self.max_depth
        return min(self.max_depth, self.build_budget or self.budget)

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

    def per_call(self, rounds: int) -> "Spec":
        """This program as a device call of at most ``rounds`` rounds runs it (decode.group): AR steps with a drafter
        hand it their features at most that many steps at once (``hand_over_rows``), not path_len's padding rows."""
        if self.tree != "root" or self.draft is None:
            return self
        return dataclasses.replace(self, hand_over_rows=min(rounds, self.path_len))

    def with_form(self, form: str, batch: int = 1) -> "Spec":
        """The program of ``form`` in this run (auto) at slot batch ``batch``: the same State layout; when there are
        predictions to record (``predict``), the tree built for them at :func:`build_budget`."""
        tree = {policy.AR: "root", policy.CHAIN: "chain"}.get(form, "best_first")
        budget = policy.nodes(form, self.draft.block_size) if self.draft else 0
        fits = ()  # the predicted tree budgets allowed at this slot batch
        if self.draft:
            fits = policy.trees(policy.allowed([str(b) for b in self.predict], batch, self.draft.block_size))
        if tree == "best_first" and budget not in fits:
            raise ValueError(f"a tree of {budget} nodes is not allowed at slot batch {batch}")
        build = build_budget(tree, budget, fits)
        tuning = self.tuning
        if tuning.verify_align == default_verify_align(self.tree):  # the default: the form's own
            tuning = dataclasses.replace(tuning, verify_align=default_verify_align(tree))
        return dataclasses.replace(self, tree=tree, budget=budget, build_budget=build, tuning=tuning)


def build_budget(tree: str, budget: int, fits: Sequence[int]) -> int:
    """Nodes of the best-first tree an auto round builds for its predictions (0: none), among the predicted tree
    budgets ``fits`` allowed at its slot batch: for a tree, the next larger one (itself if it is the largest), so that
    its rounds show the drafter's prediction of the next tree up without paying for the largest tree's build (the
    vocabulary top-k and the selections grow with the nodes; the policy climbs a size a group); for the chain, the
    cheapest probe after AR steps, the largest, so that its rounds predict every tree; none for an AR step."""
    if tree == "root" or not fits:
        return 0
    if tree == "chain":
        return max(fits)
    return min((b for b in fits if b > budget), default=budget)


def run_forms(options: GenerateOptions, moe: bool = False) -> tuple[str, ...]:
    """The forms a run may take: one for a fixed budget (the method's), the candidates of ``auto`` otherwise
    (``options.forms`` or policy.candidates; ``moe``: the target is a mixture of experts), checked against the
    method."""
    if options.tree_budget != AUTO or options.method == "ar":
        return (policy.AR if options.method == "ar" else policy.CHAIN if options.method == "dflash"
                else str(options.tree_budget),)
    forms = policy.parse_forms(options.forms) if options.forms else policy.candidates(options.method,
                                                                                     jax.default_backend(), moe)
    if options.method == "dflash" and policy.trees(forms):
        raise ValueError(f"method dflash takes the forms ar and chain, not trees ({', '.join(forms)})")
    return forms


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
    forms = run_forms(options, moe=bool(target_cfg.num_experts))
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
SMALL_LAYER_BYTES = 16 << 20  # a stacked layer's weights up to which the GPU's layer loop is unrolled whole


def default_layer_unroll(rows: int, layer_bytes: int, layers: int) -> int:
    """Target layers per iteration of the layer loop of a verify forward over ``rows`` = batch x block rows, for a
    stack of ``layers`` layers of ``layer_bytes`` bytes of weights each. On GPU: every layer (one iteration) when the
    layers are small (at most ``SMALL_LAYER_BYTES``: the default pair's target has 7 MB a layer), since each iteration
    costs the host tens of microseconds (its command buffer updated and launched), more than such a layer's kernels
    take, while the weight slices the unrolled GEMMs copy cost a few; ``GPU_AR_LAYER_UNROLL`` for one row (an AR step
    at batch 1), whose row reductions read their layer's weights in place either way; 1 otherwise: unrolled, the
    GEMMs (cuBLAS) of a longer block no longer read the stacked weights in place but copy them (0.4 GB a layer on
    Qwen3-8B). 1 elsewhere. Measurements: docs/PERFORMANCE.md#why-the-defaults-are-what-they-are."""
    if jax.default_backend() != "gpu":
        return 1
    if layer_bytes <= SMALL_LAYER_BYTES:
        return layers
    return GPU_AR_LAYER_UNROLL if rows == 1 else 1


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m
