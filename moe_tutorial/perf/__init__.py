"""Measuring: timing, benchmarks, profiles, speed of light, memory, analysis, widgets."""
