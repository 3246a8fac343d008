"""One process of the two-process check run by tests/test_distributed.py (CPU, gloo collectives):

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/distributed_checks.py PORT PROCESS_ID

Joins the run at localhost:PORT, builds a global expert=2 x tensor=2 mesh over both processes' devices (the
experts' all-to-all crosses the processes; tensor parallelism stays inside each), places the tiny hybrid's params
on it and checks the gathered logits against the same model on this process's first device alone.
"""

from __future__ import annotations

import sys

from dayzero.model import sharding


def main(port: int, process_id: int) -> None:
    sharding.initialize_distributed(f"localhost:{port}", num_processes=2, process_id=process_id)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils

    from dayzero.model.model import Model
    from mesh_checks import TOLERANCE, hybrid_config, numpy_params, relative_error

    assert jax.process_count() == 2 and jax.device_count() == 4 and jax.local_device_count() == 2, jax.devices()
    config = hybrid_config()
    params = numpy_params(config, 3)  # the same seed in both processes: the same values
    ids = np.random.default_rng(1).integers(3, 200, (2, 9))
    local = jax.local_devices()[0]
    ref = np.asarray(Model(config, jax.device_put(params, local), jnp.float32)(ids))

    mesh = sharding.make_mesh(expert=2, tensor=2)
    assert {d.process_index for d in mesh.devices[0, 0]} != {d.process_index for d in mesh.devices[0, 1]}
    model = Model(config, sharding.shard_params(params, config, mesh), jnp.float32, mesh=mesh)
    experts = model.params["layers_1"]["mlp"]["experts"]["w_gate"]
    assert not experts.is_fully_addressable and experts.sharding.spec == jax.sharding.PartitionSpec("expert")
    logits = multihost_utils.process_allgather(model(ids), tiled=True)
    err = relative_error(logits, ref)
    assert logits.shape == ref.shape and err <= TOLERANCE, (logits.shape, err)
    print(f"ok process {process_id}: logits over 2 processes x 2 devices, relative error {err:.2e}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
