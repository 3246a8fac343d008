"""The layer-by-layer comparison tool and the command-line tools."""

from __future__ import annotations

import numpy as np
import pytest

from dayzero.model import load_checkpoint
from dayzero.model.cli import forward_main, presets_main
from dayzero.model.compare import compare_checkpoint, compare_hidden_states, entry_names, main, reference_outputs


def test_compare_checkpoint_agrees(checkpoints, token_ids):
    ids, seed = token_ids
    report = compare_checkpoint(checkpoints["kimi_linear"], ids[:1])
    assert report.ok, f"token seed {seed}\n{report.format()}"
    assert len(report.rows) == 5 and report.rows[-1].name.endswith("final norm")


@pytest.mark.usefixtures("in_out_layout")
def test_compare_finds_the_layer_that_parts(checkpoints, token_ids):
    ids, _ = token_ids
    path = checkpoints["kimi_linear"]
    model = load_checkpoint(path, dtype="float32", progress=False)
    # Break layer 2's KDA output projection: layers 0-1 still agree, layer 2 is where they part.
    broken = dict(model.params)
    layer = dict(broken["layers_2"])
    attn = dict(layer["self_attn"])
    attn["o_proj"] = {"kernel": attn["o_proj"]["kernel"] * 1.5}
    layer["self_attn"], broken["layers_2"] = attn, layer
    bad = model.__class__(model.config, broken, model.dtype)
    theirs, _ = reference_outputs(path, ids)
    report = compare_hidden_states([np.asarray(h) for h in bad.hidden_states(ids)], theirs,
                                   names=entry_names(model.config))
    assert not report.ok
    assert report.first_divergence.name.startswith("layer 2"), report.format()
    assert all(r.ok for r in report.rows[:3])
    assert "<-- parts here" in report.format()


def test_compare_cli(checkpoints, capsys):
    assert main(["--model", checkpoints["deepseek_v32"], "--length", "40"]) == 0
    out = capsys.readouterr().out
    assert "all entries agree" in out and "layer 2 (mla, moe) + final norm" in out


def test_forward_cli_runs_embedded_preset(capsys):
    assert forward_main(["--new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "RANDOM weights" in out and "greedy continuation (3 tokens" in out


def test_forward_cli_on_checkpoint_and_bad_path(checkpoints, capsys, tmp_path):
    assert forward_main(["--model", checkpoints["kimi_linear"], "--new-tokens", "2", "--dtype", "float32",
                         "--prompt-ids", "1,5,9"]) == 0
    assert "checkpoint" in capsys.readouterr().out
    assert forward_main(["--model", str(tmp_path)]) == 2
    assert "config.json" in capsys.readouterr().err


def test_presets_cli(capsys):
    assert presets_main(["k3_3t"]) == 0
    out = capsys.readouterr().out
    assert "routed experts" in out and "MXFP4" in out and "total" in out
