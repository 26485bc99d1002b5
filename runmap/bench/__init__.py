"""Benchmarks: campaigns (spec -> one record per configuration), metrics, baselines, checks and reports."""
