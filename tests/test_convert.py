"""Orbax checkpoints (save/restore, shardings), the HF -> orbax converter CLI with its memory bound, and the GGUF
converter CLI's handling of bad input."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from convert.hf_to_orbax import memory_bound
from ddtree_jax import checkpoint
from ddtree_jax.weights import WeightsError, load_draft, load_target, read_config, read_hf

FIX = Path(__file__).parent / "fixtures" / "ddtree_reference"
ROOT = Path(__file__).parents[1]


def bits(x) -> np.ndarray:
    """The raw bytes of an array, so that equality is bit-exact (NaN payloads, -0.0 and all)."""
    return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


def assert_identical(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(bits(x), bits(y))


# ---------------------------------------------------------------------------------------------- checkpoint.py


@pytest.mark.parametrize("kind,src", [("target", "target"), ("draft", "draft"), ("target", "llama_target")])
def test_orbax_round_trip_is_bit_identical(tmp_path, kind, src):
    raw = read_config(str(FIX / src))
    cfg = checkpoint.KINDS[kind].parse(raw)
    host = read_hf(str(FIX / src), kind, cfg)
    checkpoint.save(str(tmp_path / "ckpt"), host, raw, kind)
    assert checkpoint.is_checkpoint(str(tmp_path / "ckpt")) and not checkpoint.is_checkpoint(str(FIX / src))
    assert checkpoint.read_metadata(str(tmp_path / "ckpt"))["kind"] == kind
    got_cfg, got = checkpoint.restore(str(tmp_path / "ckpt"))
    assert got_cfg == cfg
    assert_identical(got, host)


def test_restore_casts_and_places_on_given_shardings(tmp_path):
    _, params = load_target(str(FIX / "target"))
    raw = read_config(str(FIX / "target"))
    checkpoint.save(str(tmp_path / "ckpt"), params, raw, "target")  # jax leaves this time
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: device, params)
    _, got = checkpoint.restore(str(tmp_path / "ckpt"), shardings=shardings, dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(got)} == {jnp.dtype(jnp.bfloat16)}
    assert all(x.sharding == device for x in jax.tree.leaves(got))
    assert_identical(got, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
    with pytest.raises(checkpoint.CheckpointError, match="already exists"):
        checkpoint.save(str(tmp_path / "ckpt"), params, raw, "target")


def test_load_checks_the_checkpoint_kind(tmp_path):
    raw = read_config(str(FIX / "draft"))
    cfg = checkpoint.KINDS["draft"].parse(raw)
    checkpoint.save(str(tmp_path / "d"), read_hf(str(FIX / "draft"), "draft", cfg), raw, "draft")
    assert_identical(load_draft(str(tmp_path / "d"))[1], load_draft(str(FIX / "draft"))[1])
    with pytest.raises(WeightsError, match="is a draft checkpoint, not a target"):
        load_target(str(tmp_path / "d"))


SHARDED_RESTORE = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from ddtree_jax import checkpoint
    from ddtree_jax.weights import load_target
    mesh = Mesh(np.array(jax.devices()), ("model",))
    ckpt, src = sys.argv[1], sys.argv[2]
    cfg, ref = load_target(src)
    by_heads = lambda x: NamedSharding(mesh, P(None, None, "model", None) if x.ndim == 4 else P())
    _, got = checkpoint.restore(ckpt, shardings=jax.tree.map(by_heads, ref))
    shards = got.layers.wq.addressable_shards
    assert [s.data.shape for s in shards] == [(6, 64, 2, 16)] * 2, [s.data.shape for s in shards]
    assert len({s.device for s in shards}) == 2
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    print("ok")
    """
)


def test_restore_shards_across_devices(tmp_path):
    _, params = load_target(str(FIX / "target"))
    checkpoint.save(str(tmp_path / "ckpt"), params, read_config(str(FIX / "target")), "target")
    run = subprocess.run(
        [sys.executable, "-c", SHARDED_RESTORE, str(tmp_path / "ckpt"), str(FIX / "target")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


# ---------------------------------------------------------------------------------------------- the CLI


def cli(*args, timeout=120) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "convert.hf_to_orbax", *map(str, args)],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout,
    )


