"""The parallel layout: the (dp, tp) mesh, sharding the model, and moving shards between layouts."""
