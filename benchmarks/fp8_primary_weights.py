"""FP8 primary weights for the experts, beside the FP8 step that re-quantizes bf16 weights.

The FP8 training step keeps bf16 expert weights and casts them to FP8 (and transposes them) in
every forward pass. With TE's `quantized_model_init` the te.ops experts hold FP8 weights
instead, and TE's FusedAdam keeps the fp32 master copy and writes the FP8 weights after each
update (its fused FP8 Adam kernel for delayed-scaling weights). This runs, in one process on one
GPU, on `bench`'s training step (mixtral-2l, batch 2 x 4096, compiled loss):

- the FP8 step as the course runs it, with torch's fused AdamW and with TE's FusedAdam;
- the same step with FP8 primary expert weights and TE's FusedAdam with fp32 master weights;

each with its median step time, its peak memory (and what was resident before it), its first
loss and its loss after the timed steps (same batch, same learning rate, same number of steps:
comparable). Writes one JSON, rewritten after every row.

    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/fp8_primary_weights.py --out FILE.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moe_tutorial.moe.config import preset
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.perf import bench
from moe_tutorial.perf.timing import environment, peak_memory_gb, reset_memory, resident_gb, time_fn
from moe_tutorial.precision import hardware
from moe_tutorial.train.loop import loss_of, train_step

BASE = "ours_te_ops_fp8_compiled_loss"  # FP8 experts and attention, compiled loss, eager AdamW


def fp8_weights_model(config, device: str) -> MoEForCausalLM:
    """The FP8 step's model whose te.ops experts are rebuilt inside `quantized_model_init` with
    the model's own recipe: FP8 weights, the bf16 values copied (quantized) into them."""
    te = hardware.transformer_engine()
    torch.manual_seed(0)
    model = MoEForCausalLM(config, device=device)
    model.set_expert_backend("te_ops").set_precision(bench.VARIANTS[BASE].precision)
    model.compiled_loss = True
    with te.quantized_model_init(enabled=True, recipe=model._recipe):
        model.set_expert_backend("te_ops")
    return model


def measure(name, build, make_optimizer, batch, *, warmup, iters, reference_loss, device="cuda"):
    row = {"variant": name}
    module = opt = None
    try:
        reset_memory(device)
        row["resident_before_gb"] = resident_gb(device)
        module = build()
        opt = make_optimizer(module)
        row["optimizer"] = f"{type(opt).__module__}.{type(opt).__name__}"
        row["fp8_parameters"] = sum(p.numel() for p in module.parameters()
                                    if "Float8" in type(p).__name__)
        row["first_loss"] = loss_of(module(*batch)).item()
        if reference_loss is not None:
            row["first_loss_diff"] = abs(row["first_loss"] - reference_loss)
        t = time_fn(lambda m=module, o=opt: train_step(m, batch, o, grad_clip=None, guard=False),
                    warmup=warmup, iters=iters, device=device)
        with torch.no_grad():
            row["loss_after_steps"] = loss_of(module(*batch)).item()
        row.update(status="ok", median_ms=t.median_ms, min_ms=t.min_ms, steps=warmup + iters,
                   peak_memory_gb=peak_memory_gb(device))
    except Exception as exc:  # a row that fails is reported, the others still run
        row.update(status="failed", error=f"{type(exc).__name__}: {str(exc)[:500]}")
    finally:
        del module, opt
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--preset", default="mixtral-2l")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-5)
    args = parser.parse_args()
    config = preset(args.preset)
    batch = bench.random_batch(config, args.batch, args.seq_len, "cuda")
    te = hardware.transformer_engine()
    settings = dict(lr=args.lr, betas=(0.9, 0.95), adam_w_mode=True, weight_decay=0.0)

    def base_model():
        return bench.VARIANTS[BASE].build(config, "cuda")[0]

    variants = [
        ("fp8_step_torch_fused_adamw", base_model,
         lambda m: torch.optim.AdamW(m.parameters(), lr=args.lr, betas=(0.9, 0.95), fused=True)),
        ("fp8_step_te_fused_adam_bf16_moments", base_model,
         lambda m: te.optimizers.FusedAdam(m.parameters(), **settings, exp_avg_dtype=torch.bfloat16,
                                           exp_avg_sq_dtype=torch.bfloat16)),
        ("fp8_primary_weights_te_fused_adam_fp32_master", lambda: fp8_weights_model(config, "cuda"),
         lambda m: te.optimizers.FusedAdam(m.parameters(), **settings, master_weights=True,
                                           master_weight_dtype=torch.float32,
                                           store_param_remainders=False)),
    ]
    report = {"environment": environment(), "preset": args.preset, "batch": args.batch,
              "seq_len": args.seq_len, "base_variant": BASE, "rows": []}
    reference = None
    for name, build, make_optimizer in variants:
        row = measure(name, build, make_optimizer, batch, warmup=args.warmup, iters=args.iters,
                      reference_loss=reference)
        reference = reference if reference is not None else row.get("first_loss")
        report["rows"].append(row)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