def test_cli_converts_target_to_bfloat16(tmp_path):
    dst = tmp_path / "qwen3"
    run = cli(FIX / "target", dst)
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    meta = checkpoint.read_metadata(str(dst))
    assert meta == {"format": "ddtree_jax", "version": 1, "kind": "target", "dtype": "bfloat16"}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (dst / name).read_bytes() == (FIX / "target" / name).read_bytes()
    assert json.loads((dst / "config.json").read_text()) == read_config(str(FIX / "target"))
    cfg, got = load_target(str(dst), dtype=jnp.bfloat16)
    assert {x.dtype for x in jax.tree.leaves(got)} == {jnp.dtype(jnp.bfloat16)}
    _, want = load_target(str(FIX / "target"), dtype=jnp.bfloat16)
    assert_identical(got, want)
    assert not list(tmp_path.glob("*.partial-*"))


@pytest.mark.parametrize(
    "src,load,extra", [("draft", load_draft, []), ("llama_target", load_target, ["--dtype", "float32"])]
)
def test_cli_converts_draft_and_sharded_targets(tmp_path, src, load, extra):
    run = cli(FIX / src, tmp_path / "out", *extra)
    assert run.returncode == 0, run.stderr
    dtype = jnp.float32 if extra else jnp.bfloat16
    assert_identical(load(str(tmp_path / "out"), dtype=dtype)[1], load(str(FIX / src), dtype=dtype)[1])


def test_cli_refuses_to_overwrite_without_force(tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "precious").write_text("keep me")
    run = cli(FIX / "draft", dst)
    assert run.returncode != 0 and "already exists" in run.stderr and "--force" in run.stderr
    assert (dst / "precious").exists()
    run = cli(FIX / "draft", dst, "--force", "--dtype", "float16")
    assert run.returncode == 0, run.stderr
    assert not (dst / "precious").exists() and checkpoint.read_metadata(str(dst))["dtype"] == "float16"


def broken_copy(tmp_path) -> Path:
    d = tmp_path / "broken"
    shutil.copytree(FIX / "llama_target", d)
    os.remove(d / "model-00005-of-00007.safetensors")
    return d


BAD_INPUTS = {  # case -> (arguments from tmp_path, words on the one stderr line)
    "no source": (lambda tmp: [tmp / "missing", tmp / "out"], "no such model directory"),
    "missing shard": (lambda tmp: [broken_copy(tmp), tmp / "out"], "model-00005-of-00007.safetensors"),
    "wrong kind": (lambda tmp: [FIX / "target", tmp / "out", "--kind", "draft"], "not a DFlash drafter"),
    "bad dtype": (lambda tmp: [FIX / "target", tmp / "out", "--dtype", "int8"], "invalid choice"),
    "missing argument": (lambda tmp: [FIX / "target"], "required"),
    "onto its source": (lambda tmp: [FIX / "draft", FIX / "draft", "--force"], "would overwrite the source"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_cli_bad_input_is_one_stderr_line(tmp_path, case):
    args, words = BAD_INPUTS[case]
    run = cli(*args(tmp_path))
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], run.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("*.partial-*"))


def test_cli_help_describes_every_flag():
    run = cli("--help")
    assert run.returncode == 0
    for flag in ("SRC", "DST", "--dtype", "--kind", "--force", "bfloat16", "auto"):
        assert flag in run.stdout


