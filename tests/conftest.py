"""Shared fixtures: the tiny reference pair (Qwen3 target + DFlash drafter) and the Llama target, in f32."""

from __future__ import annotations

import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "ddtree_reference")


def fixture_path(*parts: str) -> str:
    return os.path.join(FIXTURES, *parts)


@pytest.fixture(scope="session")
def target():
    from ddtree_jax import weights

    return weights.load_target(fixture_path("target"))


@pytest.fixture(scope="session")
def drafter():
    from ddtree_jax import weights

    return weights.load_draft(fixture_path("draft"))


@pytest.fixture(scope="session")
def llama():
    from ddtree_jax import weights

    return weights.load_target(fixture_path("llama_target"))


@pytest.fixture(scope="session")
def reference_runs():
    with open(fixture_path("generate.json")) as f:
        return json.load(f)["runs"]


@pytest.fixture(scope="session")
def logits_npz():
    return dict(np.load(fixture_path("logits.npz")))


@pytest.fixture
def faulty_walk(monkeypatch):
    """A simulated decode fault: ``accept.walk`` (run as the XLA walk, whatever the attention) reports no accepted
    node (a round that commits nothing) whenever the target's choice at the root is a multiple of 3. jax's and
    decode's compile caches are emptied on the way in and out, so that programs traced with the fault never serve
    another test."""
    import jax
    import jax.numpy as jnp

    from ddtree_jax import accept, decode

    real = accept.walk

    def faulty(tree, choice, max_depth, impl="xla"):
        path, length, bonus = real(tree, choice, max_depth)
        return path, jnp.where(choice[:, 0] % 3 == 0, 0, length), bonus

    monkeypatch.setattr(accept, "walk", faulty)
    monkeypatch.setattr(decode, "_COMPILED", type(decode._COMPILED)())
    jax.clear_caches()
    yield
    monkeypatch.undo()
    jax.clear_caches()
