"""Platforms: kernel dispatch per platform and kernel (vendor policy, ROCm declarations, overrides), the PJRT plugin
path's errors, the command-line options and the `platform=` library argument. All on the CPU; the steps that would
register a plugin with JAX run in a subprocess."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from types import MappingProxyType

import jax
import jax.numpy as jnp
import pytest

from dayzero import platforms
from dayzero.kernels import dispatch
from dayzero.kernels import kda as kda_ops
from dayzero.kernels.kda import pallas as kda_pallas
from dayzero.kernels.kda import reference as kda_reference
from dayzero.model import Model, load_checkpoint
from dayzero.model import model as model_lib
from dayzero.model.presets import tiny
from dayzero.platforms import PlatformConfig, PlatformError
from dayzero.serving import Engine
from dayzero.serving import runner as runner_lib

BOTH = ("reference", "pallas")
VENDOR_POLICY = {"musa": ["kda"]}  # what a vendor package's `dayzero.kernel_platforms` entry point would name

FAKE_PLUGIN_C = """
#include <stddef.h>
struct version { size_t struct_size; void* extension_start; int major; int minor; };
struct api { size_t struct_size; void* extension_start; struct version version; void* functions[256]; };
static struct api API = { sizeof(struct api), 0, { sizeof(struct version), 0, 999, 0 } };
const void* GetPjrtApi(void) { return &API; }
"""


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(dispatch.ENV_OVERRIDE, raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def fake_plugin(tmp_path_factory):
    """A shared library exporting GetPjrtApi whose PJRT API declares major version 999: it loads, and JAX then
    refuses it when it initialises the backend."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a stand-in PJRT plugin")
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "fake.c").write_text(FAKE_PLUGIN_C)
    library = folder / "libfake_pjrt.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(folder / "fake.c")], check=True)
    return str(library)


# ------------------------------------------------------------------------------------------------------ dispatch


def test_unknown_platform_runs_the_reference_and_cuda_the_verified_pallas(no_env):
    for kernel in dispatch.KERNELS:
        for platform in ("musa", "MUSA", "cpu", "tpu", "some_vendor"):
            assert dispatch.choose(kernel, BOTH, platform=platform) == "reference", (kernel, platform)
        assert dispatch.choose(kernel, BOTH, platform="cuda") == "pallas", kernel
        assert dispatch.choose(kernel, BOTH, platform="cuda", gpu_verified=False) == "reference", kernel
        assert dispatch.choose(kernel, ("reference",), platform="cuda") == "reference", kernel
    with pytest.raises(ValueError, match="unknown kernel 'nope'"):
        dispatch.choose("nope", BOTH, platform="cuda")


def test_compiler_options_are_per_platform_and_known_to_xla(no_env):
    assert dispatch.compiler_options("cpu") == {} and dispatch.compiler_options("musa") == {}
    gpu = dispatch.compiler_options("cuda")
    assert gpu == {"xla_disable_hlo_passes": "dot-strength-reduction"} == dispatch.compiler_options("rocm")
    x = jnp.arange(6.0).reshape(1, 6)
    # the option names exist in XLA's DebugOptions (which every backend parses; a misspelt one is refused)
    assert float(jax.jit(lambda a: a @ a.T, compiler_options=gpu)(x)[0, 0]) == 55.0
    with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option"):
        jax.jit(lambda a: a @ a.T, compiler_options={"xla_disable_hlo_passes_misspelt": "x"})(x)


def test_platform_jit_compiles_once_per_platform_in_use(no_env, monkeypatch):
    asked = []
    monkeypatch.setattr(dispatch, "compiler_options", lambda platform=None: asked.append(platform) or {})
    double = dispatch.PlatformJit(lambda x, n: x * n, static_argnums=(1,))
    with jax.default_device(jax.devices("cpu")[0]):
        assert float(double(jnp.float32(2), 3)) == 6.0
        assert float(double(jnp.float32(4), 3)) == 12.0
    assert asked == ["cpu"]


def test_rocm_runs_pallas_only_where_the_lowering_is_declared(no_env, monkeypatch):
    for kernel in dispatch.KERNELS:  # none declares ROCm support yet
        assert dispatch.choose(kernel, BOTH, platform="rocm") == "reference", kernel
    kernels = {k.name: k for k in (dispatch.Kernel("declared", rocm=True), dispatch.Kernel("undeclared"),
                                   dispatch.Kernel("mosaic", lowering="mosaic_gpu", rocm=True))}
    monkeypatch.setattr(dispatch, "KERNELS", MappingProxyType(kernels))
    assert dispatch.choose("declared", BOTH, platform="rocm") == "pallas"
    assert dispatch.choose("declared", BOTH, platform="rocm", gpu_verified=False) == "reference"
    assert dispatch.choose("undeclared", BOTH, platform="rocm") == "reference"
    assert dispatch.choose("mosaic", BOTH, platform="rocm") == "reference"  # Mosaic GPU is NVIDIA-only
    assert dispatch.choose("mosaic", BOTH, platform="cuda") == "pallas"
    with dispatch.use_policy({"musa": "*"}):  # a Triton stack cannot take a Mosaic kernel
        assert dispatch.choose("mosaic", BOTH, platform="musa") == "reference"
        assert dispatch.choose("undeclared", BOTH, platform="musa") == "pallas"
    with pytest.raises(ValueError):
        dispatch.Kernel("bad", lowering="cuda_c")


