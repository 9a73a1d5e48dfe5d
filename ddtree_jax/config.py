"""Model configurations parsed from Hugging Face ``config.json`` files.

Three families of target (``Qwen3ForCausalLM``, ``LlamaForCausalLM`` and the Mixture-of-Experts
``Qwen3MoeForCausalLM``) and the z-lab DFlash drafter (``DFlashDraftModel``). Both spellings found in the wild are
accepted: transformers 4 (``rope_theta`` and ``rope_scaling`` at top level, as in the real Qwen3 and Llama-3.1
checkpoints; ``num_experts``) and transformers 5 (``rope_parameters``; ``num_local_experts``). Anything unsupported
is a :class:`ConfigError` that names the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np


class ConfigError(ValueError):
    """A config.json that this project cannot run, with the offending field named."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies [head_dim // 2] (float64 numpy; exact like transformers' float32 path)."""
        inv = 1.0 / (self.theta ** (np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim))
        inv = inv.astype(np.float32)
        if self.kind == "llama3":
            low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv = np.where(medium, smoothed, scaled).astype(np.float32)
        return inv


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: the target, or the layer stack of a DFlash drafter."""

    arch: str  # "qwen3" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qk_norm: bool
    max_position_embeddings: int = 32768
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Mixture of experts (Qwen3-MoE; num_experts 0: a dense model). Every layer's MLP is the sparse block
    # (ddtree_jax.moe) except those in dense_mlp_layers, which have a dense MLP of intermediate_size.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_mlp_layers: tuple[int, ...] = ()

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is the sparse MoE block (none in a dense model)."""
        if not self.num_experts:
            return ()
        return tuple(i for i in range(self.num_layers) if i not in self.dense_mlp_layers)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The layers with a dense SwiGLU MLP of ``intermediate_size`` (all of a dense model's)."""
        sparse = set(self.sparse_layers)
        return tuple(i for i in range(self.num_layers) if i not in sparse)


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """A DFlash block-diffusion drafter: Qwen3-style layers reading the target's hidden states."""

    layers: ModelConfig  # vocab/embedding fields mirror the target's; the drafter owns no embedding
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)


_SUPPORTED_ARCHS = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3_moe"}
# Mixture-of-experts features of other families that the Qwen3-MoE block does not have: (field, what it means)
_UNSUPPORTED_MOE = (("shared_expert_intermediate_size", "shared experts"), ("n_shared_experts", "shared experts"),
                    ("num_shared_experts", "shared experts"), ("router_bias", "a router bias"),
                    ("moe_router_bias", "a router bias"))


