"""The model a torchrun worker (`train_dist`) runs on a (dp, ep) layout: its compute and state
dtypes, the data-parallel engine applied to it (FSDP2 or replicated), our model filled from an HF
checkpoint shard by shard, the global batch every rank draws alike, and routing that starves
chosen experts (a test of ranks that receive no tokens).
"""

from __future__ import annotations

import contextlib

import torch

from ..moe.config import DTYPES, MoEConfig, preset
from ..moe.experts import STACKED_BACKENDS
from ..moe.model import MoEForCausalLM
from ..parallel import distributed
from ..parallel.sharded_init import load_hf_shards


@contextlib.contextmanager
def starve_experts(experts: list[int], *models: MoEForCausalLM):
    """Inside this block the models' routers never pick `experts` (a test of ranks that receive
    no tokens): each routes with its own rule on logits that rule those experts out."""
    rules = [model.routing_rule for model in models]
    for model, original in zip(models, rules):
        model.set_routing(_without(experts, original))
    try:
        yield
    finally:
        for model, original in zip(models, rules):
            model.set_routing(original)


def _without(experts: list[int], rule):
    def starved(logits, top_k, *options):
        logits = logits.clone()
        logits[:, experts] = -1e4
        return rule(logits, top_k, *options)
    return starved


def global_batch(config, world: int, batch: int, seq_len: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (world * batch, seq_len), generator=gen).to(device)


DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def dtypes(args, config) -> tuple[torch.dtype, torch.dtype]:
    """(compute, state): the dtype the layers compute in (`--dtype`, default the preset's) and the
    one the weights, their gradients and AdamW's moments are kept in (`--state-dtype`, default
    the compute dtype). Only FSDP2 keeps them apart (its mixed-precision policy casts each
    gathered layer); replicated weights are the ones the layers compute with."""
    compute = DTYPES[args.dtype or config.dtype]
    state = DTYPES[args.state_dtype] if args.state_dtype else compute
    if state != compute and args.engine != "fsdp2":
        raise ValueError(f"--state-dtype {args.state_dtype} with --dtype {compute}: only "
                         f"--engine fsdp2 keeps the training state in another dtype than the "
                         f"compute (replicated weights are what the layers compute with)")
    return compute, state


def parallelize(model, args, layout, compute: torch.dtype, state: torch.dtype):
    """Apply the data-parallel engine to a model built in the compute dtype whose experts
    `shard_experts` already sharded over ep; returns the `after_backward` hook `train_step`
    calls (None for FSDP2, whose backward pass reduce-scatters the gradients itself). Create
    the optimizer afterwards: FSDP2 replaces the parameters by their shards."""
    if args.activation_checkpointing:
        distributed.checkpoint_activations(model)
    if args.engine == "replicated":
        return lambda: distributed.average_gradients(model, layout)
    # Built in the compute dtype, kept in the state dtype: FSDP2's policy casts each gathered
    # layer back for its forward and backward passes.
    model.to(state)
    distributed.fully_shard_layout(model, layout, mp_policy=distributed.mixed_precision(compute,
                                                                                         state))
    return None


def model_config(args, **overrides):
    """The preset, with `--layers` if given (e.g. the deepest Mixtral-width model that fits);
    with `--hf-checkpoint`, the checkpoint's own config.json."""
    if args.hf_checkpoint:
        from transformers import AutoConfig

        return MoEConfig.from_hf_config(AutoConfig.from_pretrained(args.hf_checkpoint))
    return preset(args.preset, layers=args.layers, **overrides)


def from_hf_checkpoint(args, config, layout, device, compute: torch.dtype,
                       state: torch.dtype) -> MoEForCausalLM:
    """Our model with the weights of an HF checkpoint (`--hf-checkpoint`, a `save_pretrained`
    directory), no rank ever holding it whole: built on the meta device (no storage), its
    experts sharded over ep and everything under FSDP2, then each rank allocates only its own
    shards and reads only their rows from the safetensors files (`sharded_init`)."""
    if args.engine != "fsdp2" or args.backend not in STACKED_BACKENDS:
        raise ValueError(f"--hf-checkpoint loads into FSDP2 shards of stacked experts: use "
                         f"--engine fsdp2 and --backend {' or '.join(STACKED_BACKENDS)}, not "
                         f"--engine {args.engine} --backend {args.backend}")
    model = MoEForCausalLM(config.with_overrides(dtype=DTYPE_NAMES[compute]), device="meta")
    model.set_expert_backend(args.backend)
    distributed.shard_experts(model, layout)
    parallelize(model, args, layout, compute, state)
    model.materialize(device)
    load_hf_shards(model, args.hf_checkpoint, layout)
    return model
