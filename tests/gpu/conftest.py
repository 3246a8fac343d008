"""GPU tests skip cleanly on machines without a GPU."""

import jax
import pytest


def pytest_collection_modifyitems(config, items):
    if any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices()):
        return
    skip = pytest.mark.skip(reason="no GPU on this machine")
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(skip)
