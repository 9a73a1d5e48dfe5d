"""Converted checkpoints: an orbax params pytree next to the model's own config.json.

A checkpoint directory holds::

    config.json              the Hugging Face config, unchanged (so ``config.model_config(dir)`` works)
    ddtree_checkpoint.json   {"format": "ddtree_jax", "version": 1, "kind": "target"|"draft", "dtype": ...}
    params/                  orbax PyTree checkpoint: the params as nested dicts of arrays, None fields dropped

``ddtree_checkpoint.json`` is written last, so its presence marks a complete checkpoint
(:func:`is_checkpoint`). Restoring reads the config, rebuilds the shape tree from :mod:`ddtree_jax.params`
and asks orbax for each leaf with its sharding, so every device reads only its own part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import shutil
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from ddtree_jax.config import ConfigError, draft_config, model_config, read_json
from ddtree_jax.params import draft_shapes, target_shapes

METADATA_FILE = "ddtree_checkpoint.json"
PARAMS_DIR = "params"
CONFIG_FILE = "config.json"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A converted checkpoint that cannot be written or read, with the path named."""


@dataclasses.dataclass(frozen=True)
class Kind:
    """What a checkpoint holds: how to parse its config.json and the shape tree of its params."""

    parse: Callable[[dict[str, Any]], Any]  # raw config.json -> ModelConfig | DraftConfig
    shapes: Callable[[Any, Any], Any]  # (config, dtype) -> pytree of ShapeDtypeStruct


KINDS: dict[str, Kind] = {
    "target": Kind(model_config, target_shapes),
    "draft": Kind(draft_config, draft_shapes),
}


def is_checkpoint(path: str) -> bool:
    """True for a directory written by :func:`save`."""
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def read_metadata(path: str) -> dict[str, Any]:
    """The checkpoint's ``ddtree_checkpoint.json`` (kind, dtype, version)."""
    file = os.path.join(path, METADATA_FILE)
    try:
        with open(file) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable checkpoint metadata ({e})") from None
    if meta.get("kind") not in KINDS or meta.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{file}: unsupported checkpoint metadata {meta}")
    return meta


def _key(entry) -> str:
    return entry.name if hasattr(entry, "name") else str(entry.key)


def _paths(tree) -> tuple[list[tuple[tuple[str, ...], Any]], Any]:
    """([(field path, leaf)], treedef) of a params pytree; None fields have no leaf."""
    leaves, treedef = jax.tree.flatten_with_path(tree)
    return [(tuple(_key(k) for k in p), x) for p, x in leaves], treedef


def _nest(items: list[tuple[tuple[str, ...], Any]]) -> dict[str, Any]:
    """[(("layers", "wq"), x), ...] -> {"layers": {"wq": x}, ...}."""
    out: dict[str, Any] = {}
    for path, x in items:
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = x
    return out


def _get(nested: dict[str, Any], path: tuple[str, ...]) -> Any:
    for k in path:
        nested = nested[k]
    return nested


def _save_handler() -> ocp.PyTreeCheckpointHandler:
    """A writer whose extra memory stays small (measured: a few MB over the params being written).

    orbax deep-copies numpy leaves before writing by default (that would double a conversion's peak), and with
    zstd compression its OCDBT writer held the compressed chunks in memory (~75% of the params on random bf16
    weights), for a few percent of disk: both are off.
    """
    numpy_kwargs = {}
    if "deepcopy_host_arrays" in inspect.signature(ocp.type_handlers.NumpyHandler).parameters:
        numpy_kwargs["deepcopy_host_arrays"] = False
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ocp.type_handlers.NumpyHandler(**numpy_kwargs)),
        (jax.Array, ocp.type_handlers.ArrayHandler()),
    )
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_compression=False)


def save(path: str, params, raw_config: dict[str, Any], kind: str) -> None:
    """Write ``params`` (numpy or jax leaves, one dtype) with its config.json as a new checkpoint at ``path``."""
    if kind not in KINDS:
        raise CheckpointError(f"unknown checkpoint kind {kind!r} (expected one of {', '.join(KINDS)})")
    if os.path.exists(path):
        raise CheckpointError(f"{path} already exists")
    items, _ = _paths(params)
    dtypes = sorted({str(np.dtype(x.dtype)) for _, x in items})
    if len(dtypes) != 1:
        raise CheckpointError(f"params mix dtypes {dtypes}; cast them to one first")
    os.makedirs(path)
    ocp.Checkpointer(_save_handler()).save(
        os.path.abspath(os.path.join(path, PARAMS_DIR)), args=ocp.args.PyTreeSave(_nest(items))
    )
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(raw_config, f, indent=2)
    meta = {"format": "ddtree_jax", "version": FORMAT_VERSION, "kind": kind, "dtype": dtypes[0]}
    with open(os.path.join(path, METADATA_FILE), "w") as f:
        json.dump(meta, f, indent=2)


def _sharding_leaves(shardings, treedef, n: int) -> list[jax.sharding.Sharding]:
    """One Sharding per params leaf: from None (the default device), one Sharding, or a matching pytree."""
    if shardings is None:
        shardings = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    if isinstance(shardings, jax.sharding.Sharding):
        return [shardings] * n
    leaves, tree = jax.tree.flatten(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
    if tree != treedef:
        raise CheckpointError(f"shardings tree {tree} does not match the params tree {treedef}")
    return leaves


def restore(path: str, shardings=None, dtype=None):
    """Read a checkpoint: ``(ModelConfig | DraftConfig, TargetParams | DraftParams)`` of jax arrays.

    shardings: None (every leaf on the default device), one ``jax.sharding.Sharding`` for all leaves, or a
    pytree of them shaped like the params; each device then reads only its own shard from disk.
    dtype: cast while reading; None keeps the stored dtype.
    """
    meta = read_metadata(path)
    kind = KINDS[meta["kind"]]
    try:
        cfg = kind.parse(read_json(os.path.join(path, CONFIG_FILE)))
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None
    items, treedef = _paths(kind.shapes(cfg, meta["dtype"] if dtype is None else dtype))
    shards = _sharding_leaves(shardings, treedef, len(items))
    args = _nest(
        [(p, ocp.ArrayRestoreArgs(sharding=s, global_shape=x.shape, dtype=x.dtype)) for (p, x), s in zip(items, shards)]
    )
    params_dir = os.path.abspath(os.path.join(path, PARAMS_DIR))
    try:
        restored = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).restore(
            params_dir, args=ocp.args.PyTreeRestore(restore_args=args)
        )
        leaves = [_get(restored, p) for p, _ in items]
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{params_dir}: cannot restore ({first})") from None
    for (p, want), got in zip(items, leaves):
        if got.shape != want.shape:
            raise CheckpointError(f"{params_dir}: {'.'.join(p)} has shape {got.shape}, config says {want.shape}")
    return cfg, jax.tree.unflatten(treedef, leaves)


@contextlib.contextmanager
def staged(dst: str):
    """Yield a scratch path beside ``dst`` to write a checkpoint into; on success it replaces ``dst`` (so a
    failed or interrupted write never leaves a half-written ``dst``), and it is removed either way."""
    tmp = f"{dst.rstrip(os.sep)}.partial-{os.getpid()}"
    try:
        yield tmp
        if os.path.exists(dst):
            shutil.rmtree(dst)
        os.rename(tmp, dst)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
