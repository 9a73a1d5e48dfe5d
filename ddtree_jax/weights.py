"""Load Hugging Face safetensors checkpoints (or converted orbax ones) into the params pytrees.

Conversion is data: :data:`TARGET_RULES` / :data:`DRAFT_RULES` are rows of (Hugging Face tensor name,
pytree field, transform); ``{layer}`` in a name is the model's layer (a row of the field's stack:
``params.stacked_layers``) and ``{expert}`` a Mixture-of-Experts layer's expert. Shapes come from the one spec table
in :mod:`ddtree_jax.params`, so nothing here restates a weight's layout. A field may have several forms on disk
(an MoE layer's experts: one tensor per expert and matrix, as the hub's checkpoints, or transformers 5's fused
``gate_up_proj`` / ``down_proj``): a layer needs every tensor of one of them.

Streaming: the safetensors headers are read first, and every problem (missing, unexpected, mis-shaped or
unsupported tensors, truncated files) is reported before any weight is read. Then the weights are filled piece by
piece (one stacked field's layer, or an unstacked field), tensor by tensor, with plain reads (no mmap, so a file's
pages never count against the process). :func:`read_hf` gathers the pieces into host arrays (peak host memory = the
output + the largest stored tensor); :func:`load_target` / :func:`load_draft` place each piece on its devices as it
is read, so the host holds one piece at a time (an MoE layer's experts: 0.8 GB of Qwen3-Coder-30B-A3B's 61 GB).

Torch ``nn.Linear`` weights are stored [out, in]; the pytree keeps [in, out] with heads split out
(e.g. q_proj [H*hd, D] -> wq [D, H, hd]; o_proj [D, H*hd] -> wo [H, hd, D]).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ddtree_jax import checkpoint
from ddtree_jax.config import ConfigError, DraftConfig, ModelConfig, read_json
from ddtree_jax.params import DraftParams, TargetParams, stacked_layers, write_layer

SAFETENSORS_DTYPES = {"F32": np.dtype(np.float32), "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16)}
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class WeightsError(ValueError):
    """A checkpoint whose tensors cannot fill the params pytree, with the file or tensor named."""


def _names(names: list[str], limit: int = 6) -> str:
    """'a, b, c' or 'a, b, c, ... (12 more)'."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names) - limit} more)"


# ---------------------------------------------------------------------------------------------- transforms


@dataclasses.dataclass(frozen=True)
class Copy:
    """Stored in the pytree's own layout (embeddings, norm scales)."""

    def source_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return shape

    def write(self, out: np.ndarray, x: np.ndarray) -> None:
        out[...] = x


@dataclasses.dataclass(frozen=True)
class Linear:
    """A torch ``nn.Linear`` weight [out, in]; ``in`` is the pytree's first ``in_axes`` axes, ``out`` the rest."""

    in_axes: int = 1

    def source_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (math.prod(shape[self.in_axes :]), math.prod(shape[: self.in_axes]))

    def write(self, out: np.ndarray, x: np.ndarray) -> None:
        # Transpose and cast in one strided copy straight into the (contiguous) output: no temporary.
        np.reshape(out, x.shape[::-1], copy=False)[...] = x.T


