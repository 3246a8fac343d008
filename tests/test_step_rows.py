"""The step inputs' trip to the device: `runner.pack_rows` packs the fields XLA reads into one int32 array (one
transfer), and `unpack_rows` gives back every field bit for bit, under jit as the steps run it."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from dayzero.serving import runner
from dayzero.serving.runner import StepRows


def filled(rows: StepRows, seed: int) -> StepRows:
    """Every field of `rows` random, the float ones including -0.0, NaN and infinities (bits must survive)."""
    rng = np.random.default_rng(seed)
    for name, value in vars(rows).items():
        if value is None:
            continue
        if value.dtype == bool:
            value[...] = rng.random(value.shape) < 0.5
        elif value.dtype.kind == "f":
            value[...] = rng.standard_normal(value.shape).astype(value.dtype)
            value.reshape(-1)[:3] = [-0.0, np.nan, np.inf][:value.size]
        else:
            info = np.iinfo(value.dtype)
            value[...] = rng.integers(info.min, info.max, value.shape, dtype=value.dtype, endpoint=True)
    return rows


@pytest.mark.parametrize("decode_steps, embed_dim", [(4, 0), (0, 0), (0, 8)])
def test_packed_rows_come_back_bit_for_bit(decode_steps, embed_dim):
    rows = filled(StepRows.padding(3, 5 if not decode_steps else 1, 4, embed_dim=embed_dim,
                                   decode_steps=decode_steps), seed=decode_steps + embed_dim)
    arrays, layout = runner.pack_rows(rows)
    packed = [name for name, _, _ in layout]
    assert arrays["packed"].dtype == np.int32 and arrays["packed"].ndim == 1
    assert not set(packed) & set(arrays) and {"block_tables", "slots", "positions"} <= set(arrays)
    assert ("embeds_mask" in packed) == bool(embed_dim) and ("steps" in packed) == bool(decode_steps)
    hash(layout)  # a static argument of the jitted steps

    unpacked = jax.jit(runner.unpack_rows, static_argnums=1)(jax.device_put(arrays), layout)
    for name, want in vars(rows).items():
        got = unpacked[name]
        if want is None:
            assert got is None, name
            continue
        got = np.asarray(got)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert got.tobytes() == want.tobytes(), name


def test_packing_refuses_a_field_it_cannot_carry_bit_for_bit():
    rows = StepRows.padding(2, 1, 1, decode_steps=2)
    rows.temperature = rows.temperature.astype(np.float16)
    with pytest.raises(TypeError, match="temperature is float16"):
        runner.pack_rows(rows)
