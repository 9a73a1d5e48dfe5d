"""Convert a Hugging Face model directory (config.json + safetensors) into a ddtree_jax orbax checkpoint.

    python -m convert.hf_to_orbax SRC DST [--dtype bfloat16|float32|float16] [--kind auto|target|draft] [--force]

The output (see :mod:`ddtree_jax.checkpoint`) stacks the layers, holds one dtype, and carries the config and
tokenizer files, so ``load_target(DST)`` / ``load_draft(DST)`` and a tokenizer need nothing else.

Memory bound, by construction: :func:`ddtree_jax.weights.read_hf` preallocates the output pytree and fills it
with one stored tensor in flight, and orbax writes the numpy leaves without copying them, so

    peak host memory ~= output bytes + largest stored tensor + the interpreter (~0.5 GB).

Qwen3-8B (V=151936, D=4096, L=36, H=32, K=8, hd=128, F=12288, untied lm_head), stored and converted in bf16:
    per layer   2*D*H*hd + 2*D*K*hd + 3*D*F + 2*D + 2*hd  = 33.6M + 8.4M + 151.0M + ~0M  = 192.9M params
    36 layers   6.946G params;  embed + lm_head  2 * V*D = 1.245G params;  total 8.191G params
    output      8.191G * 2 bytes = 16.4 GB;  largest tensor (embed) 0.62G * 2 bytes = 1.25 GB
    peak        16.4 + 1.25 + 0.5 = 18.1 GB  <  24 GiB (25.8 GB)
:func:`memory_bound` computes the first two terms for any config (tests check it on the Qwen3-8B shape).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from ddtree_jax import checkpoint, cli, weights
from ddtree_jax.config import ConfigError
from ddtree_jax.params import logical_axes

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
DTYPES = ("bfloat16", "float32", "float16")


def memory_bound(kind: str, raw_config: dict, dtype: str, stored_itemsize: int = 2) -> tuple[int, int]:
    """(output bytes, largest stored tensor bytes) of converting a model with this config.json; no allocation."""
    shapes = checkpoint.KINDS[kind].shapes(checkpoint.KINDS[kind].parse(raw_config), dtype)
    leaves = jax.tree.leaves(shapes)
    axes = jax.tree.leaves(logical_axes(shapes), is_leaf=lambda a: isinstance(a, tuple))
    out = sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in leaves)
    stored = [math.prod(s.shape[1:] if a[0] == "layers" else s.shape) for s, a in zip(leaves, axes)]
    return out, max(stored) * stored_itemsize


def convert(src: str, dst: str, dtype: str = "bfloat16", kind: str = "auto", force: bool = False) -> str:
    """Write the orbax checkpoint of ``src`` at ``dst``; returns the kind. Raises ValueError subclasses on bad input."""
    if os.path.exists(dst) and not force:
        raise weights.WeightsError(f"{dst} already exists (use --force to overwrite)")
    if os.path.realpath(src) == os.path.realpath(dst) or os.path.realpath(src).startswith(os.path.realpath(dst) + os.sep):
        raise weights.WeightsError(f"{dst} would overwrite the source {src}")
    raw = weights.read_config(src)
    kind = weights.detect_kind(raw) if kind == "auto" else kind
    try:
        cfg = weights.parse_config(raw, kind)
    except ConfigError as e:
        raise weights.WeightsError(f"{src}: {e}") from None
    total = sum(ld.tensor.end - ld.tensor.start for ld in weights.plan_hf(src, kind, cfg))  # validates first
    with checkpoint.staged(dst) as tmp:
        with tqdm.tqdm(total=total, unit="B", unit_scale=True, desc=f"reading {kind}", file=sys.stderr) as bar:
            params = weights.read_hf(src, kind, cfg, jnp.dtype(dtype), progress=bar.update)
        checkpoint.save(tmp, params, raw, kind)
        del params
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(src, name)):
                shutil.copy2(os.path.join(src, name), os.path.join(tmp, name))
    return kind


def _parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m convert.hf_to_orbax",
        description="Convert a Hugging Face model directory (config.json + model.safetensors or sharded "
        "safetensors with model.safetensors.index.json) into a ddtree_jax orbax checkpoint with stacked layers.",
    )
    p.add_argument("src", metavar="SRC", help="Hugging Face model directory (a Qwen3/Llama target or a DFlash drafter)")
    p.add_argument("dst", metavar="DST", help="output checkpoint directory (must not exist unless --force)")
    p.add_argument(
        "--dtype", choices=DTYPES, default="bfloat16", help="dtype of the written weights (default: bfloat16)"
    )
    p.add_argument(
        "--kind",
        choices=("auto", "target", "draft"),
        default="auto",
        help="target or DFlash drafter; auto (default) picks draft when config.json names a DFlash "
        "architecture or has block_size",
    )
    p.add_argument("--force", action="store_true", help="replace DST if it already exists")
    return p


def _main(argv: list[str] | None) -> None:
    args = _parser().parse_args(argv)
    jax.config.update("jax_platforms", "cpu")  # conversion is host work; never claim an accelerator
    kind = convert(args.src, args.dst, args.dtype, args.kind, args.force)
    print(f"wrote {kind} checkpoint ({args.dtype}) to {args.dst}")


def main(argv: list[str] | None = None) -> int:
    """Bad input (a missing or malformed model, an existing DST) is one stderr line and exit status 2."""
    return cli.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
