"""A finished decode read on the host: the result of :func:`decode.generate`, each sequence's final length, its
traced rounds and forms, and the check that the round statistics are ones a correct program gives."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from ddtree_jax import policy
from ddtree_jax.spec import NEVER, Spec

if TYPE_CHECKING:  # annotations only: decode builds on this module
    from ddtree_jax.round import State


@dataclasses.dataclass
class GenerateResult:
    output_ids: list[list[int]]  # per prompt: prompt + generated ids
    num_generated: list[int]
    acceptance_lengths: list[list[int]]  # per prompt, per round (empty for ar)
    rounds: list[list[dict]] | None  # with trace: per prompt, per round {tree, accepted_indices, target_choices}
    prefill_s: float
    decode_s: float
    compile_s: float = 0.0  # ahead-of-time compilation of prefill and the round loop (not in the two above;
    # about 0 when an earlier call of this process compiled the same shapes: see ``decode.compiled``)
    attention: str = ""  # the attention implementation that produced the outputs (Spec.attention; 'auto' resolved)
    round_forms: list[list[str]] | None = None  # with tree_budget "auto": per prompt, per round, the form it ran
    form_costs_ms: dict[str, tuple[float, float]] | None = None  # with tree_budget "auto": per form, ms a round as
    # timed before the decode and as the decode's own timings left it (the costs its choices weighed)
    groups: list[int] | None = None  # with tree_budget "auto": the rounds each device call of the decode ran, in order


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

