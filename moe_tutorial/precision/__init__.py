"""What this machine runs and in which precision: hardware, TE recipes, FP8/MXFP8 numerics."""
