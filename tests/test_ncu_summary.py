"""benchmarks/ncu_summary.py: the few lines it prints from Nsight Compute's raw and source CSV pages."""

from __future__ import annotations

import ncu_summary


RAW = '''"ID","Kernel Name","gpu__time_duration.sum","launch__registers_per_thread",\
"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",\
"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"
"","","us","register/thread","ratio","ratio"
"0","kda_chunk_akk","530.75","255","2.41","0.69"
"1","kda_chunk_wy","182.88","168","2.69","0.94"
'''

SOURCE = '''"Kernel Name","kda_chunk_akk",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"
"0x10","FMUL R1, R2, 1.44","90","65536"
"0x20","FADD R3, R1, R4","10","65536"
"Kernel Name","kda_chunk_wy",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed"
"0x30","FFMA R5, R6, R7, R8","40","16384"
'''


def test_raw_page_kernels_units_and_stalls(tmp_path):
    path = tmp_path / "raw.csv"
    path.write_text(RAW)
    rows, units = ncu_summary.raw_rows(str(path))
    assert [r["Kernel Name"] for r in rows] == ["kda_chunk_akk", "kda_chunk_wy"]
    assert units["gpu__time_duration.sum"] == "us"
    text = ncu_summary.summarize_kernel(rows[0], units)
    assert "time=530.75 us" in text and "regs=255" in text
    # stall reasons sorted by their share, with the total
    assert "total 3.1: long_scoreboard 2.41, barrier 0.69" in text


def test_source_page_hotspots_per_kernel(tmp_path):
    path = tmp_path / "source.csv"
    path.write_text(SOURCE)
    lines = ncu_summary.source_hotspots(str(path), top=1).splitlines()
    assert lines[0] == "kda_chunk_akk: 2 SASS instructions, 100 stall samples; top 1:"
    assert "90.0%" in lines[1] and "FMUL" in lines[1]
    assert lines[2] == "kda_chunk_wy: 1 SASS instructions, 40 stall samples; top 1:"
    assert "100.0%" in lines[3] and "FFMA" in lines[3]
