"""Whether the code XLA compiles for a Pallas (Triton) kernel carries programmatic-launch instructions of XLA's own.

    python3 benchmarks/pdl_ptx_check.py [--launch off|trigger_first|wait_first|trigger_last] [--keep FOLDER]

Compiles one small Pallas kernel between two XLA ops with `--xla_dump_to` (HLO, LLVM IR, PTX) and counts
`griddepcontrol.wait` and `griddepcontrol.launch_dependents` in every dumped file that holds either. With `--launch
off` (`kernels.tiles.PROGRAMMATIC_LAUNCH`) our kernel carries neither, so a wait found then is XLA's: the thirtieth
session read in XLA's sources that it puts one at the start of every Triton kernel it launches as a programmatic
dependent (benchmarks/NOTES_serving.md), never checked on the compiled code. If XLA's wait is there, a kernel cannot
start its weight stream before the kernel ahead of it ends, whatever it does itself; if not, a wait placed after
the weights' first loads is the variant to try. Needs an sm_90+ NVIDIA GPU; prints one line per file and the
totals, and exits 1 where nothing was dumped.

The counts say something only where the dump holds the probe kernel's compiled code (`compiled_files`: PTX or LLVM
IR naming the kernel). On an H100 with jax 0.11.2 (2026-12-07) it did not: 108 files, the instructions of
`--launch trigger_last` found only in HLO and MLIR text (XLA seems to compile a Pallas call's Triton module apart
from the code it dumps). The script then says the check is inconclusive and exits 2.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile

INSTRUCTIONS = ("griddepcontrol.wait", "griddepcontrol.launch_dependents")


def dumped_texts(folder: str):
    """(path relative to `folder`, text) of every file under `folder`, in path order."""
    for path in sorted(glob.glob(os.path.join(folder, "**", "*"), recursive=True)):
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                yield os.path.relpath(path, folder), f.read()


def counts(texts: dict[str, str]) -> dict[str, dict[str, int]]:
    """{file name: {instruction: occurrences}} for the dumped files (`dumped_texts`) that hold any of
    `INSTRUCTIONS`."""
    found = {}
    for name, text in texts.items():
        hits = {instruction: text.count(instruction) for instruction in INSTRUCTIONS}
        if any(hits.values()):
            found[name] = hits
    return found


def compiled_files(texts: dict[str, str], kernel: str) -> list[str]:
    """The dumped PTX / LLVM IR files (`dumped_texts`) whose text names `kernel`."""
    return [name for name, text in texts.items() if name.endswith((".ptx", ".ll")) and kernel in text]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launch", default="off", help="kernels.tiles.PROGRAMMATIC_LAUNCH for the probe kernel")
    parser.add_argument("--keep", help="dump into this folder (kept) instead of a temporary one")
    args = parser.parse_args(argv)
    folder = args.keep or os.path.join(tempfile.gettempdir(), f"dayzero_pdl_{os.getpid()}")  # XLA makes it
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={folder} --xla_dump_hlo_as_text"
                               " --xla_gpu_dump_llvmir").strip()
    import jax  # after XLA_FLAGS: read when the backend starts
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from dayzero.kernels import tiles

    if jax.default_backend() != "gpu":
        parser.error(f"needs a GPU (the backend is {jax.default_backend()})")
    if args.launch not in tiles.LAUNCH_ORDERS:
        parser.error(f"--launch must be one of {tiles.LAUNCH_ORDERS}")
    tiles.PROGRAMMATIC_LAUNCH = args.launch

    def doubled(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2

    def probe(x):
        y = tiles.pallas_call(doubled, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
                              in_specs=[pl.BlockSpec((64,), lambda i: (i,))],
                              out_specs=pl.BlockSpec((64,), lambda i: (i,)), name="pdl_probe")(jnp.sin(x))
        return y + 1

    out = jax.jit(probe)(jnp.arange(128, dtype=jnp.float32))
    expected = jnp.sin(jnp.arange(128, dtype=jnp.float32)) * 2 + 1
    if not bool(jnp.allclose(out, expected)):
        print("the probe computed wrong values")
        return 1
    texts = dict(dumped_texts(folder))
    dumped = len(texts)
    found = counts(texts)
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, PROGRAMMATIC_LAUNCH={args.launch!r}: "
          f"{dumped} files dumped into {folder}")
    for name, hits in found.items():
        print(f"  {name}: " + ", ".join(f"{k} x{v}" for k, v in hits.items()))
    totals = {name: sum(h[name] for h in found.values()) for name in INSTRUCTIONS}
    print("totals: " + ", ".join(f"{k} x{v}" for k, v in totals.items()))
    if not dumped:
        return 1
    code = compiled_files(texts, "pdl_probe")
    if not code:
        print("inconclusive: no dumped PTX or LLVM IR holds the probe kernel's code, so a wait of XLA's own would not "
              "show in these counts")
        return 2
    print("the probe kernel's compiled code: " + ", ".join(code))
    return 0


if __name__ == "__main__":
    sys.exit(main())
