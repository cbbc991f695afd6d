"""Running the course: the notebook runner and report, lesson helpers, probes, checks."""
