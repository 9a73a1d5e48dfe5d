"""The slot batch: one decoding State whose rows (slots) hold independent sequences, as the engine serves them.

A sequence enters a free slot (:func:`insert`, :func:`insert_row`), ends there (:func:`mark_done`), and a group of
rounds may run on some slots alone (:func:`run_group_rows`: gathered with :func:`take_rows`, scattered back with
:func:`put_rows`), as a smaller slot batch. The batch's static sizes (:class:`Layout`: the prompt buckets, the cache
and output lengths) follow from --max-len; the smaller slot batches a step may run are :func:`default_buckets`'.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ddtree_jax import decode
from ddtree_jax.decode import donating_jit, init_state
from ddtree_jax.round import State
from ddtree_jax.spec import GenerateOptions, Spec, round_up

Array = jax.Array

MIN_BUCKET = 64  # shortest padded prompt: one prefill compilation covers every short prompt


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
def insert_row(batch: State, slot: Array, rows: State, row: Array) -> State:
    """:func:`insert` of sequence ``row`` of a prefilled batch ``rows`` (prompts prefilled together, padded to a
    power of two and to a data-parallel mesh's multiple with dummies)."""
    one = jax.tree.map_with_path(lambda p, x: jax.lax.dynamic_slice_in_dim(x, row, 1, axis=_batch_axis(p)), rows)
    return insert(batch, slot, one)


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


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static sizes of the slot batch, derived from --max-len (see decode.layout)."""

    max_len: int
    max_prompt: int  # max_len - 1: at least one new token
    top_bucket: int  # the longest padded prompt
    capacity: int  # KV cache slots per sequence
    out_len: int  # output buffer per sequence

    @classmethod
    def of(cls, spec: Spec, max_len: int) -> "Layout":
        max_prompt = max_len - 1
        top = round_up(max_prompt, 512) if max_prompt > 512 else round_up(max(max_prompt, 1), MIN_BUCKET)
        capacity = round_up(max(top, max_len + spec.scratch_slots), 64)
        return cls(max_len, max_prompt, top, capacity, max(top, max_len + spec.path_len + 1))

    def bucket(self, n: int) -> int:
        """Padded length of an n-token prompt: a power of two >= MIN_BUCKET, at most ``top_bucket``."""
        b = MIN_BUCKET
        while b < n:
            b *= 2
        return min(b, self.top_bucket)

    def buckets(self) -> list[int]:
        return sorted({self.bucket(n) for n in [1] + [2**k for k in range(6, 20) if 2**k <= self.max_prompt]
                       + [self.max_prompt]})


def default_buckets(max_batch: int, data_parallel: int = 1) -> tuple[int, ...]:
    """The slot batches besides max_batch unless told: the powers of two below it (none on a data-parallel mesh,
    whose slots are split over devices)."""
    return () if data_parallel != 1 else tuple(2**k for k in range(max_batch.bit_length()) if 2**k < max_batch)


def check_batch_buckets(buckets, max_batch: int, data_parallel: int) -> None:
    """ValueError unless every bucket is a smaller slot batch (1 .. max_batch - 1) and the batch is not split
    over a data axis (``data_parallel`` devices: a bucket's rows are gathered from the whole slot batch)."""
    if any(not 1 <= b < max_batch for b in buckets):
        raise ValueError(f"batch buckets must be between 1 and max_batch - 1 ({max_batch - 1}), "
                         f"got {','.join(map(str, buckets))}")
    if buckets and data_parallel != 1:
        raise ValueError("batch buckets need a mesh without a data axis (DxM with D = 1)")
