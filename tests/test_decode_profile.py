"""benchmarks/decode_profile.py's attribution of GPU kernels to model ops (synthetic HLO and trace events)."""

from __future__ import annotations

import decode_profile
import gpu_trace


HLO = """
  %input_reduce_fusion.98 = bf16[2048]{0} fusion(%a), kind=kCustom, calls=%r.98, metadata={op_name="jit(_decode)/while/body/eval_jaxpr/Decoder.step/layers_0.step/self_attn.step/self_attn._inputs/v_proj/dot_general" deduplicated_name="input_reduce_fusion.96" scheduling_name="x"}
  %input_reduce_fusion.96 = bf16[2048]{0} fusion(%b), kind=kCustom, calls=%r.96, metadata={op_name="jit(_decode)/while/body/eval_jaxpr/Decoder.step/layers_4.step/self_attn.step/self_attn._inputs/q_proj/dot_general" deduplicated_name="input_reduce_fusion.96" scheduling_name="y"}
  ROOT %fusion.7 = bf16[1,2048]{1,0} fusion(%c), kind=kLoop, calls=%f.7, metadata={op_name="jit(_decode)/while/body/eval_jaxpr/Decoder.step/layers_1.step/layers_1._mlp/mlp/shared_experts/up_proj/dot_general"}
  %constant.3 = s32[] constant(0)
"""


def test_kernels_are_named_after_the_first_of_their_shared_group():
    ops = decode_profile.kernel_ops(HLO)
    assert ops["input_reduce_fusion_98"] == ("attn: self_attn._inputs/q_proj/dot_general -> bf16[2048] | "
                                             "attn: self_attn._inputs/v_proj/dot_general -> bf16[2048]")
    assert "input_reduce_fusion_96" not in ops  # it runs as _98's kernel
    assert ops["fusion_7"] == "mlp: mlp/shared_experts/up_proj/dot_general -> bf16[1,2048]"


