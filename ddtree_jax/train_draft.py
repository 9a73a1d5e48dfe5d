"""``python -m ddtree_jax.train_draft --target PATH``: train a DFlash drafter for a target, in JAX with optax.

Pipeline (each stage's output is kept in ``--out``, so a rerun resumes where it stopped):

    prompts    real offline text: the Python documentation shipped with CPython itself (``pydoc_data.topics``,
               the language reference; PSF licence), turned into chat requests ("explain", "summarise", ...)
               and plain continuations; a fixed share of topics is held out for evaluation
    data       the target's own greedy continuations of those prompts (``decode.generate``, method ar), then one
               target forward per sequence for the hidden features at ``target_layer_ids``      -> data.npz
    train      DFlash's block-diffusion objective (below) with AdamW; orbax checkpoints of params, optimiser
               state and step every ``--save-every`` steps (resume = rerun the same command)       -> ckpt/
    evaluate   mean acceptance length of ``decode.generate(method="ddtree")`` on held-out prompts
    export     the z-lab drafter layout: config.json + model.safetensors (``layers.N.*``, ``fc.weight``,
               ``hidden_norm.weight``, ``norm.weight``), loadable by ``weights.load_draft``         -> drafter/

The objective (DFlash, arXiv 2602.06036): for each sequence, ``--anchors`` random anchor positions a in the
generated part. A block is [x_a, MASK x (bs-1)] at positions a .. a+bs-1; the drafter sees the target features
of positions 0 .. a-1 (its context, as at inference, where the block's first token is the last emitted token
whose features the target has not computed yet) and its own block, and predicts x_{a+1} .. x_{a+bs-1}. The
cross-entropy of depth k (1-based) is weighted by exp(-(k-1)/gamma). All anchors of a sequence are trained at
once under a block-sparse mask: block i's queries see context keys j < a_i and the keys of block i only.

The forward is :mod:`ddtree_jax.draft`'s layer math (``model.qkv``, ``model.mlp``, ``model.rms_norm``, the
target's embedding and lm_head), with that explicit mask instead of the KV cache; a test checks the two agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import sys
import time
from typing import Any, Sequence

import numpy as np

from ddtree_jax import cli

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # DFlash's loss-decay constants by block size
HELD_OUT_EVERY = 8  # every 8th documentation topic (sorted by name) is held out


# ---------------------------------------------------------------------------------------------- prompts


def corpus_passages(min_chars: int = 200, max_chars: int = 700) -> list[tuple[str, str]]:
    """(topic, passage) pairs from ``pydoc_data.topics``: the Python language reference, as shipped with CPython."""
    import pydoc_data.topics as topics

    out = []
    for name in sorted(topics.topics):
        paras = [p.strip() for p in topics.topics[name].split("\n\n")]
        buf = ""
        for p in paras:
            if not p or p.startswith(("*", "   ")) and len(p) < 40:
                continue
            buf = f"{buf}\n\n{p}" if buf else p
            if len(buf) >= min_chars:
                out.append((name, buf[:max_chars]))
                buf = ""
    return out


def stdlib_passages(min_chars: int = 200, max_chars: int = 700) -> list[tuple[str, str]]:
    """(topic, passage) pairs from the Python standard library's own source (PSF licence, offline): every
    function and class of 200-700 characters, and docstrings of that size, parsed with ``ast``; the topic is
    ``stdlib:<module>`` (tests, ``idlelib``, ``lib2to3`` and ``site-packages`` are skipped). Parsed once per
    process (about 4 s; 16 s when ast.get_source_segment split the whole file again for every node) and reused."""
    return list(_stdlib_passages(min_chars, max_chars))


_LINE = re.compile(r"(.*?(?:\r\n|\n|\r|$))")  # a line and its end, as the parser counts lines (ast's own pattern)


def _source_segment(lines: list[str], node) -> str:
    """``ast.get_source_segment(source, node)`` from ``_LINE.findall(source)``, split once per file: the stdlib's
    splits the whole source again for every node (three quarters of the parse's time)."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset: node.end_col_offset].decode()
    return "".join([lines[first].encode()[node.col_offset:].decode(), *lines[first + 1: last],
                    lines[last].encode()[: node.end_col_offset].decode()])


@functools.lru_cache(maxsize=4)
def _stdlib_passages(min_chars: int, max_chars: int) -> tuple[tuple[str, str], ...]:
    import ast
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "turtledemo"}
    out = []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip and not d.startswith("."))
        for fn in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(dirpath, fn)
            module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            try:
                with open(path, encoding="utf-8") as f:
                    source = f.read()
                tree = ast.parse(source)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            lines = _LINE.findall(source)
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    seg = _source_segment(lines, node)
                    if min_chars <= len(seg) <= max_chars:
                        out.append((f"stdlib:{module}", seg))
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    doc = ast.get_docstring(node) or ""
                    if len(doc) >= min_chars:
                        out.append((f"stdlib:{module}", doc[:max_chars]))
    return tuple(sorted(set(out)))


CORPORA = {"pydoc": corpus_passages, "stdlib": stdlib_passages}


TEMPLATES = (
    "Explain the following passage from the Python documentation in simple terms.\n\n{text}",
    "Summarize this text in a few sentences.\n\n{text}",
    "Write a short example that illustrates the following.\n\n{text}",
    "What are the key points of this text?\n\n{text}",
    "{text}\n\nRewrite the text above as a short tutorial for a beginner.",
)
QUESTIONS = (
    "What is {topic} in Python?",
    "How does {topic} work in Python? Give an example.",
    "Explain {topic} to a new programmer.",
)
CODE_TEMPLATES = (
    "Explain what this Python code from the standard library does.\n\n```python\n{text}\n```",
    "Write a short usage example for this Python code.\n\n```python\n{text}\n```",
    "Summarize this Python code in a few sentences.\n\n```python\n{text}\n```",
    "```python\n{text}\n```\n\nRewrite this code with comments for a beginner.",
)


