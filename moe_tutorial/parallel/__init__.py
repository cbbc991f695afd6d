"""Expert parallelism, FSDP2, sharded checkpoints and init, process groups."""
