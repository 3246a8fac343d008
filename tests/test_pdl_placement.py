"""benchmarks/pdl_placement.py: its kernels' instruction order in the Triton IR (lowered for CUDA on the CPU) and
its summary of the timer values (no GPU needed)."""

from __future__ import annotations

import numpy as np
import pytest

import pdl_placement


def _asm(ir: str) -> list[str]:
    return [line for line in ir.splitlines() if "elementwise_inline_asm" in line]


@pytest.mark.parametrize("early", [False, True])
def test_probe_reads_timer_and_sm_before_its_wait(early):
    pytest.importorskip("jax._src.pallas.triton.lowering")
    from triton_report import capture_kernels

    busy, probe = capture_kernels(lambda: pdl_placement.busy_then_probe(
        busy_ns=1000, early=early, busy_programs=4, probe_programs=2))
    assert (busy["name"], probe["name"]) == ("pdl_busy", "pdl_probe")
    busy_asm = _asm(busy["ir"])
    assert any("griddepcontrol.launch_dependents" in line for line in busy_asm) == early
    assert "%globaltimer_lo" in busy_asm[-1]  # the spin's reads come after the trigger
    order = [next(name for name, key in (("timer", "%globaltimer_lo"), ("sm", "%smid"), ("wait", "griddepcontrol.wait"))
                  if key in line) for line in _asm(probe["ir"])]
    assert order == ["timer", "sm", "wait", "timer"]
    assert all("pure = false" in line for line in busy_asm + _asm(probe["ir"]))


def test_summary_measures_from_the_busy_kernels_last_end_across_the_timer_wrap():
    wrap = 2 ** 32
    to_int32 = lambda ns: ((np.asarray(ns, np.int64) + 2 ** 31) % wrap - 2 ** 31).astype(np.int32)
    last_end = wrap - 1_000  # the timer wraps 1 us after the busy kernel ends
    ends = to_int32([last_end - 5_000, last_end])
    starts = to_int32([last_end - 3_000, last_end - 2_000, last_end + 500])
    released = to_int32([last_end + 1_500, last_end + 1_500, last_end + 2_500])
    figures = pdl_placement.summary(ends, starts, released, np.array([3, 3, 7]))
    assert figures == {"started_before_busy_end": 2, "programs": 3, "median_start_us": -2.0,
                       "median_release_us": 1.5, "sms_used": 2, "most_on_one_sm": 2}
