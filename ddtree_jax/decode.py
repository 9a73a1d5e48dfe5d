"""(stub, being written) The round and the on-device loop: methods ar / dflash / ddtree."""

from __future__ import annotations

import dataclasses
from typing import Callable

DEFAULT_TREE_BUDGET = 64


@dataclasses.dataclass(frozen=True)
class GenerateOptions:
    method: str = "ar"  # "ar" | "dflash" | "ddtree"
    max_new_tokens: int = 128
    tree_budget: int = DEFAULT_TREE_BUDGET
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()
    attention: str = "auto"  # "auto" | "pallas" | "xla"
    trace: bool = False
    seed: int = 0


@dataclasses.dataclass
class GenerateResult:
    output_ids: list[list[int]]  # per prompt: prompt + generated ids
    num_generated: list[int]
    acceptance_lengths: list[list[int]]  # per prompt, per round (empty for ar)
    rounds: list[list[dict]] | None  # with trace: per prompt, per round {"tree": {...}, "accepted_indices": [...]}
    prefill_s: float
    decode_s: float


def generate(target, prompts: list[list[int]], options: GenerateOptions, *, draft=None,
             on_tokens: Callable[[list[list[int]]], None] | None = None) -> GenerateResult:
    """target: (ModelConfig, TargetParams); draft: (DraftConfig, DraftParams) or None.

    on_tokens, when given, is called every few rounds with the tokens each sequence gained since the last call.
    """
    raise NotImplementedError
