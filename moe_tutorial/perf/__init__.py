"""Measuring, returning numbers: committed results, timing, benchmarks, profiles, speed of light,
memory, idle gaps, the analysis of a model. What a chapter shows of them lives in `course/`."""
