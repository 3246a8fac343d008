"""JAX's persistent compilation cache for dayzero's tools: compiled functions kept on disk, reused by later runs.

JAX keys each entry by the compiled program, its compile options, the backend and the jax / jaxlib versions, so a
changed model, kernel choice or XLA option compiles anew and a stale entry is never used. The tools
(`dayzero-generate`, `dayzero-forward`, ...) turn it on by default in `default_directory()`; `--compilation-cache
DIR` moves it, `--no-compilation-cache` (or JAX's own `JAX_ENABLE_COMPILATION_CACHE=false`) leaves it off. A library
user calls `enable()` once, before the first compilation it should cover:

    from dayzero.platforms import compilation_cache
    compilation_cache.enable()                 # or enable("/scratch/xla-cache")

On this project's 2-core CPU, the README's first command took 24 s on an empty cache and 7.4 s on the second run.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import os
import platform
import warnings
from collections.abc import Iterator
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

# Every compilation kept, however short (JAX's default keeps those of 1 s or more): on the 2-core CPU the README's
# first command's second run took 7.4 s with this against 12.3 s with JAX's threshold (82 entries, 2.3 MB, against 7).
MIN_COMPILE_SECONDS = 0.0
# The directory's size at most: past it the least recently used entries go (JAX's default is no limit, and every
# model, kernel choice and XLA option tried adds entries).
MAX_BYTES = 8 << 30
_JAX_MIN_COMPILE_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
_JAX_MAX_SIZE_ENV = "JAX_COMPILATION_CACHE_MAX_SIZE"
# jax.monitoring events of the persistent cache (jax 0.10 and 0.11 alike)
_HIT = "/jax/compilation_cache/cache_hits"
_WRITTEN = "/jax/compilation_cache/cache_misses"  # recorded as a missed entry is written


def host_fingerprint() -> str:
    """12 hex digits naming this host's CPU (model and instruction-set flags). JAX's key names the backend and
    device kind but not the host CPU's features, and XLA:CPU executables are machine code for them: hosts sharing
    a home directory (a cluster's) keep apart caches."""
    described = [platform.machine(), platform.processor()]
    try:
        with open("/proc/cpuinfo") as f:
            described += sorted({line.strip() for line in f if line.startswith(("model name", "flags", "Features"))})
    except OSError:
        pass
    return hashlib.sha256("\n".join(described).encode()).hexdigest()[:12]


def default_directory() -> Path:
    """$XDG_CACHE_HOME/dayzero/xla/<host_fingerprint()>, or ~/.cache/dayzero/xla/<host_fingerprint()>."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "dayzero" / "xla" / host_fingerprint()


def enable(directory: str | os.PathLike | None = None, min_compile_seconds: float = MIN_COMPILE_SECONDS,
           max_bytes: int = MAX_BYTES) -> Path | None:
    """Keeps every compilation of this process that takes at least `min_compile_seconds` in `directory` (default:
    the directory JAX is already configured with, else `default_directory()`), least recently used entries dropped
    past `max_bytes`, and reads them back there; JAX's own JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS and
    JAX_COMPILATION_CACHE_MAX_SIZE, where set, decide instead. Returns the directory, or None where the cache stays
    off: JAX's `jax_enable_compilation_cache` is False, or the directory cannot be created (a warning says why; the
    run goes on compiling as before)."""
    if not jax.config.jax_enable_compilation_cache:
        return None
    path = Path(directory or jax.config.jax_compilation_cache_dir or default_directory()).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        warnings.warn(f"compilation cache off: cannot create {path}: {e}", stacklevel=2)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    if _JAX_MIN_COMPILE_ENV not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    if _JAX_MAX_SIZE_ENV not in os.environ and importlib.util.find_spec("filelock") is not None:  # JAX evicts under it
        jax.config.update("jax_compilation_cache_max_size", max_bytes)
    jax_cache.reset_cache()  # takes effect even if this process has compiled before
    return path


def add_cli_options(parser: argparse.ArgumentParser) -> None:
    """Adds --compilation-cache DIR and --no-compilation-cache to a command-line tool."""
    group = parser.add_argument_group("compilation cache")
    group.add_argument("--compilation-cache", metavar="DIR",
                       help=f"keep compiled functions in DIR and reuse them in later runs (default: "
                            f"{default_directory()})")
    group.add_argument("--no-compilation-cache", action="store_true",
                       help="compile everything anew and write nothing to disk")


def from_cli_args(args: argparse.Namespace) -> Path | None:
    """Turns the cache on as the options of `add_cli_options` ask (on unless --no-compilation-cache); returns its
    directory, or None where it is off. Call it before anything compiles."""
    if getattr(args, "no_compilation_cache", False):
        return None
    return enable(getattr(args, "compilation_cache", None))


class CacheUse:
    """What `counting()` saw: `hits`, compilations read back from the persistent cache; `written`, compilations
    made and stored in it (those under the minimum compile time are neither)."""

    def __init__(self):
        self.hits = 0
        self.written = 0

    def __call__(self, event: str, **kwargs) -> None:
        if event == _HIT:
            self.hits += 1
        elif event == _WRITTEN:
            self.written += 1


@contextlib.contextmanager
def counting() -> Iterator[CacheUse]:
    """Within: counts the persistent cache's hits and writes in this process (a `CacheUse` that fills as they
    happen; both stay 0 with the cache off)."""
    use = CacheUse()
    jax.monitoring.register_event_listener(use)
    try:
        yield use
    finally:
        jax.monitoring.unregister_event_listener(use)


__all__ = ["host_fingerprint", "default_directory", "enable", "add_cli_options", "from_cli_args", "CacheUse",
           "counting"]
