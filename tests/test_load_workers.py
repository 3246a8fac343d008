"""`load_params` placing params in worker threads while the next are read (`model.checkpoint.LOAD_WORKERS`): the
same params as placing them in the reading thread, and a placement that fails fails the load with its own error."""

from __future__ import annotations

import numpy as np
import pytest

from dayzero.model import ModelConfig, checkpoint
from dayzero.model.model import expected_params, resolve_dtype


def _load(path, workers, dtype=None):
    config = ModelConfig.from_pretrained(path)
    expected = expected_params(config, resolve_dtype(dtype, config))
    return expected, checkpoint.load_params(path, config, expected, progress=False, workers=workers)


@pytest.mark.parametrize("kind", ["deepseek_v32", "kimi_linear"])
def test_workers_place_the_same_params(checkpoints, kind):
    expected, alone = _load(str(checkpoints[kind]), workers=0)
    _, threaded = _load(str(checkpoints[kind]), workers=3)
    assert list(threaded) == list(expected)  # every param, in the model's order
    projections = 0
    for path, want in expected.items():
        got = threaded[path]
        assert got.shape == want.shape and got.dtype == want.dtype, path
        np.testing.assert_array_equal(np.asarray(got), np.asarray(alone[path]), err_msg=str(path))
        projections += path[-1] == "kernel" or path[-1] in checkpoint.EXPERT_PARAMS
    assert projections > 10  # the device-transposed kind is among them


def test_a_failed_placement_fails_the_load(checkpoints, monkeypatch):
    place = checkpoint._place_param
    calls = []

    def failing(host, as_published, sharding, dtype):
        calls.append(as_published)
        if len(calls) == 5:
            raise RuntimeError("placement 5 failed")
        return place(host, as_published, sharding, dtype)

    monkeypatch.setattr(checkpoint, "_place_param", failing)
    with pytest.raises(RuntimeError, match="placement 5 failed"):
        _load(str(checkpoints["deepseek_v32"]), workers=3)
    # the load stopped within its window: placement 5 is awaited once placements 6 and 7 are queued, later ones never
    assert 5 <= len(calls) <= 7
    config = ModelConfig.from_pretrained(str(checkpoints["deepseek_v32"]))
    assert len(expected_params(config, resolve_dtype(None, config))) > 20
