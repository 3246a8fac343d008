"""benchmarks/serving.py's timing helper on a tiny random model (CPU): a warm-up generate, then repeated timed
generates whose compilations are counted."""

from __future__ import annotations

import serving as serving_benchmark

from dayzero.model import Model
from dayzero.model.presets import tiny
from dayzero.serving import Engine, EngineConfig, SamplingParams


def test_timed_generate_repeats_after_a_warm_up_and_counts_compilations():
    model = Model.random(tiny(), dtype="float32", seed=0)
    config = EngineConfig(max_num_seqs=2, max_model_len=128, max_prefill_tokens=64, max_prefill_rows=2,
                          prefill_len_buckets=(64,), block_buckets=(2,))
    engine = Engine(model, None, config)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    runs = serving_benchmark.timed_generate(engine, prompts, params, repeats=3)
    assert len(runs) == 3
    for outs, wall, compiled in runs:
        assert [len(o.token_ids) for o in outs] == [5, 5] and wall > 0
        assert compiled == 0  # every shape was compiled by the warm-up generate
    assert [o.token_ids for o in runs[0][0]] == [o.token_ids for o in runs[2][0]]  # greedy: the same tokens
    # with the warm-up skipped (an engine whose first generate does nothing), the first timed run compiles
    fresh = Engine(model, None, config)

    class SkipsFirst:
        calls = 0
        num_compilations = property(lambda self: fresh.num_compilations)

        def generate(self, **kwargs):
            self.calls += 1
            return [] if self.calls == 1 else fresh.generate(**kwargs)

    runs = serving_benchmark.timed_generate(SkipsFirst(), prompts, params, repeats=2)
    assert runs[0][2] > 0 and runs[1][2] == 0


def test_peer_ratios_bound_the_ratio_by_the_batch16_floor():
    ours = {"itl_B16_ms": 2.845, "bandwidth_floor_b16_ms": 2.052}
    ratios = serving_benchmark.peer_ratios(ours, {"hf_B16_P1024_itl_ms": 44.03})
    assert ratios == {"itl_B16_peer_over_ours": 15.5, "itl_B16_peer_over_floor": 21.5}
    assert serving_benchmark.peer_ratios(ours, {}) == {}  # no peer run, or it failed
    assert serving_benchmark.peer_ratios(ours, {"error": "timed out"}) == {}


def test_set_module_constants_sets_and_names_them(monkeypatch):
    """serving.py's and decode_profile.py's `--set`: each MODULE.CONSTANT=VALUE set (true/false/ints parsed) and
    returned for the results line; a constant the module lacks, or text without a value, stops the run by name."""
    import pytest

    from dayzero.model import moe

    monkeypatch.setattr(moe, "SHARED_GATE_UP_IN_FRONT", False)
    monkeypatch.setattr(moe, "SHARED_IN_PACKED_MAX_TOKENS", moe.SHARED_IN_PACKED_MAX_TOKENS)
    done = serving_benchmark.set_module_constants(["model.moe.SHARED_GATE_UP_IN_FRONT=true",
                                                   "model.moe.SHARED_IN_PACKED_MAX_TOKENS=0"])
    assert done == {"SHARED_GATE_UP_IN_FRONT": True, "SHARED_IN_PACKED_MAX_TOKENS": 0}
    assert moe.SHARED_GATE_UP_IN_FRONT is True and moe.SHARED_IN_PACKED_MAX_TOKENS == 0
    with pytest.raises(SystemExit, match="has no NOT_A_SWITCH"):
        serving_benchmark.set_module_constants(["model.moe.NOT_A_SWITCH=1"])
    with pytest.raises(SystemExit, match="not MODULE.CONSTANT=VALUE"):
        serving_benchmark.set_module_constants(["model.moe.SHARED_GATE_UP_IN_FRONT"])
    assert serving_benchmark.peer_ratios({"itl_B1_ms": 0.9, "bandwidth_floor_b16_ms": 0.7},
                                         {"hf_B16_P1024_itl_ms": 44.0}) == {}  # batch 16 not timed


def test_batch_figures_take_ttft_over_every_run_and_tokens_per_second_from_the_median_run():
    from types import SimpleNamespace as Out

    def run(itls_s, ttfts_s, wall_s):  # one timed run: (outputs, wall seconds, compilations); 4 tokens a request
        return [Out(mean_itl=i, ttft=t, token_ids=[1, 2, 3, 4]) for i, t in zip(itls_s, ttfts_s)], wall_s, 0

    runs = [run([1e-3], [0.010], 2.0), run([3e-3], [0.050], 4.0), run([2e-3], [0.060], 1.0)]
    figures = serving_benchmark.batch_figures(runs, 1)
    assert figures["itl_B1_ms"] == 2.0 and figures["itl_B1_runs_ms"] == [1.0, 3.0, 2.0]
    assert figures["tok_s_B1"] == 4.0  # the median-ITL run (the third): 4 tokens in 1 s
    assert figures["ttft_B1_ms"] == 50.0  # the median of the three runs' single requests, not the median run's 60
    two = [run([1e-3, 5e-3], [0.001, 0.002], 1.0), run([2e-3, 2e-3], [0.003, 0.100], 2.0)]
    figures = serving_benchmark.batch_figures(two, 2)
    assert figures["itl_B2_runs_ms"] == [3.0, 2.0] and figures["itl_B2_ms"] == 2.5
    assert figures["ttft_B2_ms"] == 2.5  # over all four requests
    assert figures["tok_s_B2"] == 8.0  # an even count of runs: the upper of the middle two (8 tokens in 1 s)
