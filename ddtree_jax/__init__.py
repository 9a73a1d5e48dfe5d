"""ddtree_jax: DDTree speculative decoding in JAX, the whole round on device under one jit."""

__version__ = "0.1.0"
