"""Checkpoint conversion command lines (thin wrappers over ddtree_jax.weights and ddtree_jax.checkpoint)."""
