"""Layer 1, planning (no JAX): the topology of the devices, the trees packed into it, and the
per-rank program the executors run."""
