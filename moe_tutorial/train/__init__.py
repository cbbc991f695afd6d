"""Training: the loop, its data and its checkpoints."""
