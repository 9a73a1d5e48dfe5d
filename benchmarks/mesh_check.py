"""Greedy outputs on device meshes against one device, on a random-weight model of a named shape (shapes.SHAPES).

    PYTHONPATH=. python benchmarks/mesh_check.py [--shape tiny] [--meshes 2x1,1x2] [--methods ar,dflash,ddtree]

For each method: ``decode.generate`` on one device, then on each mesh (``sharding.make_mesh``, the first D x M
devices), the same prompts as one batch; prints how many sequences' tokens equal one device's, where the first
differences are, the attention path and the decode time. Not bit for bit in bf16 on a GPU: tensor parallelism sums
the row-parallel products in another order, and data parallelism changes each device's batch and with it the
kernels that compute (a one-row product is a row reduction, more rows a GEMM; the attention's split-K), so a
near-tie may part them; random weights have many (the exact checks are tests/test_sharding.py's, in float32 on
CPU). For real multi-GPU machines; on CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from ddtree_jax import decode, sharding, shapes
from ddtree_jax.spec import GenerateOptions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", choices=sorted(shapes.SHAPES), help="model shape (default: tiny)")
    ap.add_argument("--meshes", default="2x1,1x2", help="comma-separated DxM meshes (default: 2x1,1x2)")
    ap.add_argument("--methods", default="ar,dflash,ddtree", help="methods (default: ar,dflash,ddtree)")
    ap.add_argument("--budget", type=int, default=16, help="ddtree budget (default: 16)")
    ap.add_argument("--batch", type=int, default=4, help="prompts, one batch (default: 4)")
    ap.add_argument("--prompt-len", type=int, default=24, help="tokens per prompt (default: 24)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="(default: 32)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="(default: bfloat16)")
    args = ap.parse_args()
    meshes = [m.strip() for m in args.meshes.split(",") if m.strip()]
    tcfg, dcfg = shapes.model_configs(shapes.SHAPES[args.shape])
    tp, dp = shapes.build_params(tcfg, dcfg, jnp.dtype(args.dtype))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tcfg.vocab_size, args.prompt_len).tolist() for _ in range(args.batch)]
    print(f"{len(jax.devices())} x {jax.devices()[0].device_kind}; {args.shape}, {args.dtype}, batch {args.batch}",
          flush=True)
    for method in args.methods.split(","):
        opts = GenerateOptions(method=method, max_new_tokens=args.max_new_tokens, tree_budget=args.budget)
        runs = {}
        for name in ["1 device", *meshes]:
            mesh = None if name == "1 device" else sharding.make_mesh(
                name, jax.devices()[: int(np.prod(sharding.parse_mesh(name)))])
            decode.generate((tcfg, tp), prompts, opts, draft=(dcfg, dp), mesh=mesh)  # compile
            t0 = time.perf_counter()
            res = decode.generate((tcfg, tp), prompts, opts, draft=(dcfg, dp), mesh=mesh)
            wall = time.perf_counter() - t0
            runs[name] = res
            ref = runs["1 device"].output_ids
            diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(res.output_ids, ref)]
            same = sum(x == y for x, y in zip(res.output_ids, ref))
            print(f"{method:<7} {name:<9} attention {res.attention:<15} same as one device {same}/{len(ref)} "
                  f"first difference {[d for d in diff if d is not None][:4] or '-'}  decode {1e3 * res.decode_s:.1f} ms "
                  f"(call {1e3 * wall:.0f} ms)", flush=True)


if __name__ == "__main__":
    main()
