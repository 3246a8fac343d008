"""Compares decode_profile.py dumps kernel by kernel: each kernel name's share of the dispatch's busy time (the
timeline's `end_gain_us` less any idle gap before the kernel, summed over its launches and divided by the tokens of
the dispatch), the first dump the baseline, with each other dump's difference from it.

    python3 benchmarks/dump_diff.py BASE.B1.json OTHER.B1.json [MORE.B1.json ...] [--tokens 4] [--top 30]

Kernel names are folded over layers (`gpu_trace.kernel_family`: a Pallas kernel's `__N`, an XLA fusion's `_N`).
Reads only the dumps (no GPU).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

from gpu_trace import kernel_family  # benchmarks/gpu_trace.py: a script's own folder is on sys.path


def shares(timeline: list[dict], tokens: int) -> dict[str, tuple[float, float]]:
    """{kernel family: (us per token of the dispatch's end it accounts for, launches per token)} over the timeline's
    kernels (host-to-device copies left out; the idle time before a kernel, e.g. the dispatch's launch after its
    inputs' copies, is no kernel's)."""
    gain, count = collections.Counter(), collections.Counter()
    for row in timeline:
        if row["kernel"].startswith("Memcpy"):
            continue
        family = kernel_family(row["kernel"])
        gain[family] += row["end_gain_us"] - max(row.get("gap_us", 0.0), 0.0)
        count[family] += 1
    return {family: (gain[family] / tokens, count[family] / tokens) for family in gain}


def table(dumps: list[dict[str, tuple[float, float]]], top: int) -> list[tuple[str, float, list[float]]]:
    """Rows (kernel family, its launches per token in the baseline, [us per token in each dump]), the families
    whose time changes most first (then by baseline time), at most `top` of them; a family missing from a dump
    counts 0 there."""
    families = set().union(*dumps)
    rows = [(family, dumps[0].get(family, (0.0, 0.0))[1], [d.get(family, (0.0, 0.0))[0] for d in dumps])
            for family in families]
    rows.sort(key=lambda r: (-max(abs(v - r[2][0]) for v in r[2]), -r[2][0], r[0]))
    return rows[:top]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dumps", nargs="+", help="decode_profile.py --dump files; the first is the baseline")
    parser.add_argument("--tokens", type=int, default=4, help="tokens per traced dispatch (decode_profile's STEPS)")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    loaded = []
    for path in args.dumps:
        with open(path) as f:
            dump = json.load(f)
        if not dump.get("timeline") or "end_gain_us" not in dump["timeline"][0]:
            parser.error(f"{path}: no timeline with end_gain_us (a decode_profile.py --dump from 264101a on)")
        loaded.append(shares(dump["timeline"], args.tokens))
    header = " | ".join(["kernel", "launches / token", "base us / token"] + [f"dump {i} - base" for i in
                                                                               range(1, len(loaded))])
    print(f"| {header} |\n|{'---|' * (2 + len(loaded))}")
    for family, launches, values in table(loaded, args.top):
        diffs = [f"{v - values[0]:+.2f}" for v in values[1:]]
        print(f"| {' | '.join([family, f'{launches:g}', f'{values[0]:.2f}'] + diffs)} |")
    totals = [sum(gain for gain, _ in d.values()) for d in loaded]
    print(f"| total | | {totals[0]:.2f} | " + " | ".join(f"{t - totals[0]:+.2f}" for t in totals[1:]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