def make_prompts(tokenizer, max_prompt_tokens: int, seed: int = 0, per_passage: int = 1,
                 corpora: Sequence[str] = ("pydoc",)) -> tuple[list[list[int]], list[list[int]]]:
    """(train prompts, held-out prompts) as token ids: chat requests when the tokenizer has a chat template
    (plus a share of plain continuations), plain text otherwise; ``per_passage`` draws of a request kind per
    passage (duplicates dropped). Held out: every HELD_OUT_EVERY-th topic of each corpus (``CORPORA``)."""
    rng = np.random.default_rng(seed)
    passages, held = [], set()
    for name in corpora:
        ps = CORPORA[name]()
        topics = sorted({t for t, _ in ps})
        held |= {t for i, t in enumerate(topics) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1}
        passages += ps
    chat = tokenizer.has_chat_template
    train, test, seen = [], [], set()
    for topic, text in (pt for pt in passages for _ in range(per_passage)):
        words = topic.replace("-", " ")
        msg = None
        if chat:
            kind = rng.integers(0, 10)
            code = topic.startswith("stdlib:")
            templates = CODE_TEMPLATES if code else TEMPLATES
            if kind < 6:
                msg = templates[rng.integers(len(templates))].format(text=text)
            elif kind < 8:
                msg = QUESTIONS[rng.integers(len(QUESTIONS))].format(topic=words.removeprefix("stdlib:") + (
                    " module" if code else ""))
            ids = (tokenizer.encode_chat([{"role": "user", "content": msg}]) if msg is not None
                   else tokenizer.encode(text, add_special_tokens=False))
        else:
            ids = tokenizer.encode(text, add_special_tokens=False)
        if msg is None:  # a plain continuation of the passage's opening
            ids = ids[: min(max_prompt_tokens, 64)]
        if len(ids) > max_prompt_tokens or len(ids) < 4 or tuple(ids) in seen:
            continue
        seen.add(tuple(ids))
        (test if topic in held else train).append(ids)
    order = rng.permutation(len(train))
    return [train[i] for i in order], test


def make_prompts_without_tokenizer(vocab: int, n: int, length: int, seed: int = 0):
    """Random-token prompts for a target without a tokenizer (the tiny test fixtures)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, length).tolist() for _ in range(n)]
    return prompts[: n - max(1, n // 8)], prompts[n - max(1, n // 8):]


# ---------------------------------------------------------------------------------------------- data


@dataclasses.dataclass
class Data:
    """Training sequences: tokens, the target's tapped features, and where each generated part starts.
    ``features`` is None when they are computed online (``--online-features``: by the target, inside each step)."""

    tokens: np.ndarray  # [N, T] int32, 0-padded
    lengths: np.ndarray  # [N] int32
    starts: np.ndarray  # [N] int32: prompt length (first generated position)
    features: np.ndarray | None  # [N, T, taps*D] bfloat16 (or float32)

    def save(self, path: str) -> None:
        tmp = path + ".partial.npz"
        f = self.features
        extra = {} if f is None else {"features": f.view(np.uint16) if f.dtype.itemsize == 2 else f,
                                      "features_dtype": str(f.dtype)}
        np.savez(tmp, tokens=self.tokens, lengths=self.lengths, starts=self.starts, **extra)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "Data":
        import ml_dtypes

        z = np.load(path)
        f = z["features"] if "features" in z else None
        if f is not None and str(z["features_dtype"]) == "bfloat16":
            f = f.view(ml_dtypes.bfloat16)
        return cls(z["tokens"], z["lengths"], z["starts"], f)


def generate_sequences(target, prompts: list[list[int]], max_new_tokens: int, stop_ids: Sequence[int],
                       batch: int, progress=None) -> list[tuple[list[int], int]]:
    """The target's greedy continuations: [(prompt + continuation, prompt length)], in batches of similar length."""
    from ddtree_jax import decode

    opts = decode.GenerateOptions(method="ar", max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_ids))
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[Any] = [None] * len(prompts)
    for s in range(0, len(order), batch):
        idx = order[s:s + batch]
        group = [prompts[i] for i in idx]
        while len(group) < batch:  # one compiled shape per prompt-length bucket
            group.append(group[-1])
        res = decode.generate(target, group, opts)
        for j, i in enumerate(idx):
            out[i] = (res.output_ids[j], len(prompts[i]))
        if progress is not None:
            progress(len(idx))
    return out


