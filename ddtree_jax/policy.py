"""What each round does, chosen on the host between groups of rounds (``--tree-budget auto``): pure numpy.

A *form* is what one round verifies: "ar" (the root alone: an autoregressive step), "chain" (DFlash's argmax chain of
block_size - 1 nodes) or a best-first tree of b nodes (the form "b", e.g. "64"). Each form at each slot batch is its own
compiled program; every program of a run shares one decode State, so the host may switch between groups of rounds.

The rounds record, per sequence, what the drafter expected and what the target accepted (``round.State.stats``, sums
over rounds in the columns below). The expected acceptance of a tree of c nodes, if the target behaved like the drafter,
is 1 + the sum of the path probabilities of its c best nodes (a best-first tree gives every smaller one as its prefix;
a tree round builds at the next tree size up, a chain round at the largest: ``spec.build_budget``, so a tree round's
group predicts one size up and a run climbs a size a group); the chain's is 1 + sum_d prod_{j<=d} p_top1(j). The
drafter is over- or under-confident, so :class:`Policy` keeps per sequence an exponential moving ratio

    r_i = (accepted - 1) / (predicted for the form used - 1)        (clipped to [0, RATIO_MAX])

and expects E_i(c) = 1 + r_i k_i(c) (pred_i(c) - 1) tokens a round from form c (an AR step: exactly 1). A new sequence's
r_i starts at the others' (1 for the first), worth PRIOR_ROUNDS rounds against its own first group. A tree round also
shows what every smaller tree would have accepted (its c best nodes are that tree: the accepted path up to its first
node past c), so each tree form c keeps a moving factor k_i(c): its own ratio in those rounds over the ratio of the form
they ran (1 until seen; a larger tree never seen takes the largest smaller one's; the chain 1). A group of a smaller
tree u moves the reference toward u's ratio, so the larger trees it did not show keep their factor over u's (scaled as
k_i(u) moves): a tree of 64 seen at 0.88x the tree of 32's ratio stays at that after groups of 32. A large tree whose
extra nodes the drafter overrates is then seen to accept less than its prediction and is left, while the smaller trees
are not underrated by its low ratio; and as factors, not ratios, they follow r_i when only the chain probes (a drafter
useless for a while, then useful again). It picks the (form, slot batch) with the most expected tokens per second, sum_i
E_i(c) / cost(c, n), among the ready programs whose cost is known (``costs.CostTable``: seconds a round, measured on the
device). When AR wins no prediction arrives any more, so after N AR groups one group probes the cheapest speculative
form; N doubles after each probe that changes nothing (up to ``MAX_PROBE_EVERY``) and restarts when speculation wins.
The wait is N AR groups times the probe's cost over AR's (a chain at a large slot batch costs several AR steps), so a
probe's extra time stays under 1/N of the AR time between probes, whatever the load: a useless drafter costs AR under 2%
of its speed. Each slot batch keeps its own N (:class:`Probing`): a lone request's win, where speculation is cheap, says
nothing of a full batch, and must not bring back a full batch's dear probes; a win restarts the waits of its slot batch
and of the smaller ones. A slot batch AR first wins at starts from the longest wait a smaller one has earned: what did
not pay where speculation is cheaper will not pay there (a server's load grows through its slot batches, and each new
one would otherwise probe from 2).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping, Sequence

import numpy as np

AR, CHAIN = "ar", "chain"
GPU_TREES = (16, 32, 64, 128, 256)  # tree budgets auto chooses among on a GPU (besides ar and the chain)
# ... for a mixture-of-experts target, whose verify reads more experts the more nodes it holds: on an H200 at
# Qwen3-Coder-30B-A3B's shape a tree of 8 costs 0.90x one of 16, 256 costs 1.20x 128 (docs/MOE.md)
MOE_GPU_TREES = (8, 16, 32, 64, 128)
CPU_TREES = (4, 8, 16)  # ... on CPU, where a verify costs in proportion to its rows: small trees only
# Verify rows (slot batch x (1 + nodes)) above which a tree is no candidate. On an H200 a bf16 GEMM turns
# compute-bound at about 200 rows (989 TFLOP/s over 4.8 TB/s), so a verify of 1024 rows costs about five AR steps of
# the same batch: only an acceptance above five could pay for it. The cap bounds the programs to compile (32 greedy
# ones at --max-batch 32 with the GPU forms) and the logits' memory (rows x vocabulary x 4 bytes: 0.6 GB for Qwen3).
ROW_CAP = 1024

# Columns of round.State.stats [B, STATS + 2 len(trees)] float32 (:func:`width`): per sequence, sums over its rounds.
# Only rounds that drafted (not AR steps) add to them.
ROUNDS, ACCEPTED, USED, CHAIN_PRED = 0, 1, 2, 3  # rounds; their acceptance lengths; the prediction of the form used;
# the chain's prediction. Column STATS + i: the prediction of a tree of trees[i] nodes (0 where the round's tree was
# built smaller: not predicted). Column STATS + len(trees) + i (:func:`seen_column`): the acceptance length a tree of
# trees[i] nodes would have had, in the rounds whose tree held it (0 in the others). A group of rounds runs one form,
# so the host knows which those were: all of the group's rounds when its form is a tree of trees[i] nodes or more.
STATS = 4


def width(trees: Sequence[int]) -> int:
    """Columns of round.State.stats for the tree budgets ``trees`` (Spec.predict)."""
    return STATS + 2 * len(trees)


def seen_column(trees: Sequence[int], i: int) -> int:
    """The column of what a tree of trees[i] nodes would have accepted in the rounds whose tree held it."""
    return STATS + len(trees) + i


SMOOTHING = 0.1  # weight of one round in the moving averages: a group of 8 rounds weighs 1 - 0.9^8 = 0.57
PRIOR_ROUNDS = 8.0  # what a ratio not yet observed (1 for a new Policy, the others' for a new sequence) weighs, in
# rounds, against a sequence's first group: a response's first rounds accept little, and 2 rounds taken alone sent
# decodes to AR steps (one of 8 held-out questions on 2 CPU cores; about 3 prompts in 8 on an H100); against 4
# (generate's first group, autorun.FIRST_GROUP) 3 of 9 default decodes on 2 CPU cores ran 8-76 AR steps
EXPLORE_SPREAD = 1.25  # a group that explores takes an unknown form costing at most this times the cheapest one
RATIO_MAX = 2.0
FACTOR_MAX = 4.0  # a tree's factor on the ratio (k_i(c)), at most
FIRST_PROBE_EVERY = 2  # AR groups before the first probe of a speculative form
MAX_PROBE_EVERY = 64


def tree_budget(form: str) -> int | None:
    """The node count of a tree form ("64" -> 64); None for "ar" and "chain"."""
    return int(form) if form not in (AR, CHAIN) else None


def nodes(form: str, block_size: int) -> int:
    """Tree nodes besides the root that a round of ``form`` verifies."""
    return 0 if form == AR else block_size - 1 if form == CHAIN else int(form)


def code(form: str) -> int:
    """The form as round.State.forms stores it: 0 for ar, -1 for the chain, b for a tree of b nodes."""
    return 0 if form == AR else -1 if form == CHAIN else int(form)


def name(form_code: int) -> str:
    """The inverse of :func:`code`."""
    return AR if form_code == 0 else CHAIN if form_code == -1 else str(int(form_code))


def parse_forms(items: Iterable[str | int]) -> tuple[str, ...]:
    """Forms given by a user ("ar", "chain", tree budgets), checked and without repeats; ValueError otherwise."""
    out = []
    for item in items:
        text = str(item).strip().lower()
        if text not in (AR, CHAIN) and not (text.isdigit() and int(text) >= 1):
            raise ValueError(f"unknown form {item!r}: ar, chain or a tree budget (a positive integer)")
        form = text if text in (AR, CHAIN) else str(int(text))
        if form not in out:
            out.append(form)
    if not out:
        raise ValueError("no forms given")
    return tuple(out)


def candidates(method: str, backend: str, moe: bool = False) -> tuple[str, ...]:
    """The forms ``auto`` chooses among by default: ar alone for method ar; ar and the chain for dflash; for ddtree
    also trees of ``GPU_TREES`` nodes on a GPU (``MOE_GPU_TREES`` for a mixture-of-experts target; ``CPU_TREES``
    elsewhere)."""
    if method == "ar":
        return (AR,)
    if method == "dflash":
        return (AR, CHAIN)
    trees_ = CPU_TREES if backend != "gpu" else MOE_GPU_TREES if moe else GPU_TREES
    return (AR, CHAIN) + tuple(str(b) for b in trees_)


def allowed(forms: Sequence[str], batch: int, block_size: int, row_cap: int = ROW_CAP) -> tuple[str, ...]:
    """The forms whose verify (batch x (1 + nodes) rows) fits ``row_cap``; "ar" always."""
    return tuple(f for f in forms if f == AR or batch * (1 + nodes(f, block_size)) <= row_cap)


def trees(forms: Sequence[str]) -> tuple[int, ...]:
    """The tree budgets among ``forms``, ascending."""
    return tuple(sorted(b for f in forms if (b := tree_budget(f)) is not None))


@dataclasses.dataclass
class Probing:
    """The probes' state at one slot batch."""

    every: int = FIRST_PROBE_EVERY  # N: AR groups between probes (times the probe's cost over AR's)
    ar_groups: int = 0  # AR groups since the last probe or speculative choice
    probed: bool = False  # a probe's statistics arrived since the last choice here


