"""The serving engine: requests, block pools, scheduler, batched runner, sampler, engine loop."""
