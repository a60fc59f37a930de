"""The continual RL trainer: data packing, losses, the training cycle, checkpoints and weight deltas."""
