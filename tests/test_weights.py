"""Hugging Face safetensors -> params pytrees: layouts, stored dtypes, sharded/tied targets, and every error."""

import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from ddtree_jax.params import draft_shapes, target_shapes
from ddtree_jax.weights import WeightsError, load_draft, load_target

FIX = Path(__file__).parent / "fixtures" / "ddtree_reference"


def stored(model_dir) -> dict[str, np.ndarray]:
    """Every tensor of a model directory, read with the safetensors library (an independent reader)."""
    out = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def write_model(dst, src_dir, tensors: dict[str, np.ndarray], **config_changes) -> Path:
    """A single-file model directory at dst with src_dir's config.json (optionally edited) and these tensors."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((Path(src_dir) / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **config_changes}))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def shapes_of(tree):
    return jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), tree)


# ---------------------------------------------------------------------------------------------- layouts

D, H, K, HD = 64, 4, 2, 16
TARGET_CHECKS = [  # (pytree getter, HF tensor, HF -> pytree layout)
    (lambda p: p.embed, "model.embed_tokens.weight", lambda x: x),
    (lambda p: p.final_norm, "model.norm.weight", lambda x: x),
    (lambda p: p.lm_head, "lm_head.weight", lambda x: x.T),
    (lambda p: p.layers.wq[3], "model.layers.3.self_attn.q_proj.weight", lambda x: x.T.reshape(D, H, HD)),
    (lambda p: p.layers.wk[1], "model.layers.1.self_attn.k_proj.weight", lambda x: x.T.reshape(D, K, HD)),
    (lambda p: p.layers.wv[5], "model.layers.5.self_attn.v_proj.weight", lambda x: x.T.reshape(D, K, HD)),
    (lambda p: p.layers.wo[2], "model.layers.2.self_attn.o_proj.weight", lambda x: x.T.reshape(H, HD, D)),
    (lambda p: p.layers.q_norm[4], "model.layers.4.self_attn.q_norm.weight", lambda x: x),
    (lambda p: p.layers.k_norm[0], "model.layers.0.self_attn.k_norm.weight", lambda x: x),
    (lambda p: p.layers.attn_norm[5], "model.layers.5.input_layernorm.weight", lambda x: x),
    (lambda p: p.layers.mlp_norm[2], "model.layers.2.post_attention_layernorm.weight", lambda x: x),
    (lambda p: p.layers.w_gate[1], "model.layers.1.mlp.gate_proj.weight", lambda x: x.T),
    (lambda p: p.layers.w_up[3], "model.layers.3.mlp.up_proj.weight", lambda x: x.T),
    (lambda p: p.layers.w_down[4], "model.layers.4.mlp.down_proj.weight", lambda x: x.T),
]
DRAFT_CHECKS = [
    (lambda p: p.fc, "fc.weight", lambda x: x.T),
    (lambda p: p.hidden_norm, "hidden_norm.weight", lambda x: x),
    (lambda p: p.final_norm, "norm.weight", lambda x: x),
    (lambda p: p.layers.q_norm[1], "layers.1.self_attn.q_norm.weight", lambda x: x),
    (lambda p: p.layers.wo[1], "layers.1.self_attn.o_proj.weight", lambda x: x.T.reshape(H, HD, D)),
    (lambda p: p.layers.wk[0], "layers.0.self_attn.k_proj.weight", lambda x: x.T.reshape(D, K, HD)),
    (lambda p: p.layers.w_down[1], "layers.1.mlp.down_proj.weight", lambda x: x.T),
]


def check_values(params, tensors, checks):
    for get, name, layout in checks:
        np.testing.assert_array_equal(np.asarray(get(params)), layout(tensors[name]), err_msg=name)


def test_target_loads_with_pytree_layout():
    cfg, params = load_target(str(FIX / "target"))
    assert shapes_of(params) == shapes_of(target_shapes(cfg, jnp.float32))
    check_values(params, stored(FIX / "target"), TARGET_CHECKS)


def test_draft_loads_with_pytree_layout():
    cfg, params = load_draft(str(FIX / "draft"))
    assert cfg.target_layer_ids == (1, 4) and cfg.block_size == 8
    assert shapes_of(params) == shapes_of(draft_shapes(cfg, jnp.float32))
    check_values(params, stored(FIX / "draft"), DRAFT_CHECKS)


def test_draft_accepts_model_prefix(tmp_path):
    tensors = {"model." + k: v for k, v in stored(FIX / "draft").items()}
    _, params = load_draft(str(write_model(tmp_path / "d", FIX / "draft", tensors)))
    check_values(params, stored(FIX / "draft"), DRAFT_CHECKS)


def test_llama_sharded_tied_target():
    cfg, params = load_target(str(FIX / "llama_target"))
    assert cfg.tie_word_embeddings and params.lm_head is None
    assert params.layers.q_norm is None and params.layers.k_norm is None
    assert shapes_of(params) == shapes_of(target_shapes(cfg, jnp.float32))
    t = stored(FIX / "llama_target")
    np.testing.assert_array_equal(params.embed, t["model.embed_tokens.weight"])
    np.testing.assert_array_equal(params.layers.wv[2], t["model.layers.2.self_attn.v_proj.weight"].T.reshape(48, 2, 8))
    np.testing.assert_array_equal(params.layers.wo[1], t["model.layers.1.self_attn.o_proj.weight"].T.reshape(6, 8, 48))
    np.testing.assert_array_equal(params.layers.w_down[2], t["model.layers.2.mlp.down_proj.weight"].T)


@pytest.mark.parametrize("stored_dtype", [ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_half_precision_files(tmp_path, stored_dtype, dtype):
    half = {k: v.astype(stored_dtype) for k, v in stored(FIX / "target").items()}
    _, params = load_target(str(write_model(tmp_path / "t", FIX / "target", half)), dtype=dtype)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(dtype)}
    want = {k: v.astype(np.float32).astype(dtype) for k, v in half.items()}
    check_values(params, want, TARGET_CHECKS)


def test_tied_target_may_store_an_equal_lm_head(tmp_path):
    tensors = stored(FIX / "llama_target")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    _, params = load_target(str(write_model(tmp_path / "ok", FIX / "llama_target", tensors)))
    assert params.lm_head is None
    tensors["lm_head.weight"][0, 0] += 1.0
    with pytest.raises(WeightsError, match="lm_head.weight differs from embed"):
        load_target(str(write_model(tmp_path / "bad", FIX / "llama_target", tensors)))


# ---------------------------------------------------------------------------------------------- errors


def edited(edit):
    """A maker of a copy of the Qwen3 target whose tensors dict went through ``edit``."""

    def make(tmp_path) -> Path:
        tensors = stored(FIX / "target")
        edit(tensors)
        return write_model(tmp_path / "broken", FIX / "target", tensors)

    return make


def put(name: str, x: np.ndarray):
    return edited(lambda t: t.update({name: x}))


def cut_file(keep):
    """A maker of a copy of the Qwen3 target whose file bytes went through ``keep``."""

    def make(tmp_path) -> Path:
        d = tmp_path / "cut"
        shutil.copytree(FIX / "target", d)
        (d / "model.safetensors").write_bytes(keep((d / "model.safetensors").read_bytes()))
        return d

    return make


def in_parts(src: str):
    """A maker of a copy of a fixture model whose model.safetensors is cut into .partNN files (as a device call
    returns a drafter)."""

    def make(tmp_path) -> Path:
        d = tmp_path / "parts"
        shutil.copytree(FIX / src, d)
        data = (d / "model.safetensors").read_bytes()
        (d / "model.safetensors.part00").write_bytes(data[: len(data) // 2])
        (d / "model.safetensors.part01").write_bytes(data[len(data) // 2:])
        os.remove(d / "model.safetensors")
        return d

    return make


def without(src: str, name: str):
    """A maker of a copy of a fixture model without one of its files."""

    def make(tmp_path) -> Path:
        d = tmp_path / "copy"
        shutil.copytree(FIX / src, d)
        os.remove(d / name)
        return d

    return make


CORRUPT = ["truncated or corrupt", "model.safetensors"]
ERRORS = {  # case -> (make the broken directory in tmp_path, load function, words the error must contain)
    "no directory": (lambda tmp: tmp / "nowhere", load_target, ["no such model directory", "nowhere"]),
    "no config": (without("target", "config.json"), load_target, ["no config.json"]),
    "no safetensors": (without("target", "model.safetensors"), load_target, ["no model.safetensors"]),
    "only parts": (in_parts("draft"), load_draft,
                   ["no model.safetensors, only its parts", "cat model.safetensors.part*"]),
    "missing shard": (
        without("llama_target", "model-00003-of-00007.safetensors"),
        load_target,
        ["missing safetensors file", "model-00003-of-00007.safetensors"],
    ),
    "missing tensor": (
        edited(lambda t: t.pop("model.layers.4.mlp.up_proj.weight")),
        load_target,
        ["missing tensor", "model.layers.4.mlp.up_proj.weight"],
    ),
    "unexpected tensor": (
        put("model.layers.0.self_attn.q_proj.bias", np.zeros(64, np.float32)),
        load_target,
        ["unexpected tensor", "model.layers.0.self_attn.q_proj.bias"],
    ),
    "extra layer": (
        put("model.layers.6.input_layernorm.weight", np.ones(64, np.float32)),
        load_target,
        ["unexpected tensor", "model.layers.6.input_layernorm.weight"],
    ),
    "many unexpected": (
        edited(lambda t: t.update({f"extra.{i}.weight": np.zeros(2, np.float32) for i in range(20)})),
        load_target,
        ["unexpected tensor", "(14 more)"],
    ),
    "shape": (
        put("model.layers.2.self_attn.k_proj.weight", np.zeros((16, 64), np.float32)),
        load_target,
        ["model.layers.2.self_attn.k_proj.weight", "[16, 64]", "[32, 64]"],
    ),
    "int8": (put("model.norm.weight", np.ones(64, np.int8)), load_target, ["norm.weight", "unsupported dtype I8"]),
    "truncated": (cut_file(lambda b: b[:-100]), load_target, CORRUPT),
    "corrupt header": (cut_file(lambda b: b[:8] + b"{garbage" + b[16:]), load_target, CORRUPT),
    "empty file": (cut_file(lambda b: b""), load_target, CORRUPT),
    "not a drafter": (lambda tmp: FIX / "target", load_draft, ["not a DFlash drafter"]),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_are_one_line_and_named(tmp_path, case):
    make, load, words = ERRORS[case]
    with pytest.raises(WeightsError) as err:
        load(str(make(tmp_path)))
    msg = str(err.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_the_shipped_default_drafter_loads_and_fits_smollm2():
    """The drafter in the package (what `generate` with no arguments runs) loads, and its shape is SmolLM2-135M's
    (hidden 576, 9/3 heads of 64, taps inside its 30 layers, block 16): checked without the target's download."""
    from ddtree_jax import defaults

    dcfg, dp = load_draft(defaults.draft_path())
    assert (dcfg.block_size, dcfg.num_target_layers) == (16, 30)
    assert (dcfg.layers.hidden_size, dcfg.layers.num_heads, dcfg.layers.num_kv_heads, dcfg.layers.head_dim) == (
        576, 9, 3, 64)
    assert all(0 <= i < 30 for i in dcfg.target_layer_ids)
    assert all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in jax.tree.leaves(dp))
