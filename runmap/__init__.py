"""Horizon RunMap: MoE inference with INT4 qpacked routed experts and a strict residency cache."""
__version__ = "0.1.0"
