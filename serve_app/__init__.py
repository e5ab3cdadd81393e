"""The Ray Serve application: settings, the engine replica deployment, its model shard actor, metrics."""