def test_attribution_counts_gpu_kernels_per_token():
    ops = decode_profile.kernel_ops(HLO)
    events = [{"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
              {"ph": "X", "pid": 3, "name": "input_reduce_fusion_98", "dur": 6.0},
              {"ph": "X", "pid": 3, "name": "input_reduce_fusion_98", "dur": 6.0},
              {"ph": "X", "pid": 3, "name": "moe_dense_gate_up", "dur": 4.0},
              {"ph": "X", "pid": 1, "name": "input_reduce_fusion_98", "dur": 500.0}]  # host event: not counted
    rows, total_ms, kernels = decode_profile.attribute(events, ops, n_tokens=2)
    assert rows[0] == (ops["input_reduce_fusion_98"] + " [input_reduce_fusion]", 0.006, 1.0)
    assert rows[1] == ("moe_dense_gate_up", 0.002, 0.5)  # Pallas kernels keep their own name
    assert abs(total_ms - 0.008) < 1e-12 and kernels == 1.5


def test_busy_summary_merges_overlapping_kernels_and_groups_by_module():
    gpu = {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:GPU:0"}}
    kernel = lambda ts, dur, module: {"ph": "X", "pid": 3, "name": "k", "ts": ts, "dur": dur,
                                      "args": {"hlo_module": module}}
    events = [gpu, kernel(100.0, 50.0, "jit__decode"), kernel(120.0, 50.0, "jit__decode"),  # overlap: 70 busy
              kernel(400.0, 100.0, "jit__prefill")]
    summary = gpu_trace.busy_summary(gpu_trace.gpu_kernels(events))
    assert summary["span_ms"] == 0.4 and summary["busy_ms"] == 0.17
    assert summary["idle_share"] == round(1 - 170 / 400, 3)
    assert summary["by_module"] == {"jit__decode": {"ms": 0.1, "kernels": 2}, "jit__prefill": {"ms": 0.1, "kernels": 1}}
    assert gpu_trace.busy_summary([]) == {"kernels": 0}


def test_kernel_time_split_reports_median_and_span_with_gaps():
    events = [{"name": "kda_recurrent_slots", "ts": 0.0, "dur": 5.0}, {"name": "other", "ts": 6.0, "dur": 1.0},
              {"name": "kda_recurrent_slots", "ts": 10.0, "dur": 7.0}]
    split = gpu_trace.kernel_time_split(events, "kda_recurrent")
    assert split == {"count": 2, "median_us": 7.0, "mean_us": 6.0, "span_per_kernel_us": 8.5}
    assert gpu_trace.kernel_time_split(events, "missing") == {"count": 0}


def test_xla_options_are_added_to_the_gpu_compile_options(monkeypatch):
    from dayzero.kernels import dispatch

    monkeypatch.setattr(dispatch, "_COMPILER_OPTIONS", dict(dispatch._COMPILER_OPTIONS))
    extra = decode_profile.use_xla_options(["xla_gpu_enable_triton_gemm=false", "xla_gpu_autotune_level=2"])
    assert extra == {"xla_gpu_enable_triton_gemm": False, "xla_gpu_autotune_level": 2}
    cuda = dispatch.compiler_options("cuda")
    assert cuda["xla_gpu_enable_triton_gemm"] is False and cuda["xla_disable_hlo_passes"] == "dot-strength-reduction"
    assert dispatch.compiler_options("cpu") == {}


def test_set_names_a_module_constant_and_parses_its_value():
    from dayzero.model import mla

    module, constant, value = decode_profile.module_constant("model.mla.DECODE_PROJECTIONS=false")
    assert (module, constant, value) == (mla, "DECODE_PROJECTIONS", False)
    assert decode_profile.module_constant("kernels.projection.CHOOSE_MAX_ROWS=16")[1:] == ("CHOOSE_MAX_ROWS", 16)
    for bad in ("model.mla.NO_SUCH_CONSTANT=1", "model.nowhere.X=1", "DECODE_PROJECTIONS=1", "model.mla.X"):
        try:
            decode_profile.module_constant(bad)
        except SystemExit as e:
            assert "--set" in str(e)
        else:
            raise AssertionError(f"{bad!r} was taken")


def test_results_lines_name_the_xla_environment(monkeypatch):
    import results

    for name in results.XLA_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    assert results.xla_environment() == "none"
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "vmm")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
    assert results.xla_environment() == ("XLA_FLAGS='--xla_gpu_enable_command_buffer=', "
                                         "XLA_PYTHON_CLIENT_ALLOCATOR='vmm'")


def test_timeline_lists_the_last_dispatch_in_launch_order():
    ops = decode_profile.kernel_ops(HLO)
    gpu = {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:GPU:0"}}
    kernel = lambda name, ts, dur: {"ph": "X", "pid": 3, "name": name, "ts": ts, "dur": dur}
    events = [gpu, kernel("moe_front", 0.0, 5.0), kernel("input_reduce_fusion_98", 6.0, 2.0),  # dispatch 1
              kernel("input_reduce_fusion_98", 113.0, 2.0), kernel("moe_front", 100.0, 5.0)]  # dispatch 2, unsorted
    rows = decode_profile.timeline(events, ops, dispatches=2)
    assert [r["kernel"] for r in rows] == ["moe_front", "input_reduce_fusion_98"]
    assert rows[0] == {"kernel": "moe_front", "op": "", "start_us": 0.0, "dur_us": 5.0, "gap_us": 0.0,
                       "end_gain_us": 5.0}
    assert rows[1]["op"] == ops["input_reduce_fusion_98"] and rows[1]["start_us"] == 13.0
    assert rows[1]["gap_us"] == 8.0  # from the first kernel's end (5 us) to this one's start (13 us)
    assert rows[1]["end_gain_us"] == 10.0  # the dispatch's end 5 -> 15 us: its gap and its own 2 us


def test_timeline_gives_overlapping_kernels_their_share_of_the_end():
    """A kernel launched early (its span starts with a wait, inside the one before) moves the dispatch's end only by
    the part of it past the previous end."""
    gpu = {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:GPU:0"}}
    kernel = lambda name, ts, dur: {"ph": "X", "pid": 3, "name": name, "ts": ts, "dur": dur}
    events = [gpu, kernel("a", 0.0, 10.0), kernel("b", 4.0, 9.0), kernel("c", 12.0, 0.5)]
    rows = decode_profile.timeline(events, {}, dispatches=1)
    assert [r["end_gain_us"] for r in rows] == [10.0, 3.0, 0.0]
    assert [r["gap_us"] for r in rows] == [0.0, -6.0, -1.0]


def test_call_host_ms_times_every_input_kind_and_leaves_the_engine_usable():
    """The dispatch call's host-time split runs the engine's own decode function with the cache donated: every
    kind is timed, and the runner's cache (handed back by each call) still serves the next dispatch."""
    from dayzero.model import Model
    from dayzero.model.presets import tiny

    model = Model.random(tiny(), dtype="float32", seed=0)
    engine = decode_profile.engine_for(model, "profile", 1)
    rows = decode_profile.decode_rows(1, 20, model.config.vocab_size)
    engine.runner.run(rows, True)  # compiles
    parts = decode_profile.call_host_ms(engine, rows, repeats=3)
    assert set(parts) == {"put", "fresh", "ready", "same", "waited"}
    assert all(ms > 0 for ms in parts.values())
    tokens, logprobs = engine.runner.run(rows, True)
    assert tokens.shape == (1, decode_profile.STEPS) and ((tokens >= 0) & (tokens < model.config.vocab_size)).all()
    assert (logprobs <= 0).all()


def test_dump_diff_folds_copies_and_compares_shares():
    import dump_diff
    assert [dump_diff.kernel_family(n) for n in ("moe_front__3", "loop_add_fusion_3", "gemm_fusion_dot.20",
                                                 "decode_projection_one_weight", "wrapped_iota")] == [
        "moe_front", "loop_add_fusion", "gemm_fusion_dot", "decode_projection_one_weight", "wrapped_iota"]
    base = [{"kernel": "MemcpyH2D", "end_gain_us": 0.8}, {"kernel": "moe_front", "end_gain_us": 9.0, "gap_us": 4.0},
            {"kernel": "moe_front__1", "end_gain_us": 6.0}, {"kernel": "loop_add_fusion_2", "end_gain_us": 1.0}]
    other = [{"kernel": "moe_front", "end_gain_us": 4.0}, {"kernel": "moe_front__1", "end_gain_us": 4.0}]
    shares = [dump_diff.shares(t, tokens=2) for t in (base, other)]
    assert shares[0] == {"moe_front": (5.5, 1.0), "loop_add_fusion": (0.5, 0.5)}
    rows = dump_diff.table(shares, top=5)
    assert rows[0] == ("moe_front", 1.0, [5.5, 4.0])  # the largest change first
    assert rows[1] == ("loop_add_fusion", 0.5, [0.5, 0.0])  # missing from the second dump: 0 there
