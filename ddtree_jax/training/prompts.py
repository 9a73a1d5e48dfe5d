"""Prompts for the drafter's data, their curation, and the two held-out prompt sets shipped with the package.

Prompts come from two places:

    passages      :mod:`ddtree_jax.training.corpus` text turned into chat requests ("explain", "summarise", a
                  question about the topic, ...) and a share of plain continuations of the text
    self-instruct the target's own user turns (Magpie): given only its chat template's opening of a user turn
                  (:func:`user_turn_opening`), an instruct model writes a plausible request and ends the turn; the
                  same model then answers it. Openings with a few system prompts (``SYSTEMS``) vary the requests.

Curation (:class:`Curator`): every passage and user turn is normalised and dropped when it is an exact or near
duplicate of one kept before (:mod:`ddtree_jax.training.dedup`) or when it is, or contains, a prompt of the held-out
sets (``HELD_OUT_SETS``: ``ddtree_jax/data/prompts/*.json``, questions a new user would type, never trained on).
Held-out split: whole topics (a documentation topic, a module, a cluster of user turns: :func:`turn_topic`) go to
the held-out split when the crc32 of their name falls in one of ``HELD_OUT_EVERY`` buckets.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from typing import Sequence

import numpy as np

from ddtree_jax.training import dedup
from ddtree_jax.training.corpus import Passage

HELD_OUT_EVERY = 16  # one topic in 16 is held out
HELD_OUT_SETS = ("python", "everyday")
PROMPTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "prompts")

TEMPLATES = (
    "Explain the following passage from the Python documentation in simple terms.\n\n{text}",
    "Summarize this text in a few sentences.\n\n{text}",
    "Write a short example that illustrates the following.\n\n{text}",
    "What are the key points of this text?\n\n{text}",
    "{text}\n\nRewrite the text above as a short tutorial for a beginner.",
)
QUESTIONS = (
    "What is {topic} in Python?",
    "How does {topic} work in Python? Give an example.",
    "Explain {topic} to a new programmer.",
)
CODE_TEMPLATES = (
    "Explain what this Python code does.\n\n```python\n{text}\n```",
    "Write a short usage example for this Python code.\n\n```python\n{text}\n```",
    "Summarize this Python code in a few sentences.\n\n```python\n{text}\n```",
    "```python\n{text}\n```\n\nRewrite this code with comments for a beginner.",
)
# System prompts of the self-instruct openings besides the template's own (None), so that user turns cover more
SYSTEMS = (None, None, None, "You are a helpful assistant.", "You are an expert Python programmer who helps users.",
           "You are a friendly assistant who helps people with everyday questions.",
           "You are a knowledgeable teacher who explains science and history.",
           "You are a creative writing assistant.", "You are an assistant who gives practical advice on cooking, "
           "travel, health and money.", "You are a helpful coding assistant for software developers.")
_STOP_WORDS = frozenset("about above after again also because been before being below between both could does doing "
                        "down during each from further have having here into just more most other over same should "
                        "some such than that their them then there these they this those through under until very "
                        "what when where which while whom will with would your yours please tell give make want "
                        "know help need like write explain some".split())


def held_out_set(name: str) -> list[str]:
    """A shipped held-out prompt set (``HELD_OUT_SETS``): the user messages, in order."""
    with open(os.path.join(PROMPTS_DIR, f"{name}.json")) as f:
        return json.load(f)


def held_out_sets() -> dict[str, list[str]]:
    return {name: held_out_set(name) for name in HELD_OUT_SETS}


def held_out_topic(topic: str) -> bool:
    return zlib.crc32(topic.encode()) % HELD_OUT_EVERY == 0


def turn_topic(text: str) -> str:
    """A cluster of self-instruct user turns: the content word (4+ letters, not a stop word) with the smallest crc32
    (one min-hash over words: two turns fall together with probability their word sets' Jaccard similarity)."""
    words = {w for w in dedup.normalise(text).split() if len(w) >= 4 and w.isalpha() and w not in _STOP_WORDS}
    return "turn:" + min(words or {"-"}, key=lambda w: zlib.crc32(w.encode()))


@dataclasses.dataclass(frozen=True)
class Prompt:
    source: str  # pydoc, stdlib, packages, self-instruct
    topic: str
    ids: tuple[int, ...]
    held_out: bool


class Curator:
    """Keeps texts that are new and clean: not a duplicate of a kept text, not a held-out prompt. ``counts``: per
    source, kept / duplicate / contaminated."""

    def __init__(self, reserved: Sequence[str], threshold: float = 0.6):
        self.reserved = list(reserved)
        self.kept = dedup.Index(threshold)
        self.reserved_index = dedup.Index(threshold)
        for r in self.reserved:
            self.reserved_index.add(r)
        self.counts: dict[str, dict[str, int]] = {}

    def admit(self, source: str, text: str) -> bool:
        c = self.counts.setdefault(source, {"kept": 0, "duplicate": 0, "contaminated": 0})
        if dedup.contaminated(text, self.reserved, self.reserved_index):
            c["contaminated"] += 1
            return False
        if not self.kept.add(text):
            c["duplicate"] += 1
            return False
        c["kept"] += 1
        return True


def passage_prompts(tokenizer, passages: Sequence[Passage], curator: Curator, *, max_prompt_tokens: int,
                    per_passage: int = 1, seed: int = 0) -> list[Prompt]:
    """Requests about each passage that the curator admits: with a chat template, 6 in 10 a request quoting the
    passage, 2 a question about its topic, 2 a plain continuation of its opening (64 tokens at most); without one,
    continuations only. ``per_passage`` draws per passage (repeats dropped); longer than max_prompt_tokens dropped."""
    rng = np.random.default_rng(seed)
    chat = tokenizer.has_chat_template
    out, seen = [], set()
    for p in passages:
        if not curator.admit(p.source, p.text):
            continue
        code = p.source != "pydoc"
        name = p.topic.rsplit(".", 1)[-1] + (" module" if code else "")
        for _ in range(per_passage):
            kind = rng.integers(0, 10) if chat else 9
            if kind < 6:
                templates = CODE_TEMPLATES if code else TEMPLATES
                ids = chat_ids(tokenizer, templates[rng.integers(len(templates))].format(text=p.text))
            elif kind < 8:
                ids = chat_ids(tokenizer, QUESTIONS[rng.integers(len(QUESTIONS))].format(topic=name.replace("-", " ")))
            else:
                ids = tokenizer.encode(p.text, add_special_tokens=False)[:64]
            if not 4 <= len(ids) <= max_prompt_tokens or tuple(ids) in seen:
                continue
            seen.add(tuple(ids))
            out.append(Prompt(p.source, f"{p.source}:{p.topic}", tuple(ids), held_out_topic(f"{p.source}:{p.topic}")))
    return out


def chat_ids(tokenizer, message: str) -> list[int]:
    """One user message in the chat template, with the assistant's turn opened: what ``generate --prompt`` sends."""
    return tokenizer.encode_chat([{"role": "user", "content": message}])


def user_turn_opening(tokenizer, system: str | None = None) -> list[int]:
    """The chat template's text before a user message's content (with ``system`` as a system message, else the
    template's default), as ids: the self-instruct prompt. ValueError if the template has no such opening."""
    marker = "\x00USER\x00"
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": marker}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    if marker not in text or not text.index(marker):
        raise ValueError("the chat template has no opening of a user turn for self-instruct")
    return tokenizer.encode(text[: text.index(marker)], add_special_tokens=False)


def user_turn(tokenizer, ids: Sequence[int], stopped: bool) -> str | None:
    """The user message of a self-instruct continuation, or None when it is unusable: not ended by the turn's end,
    too short or long (12 to 1,000 characters, 3 words at least), or mostly not letters."""
    if not stopped:
        return None
    text = tokenizer.decode(ids, skip_special_tokens=True).strip()
    letters = sum(ch.isalpha() or ch.isspace() for ch in text)
    if not 12 <= len(text) <= 1000 or len(text.split()) < 3 or letters < 0.7 * len(text):
        return None
    return text


def random_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[Prompt]:
    """Random-token prompts for a target without a tokenizer (the tiny test fixtures); one in eight held out."""
    rng = np.random.default_rng(seed)
    return [Prompt("random", f"random:{i}", tuple(rng.integers(0, vocab, length).tolist()), i % 8 == 7)
            for i in range(n)]
