"""ddtree_jax.tokenizer on the fixture's byte-level tokenizer (ids 0..255 = bytes) and its chat template."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest

from ddtree_jax.tokenizer import Tokenizer, TokenizerError, load_tokenizer

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "ddtree_reference")
TARGET = os.path.join(FIXTURES, "target")
MULTIBYTE = "héllo € 😀 世界, ça va? ✓"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = load_tokenizer(TARGET)
    assert t is not None
    return t


def _copy_tokenizer(tmp_path, **tokenizer_config) -> str:
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(os.path.join(TARGET, "tokenizer.json"), d / "tokenizer.json")
    with open(os.path.join(TARGET, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg.update(tokenizer_config)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize("text", ["hello world", "  leading and trailing spaces  ", "line\nbreaks\ttabs", MULTIBYTE])
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))  # byte-level vocabulary: id == byte
    assert tok.decode(ids) == text


def test_vocab_and_no_eos(tok):
    assert tok.vocab_size == 256
    assert tok.eos_token_ids == ()  # the fixture sets no eos anywhere
    assert tok.has_chat_template


def test_no_tokenizer_json_is_none():
    assert load_tokenizer(os.path.join(FIXTURES, "llama_target")) is None


MESSAGES = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]


def test_chat_template_with_generation_prompt(tok):
    assert tok.apply_chat_template(MESSAGES) == "[user]\nHi there\n[assistant]\nHello!\n[assistant]\n"


def test_chat_template_without_generation_prompt(tok):
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == "[user]\nHi there\n[assistant]\nHello!\n"


def test_encode_chat_is_bytes_of_rendered_text(tok):
    text = tok.apply_chat_template(MESSAGES[:1])
    assert tok.encode_chat(MESSAGES[:1]) == list(text.encode("utf-8"))


def test_template_environment_like_transformers(tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}\n"
        "    {% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}\n"
        "    <{{ m['role'] }}>{{ m['content'] | tojson }}{{ eos_token }}\n"
        "{% endfor %}"
    )
    path = _copy_tokenizer(tmp_path, chat_template=template, bos_token={"content": "<s>", "lstrip": False},
                           eos_token="</s>")
    t = load_tokenizer(path)
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before one;
    # tojson keeps non-ASCII characters; bos/eos come from tokenizer_config.json (string or AddedToken dict)
    assert t.apply_chat_template([{"role": "user", "content": "é"}]) == '<s>    <user>"é"</s>\n'
    with pytest.raises(TokenizerError, match="no system role"):
        t.apply_chat_template([{"role": "system", "content": "x"}])


def test_template_is_sandboxed(tmp_path):
    t = load_tokenizer(_copy_tokenizer(tmp_path, chat_template="{% set _ = messages.append(1) %}x"))
    with pytest.raises(TokenizerError):
        t.apply_chat_template(MESSAGES)


def test_no_template_is_an_error(tmp_path):
    t = load_tokenizer(_copy_tokenizer(tmp_path, chat_template=None))
    assert not t.has_chat_template
    with pytest.raises(TokenizerError, match="no chat_template"):
        t.apply_chat_template(MESSAGES)


def test_chat_template_jinja_file(tmp_path):
    path = _copy_tokenizer(tmp_path, chat_template=None)
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert load_tokenizer(path).apply_chat_template(MESSAGES, add_generation_prompt=False) == "Hi thereHello!"


def test_eos_ids_from_all_configs(tmp_path):
    path = _copy_tokenizer(tmp_path, eos_token="!")
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [10, 33]}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"eos_token_id": 0}, f)
    assert load_tokenizer(path).eos_token_ids == (33, 10, 0)  # tokenizer_config first, duplicates dropped


def test_incremental_decoder_one_byte_at_a_time(tok):
    dec = tok.incremental_decoder()
    chunks = [dec.push([b]) for b in MULTIBYTE.encode("utf-8")] + [dec.flush()]
    assert "".join(chunks) == MULTIBYTE
    for c in chunks:
        assert "\ufffd" not in c  # never half a character
    assert dec.push([0xE2, 0x82]) == ""  # the first two bytes of '€' are held back
    assert dec.push([0xAC]) == "€"


def test_incremental_decoder_random_splits(tok):
    rng = random.Random(0)
    data = list(MULTIBYTE.encode("utf-8"))
    for _ in range(50):
        dec, out, i = tok.incremental_decoder(), [], 0
        while i < len(data):
            n = rng.randint(1, 5)
            out.append(dec.push(data[i:i + n]))
            i += n
        out.append(dec.flush())
        assert all("\ufffd" not in c for c in out)
        assert "".join(out) == MULTIBYTE


def test_incremental_decoder_flushes_invalid_bytes(tok):
    dec = tok.incremental_decoder()
    assert dec.push([ord("a"), 0xF0, 0x9F]) == "a"  # an unfinished 4-byte character is held
    assert dec.flush() == "\ufffd"  # ... and shown as a replacement character when the stream ends
    assert dec.flush() == ""


def test_incremental_decoder_keeps_left_context():
    """A Metaspace (sentencepiece-style) decoder drops the leading space of a sequence's first token: streaming
    must still produce the spaces between words, as a decode of the whole sequence does."""
    import tokenizers
    from tokenizers import decoders, models

    raw = tokenizers.Tokenizer(models.WordLevel({"▁hello": 0, "▁world": 1, "!": 2, "<unk>": 3}, unk_token="<unk>"))
    raw.decoder = decoders.Metaspace()
    t = Tokenizer(raw)
    ids = [0, 1, 2, 1, 0]
    dec = t.incremental_decoder()
    streamed = "".join(dec.push([i]) for i in ids) + dec.flush()
    assert streamed == t.decode(ids) == "hello world! world hello"
