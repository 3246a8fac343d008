"""`model.linear.WEIGHT_ROWS`: the attention projections stored [out, in] (`RowDense`), loaded from hub checkpoints
without the transpose, split by the sharding rules, recorded by converted checkpoints, and read by the decode
projection kernel as whole rows (`project(weight_rows=True)`): the same logits as the [in, out] layout."""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax.errors import ScopeParamNotFoundError

from dayzero.kernels import moe_front, projection
from dayzero.model import Model, linear, load_checkpoint
from dayzero.model.errors import CheckpointError
from dayzero.model.presets import tiny
from tiny_checkpoints import relative_error
from tiny_decode_cases import as_kernels, prefilled_decode

ROW_PATHS = {"kimi_linear": ("layers_0", "self_attn", "q_proj"), "deepseek_v32": ("layers_0", "self_attn", "q_a_proj")}


def _at(params, path):
    for name in path:
        params = params[name]
    return params


@pytest.mark.usefixtures("in_out_layout")
@pytest.mark.parametrize("kind", ["kimi_linear", "deepseek_v32"])
def test_hub_checkpoint_loads_as_weight_rows(checkpoints, token_ids, monkeypatch, kind):
    """With the switch on, a published checkpoint's attention projections load as "weight" [out, in] (the others
    stay "kernel" [in, out]) and the model's logits equal those of the [in, out] layout's load."""
    ids, _ = token_ids
    plain = load_checkpoint(checkpoints[kind], dtype="float32", progress=False)
    plain_logits = plain(ids)  # (applied under the layout it was loaded with)
    monkeypatch.setattr(linear, "WEIGHT_ROWS", True)
    rows = load_checkpoint(checkpoints[kind], dtype="float32", progress=False)
    got, want = _at(rows.params, ROW_PATHS[kind]), _at(plain.params, ROW_PATHS[kind])
    assert set(got) == {"weight"} | ({"bias"} if "bias" in want else set()) and "kernel" in want
    assert np.array_equal(np.asarray(got["weight"]), np.asarray(want["kernel"]).T)
    assert "kernel" in rows.params["layers_0"]["mlp"]["gate_proj"]
    assert relative_error(rows(ids), plain_logits) <= 1e-5


def test_sharding_rules_split_weight_rows_on_their_heads():
    """The [out, in] projections split on their heads' dim: q/k/v and b over their rows, o_proj over its columns."""
    from dayzero.model import sharding

    layout = lambda key: next(spec for pattern, spec in sharding.PARAM_RULES if re.fullmatch(pattern, key))
    assert layout("kda/q_proj/weight") == (("tensor", "kda_heads"),)
    assert layout("kda/b_proj/weight") == (("tensor", "kda_heads"),)
    assert layout("kda/o_proj/weight") == (None, ("tensor", "kda_heads"))
    assert layout("mla/q_proj/weight") == (("tensor", "mla_heads"),)
    assert layout("mla/o_proj/weight") == (None, ("tensor", "mla_heads"))
    assert layout("kda/q_conv1d/weight") == (("tensor", "kda_heads"),)
    assert layout("kda/f_a_proj/weight") == ()


@pytest.mark.usefixtures("in_out_layout")
def test_converted_checkpoint_names_its_layout(checkpoints, tmp_path, monkeypatch):
    """A converted checkpoint records the layout it was made with; loading it under the other names the switch."""
    from dayzero.model.convert import convert_checkpoint

    out = tmp_path / "converted"
    convert_checkpoint(checkpoints["kimi_linear"], out, dtype="float32", progress=False)
    monkeypatch.setattr(linear, "WEIGHT_ROWS", True)
    with pytest.raises(CheckpointError, match=r"stored \[in, out\]; this process builds them \[out, in\]"):
        load_checkpoint(out, dtype="float32", progress=False)


def _decode_config():
    """A tiny hybrid whose KDA layers take the one-kernel decode step and the projection kernel (b_proj 16 heads
    wide) and whose MoE layers take the front kernel."""
    return tiny().replace(hidden_size=64, kda_num_heads=16, kda_head_dim=16, index_topk=0, q_lora_rank=None,
                          kv_lora_rank=28, num_heads=4, v_head_dim=16, num_experts=8)


def _decode(model, batch, seed):
    """Five-token prompts prefilled, then one decode step of every kernel in interpret mode -> (logits, cache)."""
    step, args = prefilled_decode(model.config, seed, batch, model=model)
    return step(*args, decode=True)


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_step_from_weight_rows(seed, monkeypatch, batch):
    """The cached decode step (interpret mode) of a model with its attention projections stored [out, in] runs
    every projection kernel call with `weight_rows` (one row: whole rows on the CUDA cores; two: the MMA path),
    hands the MoE front kernel o_proj's output with the residual added where K is not split (one row: no update to
    finish) and its partial sums where it is (two rows, the KDA layers' o_proj), and gives the logits and caches of
    the same weights in the [in, out] layout, to bf16 rounding."""
    cfg = _decode_config()
    monkeypatch.setenv("DAYZERO_KERNELS", "interpret")
    monkeypatch.setattr(linear, "WEIGHT_ROWS", True)
    rows_model = Model.random(cfg, dtype="bfloat16", seed=seed % 1000)
    calls, updates = [], []
    project, front = projection.project, moe_front.front
    monkeypatch.setattr(projection, "project", lambda *a, **k: calls.append(k.get("weight_rows")) or project(*a, **k))
    monkeypatch.setattr(moe_front, "front", lambda update, *a, **k: updates.append(update) or front(update, *a, **k))
    rows_logits, rows_cache = _decode(rows_model, batch, seed)
    assert len(calls) == 2 * cfg.num_layers and all(calls), calls  # each layer's input projections and o_proj
    # one row: o_proj adds the residual itself, the MoE front kernel gets no partial sums to finish; two (the MMA
    # path, K split): the partial sums go to the front as in the [in, out] layout, no XLA kernel adding them up
    assert len(updates) == cfg.mlp_types.count("moe")
    assert all(u is None or isinstance(u, projection.Partials) for u in updates), updates
    assert not any(updates) if batch == 1 else any(isinstance(u, projection.Partials) for u in updates)
    monkeypatch.setattr(linear, "WEIGHT_ROWS", False)
    calls.clear()
    plain_logits, plain_cache = _decode(Model(cfg, as_kernels(rows_model.params), rows_model.dtype), batch, seed)
    assert calls and not any(calls)
    a, b = np.asarray(rows_logits, np.float64), np.asarray(plain_logits, np.float64)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2
    for name in plain_cache:
        c, d = np.asarray(rows_cache[name], np.float32), np.asarray(plain_cache[name], np.float32)
        assert np.abs(c - d).max() <= 3e-2 * max(np.abs(d).max(), 1e-6), name


@pytest.mark.usefixtures("in_out_layout")
def test_params_of_the_other_layout_fail_by_name(monkeypatch):
    """Params made under one layout, applied under the other: Flax names the missing param."""
    cfg = tiny()
    model = Model.random(cfg, dtype="float32", seed=0)
    monkeypatch.setattr(linear, "WEIGHT_ROWS", True)
    with pytest.raises(ScopeParamNotFoundError, match='parameter named "weight" in scope "/layers_0/self_attn/q_proj"'):
        model(jnp.ones((1, 3), jnp.int32))
