"""What an Nsight Compute report says about each profiled kernel, in a few lines: time, throughputs, occupancy,
issue rate, the leading warp-stall reasons, and (from the source page) the SASS instructions that hold the most
stall samples.

    ncu -i report.ncu-rep --page raw --csv > raw.csv
    ncu -i report.ncu-rep --page source --csv --print-source sass > source.csv     # optional
    python3 benchmarks/ncu_summary.py raw.csv [source.csv] [--top 25]
"""

from __future__ import annotations

import argparse
import csv
import re
import sys

# (label, raw metric name): printed when present, with the unit the report gives it
METRICS = (
    ("time", "gpu__time_duration.sum"),
    ("grid", "launch__grid_size"),
    ("block", "launch__block_size"),
    ("regs", "launch__registers_per_thread"),
    ("smem", "launch__shared_mem_per_block"),
    ("occ_limit_regs", "launch__occupancy_limit_registers"),
    ("occ_limit_smem", "launch__occupancy_limit_shared_mem"),
    ("occ_theory_pct", "sm__maximum_warps_per_active_cycle_pct"),
    ("occ_achieved_pct", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("sm_pct", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("dram_pct", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("dram_rate", "dram__bytes.sum.per_second"),
    ("dram_read", "dram__bytes_read.sum"),
    ("l1_hit_pct", "l1tex__t_sector_hit_rate.pct"),
    ("l2_hit_pct", "lts__t_sector_hit_rate.pct"),
    ("ipc_per_sm", "sm__inst_executed.avg.per_cycle_active"),
    ("issue_active_pct", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("tensor_pct", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("warp_cycles_per_issue", "smsp__average_warp_latency_per_inst_issued.ratio"),
    ("eligible_warps", "smsp__warps_eligible.avg.per_cycle_active"),
    ("active_warps", "smsp__warps_active.avg.per_cycle_active"),
)
_STALL = re.compile(r"smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")


def _number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def raw_rows(path: str) -> tuple[list[dict], dict]:
    """Rows of `--page raw --csv` (a header row, a units row, one row per kernel) as dicts, and the units by metric."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if start is None:
        return [], {}
    header = rows[start]
    units = dict(zip(header, rows[start + 1])) if len(rows) > start + 1 else {}
    return [dict(zip(header, r)) for r in rows[start + 2:] if len(r) == len(header)], units


def summarize_kernel(row: dict, units: dict) -> str:
    name = row.get("Kernel Name", "?")
    parts = []
    for label, metric in METRICS:
        value = row.get(metric)
        if value not in (None, ""):
            unit = units.get(metric, "")
            parts.append(f"{label}={value}" + (f" {unit}" if unit and unit not in ("%", "register/thread") else ""))
    stalls = []
    for metric, value in row.items():
        match = _STALL.match(metric)
        number = _number(value) if match else None
        if number:
            stalls.append((number, match.group(1)))
    stalls.sort(reverse=True)
    lines = [f"{name[:90]}", "  " + " ".join(parts)]
    if stalls:
        total = sum(v for v, _ in stalls)
        lines.append("  stalls (warp cycles per issued instruction): total %.1f: " % total
                     + ", ".join(f"{n} {v:.2f}" for v, n in stalls[:8]))
    return "\n".join(lines)


def source_hotspots(path: str, top: int) -> str:
    """The SASS instructions with the most warp-stall samples, per kernel of `--page source --csv` (the page prints
    a `"Kernel Name","<name>"` line, then that kernel's table: a header row and one row per instruction)."""
    tables, current = [], None
    with open(path, newline="", errors="replace") as f:
        for line in f:
            if line.startswith('"Kernel Name"'):
                current = [next(csv.reader([line]))[1], []]
                tables.append(current)
            elif current is not None and line.strip():
                current[1].append(line)
    out = []
    for name, lines in tables:
        rows = list(csv.reader(lines))
        header, body = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
        samples = next((i for i, h in enumerate(header) if h.startswith("Warp Stall Sampling (All")), None)
        if samples is None:
            out.append(f"{name}: no stall-sampling column (columns: {', '.join(header[:8])})")
            continue
        source = header.index("Source") if "Source" in header else 1
        executed = next((i for i, h in enumerate(header) if h.startswith("Instructions Executed")), None)
        total = sum(_number(r[samples]) or 0 for r in body) or 1
        out.append(f"{name}: {len(body)} SASS instructions, {int(total)} stall samples; top {top}:")
        for r in sorted(body, key=lambda r: -(_number(r[samples]) or 0))[:top]:
            ex = f" exec={r[executed]}" if executed is not None else ""
            out.append(f"  {100 * (_number(r[samples]) or 0) / total:5.1f}%  {r[0]}  {r[source][:90]}{ex}")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw")
    parser.add_argument("source", nargs="?")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    rows, units = raw_rows(args.raw)
    if not rows:
        print(f"{args.raw}: no kernel rows")
    for row in rows:
        print(summarize_kernel(row, units))
    if args.source:
        try:
            print(source_hotspots(args.source, args.top))
        except OSError as e:
            print(f"{args.source}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
