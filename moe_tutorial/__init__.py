"""moe_tutorial: the support package of the course "Training Mixture-of-Experts models fast with
NVIDIA Transformer Engine".

One concern per module (see docs/package.md for the map):
config → hardware → routing / experts → model → data / train → (bench, widgets, course).
Notebooks import from here; the package never imports notebook code.
"""

__version__ = "0.1.0"
