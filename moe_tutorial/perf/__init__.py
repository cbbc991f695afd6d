"""Measuring: committed results, timing, benchmarks, profiles, speed of light, memory, analysis,
widgets."""
