"""What every benchmark script shares: the commit it measured and the dated line it appends to RESULTS.md."""

from __future__ import annotations

import os
import subprocess

# Environment variables that change how XLA compiles or runs what a benchmark measures (read when the client starts).
XLA_ENVIRONMENT = ("XLA_FLAGS", "XLA_PYTHON_CLIENT_ALLOCATOR", "XLA_PYTHON_CLIENT_PREALLOCATE",
                   "XLA_PYTHON_CLIENT_MEM_FRACTION")


def git_commit() -> str:
    """Short hash of HEAD, with "+modified" when tracked files differ from it ("unknown" outside a git checkout).

    A copied working tree can carry older git metadata than its files (the device tool's copies do): "+modified"
    then says that the hash alone does not name what was measured."""
    try:
        run = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout
        head = run("rev-parse", "--short", "HEAD").strip()
        return head + ("+modified" if run("status", "--porcelain", "--untracked-files=no").strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def xla_environment() -> str:
    """The `XLA_ENVIRONMENT` variables set in this process, as "NAME='value', ..." ("none" when none is): call it
    before the script adds its own (a dump folder) so the results line names what the run was given."""
    given = [f"{name}={os.environ[name]!r}" for name in XLA_ENVIRONMENT if os.environ.get(name)]
    return ", ".join(given) or "none"


def line_head(script: str, device_kind: str, environment: str) -> str:
    """The start every result line shares: "- DATE SCRIPT, DEVICE, commit C, jax V, XLA environment E"
    (`environment` as `xla_environment` gave it before the script set its own)."""
    import datetime

    import jax

    return (f"- {datetime.date.today()} {script}, {device_kind}, commit {git_commit()}, jax {jax.__version__}, "
            f"XLA environment {environment}")


def chosen_modes(text: str, known: tuple[str, ...]) -> list[str]:
    """A benchmark's comma-separated `--modes` -> the list; exits naming the unknown ones."""
    modes = text.split(",")
    if unknown := sorted(set(modes) - set(known)):
        raise SystemExit(f"--modes: unknown {unknown} (known: {', '.join(known)})")
    return modes


def append_line(path: str, line: str) -> None:
    """Appends one result line (newline-terminated) to `path` and prints it."""
    with open(path, "a") as f:
        f.write(line)
    print(line)
