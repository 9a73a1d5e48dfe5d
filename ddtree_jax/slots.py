"""The slot batch: one decoding State whose rows (slots) hold independent sequences, as the engine serves them.

A sequence enters a free slot (:func:`insert`, :func:`insert_first`), ends there (:func:`mark_done`), and a group of
rounds may run on some slots alone (:func:`run_group_rows`: gathered with :func:`take_rows`, scattered back with
:func:`put_rows`), as a smaller slot batch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ddtree_jax import decode
from ddtree_jax.decode import State, donating_jit, init_state
from ddtree_jax.spec import GenerateOptions, Spec

Array = jax.Array


def _batch_axis(path) -> int:
    """KV arrays [L, B, ...] carry the batch on axis 1; every other State leaf on axis 0."""
    names = [getattr(p, "name", None) for p in path]
    return 1 if names[-1] in ("k", "v") else 0


def empty_slots(spec: Spec, batch: int, capacity: int, out_len: int, dtype) -> State:
    """A batch state whose every slot is done (free): the engine's starting point for serving."""
    state = init_state(spec, [1] * batch, [GenerateOptions(max_new_tokens=1)] * batch, capacity, out_len, dtype)
    return dataclasses.replace(state, done=jnp.ones((batch,), bool))


@functools.partial(donating_jit, donate_argnums=(0,))
def insert(batch: State, slot: Array, one: State) -> State:
    """Put a prefilled single-sequence state (batch 1, same shapes otherwise) into slot ``slot``."""

    def put(path, big, small):
        return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, axis=_batch_axis(path))

    return jax.tree.map_with_path(put, batch, one)


@functools.partial(donating_jit, donate_argnums=(0,))
def insert_first(batch: State, slot: Array, rows: State) -> State:
    """:func:`insert` of the first sequence of a prefilled batch ``rows`` (the others are padding for a
    data-parallel mesh, whose batch must split evenly over the data axis)."""
    first = jax.tree.map_with_path(lambda p, x: jax.lax.slice_in_dim(x, 0, 1, axis=_batch_axis(p)), rows)
    return insert(batch, slot, first)


@functools.partial(donating_jit, donate_argnums=(0,))
def mark_done(state: State, mask: Array) -> State:
    """Finish the slots where ``mask`` [B] is set (cancelled requests): the round loop skips them."""
    return dataclasses.replace(state, done=state.done | mask)


def take_rows(state: State, rows: Array) -> State:
    """The sequences ``rows`` [n] of a batch state, as a batch of n."""
    return jax.tree.map_with_path(lambda p, x: jnp.take(x, rows, axis=_batch_axis(p)), state)


def put_rows(state: State, rows: Array, sub: State) -> State:
    """``state`` with its sequences ``rows`` [n] (distinct) replaced by the batch of n ``sub``."""

    def put(path, big, small):
        index = (slice(None),) * _batch_axis(path) + (rows,)
        return big.at[index].set(small.astype(big.dtype), unique_indices=True)

    return jax.tree.map_with_path(put, state, sub)


@functools.partial(donating_jit, static_argnums=(0, 7), donate_argnums=(3,))
def run_group_rows(spec: Spec, target, drafter, state: State, rows: Array, starts: Array, rounds: Array, most: int):
    """:func:`decode.run_group` on the sequences ``rows`` [n] (distinct) alone, gathered out of the batch and
    scattered back (a slot batch smaller than the engine's): the Snapshot is theirs, in ``rows``' order."""
    sub, snap = decode.group(spec, target, drafter, take_rows(state, rows), starts, rounds, most)
    return put_rows(state, rows, sub), snap
