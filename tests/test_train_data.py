"""The drafter's data: corpora and their held-out topics, deduplication, the shipped held-out prompt sets kept out
of training, self-instruct openings, the large-batch generator (equal to decode.generate row by row), packing."""

from __future__ import annotations

import numpy as np
import pytest

from ddtree_jax import decode
from ddtree_jax.tokenizer import load_tokenizer
from ddtree_jax.training import corpus, dataset, dedup, prompts as P, responses
from tests.conftest import fixture_path


class _BytesTokenizer:
    """A stand-in tokenizer (UTF-8 bytes, no chat template) for the prompt builders."""

    has_chat_template = False

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())


def test_corpora_are_offline_licence_clean_passages():
    for name in ("pydoc", "stdlib"):
        ps = corpus.CORPORA[name]()
        assert len(ps) > 1000 and all(corpus.MIN_CHARS <= len(p.text) <= corpus.MAX_CHARS for p in ps)
        assert {p.licence for p in ps} == {"PSF-2.0"}
    assert len({p.topic for p in corpus.stdlib_passages()}) > 200


def test_permissive_licences_only():
    class Meta(dict):
        def get_all(self, key):
            return self.get(key + "s")

    ok = corpus.permissive_licence
    assert ok(Meta({"License-Expression": "Apache-2.0"})) == "Apache-2.0"
    assert ok(Meta({"License-Expression": "BSD-3-Clause AND MIT"})) == "BSD-3-Clause AND MIT"
    assert ok(Meta({"License-Expression": "GPL-3.0-only OR MIT"})) == "MIT"
    assert ok(Meta({"License-Expression": "MIT AND GPL-2.0-only"})) is None
    assert ok(Meta({"License-Expression": "MPL-2.0"})) is None
    assert ok(Meta({"Classifiers": ["License :: OSI Approved :: BSD License"]})) == "BSD License"
    assert ok(Meta({"Classifiers": ["License :: OSI Approved :: GNU General Public License v3 (GPLv3)"]})) is None
    assert ok(Meta({})) is None


def test_near_duplicates_are_dropped_and_distinct_texts_kept():
    idx = dedup.Index()
    base = ("The quick brown fox jumps over the lazy dog near the river bank on a sunny afternoon in May, while two "
            "children watch from the old stone bridge and a heron waits in the reeds for the fish to come back.")
    assert idx.add(base)
    assert not idx.add(base.upper())  # exact after normalisation
    assert not idx.add(base.replace("sunny", "bright"))  # one word changed: a near duplicate
    assert idx.add("A completely different sentence about Python lists and how to sort them by a key function.")
    assert len(idx) == 2


def test_held_out_sets_are_kept_out_of_training():
    """20 Python and 20 everyday questions, distinct; every one of them, as written or inside a longer text, is
    refused by the curator, and no passage prompt of any corpus contains or nearly duplicates one."""
    sets = P.held_out_sets()
    assert {k: len(v) for k, v in sets.items()} == {"python": 20, "everyday": 20}
    reserved = [m for ps in sets.values() for m in ps]
    assert len(set(reserved)) == 40
    from ddtree_jax import defaults

    assert defaults.PROMPT in reserved  # generate's own sample prompt is never trained on
    cur = P.Curator(reserved)
    for m in reserved:
        assert not cur.admit("self-instruct", m)
        assert not cur.admit("self-instruct", "Hi! " + m.lower() + " Thanks a lot.")
        assert not cur.admit("self-instruct", m.replace("?", " please?"))
    assert cur.counts["self-instruct"]["contaminated"] == 120
    found = P.passage_prompts(_BytesTokenizer(), corpus.passages(("pydoc", "stdlib")), P.Curator(reserved),
                              max_prompt_tokens=10_000)
    texts = [bytes(p.ids).decode(errors="ignore") for p in found]
    index = dedup.Index(0.6)
    for m in reserved:
        index.add(m)
    assert not any(dedup.contaminated(t, reserved, index) for t in texts)


def test_held_out_split_keeps_whole_topics():
    found = P.passage_prompts(_BytesTokenizer(), corpus.stdlib_passages(), P.Curator([]), max_prompt_tokens=10_000)
    by_topic: dict[str, set] = {}
    for p in found:
        by_topic.setdefault(p.topic, set()).add(p.held_out)
    assert all(len(v) == 1 for v in by_topic.values())
    held = sum(v == {True} for v in by_topic.values())
    assert 0.03 < held / len(by_topic) < 0.12  # one topic in 16
    topic = P.turn_topic("How do I bake sourdough bread?")  # one of its content words, whatever their order
    assert topic in ("turn:bake", "turn:sourdough", "turn:bread") and topic == P.turn_topic("Sourdough bread: bake it?")


