"""The one place that decides which implementation of an op runs.

CUDA/ROCm devices get the Pallas implementation where the op has one that has passed its GPU tests (tests/gpu on an
H200: `gpu_verified=True` at the call site); every other platform (CPU, a vendor PJRT plugin such as MUSA) gets the
plain-XLA reference. A kernel not yet verified on a GPU runs only when asked for. The decision is made at trace time from the platform of the
default devices. `impl=` on an op, or `DAYZERO_KERNELS=reference|pallas|interpret` for a whole process, overrides it
for experiments; an override naming an implementation the op lacks falls back to the reference.
"""

from __future__ import annotations

import os

import jax

IMPLS = ("reference", "pallas", "interpret")
PALLAS_PLATFORMS = ("gpu", "cuda", "rocm")
ENV_OVERRIDE = "DAYZERO_KERNELS"


def current_platform() -> str:
    """Platform of the devices in use: the `jax.default_device` in effect (a device or a platform name) if any,
    else the default backend ('cpu', 'cuda', 'rocm', or a plugin's name such as 'musa')."""
    device = jax.config.jax_default_device
    if device is not None:
        return device if isinstance(device, str) else device.platform
    return jax.default_backend()


def choose(available: tuple[str, ...], impl: str | None = None, platform: str | None = None,
           gpu_verified: bool = True) -> str:
    """Returns the implementation to run among `available` (always including "reference").

    `impl` (or the DAYZERO_KERNELS variable) forces a choice; otherwise Pallas on CUDA/ROCm when the op's Pallas
    kernel is `gpu_verified`, the reference elsewhere.
    """
    forced = impl or os.environ.get(ENV_OVERRIDE) or None
    if forced is not None:
        if forced not in IMPLS:
            raise ValueError(f"kernel implementation '{forced}' is not one of {IMPLS}")
        if forced == "interpret" and "pallas" in available:
            return "interpret"
        return forced if forced in available else "reference"
    platform = platform or current_platform()
    if platform in PALLAS_PLATFORMS and "pallas" in available and gpu_verified:
        return "pallas"
    return "reference"
