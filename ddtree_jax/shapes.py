"""Named model shapes of real models (Qwen3-8B, Qwen3-4B, Qwen3-Coder-30B-A3B, ...) with their DFlash drafter shapes,
and random weights of those shapes made directly on the device: what the benchmarks and the server's ``random:SHAPE``
targets run, with nothing to download."""

from __future__ import annotations

import dataclasses

from ddtree_jax import cli

RANDOM_PREFIX = "random:"  # --target random:SHAPE (serve, generate)


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    layers: int = 36
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 151936
    draft_layers: int = 5
    block: int = 16
    taps: tuple[int, ...] = (1, 9, 17, 25, 33)
    # Mixture of experts (every layer sparse; 0 experts: dense). The drafter stays dense, of ``intermediate``.
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    # The target's family: "llama" has no q/k norms; ``tied``: its output layer is the embedding's transpose
    arch: str = "qwen3"
    tied: bool = False
    rope_theta: float = 1e6


SHAPES = {
    "qwen3-8b": Shape("qwen3-8b", 4096, 12288),
    "qwen3-4b": Shape("qwen3-4b", 2560, 9728),  # untied here (the real 4B ties lm_head)
    # Qwen3-8B's layer shape at 8 layers: per-layer behaviour of the unrolled layout at a fraction of its compile time
    "qwen3-8b-l8": Shape("qwen3-8b-l8", 4096, 12288, layers=8, taps=(1, 2, 4, 5, 6)),
    "tiny": Shape("tiny", 128, 256, layers=4, heads=4, kv_heads=2, head_dim=64, vocab=2048, draft_layers=2,
                  block=8, taps=(0, 2)),
    # Qwen3-Coder-30B-A3B-Instruct (61 GB in bf16) with z-lab/Qwen3-Coder-30B-A3B-DFlash's shape as reported (8 dense
    # layers of width 6144, block 16, these taps), its attention assumed to be the target's (32 / 4 heads of 128):
    # read the drafter checkpoint's config.json before relying on the drafter's share of a round
    "qwen3-coder-30b-a3b": Shape("qwen3-coder-30b-a3b", 2048, 6144, layers=48, kv_heads=4, draft_layers=8,
                                 taps=(1, 12, 23, 34, 45), experts=128, experts_per_token=8, expert_intermediate=768),
    "tiny-moe": Shape("tiny-moe", 128, 256, layers=4, heads=4, kv_heads=2, head_dim=64, vocab=2048, draft_layers=2,
                      block=8, taps=(0, 2), experts=16, experts_per_token=4, expert_intermediate=64),
    # SmolLM2-135M-Instruct, the default pair's target, with the drafter train_draft makes for it by default
    "smollm2-135m": Shape("smollm2-135m", 576, 1536, layers=30, heads=9, kv_heads=3, head_dim=64, vocab=49152,
                          draft_layers=2, taps=(1, 10, 18, 27), arch="llama", tied=True, rope_theta=1e5),
}


def model_configs(shape: Shape):
    from ddtree_jax.config import DraftConfig, ModelConfig, RopeConfig

    def mc(layers: int, arch: str = "qwen3", tied: bool = False, **moe) -> ModelConfig:
        return ModelConfig(
            arch="qwen3_moe" if moe else arch, vocab_size=shape.vocab, hidden_size=shape.hidden,
            intermediate_size=shape.intermediate, num_layers=layers, num_heads=shape.heads,
            num_kv_heads=shape.kv_heads, head_dim=shape.head_dim, rms_norm_eps=1e-6,
            rope=RopeConfig(theta=shape.rope_theta), tie_word_embeddings=tied, qk_norm=arch != "llama",
            max_position_embeddings=40960, **moe,
        )

    dcfg = DraftConfig(layers=mc(shape.draft_layers), block_size=shape.block, mask_token_id=shape.vocab - 1,
                       target_layer_ids=shape.taps, num_target_layers=shape.layers,
                       layer_types=("full_attention",) * shape.draft_layers)
    moe = dict(num_experts=shape.experts, experts_per_token=shape.experts_per_token,
               moe_intermediate_size=shape.expert_intermediate, norm_topk_prob=True) if shape.experts else {}
    return mc(shape.layers, shape.arch, shape.tied, **moe), dcfg


LEAF_BYTES = 1 << 30  # a layer stack whose f32 draw is larger is drawn one layer at a time


def build_params(tcfg, dcfg, dtype, seed: int = 0):
    """Random parameters (``params.init_random``'s) made on the device, nothing crossing the host: one jitted function
    for each model, but a layer stack whose f32 draw exceeds ``LEAF_BYTES`` (Qwen3-Coder-30B-A3B's experts: 39 GB of
    bf16 gate|up) is drawn one layer at a time into its buffer, updated in place, so that the device never holds the
    f32 draw of a whole stack."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax import params

    def build(shapes, key):
        leaves, treedef = jax.tree.flatten_with_path(shapes)
        keys = jax.random.split(key, len(leaves))
        big = {i for i, (path, s) in enumerate(leaves)
               if s.size * 4 > LEAF_BYTES and getattr(path[0], "name", "") == "layers"}
        out = jax.jit(lambda keys: [None if i in big else params.random_leaf(p, s, k)
                                    for i, ((p, s), k) in enumerate(zip(leaves, keys))])(keys)
        for i in sorted(big):  # one layer at a time
            path, s = leaves[i]
            row = jax.ShapeDtypeStruct(s.shape[1:], s.dtype)
            draw = jax.jit(lambda k, j, path=path, row=row: params.random_leaf(path, row, jax.random.fold_in(k, j)))
            out[i] = jax.jit(lambda s=s: jnp.zeros(s.shape, s.dtype))()
            for j in range(s.shape[0]):
                out[i] = params.write_layer(out[i], draw(keys[i], j), j)
        return jax.tree.unflatten(treedef, out)

    kt, kd = jax.random.split(jax.random.key(seed))
    return jax.block_until_ready((build(params.target_shapes(tcfg, dtype), kt),
                                  build(params.draft_shapes(dcfg, dtype), kd)))


def random_shape(target: str | None) -> str | None:
    """--target 'random:SHAPE' -> SHAPE (checked against the known shapes; a one-line error otherwise); None for a
    path."""
    if target is None or not target.startswith(RANDOM_PREFIX):
        return None
    name = target[len(RANDOM_PREFIX):]
    if name not in SHAPES:
        raise cli.UsageError(f"--target {target}: unknown random shape {name!r} (choose from "
                             f"{', '.join(RANDOM_PREFIX + k for k in SHAPES)})")
    return name


def random_models(name: str, dtype, draft: bool = True):
    """(target, draft) of random weights of shape ``name`` (build_params), each a (config, params) pair on the
    device, the draft None unless ``draft``; one line on stderr says what was built."""
    import time

    import jax
    import jax.numpy as jnp

    tcfg, dcfg = model_configs(SHAPES[name])
    t0 = time.perf_counter()
    tparams, dparams = build_params(tcfg, dcfg, dtype)
    n = [sum(x.size for x in jax.tree.leaves(t)) for t in (tparams, dparams)]
    count = [f"{x / 1e9:.2f}B" if x >= 1e9 else f"{x / 1e6:.1f}M" for x in n]
    cli.info(f"built random {name} weights ({jnp.dtype(dtype).name}; target {count[0]}, drafter {count[1]} "
             f"parameters) on {jax.devices()[0].device_kind} in {time.perf_counter() - t0:.1f}s")
    return (tcfg, tparams), ((dcfg, dparams) if draft else None)
