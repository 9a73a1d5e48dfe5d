"""Mixture-of-Experts targets (Qwen3-MoE) against the official code's fixture (tests/fixtures/ddtree_reference_moe).

The tiny target: 4 layers, 8 experts of width 32, 2 per token, every layer sparse. Layer parity (logits, every hidden
state, every layer's router choices), the block's forms against a per-token loop (the gather form, the grouped form by
XLA's ragged dot and by the Pallas kernel in the interpreter, experts read in place from the stack), the loader on both
layouts of the experts and a stack mixing dense and sparse MLPs, and decoding: AR, DFlash and DDTree (budgets 1, 4, 16,
64) round by round against the reference. Meshes: tests/test_moe_sharding.py.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from ddtree_jax import checkpoint, config, decode, moe, params as P, weights
from ddtree_jax.tuning import Tuning
from pallas_kernels import grouped_matmul as gmm
from tests.test_decode import accepted_tokens, rows_with_their_own_limits, tree_paths
from tests.test_model import run_chunked

FIX = Path(__file__).parent / "fixtures" / "ddtree_reference_moe"


@pytest.fixture(scope="module")
def target():
    return weights.load_target(str(FIX / "target"))


@pytest.fixture(scope="module")
def drafter():
    return weights.load_draft(str(FIX / "draft"))


@pytest.fixture(scope="module")
def runs():
    return json.loads((FIX / "generate.json").read_text())["runs"]


@pytest.fixture(scope="module")
def npz():
    return dict(np.load(FIX / "logits.npz"))


def stored(model_dir) -> dict[str, np.ndarray]:
    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def write_model(dst: Path, tensors: dict, **config_changes) -> str:
    dst.mkdir(parents=True)
    raw = json.loads((FIX / "target" / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**raw, **config_changes}))
    save_file(tensors, str(dst / "model.safetensors"))
    return str(dst)


# ---------------------------------------------------------------------------------------------- config


def test_config_in_both_spellings_and_one_line_errors():
    raw = json.loads((FIX / "target" / "config.json").read_text())
    cfg = config.model_config(raw)
    assert (cfg.arch, cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == ("qwen3_moe", 8, 2, 32)
    assert cfg.norm_topk_prob and cfg.sparse_layers == (0, 1, 2, 3) and cfg.dense_layers == () and cfg.qk_norm
    v5 = {k: v for k, v in raw.items() if k not in ("num_experts", "rope_theta", "rope_scaling")}
    v5.update(num_local_experts=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    assert config.model_config(v5) == cfg
    assert config.model_config({**raw, "architectures": [], "model_type": "qwen3_moe"}) == cfg
    assert config.model_config({**raw, "decoder_sparse_step": 2}).dense_layers == (0, 2)
    assert config.model_config({**raw, "mlp_only_layers": [3]}).sparse_layers == (0, 1, 2)
    assert config.model_config({**raw, "num_experts": 0}).sparse_layers == ()  # transformers: all dense
    errors = {
        "shared_expert_intermediate_size": {"shared_expert_intermediate_size": 64},
        "'num_experts'": {"num_experts": None},
        "num_experts_per_tok=9": {"num_experts_per_tok": 9},
        "mlp_only_layers [4]": {"mlp_only_layers": [4]},
        "'moe_intermediate_size'": {"moe_intermediate_size": None},
    }
    for words, change in errors.items():
        bad = {k: v for k, v in {**raw, **change}.items() if v is not None}
        with pytest.raises(config.ConfigError, match=re.escape(words)) as e:
            config.model_config(bad)
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- the layer


@pytest.mark.parametrize("chunk", [8, 32])  # 16 or 38 (token, slot) pairs a chunk: the gather and grouped forms
def test_logits_hidden_states_and_router_choices(target, npz, chunk):
    cfg, params = target
    seen: list = []
    with moe.recording(seen):
        lg, feats = run_chunked(cfg, params, npz["prompt"], chunk=chunk, taps=tuple(range(cfg.num_layers)))
    assert np.abs(lg - npz["target_logits"]).max() < 1e-4
    d, t = cfg.hidden_size, len(npz["prompt"])
    for layer in range(cfg.num_layers):
        assert np.abs(feats[:, layer * d:(layer + 1) * d] - npz["target_hidden_states"][layer + 1]).max() < 1e-4
    # per chunk, one [chunk, k] array per layer, in layer order: the chosen experts of the prompt's tokens
    chunks = -(-t // chunk)
    assert len(seen) == chunks * cfg.num_layers
    ids = np.stack([np.concatenate([seen[c * cfg.num_layers + layer] for c in range(chunks)])[:t]
                    for layer in range(cfg.num_layers)])
    np.testing.assert_array_equal(np.sort(ids, axis=-1), npz["router_topk"])


def loop_reference(x, router, gate_up, down, k, norm):
    """transformers' block, token by token in float64: x [N, D], router [D, E], gate_up [E, 2F, D], down [E, D, F]."""
    x, router, gate_up, down = (np.asarray(a, np.float64) for a in (x, router, gate_up, down))
    out = np.zeros_like(x)
    for n, row in enumerate(x):
        logits = row @ router
        p = np.exp(logits - logits.max())
        p /= p.sum()
        top = np.argsort(-p, kind="stable")[:k]
        w = p[top] / (p[top].sum() if norm else 1.0)
        for e, we in zip(top, w):
            gate, up = np.split(gate_up[e] @ row, 2)
            out[n] += we * (down[e] @ (gate / (1 + np.exp(-gate)) * up))
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_form_of_the_block_is_the_per_token_loop(target, dtype):
    """The gather form (XLA's row reductions, with or without the layer kernels), the grouped form by XLA's ragged dot
    and by the Pallas grouped matmul (interpreted; it takes 16-bit weights only, so in f32 XLA's ragged dot runs), on
    the stack's layer 2 read in place and on that layer alone: all the per-token loop (f32: to 1e-5 of its largest
    value; bf16: 5 %). The form and its kernel are the tuning's (ddtree_jax.tuning.Tuning)."""
    cfg, params = target
    stack = P.cast(params.layers, dtype)
    one = P.layer(stack, 2)
    x = (jax.random.normal(jax.random.key(0), (2, 20, cfg.hidden_size)) * 3).astype(dtype)
    want = loop_reference(x.reshape(40, -1).astype(jnp.float32), one.router.astype(jnp.float32),
                          one.experts_gate_up.astype(jnp.float32), one.experts_down.astype(jnp.float32),
                          cfg.experts_per_token, cfg.norm_topk_prob).reshape(x.shape)
    tol = (1e-5 if dtype == jnp.float32 else 0.05) * np.abs(want).max()
    forms = {  # (attention, tuning): every pair gathered (with the layer kernels or not); grouped by XLA, by the kernel
        "gather": ("xla", Tuning(moe_gather_pairs=10**6)),
        "gather, layer kernels": ("pallas-interpret", Tuning(moe_gather_pairs=10**6)),
        "ragged dot": ("pallas-interpret", Tuning(moe_gather_pairs=1, grouped_matmul=False)),
        "kernel": ("pallas-interpret", Tuning(moe_gather_pairs=1)),
    }
    got = {}
    for form, (impl, tuning) in forms.items():
        for where in ("in place", "alone"):
            kw = dict(stacked=stack, layer=jnp.int32(2)) if where == "in place" else {}
            fn = jax.jit(lambda x, w, kw=kw, impl=impl, tuning=tuning: moe.block(x, w, cfg, impl, tuning=tuning, **kw))
            got[form, where] = y = np.asarray(fn(x, one))
            # the grouped kernel's program where it takes the dtype; no Pallas call in any other form
            program = str(jax.make_jaxpr(fn)(x, one))
            assert ("grouped_matmul" in program) == (form == "kernel" and dtype == jnp.bfloat16), (form, where)
            assert ("pallas_call" in program) == ("grouped_matmul" in program), (form, where)
            assert y.dtype == np.float32 and np.abs(y - want).max() < tol, (form, where)
    for where in ("in place", "alone"):  # the gather form is XLA's whatever the attention
        np.testing.assert_array_equal(got["gather, layer kernels", where], got["gather", where])
    if dtype == jnp.bfloat16:  # the kernel took the bf16 products (and its probe would pass on a GPU)
        assert gmm.supports(x.reshape(40, -1), one.experts_gate_up)
        first = got["ragged dot", "alone"]
        assert all(np.abs(y - first).max() < 0.02 * np.abs(first).max() for y in got.values())


