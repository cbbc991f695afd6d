"""moe_tutorial: the support package of the course "Training Mixture-of-Experts models fast with
NVIDIA Transformer Engine".

One sub-package per concern, each importing only from those before it (docs/package.md):
precision → moe → train → parallel → perf → course, and the command line (`cli`). The model
the course teaches is `moe`: `moe.model.MoEForCausalLM`. Its minimal reading path, in order: the
MoE block `moe.model.MoEBlock`, its token dispatcher `moe.model.LocalDispatcher` and its router
`moe.model.Router` (a softmax's top-k: `moe.model.route`), all in the model's file; the experts
as `moe.experts.naive.NaiveExperts` (the reference loop, first among the backends); one training
step, `train.loop.train_step`.
Notebooks import from here; the package never imports notebook code, and finds files through
`locations` (its own data, the clone around the current directory), so an installed wheel runs
as a checkout does; committed results are read by `perf.results`.
"""

__version__ = "0.1.0"
