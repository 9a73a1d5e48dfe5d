"""A trained drafter on disk: the z-lab layout (config.json + model.safetensors) that ``weights.load_draft`` reads,
and that layout split into parts small enough to travel (a device call returns files of 16 MiB at most).

``model.safetensors.partNN`` files are the bytes of model.safetensors cut in order; :func:`load` joins them back
when the whole file is absent, so a drafter returned in parts warm-starts the next session as it is.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import shutil
import tempfile
from typing import Any

import numpy as np

WEIGHTS = "model.safetensors"
PART = WEIGHTS + ".part"


def to_torch_layout(params) -> dict[str, np.ndarray]:
    """DraftParams -> {z-lab tensor name: array}, the inverse of weights.DRAFT_RULES (Linear: [in..., out...] ->
    [out, in])."""
    import jax

    from ddtree_jax.weights import DRAFT_RULES, Linear

    leaves = {".".join(k.name for k in p): np.asarray(x) for p, x in jax.tree.flatten_with_path(params)[0]}
    out = {}
    for name, field, transform in DRAFT_RULES:
        if field not in leaves:
            continue
        x = leaves[field]
        for i in range(x.shape[0]) if "{layer}" in name else [None]:
            y = x if i is None else x[i]
            if isinstance(transform, Linear):
                y = y.reshape(math.prod(y.shape[: transform.in_axes]), -1).T
            out[name.format(layer=i)] = np.ascontiguousarray(y)
    return out


def export(params, raw_config: dict[str, Any], path: str, dtype: str = "bfloat16", meta: dict | None = None) -> str:
    """Write ``path``/config.json + model.safetensors (z-lab drafter layout) atomically."""
    import ml_dtypes
    import safetensors.numpy

    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    tensors = {k: v.astype(np_dtype) for k, v in to_torch_layout(params).items()}
    tmp = f"{path.rstrip(os.sep)}.partial-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    safetensors.numpy.save_file(tensors, os.path.join(tmp, WEIGHTS),
                                metadata={"format": "pt", **{k: str(v) for k, v in (meta or {}).items()}})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump({**raw_config, "torch_dtype": dtype}, f, indent=2)
    for name in (WEIGHTS, "config.json"):
        os.chmod(os.path.join(tmp, name), 0o644)
    if os.path.exists(path):
        shutil.rmtree(path)
    os.rename(tmp, path)
    return path


def split(path: str, dst: str, max_bytes: int = 15 << 20) -> list[str]:
    """Copy the drafter at ``path`` into ``dst`` as config.json + model.safetensors.part00, part01, ... of at most
    ``max_bytes`` each; returns the parts' names. The sha256 of the whole file goes into ``dst``/config.json
    (``weights_sha256``), which :func:`load` checks."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(path, WEIGHTS), "rb") as f:
        data = f.read()
    names = []
    for i in range(0, len(data), max_bytes):
        names.append(f"{PART}{i // max_bytes:02d}")
        with open(os.path.join(dst, names[-1]), "wb") as f:
            f.write(data[i:i + max_bytes])
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**raw, "weights_sha256": hashlib.sha256(data).hexdigest()}, f, indent=2)
    return names


def load(path: str, dtype=None):
    """``weights.load_draft`` of a drafter directory, joining ``model.safetensors.partNN`` files first when the whole
    file is not there (checked against config.json's ``weights_sha256``). ValueError (one line) if neither is."""
    import jax.numpy as jnp

    from ddtree_jax import weights

    dtype = jnp.float32 if dtype is None else dtype
    if os.path.exists(os.path.join(path, WEIGHTS)):
        return weights.load_draft(path, dtype)
    parts = sorted(glob.glob(os.path.join(path, PART + "*")))
    if not parts:
        raise ValueError(f"{path}: no {WEIGHTS} and no {PART}NN files")
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    data = b"".join(open(p, "rb").read() for p in parts)
    want = raw.pop("weights_sha256", None)
    if want is not None and hashlib.sha256(data).hexdigest() != want:
        raise ValueError(f"{path}: the joined {PART}NN files do not match weights_sha256 (a part missing?)")
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, WEIGHTS), "wb") as f:
            f.write(data)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(raw, f)
        return weights.load_draft(tmp, dtype)