def target_features(target, taps: tuple[int, ...], tokens: np.ndarray, batch: int, progress=None,
                    lengths=None) -> np.ndarray:
    """Hidden taps [N, T, taps*D] of the target over full sequences (causal), ``batch`` sequences per forward
    (sequences of similar ``lengths`` together, each forward only as long as its longest; zeros past that)."""
    import jax
    import jax.numpy as jnp

    n, t = tokens.shape
    lengths = np.asarray(lengths if lengths is not None else [t] * n)
    run = jax.jit(functools.partial(tap_features, target, taps))
    out = None
    order = np.argsort(lengths, kind="stable")
    for s in range(0, n, batch):
        idx = order[s:s + batch]
        tt = min(t, -(-int(lengths[idx].max()) // 32) * 32)  # one compiled shape per 32-token bucket
        chunk = np.pad(tokens[idx, :tt], ((0, batch - len(idx)), (0, 0)))
        f = np.asarray(run(jnp.asarray(chunk)))[: len(idx)]
        if out is None:
            out = np.zeros((n, t, f.shape[-1]), f.dtype)
        out[idx, :tt] = f
        if progress is not None:
            progress(len(idx))
    return out


def tap_features(target, taps: tuple[int, ...], tokens):
    """Traceable: the target's hidden taps [B, T, taps*D] over full sequences tokens [B, T] (causal; positions
    past a sequence's end see only what precedes them, so padding changes nothing before it)."""
    import jax.numpy as jnp

    from ddtree_jax import cache as kvcache
    from ddtree_jax import model
    from pallas_kernels.bitmask import causal_bits

    cfg, params = target
    b, tt = tokens.shape
    c = kvcache.init(cfg.num_layers, b, tt, cfg.num_kv_heads, cfg.head_dim, params.embed.dtype)
    _, _, f = model.forward(params, cfg, tokens, jnp.broadcast_to(jnp.arange(tt), (b, tt)), c,
                            causal_bits(b, tt), taps=taps)
    return f


def build_data(target, prompts, *, taps, max_new_tokens, seq_len, stop_ids, batch, log=None,
               features: bool = True) -> Data:
    import tqdm

    with tqdm.tqdm(total=len(prompts), desc="target continuations", unit="seq", file=sys.stderr) as bar:
        seqs = generate_sequences(target, prompts, max_new_tokens, stop_ids, batch, bar.update)
    seqs = [(s[:seq_len], p) for s, p in seqs if min(len(s), seq_len) - p >= 2]
    tokens = np.zeros((len(seqs), seq_len), np.int32)
    for i, (s, _) in enumerate(seqs):
        tokens[i, : len(s)] = s
    lengths = np.asarray([len(s) for s, _ in seqs], np.int32)
    starts = np.asarray([p for _, p in seqs], np.int32)
    if not features:
        return Data(tokens, lengths, starts, None)
    with tqdm.tqdm(total=len(seqs), desc="target features", unit="seq", file=sys.stderr) as bar:
        feats = target_features(target, taps, tokens, batch, bar.update, lengths)
    return Data(tokens, lengths, starts, feats)


# ---------------------------------------------------------------------------------------------- model


def draft_raw_config(target_cfg, *, num_layers: int, block_size: int, mask_token_id: int,
                     target_layer_ids: Sequence[int], intermediate_size: int | None = None) -> dict[str, Any]:
    """A z-lab DFlash config.json for a drafter as wide as the target (its heads and MLP width by default)."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "block_size": int(block_size),
        "dflash_config": {"mask_token_id": int(mask_token_id), "target_layer_ids": [int(i) for i in target_layer_ids]},
        "head_dim": target_cfg.head_dim,
        "hidden_act": "silu",
        "hidden_size": target_cfg.hidden_size,
        "intermediate_size": int(intermediate_size or target_cfg.intermediate_size),
        "layer_types": ["full_attention"] * num_layers,
        "max_position_embeddings": target_cfg.max_position_embeddings,
        "num_attention_heads": target_cfg.num_heads,
        "num_hidden_layers": int(num_layers),
        "num_key_value_heads": target_cfg.num_kv_heads,
        "num_target_layers": target_cfg.num_layers,
        "rms_norm_eps": target_cfg.rms_norm_eps,
        "rope_theta": target_cfg.rope.theta,
        "tie_word_embeddings": False,
        "vocab_size": target_cfg.vocab_size,
        "torch_dtype": "bfloat16",
    }


def init_params(dcfg, key):
    """Random drafter params (f32): matrices N(0, 0.02^2), every norm scale exactly 1. (Starting the final norm
    at the target's was tried on SmolLM2: a higher initial loss, 35 against 26, so no.)"""
    import jax
    import jax.numpy as jnp

    from ddtree_jax import params as P

    p = P.init_random(P.draft_shapes(dcfg, jnp.float32), key)
    leaves, treedef = jax.tree.flatten_with_path(p)
    p = jax.tree.unflatten(treedef, [jnp.ones_like(x) if getattr(path[-1], "name", "") in P.NORMS else x
                                     for path, x in leaves])
    return p


def masked_attention(q, k, v, mask):
    """q [B, A, S, H, hd], k/v [B, A, J, K, hd], mask [B, A, S, J] -> [B, A, S, H, hd] (f32 softmax)."""
    import jax
    import jax.numpy as jnp

    b, a, s, h, hd = q.shape
    kh = k.shape[3]
    qg = q.reshape(b, a, s, kh, h // kh, hd)
    scores = jnp.einsum("basgqd,bajgd->basgqj", qg, k, preferred_element_type=jnp.float32) / math.sqrt(hd)
    scores = jnp.where(mask[:, :, :, None, None, :], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    o = jnp.einsum("basgqj,bajgd->basgqd", probs, v, preferred_element_type=jnp.float32)
    return o.reshape(b, a, s, h, hd).astype(q.dtype)


def draft_hidden(params, dcfg, embed, features, anchors, anchor_tokens, ctx_len: int | None = None):
    """The drafter's output (after its final norm) for blocks at ``anchors``: [B, A, bs, D] f32.

    features [B, T, taps*D] (target taps of every position); anchors [B, A] int32 block start positions;
    anchor_tokens [B, A] the tokens at the anchors. Block i sees context positions j < anchors[i] and itself.
    """
    import jax
    import jax.numpy as jnp

    from ddtree_jax import model

    lc, bs = dcfg.layers, dcfg.block_size
    b, t, _ = features.shape
    na = anchors.shape[1]
    dt = params.fc.dtype
    ctx = jnp.einsum("btf,fd->btd", features.astype(dt), params.fc, preferred_element_type=jnp.float32)
    ctx = model.rms_norm(ctx, params.hidden_norm, lc.rms_norm_eps)  # [B, T, D]
    ccos, csin = model.rope_tables(lc, jnp.broadcast_to(jnp.arange(t), (b, t)))
    tokens = jnp.concatenate([anchor_tokens[..., None], jnp.full((b, na, bs - 1), dcfg.mask_token_id, jnp.int32)], -1)
    positions = (anchors[..., None] + jnp.arange(bs)).reshape(b, na * bs)
    bcos, bsin = model.rope_tables(lc, positions)
    x = jnp.take(embed, tokens.reshape(b, na * bs), axis=0).astype(jnp.float32)  # [B, A*bs, D]
    ctx_visible = jnp.arange(t)[None, None, None, :] < anchors[:, :, None, None]  # [B, A, 1, T]
    mask = jnp.concatenate([jnp.broadcast_to(ctx_visible, (b, na, bs, t)), jnp.ones((b, na, bs, bs), bool)], -1)

    def layer(x, w):
        h = model.rms_norm(x, w.attn_norm, lc.rms_norm_eps)
        q, kb, vb = model.qkv(h, w, lc.rms_norm_eps, bcos, bsin)  # [B, A*bs, ...]
        _, kc, vc = model.qkv(ctx.astype(h.dtype), w, lc.rms_norm_eps, ccos, csin)  # [B, T, K, hd]
        split = lambda z: z.reshape(b, na, bs, *z.shape[2:])  # noqa: E731
        keys = jnp.concatenate([jnp.broadcast_to(kc[:, None], (b, na, *kc.shape[1:])), split(kb)], axis=2)
        vals = jnp.concatenate([jnp.broadcast_to(vc[:, None], (b, na, *vc.shape[1:])), split(vb)], axis=2)
        o = masked_attention(split(q), keys, vals, mask).reshape(b, na * bs, lc.num_heads, lc.head_dim)
        x = x + jnp.einsum("bthk,hkd->btd", o, w.wo, preferred_element_type=jnp.float32)
        x = x + model.mlp(model.rms_norm(x, w.mlp_norm, lc.rms_norm_eps), w)
        return x, None

    x, _ = jax.lax.scan(layer, x, params.layers)
    return model.rms_norm(x, params.final_norm, lc.rms_norm_eps).reshape(b, na, bs, -1)


def sample_anchors(key, starts, lengths, num: int):
    """[B, num] anchor positions, uniform in [start, length - 2] (at least one label after each anchor)."""
    import jax
    import jax.numpy as jnp

    lo = starts[:, None]
    hi = jnp.maximum(lengths[:, None] - 1, lo + 1)
    return jax.random.randint(key, (starts.shape[0], num), lo, hi)


def depth_weights(block_size: int, gamma: float):
    return np.exp(-np.arange(block_size - 1) / gamma).astype(np.float32)


def loss_fn(params, dcfg, head, embed, batch, key, num_anchors: int, gamma: float):
    """Weighted block-diffusion cross-entropy; returns (loss, (per-depth accuracy [bs-1], label count))."""
    import jax
    import jax.numpy as jnp

    tokens, lengths, starts, features = batch
    bs = dcfg.block_size
    anchors = sample_anchors(key, starts, lengths, num_anchors)  # [B, A]
    anchor_tokens = jnp.take_along_axis(tokens, anchors, axis=1)
    hidden = draft_hidden(params, dcfg, embed, features, anchors, anchor_tokens)[:, :, 1:]  # [B, A, bs-1, D]
    label_pos = anchors[..., None] + 1 + jnp.arange(bs - 1)  # [B, A, bs-1]
    valid = label_pos < lengths[:, None, None]
    labels = jnp.take_along_axis(tokens, jnp.minimum(label_pos, tokens.shape[1] - 1).reshape(tokens.shape[0], -1),
                                 axis=1).reshape(label_pos.shape)
    logits = jnp.einsum("bakd,dv->bakv", hidden.astype(head.dtype), head, preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    ce = lse - picked
    w = jnp.asarray(depth_weights(bs, gamma))[None, None, :] * valid
    loss = jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1e-6)
    correct = (jnp.argmax(logits, axis=-1) == labels) & valid
    acc = jnp.sum(correct, axis=(0, 1)) / jnp.maximum(jnp.sum(valid, axis=(0, 1)), 1)
    return loss, (acc, jnp.sum(valid))


# ---------------------------------------------------------------------------------------------- export


def to_torch_layout(params) -> dict[str, np.ndarray]:
    """DraftParams -> {z-lab tensor name: array}, the inverse of weights.DRAFT_RULES (Linear: [in..., out...] ->
    [out, in])."""
    import jax

    from ddtree_jax.weights import DRAFT_RULES, Linear

    leaves = {".".join(k.name for k in p): np.asarray(x) for p, x in jax.tree.flatten_with_path(params)[0]}
    out = {}
    for name, field, transform in DRAFT_RULES:
        if field not in leaves:
            continue
        x = leaves[field]
        for i in range(x.shape[0]) if "{layer}" in name else [None]:
            y = x if i is None else x[i]
            if isinstance(transform, Linear):
                y = y.reshape(math.prod(y.shape[: transform.in_axes]), -1).T
            out[name.format(layer=i)] = np.ascontiguousarray(y)
    return out


def export(params, raw_config: dict[str, Any], path: str, dtype: str = "bfloat16", meta: dict | None = None) -> str:
    """Write ``path``/config.json + model.safetensors (z-lab drafter layout) atomically."""
    import ml_dtypes
    import safetensors.numpy

    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    tensors = {k: v.astype(np_dtype) for k, v in to_torch_layout(params).items()}
    tmp = f"{path.rstrip(os.sep)}.partial-{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    safetensors.numpy.save_file(tensors, os.path.join(tmp, "model.safetensors"),
                                metadata={"format": "pt", **{k: str(v) for k, v in (meta or {}).items()}})
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump({**raw_config, "torch_dtype": dtype}, f, indent=2)
    for name in ("model.safetensors", "config.json"):
        os.chmod(os.path.join(tmp, name), 0o644)
    if os.path.exists(path):
        import shutil

        shutil.rmtree(path)
    os.rename(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------- evaluate


def acceptance(target, draft, prompts: list[list[int]], *, budget: int, max_new_tokens: int,
               stop_ids: Sequence[int] = (), method: str = "ddtree") -> float:
    """Mean acceptance length (accepted nodes per round incl. the root) of greedy speculative decoding."""
    from ddtree_jax import decode

    opts = decode.GenerateOptions(method=method, tree_budget=budget, max_new_tokens=max_new_tokens,
                                  stop_token_ids=tuple(stop_ids))
    res = decode.generate(target, prompts, opts, draft=draft)
    acc = [a for seq in res.acceptance_lengths for a in seq]
    return float(np.mean(acc)) if acc else float("nan")


def benchmark(target, draft, prompts: list[list[int]], *, budgets: Sequence[int], max_new_tokens: int,
              stop_ids: Sequence[int] = (), attention: str = "auto", check: bool = False, log=print) -> dict[str, Any]:
    """Greedy ar / dflash / ddtree(budget) on the prompts as one batch (one compilation per method): mean
    acceptance length and decode tokens/s (generated tokens / the on-device decode loop's time: no prefill,
    no compilation, no streaming round trips), speedup over ar.

    check: also compare each method's tokens with ar's (``same_as_ar``: prompts whose outputs are equal;
    ``first_divergence``: the earliest generated position where one differs) and run it again traced, replaying
    every round's walk on the host from the traced tree and target choices (``walk_mismatches``: rounds whose
    accepted path differs from :func:`accept.walk_host`'s). Greedy speculative decoding in bf16 may part from
    ar where two logits nearly tie (the verify's matrix shapes differ from ar's); a walk mismatch is a fault."""
    from ddtree_jax import decode

    # laid out for the backend once here, for the rounds, not in each decode.generate call below (on GPU each ar call
    # turns the target output-major again)
    target, draft = ((cfg, decode.device_layout(p)) for cfg, p in (target, draft))
    runs = [("ar", 0), ("dflash", 0)] + [("ddtree", b) for b in budgets]
    out: dict[str, Any] = {}
    ar_ids = None
    for method, budget in runs:
        opts = decode.GenerateOptions(method=method, tree_budget=budget or 1, max_new_tokens=max_new_tokens,
                                      stop_token_ids=tuple(stop_ids), attention=attention)
        res = decode.generate(target, prompts, opts, draft=None if method == "ar" else draft)
        acc = [a for seq in res.acceptance_lengths for a in seq]
        tokens = sum(res.num_generated)
        name = method if method != "ddtree" else f"ddtree-{budget}"
        # every round accepts at least the root (decode.generate raises 'decode fault' otherwise: the H200 sweep
        # once reported means below 1, docs/DEFAULT_PAIR.md); the smallest round is kept in the record
        out[name] = {"mean_acceptance_length": float(np.mean(acc)) if acc else None,
                     "min_acceptance_length": int(min(acc)) if acc else None, "rounds": len(acc),
                     "tokens_per_s": tokens / res.decode_s if res.decode_s > 0 else None,
                     "attention": res.attention}  # the path that ran ("auto" resolved)
        if name != "ar" and out["ar"]["tokens_per_s"] and out[name]["tokens_per_s"]:
            out[name]["speedup"] = out[name]["tokens_per_s"] / out["ar"]["tokens_per_s"]
        if method == "ar":
            ar_ids = res.output_ids
        elif check:
            out[name].update(_check(res, ar_ids, prompts, target, draft, dataclasses.replace(opts, trace=True)))
        log(f"{name}: {json.dumps(out[name])}")
    return out


def _check(res, ar_ids, prompts, target, draft, traced_opts) -> dict[str, Any]:
    """``benchmark``'s check of one method: its outputs against ar's, and a traced run's walks replayed."""
    from ddtree_jax import accept, decode

    starts = [len(p) for p in prompts]
    firsts = [next((i - s for i, (x, y) in enumerate(zip(mine, theirs)) if i >= s and x != y),
                   None if len(mine) == len(theirs) else min(len(mine), len(theirs)) - s)
              for mine, theirs, s in zip(res.output_ids, ar_ids, starts)]
    traced = decode.generate(target, prompts, traced_opts, draft=draft)
    rounds = [r for seq in traced.rounds for r in seq]
    bad = sum(accept.walk_host(r["tree"]["node_token_ids"], r["tree"]["parents"], r["target_choices"])
              != r["accepted_indices"] for r in rounds)
    return {"same_as_ar": sum(f is None for f in firsts), "prompts": len(prompts),
            "first_divergence": min((f for f in firsts if f is not None), default=None),
            "walk_mismatches": bad, "traced_rounds": len(rounds),
            "traced_same_as_untraced": traced.output_ids == res.output_ids}


# ---------------------------------------------------------------------------------------------- train


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch: int = 4
    anchors: int = 32
    lr: float = 6e-4
    warmup: int = 20
    weight_decay: float = 0.01
    clip: float = 1.0
    gamma: float | None = None
    seed: int = 0


@functools.lru_cache(maxsize=8)
def make_optimizer(tc: TrainConfig):
    import optax

    sched = optax.warmup_cosine_decay_schedule(0.0, tc.lr, max(1, tc.warmup), max(tc.steps, tc.warmup + 1),
                                               end_value=tc.lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(tc.clip), optax.adamw(sched, weight_decay=tc.weight_decay))


@functools.lru_cache(maxsize=8)
def make_step(dcfg, tc: TrainConfig, optimizer, target_cfg=None):
    """The jitted training step (cached per configuration, so repeated runs in one process compile once).
    With ``target_cfg``, features are online: the batch's features are None and the step computes them with
    the target (its params passed as ``target_params``), outside the gradient."""
    import jax
    import optax

    gamma = tc.gamma or DEFAULT_GAMMA.get(dcfg.block_size, dcfg.block_size / 2.3)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, head, embed, batch, key, target_params=None):
        if target_cfg is not None:
            tokens = batch[0]
            feats = tap_features((target_cfg, target_params), dcfg.target_layer_ids, tokens)
            batch = (*batch[:3], jax.lax.stop_gradient(feats))
        (loss, (acc, n)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, dcfg, head, embed, batch, key, tc.anchors, gamma)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, acc

    return step


class Checkpoints:
    """Orbax checkpoints of the training state ({params, opt_state, step}) under ``dir``, the last two kept."""

    def __init__(self, path: str):
        import orbax.checkpoint as ocp

        self.ocp = ocp
        self.mgr = ocp.CheckpointManager(os.path.abspath(path), options=ocp.CheckpointManagerOptions(max_to_keep=2))

    def latest(self) -> int | None:
        return self.mgr.latest_step()

    def save(self, step: int, state) -> None:
        self.mgr.save(step, args=self.ocp.args.StandardSave(state))
        self.mgr.wait_until_finished()

    def restore(self, step: int, like):
        return self.mgr.restore(step, args=self.ocp.args.StandardRestore(like))


def batch_indices(n: int, batch: int, step: int, seed: int) -> np.ndarray:
    """The sequences of minibatch ``step``: a fresh shuffle every epoch, a pure function of (seed, step), so a
    resumed run sees exactly the batches an uninterrupted one would."""
    per_epoch = max(1, n // batch)
    order = np.random.default_rng([seed, step // per_epoch]).permutation(n)
    return np.sort(order[(step % per_epoch) * batch:(step % per_epoch + 1) * batch])


def train(target, data: Data, dcfg, raw_cfg, out: str, tc: TrainConfig, *, eval_prompts=(), eval_every: int = 0,
          eval_budget: int = 32, eval_tokens: int = 48, stop_ids=(), save_every: int = 100,
          time_limit: float | None = None, until: int | None = None, keep_best: bool = False,
          log=print) -> tuple[Any, list[dict]]:
    """Train (resuming from ``out``/ckpt), evaluate as it goes, export to ``out``/drafter. Returns (params, log).

    time_limit: seconds of training (this run) after which it checkpoints, exports and stops; until: stop after
    this step (both leave a checkpoint to resume from). keep_best: export the parameters of this run's best
    held-out evaluation (early stopping) instead of the last ones; checkpoints still hold the last."""
    import jax
    import jax.numpy as jnp
    import tqdm

    tcfg, tparams = target
    head = tparams.head()
    embed = tparams.embed
    optimizer = make_optimizer(tc)
    online = data.features is None
    step_fn = make_step(dcfg, tc, optimizer, tcfg if online else None)
    params = init_params(dcfg, jax.random.key(tc.seed))
    opt_state = optimizer.init(params)
    ckpts = Checkpoints(os.path.join(out, "ckpt"))
    start = 0
    history: list[dict] = []
    hist_file = os.path.join(out, "history.jsonl")
    if ckpts.latest() is not None:
        start = int(ckpts.latest())
        state = ckpts.restore(start, {"params": params, "opt_state": opt_state})
        params, opt_state = state["params"], state["opt_state"]
        log(f"resumed from step {start}")
        if os.path.exists(hist_file):
            with open(hist_file) as f:
                history = [json.loads(line) for line in f if json.loads(line)["step"] <= start]
    key = jax.random.key(tc.seed + 1)
    t_start = time.perf_counter()

    def evaluate(step):
        if not eval_prompts:
            return None
        draft = (dcfg, jax.tree.map(lambda x: x.astype(tparams.embed.dtype), params))
        return acceptance(target, draft, list(eval_prompts), budget=eval_budget, max_new_tokens=eval_tokens,
                          stop_ids=stop_ids)

    def record(entry):
        history.append(entry)
        with open(hist_file, "a") as f:
            f.write(json.dumps(entry) + "\n")

    step = start
    bar = tqdm.tqdm(total=tc.steps, initial=start, desc="train drafter", file=sys.stderr, dynamic_ncols=True)
    losses: list = []  # device scalars, read every 10 steps (no host sync per step)
    stopped_early = False
    last = tc.steps if until is None else min(until, tc.steps)
    # the whole data set on the device once ([N, T, taps*D] bf16: 6.7 GB for 2,800 sequences of 512 tokens at
    # SmolLM2's width); each step gathers its minibatch there instead of copying it from the host
    # (online features: only the tokens; the step runs the target over its minibatch)
    on_device = jax.device_put((data.tokens, data.lengths, data.starts, data.features))
    best: tuple[float, int, Any] | None = None  # (held-out acceptance, step, params copy) with keep_best
    while step < last:
        i = jnp.asarray(batch_indices(len(data.lengths), tc.batch, step, tc.seed))
        batch = tuple(None if x is None else x[i] for x in on_device)
        params, opt_state, loss, acc = step_fn(params, opt_state, head, embed, batch, jax.random.fold_in(key, step),
                                               tparams if online else None)
        step += 1
        losses.append(loss)
        bar.update(1)
        out_of_time = (time_limit is not None and time.perf_counter() - t_start > time_limit) or step == last
        if step % 10 == 0 or step == tc.steps or out_of_time:
            mean = float(np.mean(jax.device_get(losses[-10:])))
            losses = losses[-10:]
            bar.set_postfix(loss=f"{mean:.3f}", acc1=f"{float(acc[0]):.2f}")
            record({"step": step, "loss": mean, "acc": [round(float(a), 4) for a in acc],
                    "elapsed_s": round(time.perf_counter() - t_start, 1)})
        if (eval_every and step % eval_every == 0) or step == tc.steps or out_of_time:
            tau = evaluate(step)
            if tau is not None:
                record({"step": step, "eval_acceptance": tau, "budget": eval_budget})
                if keep_best and (best is None or tau > best[0]):  # params are donated to the next step: copy
                    best = (tau, step, jax.tree.map(jnp.copy, params))
                mean = float(np.mean(jax.device_get(losses[-10:])))
                bar.write(f"step {step}: loss {mean:.3f}, held-out acceptance length {tau:.2f} "
                          f"(ddtree, budget {eval_budget})")
        if step % save_every == 0 or step == tc.steps or out_of_time:
            ckpts.save(step, {"params": params, "opt_state": opt_state})
        if out_of_time:
            stopped_early = step < tc.steps
            break
    else:
        if start >= tc.steps:
            log(f"already trained: step {start} of {tc.steps}")
    bar.close()
    if stopped_early:
        log(f"stopped at step {step} of {tc.steps} (rerun the same command to resume)")
    if best is not None and best[1] != step:
        log(f"exporting step {best[1]}'s parameters: the best held-out acceptance length ({best[0]:.2f})")
        params, step = best[2], best[1]
    export(params, raw_cfg, os.path.join(out, "drafter"), meta={"step": step})
    return params, history


# ---------------------------------------------------------------------------------------------- CLI


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" where there is a default (not for required flags or None)."""

    def _get_help_string(self, action):
        if action.default is None or action.required:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(
        prog="python -m ddtree_jax.train_draft",
        description="Train a DFlash block-diffusion drafter for a target model on the target's own greedy "
                    "continuations of prompts from offline text shipped with CPython (--corpus). "
                    "Rerunning the same command resumes.",
        formatter_class=_DefaultsFormatter,
    )
    p.add_argument("--target", required=True, metavar="PATH",
                   help="target model directory (Hugging Face or converted), or 'default' for SmolLM2-135M-Instruct")
    p.add_argument("--out", required=True, metavar="DIR", help="work directory: data.npz, ckpt/, drafter/")
    p.add_argument("--dtype", choices=cli.DTYPES, default="bfloat16",
                   help="target dtype for data generation, features and evaluation")
    m = p.add_argument_group("drafter")
    m.add_argument("--layers", type=cli.positive_int, default=1, help="drafter layers (of the target's width)")
    m.add_argument("--block-size", type=cli.positive_int, default=16,
                   help="block: the anchor token + block-size - 1 predicted positions")
    m.add_argument("--intermediate-size", type=cli.positive_int, default=None,
                   help="MLP width (default: the target's)")
    m.add_argument("--target-layer-ids", type=cli.int_list, default=None,
                   help="tapped target layers (default: 4 spread over the target's depth)")
    m.add_argument("--mask-token-id", type=int, default=None,
                   help="default: the tokenizer's last control token, else the last vocabulary id")
    d = p.add_argument_group("data")
    d.add_argument("--num-prompts", type=cli.positive_int, default=512, help="training prompts used (at most)")
    d.add_argument("--corpus", type=_corpora, default="pydoc", metavar="NAME,...",
                   help="offline text the prompts come from: pydoc (the language reference topics shipped with "
                        "CPython), stdlib (functions, classes and docstrings of the installed standard library), "
                        "or both, comma-separated")
    d.add_argument("--prompts-per-passage", type=cli.positive_int, default=1,
                   help="requests drawn per passage (more, different prompts)")
    d.add_argument("--max-prompt-tokens", type=cli.positive_int, default=320, help="longer prompts are dropped")
    d.add_argument("--max-new-tokens", type=cli.positive_int, default=128,
                   help="length of the target's greedy continuation of each prompt")
    d.add_argument("--seq-len", type=cli.positive_int, default=448, help="training sequence length (cut there)")
    d.add_argument("--gen-batch", type=cli.positive_int, default=32,
                   help="sequences per batch when generating the data and its features")
    d.add_argument("--online-features", action="store_true",
                   help="compute the target's features inside each training step instead of storing them for "
                        "every sequence (data.npz then holds tokens only: for corpora whose features would not "
                        "fit in memory; costs one target forward per step)")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=cli.positive_int, default=1000, help="training steps (the schedule's length)")
    t.add_argument("--batch", type=cli.positive_int, default=4, help="sequences per step")
    t.add_argument("--anchors", type=cli.positive_int, default=32, help="anchor blocks per sequence per step")
    t.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate (warmup 20, cosine to lr/10)")
    t.add_argument("--gamma", type=float, default=None, help="loss decay: weight of depth k = exp(-(k-1)/gamma) "
                                                             "(default: 7 for block 16, as DFlash)")
    t.add_argument("--seed", type=int, default=0, help="prompts, initialisation, batches and anchors")
    t.add_argument("--save-every", type=cli.positive_int, default=100, help="checkpoint every N steps")
    t.add_argument("--time-limit", type=float, default=None, metavar="MINUTES",
                   help="stop training (checkpoint and export) after this many minutes")
    e = p.add_argument_group("evaluation")
    e.add_argument("--eval-every", type=cli.nonneg_int, default=200, help="0 = only at the end")
    e.add_argument("--eval-prompts", type=cli.nonneg_int, default=4, help="0 = no evaluation while training")
    e.add_argument("--eval-budget", type=cli.positive_int, default=32, help="ddtree budget of the evaluation")
    e.add_argument("--eval-tokens", type=cli.positive_int, default=48, help="tokens per held-out prompt")
    e.add_argument("--keep-best", action="store_true",
                   help="export the parameters of the best held-out evaluation of this run (early stopping), "
                        "not the last; needs --eval-prompts > 0 and --eval-every")
    e.add_argument("--bench-budgets", type=cli.int_list, default=None, metavar="B1,B2,...",
                   help="after training, time ar / dflash / ddtree at these budgets on the held-out prompts "
                        "(--bench-prompts of them as one batch, greedy) and write bench.json")
    e.add_argument("--bench-prompts", type=cli.positive_int, default=4, help="held-out prompts of the benchmark")
    e.add_argument("--bench-tokens", type=cli.positive_int, default=64, help="tokens per benchmark prompt")
    return p


def _corpora(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    bad = [n for n in names if n not in CORPORA]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"unknown corpus {', '.join(bad) or repr(text)} "
                                         f"(choose from {', '.join(CORPORA)})")
    return names


def default_layer_ids(num_layers: int, n: int = 4) -> tuple[int, ...]:
    """n layers spread from 1 to num_layers - 3 (z-lab's range)."""
    hi = max(1, num_layers - 3)
    return tuple(sorted({int(round(1 + i * (hi - 1) / max(1, n - 1))) for i in range(n)}))


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    import jax.numpy as jnp

    from ddtree_jax import config, weights
    from ddtree_jax.tokenizer import load_tokenizer

    if args.target == "default":
        from ddtree_jax import defaults

        target_path = defaults.target_path()
    else:
        target_path = cli.existing_dir("--target", args.target)
    if args.block_size < 2:
        raise cli.UsageError("--block-size must be at least 2")
    tcfg = config.model_config(target_path)
    tok = load_tokenizer(target_path)
    ids = tuple(args.target_layer_ids or default_layer_ids(tcfg.num_layers))
    if args.mask_token_id is not None:
        mask = args.mask_token_id
    else:
        mask = tcfg.vocab_size - 1
        if tok is not None:
            specials = [i for i, t in tok._tok.get_added_tokens_decoder().items() if t.special and i < tcfg.vocab_size]
            mask = max(specials) if specials else mask
    raw = draft_raw_config(tcfg, num_layers=args.layers, block_size=args.block_size, mask_token_id=mask,
                           target_layer_ids=ids, intermediate_size=args.intermediate_size)
    dcfg = config.draft_config(raw)
    config.check_pair(tcfg, dcfg)
    os.makedirs(args.out, exist_ok=True)
    run_file = os.path.join(args.out, "run.json")
    with open(run_file, "w") as f:
        json.dump({"argv": list(argv) if argv is not None else sys.argv[1:], "target": target_path,
                   "drafter_config": raw}, f, indent=2)

    stop = tuple(dict.fromkeys((tok.eos_token_ids if tok else ()) + tcfg.eos_token_ids))
    if tok is not None:
        train_prompts, test_prompts = make_prompts(tok, args.max_prompt_tokens, args.seed, args.prompts_per_passage,
                                                   args.corpus)
    else:
        train_prompts, test_prompts = make_prompts_without_tokenizer(tcfg.vocab_size, args.num_prompts + 8, 24,
                                                                     args.seed)
    train_prompts = train_prompts[: args.num_prompts]
    all_test_prompts, test_prompts = test_prompts, test_prompts[: args.eval_prompts]
    cli.info(f"{len(train_prompts)} training prompts, {len(test_prompts)} held-out prompts")

    target = weights.load_target(target_path, jnp.dtype(args.dtype))
    data_file = os.path.join(args.out, "data.npz")
    if os.path.exists(data_file):
        data = Data.load(data_file)
        cli.info(f"reusing {data_file}: {len(data.lengths)} sequences")
        if args.online_features:
            data = dataclasses.replace(data, features=None)
        elif data.features is None:
            data = dataclasses.replace(data, features=target_features(target, ids, data.tokens, args.gen_batch,
                                                                      lengths=data.lengths))
    else:
        t0 = time.perf_counter()
        data = build_data(target, train_prompts, taps=ids, max_new_tokens=args.max_new_tokens, seq_len=args.seq_len,
                          stop_ids=stop, batch=args.gen_batch, features=not args.online_features)
        data.save(data_file)
        gen = int(np.sum(data.lengths - data.starts))
        cli.info(f"data: {len(data.lengths)} sequences, {gen} generated tokens, {int(np.sum(data.lengths))} tokens "
                 f"in all, in {time.perf_counter() - t0:.0f}s")
    if args.keep_best and not (args.eval_prompts and args.eval_every):
        raise cli.UsageError("--keep-best needs held-out evaluations: --eval-prompts and --eval-every above 0")
    if len(data.lengths) < args.batch:
        raise cli.UsageError(f"only {len(data.lengths)} training sequences for --batch {args.batch}")
    tc = TrainConfig(steps=args.steps, batch=args.batch, anchors=args.anchors, lr=args.lr, gamma=args.gamma,
                     seed=args.seed)
    _, history = train(target, data, dcfg, raw, args.out, tc, eval_prompts=test_prompts, eval_every=args.eval_every,
                       eval_budget=args.eval_budget, eval_tokens=args.eval_tokens, stop_ids=stop,
                       save_every=args.save_every, time_limit=None if args.time_limit is None
                       else args.time_limit * 60, keep_best=args.keep_best, log=cli.info)
    if args.bench_budgets:
        draft = weights.load_draft(os.path.join(args.out, "drafter"), jnp.dtype(args.dtype))
        result = benchmark(target, draft, all_test_prompts[: args.bench_prompts], budgets=args.bench_budgets, max_new_tokens=args.bench_tokens,
                           stop_ids=stop, log=cli.info)
        import jax

        result["setup"] = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
                           "dtype": args.dtype, "prompts": args.bench_prompts, "max_new_tokens": args.bench_tokens,
                           "cpus": os.cpu_count()}
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(result, f, indent=2)
    evals = [h for h in history if "eval_acceptance" in h]
    msg = f"wrote {os.path.join(args.out, 'drafter')}"
    if evals:
        msg += (f" (held-out acceptance length {evals[-1]['eval_acceptance']:.2f} at step {evals[-1]['step']}, "
                f"budget {evals[-1]['budget']})")
    cli.info(msg)
    return cli.EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
