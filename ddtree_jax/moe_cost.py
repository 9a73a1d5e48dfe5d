"""What a step of a Mixture-of-Experts target reads: the experts its tokens route to, measured from the router's
choices (for ``bench models`` and ``benchmarks/moe_h200.py``).

A forward over n tokens reads, per layer, the attention and router weights and the distinct experts its n x k (token,
slot) pairs route to, each once (``ddtree_jax.moe``). Random weights route nearly uniformly: n independent tokens
reach E (1 - (1 - k / E)^n) experts of a layer on average (:func:`uniform_distinct`; Qwen3-Coder-30B-A3B: 8 for one
token, 82 for 16, 126 for 64). Real routing is correlated, so a checkpoint's trees touch fewer.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from ddtree_jax import moe
from ddtree_jax.config import ModelConfig
from ddtree_jax.params import LayerWeights

EXPERT_FIELDS = ("experts_gate_up", "experts_down")


def _layers(layers) -> list[LayerWeights]:
    return list(layers) if isinstance(layers, (tuple, list)) else [layers]


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def expert_bytes(layers) -> int:
    """Bytes of one expert of one layer (its gate|up and down matrices); layers: stacked, or a per-layer tuple."""
    w = next(w for w in _layers(layers) if w.experts_gate_up is not None)
    return sum(math.prod(a.shape[-2:]) * a.dtype.itemsize for a in (w.experts_gate_up, w.experts_down))


def layer_bytes(layers, distinct: list[int] | None = None) -> int:
    """Bytes of a target's layer weights that a step reads: every weight but the experts', and ``distinct[i]`` experts
    of the i-th sparse layer (every expert when None). layers: stacked, or a per-layer tuple."""
    ws = _layers(layers)
    experts = sum(_nbytes([getattr(w, f) for f in EXPERT_FIELDS]) for w in ws)
    if distinct is None:
        return _nbytes(ws)
    return _nbytes(ws) - experts + sum(distinct) * expert_bytes(layers)


def uniform_distinct(cfg: ModelConfig, tokens: int) -> float:
    """The distinct experts per layer that ``tokens`` tokens routed independently and uniformly reach on average."""
    e, k = cfg.num_experts, cfg.experts_per_token
    return e * (1 - (1 - k / e) ** tokens)


def routed(spec, target, drafter, state) -> dict:
    """One round of ``spec`` (``round.round_step``, its verify over the batch's 1 + budget rows and their padding)
    from ``state``, traced afresh with the MoE layers recording their choices: {"distinct": experts touched per sparse
    layer, "mean", "min", "max", "tokens": rows of the verify, "uniform": :func:`uniform_distinct` of them}. One device
    (each device of a mesh would report its own copy of the choices)."""
    from ddtree_jax.round import round_step

    if spec.mesh is not None:
        raise ValueError("routed experts are measured on one device")
    seen: list = []
    with moe.recording(seen):
        jax.block_until_ready(jax.jit(lambda t, d, s: round_step(spec, t, d, s))(target, drafter, state))
    distinct = [len(np.unique(ids)) for ids in seen]
    tokens = int(seen[0].shape[0])
    return {"distinct": distinct, "mean": float(np.mean(distinct)), "min": min(distinct), "max": max(distinct),
            "tokens": tokens, "uniform": uniform_distinct(spec.target, tokens)}

