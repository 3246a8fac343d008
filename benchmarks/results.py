"""What every benchmark script shares: the commit it measured and the dated line it appends to RESULTS.md."""

from __future__ import annotations

import subprocess


def git_commit() -> str:
    """Short hash of HEAD ("unknown" outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def append_line(path: str, line: str) -> None:
    """Appends one result line (newline-terminated) to `path` and prints it."""
    with open(path, "a") as f:
        f.write(line)
    print(line)
