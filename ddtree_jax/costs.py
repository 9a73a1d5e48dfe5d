"""Seconds per round of each compiled program, measured on the device, corrected online and kept on disk.

``--tree-budget auto`` (ddtree_jax/policy.py) weighs each form's expected tokens against its cost at the live slot
batch. Costs are never guessed: each program is timed right after it is compiled (a few rounds on a state of its
shape, the median); the engine times a program again when its timing ran beside a compilation, came from disk, or has
aged past ``programs.COST_TTL_S`` (times its ratio to the cheapest's), and ``generate`` times every form afresh before
each decode.

A step while serving takes longer than its program's timing (the host's work beside it, the live contexts), by about
the same time a round whatever the program. So the table keeps one **offset**, an exponential moving average of what
the steps took beyond their programs' timings (any program's), and a program's cost is its timing plus the offset:
every program moves with the steps of the one that runs. (A cost per program refined by its own steps set the forms
that ran, at served speed, against the forms that had not, at their timings: on an H200 under load the table held the
tree of 64 at slot batch 4 no dearer than the tree of 16, whose few steps had refined it up 22% over its timing, and the
chain's timing at slot batch 32 18% under what its steps took: benchmarks/results/load_pair_h200.json.) A step chosen
to time its program gives its timing less the offset.

They are kept per (model shapes, dtype, device kind, attention) signature and program key in
``$DDTREE_JAX_CACHE/costs.json`` (default ``~/.cache/ddtree_jax``), so the next start and ``generate`` know them; the
offset, a property of the load of the moment, is not kept.

Each entry also records the context length (committed tokens per sequence) it was timed at; no correction for
context is applied: the offset follows the live contexts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import threading

REFINE = 0.2  # weight of one step in the offset's moving average
OUTLIER = 3.0  # a step further than this factor from its program's cost is clipped to it (a host hiccup)


def signature(*parts) -> str:
    """A short stable hash of what a cost depends on besides the program (model configs, dtype, device kind, ...)."""
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def program_key(form: str, batch: int, variant: str) -> str:
    """'64@8/greedy': a tree of 64 nodes at slot batch 8, the greedy-only program."""
    return f"{form}@{batch}/{variant}"


def default_path() -> str:
    from ddtree_jax import gguf_model

    return os.path.join(gguf_model.cache_dir(), "costs.json")


@dataclasses.dataclass
class Cost:
    seconds: float  # per round, as timed
    context: int  # committed tokens per sequence when timed


class CostTable:
    """Timings of one signature (program key -> :class:`Cost`) and the steps' offset over them. ``path`` None keeps
    them in memory only. Thread-safe."""

    def __init__(self, sig: str, path: str | None = None):
        self.signature, self.path = sig, path
        self._lock = threading.Lock()
        self._costs: dict[str, Cost] = {}
        self.offset = 0.0  # seconds a round the steps took beyond their programs' timings (moving average)
        self._dirty = False
        if path is not None:
            try:
                self._costs = {k: Cost(**v) for k, v in _read(path).get(sig, {}).items()}
            except TypeError:  # a file of another layout: timed anew
                self._costs = {}

    def _cost(self, timed: float) -> float:
        return max(timed + self.offset, timed / OUTLIER)

    def _less_offset(self, step: float) -> float:
        """The timing a step's seconds a round give (at least a step / OUTLIER)."""
        return max(float(step) - self.offset, float(step) / OUTLIER)

    def get(self, key: str) -> float | None:
        """The program's cost: seconds a round, its timing plus the offset (at least its timing / OUTLIER)."""
        with self._lock:
            c = self._costs.get(key)
            return None if c is None else self._cost(c.seconds)

    def seconds(self) -> dict[str, float]:
        """Every known cost (:meth:`get`): program key -> seconds a round (one read of the table)."""
        with self._lock:
            return {k: self._cost(c.seconds) for k, c in self._costs.items()}

    def entries(self) -> dict[str, tuple[float, float]]:
        """Program key -> (its cost, its timing without the offset), seconds a round, in one read of the table
        (/metrics shows both)."""
        with self._lock:
            return {k: (self._cost(c.seconds), c.seconds) for k, c in self._costs.items()}

    def measured(self, key: str, seconds: float, context: int, step: bool = False) -> None:
        """A fresh timing of the program (free slots after its compilation; or, with ``step``, a step chosen to time
        it, whose time holds the offset): replaces what was known."""
        with self._lock:
            self._costs[key] = Cost(self._less_offset(seconds) if step else float(seconds), int(context))
            self._dirty = True

    def observe(self, key: str, seconds: float, context: int) -> None:
        """A step of the program took ``seconds`` a round: moves the offset by ``REFINE`` of its excess over the
        program's cost (the step clipped to OUTLIER times it). A program not timed yet takes it as its timing."""
        with self._lock:
            c = self._costs.get(key)
            if c is None:
                self._costs[key] = Cost(self._less_offset(seconds), int(context))
                self._dirty = True
                return
            cost = self._cost(c.seconds)
            s = min(max(seconds, cost / OUTLIER), cost * OUTLIER)
            self.offset += REFINE * (s - cost)

    def save(self) -> None:
        """Merge this signature's costs into the file (atomically; other signatures kept). No-op in memory."""
        with self._lock:
            if self.path is None or not self._dirty:
                return
            data = _read(self.path)
            data[self.signature] = {k: dataclasses.asdict(c) for k, c in self._costs.items()}
            self._dirty = False
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path) or ".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}
