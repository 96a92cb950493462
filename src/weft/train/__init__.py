"""Training: data pipeline, loop, checkpoints, metrics."""
