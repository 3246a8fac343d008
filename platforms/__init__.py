"""dayzero.platforms: pointing JAX, and dayzero's kernel dispatch, at a platform, a vendor PJRT plugin included.

    devices = init_platform(PlatformConfig(platform="musa", pjrt_plugin="/opt/musa/lib/libpjrt_musa.so"))
    model = load_checkpoint(path, platform=PlatformConfig(platform="musa", pallas_kernels=("kda",)))

A PJRT plugin reaches JAX in one of two ways. A vendor package may declare it itself: a module under the
`jax_plugins` namespace package, or an entry point in the `jax_plugins` group, whose `initialize()` registers the
library; JAX imports those when it initialises its backends, and only `platform=` is needed here. Or a library path:
`init_platform` checks the file (it exists, loads, exports `GetPjrtApi`) and adds it to JAX's
`PJRT_NAMES_AND_LIBRARY_PATHS` (`name:path`, JAX's public route for plugin libraries), which JAX reads when it
initialises its backends. JAX initialises them once per process, at the first `jax.devices()` or array: register the
plugin before anything uses JAX (the command-line tools do it before loading the model).

`Placement` (a device and an optional kernel policy) is what a `Model` runs under: `activate(placement)` makes that
device the one in use (`jax.default_device`), so `dayzero.kernels.dispatch` picks that platform's implementations
while tracing, and adds `PlatformConfig.pallas_kernels` to the dispatch policy. See docs/PLATFORMS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import jax

from dayzero.kernels import dispatch
from dayzero.model.errors import DayzeroError
from dayzero.platforms import compilation_cache

PLUGIN_ENV = "PJRT_NAMES_AND_LIBRARY_PATHS"
PJRT_ENTRY_SYMBOL = "GetPjrtApi"
T = TypeVar("T")


class PlatformError(DayzeroError, RuntimeError):
    """A platform cannot be used: its PJRT plugin library is missing or does not load, the platform is not among
    JAX's backends, JAX's backends were initialised before the plugin could be registered, or the PlatformConfig
    is inconsistent (e.g. an unknown kernel in pallas_kernels)."""


@dataclass(frozen=True)
class PlatformConfig:
    """Which platform to run on and how to reach it.

    platform: JAX's name for it ("cpu", "cuda", "rocm", "gpu", or a plugin's name such as "musa"); default: the
        plugin's name, else JAX's default backend.
    pjrt_plugin: path of a PJRT plugin library (.so), or of a JSON plugin config (`library_path`, optional
        `create_options`), to register under `plugin_name`.
    plugin_name: the backend name to register the library as (default: `platform`).
    pallas_kernels: kernels (names in `dayzero.kernels.dispatch.KERNELS`, or "*") switched on to run their Pallas
        (Triton-lowered) implementation on this platform: a vendor Triton stack such as Triton-MUSA.
    exclusive: initialise only this platform and the CPU (sets JAX's `jax_platforms`; needs the backends not yet
        initialised).
    """

    platform: str | None = None
    pjrt_plugin: str | None = None
    plugin_name: str | None = None
    pallas_kernels: tuple[str, ...] = ()
    exclusive: bool = False

    def __post_init__(self):
        kernels = self.pallas_kernels
        object.__setattr__(self, "pallas_kernels", (kernels,) if isinstance(kernels, str) else tuple(kernels))
        if self.pjrt_plugin is not None and self.name is None:
            raise PlatformError(f"PJRT plugin {self.pjrt_plugin}: give plugin_name (or platform) to register it as")
        if self.pallas_kernels and self.name is None:
            raise PlatformError(f"pallas_kernels {list(self.pallas_kernels)} need a platform to apply to")
        if self.exclusive and self.name is None:
            raise PlatformError("exclusive needs a platform")
        for kernel in self.pallas_kernels:
            if kernel != dispatch.ALL_KERNELS and kernel not in dispatch.KERNELS:
                raise PlatformError(f"pallas_kernels: unknown kernel '{kernel}'; known: {sorted(dispatch.KERNELS)}")

    @property
    def name(self) -> str | None:
        """The platform asked for: `platform`, else `plugin_name`."""
        return self.platform or self.plugin_name

    def kernel_policy(self, platform: str | None = None) -> dispatch.KernelPolicy | None:
        """`pallas_kernels` as a dispatch policy for `platform` (default: this config's), None when there are none."""
        if not self.pallas_kernels:
            return None
        return dispatch.KernelPolicy.of({platform or self.name: self.pallas_kernels})


def as_config(platform: PlatformConfig | str | None) -> PlatformConfig:
    """A PlatformConfig from a config, a platform name or None (JAX's default backend)."""
    if isinstance(platform, PlatformConfig):
        return platform
    if platform is None or isinstance(platform, str):
        return PlatformConfig(platform=platform or None)
    raise TypeError(f"platform must be a PlatformConfig or a platform name, got {type(platform).__name__}")


def backends_initialized() -> bool | None:
    """Whether JAX has initialised its backends in this process; None where this JAX does not tell (it has no public
    query: this reads `backends_are_initialized` from its bridge module when that exists)."""
    try:
        from jax._src import xla_bridge
    except ImportError:
        return None
    probe = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(probe()) if callable(probe) else None


def _library_path(plugin: str) -> str:
    """The plugin library a `pjrt_plugin` value names (a .so, or a JSON config's `library_path`), checked."""
    path = os.path.abspath(os.path.expanduser(plugin))
    if not os.path.exists(path):
        raise PlatformError(f"PJRT plugin library {path}: no such file")
    if not os.path.isfile(path):
        raise PlatformError(f"PJRT plugin library {path}: not a file")
    if path.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                library = json.load(f)["library_path"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise PlatformError(f"PJRT plugin config {path}: cannot read its library_path ({type(e).__name__}: "
                                f"{e})") from e
        _library_path(library)
        return path
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise PlatformError(f"PJRT plugin library {path} does not load: {e}") from e
    if not hasattr(lib, PJRT_ENTRY_SYMBOL):
        raise PlatformError(f"PJRT plugin library {path} loads but does not export {PJRT_ENTRY_SYMBOL}: it is not a "
                            "PJRT plugin")
    return path


def _register(name: str, plugin: str) -> str:
    """Adds `name:plugin` to PJRT_NAMES_AND_LIBRARY_PATHS (checked first); returns the library path."""
    path = _library_path(plugin)
    if "," in path or os.pathsep in path or "," in name or os.pathsep in name:
        raise PlatformError(f"PJRT plugin {name} at {path}: JAX's {PLUGIN_ENV} cannot hold a name or path with "
                            f"',' or '{os.pathsep}'")
    entries = [e for e in os.environ.get(PLUGIN_ENV, "").split(",") if e]
    registered = dict(e.split(os.pathsep, 1) for e in entries if os.pathsep in e)
    if registered.get(name) == path:
        return path
    if name in registered:
        raise PlatformError(f"PJRT plugin '{name}' is already set to {registered[name]} in {PLUGIN_ENV}; cannot "
                            f"register {path} under the same name")
    if backends_initialized():
        from jax.extend import backend

        if name in backend.backends():
            return path  # registered by other means (a jax_plugins package) before
        raise PlatformError(f"cannot register PJRT plugin '{name}' from {path}: JAX's backends are already "
                            f"initialised in this process ({sorted(backend.backends())}) and initialise only once. "
                            "Call init_platform (or pass --pjrt-plugin) before anything uses JAX.")
    os.environ[PLUGIN_ENV] = ",".join(entries + [f"{name}{os.pathsep}{path}"])
    return path


def _available() -> list[str]:
    from jax.extend import backend

    try:
        return sorted(backend.backends())
    except RuntimeError as e:
        return [f"(none: {e})"]


def init_platform(config: PlatformConfig | str | None = None) -> list[jax.Device]:
    """Registers the config's PJRT plugin (if any) before JAX initialises its backends, and returns the devices of
    the requested platform (JAX's default backend's when none is named).

    Raises PlatformError naming the library when the plugin file is missing, does not load or is not a PJRT plugin,
    or its backend fails to initialise; naming the platform and the available ones when it is not among JAX's
    backends; saying so when JAX's backends were initialised before the plugin could be registered.
    """
    config = as_config(config)
    name = config.name
    initialized = backends_initialized()
    library = _register(config.plugin_name or name, config.pjrt_plugin) if config.pjrt_plugin else None
    if config.exclusive:
        if initialized:
            if dispatch.canonical_platform(jax.default_backend()) != dispatch.canonical_platform(name):
                raise PlatformError(f"cannot make '{name}' JAX's only platform: JAX's backends are already "
                                    f"initialised in this process ({_available()})")
        else:
            jax.config.update("jax_platforms", name if name == "cpu" else f"{name},cpu")
    where = f" (PJRT plugin library {library})" if library else ""
    try:
        devices = jax.devices(name) if name else jax.devices()
    except RuntimeError as e:
        hint = ""
        if library and initialized is None:
            hint = (" JAX's backends may have been initialised before the plugin was registered: they initialise "
                    "once per process, at the first use of JAX.")
        raise PlatformError(f"platform '{name}'{where} is not available: {e}. Available platforms: "
                            f"{_available()}.{hint}") from e
    if not devices:
        raise PlatformError(f"platform '{name}'{where} has no devices. Available platforms: {_available()}")
    return devices


@dataclass(frozen=True)
class Placement:
    """Where a model runs: `device` becomes the device in use for its calls; `kernels` (optional) is added to the
    kernel dispatch policy while they trace."""

    device: Any
    kernels: dispatch.KernelPolicy | None = None

    @property
    def platform(self) -> str:
        return self.device.platform


def placement_for(platform: PlatformConfig | str | None, mesh: jax.sharding.Mesh | None = None
                  ) -> Placement | None:
    """Initialises `platform` (see `init_platform`) and returns its first device with the config's kernel policy;
    None for None. With `mesh`, the mesh's devices must be of that platform and its first device is used."""
    if platform is None:
        return None
    config = as_config(platform)
    devices = init_platform(config)
    device = devices[0]
    if mesh is not None:
        device = mesh.devices.flat[0]
        wrong = sorted({d.platform for d in mesh.devices.flat} - {devices[0].platform})
        if wrong:
            raise PlatformError(f"the mesh holds {wrong} devices; platform '{config.name}' is "
                                f"'{devices[0].platform}'")
    return Placement(device, config.kernel_policy(device.platform))


def build_on(platform: PlatformConfig | str, mesh: jax.sharding.Mesh | None, build: Callable[[], T]) -> T:
    """Initialises `platform`, runs `build()` (which makes a Model) with its placement active, so the arrays it
    creates land on the platform's first device, and gives the result that placement."""
    placement = placement_for(platform, mesh)
    with activate(placement):
        model = build()
    model.placement = placement
    return model


def placement_of(params) -> Placement | None:
    """The placement of a params pytree whose arrays live on one device (None for host, traced or multi-device
    params: a mesh places those)."""
    leaves = jax.tree_util.tree_leaves(params)
    if not leaves:
        return None
    leaf = leaves[0]
    if not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
        return None
    devices = leaf.sharding.device_set
    return Placement(next(iter(devices))) if len(devices) == 1 else None


@contextlib.contextmanager
def activate(placement: Placement | None) -> Iterator[None]:
    """Runs the block with `placement.device` as JAX's default device and its kernel policy in dispatch (nothing
    for None). Dispatch decides while tracing, and jit caches traces per default device, so calls under different
    placements compile separately; a kernel policy is not part of that cache key (set it before the first call)."""
    if placement is None:
        yield
        return
    with jax.default_device(placement.device), dispatch.use_policy(placement.kernels):
        yield


def add_cli_options(parser: argparse.ArgumentParser) -> None:
    """Adds --platform, --pjrt-plugin, --plugin-name and --pallas-kernels to a command-line tool, and the persistent
    compilation cache's options (`compilation_cache.add_cli_options`)."""
    group = parser.add_argument_group("platform")
    group.add_argument("--platform", help="JAX platform to run on (cpu, cuda, rocm, or a plugin's name such as musa;"
                                          " default: JAX's default backend)")
    group.add_argument("--pjrt-plugin", metavar="PATH", help="PJRT plugin library (.so, or JSON plugin config) to "
                                                             "register before JAX starts")
    group.add_argument("--plugin-name", help="backend name to register --pjrt-plugin as (default: --platform)")
    group.add_argument("--pallas-kernels", metavar="NAMES", default="",
                       help=f"comma-separated kernels to run as Pallas (Triton) on this platform "
                            f"({', '.join(dispatch.KERNELS)}, or *)")
    compilation_cache.add_cli_options(parser)


def from_cli_args(args: argparse.Namespace, init: bool = False) -> PlatformConfig | None:
    """The PlatformConfig the options of `add_cli_options` ask for; None when none was given. `init=True` also
    initialises it now (`init_platform`), for a tool that uses JAX before it loads the model. Also turns the
    persistent compilation cache on unless the options say not to (`compilation_cache.from_cli_args`): call this
    before anything compiles."""
    compilation_cache.from_cli_args(args)
    kernels = tuple(k.strip() for k in (getattr(args, "pallas_kernels", "") or "").split(",") if k.strip())
    values = (getattr(args, "platform", None), getattr(args, "pjrt_plugin", None), getattr(args, "plugin_name", None))
    if not any(values) and not kernels:
        return None
    config = PlatformConfig(platform=values[0], pjrt_plugin=values[1], plugin_name=values[2], pallas_kernels=kernels)
    if init:
        init_platform(config)
    return config


__all__ = ["PlatformConfig", "PlatformError", "Placement", "init_platform", "placement_for", "placement_of", "build_on",
           "activate", "as_config", "backends_initialized", "add_cli_options", "from_cli_args", "PLUGIN_ENV",
           "compilation_cache"]
