"""The inference engine: one readable model file, the engine that wires weights, cache and executor,
generation (prefill, decode, sampling), tokenization and run telemetry."""