def test_the_kernel_probe_runs_while_a_layer_is_traced(monkeypatch):
    """moe.kernel_works runs kernel_mismatch the first time a layer is traced: on a thread of its own, so that its
    problem is computed then and there (here interpreted, as on a CPU), not staged into the layer's program."""
    monkeypatch.setattr(moe, "kernel_mismatch", functools.partial(REAL_MISMATCH, interpret=True))
    moe.kernel_works.cache_clear()
    try:
        assert jax.jit(lambda x: x + moe.kernel_works("grouped_matmul"))(jnp.int32(1)) == 2
    finally:
        moe.kernel_works.cache_clear()
    with pytest.raises(ValueError, match="no Pallas MoE kernel 'expert_gemv'"):  # the only one is grouped_matmul
        REAL_MISMATCH("expert_gemv", interpret=True)


REAL_MISMATCH = moe.kernel_mismatch


@pytest.mark.parametrize("norm", [True, False])
def test_routing_is_transformers_softmax_top_k_and_renormalisation(norm):
    """moe.route: transformers' routing (softmax over all experts in f32, the k largest, ties to the lower id, divided
    by their sum when norm_topk_prob) in float64, with bf16 logits that tie (rows of equal router columns)."""
    rng = np.random.default_rng(7)
    n, d, e, k = 64, 32, 128, 8
    x = jnp.asarray(rng.normal(size=(n, d)), jnp.bfloat16)
    router = rng.normal(size=(d, e)) * 0.2
    router[:, 40:44] = router[:, 12:13]  # experts 12 and 40-43 tie on every token
    router = jnp.asarray(router, jnp.bfloat16)
    weights, ids = moe.route(x, router, k, norm)
    logits = np.asarray(jnp.einsum("nd,de->ne", x, router, preferred_element_type=jnp.float32).astype(jnp.bfloat16),
                        np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    want = np.argsort(-probs, axis=-1, kind="stable")[:, :k]  # the k largest, ties to the lower id
    top = np.take_along_axis(probs, want, -1)
    if norm:
        top /= top.sum(-1, keepdims=True)
    assert np.array_equal(np.asarray(ids), want) and ids.dtype == jnp.int32
    assert np.abs(np.asarray(weights) - top).max() < 1e-6 and weights.dtype == jnp.float32
    assert (np.isin(want, [12, 40, 41, 42, 43]).sum(-1) >= 2).any()  # the ties were among the chosen


@pytest.mark.parametrize("pairs", [1, 8, 16])  # one pair, an AR step of 8 experts, two
def test_the_gather_product_is_the_float64_product(pairs):
    """moe._gather_product (the gather form's batched GEMV) is the float64 product to f32 rounding on random bf16
    inputs, pairs sharing experts, at a traced offset into the stacked matrices; in x's dtype by default."""
    rng = np.random.default_rng(pairs)
    d, n, offset = 96, 64, 5
    x = jnp.asarray(rng.normal(size=(pairs, d)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(offset + 6, n, d)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, 6, pairs), jnp.int32)
    got = np.asarray(jax.jit(moe._gather_product, static_argnames="out_dtype")(x, w, ids, jnp.int32(offset),
                                                                                out_dtype=jnp.float32))
    exact = np.einsum("pd,pnd->pn", np.asarray(x, np.float64), np.asarray(w, np.float64)[offset + np.asarray(ids)])
    assert got.dtype == np.float32 and np.abs(got - exact).max() < 1e-6 * np.abs(exact).max()
    assert moe._gather_product(x, w, ids, offset).dtype == jnp.bfloat16


@pytest.mark.parametrize("sizes,block_rows,offset", [
    ([3, 0, 5, 0, 0, 20, 1, 0], None, 0),  # empty groups, one over two tiles of 16
    ([0, 0, 2], 16, 4),  # one group, at an offset into the matrices
    ([17, 0, 0, 1], 16, 1),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_matmul_kernel_interpreted(sizes, block_rows, offset, dtype):
    rng = np.random.default_rng(len(sizes) + offset)
    rows, k, n = sum(sizes) + 3, 96, 128  # 3 rows past the groups: 0
    x = jnp.asarray(rng.normal(size=(rows, k)), dtype)
    w = jnp.asarray(rng.normal(size=(offset + len(sizes) + 1, n, k)), dtype)
    s = jnp.asarray(sizes, jnp.int32)
    got = gmm.grouped_matmul(x, w, s, jnp.int32(offset), out_dtype=jnp.float32, block_rows=block_rows, interpret=True)
    want = np.zeros((rows, n))
    starts = np.cumsum([0] + sizes)
    for g in range(len(sizes)):
        for r in range(starts[g], starts[g + 1]):
            want[r] = np.asarray(w[offset + g], np.float64) @ np.asarray(x[r], np.float64)
    assert np.abs(np.asarray(got) - want).max() < 1e-3 * np.abs(want).max()
    np.testing.assert_array_equal(np.asarray(gmm.reference(x, w, s, offset, jnp.float32))[sum(sizes):], 0)
    tiles = np.asarray(gmm.schedule(s, rows, block_rows or gmm.default_block_rows(rows, len(sizes)), offset))
    live = tiles[tiles[:, 2] > tiles[:, 1]]
    assert sorted(set(live[:, 0] - offset)) == [g for g, c in enumerate(sizes) if c]  # empty groups: no tile


# ---------------------------------------------------------------------------------------------- weights


def test_experts_load_from_both_layouts_and_through_orbax(target, tmp_path):
    """The hub's one tensor per expert and transformers 5's fused gate_up_proj [E, 2F, D] / down_proj [E, D, F] give the
    same params; a converted checkpoint restores them; a missing expert or two forms of one layer are named."""
    cfg, params = target
    hub = stored(FIX / "target")
    fused = {k: v for k, v in hub.items() if ".experts." not in k}
    for layer in range(cfg.num_layers):
        pre = f"model.layers.{layer}.mlp.experts."
        fused[pre + "gate_up_proj"] = np.stack(
            [np.concatenate([hub[f"{pre}{e}.gate_proj.weight"], hub[f"{pre}{e}.up_proj.weight"]]) for e in range(8)])
        fused[pre + "down_proj"] = np.stack([hub[f"{pre}{e}.down_proj.weight"] for e in range(8)])
    v5 = write_model(tmp_path / "v5", fused)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(weights.load_target(v5)[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(params.layers.experts_gate_up[1, 5, 32:],
                                  hub["model.layers.1.mlp.experts.5.up_proj.weight"])
    np.testing.assert_array_equal(params.layers.router[3], hub["model.layers.3.mlp.gate.weight"].T)

    raw = weights.read_config(str(FIX / "target"))
    checkpoint.save(str(tmp_path / "ckpt"), weights.read_hf(v5, "target", cfg), raw, "target")
    got_cfg, got = checkpoint.restore(str(tmp_path / "ckpt"))
    assert got_cfg == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    gone = {k: v for k, v in hub.items() if k != "model.layers.2.mlp.experts.6.up_proj.weight"}
    with pytest.raises(weights.WeightsError, match=r"missing tensor\(s\).*layers\.2\.mlp\.experts\.6\.up_proj"):
        weights.load_target(write_model(tmp_path / "gone", gone))
    both = {**hub, "model.layers.0.mlp.experts.down_proj": fused["model.layers.0.mlp.experts.down_proj"]}
    with pytest.raises(weights.WeightsError, match="layer 0 holds layers.experts_down in two forms"):
        weights.load_target(write_model(tmp_path / "both", both))
    with pytest.raises(weights.WeightsError, match=r"experts\.8\.gate_proj"):  # a ninth expert: unexpected
        weights.load_target(write_model(tmp_path / "nine", {**hub, "model.layers.0.mlp.experts.8.gate_proj.weight":
                                                             hub["model.layers.0.mlp.experts.0.gate_proj.weight"]}))


def test_a_stack_mixing_dense_and_sparse_layers(target, npz, tmp_path):
    """Layer 1 dense (mlp_only_layers): a dense MLP with one expert's matrices computes what a sparse layer whose
    experts are all that expert computes (the routing weights sum to 1), so the two checkpoints give the same logits."""
    cfg, _ = target
    hub = stored(FIX / "target")
    pre = "model.layers.1.mlp."
    same = dict(hub)
    for e in range(8):
        for m in ("gate", "up", "down"):
            same[f"{pre}experts.{e}.{m}_proj.weight"] = hub[f"{pre}experts.0.{m}_proj.weight"]
    mixed = {k: v for k, v in hub.items() if not k.startswith(pre)}
    mixed.update({f"{pre}{m}_proj.weight": hub[f"{pre}experts.0.{m}_proj.weight"] for m in ("gate", "up", "down")})
    a_cfg, a = weights.load_target(write_model(tmp_path / "same", same))
    b_cfg, b = weights.load_target(write_model(tmp_path / "mixed", mixed, mlp_only_layers=[1], intermediate_size=32))
    assert b_cfg.dense_layers == (1,) and b.layers.sparse_pattern == (True, False, True, True)
    assert b.layers.w_gate.shape == (1, 64, 32) and b.layers.router.shape == (3, 64, 8)
    assert P.layer(b.layers, 1).router is None and P.layer(b.layers, 2).w_gate is None
    np.testing.assert_array_equal(np.asarray(P.layer(b.layers, 3).router), np.asarray(a.layers.router[3]))
    want, _ = run_chunked(a_cfg, a, npz["prompt"], chunk=32)
    got, _ = run_chunked(b_cfg, b, npz["prompt"], chunk=32)
    assert np.abs(got - want).max() < 1e-5


# ---------------------------------------------------------------------------------------------- decoding
MASK = 255  # the drafter's mask token


def as_reference(run, output: list[int]) -> list[int]:
    """An output as the official code reports it: it drops the mask token from what it generates, which this target
    chooses twice on the third prompt (its outputs are 2 tokens short of max_new_tokens there); ours keeps every
    token the target chose."""
    n = len(run["prompt"])
    assert output[:n] == run["prompt"] and len(output) == n + run["max_new_tokens"]
    return output[:n] + [t for t in output[n:] if t != MASK]


def test_ar_matches_the_reference(target, runs):
    for run in runs:
        res = decode.generate(target, [run["prompt"]], decode.GenerateOptions(max_new_tokens=run["max_new_tokens"]))
        assert as_reference(run, res.output_ids[0]) == run["ar"]
    assert MASK in res.output_ids[0]  # the third prompt


def test_dflash_matches_the_reference(target, drafter, runs):
    outputs, acceptance, _ = rows_with_their_own_limits(target, drafter, runs, decode.GenerateOptions(method="dflash"))
    for run, output, accepted in zip(runs, outputs, acceptance):
        assert as_reference(run, output) == run["dflash"]["output"] == run["ar"]
        assert accepted == run["dflash"]["acceptance_lengths"]


@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_ddtree_matches_the_reference_round_by_round(target, drafter, runs, budget):
    """Outputs and acceptance lengths equal; trees as path sets (the last rounds excepted: the fixture README)."""
    opts = decode.GenerateOptions(method="ddtree", tree_budget=budget, trace=True)
    outputs, acceptance, traced = rows_with_their_own_limits(target, drafter, runs, opts)
    same = compared = 0
    for run, output, accepted, rounds in zip(runs, outputs, acceptance, traced):
        ref = run["ddtree"][str(budget)]
        assert as_reference(run, output) == ref["output"] == run["ar"]
        assert accepted == ref["acceptance_lengths"]
        limit = len(run["prompt"]) + run["max_new_tokens"] + 1 + budget
        starts = len(run["prompt"]) + np.concatenate([[0], np.cumsum(ref["acceptance_lengths"])[:-1]])
        for mine, theirs, whole in zip(rounds, ref["rounds"], starts + drafter[0].block_size <= limit):
            assert accepted_tokens(mine) == accepted_tokens(theirs)
            if whole:
                compared += 1
                same += tree_paths(mine["tree"]["node_token_ids"], mine["tree"]["parents"]) == tree_paths(
                    theirs["tree"]["node_token_ids"], theirs["tree"]["parents"])
    assert compared >= sum(len(a) for a in acceptance) - 3 * drafter[0].block_size
    assert same / compared == 1.0 if budget <= 16 else same / compared >= 0.9, (same, compared)


@pytest.mark.parametrize("layout", ["stacked-out-major-fused", "unstacked-out-major-fused", "stacked-fused"])
def test_gpu_layouts_give_the_same_rounds(target, drafter, runs, layout):
    """The GPU's weight layouts (decode.device_layout: attention matrices output-major or not, q/k/v fused, per-layer
    buffers) leave the experts as they are and decode as the stacked layout does."""
    run = runs[0]
    (cfg, tp), (dcfg, dp) = target, drafter
    laid = decode.device_layout(tp, backend="gpu", layout=layout)
    layers = laid.layers if isinstance(laid.layers, P.LayerWeights) else laid.layers[0]
    assert layers.fused and layers.w_gate is None and layers.experts_gate_up.shape[-2:] == (64, 64)
    opts = decode.GenerateOptions(method="ddtree", tree_budget=16, max_new_tokens=run["max_new_tokens"])
    res = decode.generate((cfg, laid), [run["prompt"]], opts, draft=(dcfg, dp))
    ref = run["ddtree"]["16"]
    assert as_reference(run, res.output_ids[0]) == ref["output"]
    assert res.acceptance_lengths[0] == ref["acceptance_lengths"]
