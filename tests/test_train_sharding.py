"""Data-parallel training on 8 fake CPU devices against one device: the same losses and parameters after three steps.

The device count of a process is fixed when jax starts, so the 8-device run is a subprocess (this file executed as a
script with XLA_FLAGS=--xla_force_host_platform_device_count=8, as tests/test_sharding.py does), which trains the
tiny fixture drafter three steps on a mesh of 8x1 and on one device (f32, the same rows, anchors and schedule) and
reports JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures", "ddtree_reference")


def _script(out_path: str) -> None:
    import tempfile

    import jax
    import numpy as np

    from ddtree_jax import sharding, weights
    from ddtree_jax.training import dataset, objective, trainer

    assert jax.device_count() == 8, jax.devices()
    target = weights.load_target(os.path.join(FIXTURES, "target"))
    dcfg, _ = weights.load_draft(os.path.join(FIXTURES, "draft"))
    raw = weights.read_config(os.path.join(FIXTURES, "draft"))
    rng = np.random.default_rng(0)  # random "responses": the comparison needs rows, not the target's text
    seqs = [rng.integers(0, 255, 32).tolist() for _ in range(16)]
    rows = dataset.pack(dataset.Sequences.build([(s, 10, dataset.TRAIN, 0.0, "random") for s in seqs]), 32)
    tc = trainer.TrainConfig(steps=3, batch=8, lr=3e-3, warmup=1, compute_dtype="float32",
                             objective=objective.Objective(anchors=12, group=4))
    report = {}
    for name, mesh in (("one", None), ("8x1", sharding.make_mesh((8, 1)))):
        with tempfile.TemporaryDirectory() as d:
            tr = trainer.Trainer(target, dcfg, raw, tc, d, mesh)
            tr.start(log=lambda *_: None)
            tr.fit(rows, evals=0, log_every=1, log=lambda *_: None)
            report[name] = {"losses": [h["loss"] for h in tr.history if "loss" in h],
                            "params": [np.asarray(x).tolist() for x in jax.tree.leaves(tr.params)],
                            "spec": str(jax.tree.leaves(tr.params)[0].sharding)}
    with open(out_path, "w") as f:
        json.dump(report, f)


def test_data_parallel_training_matches_one_device(tmp_path):
    import numpy as np

    from tests.conftest import FAST_COMPILE

    out = str(tmp_path / "report.json")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}"
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), out], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out) as f:
        rep = json.load(f)
    one, many = rep["one"], rep["8x1"]
    assert len(one["losses"]) == 3 and one["losses"][-1] < one["losses"][0]
    np.testing.assert_allclose(many["losses"], one["losses"], rtol=1e-5)
    # Adam divides by the gradients' root mean square, so an entry whose gradient is ~0 moves by up to lr (3e-3) a
    # step on the sign of rounding noise: nearly every entry agrees to 1e-5, and none differs by a third of a step
    diff = np.concatenate([np.abs(np.asarray(b) - np.asarray(a)).ravel()
                           for a, b in zip(one["params"], many["params"])])
    assert np.mean(diff < 1e-5) > 0.97 and diff.max() < 1e-3, (np.mean(diff < 1e-5), diff.max())
    assert "NamedSharding" in many["spec"]


if __name__ == "__main__":  # the 8-device subprocess
    _script(sys.argv[1])