@pytest.mark.parametrize("args,words", [
    ([], "SRC and DST are required"),
    (["--default", "a", "b"], "--default takes at most one path"),
    (["{tmp}/missing.gguf", "{tmp}/out"], "not a readable GGUF file"),
    (["{tmp}/bad.gguf", "{tmp}/out"], "GGUF magic invalid"),
    (["{tmp}/bad.gguf", "{tmp}/out", "--dtype", "int8"], "invalid choice"),
])
def test_gguf_cli_bad_input_is_one_stderr_line(tmp_path, capsys, args, words):
    from convert import gguf_to_orbax

    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    code = gguf_to_orbax.main([a.format(tmp=tmp_path) for a in args])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and words in err, err
    assert not (tmp_path / "out").exists()


def test_gguf_cli_help_describes_every_flag(capsys):
    from convert import gguf_to_orbax

    assert gguf_to_orbax.main(["--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("SRC", "DST", "--default", "--dtype", "--force", "float32"):
        assert flag in out


# ---------------------------------------------------------------------------------------------- memory


def write_synthetic(dst: Path, d=1024, heads=8, f=4096, layers=4, vocab=4096) -> tuple[int, int]:
    """A float32 Llama-shaped model written tensor by tensor; returns (its bf16 output bytes, largest tensor bytes)."""
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,), "lm_head.weight": (vocab, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (d, d), p + "self_attn.k_proj.weight": (d, d),
            p + "self_attn.v_proj.weight": (d, d), p + "self_attn.o_proj.weight": (d, d),
            p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d), p + "mlp.down_proj.weight": (d, f),
        })  # fmt: skip
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header).encode()
    dst.mkdir()
    rng = np.random.default_rng(0)
    with open(dst / "model.safetensors", "wb") as out:
        out.write(len(head).to_bytes(8, "little") + head)
        for shape in shapes.values():
            out.write(rng.standard_normal(shape, dtype=np.float32).tobytes())
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": d, "intermediate_size": f, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "vocab_size": vocab, "tie_word_embeddings": False,
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config))
    return offset // 2, 4 * max(int(np.prod(s)) for s in shapes.values())


def peak_rss(*args) -> int:
    """Peak resident bytes of one converter run: os.wait4 gives this child's own rusage (ru_maxrss), which
    RUSAGE_CHILDREN would mix with every earlier child of the test process."""
    child = subprocess.Popen(
        [sys.executable, "-m", "convert.hf_to_orbax", *map(str, args)],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    with child.stderr:
        stderr = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    assert child.returncode == 0, stderr[-2000:]
    return usage.ru_maxrss * 1024  # kilobytes on Linux


def test_conversion_peak_memory_is_output_plus_one_tensor(tmp_path):
    output_bytes, largest = write_synthetic(tmp_path / "big")  # ~300 MB on disk, ~150 MB of bf16 output, largest 16 MB
    baseline = peak_rss(FIX / "target", tmp_path / "tiny")  # interpreter, jax, orbax, tensorstore
    peak = peak_rss(tmp_path / "big", tmp_path / "big_out")
    margin = 32 << 20
    mib = {k: v >> 20 for k, v in dict(extra=peak - baseline, output=output_bytes, largest=largest).items()}
    assert peak - baseline < output_bytes + largest + margin, mib  # measured: extra ~124, output 144, largest 16
    assert checkpoint.read_metadata(str(tmp_path / "big_out"))["dtype"] == "bfloat16"


QWEN3_8B = {  # the real config.json's relevant fields (transformers-4 spelling)
    "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "tie_word_embeddings": False, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
}  # fmt: skip


def test_8b_bound_by_construction_fits_24_gib():
    """The bound the test above measures, evaluated on Qwen3-8B's shapes (nothing allocated)."""
    output_bytes, largest = memory_bound("target", QWEN3_8B, "bfloat16", stored_itemsize=2)
    assert 16.3e9 < output_bytes < 16.5e9  # 8.19 G params in bf16
    assert largest == 151936 * 4096 * 2  # the embedding (and lm_head): 1.24 GB
    interpreter = 1 << 30  # python + jax + orbax + tensorstore (the measured baseline is ~0.2 GB)
    assert output_bytes + largest + interpreter < 24 * 2**30