@dataclasses.dataclass
class Estimate:
    """What is known of one sequence (or, as the prior of new ones, of all)."""

    ratio: float = 1.0  # of the forms used (any tree, the chain)
    preds: dict[str, float] = dataclasses.field(default_factory=dict)  # form -> predicted acceptance length
    factors: dict[str, float] = dataclasses.field(default_factory=dict)  # tree form -> its factor k on ratio, where seen
    observed: bool = False


def _ratio(rounds: float, accepted: float, predicted: float) -> float | None:
    """(accepted - rounds) / (predicted - rounds), clipped to [0, RATIO_MAX]; None when nothing beyond the roots was
    predicted."""
    excess = predicted - rounds
    if excess <= 1e-3 * rounds:
        return None
    return min(max((accepted - rounds) / excess, 0.0), RATIO_MAX)


class Policy:
    """Chooses the (form, slot batch) of the next group of rounds; host-side, one per engine or generate call.

    forms: the candidate forms; columns: the tree budgets of round.State.stats' tree columns (in order);
    prior_rounds: what a ratio not yet observed weighs against a sequence's first group, in rounds (0: the first
    group's ratio replaces it).
    Sequences are keyed by any hashable (the engine's slots, generate's rows)."""

    def __init__(self, forms: Sequence[str], columns: Sequence[int], prior_rounds: float = PRIOR_ROUNDS):
        self.forms = tuple(forms)
        self.columns = tuple(columns)
        self.prior_rounds = prior_rounds
        self.prior = Estimate()
        self.seqs: dict = {}
        self.probing: dict[int, Probing] = {}  # slot batch -> its probes' state
        self._probe_out: int | None = None  # the slot batch of a probe whose statistics have not arrived (they come
        # a group late)
        self.probes = 0  # choices that were probes (the engine's metrics tell its rounds apart by them)
        self.choices = 0  # calls of choose
        self.last: dict[str, float] = {}  # at the last choice: form -> mean E_i over its sequences (known forms)
        self._exploring: set[str] = set()  # forms chosen to learn about whose statistics have not arrived

    # ---------------------------------------------------------------- sequences
    def start(self, seq) -> None:
        """A new sequence: it starts from the prior (what the sequences before it showed)."""
        self.seqs[seq] = Estimate(self.prior.ratio, dict(self.prior.preds), dict(self.prior.factors), False)

    def end(self, seq) -> None:
        self.seqs.pop(seq, None)

    def observe(self, seq, form: str, sums: np.ndarray) -> None:
        """One group's statistics of sequence ``seq`` (a row of round.State.stats' growth over the group), whose
        rounds ran ``form``."""
        rounds = float(sums[ROUNDS])
        if rounds <= 0:
            return  # AR steps: nothing drafted
        self._exploring.discard(form)
        if seq not in self.seqs:
            self.start(seq)
        preds = {CHAIN: float(sums[CHAIN_PRED]) / rounds}
        preds.update({str(b): float(s) / rounds for b, s in zip(self.columns, sums[STATS:]) if s > 0})
        ratio = _ratio(rounds, float(sums[ACCEPTED]), float(sums[USED]))
        factors = {}  # tree form -> its ratio over the form used's, for every tree the group's tree held
        used = tree_budget(form) or 0
        for i, b in enumerate(self.columns):
            if b <= used and ratio and (r := _ratio(rounds, float(sums[seen_column(self.columns, i)]),
                                                    float(sums[STATS + i]))) is not None:
                factors[str(b)] = min(r / ratio, FACTOR_MAX)
        weight = 1.0 - (1.0 - SMOOTHING) ** rounds
        for est in (self.seqs[seq], self.prior):
            first = not est.observed
            if ratio is not None:
                w = rounds / (rounds + self.prior_rounds) if first else weight
                est.ratio += w * (ratio - est.ratio)
            for f, p in preds.items():
                old = est.preds.get(f)
                est.preds[f] = p if old is None or first else old + weight * (p - old)
            before = est.factors.get(form)  # the group's own tree's factor, in the reference of the forms before
            for f, k in factors.items():
                old = est.factors.get(f)
                est.factors[f] = k if old is None or first else old + weight * (k - old)
            if before and (now := est.factors.get(form)):  # the larger trees this group did not show keep their
                for f in est.factors:  # factor over its tree's, which the reference moving toward it rescales
                    if int(f) > used:
                        est.factors[f] = min(est.factors[f] * now / before, FACTOR_MAX)
            est.observed = True
        if form != AR and self._probe_out is not None:  # a probe's, not those of speculation that ran before AR won
            if (state := self.probing.get(self._probe_out)) is not None:
                state.probed = True
            self._probe_out = None

    # ---------------------------------------------------------------- expectations
    def pred(self, est: Estimate, form: str) -> float | None:
        """The predicted acceptance length of ``form`` for a sequence; a tree budget never predicted takes the largest
        smaller one's (a lower bound); None when nothing is known."""
        if form == AR:
            return 1.0
        if form in est.preds:
            return est.preds[form]
        b = tree_budget(form)
        known = [(int(f), p) for f, p in est.preds.items() if f != CHAIN and int(f) < (b or 0)]
        return max(known)[1] if known else None

    @staticmethod
    def ratio(est: Estimate, form: str) -> float:
        """r_i k_i(form): the ratio times a tree's factor (its own where seen, else the largest smaller seen tree's,
        else 1; the chain's 1), at most RATIO_MAX."""
        b = tree_budget(form)
        smaller = [(int(f), k) for f, k in est.factors.items() if int(f) <= (b or 0)]
        return min(est.ratio * (max(smaller)[1] if smaller else 1.0), RATIO_MAX)

    def expected(self, seq, form: str) -> float | None:
        """E_i(form): tokens a round of ``form`` is expected to commit for sequence ``seq``; None when unknown."""
        est = self.seqs.get(seq, self.prior)
        p = self.pred(est, form)
        return None if p is None else 1.0 + self.ratio(est, form) * (p - 1.0)

    def total(self, seqs: Iterable, form: str) -> float | None:
        values = [self.expected(s, form) for s in seqs]
        return None if any(v is None for v in values) else float(sum(values))

    # ---------------------------------------------------------------- choice
    def choose(self, seqs: Sequence, options: Mapping[tuple[str, int], float]) -> tuple[str, int]:
        """The (form, slot batch) among ``options`` ((form, batch) -> seconds a round, the ready programs that can
        hold ``seqs``) with the most expected tokens per second. While some form's expectation is unknown (nothing
        observed yet) a group explores: of the unknown forms costing at most EXPLORE_SPREAD times the cheapest, the
        largest tree (its rounds predict every smaller tree and the next one up, and show what each smaller one would
        have accepted; the chain, which accepts least, last), each once until its statistics arrive (a group late);
        after AR has won N groups in a row at its slot batch (times the probe's cost over AR's, at least 1:
        :class:`Probing`), one group probes the cheapest speculative form."""
        if not options:
            raise ValueError("no program to choose from")
        totals = {form: self.total(seqs, form) for form in {f for f, _ in options}}  # once per form, not per batch
        self.choices += 1
        self.last = {f: t / len(seqs) for f, t in totals.items() if t is not None and seqs}
        speculative = sorted(((c, k) for k, c in options.items() if k[0] != AR), key=lambda x: x[0])
        unknown = [k for c, k in speculative if totals[k[0]] is None]
        if unknown:  # of those within EXPLORE_SPREAD times the cheapest, the one whose rounds teach the most
            near = sorted((k for k in unknown if options[k] <= EXPLORE_SPREAD * options[unknown[0]]),
                          key=lambda k: -(tree_budget(k[0]) or 0))
            pick = next((k for k in near if k[0] not in self._exploring), near[0])
            self._exploring.add(pick[0])
            return pick
        best = max(options, key=lambda k: (totals[k[0]] / options[k], -options[k]))
        if best[0] != AR:  # speculation pays here, and where it is cheaper: the smaller slot batches
            self.probing = {n: p for n, p in self.probing.items() if n > best[1]}
            self._probe_out = None
            return best
        if not speculative:  # nothing to probe now (e.g. no speculative program timed at this slot batch yet): the
            return best  # wait between probes stays what the probes so far earned
        if best[1] not in self.probing:
            self.probing[best[1]] = self._first_probing(best[1])
        state = self.probing[best[1]]
        if state.probed:  # the last probe changed nothing
            state.every, state.probed = min(2 * state.every, MAX_PROBE_EVERY), False
        state.ar_groups += 1
        cost, probe = speculative[0]
        if state.ar_groups >= state.every * max(1.0, cost / options[best]):
            state.ar_groups, self._probe_out = 0, best[1]
            self.probes += 1
            return probe
        return best

    def _first_probing(self, batch: int) -> Probing:
        """The probes' state of a slot batch AR first wins at: the longest wait a smaller slot batch has earned (where
        speculation is cheaper and still did not pay, it will not pay here either), else FIRST_PROBE_EVERY."""
        return Probing(max((p.every for n, p in self.probing.items() if n < batch), default=FIRST_PROBE_EVERY))

    def summary(self, seqs: Sequence, form: str) -> tuple[float, float]:
        """(mean E_i at ``form``, mean r_i(form)) over ``seqs``, for /metrics; NaN without sequences."""
        if not seqs:
            return math.nan, math.nan
        e = [self.expected(s, form) for s in seqs]
        r = [self.ratio(self.seqs.get(s, self.prior), form) for s in seqs]
        return float(np.mean([x for x in e if x is not None] or [math.nan])), float(np.mean(r))
