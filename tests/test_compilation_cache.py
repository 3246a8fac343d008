"""The tools' persistent compilation cache: a second `dayzero-generate` reads back every function the first wrote;
`--no-compilation-cache` and an unusable directory leave it off."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import jax
import pytest

from dayzero.platforms import compilation_cache

_SUMMARY = re.compile(r"compilation cache: (.+): (\d+) compilations read back, (\d+) written")


def generate(cache_dir, *extra) -> str:
    """`dayzero-generate` on the embedded preset in a fresh process, with the cache on; its printed output."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_COMPILATION_CACHE"}  # conftest turns it off
    done = subprocess.run([sys.executable, "-c", "import sys; from dayzero.serving.cli import main; "
                           "sys.exit(main(sys.argv[1:]))", "--num-prompts", "2", "--max-tokens", "2",
                           "--output", os.devnull, "--no-progress", "--compilation-cache", str(cache_dir), *extra],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_second_run_reads_back_what_the_first_wrote(tmp_path):
    cache_dir = tmp_path / "xla"
    first = _SUMMARY.search(generate(cache_dir))
    assert first is not None and first.group(1) == str(cache_dir)
    read, written = int(first.group(2)), int(first.group(3))  # read: a program compiled twice in the run
    assert written > 0 and len(os.listdir(cache_dir)) >= written
    second = _SUMMARY.search(generate(cache_dir))
    assert second is not None and (int(second.group(2)), int(second.group(3))) == (read + written, 0)


def test_no_compilation_cache_writes_nothing(tmp_path):
    args = argparse.Namespace(no_compilation_cache=True, compilation_cache=str(tmp_path / "xla"))
    assert compilation_cache.from_cli_args(args) is None
    assert not (tmp_path / "xla").exists()


def test_directory_that_cannot_be_made_leaves_it_off(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    before = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", True)
    try:
        with pytest.warns(UserWarning, match="cannot create"):
            assert compilation_cache.enable(blocker / "xla") is None
        assert jax.config.jax_compilation_cache_dir == before[0]
    finally:
        jax.config.update("jax_enable_compilation_cache", before[1])


def test_default_directory_per_host_under_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = compilation_cache.default_directory()
    assert path.parent == tmp_path / "dayzero" / "xla" and re.fullmatch(r"[0-9a-f]{12}", path.name)
    assert path.name == compilation_cache.host_fingerprint()
