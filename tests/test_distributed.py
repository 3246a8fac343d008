"""Multi-host on one machine: two CPU processes joined by `sharding.initialize_distributed` (jax.distributed, gloo
collectives) run the tiny hybrid on a global 4-device mesh and match one device (tests/distributed_checks.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 120  # both processes together


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_two_processes_match_one_device():
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2 "
                         "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true".strip(),
               PYTHONPATH=os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")])))
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "distributed_checks.py"), str(port), str(i)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    for i, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"process {i} failed ({proc.returncode}):\n{out[-6000:]}"
        assert f"ok process {i}: logits over 2 processes" in out, out[-3000:]
