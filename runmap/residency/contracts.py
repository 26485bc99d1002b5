"""The cache contracts by name: the one registry of them (docs/cache-contract.md). Torch-free, so that the command
line's parsers can offer the names before any backend is loaded."""
from __future__ import annotations

CONTRACT_V1 = "resident-qpacked-cache-v1"  # pageable host source -> pinned staging -> device (the default)
CONTRACT_V2 = "resident-qpacked-cache-v2"  # the host source registered once, rows copied straight into spare rows
CACHE_CONTRACTS = {"v1": CONTRACT_V1, "v2": CONTRACT_V2}  # option value -> contract id
CONTRACT_NAMES = tuple(CACHE_CONTRACTS)  # the option values, default first