def test_self_instruct_opening_is_the_template_before_a_user_message():
    tok = load_tokenizer(fixture_path("target"))  # template: "[role]\ncontent\n" per message
    assert tok.decode(P.user_turn_opening(tok), skip_special_tokens=False) == "[user]\n"
    with_system = P.user_turn_opening(tok, "Be brief.")
    assert tok.decode(with_system, skip_special_tokens=False) == "[system]\nBe brief.\n[user]\n"
    assert P.user_turn(tok, tok.encode("How do I learn to swim?", add_special_tokens=False), True)
    assert P.user_turn(tok, tok.encode("How do I learn to swim?", add_special_tokens=False), False) is None
    assert P.user_turn(tok, tok.encode("#$%^&*()!@#$%^&*", add_special_tokens=False), True) is None


def test_generator_equals_decode_generate_row_by_row(target):
    """More requests than rows, refilled as rows finish, greedy and sampled, stop tokens and limits of their own:
    each result is decode.generate's for that request alone, cut at the request's limit (sampling keys depend on a
    row's seed and positions only); a follow-up request from on_done is answered in the same run."""
    rng = np.random.default_rng(0)
    reqs = [responses.Request(tuple(rng.integers(0, 256, rng.integers(3, 12)).tolist()), [5, 13][i % 2],
                              [0.0, 0.8][i // 2 % 2], seed=i, tag=i) for i in range(9)]
    follow = responses.Request((5, 6, 8), 5, 0.0, seed=99, tag="follow")
    results, stats = responses.generate(target, reqs, batch=4, refill=2, max_prompt_tokens=16, max_new_tokens=16,
                                        stop_ids=(7, 11), rounds_per_sync=3,
                                        on_done=lambda r: [follow] if r.request.tag == 0 else [])
    assert sorted(str(r.request.tag) for r in results) == sorted([str(i) for i in range(9)] + ["follow"])
    assert stats.finished == 10 and stats.unfinished == 0
    for r in results:
        q = r.request
        opts = decode.GenerateOptions(max_new_tokens=13, temperature=q.temperature, seed=q.seed, stop_token_ids=(7, 11))
        want = decode.generate(target, [list(q.prompt)], opts).output_ids[0][len(q.prompt):][: q.max_new_tokens]
        assert r.tokens == want, q
        assert r.stopped == (want[-1] in (7, 11))
    assert stats.generated_tokens == sum(len(r.tokens) for r in results)


def test_generator_stops_at_its_deadline_keeping_partial_responses(target):
    reqs = [responses.Request((1, 2, 3), 14, 0.0, tag=i) for i in range(6)]
    results, stats = responses.generate(target, reqs, batch=2, refill=2, max_prompt_tokens=8, max_new_tokens=14,
                                        rounds_per_sync=2, deadline=0.0)
    assert len(results) == 2 and stats.unfinished == 2 and all(1 <= len(r.tokens) < 14 for r in results)


def test_packing_keeps_whole_sequences_with_their_positions():
    items = [(list(range(10 * i, 10 * i + n)), p, dataset.TRAIN, 0.0, "x")
             for i, (n, p) in enumerate([(7, 3), (5, 2), (9, 4), (3, 1), (12, 5), (4, 3)])]
    seqs = dataset.Sequences.build(items)
    rows = dataset.pack(seqs, 12)
    assert rows.tokens.shape == (3, 12)  # 12 | 9 + 3 | 7 + 5; the 4-token sequence (1 response token) dropped
    found = []
    for r in range(len(rows)):
        starts = np.flatnonzero(rows.positions[r] == 0)
        for s, e in zip(starts, list(starts[1:]) + [12]):
            toks = rows.tokens[r, s:e].tolist()
            match = [it for it in items if it[0] == toks[: len(it[0])]]
            if match and rows.supervised[r, s:e].any():
                seq, p = match[0][:2]
                found.append(tuple(seq))
                assert rows.supervised[r, s:s + len(seq)].tolist() == [i >= p for i in range(len(seq))]
    assert sorted(found) == sorted(tuple(it[0]) for it in items if len(it[0]) - it[1] >= 2)


def test_sequences_round_trip(tmp_path):
    seqs = dataset.Sequences.build([([1, 2, 3, 4], 2, dataset.TRAIN, 0.0, "pydoc"),
                                    ([5, 6, 7], 1, dataset.HELD_OUT, 0.7, "self-instruct")])
    seqs.save(str(tmp_path / "d.npz"))
    back = dataset.Sequences.load(str(tmp_path / "d.npz"))
    assert back[1].tolist() == [5, 6, 7] and back.source.tolist() == ["pydoc", "self-instruct"]
    assert back.summary()["by_decoding"] == {"greedy": {"sequences": 1, "response_tokens": 2},
                                             "sampled": {"sequences": 1, "response_tokens": 2}}


@pytest.mark.parametrize("n", [1, 5, 8])
def test_batches_cover_every_row_each_epoch(n):
    seen = np.concatenate([dataset.batch_indices(n, 4, s, 0) for s in range(max(1, n // 4))])
    assert len(seen) == max(1, n // 4) * 4
    if n >= 4:
        assert len(set(seen.tolist())) == len(seen)
