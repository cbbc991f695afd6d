"""Tensors from a real training step, for the numerics chapters to measure on.

`realistic_tensors` runs one forward and backward pass of the course model and keeps what the
FP8 and MXFP8 recipes would quantize: the MoE block's input, the experts' weights and their
gradients, and the gradient flowing into the block. It sits above the model (it builds one),
while `moe_tutorial.precision.quant`'s numerics sit below it.
"""

from __future__ import annotations

import torch

from ..moe.config import preset
from ..moe.model import MoEForCausalLM


def realistic_tensors(config=None, batch: int = 8, seq_len: int = 64, layer: int = 0,
                      outlier_channels: int = 2, outlier_scale: float = 100.0, seed: int = 0
                      ) -> dict[str, torch.Tensor]:
    """Tensors from one real forward + backward pass of the course model (2-D, float32).

    * "activations": the MoE block's input (tokens × hidden) in layer `layer`;
    * "activations_outliers": the same with `outlier_channels` hidden channels multiplied by
      `outlier_scale`, imitating the few huge feature channels of trained LLMs (a freshly
      initialised model has none; this is the only synthetic tensor here);
    * "weights": the experts' gate_up_proj, [E·2I, H];
    * "weight_gradients": its gradient;
    * "activation_gradients": the gradient of the loss w.r.t. the MoE block's output.

    The model is `moe_tutorial.moe.model.MoEForCausalLM(config)` (default: the "tiny" preset) on
    random tokens, at initialisation.
    """
    config = config or preset("tiny")
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():  # seed the initialisation without touching the caller's RNG
        torch.manual_seed(seed)
        model = MoEForCausalLM(config)
    moe = model.model.layers[layer].mlp
    captured = {}

    def keep_input(_module, args):
        captured["activations"] = args[0].detach().reshape(-1, config.hidden_size)

    def keep_output_grad(_module, _args, output):
        out = output[0] if isinstance(output, tuple) else output
        out.register_hook(lambda g: captured.__setitem__(
            "activation_gradients", g.detach().reshape(-1, config.hidden_size)))

    hooks = [moe.register_forward_pre_hook(keep_input), moe.register_forward_hook(keep_output_grad)]
    try:
        ids = torch.randint(0, config.vocab_size, (batch, seq_len + 1), generator=generator)
        model(ids[:, :-1], ids[:, 1:]).loss.backward()
    finally:
        for hook in hooks:
            hook.remove()

    gate_up = moe.experts.gate_up_proj
    activations = captured["activations"]
    with_outliers = activations.clone()
    channels = torch.randperm(config.hidden_size, generator=generator)[:outlier_channels]
    with_outliers[:, channels] *= outlier_scale
    return {
        "activations": activations.float(),
        "activations_outliers": with_outliers.float(),
        "weights": gate_up.detach().reshape(-1, config.hidden_size).float(),
        "weight_gradients": gate_up.grad.reshape(-1, config.hidden_size).float(),
        "activation_gradients": captured["activation_gradients"].float(),
    }