@dataclasses.dataclass(frozen=True)
class Expert:
    """One expert's torch ``nn.Linear`` weight [out, in] (the name's ``{expert}``), kept as is (output-major) as the
    row block ``part`` of ``parts`` of its expert in the field's [E, parts x out, in] (gate then up: gate_up)."""

    part: int = 0
    parts: int = 1

    def source_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (shape[1] // self.parts, *shape[2:])

    def write(self, out: np.ndarray, x: np.ndarray) -> None:  # out: this expert's [parts x out, in]
        n = x.shape[0]
        out[self.part * n : (self.part + 1) * n] = x


COPY, LINEAR = Copy(), Linear()
Transform = Copy | Linear | Expert
Rule = tuple[str, str, Transform]  # (HF tensor name with {layer} / {expert}, pytree field path, transform)

LAYER_RULES: tuple[Rule, ...] = (
    ("layers.{layer}.input_layernorm.weight", "layers.attn_norm", COPY),
    ("layers.{layer}.self_attn.q_proj.weight", "layers.wq", LINEAR),  # [H*hd, D] -> [D, H, hd]
    ("layers.{layer}.self_attn.k_proj.weight", "layers.wk", LINEAR),  # [K*hd, D] -> [D, K, hd]
    ("layers.{layer}.self_attn.v_proj.weight", "layers.wv", LINEAR),  # [K*hd, D] -> [D, K, hd]
    ("layers.{layer}.self_attn.o_proj.weight", "layers.wo", Linear(in_axes=2)),  # [D, H*hd] -> [H, hd, D]
    ("layers.{layer}.self_attn.q_norm.weight", "layers.q_norm", COPY),
    ("layers.{layer}.self_attn.k_norm.weight", "layers.k_norm", COPY),
    ("layers.{layer}.post_attention_layernorm.weight", "layers.mlp_norm", COPY),
    ("layers.{layer}.mlp.gate_proj.weight", "layers.w_gate", LINEAR),  # [F, D] -> [D, F]
    ("layers.{layer}.mlp.up_proj.weight", "layers.w_up", LINEAR),  # [F, D] -> [D, F]
    ("layers.{layer}.mlp.down_proj.weight", "layers.w_down", LINEAR),  # [D, F] -> [F, D]
    # a Mixture-of-Experts layer (Qwen3-MoE): the router, then each expert's matrices ...
    ("layers.{layer}.mlp.gate.weight", "layers.router", LINEAR),  # [E, D] -> [D, E]
    ("layers.{layer}.mlp.experts.{expert}.gate_proj.weight", "layers.experts_gate_up", Expert(0, 2)),  # [F, D]
    ("layers.{layer}.mlp.experts.{expert}.up_proj.weight", "layers.experts_gate_up", Expert(1, 2)),  # [F, D]
    ("layers.{layer}.mlp.experts.{expert}.down_proj.weight", "layers.experts_down", Expert()),  # [D, F]
    # ... or transformers 5's fused experts, already in the pytree's layout
    ("layers.{layer}.mlp.experts.gate_up_proj", "layers.experts_gate_up", COPY),  # [E, 2F, D]
    ("layers.{layer}.mlp.experts.down_proj", "layers.experts_down", COPY),  # [E, D, F]
)
TARGET_RULES: tuple[Rule, ...] = (
    ("model.embed_tokens.weight", "embed", COPY),
    ("model.norm.weight", "final_norm", COPY),
    ("lm_head.weight", "lm_head", LINEAR),  # [V, D] -> [D, V]
    *(("model." + name, field, t) for name, field, t in LAYER_RULES),
)
DRAFT_RULES: tuple[Rule, ...] = (  # z-lab DFlash layout: no "model." prefix (accepted when present)
    ("fc.weight", "fc", LINEAR),  # [D, taps*D] -> [taps*D, D]
    ("hidden_norm.weight", "hidden_norm", COPY),
    ("norm.weight", "final_norm", COPY),
    *LAYER_RULES,
)


@dataclasses.dataclass(frozen=True)
class Format:
    """How one kind of Hugging Face checkpoint maps onto its pytree."""

    rules: tuple[Rule, ...]
    optional_prefix: str = ""  # stripped from tensor names when present
    tied: tuple[tuple[str, str], ...] = ()  # (field, twin): a config may drop field; a stored copy must equal twin


FORMATS = {
    "target": Format(TARGET_RULES, tied=(("lm_head", "embed"),)),
    "draft": Format(DRAFT_RULES, optional_prefix="model."),
}


# ---------------------------------------------------------------------------------------------- safetensors


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors file: its name, safetensors dtype code, shape and absolute byte range."""

    file: str
    name: str
    dtype: str  # "F32", "BF16", "F16", "I8", ...
    shape: tuple[int, ...]
    start: int
    end: int


def read_header(file: str) -> list[Tensor]:
    """The tensors listed in a safetensors file's header (8-byte little-endian length, then JSON)."""
    size = os.path.getsize(file)
    corrupt = f"{file}: truncated or corrupt safetensors file"
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= size - 8:
            raise WeightsError(f"{corrupt} (bad header length)")
        try:
            header = json.loads(f.read(n))
            entries = [
                (k, v["dtype"], tuple(int(d) for d in v["shape"]), *(int(o) for o in v["data_offsets"]))
                for k, v in header.items()
                if k != "__metadata__"
            ]
        except (ValueError, KeyError, TypeError, AttributeError):
            raise WeightsError(f"{corrupt} (unreadable header)") from None
    tensors = [Tensor(file, k, dtype, shape, 8 + n + a, 8 + n + b) for k, dtype, shape, a, b in entries]
    for t in tensors:
        if t.end > size or t.start > t.end:
            raise WeightsError(f"{corrupt} (tensor {t.name} ends at byte {t.end}, the file has {size})")
    return tensors


def read_tensor(t: Tensor) -> np.ndarray:
    """The tensor's data as a fresh numpy array (its stored dtype)."""
    out = np.empty(t.shape, SAFETENSORS_DTYPES[t.dtype])
    with open(t.file, "rb") as f:
        f.seek(t.start)
        got = f.readinto(memoryview(out.reshape(-1).view(np.uint8)))
    if got != t.end - t.start:
        raise WeightsError(f"{t.file}: truncated or corrupt safetensors file (short read in {t.name})")
    return out


def shard_files(path: str) -> list[str]:
    """The safetensors files of a Hugging Face model directory (one file, or the shards of an index)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise WeightsError(f"{index}: unreadable safetensors index") from None
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise WeightsError(f"{path}: missing safetensors file(s) listed in {INDEX_FILE}: {_names(missing)}")
        return [os.path.join(path, n) for n in names]
    if os.path.isfile(os.path.join(path, SINGLE_FILE)):
        return [os.path.join(path, SINGLE_FILE)]
    if any(n.startswith(SINGLE_FILE + ".part") for n in os.listdir(path)):  # a drafter as a device call returns it
        raise WeightsError(f"{path}: no {SINGLE_FILE}, only its parts: join them first (cat {SINGLE_FILE}.part* > "
                           f"{SINGLE_FILE})")
    raise WeightsError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}")


# ---------------------------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Load:
    """Read ``tensor`` into ``field`` (at ``layer``, the row on the stacked axis, and ``expert``), or only check it
    equals the field. ``rule``: the index of the rule it matched."""

    tensor: Tensor
    field: str
    layer: int | None
    transform: Transform
    check: bool = False
    expert: int | None = None
    rule: int = 0


def _compile(rules: tuple[Rule, ...]) -> list[tuple[re.Pattern, str, Transform]]:
    def pattern(name: str) -> re.Pattern:
        p = re.escape(name)
        for key in ("layer", "expert"):
            p = p.replace(re.escape("{" + key + "}"), rf"(?P<{key}>\d+)")
        return re.compile(p)

    return [(pattern(n), f, t) for n, f, t in rules]


def _match(t: Tensor, rules, fmt: Format, shapes: dict[str, tuple[int, ...]],
           rows: dict[str, tuple[int, ...]]) -> Load | None:
    """The slot a tensor fills, or None when this model has no such slot (an unexpected tensor)."""
    name = t.name.removeprefix(fmt.optional_prefix) if fmt.optional_prefix else t.name
    hit = next(((i, m, f, tr) for i, (r, f, tr) in enumerate(rules) if (m := r.fullmatch(name))), None)
    if hit is None:
        return None
    i, m, field, transform = hit
    found = m.groupdict()
    layer, expert = (None if found.get(key) is None else int(found[key]) for key in ("layer", "expert"))
    tied = dict(fmt.tied)
    check = field not in shapes and field in tied
    if check:
        field, transform = tied[field], COPY
    if field not in shapes or (layer is not None and layer not in rows[field]):
        return None
    if expert is not None and expert >= shapes[field][1]:
        return None
    return Load(t, field, None if layer is None else rows[field].index(layer), transform, check, expert, i)


def _validate(ld: Load, shapes: dict[str, tuple[int, ...]]) -> None:
    """Shape, dtype and byte size of one matched tensor."""
    t, shape = ld.tensor, shapes[ld.field]
    want = ld.transform.source_shape(shape if ld.layer is None else shape[1:])
    where = f"tensor {t.name} in {t.file}"
    if t.shape != want:
        raise WeightsError(f"{where} has shape {list(t.shape)}, expected {list(want)}")
    if t.dtype not in SAFETENSORS_DTYPES:
        raise WeightsError(f"{where} has unsupported dtype {t.dtype} (supported: {', '.join(SAFETENSORS_DTYPES)})")
    if t.end - t.start != math.prod(t.shape) * SAFETENSORS_DTYPES[t.dtype].itemsize:
        raise WeightsError(f"{t.file}: truncated or corrupt safetensors file ({t.name} has the wrong byte size)")


def _form(transform: Transform) -> str:
    """Which of a field's forms on disk a rule belongs to: one tensor per expert, or one for the whole slot."""
    return "per-expert" if isinstance(transform, Expert) else "whole"


def plan(tensors: list[Tensor], fmt: Format, shapes: dict[str, tuple[int, ...]],
         rows: dict[str, tuple[int, ...]] | None = None) -> list[Load]:
    """Match every tensor to its slot in the pytree; raise WeightsError for any mismatch, before reading data.

    shapes: field path -> full pytree shape ([rows, ...] for "layers.*"), for the fields this model has; rows: field
    path -> the model layers its stack holds, in order (default: all of them, 0 .. rows - 1).
    """
    rows = rows or {}
    rows = {f: rows.get(f, tuple(range(s[0])) if f.startswith("layers.") else ()) for f, s in shapes.items()}
    rules = _compile(fmt.rules)
    loads, unexpected, seen = [], [], {}
    for t in tensors:
        ld = _match(t, rules, fmt, shapes, rows)
        if ld is None:
            unexpected.append(t.name)
            continue
        slot = (ld.field, ld.layer, ld.rule, ld.expert, ld.check)
        if slot in seen:
            raise WeightsError(f"tensors {seen[slot]} and {t.name} both hold {ld.field} (layer {ld.layer})")
        seen[slot] = t.name
        loads.append(ld)
    if unexpected:
        raise WeightsError(f"unexpected tensor(s) in the checkpoint: {_names(unexpected)}")
    filled: dict[tuple[str, int | None], dict[str, set]] = {}  # (field, row) -> form -> {(rule, expert)}
    for ld in loads:
        if not ld.check:
            filled.setdefault((ld.field, ld.layer), {}).setdefault(_form(ld.transform), set()).add((ld.rule, ld.expert))
    missing = []
    for field in shapes:
        forms: dict[str, list[tuple[int, str]]] = {}  # form -> [(rule, name)]
        for i, (name, f, tr) in enumerate(fmt.rules):
            if f == field:
                forms.setdefault(_form(tr), []).append((i, name))
        for row, layer in (enumerate(rows[field]) if field.startswith("layers.") else [(None, None)]):
            have = filled.get((field, row), {})
            if len(have) > 1:
                raise WeightsError(f"layer {layer} holds {field} in two forms ({' and '.join(sorted(have))} tensors)")
            if not forms:
                continue
            need = {form: [(i, n, e) for i, n in rules_
                           for e in (range(shapes[field][1]) if "{expert}" in n else [None])]
                    for form, rules_ in forms.items()}
            if not any(all((i, e) in have.get(form, ()) for i, _, e in want) for form, want in need.items()):
                form = next(iter(have), next(iter(need)))  # the form begun, else the first listed
                missing += [n.format(layer=layer, expert=e) for i, n, e in need[form]
                            if (i, e) not in have.get(form, ())]
    if missing:
        raise WeightsError(f"missing tensor(s) in the checkpoint: {_names(missing)}")
    for ld in loads:
        _validate(ld, shapes)
    return loads


# ---------------------------------------------------------------------------------------------- loading


def read_config(path: str) -> dict[str, Any]:
    """The raw config.json of a Hugging Face model directory."""
    if not os.path.isdir(path):
        raise WeightsError(f"no such model directory: {path}")
    try:
        return read_json(path)
    except (ConfigError, OSError) as e:
        raise WeightsError(str(e)) from None


def detect_kind(raw: dict[str, Any]) -> str:
    """"draft" for a DFlash drafter config (architecture name or a block_size field), else "target"."""
    archs = raw.get("architectures") or []
    return "draft" if any("DFlash" in a for a in archs) or "block_size" in raw else "target"


def parse_config(raw: dict[str, Any], kind: str) -> ModelConfig | DraftConfig:
    return checkpoint.KINDS[kind].parse(raw)


def _fields(kind: str, cfg: ModelConfig | DraftConfig, dtype):
    """({field path: ShapeDtypeStruct}, treedef, {field path: the model layers its stack holds}) of the kind's params
    for this config."""
    leaves, treedef = jax.tree.flatten_with_path(checkpoint.KINDS[kind].shapes(cfg, dtype))
    fields = {".".join(k.name for k in p): s for p, s in leaves}
    layers_cfg = cfg.layers if isinstance(cfg, DraftConfig) else cfg
    rows = {f: stacked_layers(layers_cfg, f.split(".")[-1]) for f in fields if f.startswith("layers.")}
    return fields, treedef, rows


def plan_hf(path: str, kind: str, cfg: ModelConfig | DraftConfig) -> list[Load]:
    """Validate a Hugging Face directory's tensors against the config from the headers alone (no weight read)."""
    fields, _, rows = _fields(kind, cfg, np.float32)
    tensors = [t for file in shard_files(path) for t in read_header(file)]
    return plan(tensors, FORMATS[kind], {f: s.shape for f, s in fields.items()}, rows)


def pieces(path: str, kind: str, cfg: ModelConfig | DraftConfig, dtype=np.float32,
           progress: Callable[[int], Any] | None = None):
    """The params of a Hugging Face directory piece by piece: yields (field path, row, numpy array of ``dtype``), a
    stacked field's row (one layer's [...]) or an unstacked field whole (row None), each once its tensors are read, in
    the order of their first tensor on disk; last, ("_check", None, {field: [Load]}) for the stored copies of fields
    that config.json ties (:func:`_check_tied`). Host memory: one piece and one stored tensor.

    progress: called with the byte count of each tensor once it has been read.
    """
    loads = plan_hf(path, kind, cfg)
    fields, _, _ = _fields(kind, cfg, dtype)
    groups: dict[tuple[str, int | None], list[Load]] = {}
    for ld in sorted(loads, key=lambda ld: (ld.tensor.file, ld.tensor.start)):
        if not ld.check:
            groups.setdefault((ld.field, ld.layer), []).append(ld)
    for (field, row), group in groups.items():
        s = fields[field]
        out = np.empty(s.shape if row is None else s.shape[1:], s.dtype)
        for ld in group:
            x = read_tensor(ld.tensor)
            ld.transform.write(out if ld.expert is None else out[ld.expert], x)
            del x
            if progress is not None:
                progress(ld.tensor.end - ld.tensor.start)
        yield field, row, out
        del out
    stored: dict[str, list[Load]] = {}
    for ld in loads:
        if ld.check:
            stored.setdefault(ld.field, []).append(ld)
    if stored:
        yield "_check", None, stored


def _check_tied(stored: dict[str, list[Load]], out: dict[str, Any], progress) -> None:
    """Each stored copy of a field that config.json ties equals the field as loaded (out: host or device arrays)."""
    for field, group in stored.items():
        have = np.asarray(out[field])
        for ld in group:
            x = read_tensor(ld.tensor)
            if not np.array_equal(x.astype(have.dtype), have):
                raise WeightsError(f"tensor {ld.tensor.name} differs from {ld.field} but config.json ties them")
            if progress is not None:
                progress(ld.tensor.end - ld.tensor.start)


def read_hf(
    path: str,
    kind: str,
    cfg: ModelConfig | DraftConfig,
    dtype=np.float32,
    progress: Callable[[int], Any] | None = None,
) -> TargetParams | DraftParams:
    """The params of a Hugging Face directory as a pytree of numpy arrays of ``dtype``, read tensor by tensor
    (:func:`pieces`). progress: called with the byte count of each tensor once it has been read."""
    fields, treedef, _ = _fields(kind, cfg, dtype)
    out = {f: np.empty(s.shape, s.dtype) for f, s in fields.items()}
    for field, row, piece in pieces(path, kind, cfg, dtype, progress):
        if field == "_check":
            _check_tied(piece, out, progress)
        elif row is None:
            out[field] = piece
        else:
            out[field][row] = piece
        del piece
    return jax.tree.unflatten(treedef, [out.pop(f) for f in list(fields)])


def load_hf(path: str, kind: str, cfg: ModelConfig | DraftConfig, dtype, shardings=None):
    """The params of a Hugging Face directory on the devices, each piece (:func:`pieces`) placed as soon as it is read:
    a stacked field's buffer is made on its devices, then filled layer by layer in place. shardings: None (the default
    device), one Sharding, or a pytree of them shaped like the params."""
    fields, treedef, _ = _fields(kind, cfg, dtype)
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        where = dict.fromkeys(fields, shardings)
    else:
        shards = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
        if len(shards) != len(fields):
            raise WeightsError(f"shardings has {len(shards)} leaves, the params {len(fields)}")
        where = dict(zip(fields, shards))
    out: dict[str, Any] = {}
    for field, row, piece in pieces(path, kind, cfg, dtype):
        if field == "_check":
            _check_tied(piece, out, None)
        elif row is None:
            out[field] = jax.device_put(piece, where[field])
        else:
            if field not in out:
                s = fields[field]
                out[field] = jax.jit(lambda s=s: jnp.zeros(s.shape, s.dtype), out_shardings=where[field])()
            out[field] = write_layer(out[field], piece, row)
        del piece
    return jax.tree.unflatten(treedef, [out.pop(f) for f in list(fields)])


def _load(path: str, kind: str, dtype, shardings):
    if checkpoint.is_checkpoint(path):
        found = checkpoint.read_metadata(path)["kind"]
        if found != kind:
            raise WeightsError(f"{path} is a {found} checkpoint, not a {kind}")
        return checkpoint.restore(path, shardings, dtype)
    raw = read_config(path)
    try:
        cfg = parse_config(raw, kind)
    except ConfigError as e:
        raise WeightsError(f"{path}: {e}") from None
    return cfg, load_hf(path, kind, cfg, dtype, shardings)


def load_target(path: str, dtype=jnp.float32, shardings=None) -> tuple[ModelConfig, TargetParams]:
    """A target model from a Hugging Face directory or a converted checkpoint, as jax arrays of ``dtype``.

    shardings: None (default device), one Sharding, or a pytree of them shaped like the params.
    """
    return _load(path, "target", dtype, shardings)


def load_draft(path: str, dtype=jnp.float32, shardings=None) -> tuple[DraftConfig, DraftParams]:
    """A DFlash drafter from a Hugging Face directory or a converted checkpoint, as jax arrays of ``dtype``."""
    return _load(path, "draft", dtype, shardings)