def test_vendor_policy_switches_one_kernel_on_for_its_platform(no_env):
    policy = dispatch.KernelPolicy.of({"MUSA": ["kda"]})
    assert policy.allows("musa", "kda") and not policy.allows("musa", "indexer") and not policy.allows("cpu", "kda")
    with dispatch.use_policy(policy):
        assert dispatch.choose("kda", BOTH, platform="musa") == "pallas"
        for kernel in set(dispatch.KERNELS) - {"kda"}:
            assert dispatch.choose(kernel, BOTH, platform="musa") == "reference", kernel
        assert dispatch.choose("kda", BOTH, platform="cpu") == "reference"
        assert dispatch.choose("kda", BOTH, platform="musa", impl="reference") == "reference"  # overrides win
        with dispatch.use_policy({"musa": ["moe_mxfp4"]}):  # nested policies add up
            assert dispatch.choose("moe_mxfp4", BOTH, platform="musa") == "pallas"
            assert dispatch.choose("kda", BOTH, platform="musa") == "pallas"
        assert dispatch.choose("moe_mxfp4", BOTH, platform="musa") == "reference"
        no_env.setenv(dispatch.ENV_OVERRIDE, "interpret")
        assert dispatch.choose("indexer", BOTH, platform="musa") == "interpret"
        no_env.delenv(dispatch.ENV_OVERRIDE)
    assert dispatch.choose("kda", BOTH, platform="musa") == "reference"  # only inside the block
    with dispatch.use_policy({"gpu": ["indexer"]}):  # a policy for JAX's "gpu" alias covers CUDA
        assert dispatch.choose("indexer", BOTH, platform="cuda", gpu_verified=False) == "pallas"
    with pytest.raises(ValueError, match="unknown kernel 'kdaa'"):
        dispatch.KernelPolicy.of({"musa": ["kdaa"]})


def test_policy_from_entry_points(no_env, monkeypatch):
    group = dispatch.ENTRY_POINT_GROUP
    good = importlib.metadata.EntryPoint("vendor", f"{__name__}:VENDOR_POLICY", group)
    broken = importlib.metadata.EntryPoint("broken", "no_such_vendor_module:POLICY", group)
    found = {"points": [good]}
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: found["points"] if group == dispatch.ENTRY_POINT_GROUP else [])
    dispatch.discovered_policy.cache_clear()
    try:
        assert dispatch.discovered_policy().allows("musa", "kda")
        assert dispatch.choose("kda", BOTH, platform="musa") == "pallas"
        assert dispatch.choose("indexer", BOTH, platform="musa") == "reference"
        found["points"] = [good, broken]
        dispatch.discovered_policy.cache_clear()
        with pytest.raises(ValueError, match="entry point 'broken'"):
            dispatch.choose("kda", BOTH, platform="musa")
    finally:
        dispatch.discovered_policy.cache_clear()
    monkeypatch.undo()
    assert dispatch.choose("kda", BOTH, platform="musa") == "reference"


def test_platform_of_the_devices_in_use(no_env, monkeypatch):
    """default_device in effect, else the mesh set with jax.set_mesh (also while tracing), else the backend."""
    monkeypatch.setattr(jax, "default_backend", lambda: "musa")
    assert dispatch.current_platform() == "musa"
    with jax.default_device("gpu"):
        assert dispatch.current_platform() == "gpu"
    with jax.set_mesh(jax.make_mesh((1,), ("x",), devices=jax.devices("cpu")[:1])):
        assert dispatch.current_platform() == "cpu"
        seen = []
        jax.jit(lambda x: seen.append(dispatch.current_platform()) or x)(jnp.ones(2))
        assert seen == ["cpu"]
    with dispatch.use_policy({"musa": ["kda"]}):
        assert dispatch.choose("kda") == "pallas"
        with jax.default_device(jax.devices("cpu")[0]):
            assert dispatch.choose("kda") == "reference"


