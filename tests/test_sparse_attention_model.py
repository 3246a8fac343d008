"""DSA end to end: cached decoding through the paged cache reproduces the full-sequence forward.

transformers' own cached generate for deepseek_v32 does not reproduce its full forward on a tiny random model with a
single indexer head. With one head, score = w * relu(q . k) is exactly 0 for every key with q . k <= 0, so many keys
tie at the top-k boundary, and `torch.topk` breaks those ties differently for a decode row (t + 1 keys) than for the
same row of the full forward (T keys, the future masked): the two select different tokens. dayzero breaks ties
towards the lower position in every path (reference and kernels), so its cached decode equals its full forward.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dsa_cases import assert_cached_matches_full, first_flip, full_and_cached, kernel_sized_dsa_config
from tiny_checkpoints import build_hf_model, relative_error, save_hf_model
from dayzero.kernels import dispatch
from dayzero.model import Model, load_checkpoint
from dayzero.model.cache import init_cache

torch = pytest.importorskip("torch")

PROMPT, NEW = 50, 24  # 74 tokens: decoding crosses a 64-token block boundary
TABLES = np.array([[5, 2], [3, 6]], np.int32)  # scattered, reordered blocks (block 0 is scratch)


def hf_cached_and_full(hf_model, ids):
    """Greedy cached generate from `ids`: (sequences [B, PROMPT + NEW], cached logits, full-forward logits), the
    logits [B, NEW, V] predicting each generated token."""
    with torch.no_grad():
        out = hf_model.generate(torch.as_tensor(ids), max_new_tokens=NEW, do_sample=False, output_logits=True,
                                return_dict_in_generate=True, pad_token_id=0)
        full = hf_model(out.sequences).logits[:, PROMPT - 1:-1]
    return out.sequences.numpy(), torch.stack(out.logits, 1).numpy(), full.numpy()


def dayzero_full_and_cached(model: Model, seq: np.ndarray):
    """(full-forward logits, cached logits) [B, T - PROMPT, V] for seq [B, T] (`full_and_cached` with PROMPT tokens
    prefilled, in scattered blocks)."""
    return full_and_cached(model, seq, PROMPT, TABLES)[:2]


def one_head_dsa(tmp_path_factory, **overrides):
    """A tiny deepseek_v32 with one indexer head (index_topk 9 < context): (transformers model, dayzero model)."""
    hf = build_hf_model("deepseek_v32", seed=int(np.random.default_rng().integers(1 << 16)), index_n_heads=1,
                        **overrides)
    path = save_hf_model(hf, tmp_path_factory.mktemp("v32_one_head") / "ckpt")
    return hf, load_checkpoint(path, dtype="float32", progress=False)


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    return one_head_dsa(tmp_path_factory)


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    """One MLA layer: interpret-mode kernels compile slowly on CPU."""
    return one_head_dsa(tmp_path_factory, num_hidden_layers=1)


def test_cached_decode_equals_full_forward_where_transformers_does_not(three_layers, seed, monkeypatch):
    monkeypatch.delenv(dispatch.ENV_OVERRIDE, raising=False)
    hf, model = three_layers
    rng = np.random.default_rng(seed)
    for attempt in range(3):  # ties at the boundary are the rule here; a draw without any is redrawn
        seq, hf_cached, hf_full = hf_cached_and_full(hf, rng.integers(3, 200, (2, PROMPT)))
        hf_gap = float(np.max(np.abs(hf_cached - hf_full)))
        if hf_gap > 1e-3:
            break
    assert hf_gap > 1e-3, f"transformers' cached generate agreed with its full forward in 3 draws (seed={seed})"
    full, cached = dayzero_full_and_cached(model, seq)
    err = relative_error(cached, full)
    assert err < 1e-5, f"dayzero cached decode vs full forward: relative error {err:.2e} (seed={seed})"
    assert np.array_equal(cached.argmax(-1), full.argmax(-1)), f"seed={seed}"


def test_kernels_in_the_model_match_the_reference(one_layer, seed, monkeypatch):
    """The Pallas kernels (interpret mode) inside the model: decode == full forward == the reference path."""
    _, model = one_layer
    seq = np.random.default_rng(seed).integers(3, 200, (2, PROMPT + 6))
    monkeypatch.setenv(dispatch.ENV_OVERRIDE, "reference")
    ref_full, ref_cached = dayzero_full_and_cached(model, seq)
    monkeypatch.setenv(dispatch.ENV_OVERRIDE, "interpret")
    full, cached = dayzero_full_and_cached(model, seq)
    assert relative_error(ref_cached, ref_full) < 1e-5, f"reference: cached vs full (seed={seed})"
    assert relative_error(cached, full) < 1e-5, f"kernels: cached vs full (seed={seed})"
    assert relative_error(full, ref_full) < 1e-4, f"kernels vs reference (seed={seed})"


def test_fp8_indexer_decode_equals_full_forward(one_layer, seed, monkeypatch):
    """FP8 indexer mode: e4m3 keys and scales in the paged cache; cached decode == full forward. (On a tiny model
    the FP8 selection often equals the exact one, so the logits need not move; the quantization error itself is
    checked by the FP8 indexer's kernel tests.)"""
    monkeypatch.delenv(dispatch.ENV_OVERRIDE, raising=False)
    _, exact = one_layer
    model = Model(exact.config.replace(index_fp8=True), exact.params, exact.dtype)
    cache = init_cache(model.config, num_blocks=2, num_slots=1, dtype=model.dtype)
    assert cache["index_keys"].dtype == jnp.float8_e4m3fn and cache["index_scales"].shape == (1, 2, 64, 1)
    seq = np.random.default_rng(seed).integers(3, 200, (2, PROMPT + 6))
    full, cached, full_sel, cached_sel = full_and_cached(model, seq, PROMPT, TABLES)
    assert relative_error(cached, full) < 1e-5, f"fp8: cached vs full (seed={seed})"
    # the selections both runs sow (what the GPU test reads to tell a near-tie flip from a wrong cache)
    expected = (2, PROMPT + 5, model.config.index_topk)
    assert [s.shape for s in full_sel] == [s.shape for s in cached_sel] == [expected], (full_sel, cached_sel)
    assert first_flip(full_sel, cached_sel) is None, f"fp8: selections differ (seed={seed})"
    swapped = [s.copy() for s in cached_sel]
    swapped[0][1, 7, -1] += 1  # another key than the last (largest) one token 7 selects
    assert first_flip(full_sel, swapped) == (7, 0)


def test_cached_vs_full_checker_catches_a_misplaced_decode(seed, monkeypatch):
    """`assert_cached_matches_full`, which the GPU test relies on to tell a near-tie flip from a bug, at the GPU test's
    model size (16 index heads, top 48): it passes the model's own cached decode and fails a planted bug, each decode
    token written and read one position late (3-11 keys swapped per row at the first decode token over 28 seeds)."""
    monkeypatch.delenv(dispatch.ENV_OVERRIDE, raising=False)
    rng = np.random.default_rng(seed)
    model = Model.random(kernel_sized_dsa_config(), dtype="float32", seed=int(rng.integers(1000)))
    seq, prompt, tables = rng.integers(3, 256, (2, 106)), 100, np.array([[7, 2, 9], [4, 8, 1]])
    assert_cached_matches_full(*full_and_cached(model, seq, prompt, tables), prompt, seed)
    with pytest.raises(AssertionError, match="keys swapped"):
        assert_cached_matches_full(*full_and_cached(model, seq, prompt, tables, decode_shift=1), prompt, seed)
