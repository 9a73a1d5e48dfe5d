"""Exact and near-duplicate detection of texts: normalised keys and MinHash over word shingles, banded (LSH).

Normalised text: lower case, runs of anything but letters and digits as one space. Two texts are exact duplicates
when their normalised texts are equal, near duplicates when the Jaccard similarity of their sets of word 3-shingles
(estimated from ``PERMUTATIONS`` min-hashes, compared only when one of ``BANDS`` bands of ``ROWS`` hashes agrees) is
at least ``threshold``. :class:`Index` keeps the first of each group: texts are added one at a time (curation runs
as the texts arrive), each kept or reported as a duplicate of an earlier one. Deterministic: shingles are hashed with
crc32, the permutations drawn from a fixed seed.
"""

from __future__ import annotations

import re
import zlib

import numpy as np

PERMUTATIONS, BANDS, ROWS = 64, 16, 4  # a pair at Jaccard 0.6 shares a band with probability 0.88, at 0.3 0.12
SHINGLE = 3
_PRIME = np.uint64(4294967311)  # > 2^32: (a x + b) mod p over 32-bit hashes, a < 2^31, without overflow
_rng = np.random.default_rng(20261204)
_A = _rng.integers(1, 1 << 31, PERMUTATIONS, dtype=np.uint64)
_B = _rng.integers(0, 1 << 31, PERMUTATIONS, dtype=np.uint64)
_NOT_WORD = re.compile(r"[\W_]+", re.UNICODE)


def normalise(text: str) -> str:
    return _NOT_WORD.sub(" ", text.lower()).strip()


def shingles(text: str) -> np.ndarray:
    """crc32 of every run of SHINGLE words of the normalised text (the whole text when shorter): [n] uint64."""
    words = normalise(text).split()
    runs = [" ".join(words[i:i + SHINGLE]) for i in range(max(1, len(words) - SHINGLE + 1))]
    return np.unique(np.fromiter((zlib.crc32(r.encode()) for r in runs), np.uint64, len(runs)))


def signature(text: str) -> np.ndarray:
    """[PERMUTATIONS] uint64 min-hashes of the text's shingles."""
    x = shingles(text)
    return np.min((x[:, None] * _A[None, :] + _B[None, :]) % _PRIME, axis=0)


class Index:
    """Texts added one at a time; ``add`` says whether a text is new (kept) or a duplicate of a kept one."""

    def __init__(self, threshold: float = 0.6):
        self.threshold = threshold
        self.exact: dict[str, int] = {}
        self.bands: list[dict[bytes, list[int]]] = [{} for _ in range(BANDS)]
        self.signatures: list[np.ndarray] = []

    def __len__(self) -> int:
        return len(self.signatures)

    def duplicate_of(self, text: str) -> int | None:
        """The kept text (its index) that ``text`` duplicates, or None."""
        key = normalise(text)
        if key in self.exact:
            return self.exact[key]
        sig = signature(text)
        for band, table in zip(sig.reshape(BANDS, ROWS), self.bands):
            for j in table.get(band.tobytes(), ()):
                if np.mean(self.signatures[j] == sig) >= self.threshold:
                    return j
        return None

    def add(self, text: str) -> bool:
        """Keep ``text`` unless it duplicates a kept one; True if kept."""
        if self.duplicate_of(text) is not None:
            return False
        i = len(self.signatures)
        sig = signature(text)
        self.exact[normalise(text)] = i
        self.signatures.append(sig)
        for band, table in zip(sig.reshape(BANDS, ROWS), self.bands):
            table.setdefault(band.tobytes(), []).append(i)
        return True


def contaminated(text: str, reserved: list[str], index: Index) -> bool:
    """Whether ``text`` must stay out of training because of the ``reserved`` texts (held-out prompts, whose
    ``index`` holds them alone): a near duplicate of one, or containing one (normalised) inside it."""
    norm = f" {normalise(text)} "
    return index.duplicate_of(text) is not None or any(f" {normalise(r)} " in norm for r in reserved)
