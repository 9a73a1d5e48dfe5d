"""Pallas GPU kernels (Mosaic GPU backend), each beside a pure-jnp reference of identical semantics."""
