"""What every benchmark script shares: the commit it measured and the dated line it appends to RESULTS.md."""

from __future__ import annotations

import subprocess


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


def append_line(path: str, line: str) -> None:
    """Appends one result line (newline-terminated) to `path` and prints it."""
    with open(path, "a") as f:
        f.write(line)
    print(line)
