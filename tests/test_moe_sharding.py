"""The MoE target on meshes of 4 fake CPU devices (expert parallel), against one device and the reference fixture.

As tests/test_sharding.py: the device count is fixed when jax starts, so the multi-device runs happen once, in a
subprocess (this file run as a script with XLA_FLAGS=--xla_force_host_platform_device_count=4), which reports JSON:
- meshes 1x2 and 2x2 (the experts split in halves; 2x2 also splits the batch), each method and budget of the fixture
  (AR, DFlash, DDTree 1, 4, 16, 64) on the three prompts as one batch, each row to its own max_new_tokens, and 1x4
  (KV heads replicated, two experts per device) for DDTree 16: outputs and per-round acceptance lengths;
- the layer itself on 1x2: prefill logits (the grouped form) and one-token logits (the gather form) against one device,
  and the block with the Pallas grouped matmul (interpreted) per device in bf16;
- the collectives of a 2x2 round and AR step: the experts' partial outputs summed by an all-reduce of the residual
  stream's width; no expert weight crosses devices.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

import pytest

from tests.conftest import decode_to_the_end, fake_device_report

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(REPO, "tests", "fixtures", "ddtree_reference_moe")
CASES = [("ar", 0), ("dflash", 0), ("ddtree", 1), ("ddtree", 4), ("ddtree", 16), ("ddtree", 64)]
GRID = {"1x2": CASES, "2x2": CASES, "1x4": [("ddtree", 16)]}
MASK = 255


def _runs():
    with open(os.path.join(FIX, "generate.json")) as f:
        return json.load(f)["runs"]


def _script(out_path: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ddtree_jax import cache as kvcache, decode, model, moe, params as P, sharding, weights
    from pallas_kernels.bitmask import causal_bits

    assert jax.device_count() == 4, jax.devices()
    runs = _runs()
    prompts, limits = [r["prompt"] for r in runs], [r["max_new_tokens"] for r in runs]
    target = weights.load_target(os.path.join(FIX, "target"))
    drafter = weights.load_draft(os.path.join(FIX, "draft"))
    report: dict = {"grid": {}, "hlo": {}}

    def mesh_of(shape):
        d, m = sharding.parse_mesh(shape)
        return sharding.make_mesh(shape, jax.devices()[: d * m])

    def decode_rows(mesh, method, budget):
        tgt, drf = sharding.shard_model(target, mesh), sharding.shard_model(drafter, mesh)
        base = decode.GenerateOptions(method=method, max_new_tokens=max(limits), tree_budget=max(budget, 1))
        spec = decode.make_spec(tgt[0], drf[0], base, mesh=mesh)
        rows = prompts + prompts[:1] * (sharding.padded_batch(3, mesh) - 3)
        opts = [dataclasses.replace(base, max_new_tokens=n) for n in limits + [1] * (len(rows) - 3)]
        state, tokens = decode.start(spec, rows, opts, max(limits), jnp.float32, mesh)
        tp, dp = tgt[1], drf[1] if method != "ar" else None
        outputs, acceptance, _, _, step = decode_to_the_end(spec, tp, dp, state, tokens, 3)
        got = {"outputs": outputs, "acceptance": acceptance,
               "experts_spec": str(tp.layers.experts_gate_up.sharding.spec)}
        return got, sharding.collectives(step.as_text())

    for shape, cases in GRID.items():
        mesh = mesh_of(shape)
        report["grid"][shape] = {}
        for method, budget in cases:
            got, hlo = decode_rows(mesh, method, budget)
            report["grid"][shape][f"{method}{budget or ''}"] = got
            if shape == "2x2" and method in ("ar", "ddtree") and budget in (0, 16):
                report["hlo"][f"{method}{budget or ''}"] = hlo

    # the layer on 1x2 against one device: a prefill chunk (grouped form) and a one-token step (gather form)
    cfg, params = target
    prompt = np.asarray(runs[1]["prompt"][:16])

    def logits(p, tokens, mesh=None):
        t = len(tokens)
        cache = kvcache.init(cfg.num_layers, 1, 32, cfg.num_kv_heads, cfg.head_dim, jnp.float32)

        def run(p, cache):
            with sharding.use_mesh(mesh):
                h, _, _ = model.forward(p, cfg, jnp.asarray(tokens[None]), jnp.arange(t)[None], cache,
                                        causal_bits(1, t))
                return model.logits(p, h)

        return np.asarray(jax.jit(run)(p, cache))

    sharded = sharding.shard_model(target, mesh_of("1x2"))[1]
    report["layer"] = {name: float(np.abs(logits(sharded, toks, mesh_of("1x2")) - logits(params, toks)).max())
                       for name, toks in (("prefill", prompt), ("one token", prompt[:1]))}

    # the Pallas grouped matmul per device (interpreted), bf16, the stack's layer 1 read in place
    stack = P.cast(params.layers, jnp.bfloat16)
    x = (3 * jax.random.normal(jax.random.key(1), (2, 12, cfg.hidden_size))).astype(jnp.bfloat16)
    one = P.layer(stack, 1)
    want = np.asarray(jax.jit(lambda x: moe.block(x, one, cfg, "xla"))(x))
    mesh = mesh_of("1x2")
    placed = jax.device_put(stack, sharding.param_shardings(stack, mesh))

    def kernel(x, stack):
        with sharding.use_mesh(mesh):
            return moe.block(x, P.layer(stack, 1), cfg, "pallas-interpret", stack, jnp.int32(1))

    got = np.asarray(jax.jit(kernel)(x, placed))
    report["kernel_1x2"] = {"err": float(np.abs(got - want).max()), "scale": float(np.abs(want).max()),
                            "local_experts": list(placed.experts_gate_up.addressable_shards[0].data.shape)}
    with open(out_path, "w") as f:
        json.dump(report, f)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return fake_device_report(__file__, str(tmp_path_factory.mktemp("moe_sharding") / "report.json"), 4)


@pytest.mark.parametrize("shape,case", [(s, f"{m}{b or ''}") for s, cases in GRID.items() for m, b in cases])
def test_rows_match_the_reference(report, shape, case):
    """Every row's output (the reference drops the mask token from its outputs: tests/test_moe.py) and rounds."""
    got = report["grid"][shape][case]
    assert got["experts_spec"].startswith("P(None, 'model'")
    for run, out, acc in zip(_runs(), got["outputs"], got["acceptance"]):
        n = len(run["prompt"])
        assert len(out) == n + run["max_new_tokens"]
        assert out[:n] + [t for t in out[n:] if t != MASK] == run["ar"], (shape, case)
        if case != "ar":
            ref = run["dflash"] if case == "dflash" else run["ddtree"][case.removeprefix("ddtree")]
            assert acc == ref["acceptance_lengths"], (shape, case)


