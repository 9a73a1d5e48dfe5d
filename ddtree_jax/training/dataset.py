"""Training sequences (a prompt and the target's response to it) and their packing into fixed-length rows.

:class:`Sequences` keeps them flat (one token array and offsets), with what each one is: its prompt length, its
split (train or held out), the temperature its response was sampled at (0: greedy) and its source. Saved as one
``.npz``. :func:`pack` lays them into rows of T tokens, whole sequences one after another (best fit, longest
first), with each token's position within its own sequence: the rows the objective trains on
(:class:`ddtree_jax.training.objective.Batch`), with no padding but a row's tail.
"""

from __future__ import annotations

import bisect
import dataclasses
import os

import numpy as np

TRAIN, HELD_OUT = 0, 1


@dataclasses.dataclass
class Sequences:
    tokens: np.ndarray  # [total] int32: every sequence's prompt and response, one after another
    offsets: np.ndarray  # [N + 1] int64: sequence i is tokens[offsets[i]:offsets[i + 1]]
    prompt_lens: np.ndarray  # [N] int32
    split: np.ndarray  # [N] uint8: TRAIN or HELD_OUT
    temperature: np.ndarray  # [N] float32: 0 for a greedy response
    source: np.ndarray  # [N] str: the prompt's source (pydoc, stdlib, packages, magpie, ...)

    @classmethod
    def build(cls, items: list[tuple[list[int], int, int, float, str]]) -> "Sequences":
        """From (prompt + response ids, prompt length, split, temperature, source) tuples."""
        lens = np.asarray([len(s) for s, *_ in items], np.int64)
        flat = np.fromiter((t for s, *_ in items for t in s), np.int32, int(lens.sum()))
        return cls(flat, np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
                   np.asarray([p for _, p, *_ in items], np.int32), np.asarray([s for _, _, s, *_ in items], np.uint8),
                   np.asarray([t for *_, t, _ in items], np.float32), np.asarray([src for *_, src in items], str))

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets).astype(np.int32)

    @property
    def response_tokens(self) -> int:
        return int(np.sum(self.lengths - self.prompt_lens))

    def subset(self, keep: np.ndarray) -> "Sequences":
        idx = np.flatnonzero(keep)
        return Sequences.build([(self[i].tolist(), int(self.prompt_lens[i]), int(self.split[i]),
                                 float(self.temperature[i]), str(self.source[i])) for i in idx])

    def summary(self) -> dict:
        """Counts for the run record: sequences and response tokens per split, source and decoding."""
        out = {"sequences": len(self), "response_tokens": self.response_tokens, "tokens": int(len(self.tokens))}
        resp = self.lengths - self.prompt_lens
        for name, values in (("split", np.where(self.split == TRAIN, "train", "held_out")), ("source", self.source),
                             ("decoding", np.where(self.temperature > 0, "sampled", "greedy"))):
            out[f"by_{name}"] = {str(v): {"sequences": int(np.sum(values == v)),
                                          "response_tokens": int(np.sum(resp[values == v]))}
                                 for v in sorted(set(values.tolist()))}
        return out

    def save(self, path: str) -> None:
        tmp = path + ".partial.npz"
        np.savez(tmp, **dataclasses.asdict(self))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "Sequences":
        with np.load(path) as z:
            return cls(**{f.name: z[f.name] for f in dataclasses.fields(cls)})


@dataclasses.dataclass
class Rows:
    """Packed rows: [R, T] each (numpy; the objective's Batch once on the device)."""

    tokens: np.ndarray  # int32
    positions: np.ndarray  # int32: within the token's own sequence; a row's padded tail counts on as one more
    supervised: np.ndarray  # bool: response tokens

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def take(self, idx: np.ndarray) -> "Rows":
        return Rows(self.tokens[idx], self.positions[idx], self.supervised[idx])


def pack(seqs: Sequences, seq_len: int) -> Rows:
    """Every sequence with a response, cut to ``seq_len`` tokens, into rows of ``seq_len``: longest first, each
    into the row it fills best (the fullest one with room). Deterministic."""
    lens = np.minimum(seqs.lengths, seq_len)
    order = [i for i in np.argsort(-lens, kind="stable") if lens[i] - seqs.prompt_lens[i] >= 2]
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    rows: list[list[int]] = []
    for i in order:
        n = int(lens[i])
        j = bisect.bisect_left(free, (n, -1))
        if j == len(free):
            rows.append([i])
            bisect.insort(free, (seq_len - n, len(rows) - 1))
        else:
            room, r = free.pop(j)
            rows[r].append(i)
            if room - n > 0:
                bisect.insort(free, (room - n, r))
    tokens = np.zeros((len(rows), seq_len), np.int32)
    positions = np.tile(np.arange(seq_len, dtype=np.int32), (len(rows), 1))
    supervised = np.zeros((len(rows), seq_len), bool)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            n = int(lens[i])
            tokens[r, at:at + n] = seqs[i][:n]
            positions[r, at:] = np.arange(seq_len - at)
            supervised[r, at + seqs.prompt_lens[i]:at + n] = True
            at += n
    return Rows(tokens, positions, supervised)


def batch_indices(n: int, batch: int, step: int, seed: int) -> np.ndarray:
    """The rows of minibatch ``step``: a fresh shuffle every epoch, a pure function of (seed, step), so a resumed
    run sees exactly the batches an uninterrupted one would."""
    per_epoch = max(1, n // batch)
    order = np.random.default_rng([seed, step // per_epoch]).permutation(n)
    if n < batch:
        order = np.resize(order, batch)
    return np.sort(order[(step % per_epoch) * batch:(step % per_epoch + 1) * batch])
