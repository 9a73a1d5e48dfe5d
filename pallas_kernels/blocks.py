"""Block sizes of the Triton kernels: a Triton tensor's every dimension is a power of two, so a kernel pads a length
to the next one and masks the rest."""

from __future__ import annotations


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())
