"""Expert-parallel training, launched with torchrun: `check`, `train` or `bench` a (dp, ep) layout.

    torchrun --nproc_per_node=2 -m moe_tutorial.train_dist --mode check --dp 1 --ep 2
    torchrun --nproc_per_node=2 -m moe_tutorial.train_dist --mode train --dp 1 --ep 2 --steps 50
    torchrun --nproc_per_node=2 -m moe_tutorial.train_dist --mode bench --preset mixtral-2l \\
        --dp 1 --ep 2 --backend te_ops --precision fp8 --out ep2.json

NCCL on GPUs (one process per GPU), gloo on CPUs. `check` proves the layout computes what one
process computes: every rank also runs the full model on the global batch and compares its
logits and its (averaged) gradients. `bench` reports tokens/s per GPU, the recipe's PFLOP/s per
GPU (6 × active parameters × tokens/s/GPU), peak memory, and the all-to-all's share of the step
(from torch.profiler). `launch()` runs any of these as a subprocess for a notebook.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from . import distributed, routing
from .bench import environment, time_fn
from .config import preset
from .model import IGNORE_INDEX, MoEForCausalLM


def _setup() -> torch.device:
    distributed.apply_safe_env()
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def _targets(ids: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)


@contextlib.contextmanager
def starve_experts(experts: list[int]):
    """Routing that never picks `experts` (a test of ranks that receive no tokens)."""
    original = routing.route

    def route(logits, top_k):
        logits = logits.clone()
        logits[:, experts] = -1e4
        return original(logits, top_k)

    routing.route = route
    try:
        yield
    finally:
        routing.route = original


def _global_batch(config, world: int, batch: int, seq_len: int, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (world * batch, seq_len), generator=gen).to(device)


def check(args, device) -> dict:
    """Distributed forward/backward vs the single-process model on the same global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = preset(args.preset, aux_loss_coef=0.0)  # the aux loss is per rank (local balance)
    layout = distributed.init_layout(args.dp, args.ep, config.num_experts)
    torch.manual_seed(0)
    reference = MoEForCausalLM(config, device=device)
    model = copy.deepcopy(reference)
    model.set_expert_backend(args.backend)
    distributed.shard_experts(model, layout)
    ids = _global_batch(config, world, args.batch, args.seq_len, device)
    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    starve = ([] if args.starve_rank is None else
              list(range(args.starve_rank * config.num_experts // args.ep,
                         (args.starve_rank + 1) * config.num_experts // args.ep)))
    with starve_experts(starve):
        ref_out = reference(ids, _targets(ids))
        ref_out.loss.backward()
        out = model(ids[mine], _targets(ids[mine]))
        out.loss.backward()
    distributed.average_gradients(model, layout)

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()

    errors = {"logits": rel(out.logits, ref_out.logits[mine])}
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if not distributed.is_expert_parameter(name):
            errors[name] = rel(p.grad, ref_params[name].grad)
    # Expert gradients in HF layout (whatever the backend's own layout): this rank's shard.
    per_rank = config.num_experts // args.ep
    first = layout.ep_rank * per_rank if args.ep > 1 else 0
    for i, (layer, ref_layer) in enumerate(zip(model.model.layers, reference.model.layers)):
        experts = layer.mlp.experts
        local = experts.local if args.ep > 1 else experts
        ref_grads = ref_layer.mlp.experts.hf_gradients()
        for what, grad, ref in zip(("gate_up_proj", "down_proj"), local.hf_gradients(), ref_grads):
            errors[f"model.layers.{i}.mlp.experts.{what}"] = rel(
                grad, ref[first:first + local.num_experts])
    worst = max(errors, key=errors.get)
    return {"rank": rank, "dp": args.dp, "ep": args.ep, "max_rel_error": errors[worst],
            "worst": worst, "starved_experts": starve,
            "path": model.model.layers[0].mlp.experts.last_path}


def _step_fn(model, layout, optimizer, ids):
    targets = _targets(ids)

    def step():
        model(ids, targets).loss.backward()
        distributed.average_gradients(model, layout)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def bench(args, device) -> dict:
    """Training-step throughput of one (dp, ep) layout, per GPU, with the all-to-all share."""
    from torch.profiler import ProfilerActivity, profile

    from .train import TrainSettings, make_optimizer

    world = dist.get_world_size()
    config = preset(args.preset)
    if device.type == "cpu":
        config = config.with_overrides(dtype="float32")
    layout = distributed.init_layout(args.dp, args.ep, config.num_experts)
    torch.manual_seed(0)
    model = MoEForCausalLM(config, device=device)
    model.set_expert_backend(args.backend)
    model.set_precision(args.precision)
    distributed.shard_experts(model, layout)
    optimizer = make_optimizer(model, TrainSettings(lr=1e-5, steps=2, warmup_steps=0))
    ids = _global_batch(config, world, args.batch, args.seq_len, device)
    rank = dist.get_rank()
    step = _step_fn(model, layout, optimizer, ids[rank * args.batch:(rank + 1) * args.batch])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timing = time_fn(step, warmup=args.warmup, iters=args.iters, device=device)
    tokens = args.batch * args.seq_len
    tokens_per_s = tokens / (timing.median_ms / 1e3)
    comm_ms = None
    if device.type == "cuda":  # where the time goes: NCCL kernels by name
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize(device)
        kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        comm_ms = {kind: sum(e.self_device_time_total for e in kernels
                             if "nccl" in e.key.lower() and kind in e.key.lower()) / 1e3 / 3
                   for kind in ("sendrecv", "alltoall", "allreduce")}
    result = {"rank": rank, "dp": args.dp, "ep": args.ep, "world": world,
              "environment": environment() if rank == 0 else None, "preset": args.preset,
              "backend": args.backend, "precision": args.precision,
              "batch_per_gpu": args.batch, "seq_len": args.seq_len,
              "median_ms": timing.median_ms, "tokens_per_s_per_gpu": tokens_per_s,
              "pflops_per_gpu": 6 * config.active_params_per_token() * tokens_per_s / 1e15,
              "peak_memory_gb": (torch.cuda.max_memory_allocated(device) / 2**30
                                 if device.type == "cuda" else None),
              "nccl_kernel_ms_per_step": comm_ms,
              "path": model.model.layers[0].mlp.experts.last_path}
    return result


def train(args, device) -> dict:
    """Expert-parallel training on the shipped protein data: each rank its own batches."""
    from .data import iterate_batches, load_protein_data
    from .train import TrainSettings, evaluate, learning_rate, make_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    config = preset(args.preset)
    layout = distributed.init_layout(args.dp, args.ep, config.num_experts)
    data = load_protein_data(config.max_seq_len, max_sequences=args.max_sequences)
    torch.manual_seed(0)
    model = MoEForCausalLM(config, device=device)
    model.set_expert_backend(args.backend)
    distributed.shard_experts(model, layout)
    settings = TrainSettings(steps=args.steps, batch_size=args.batch, lr=args.lr,
                             warmup_steps=max(1, args.steps // 10))
    optimizer = make_optimizer(model, settings)
    batches = iterate_batches(data.train, args.batch, seed=rank)  # each rank its own data
    history, start = [], time.perf_counter()
    for i in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(i, settings)
        inputs, targets = (t.to(device) for t in next(batches))
        out = model(inputs, targets)
        out.loss.backward()
        distributed.average_gradients(model, layout)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.tensor([out.lm_loss.item()], device=device)
        dist.all_reduce(loss)
        history.append({"step": i + 1, "loss": loss.item() / world,
                        "elapsed_s": time.perf_counter() - start})
        if rank == 0 and (i + 1) % max(1, args.steps // 10) == 0:
            print(f"step {i + 1:>5}  loss {history[-1]['loss']:.3f}", flush=True)
    val = evaluate(model, data.val, args.batch, max_batches=4)
    return {"rank": rank, "dp": args.dp, "ep": args.ep, "history": history,
            "val_loss": val, "unigram_nats": data.unigram_nats,
            "tokens_per_s_per_rank": args.steps * args.batch * config.max_seq_len / (
                time.perf_counter() - start)}


MODES = {"check": check, "bench": bench, "train": train}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="moe_tutorial.train_dist", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(MODES), default="check")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=None, help="default: the world size")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--backend", default="grouped_torch")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-sequences", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--starve-rank", type=int, default=None,
                        help="check mode: route no token to this EP rank's experts")
    parser.add_argument("--out", default=None, help="rank 0 writes all ranks' results here")
    args = parser.parse_args(argv)
    device = _setup()
    try:
        if args.ep is None:
            args.ep = dist.get_world_size() // args.dp
        result = MODES[args.mode](args, device)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, result)
        if dist.get_rank() == 0:
            report = {"mode": args.mode, "results": gathered}
            print("RESULT " + json.dumps(report))
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(report, f, indent=1)
    finally:
        dist.destroy_process_group()
    return 0


def launch(nproc: int, *args: str, timeout: float | None = None, echo: bool = True) -> dict:
    """Run `torchrun --nproc_per_node=nproc -m moe_tutorial.train_dist *args` as a subprocess
    (what a notebook calls), streaming its output; returns rank 0's gathered results."""
    env = {**os.environ, **distributed.SAFE_NCCL_ENV}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", "-m", "moe_tutorial.train_dist", *args]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    result, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
        elif echo:
            print(line, end="")
    proc.wait(timeout=timeout)
    if proc.returncode != 0 or result is None:
        # The ranks' own exception lines say what went wrong; torchrun's summary does not.
        errors = [line for line in lines if re.match(r"\[rank\d+\]: \w*(Error|Exception)\b", line)]
        detail = "".join(errors[:2]) or "".join(lines[-30:])
        raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{detail}")
    return result


if __name__ == "__main__":
    sys.exit(main())
