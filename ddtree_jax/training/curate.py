"""The data stage: curated prompts, the target's responses to them, as :class:`~ddtree_jax.training.dataset.Sequences`.

One generation run (:func:`ddtree_jax.training.responses.generate`) serves everything: the self-instruct user turns
(short, sampled at temperature 1) and the responses, each greedy or sampled (``DataConfig.greedy_share``, the
temperatures ``DataConfig.temperatures``) up to ``max_new_tokens``. A user turn that passes curation is answered in
the same run, ahead of the queue. The queue interleaves passage requests and user turns at random, so a run cut by
its deadline keeps the mix; responses cut by the deadline are kept (the target's tokens, only shorter).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Callable, Sequence

import numpy as np

from ddtree_jax.training import corpus, prompts as P, responses
from ddtree_jax.training.dataset import HELD_OUT, TRAIN, Sequences


@dataclasses.dataclass(frozen=True)
class DataConfig:
    corpora: tuple[str, ...] = ("pydoc", "stdlib")
    per_passage: int = 1  # requests drawn per passage
    self_instruct: int = 0  # user turns the target is asked to write
    max_prompts: int | None = None  # passage requests answered (at most)
    held_out_prompts: int = 64  # held-out requests answered (at most; the rest are counted only)
    max_prompt_tokens: int = 256
    max_new_tokens: int = 1024
    turn_tokens: int = 128  # a self-instruct user turn's limit
    greedy_share: float = 0.5
    temperatures: tuple[float, ...] = (0.7, 1.0)
    batch: int = 256  # rows decoded together
    seed: int = 0


def curate(target, tokenizer, dc: DataConfig, *, stop_ids: Sequence[int], deadline: float | None = None,
           should_stop: Callable[[], bool] = lambda: False, attention: str = "auto",
           log: Callable[[str], object] = print) -> tuple[Sequences, dict]:
    """Prompts -> curation -> the target's responses. Returns (sequences, a record of the counts and the generation's
    tokens/s). ``tokenizer`` None: random-token prompts (targets without one, the tiny test fixtures)."""
    import tqdm

    rng = np.random.default_rng(dc.seed)
    record: dict = {"config": dataclasses.asdict(dc)}
    t0 = time.perf_counter()
    curator = P.Curator([p for ps in P.held_out_sets().values() for p in ps])
    if tokenizer is None:
        found = P.random_prompts(target[0].vocab_size, (dc.max_prompts or 64) + 8, 24, dc.seed)
    else:
        found = P.passage_prompts(tokenizer, corpus.passages(dc.corpora), curator,
                                  max_prompt_tokens=dc.max_prompt_tokens, per_passage=dc.per_passage, seed=dc.seed)
    found = [found[i] for i in rng.permutation(len(found))]
    train = [p for p in found if not p.held_out][: dc.max_prompts]
    held = [p for p in found if p.held_out][: dc.held_out_prompts]
    record["passage_prompts"] = {"train": len(train), "held_out": len(held),
                                 "held_out_unused": sum(p.held_out for p in found) - len(held)}

    def respond(p: P.Prompt, i: int) -> responses.Request:
        greedy = rng.random() < dc.greedy_share
        temp = 0.0 if greedy else float(rng.choice(dc.temperatures))
        return responses.Request(p.ids, dc.max_new_tokens, temp, seed=dc.seed * 1_000_003 + i, tag=p)

    queue = [respond(p, i) for i, p in enumerate(train + held)]
    if dc.self_instruct and tokenizer is not None:
        openings = [P.user_turn_opening(tokenizer, s) for s in P.SYSTEMS]
        turns = [responses.Request(tuple(openings[i % len(openings)]), dc.turn_tokens, 1.0,
                                   seed=dc.seed * 1_000_003 + len(queue) + i, tag="turn")
                 for i in range(dc.self_instruct)]
        queue = [queue[i] if i < len(queue) else turns[i - len(queue)] for i in rng.permutation(len(queue + turns))]
    record["curation_s"] = round(time.perf_counter() - t0, 1)
    log(f"{len(train)} passage requests, {len(held)} held out, {dc.self_instruct} self-instruct turns "
        f"({record['curation_s']} s)")
    counts = {"turns_written": 0, "turns_usable": 0, "held_out_skipped": 0}
    held_answered = [len(held)]

    def on_done(res: responses.Result) -> list[responses.Request]:
        if res.request.tag != "turn":
            return []
        counts["turns_written"] += 1
        text = P.user_turn(tokenizer, res.tokens, res.stopped)
        if text is None or not curator.admit("self-instruct", text):
            return []
        ids = P.chat_ids(tokenizer, text)
        topic = P.turn_topic(text)
        held_out = P.held_out_topic(topic)
        if len(ids) > dc.max_prompt_tokens:
            return []
        if held_out and held_answered[0] >= dc.held_out_prompts:
            counts["held_out_skipped"] += 1
            return []
        held_answered[0] += held_out
        counts["turns_usable"] += 1
        return [respond(P.Prompt("self-instruct", topic, tuple(ids), held_out), res.request.seed)]

    with tqdm.tqdm(desc="target responses", unit="tok", unit_scale=True, file=sys.stderr, dynamic_ncols=True) as bar:
        results, stats = responses.generate(target, queue, batch=dc.batch, max_prompt_tokens=dc.max_prompt_tokens,
                                            max_new_tokens=max(dc.max_new_tokens, dc.turn_tokens), stop_ids=stop_ids,
                                            on_done=on_done, deadline=deadline, should_stop=should_stop,
                                            progress=bar.update, attention=attention)
    items = [(list(r.request.prompt) + r.tokens, len(r.request.prompt), HELD_OUT if r.request.tag.held_out else TRAIN,
              r.request.temperature, r.request.tag.source) for r in results if r.request.tag != "turn"]
    seqs = Sequences.build(items)
    record.update(curation=curator.counts, self_instruct=counts, generation=stats.as_dict(), sequences=seqs.summary())
    log(f"data: {len(seqs)} sequences, {seqs.response_tokens:,} response tokens; generation "
        f"{stats.generated_tokens:,} tokens in {stats.run_s:.0f} s ({stats.tokens_per_s:,.0f} tokens/s, batch "
        f"{dc.batch}; compile {stats.compile_s:.0f} s)")
    return seqs, record
