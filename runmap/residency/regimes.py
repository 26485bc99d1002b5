"""The residency regimes (docs/architecture.md#residency-regimes): every compact expert on the GPU, or a fixed
number per layer with the rest fetched through the cache contract. Mirrors ``specs/architecture.yaml``
``regimes`` and ``schemas/common.schema.json#/$defs/regime``."""
REGIMES: dict[str, str] = {
    "full": "every compact expert of every layer resident on the GPU; one generation published at startup",
    "partial": "a fixed number of experts per layer resident; the rest fetched from host RAM on demand",
}
REGIME_NAMES: tuple[str, ...] = tuple(REGIMES)


def regime_of(resident: int, experts_per_layer: int) -> str:
    """The regime of a configuration with ``resident`` of ``experts_per_layer`` experts on the GPU."""
    return "full" if resident == experts_per_layer else "partial"
