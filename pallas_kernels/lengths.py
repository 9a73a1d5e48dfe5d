"""The integer operand the layer kernels share: [prefix lengths (B), layer index] int32.

``tree_attention``, ``qkv_write`` and ``decode_attention`` read the stacked caches, and ``add_norm`` and ``qkv_write``
every layer's norm weights, in place at a layer index that must reach them inside an operand. As an operand of its
own, an int32 [1] that XLA sliced asynchronously out of the layer loop's indices (dynamic-slice fusion on), it was
miscompiled on an H200 (jaxlib 0.11.2: the compiled prefill returned a wrong round counter at batch 1). The kernels
take this one array, the sequences' prefix lengths (cache slots before the new rows) with the layer appended, built
by the same concatenation, which XLA makes once per layer for all.
"""

from __future__ import annotations

import jax.numpy as jnp


def lengths(prefix_len, layer):
    """prefix_len [B], layer (an integer scalar) -> [B + 1] int32."""
    return jnp.concatenate([prefix_len.astype(jnp.int32), jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))])
