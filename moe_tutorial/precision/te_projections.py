"""Under an FP8 recipe the attention's projections run as Transformer Engine modules, so that
every large GEMM of a decoder layer is quantized: q, k and v become one `te.Linear` (one GEMM
and one FP8 cast of the input instead of three) and o_proj a `te.Linear`, with the same
[out, in] weights. `MoEForCausalLM.set_precision` applies this to every layer; the attention
module keeps the fused projection as `qkv_proj`, its weight split into the parameters
`q_proj_weight`, `k_proj_weight` and `v_proj_weight` (TE's `parameters_split`), which is how
`moe.hf` finds them again under HF's names.
"""

from __future__ import annotations

import torch

QKV_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


@torch.no_grad()
def fuse_attention_projections(attention: torch.nn.Module, te) -> None:
    """Replace `attention`'s `nn.Linear` projections (no biases) by TE modules in place: q, k, v
    by one `te.Linear` stored as `attention.qkv_proj`, o_proj by a `te.Linear`. Does nothing
    to projections already converted. `te`: the `transformer_engine.pytorch` module."""
    if attention.qkv_proj is None:
        parts = {name: getattr(attention, name).weight for name in QKV_PROJECTIONS}
        first = parts["q_proj"]
        qkv = te.Linear(first.shape[1], sum(w.shape[0] for w in parts.values()), bias=False,
                        params_dtype=first.dtype, device=first.device,
                        parameters_split={name: w.shape[0] for name, w in parts.items()})
        for name, w in parts.items():
            getattr(qkv, f"{name}_weight").copy_(w)
            delattr(attention, name)
        attention.qkv_proj = qkv
    if not isinstance(attention.o_proj, te.Linear):
        old = attention.o_proj.weight
        attention.o_proj = te.Linear(old.shape[1], old.shape[0], bias=False,
                                     params_dtype=old.dtype, device=old.device)
        attention.o_proj.weight.copy_(old)
