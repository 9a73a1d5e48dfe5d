"""A deliberately weakened copy of a drafter, for checking the decoder with drafters that rarely agree.

    python benchmarks/perturb_drafter.py SRC DST --noise 0.5 [--seed 0]

Adds Gaussian noise of ``noise`` x each weight matrix's own standard deviation to every matrix of the drafter's
layers (norms and the shared embeddings untouched) and writes DST in the z-lab layout (train_draft.export).
Used by docs/DEFAULT_PAIR.md's GPU check: the H200 sweep's weak drafters reported chain acceptance below 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import train_draft, weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", help="a drafter directory (config.json + model.safetensors)")
    ap.add_argument("dst", help="where to write the weakened copy")
    ap.add_argument("--noise", type=float, default=0.5, help="noise std / each matrix's std (default: 0.5)")
    ap.add_argument("--seed", type=int, default=0, help="(default: 0)")
    args = ap.parse_args()
    _, params = weights.load_draft(args.src, jnp.float32)
    rng = np.random.default_rng(args.seed)

    def noisy(x):
        x = np.asarray(x)
        if x.ndim < 3:  # stacked [L, D] norms; matrices are [L, in, out...]
            return x
        return (x + args.noise * x.std() * rng.standard_normal(x.shape)).astype(x.dtype)

    params = dataclasses.replace(params, layers=jax.tree.map(noisy, params.layers))
    with open(os.path.join(args.src, "config.json")) as f:
        raw = json.load(f)
    train_draft.export(params, raw, args.dst)
    print(f"wrote {args.dst} (noise {args.noise})")


if __name__ == "__main__":
    main()