def test_activate_reaches_dispatch_at_trace_time(no_env, monkeypatch):
    """A KDA call traced under a placement whose policy switches "kda" on takes the Pallas implementation; traced
    outside it, the reference."""
    calls, original = [], kda_reference.chunk_kda

    def spy(name):
        def run(*args, interpret=None, **kwargs):
            calls.append((name, interpret))
            return original(*args, **kwargs)
        return run

    monkeypatch.setattr(kda_pallas, "chunk_kda", spy("pallas"))
    monkeypatch.setattr(kda_reference, "chunk_kda", spy("reference"))
    qkv = jax.ShapeDtypeStruct((1, 5, 1, 16), jnp.float32)
    beta = jax.ShapeDtypeStruct((1, 5, 1), jnp.float32)
    fn = lambda *a: kda_ops.chunk_kda(*a)[0]  # noqa: E731
    placement = platforms.Placement(jax.devices("cpu")[0],
                                    PlatformConfig("cpu", pallas_kernels=("kda",)).kernel_policy())
    with platforms.activate(placement):
        jax.eval_shape(fn, qkv, qkv, qkv, qkv, beta)  # traces (dispatch decides here) without compiling
    jax.eval_shape(fn, qkv, qkv, qkv, qkv, beta)
    assert calls[0] == ("pallas", False) and calls[-1] == ("reference", None), calls


# --------------------------------------------------------------------------------------------- the plugin path


def test_missing_plugin_library_is_a_clear_error():
    before = os.environ.get(platforms.PLUGIN_ENV)
    missing = "/nonexistent/dayzero/libpjrt_musa.so"
    with pytest.raises(PlatformError, match=f"{missing}: no such file"):
        platforms.init_platform(PlatformConfig(platform="musa", pjrt_plugin=missing))
    assert os.environ.get(platforms.PLUGIN_ENV) == before
    assert jax.devices("cpu")  # the process's backends are untouched


def test_a_file_that_is_not_a_shared_library_is_a_clear_error(tmp_path):
    bogus = tmp_path / "libpjrt_musa.so"
    bogus.write_text("not an ELF file")
    with pytest.raises(PlatformError, match=f"{bogus} does not load"):
        platforms.init_platform(PlatformConfig(platform="musa", pjrt_plugin=str(bogus)))
    config = tmp_path / "musa.json"
    config.write_text(json.dumps({"library_path": str(tmp_path / "gone.so")}))
    with pytest.raises(PlatformError, match="gone.so: no such file"):
        platforms.init_platform(PlatformConfig(plugin_name="musa", pjrt_plugin=str(config)))
    with pytest.raises(PlatformError, match="give plugin_name"):
        PlatformConfig(pjrt_plugin=str(bogus))


def test_a_library_without_the_pjrt_entry_point_is_a_clear_error(tmp_path, fake_plugin):
    other = tmp_path / "libother.so"
    (tmp_path / "other.c").write_text("int not_pjrt(void) { return 1; }\n")
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-o", str(other), str(tmp_path / "other.c")],
                   check=True)
    with pytest.raises(PlatformError, match=f"{other} loads but does not export GetPjrtApi"):
        platforms.init_platform(PlatformConfig(platform="musa", pjrt_plugin=str(other)))


def test_registering_after_the_backends_started_says_so(fake_plugin):
    jax.devices()  # this process's backends are initialised
    assert platforms.backends_initialized() is True
    before = os.environ.get(platforms.PLUGIN_ENV)
    with pytest.raises(PlatformError, match="already initialised"):
        platforms.init_platform(PlatformConfig(platform="musa", pjrt_plugin=fake_plugin))
    assert os.environ.get(platforms.PLUGIN_ENV) == before


def test_unavailable_platform_names_it_and_the_available_ones():
    with pytest.raises(PlatformError, match=r"platform 'musa' is not available: .*Available platforms: \[.*'cpu'"):
        platforms.init_platform("musa")
    assert platforms.init_platform("cpu") == jax.devices("cpu")


