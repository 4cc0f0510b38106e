"""The applications on top of the runtime and the trainer: the `medusa-heads` CLI, the benchmark, tree fitting."""
