"""When and where a kernel launched early (programmatic dependent launch) starts its programs, against the end of the
kernel before it.

    python3 benchmarks/pdl_placement.py [--busy-us 20] [--busy-programs 528] [--busy-warps 4] [--probe-programs 128]

Two Pallas (Triton) kernels in one jitted function: a "busy" kernel whose programs spin on the global timer for
`--busy-us` and store when they end, then a "probe" kernel whose programs store the global timer and their SM
(`%smid`) as their first instructions, wait (`griddepcontrol.wait`), and store the timer again. It runs twice:
with the busy kernel letting the probe launch as it starts (`griddepcontrol.launch_dependents` first), and
without. `--busy-warps` sets how much of each SM the busy kernel holds while the probe is placed (528 programs of
4 warps: 16 of an H100 SM's 64 warp slots). Two questions of the fifty-fifth session (benchmarks/NOTES_serving.md)
have answers here:

- whether XLA puts a wait of its own before a Pallas kernel's code (`pdl_ptx_check.py` could not tell from the
  dump): with the early launch, probe programs that started before the busy kernel ended ran our code before any
  wait of ours, so XLA added none;
- whether an early-launched kernel's programs land on the SMs unevenly (a kernel family launched early ran ~7 us
  slower per layer in the model): the probe programs per SM, early against not.

Prints, per mode, the probe programs that started before the busy kernel's end, the median start and wait release
relative to it (us), the SMs used and the most programs on one SM; appends one line to RESULTS.md. Needs an sm_90+
NVIDIA GPU (the special registers are read through inline PTX; elsewhere the readers are the identity).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from dayzero.kernels import grid_dependency, inline_asm, tiles

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import results  # noqa: E402  (benchmarks/)

_PTX = {"timer": "mov.u32 $0, %globaltimer_lo;", "sm": "mov.u32 $0, %smid;"}
special_register_p, _LOWERING = inline_asm.scalar_asm_primitive("dayzero_special_register", _PTX)


def read(name: str, after) -> jax.Array:
    """Inside a kernel: the special register `name` ("timer": %globaltimer_lo, ns; "sm": %smid) as an int32 scalar,
    read after whatever produced `after` (an int32 scalar threaded through, as `grid_dependency` does)."""
    return special_register_p.bind(jnp.asarray(after, jnp.int32), kind=name)


def _busy_kernel(out_ref, *, busy_ns: int, early: bool):
    """Spins `busy_ns` on the global timer; out_ref [P] int32: each program's end time."""
    token = grid_dependency.launch_dependents(0) if early else jnp.int32(0)
    start = read("timer", token)
    end = jax.lax.while_loop(lambda t: t - start < busy_ns, lambda t: read("timer", t), start)
    out_ref[pl.ds(pl.program_id(0), 1)] = jnp.full((1,), end, jnp.int32)


def _probe_kernel(before_ref, starts_ref, released_ref, sms_ref):
    """Each program: the timer and its SM first, then the wait, then the timer again ([P] int32 each). `before_ref`
    (the busy kernel's output) is only an operand, so XLA orders the two."""
    del before_ref
    pid = pl.program_id(0)
    start = read("timer", 0)
    sm = read("sm", start)
    released = read("timer", grid_dependency.wait(sm))
    for ref, value in ((starts_ref, start), (sms_ref, sm), (released_ref, released)):
        ref[pl.ds(pid, 1)] = jnp.full((1,), value, jnp.int32)


@functools.partial(jax.jit, static_argnames=("busy_ns", "early", "busy_programs", "busy_warps", "probe_programs"))
def busy_then_probe(*, busy_ns: int, early: bool, busy_programs: int, probe_programs: int, busy_warps: int = 4):
    """(busy ends [Pb], probe starts [Pp], probe releases [Pp], probe SMs [Pp]): int32 timer values and SM ids."""
    ints = lambda n: jax.ShapeDtypeStruct((n,), jnp.int32)
    ends = pl.pallas_call(functools.partial(_busy_kernel, busy_ns=busy_ns, early=early), out_shape=ints(busy_programs),
                          grid=(busy_programs,), compiler_params=tiles.compiler_params(busy_warps, 1),
                          name="pdl_busy")()
    probe = pl.pallas_call(_probe_kernel, out_shape=[ints(probe_programs)] * 3, grid=(probe_programs,),
                           compiler_params=tiles.compiler_params(1, 1), name="pdl_probe")(ends)
    return (ends, *probe)


def summary(ends, starts, released, sms) -> dict:
    """The figures of one run (int32 timer values in ns, SM ids): probe programs started before the busy kernel's
    last end, the median start and release relative to that end (us), SMs used, the most programs on one SM."""
    ends, starts, released = (np.asarray(a, np.int64) for a in (ends, starts, released))
    last_end = ends.max()
    relative = lambda t: ((t - last_end + 2 ** 31) % 2 ** 32 - 2 ** 31) / 1e3  # int32 wrap-safe, us
    counts = np.bincount(np.asarray(sms, np.int64))
    return {"started_before_busy_end": int((relative(starts) < 0).sum()), "programs": int(starts.size),
            "median_start_us": round(float(np.median(relative(starts))), 2),
            "median_release_us": round(float(np.median(relative(released))), 2),
            "sms_used": int((counts > 0).sum()), "most_on_one_sm": int(counts.max())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy-us", type=float, default=20.0)
    parser.add_argument("--busy-programs", type=int, default=528)
    parser.add_argument("--busy-warps", type=int, default=4)
    parser.add_argument("--probe-programs", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="runs per mode; the figures of the last")
    parser.add_argument("--results", default="benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu" or not _LOWERING:
        parser.error(f"needs an NVIDIA GPU with the Pallas Triton lowering (backend {jax.default_backend()})")
    environment = results.xla_environment()
    figures = {}
    for mode, early in (("not early", False), ("early", True)):
        for _ in range(args.repeats):
            out = jax.block_until_ready(busy_then_probe(busy_ns=int(args.busy_us * 1e3), early=early,
                                                        busy_programs=args.busy_programs, busy_warps=args.busy_warps,
                                                        probe_programs=args.probe_programs))
        figures[mode] = summary(*out)
        print(f"{mode}: {figures[mode]}")
    device = jax.devices()[0].device_kind
    results.append_line(args.results, (
        f"{results.line_head('pdl_placement.py', device, environment)}: a {args.busy_us:g} us busy kernel of "
        f"{args.busy_programs} programs of {args.busy_warps} warps, then a probe of {args.probe_programs} reading "
        f"the timer and its SM before its wait: {json.dumps(figures)}\n"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
