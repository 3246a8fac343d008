"""The engine's host work per decode dispatch, with the device taken out: scheduling, building the step inputs
(tokens, block tables, sampling keys), and recording the sampled tokens (stop checks, outputs).

    python3 benchmarks/engine_host.py [--batches 1,16,64] [--tokens 256] [--repeats 7] [--results ...]

With `EngineConfig.overlap_decode` (the default) the engine launches the next decode dispatch before it reads this
one's tokens, so this time hides behind the device's while it is shorter than a dispatch's device time; past that
(or with overlap off, where it adds to every dispatch) each millisecond here is 0.25 ms of ITL at 4 steps per
dispatch. A stand-in runner returns fixed tokens at once, so only host work is timed (the tiny preset; model
size does not matter here). Runs on any machine; the host's CPU is what it measures. Median of `--repeats` runs
per batch size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import numpy as np

from dayzero.model import Model
from dayzero.model.presets import get_preset
from dayzero.serving import Engine, EngineConfig, SamplingParams

from results import append_line, git_commit  # benchmarks/results.py: a script's own folder is on sys.path


class InstantRunner:
    """Stands in for `ModelRunner.dispatch`: returns token 5 with logprob 0 at once (numpy arrays) and counts
    decode dispatches; everything else is the real runner's."""

    def __init__(self, real):
        self.real = real
        self.decode_dispatches = 0

    def dispatch(self, rows, decode, previous=None):
        n_rows = rows.tokens.shape[0]
        self.decode_dispatches += decode
        shape = (n_rows, rows.keys.shape[1]) if decode else (n_rows,)
        return np.full(shape, 5, np.int32), np.zeros(shape, np.float32)

    def __getattr__(self, name):
        return getattr(self.real, name)


def host_ms_per_dispatch(model: Model, batch: int, new_tokens: int) -> dict:
    """`Engine.generate` of `batch` requests (97-token prompts, `new_tokens` each), timed whole: host time per
    decode dispatch and per token step (the few prefill dispatches' host work included)."""
    engine = Engine(model, None, EngineConfig(max_num_seqs=batch, max_model_len=2048, enable_prefix_caching=False,
                                              seed=0))
    runner = engine.runner = InstantRunner(engine.runner)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.generate(prompt_token_ids=[list(range(3, 100))] * batch, sampling_params=params)
    seconds = time.perf_counter() - start
    return {"ms_per_dispatch": round(seconds / runner.decode_dispatches * 1e3, 3),
            "ms_per_token_step": round(seconds / new_tokens * 1e3, 3), "dispatches": runner.decode_dispatches}


def host_cpu() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one) and core count."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    model = Model.random(get_preset("tiny"), dtype="float32")
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        host_ms_per_dispatch(model, batch, 16)  # warm the Python paths
        runs = [host_ms_per_dispatch(model, batch, args.tokens) for _ in range(args.repeats)]
        results[f"B{batch}"] = {key: float(np.median([r[key] for r in runs])) for key in runs[0]}
        print(f"batch {batch} (median of {args.repeats}): {results[f'B{batch}']}")
    line = (f"- {datetime.date.today()} engine_host.py, host CPU {host_cpu()} "
            f"(device replaced by an instant stand-in), commit {git_commit()}, {args.tokens} new tokens, "
            f"{EngineConfig().decode_steps} decode steps per dispatch, median of {args.repeats} runs: "
            f"{json.dumps(results)}\n")
    append_line(args.results, line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
