"""Benchmark drivers run from a checkout; their committed results are in results/."""
