"""What a run shows and records while it trains: the progress display, metrics.jsonl, TensorBoard. Observers never save."""
