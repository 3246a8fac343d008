"""benchmarks/engine_host.py on the CPU: the engine's host work per decode dispatch with the device replaced by a
stand-in that returns tokens at once."""

from __future__ import annotations

import json
import math

import pytest

import engine_host

from dayzero.model import Model
from dayzero.model.presets import tiny
from dayzero.serving import EngineConfig


@pytest.mark.parametrize("batch, new_tokens", [(1, 9), (3, 6)])
def test_dispatches_counted_and_host_time_per_dispatch(batch, new_tokens):
    """Every token after the prefill's comes from a decode dispatch of `decode_steps` steps, so a request of
    `new_tokens` takes ceil((new_tokens - 1) / decode_steps) of them; the times are per dispatch and per step."""
    model = Model.random(tiny(), dtype="float32", seed=0)
    result = engine_host.host_ms_per_dispatch(model, batch, new_tokens)
    assert result["dispatches"] == math.ceil((new_tokens - 1) / EngineConfig().decode_steps)
    assert result["ms_per_dispatch"] > 0 and result["ms_per_token_step"] > 0
    total_ms = result["ms_per_token_step"] * new_tokens
    assert total_ms == pytest.approx(result["ms_per_dispatch"] * result["dispatches"], rel=0.05, abs=2e-3)


def test_main_appends_one_line_of_medians(tmp_path):
    results = tmp_path / "RESULTS.md"
    assert engine_host.main(["--batches", "2", "--tokens", "5", "--repeats", "1", "--results", str(results)]) == 0
    (line,) = results.read_text().splitlines()
    assert "engine_host.py" in line and "5 new tokens" in line
    figures = json.loads(line[line.index("runs: ") + len("runs: "):])
    assert set(figures) == {"B2"} and figures["B2"]["dispatches"] == 1.0