def read_json(path: str) -> dict[str, Any]:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise ConfigError(f"no config.json at {path}")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def _rope(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters")
    if params is None:  # transformers 4 spelling
        params = dict(raw.get("rope_scaling") or {})
        if "rope_theta" in raw:
            params["rope_theta"] = raw["rope_theta"]
    params = dict(params)
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if kind == "default":
        return RopeConfig(theta=theta)
    if kind == "llama3":
        try:
            return RopeConfig(
                theta=theta,
                kind="llama3",
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            )
        except KeyError as e:
            raise ConfigError(f"rope_scaling of type llama3 is missing field {e.args[0]!r}") from None
    raise ConfigError(f"unsupported rope type {kind!r} (supported: default, llama3)")


def _require(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise ConfigError(f"config.json is missing required field {key!r}")
    return raw[key]


def _layers_config(raw: dict[str, Any], arch: str) -> ModelConfig:
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported hidden_act {raw['hidden_act']!r} (supported: silu)")
    if raw.get("attention_bias", False):
        raise ConfigError("unsupported attention_bias=true")
    if raw.get("mlp_bias", False):
        raise ConfigError("unsupported mlp_bias=true")
    if arch in ("qwen3", "qwen3_moe") and raw.get("use_sliding_window", False):
        raise ConfigError("unsupported use_sliding_window=true for a Qwen3 target")
    hidden = int(_require(raw, "hidden_size"))
    heads = int(_require(raw, "num_attention_heads"))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    eos = raw.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    return ModelConfig(
        arch=arch,
        vocab_size=int(_require(raw, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(raw, "intermediate_size")),
        num_layers=int(_require(raw, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        eos_token_ids=eos,
        bos_token_id=raw.get("bos_token_id"),
        **(_moe_fields(raw) if arch == "qwen3_moe" else {}),
    )


def _moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """A Qwen3-MoE config's expert fields (transformers 4 ``num_experts``, 5 ``num_local_experts``). As transformers'
    ``Qwen3MoeDecoderLayer``: layer i is sparse unless it is in ``mlp_only_layers`` or (i + 1) is not a multiple of
    ``decoder_sparse_step``."""
    for field, what in _UNSUPPORTED_MOE:
        if raw.get(field):
            raise ConfigError(f"unsupported {field}={raw[field]!r} ({what}; Qwen3-MoE has none)")
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    if experts is None:
        raise ConfigError("config.json is missing required field 'num_experts' (or 'num_local_experts')")
    if not int(experts):  # transformers: every layer dense
        return {}
    experts, top_k = int(experts), int(_require(raw, "num_experts_per_tok"))
    if not 1 <= top_k <= experts:
        raise ConfigError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={experts}")
    layers, step = int(_require(raw, "num_hidden_layers")), int(raw.get("decoder_sparse_step", 1) or 1)
    if step < 1:
        raise ConfigError(f"decoder_sparse_step={step} must be at least 1")
    only = [int(i) for i in raw.get("mlp_only_layers") or ()]
    bad = [i for i in only if not 0 <= i < layers]
    if bad:
        raise ConfigError(f"mlp_only_layers {bad} out of range for {layers} layers")
    return dict(
        num_experts=experts,
        experts_per_token=top_k,
        moe_intermediate_size=int(_require(raw, "moe_intermediate_size")),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        dense_mlp_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step),
    )


def model_config(raw_or_path: dict[str, Any] | str) -> ModelConfig:
    """Parse a target model's config.json (dict, file or model directory)."""
    raw = read_json(raw_or_path) if isinstance(raw_or_path, str) else raw_or_path
    archs = raw.get("architectures") or []
    arch = next((_SUPPORTED_ARCHS[a] for a in archs if a in _SUPPORTED_ARCHS), None)
    if arch is None:
        model_type = raw.get("model_type")
        if not archs and model_type in ("qwen3", "llama", "qwen3_moe"):
            arch = model_type
        else:
            found = ", ".join(archs) if archs else f"model_type={model_type!r}"
            raise ConfigError(
                f"unsupported architecture {found} (supported: {', '.join(_SUPPORTED_ARCHS)})"
            )
    return _layers_config(raw, arch)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference's default spread of tapped target layers when a drafter config names none."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    span = end - start
    return tuple(int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


def draft_config(raw_or_path: dict[str, Any] | str) -> DraftConfig:
    """Parse a z-lab DFlash drafter's config.json."""
    raw = read_json(raw_or_path) if isinstance(raw_or_path, str) else raw_or_path
    archs = raw.get("architectures") or []
    if archs and not any("DFlash" in a for a in archs):
        raise ConfigError(f"not a DFlash drafter: architectures={archs}")
    layers = _layers_config(raw, "qwen3")
    dflash = raw.get("dflash_config") or {}
    num_target_layers = int(_require(raw, "num_target_layers"))
    ids = dflash.get("target_layer_ids")
    ids = tuple(int(i) for i in ids) if ids else default_target_layer_ids(num_target_layers, layers.num_layers)
    mask = dflash.get("mask_token_id", raw.get("mask_token_id"))
    if mask is None:
        raise ConfigError("drafter config has no dflash_config.mask_token_id")
    block_size = int(_require(raw, "block_size"))
    if block_size < 2:
        raise ConfigError(f"drafter block_size={block_size} must be at least 2")
    layer_types = tuple(raw.get("layer_types") or ("full_attention",) * layers.num_layers)
    for t in layer_types:
        if t not in ("full_attention", "sliding_attention"):
            raise ConfigError(f"unsupported drafter layer type {t!r}")
    return DraftConfig(
        layers=layers,
        block_size=block_size,
        mask_token_id=int(mask),
        target_layer_ids=ids,
        num_target_layers=num_target_layers,
        layer_types=layer_types,
        sliding_window=raw.get("sliding_window"),
    )


def check_pair(target: ModelConfig, draft: DraftConfig) -> None:
    """Raise ConfigError unless the drafter can run against this target."""
    if draft.layers.hidden_size != target.hidden_size:
        raise ConfigError(
            f"drafter hidden_size={draft.layers.hidden_size} differs from the target's {target.hidden_size}"
        )
    if draft.layers.vocab_size != target.vocab_size:
        raise ConfigError(f"drafter vocab_size={draft.layers.vocab_size} differs from the target's {target.vocab_size}")
    bad = [i for i in draft.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise ConfigError(f"drafter target_layer_ids {bad} out of range for a {target.num_layers}-layer target")
    if not 0 <= draft.mask_token_id < target.vocab_size:
        raise ConfigError(f"drafter mask_token_id={draft.mask_token_id} outside the vocabulary ({target.vocab_size})")
