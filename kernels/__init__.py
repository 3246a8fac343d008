"""dayzero's kernels: one module per op, each with a plain-jnp `reference` (the oracle) and, where written,
Pallas implementations; `dispatch` chooses between them at trace time."""