def test_plugin_registration_in_a_fresh_process(fake_plugin):
    """Before any JAX use, init_platform registers the library with JAX; JAX loads it when it initialises the
    backend, and its refusal comes back as a PlatformError naming the platform and the library."""
    script = textwrap.dedent(f"""
        from dayzero.platforms import PLUGIN_ENV, PlatformConfig, PlatformError, backends_initialized, init_platform
        import os
        assert backends_initialized() is False
        try:
            init_platform(PlatformConfig(platform="musa", pjrt_plugin={fake_plugin!r}))
        except PlatformError as e:
            print("ENV", os.environ[PLUGIN_ENV])
            print("ERROR", e)
    """)
    env = {k: v for k, v in os.environ.items() if k not in (platforms.PLUGIN_ENV, "JAX_PLATFORMS")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"ENV musa:{fake_plugin}" in done.stdout, done.stdout
    error = done.stdout.split("ERROR", 1)[1]
    assert "platform 'musa'" in error and fake_plugin in error and "major version" in error, error


# ------------------------------------------------------------------------------ command line and library argument


def test_cli_options_parse_into_a_platform_config():
    import argparse

    parser = argparse.ArgumentParser()
    platforms.add_cli_options(parser)
    assert platforms.from_cli_args(parser.parse_args([])) is None
    args = parser.parse_args(["--platform", "musa", "--pjrt-plugin", "/opt/musa/libpjrt_musa.so", "--plugin-name",
                              "musa_pjrt", "--pallas-kernels", "kda, moe_mxfp4"])
    config = platforms.from_cli_args(args)
    assert config == PlatformConfig(platform="musa", pjrt_plugin="/opt/musa/libpjrt_musa.so",
                                    plugin_name="musa_pjrt", pallas_kernels=("kda", "moe_mxfp4"))
    assert config.kernel_policy().allows("musa", "moe_mxfp4") and not config.kernel_policy().allows("musa", "indexer")
    with pytest.raises(PlatformError, match="unknown kernel 'flash'"):
        platforms.from_cli_args(parser.parse_args(["--platform", "musa", "--pallas-kernels", "flash"]))


@pytest.fixture
def cheap_random_params(monkeypatch):
    """Model.random draws one small array instead of the preset's params (compiling every random draw on a cold
    CPU takes tens of seconds); the placement wiring around it is unchanged."""
    monkeypatch.setattr(model_lib, "random_params", lambda config, dtype, seed: {"w": jnp.zeros((2, 2), dtype)})


def test_every_model_tool_takes_the_platform_options(tmp_path, monkeypatch, capsys, cheap_random_params):
    from dayzero.model import cli as model_cli
    from dayzero.model import compare, drift
    from dayzero.serving import cli as serving_cli

    assert serving_cli.main(["--platform", "musa", "--output", str(tmp_path / "out.jsonl")]) == 2
    assert "platform 'musa'" in capsys.readouterr().err
    assert model_cli.forward_main(["--platform", "musa"]) == 2
    assert "Available platforms: [" in capsys.readouterr().err
    assert model_cli.forward_main(["--platform", "cpu", "--new-tokens", "0"]) == 0
    assert "on cpu;" in capsys.readouterr().out

    seen = {}

    def compare_checkpoint(path, ids, dtype, rtol, platform):
        seen["compare"] = platform
        return compare.Comparison((), None, rtol)

    def drift_report(original, mxfp4_dir, ids, dtype, execution, platform):
        seen["drift"] = platform
        return types.SimpleNamespace(format=lambda: "drift report")

    monkeypatch.setattr(compare.ModelConfig, "from_pretrained", staticmethod(lambda path: tiny()))
    monkeypatch.setattr(compare, "compare_checkpoint", compare_checkpoint)
    monkeypatch.setattr(drift, "drift_report", drift_report)
    argv = ["--model", str(tmp_path), "--platform", "cpu", "--pallas-kernels", "kda"]
    assert drift.main(argv + ["--mxfp4", str(tmp_path)]) == 0
    assert compare.main(argv) == 0
    expected = PlatformConfig(platform="cpu", pallas_kernels=("kda",))
    assert seen == {"compare": expected, "drift": expected}


def test_platform_argument_of_load_checkpoint_and_the_engine(tmp_path, no_env, monkeypatch, cheap_random_params):
    for load in (load_checkpoint, Engine.from_checkpoint):  # the platform is initialised before anything is read
        with pytest.raises(PlatformError, match="platform 'musa'"):
            load(tmp_path, platform="musa")
    model = Model.random(tiny(), platform=PlatformConfig("cpu", pallas_kernels=("kda",)))
    cpu = jax.devices("cpu")[0]
    assert model.placement.device == cpu and model.placement.kernels.allows("cpu", "kda")
    assert {d for leaf in jax.tree_util.tree_leaves(model.params) for d in leaf.devices()} == {cpu}
    assert model._run(lambda: (dispatch.choose("kda"), dispatch.choose("indexer"))) == ("pallas", "reference")
    assert Model(model.config, model.params, model.dtype).placement == platforms.Placement(cpu)

    engine = Engine(model, None, None)
    seen = []

    def step(module, params, cache, arrays, layout, decode):
        rows = runner_lib.unpack_rows(arrays, layout)
        seen.append((dispatch.choose("kda"), arrays["packed"].devices(), rows["positions"].devices()))
        return jnp.zeros(rows["tokens"].shape[0], jnp.int32), jnp.zeros(rows["tokens"].shape[0]), cache

    monkeypatch.setattr(runner_lib, "_STEP", step)
    engine.runner.dispatch(runner_lib.StepRows.padding(1, 1, 1), decode=False)
    assert seen == [("pallas", {cpu}, {cpu})]
