"""The one place that decides which implementation of an op runs.

Every op with a Pallas implementation calls `choose(kernel, ...)` with its kernel name (one of `KERNELS`). The
decision is made at trace time from the platform of the devices in use (`current_platform`):

- CUDA: Pallas where the op's kernel has passed its GPU tests (tests/gpu on an H200: `gpu_verified=True` at the call
  site);
- ROCm: Pallas where, in addition, the kernel's `Kernel.rocm` declares that its lowering works there (Triton-lowered
  kernels count as supported on ROCm only when declared; Mosaic GPU kernels never);
- CPU and every other platform (a vendor PJRT plugin such as MUSA): the plain-XLA reference, unless a
  `KernelPolicy` switches a Triton-lowered kernel on for that platform (a vendor whose Triton-based stack, e.g.
  Triton-MUSA, consumes Pallas' Triton lowering).

A `KernelPolicy` comes from the `dayzero.kernel_platforms` entry-point group (discovered once per process, see
`discovered_policy`) and from `use_policy` (a context manager; `dayzero.platforms.PlatformConfig.pallas_kernels`
uses it). Both are read when a function is traced, and jit caches traces: set them before the first call of the
model or engine (a policy changed later does not reach functions already compiled).

`impl=` on an op, or `DAYZERO_KERNELS=reference|pallas|interpret` for a whole process, overrides all of this for
experiments; an override naming an implementation the op lacks falls back to the reference.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType

import jax

IMPLS = ("reference", "pallas", "interpret")
ENV_OVERRIDE = "DAYZERO_KERNELS"
ENTRY_POINT_GROUP = "dayzero.kernel_platforms"
LOWERINGS = ("triton", "mosaic_gpu")
ALL_KERNELS = "*"


@dataclass(frozen=True)
class Kernel:
    """What dispatch knows of one op's Pallas implementation: the Pallas backend it is written for (`lowering`) and
    whether that lowering is declared to work on ROCm (`rocm`; only meaningful for Triton-lowered kernels)."""

    name: str
    lowering: str = "triton"
    rocm: bool = False

    def __post_init__(self):
        if self.lowering not in LOWERINGS:
            raise ValueError(f"kernel '{self.name}': lowering '{self.lowering}' is not one of {LOWERINGS}")


# Every kernel with a Pallas implementation, by name. All are written for the Triton lowering; none has been run on
# ROCm yet, so none declares it.
KERNELS: Mapping[str, Kernel] = MappingProxyType({k.name: k for k in (
    Kernel("kda"),          # kernels/kda: chunked prefill, recurrent decode, in-place slot decode
    Kernel("kda_decode_layer"),  # kernels/kda/decode_layer.py: a KDA layer's decode conv, gates, step, gated norm
    Kernel("paged_write"),  # kernels/paged.py -> paged_pallas
    Kernel("indexer"),      # kernels/indexer.py -> indexer_pallas (DSA lightning indexer + top-k)
    Kernel("sparse_mla"),   # kernels/attention.py -> sparse_mla (attention over the selected latents)
    Kernel("moe_mxfp4"),    # kernels/moe.py -> moe_mxfp4 (+ moe_workspace): MXFP4 grouped SwiGLU matmuls
    Kernel("moe_dense"),    # kernels/moe.py -> moe_dense: grouped SwiGLU matmuls over dense (bf16/fp32) experts
    Kernel("router"),       # kernels/router.py: the MoE router (logits, scores, top-k, weights) in one kernel
    Kernel("router_select"),  # kernels/router.py: the router's scores, top-k and weights after XLA's logits
    Kernel("projection"),   # kernels/projection.py: decode-sized projections (norm in, residual out) in one kernel
    Kernel("moe_front"),    # kernels/moe_front.py: a decode MoE block's residual add, norm and router logits
    Kernel("mla_absorb"),   # kernels/mla_absorb.py: absorbed MLA's W_UK and W_UV products (split merge) at decode
)})


def _kernel(name: str) -> Kernel:
    try:
        return KERNELS[name]
    except KeyError:
        raise ValueError(f"unknown kernel '{name}'; known: {sorted(KERNELS)}") from None


@dataclass(frozen=True)
class KernelPolicy:
    """Kernels switched on to run their Pallas implementation, as (platform, kernel name) pairs (kernel "*": every
    kernel). Build one with `KernelPolicy.of({"musa": ["kda", "moe_mxfp4"]})`."""

    pallas: frozenset[tuple[str, str]] = frozenset()

    def __post_init__(self):
        for platform, kernel in self.pallas:
            if not isinstance(platform, str) or not platform:
                raise ValueError(f"kernel policy: platform {platform!r} is not a platform name")
            if kernel != ALL_KERNELS:
                _kernel(kernel)

    @classmethod
    def of(cls, mapping: Mapping[str, Iterable[str] | str]) -> "KernelPolicy":
        """From {platform: kernel names} (a single name, or "*" for every kernel, may stand alone)."""
        pairs = set()
        for platform, kernels in mapping.items():
            for kernel in ((kernels,) if isinstance(kernels, str) else kernels):
                pairs.add((platform.lower(), kernel))
        return cls(frozenset(pairs))

    def allows(self, platform: str, kernel: str) -> bool:
        """Whether the policy switches `kernel` on for `platform` (a canonical name: "cuda" and "rocm" also match
        entries for JAX's "gpu" alias)."""
        names = (platform, "gpu") if platform in ("cuda", "rocm") else (platform,)
        return any((name, k) in self.pallas for name in names for k in (kernel, ALL_KERNELS))

    def merge(self, other: "KernelPolicy | None") -> "KernelPolicy":
        return self if other is None else KernelPolicy(self.pallas | other.pallas)


def _as_policy(value, source: str) -> KernelPolicy:
    if callable(value) and not isinstance(value, KernelPolicy):
        value = value()
    if isinstance(value, KernelPolicy):
        return value
    if isinstance(value, Mapping):
        return KernelPolicy.of(value)
    raise ValueError(f"{source} gave a {type(value).__name__}; expected a KernelPolicy, a mapping "
                     "{platform: kernel names} or a function returning one")


@functools.cache
def discovered_policy() -> KernelPolicy:
    """The union of the policies that installed packages declare in the `dayzero.kernel_platforms` entry-point group
    (each entry point: a KernelPolicy, a {platform: kernel names} mapping, or a function returning one). Read once
    per process; raises ValueError naming a broken entry point."""
    from importlib.metadata import entry_points

    policy = KernelPolicy()
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        source = f"entry point '{entry.name}' = '{entry.value}' (group {ENTRY_POINT_GROUP})"
        try:
            policy = policy.merge(_as_policy(entry.load(), source))
        except ValueError:
            raise
        except Exception as e:  # an import error in the vendor's package: name the entry point that pulled it in
            raise ValueError(f"{source} failed to load: {type(e).__name__}: {e}") from e
    return policy


_CONTEXT_POLICY: ContextVar[KernelPolicy | None] = ContextVar("dayzero_kernel_policy", default=None)


@contextlib.contextmanager
def use_policy(policy: KernelPolicy | Mapping[str, Iterable[str]] | None) -> Iterator[None]:
    """Adds `policy` to the discovered one while the block runs (None: no change). Takes effect for functions traced
    inside the block: jit caches traces, so enter it before the first call."""
    if policy is None:
        yield
        return
    policy = _as_policy(policy, "use_policy")
    token = _CONTEXT_POLICY.set(policy.merge(_CONTEXT_POLICY.get()))
    try:
        yield
    finally:
        _CONTEXT_POLICY.reset(token)


def active_policy() -> KernelPolicy:
    """The policy in force: the discovered one plus any `use_policy` in effect."""
    return discovered_policy().merge(_CONTEXT_POLICY.get())


def current_platform() -> str:
    """Platform of the devices in use, as JAX names it: the `jax.default_device` in effect (a device or a platform
    name) if any, else the devices of the mesh set with `jax.set_mesh` (read through `get_abstract_mesh`, which works
    while tracing), else the default backend ('cpu', 'gpu', or a plugin's name such as 'musa')."""
    device = jax.config.jax_default_device
    if device is not None:
        return device if isinstance(device, str) else device.platform
    mesh_device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    if mesh_device is not None:
        return mesh_device.platform
    return jax.default_backend()


def canonical_platform(platform: str) -> str:
    """Lower-case platform name with JAX's "gpu" alias resolved: "rocm" when this process has a ROCm backend, else
    "cuda" (JAX devices of both report "gpu")."""
    platform = platform.lower()
    if platform != "gpu":
        return platform
    from jax.extend import backend

    return "rocm" if "rocm" in backend.backends() else "cuda"


def pallas_allowed(kernel: str, platform: str, gpu_verified: bool = True, policy: KernelPolicy | None = None) -> bool:
    """Whether `kernel` runs its Pallas implementation on `platform` by default (the rules of the module doc)."""
    spec = _kernel(kernel)
    platform = canonical_platform(platform)
    if (policy if policy is not None else active_policy()).allows(platform, kernel):
        return spec.lowering == "triton" or platform == "cuda"
    if platform == "cuda":
        return gpu_verified
    if platform == "rocm":
        return gpu_verified and spec.lowering == "triton" and spec.rocm
    return False


# XLA options dayzero's jitted model functions compile with, by canonical platform (`compiler_options`).
# GPUs: XLA's dot-strength-reduction pass off. It rewrites a dot with a vector operand and fewer than 1e7
# multiply-adds (every projection of a batch-1 decode step: [D] @ [D, N]) into a multiply that writes [D, N] and a
# reduce over it: three passes over the weight instead of one. On an H200 (jax 0.11.2) each 2048 x 2048 bf16
# projection of the medium hybrid took ~7.7 us that way (~1.1 TB/s), and the rewritten projections ~40% of a batch-1
# decode step (benchmarks/NOTES_serving.md). Without it they go to XLA's GEMM emitters like the batched case.
_NO_DOT_STRENGTH_REDUCTION = MappingProxyType({"xla_disable_hlo_passes": "dot-strength-reduction"})
_COMPILER_OPTIONS: Mapping[str, Mapping[str, object]] = MappingProxyType(
    {"cuda": _NO_DOT_STRENGTH_REDUCTION, "rocm": _NO_DOT_STRENGTH_REDUCTION})


def nvidia_ptx(interpret: bool) -> bool:
    """Whether a Pallas kernel may carry inline PTX: compiled (not interpret mode) for NVIDIA GPUs. ROCm and vendor
    plugins whose Triton takes Pallas' lowering (MUSA, `KernelPolicy`) get the kernels' jnp forms. A CPU process
    reaches a compiled lowering only by exporting for CUDA (tests/triton_lowering.py, benchmarks/triton_report.py)."""
    return not interpret and canonical_platform(current_platform()) in ("cuda", "cpu")


def grid_dependency_ptx(interpret: bool) -> bool:
    """Whether a Pallas kernel may carry `griddepcontrol` (programmatic dependent launch, `grid_dependency`): inline
    PTX is allowed (`nvidia_ptx`) and every local NVIDIA GPU is sm_90 or newer (a CPU process exporting for CUDA
    lowers for sm_90, as Pallas does without a GPU)."""
    if not nvidia_ptx(interpret):
        return False
    if canonical_platform(current_platform()) != "cuda":
        return True
    capabilities = [getattr(d, "compute_capability", "0") for d in jax.local_devices(backend="gpu")]
    return bool(capabilities) and min(int(str(c).split(".")[0]) for c in capabilities) >= 9


def compiler_options(platform: str | None = None) -> dict[str, object]:
    """XLA compile options for dayzero's model functions on `platform` (default: `current_platform()`); empty
    where none apply (XLA rejects another backend's options, so they are per platform)."""
    return dict(_COMPILER_OPTIONS.get(canonical_platform(platform or current_platform()), {}))


class PlatformJit:
    """`jax.jit(fun, **jit_kwargs)` compiled with the `compiler_options` of the platform in use at each call (one
    jit per platform, made at its first call): call it where the model's placement is active."""

    def __init__(self, fun, **jit_kwargs):
        self._fun, self._jit_kwargs = fun, jit_kwargs
        self._jits: dict[str, object] = {}  # by current_platform() as it reads (canonicalised once, at creation)

    def __call__(self, *args):
        platform = current_platform()
        jitted = self._jits.get(platform)
        if jitted is None:
            jitted = self._jits[platform] = jax.jit(self._fun, compiler_options=compiler_options(platform) or None,
                                                    **self._jit_kwargs)
        return jitted(*args)


def choose(kernel: str, available: tuple[str, ...] = ("reference", "pallas"), impl: str | None = None,
           platform: str | None = None, gpu_verified: bool = True) -> str:
    """Returns the implementation of `kernel` (a name in `KERNELS`) to run among `available` (always including
    "reference").

    `impl` (or the DAYZERO_KERNELS variable) forces a choice; otherwise `pallas_allowed` on `platform` (default:
    `current_platform()`), where `gpu_verified` is whether the op's Pallas kernels have passed their GPU tests.
    """
    _kernel(kernel)
    forced = impl or os.environ.get(ENV_OVERRIDE) or None
    if forced is not None:
        if forced not in IMPLS:
            raise ValueError(f"kernel implementation '{forced}' is not one of {IMPLS}")
        if forced == "interpret" and "pallas" in available:
            return "interpret"
        return forced if forced in available else "reference"
    platform = platform or current_platform()
    if "pallas" in available and pallas_allowed(kernel, platform, gpu_verified):
        return "pallas"
    return "reference"
