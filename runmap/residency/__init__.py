"""Expert residency: the cache contract (resident-qpacked-cache-v1), host source, transport, eviction,
observations, and the reference model the contract tests check the cache against."""
