"""Conformance: JSON Schema discovery and validation of every artifact, and the conformance summary."""
