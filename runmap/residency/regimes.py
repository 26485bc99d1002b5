"""The residency regimes (docs/architecture.md#residency-regimes): every compact expert on the GPU, or a fixed
number per layer with the rest fetched through the cache contract. Mirrors ``specs/architecture.yaml``
``regimes`` and ``schemas/common.schema.json#/$defs/regime``."""
REGIMES: dict[str, str] = {
    "full": "every compact expert of every layer resident on the GPU; one generation published at startup",
    "partial": "a fixed number of experts per layer resident; the rest fetched from host RAM on demand",
}
REGIME_NAMES: tuple[str, ...] = tuple(REGIMES)
