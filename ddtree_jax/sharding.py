"""Logical axes -> mesh axes: one rules table; the model code names logical axes only.

Without an active mesh (:func:`use_mesh`), :func:`constrain` is the identity, so single-device code
pays nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Rules:
    """Which mesh axis (or None) each logical axis is split over."""

    batch: str | None = "data"
    seq: str | None = None
    embed: str | None = None
    heads: str | None = "model"
    kv_heads: str | None = "model"
    head_dim: str | None = None
    mlp: str | None = "model"
    vocab: str | None = "model"
    layers: str | None = None
    taps: str | None = None
    cache_seq: str | None = None
    nodes: str | None = None

    def spec(self, axes: tuple[str | None, ...]) -> P:
        return P(*(None if a is None else getattr(self, a) for a in axes))


_ACTIVE: list[tuple[jax.sharding.Mesh, Rules]] = []


@contextlib.contextmanager
def use_mesh(mesh: jax.sharding.Mesh, rules: Rules = Rules()):
    """Make ``constrain`` place activations on ``mesh`` while tracing inside this block."""
    _ACTIVE.append((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.pop()


def active() -> tuple[jax.sharding.Mesh, Rules] | None:
    return _ACTIVE[-1] if _ACTIVE else None


def constrain(x: Array, axes: tuple[str | None, ...]) -> Array:
    """with_sharding_constraint by logical axis names; identity when no mesh is active."""
    if not _ACTIVE:
        return x
    mesh, rules = _ACTIVE[-1]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, rules.spec(axes)))
