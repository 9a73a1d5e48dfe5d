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
