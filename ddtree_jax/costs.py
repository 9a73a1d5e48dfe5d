"""Seconds per round of each compiled program, measured on the device, refined online and kept on disk.

``--tree-budget auto`` (ddtree_jax/policy.py) weighs each form's expected tokens against its cost at the live slot
batch. Costs are never guessed: each program is timed right after it is compiled (a few rounds on a state of its
shape, the median), then refined by an exponential moving average of the engine's own step timings (elapsed time /
rounds); the engine times a program again when its cost was timed beside a compilation, read from disk, or has
aged past ``programs.COST_TTL_S`` (times its ratio to the cheapest's), and ``generate`` times every form afresh
before each decode.
They are kept per (model shapes, dtype, device kind, attention) signature and program key in
``$DDTREE_JAX_CACHE/costs.json`` (default ``~/.cache/ddtree_jax``), so the next start and ``generate`` know them.

Each entry also records the context length (committed tokens per sequence) it was measured at; no correction for
context is applied: the online refinement follows the live contexts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
import threading

REFINE = 0.2  # weight of one online timing in the moving average
OUTLIER = 3.0  # an online timing further than this factor from the estimate is clipped to it (a host hiccup)


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
    seconds: float  # per round
    context: int  # committed tokens per sequence when measured
    samples: int = 1
    timed: float = 0.0  # seconds a round as last timed (before the online refinement; 0: not known)


class CostTable:
    """Costs of one signature: program key -> :class:`Cost`. ``path`` None keeps them in memory only. Thread-safe."""

    def __init__(self, sig: str, path: str | None = None):
        self.signature, self.path = sig, path
        self._lock = threading.Lock()
        self._costs: dict[str, Cost] = {}
        self._dirty = False
        if path is not None:
            try:
                self._costs = {k: Cost(**v) for k, v in _read(path).get(sig, {}).items()}
            except TypeError:  # a file of another layout: timed anew
                self._costs = {}

    def get(self, key: str) -> float | None:
        with self._lock:
            c = self._costs.get(key)
            return None if c is None else c.seconds

    def seconds(self) -> dict[str, float]:
        """Every known cost: program key -> seconds a round (one read of the table)."""
        with self._lock:
            return {k: c.seconds for k, c in self._costs.items()}

    def timings(self) -> dict[str, float]:
        """Each program's last timing (free slots, or a step chosen to time it), before the online refinement moved
        it: beside :meth:`seconds`, how far the steps corrected it. Program key -> seconds a round."""
        with self._lock:
            return {k: c.timed for k, c in self._costs.items() if c.timed > 0}

    def measured(self, key: str, seconds: float, context: int) -> None:
        """A fresh timing of the program (after its compilation): replaces what was known."""
        with self._lock:
            self._costs[key] = Cost(float(seconds), int(context), timed=float(seconds))
            self._dirty = True

    def observe(self, key: str, seconds: float, context: int) -> None:
        """An online timing (a step's elapsed time / its rounds): moves the estimate by ``REFINE``."""
        with self._lock:
            c = self._costs.get(key)
            if c is None:
                self._costs[key] = Cost(float(seconds), int(context), timed=float(seconds))
            else:
                s = min(max(seconds, c.seconds / OUTLIER), c.seconds * OUTLIER)
                c.seconds += REFINE * (s - c.seconds)
                c.context = int(context)
                c.samples += 1
            self._dirty = True

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
