"""Shared fixtures: tiny random checkpoints (see tiny_checkpoints.py) and fresh random token ids."""

from __future__ import annotations

import os

# On CPU-only machines (CI), XLA at optimization level 0 compiles the many small test programs in about a third less
# CPU time; set before anything imports jax. No fast-math at either level, so results agree to rounding (FMA
# contraction at most). GPU hosts (tests/gpu) keep the default optimization.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "") and not os.path.exists("/dev/nvidiactl"):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

# The command-line tools turn JAX's persistent compilation cache on (in ~/.cache by default); the tests that call
# them in this process must not write there. tests/test_compilation_cache.py runs the tools with it on, apart.
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

import gc  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest

from tiny_checkpoints import BUILDERS, SEQ_LEN, build_hf_model, build_kimi_k25, save_hf_model, save_kimi_k25


# Memory mappings per process past which a module's end drops JAX's compiled programs (the kernel's limit,
# vm.max_map_count, is 65530 by default). One module may add ~31K (a worker went from 5.3K to 35.9K in one, on 2
# workers, 2026-12-06), so the worst case here stays near 46K.
MAPPINGS_BEFORE_CLEARING = 15000


def _mappings() -> int | None:
    """This process's memory mappings (lines of /proc/self/maps), or None where that file does not exist."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After a test module, drop JAX's compiled programs once the process holds MAPPINGS_BEFORE_CLEARING memory
    mappings (always where they cannot be counted). Every XLA:CPU executable keeps its JIT code in its own memory
    mappings, and a worker that compiles a few thousand test programs reaches the kernel's limit on mappings per
    process (vm.max_map_count, 65530 by default): XLA's next compilation then segfaults or aborts (a pytest-xdist
    worker crash in an unrelated test late in the run). Measured on 2 workers: one reached ~61.5K mappings by the end
    of the suite without clearing. Clearing after every module instead made the next modules compile again the
    small programs they share (eager ops of the same shapes): ~10% more compilations."""
    yield
    mappings = _mappings()
    if mappings is None or mappings > MAPPINGS_BEFORE_CLEARING:
        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """{kind: directory} of fp32 tiny checkpoints saved by transformers."""
    root = tmp_path_factory.mktemp("ckpt")
    return {kind: save_hf_model(build_hf_model(kind), root / kind) for kind in BUILDERS}


@pytest.fixture
def token_ids():
    """(ids [2, SEQ_LEN], the seed they were drawn from); DAYZERO_TEST_SEED=<n> replays one."""
    env = os.environ.get("DAYZERO_TEST_SEED")
    seed = int(env) if env else int(np.random.default_rng().integers(1 << 31))
    rng = np.random.default_rng(seed)
    return rng.integers(3, 197, (2, SEQ_LEN)), seed


@pytest.fixture
def seed(request):
    """A fresh random seed per test, printed; DAYZERO_TEST_SEED=<n> replays one."""
    env = os.environ.get("DAYZERO_TEST_SEED")
    value = int(env) if env else int(np.random.SeedSequence().entropy % (2**32))
    print(f"{request.node.nodeid}: seed={value} (replay with DAYZERO_TEST_SEED={value})")
    return value


@pytest.fixture(scope="session")
def kimi_k25(tmp_path_factory):
    """(directory, transformers model) of a tiny fp32 kimi_k25 checkpoint under the published tensor names, with
    fresh random weights each session (DAYZERO_TEST_SEED=<n> replays one); image features and attention outputs
    amplified so that images steer the random model's logits."""
    env = os.environ.get("DAYZERO_TEST_SEED")
    value = int(env) if env else int(np.random.SeedSequence().entropy % (2**31))
    print(f"kimi_k25 weights: seed={value} (replay with DAYZERO_TEST_SEED={value})")
    model = build_kimi_k25(seed=value, feature_gain=20.0, attention_gain=10.0)
    return save_kimi_k25(model, tmp_path_factory.mktemp("ckpt") / "kimi_k25"), model


@pytest.fixture
def in_out_layout(monkeypatch):
    """The attention projections stored [in, out] (`model.linear.WEIGHT_ROWS` off), for a test that names that
    layout (its "kernel" params, o_proj's partial sums, the FP8 projections dequantized on the device)."""
    from dayzero.model import linear

    monkeypatch.setattr(linear, "WEIGHT_ROWS", False)
