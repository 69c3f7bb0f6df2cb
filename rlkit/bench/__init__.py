"""Benchmarks: `rlkit bench ...`; each reports ratios measured side by side in one run."""
