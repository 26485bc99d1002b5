"""Model architectures: the config dataclass, presets and one adapter per model family."""
