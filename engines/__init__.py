"""Engine bridges: the simulated engine, and (later) vLLM's token-only HTTP API."""
