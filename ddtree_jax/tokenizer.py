"""Text <-> token ids for a model directory: Hugging Face ``tokenizer.json`` plus its chat template.

A thin wrapper over ``tokenizers.Tokenizer`` (no transformers, no torch). A model directory (HF download or
a converted checkpoint, which keeps the same files) may hold:

    tokenizer.json           the tokenizer itself (required; without it :func:`load_tokenizer` returns None)
    tokenizer_config.json    ``chat_template``, ``bos_token`` / ``eos_token``
    chat_template.jinja      the chat template as newer transformers save it
    generation_config.json   ``eos_token_id`` (int or list)
    config.json              ``eos_token_id`` (int or list)

Chat templates render as transformers renders them: a sandboxed Jinja environment with ``trim_blocks`` and
``lstrip_blocks``, a ``raise_exception`` helper, ``strftime_now``, a non-ASCII-escaping ``tojson`` and the
special tokens (``bos_token``, ``eos_token``, ...) as variables.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Iterable, Sequence

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
_REPLACEMENT = "\ufffd"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A tokenizer directory or chat template that cannot be used, with the reason."""


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from None
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def _pick_template(raw: Any) -> str | None:
    """``chat_template`` is a string, or (older transformers) a list of {"name", "template"}: take "default"."""
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    raise TokenizerError(f"unsupported chat_template of type {type(raw).__name__}")


class Tokenizer:
    """encode / decode / chat template / eos ids of one model directory."""

    def __init__(self, tok: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None, eos_token_ids: Sequence[int] = ()):
        self._tok = tok
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self._compiled_template = None

    @classmethod
    def from_dir(cls, path: str) -> "Tokenizer":
        file = os.path.join(path, TOKENIZER_FILE)
        try:
            tok = tokenizers.Tokenizer.from_file(file)
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"cannot load {file}: {e}") from None
        tcfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        template = _pick_template(tcfg.get("chat_template"))
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        if template is None:
            template = _pick_template(_read_json(os.path.join(path, "chat_template.json")).get("chat_template"))
        special = {k: v for k in _SPECIAL_TOKEN_KEYS if (v := _token_content(tcfg.get(k))) is not None}
        eos: list[int] = []
        eos_text = special.get("eos_token")
        if eos_text is not None and (eos_id := tok.token_to_id(eos_text)) is not None:
            eos.append(eos_id)
        for name in ("generation_config.json", "config.json"):
            eos += _as_id_list(_read_json(os.path.join(path, name)).get("eos_token_id"))
        return cls(tok, chat_template=template, special_tokens=special, eos_token_ids=eos)

    # ------------------------------------------------------------------ ids
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self) -> "IncrementalDecoder":
        return IncrementalDecoder(self)

    # ------------------------------------------------------------------ chat
    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render the chat template for ``messages`` ([{"role", "content"}, ...]) to a string.

        Extra keyword arguments (``tools``, ``enable_thinking``, ...) become template variables. Encode the
        result with ``add_special_tokens=False``: the template writes its own special tokens.
        """
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat_template")
        import jinja2

        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        variables = {**self.special_tokens, **kwargs}
        try:
            return self._compiled_template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template error: {e}") from None

    def encode_chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)


def _compile_template(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"chat template does not parse: {e}") from None


class IncrementalDecoder:
    """Streaming detokenisation that only ever emits complete text.

    A multi-byte UTF-8 character can be split across tokens (always so with a byte-level vocabulary); the
    decode of the ids seen so far then ends in U+FFFD. Those trailing replacement characters are held back
    until the character completes; everything before them is emitted at once. Decoding runs over a short
    window that starts at an earlier clean boundary (one already-emitted chunk of left context, as in vLLM),
    so tokenizers whose text depends on the previous token (leading-space handling) decode as a decode of
    the whole sequence would, and the cost per push stays constant. :meth:`flush` emits what is still held.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._start = 0  # window start: a clean character boundary
        self._clean = 0  # the latest clean boundary (the decode of ids[:clean] ends in a whole character)
        self._emitted = 0  # characters of decode(ids[start:]) already returned

    def push(self, ids: Iterable[int]) -> str:
        self._ids.extend(int(i) for i in ids)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        text = self._tok.decode(self._ids[self._start:])
        stable = text if final else text.rstrip(_REPLACEMENT)
        out = stable[self._emitted:]
        self._emitted = max(self._emitted, len(stable))
        if final:  # the stream ended: whatever comes next decodes afresh
            self._start = self._clean = len(self._ids)
            self._emitted = 0
        elif not text.endswith(_REPLACEMENT):  # a clean boundary: slide the window forward
            self._start, self._clean = self._clean, len(self._ids)
            self._emitted = len(self._tok.decode(self._ids[self._start:]))
        return out


def load_tokenizer(path: str) -> Tokenizer | None:
    """The tokenizer of a model directory, or None when it has no ``tokenizer.json``."""
    if not os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
        return None
    return Tokenizer.from_dir(path)