def test_the_layer_on_a_mesh_is_one_device(report):
    assert report["layer"]["prefill"] < 1e-5 and report["layer"]["one token"] < 1e-5, report["layer"]
    got = report["kernel_1x2"]
    assert got["local_experts"] == [4, 4, 64, 64]  # [L, E / 2, 2F, D] on each device
    assert got["err"] < 0.02 * got["scale"], got


@pytest.mark.parametrize("case", ["ar", "ddtree16"])
def test_experts_reach_tokens_by_one_all_reduce(report, case):
    """2x2: the MoE block's psum of the partial outputs (the residual stream's width, 64), beside the dense all-reduces;
    nothing shaped like an expert's matrices (64 x 64 or 32 x 64 per expert) is gathered or moved."""
    hlo = report["hlo"][case]
    psums = [c for c in hlo if c["op"] == "all-reduce" and "psum" in c["source"]]
    assert psums and all(c["shapes"][0][1][-1] == 64 for c in psums), hlo
    assert all(c["op"] in ("all-reduce", "all-gather") for c in hlo), hlo
    assert not [c for c in hlo if c["op"] == "all-gather" and any(len(d) >= 3 and d[-2:] in ((64, 64), (32, 64))
                                                                     for _, d in c["shapes"])], hlo


def test_meshes_that_do_not_divide_the_experts_are_one_line_errors():
    from jax.sharding import AbstractMesh

    from ddtree_jax import config, sharding

    cfg = config.model_config(os.path.join(FIX, "target"))
    mesh = AbstractMesh((1, 4), sharding.AXES)
    sharding.check_model(cfg, mesh)  # 8 experts, 4 heads, 2 KV heads (replicated): fine
    six = "mesh 1x4: the target has 6 experts, not divisible by the model axis (4)"
    for change, words in (({"num_experts": 6}, six), ({"num_heads": 6}, "6 query heads")):
        with pytest.raises(sharding.ShardingError, match=re.escape(words)) as e:
            sharding.check_model(dataclasses.replace(cfg, **change), mesh)
        assert "\n" not in str(e.value)


if __name__ == "__main__":
    _script(sys.argv[1])
