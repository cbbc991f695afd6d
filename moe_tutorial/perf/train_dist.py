"""Expert-parallel training, launched with torchrun: `check`, `train` or `bench` a (dp, ep) layout.

    torchrun --nproc_per_node=2 -m moe_tutorial.perf.train_dist --mode check --dp 1 --ep 2
    torchrun --nproc_per_node=2 -m moe_tutorial.perf.train_dist --mode train --dp 1 --ep 2 --steps 50
    torchrun --nproc_per_node=2 -m moe_tutorial.perf.train_dist --mode bench --preset mixtral-2l \\
        --dp 1 --ep 2 --backend te_ops --precision fp8 --out ep2.json
    torchrun --nproc_per_node=2 -m moe_tutorial.perf.train_dist --mode bench --preset mixtral-2l \\
        --model hf --dp 2 --ep 1

NCCL on GPUs (one process per GPU), gloo on CPUs. The data-parallel engine is FSDP2
(`--engine fsdp2`, `distributed.fully_shard_layout`); `--engine replicated` keeps full copies
and averages the gradients by hand (`distributed.average_gradients`), the arithmetic notebook 07
explains and the baseline the benchmark compares with. `--state-dtype float32` keeps FSDP2's
sharded weights, gradients and AdamW moments in fp32 and computes in the preset's dtype
(`--dtype`); `--activation-checkpointing` recomputes each decoder layer in the backward pass.
`check` proves the layout computes what one process computes: every rank also runs the full
model on the global batch and compares its loss, logits and gradients. `bench` reports tokens/s
per GPU, the recipe's PFLOP/s per GPU (6 × active parameters × tokens/s/GPU), peak memory, and
NCCL's kernels per step by kind (from torch.profiler); `--model hf` benches the HF baseline (transformers' MixtralForCausalLM,
grouped_mm experts, bf16) the same way, data parallel only. `launch()` runs any of these as a
subprocess for a notebook; `benchmarks.matrix` runs every layout of a machine.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import safe_io
from ..arguments import check_count, check_positive_number
from ..moe.batch import next_token_targets
from ..moe.config import DTYPES
from ..moe.experts import TE_BACKENDS
from ..moe.hf_baseline import hf_mixtral, hf_training_loss
from ..moe.model import MoEForCausalLM, is_expert_parameter
from ..parallel import dist_checkpoint, distributed
from ..parallel.dist_checkpoint import ShardedCheckpointing
from ..precision import recipes
from ..precision.quant import rel_error
from ..train.checkpoint import check_directory, check_same_run
from ..train.data import load_protein_data
from ..train.loop import (
    TrainingDiverged,
    TrainSettings,
    _settings_dict,
    check_learned,
    evaluate,
    make_optimizer,
    train_step,
)
from ..train.loop import train as train_loop
from . import memory
from .dist_model import (
    DTYPE_NAMES,
    dtypes,
    from_hf_checkpoint,
    global_batch,
    model_config,
    parallelize,
    starve_experts,
)
from .step_profile import profile_step
from .timing import allocator_retries, environment, time_fn


def _setup() -> torch.device:
    distributed.apply_safe_env()
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


ENGINES = ("fsdp2", "replicated")


def check(args, device) -> dict:
    """Distributed forward/backward vs the single-process model on the same global batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = model_config(args, aux_loss_coef=0.0)  # the aux loss is per rank (local balance)
    compute, state = dtypes(args, config)
    layout = distributed.init_layout(args.dp, args.ep, config.num_experts)
    # The one-process model computes in the compute dtype, as the layout's gathered layers do; the
    # layout keeps the same weights in the state dtype.
    torch.manual_seed(0)
    one_process = MoEForCausalLM(config.with_overrides(dtype=DTYPE_NAMES[compute]), device=device)
    model = copy.deepcopy(one_process)
    model.set_expert_backend(args.backend)
    distributed.shard_experts(model, layout)
    # Where the gathered gradients land, in the backend's own parameter layout (FSDP2 turns the
    # model's parameters into shards)
    # (sharing the layout: its process groups cannot be copied)
    unsharded = (copy.deepcopy(model, memo={id(layout): layout}).to(state)
                 if args.engine == "fsdp2" else model)
    after_backward = parallelize(model, args, layout, compute, state)
    ids = global_batch(config, world, args.batch, args.seq_len, device)
    mine = slice(rank * args.batch, (rank + 1) * args.batch)
    starve = ([] if args.starve_rank is None else
              list(range(args.starve_rank * config.num_experts // args.ep,
                         (args.starve_rank + 1) * config.num_experts // args.ep)))
    with starve_experts(starve, one_process, model):
        # The global batch in one process, as rank-sized micro-batches whose gradients add up
        # (each loss / world: the mean over all of them). The same sums as one big batch, and
        # the forward passes have the ranks' shapes, so in bf16 they round alike: a token near a
        # tie between two experts cannot pick another one in the one-process model.
        ref_losses, ref_logits = [], []
        for r in range(world):
            part = ids[r * args.batch:(r + 1) * args.batch]
            ref_out = one_process(part, next_token_targets(part))
            (ref_out.loss / world).backward()
            ref_losses.append(ref_out.loss.detach().float())
            ref_logits.append(ref_out.logits.detach())
        out = model(ids[mine], next_token_targets(ids[mine]))
        out.loss.backward()
    if after_backward is not None:
        after_backward()

    # Every rank's loss is the mean over its equally many tokens: their mean is the global one.
    loss = out.loss.detach().float()
    dist.all_reduce(loss)
    errors = {"loss": rel_error(loss / world, torch.stack(ref_losses).mean()),
              "logits": rel_error(out.logits, ref_logits[rank])}
    grads = distributed.full_gradients(model)
    if unsharded is not model:
        params = dict(unsharded.named_parameters())
        for name, grad in grads.items():
            params[name].grad = grad
    ref_params = dict(one_process.named_parameters())
    for name, grad in grads.items():
        if not is_expert_parameter(name):
            errors[name] = rel_error(grad, ref_params[name].grad)
    # Expert gradients in HF layout (whatever the backend's own layout): this rank's shard.
    per_rank = config.num_experts // args.ep
    first = layout.ep_rank * per_rank
    for i, (layer, ref_layer) in enumerate(zip(unsharded.model.layers, one_process.model.layers)):
        ref_grads = ref_layer.mlp.experts.hf_gradients()
        for what, grad, ref in zip(("gate_up_proj", "down_proj"), layer.mlp.experts.hf_gradients(),
                                   ref_grads):
            errors[f"model.layers.{i}.mlp.experts.{what}"] = rel_error(
                grad, ref[first:first + per_rank])
    # The norm the training loop clips by: the whole model's, from every rank's shard (an
    # infinite max_norm measures it without scaling anything)
    errors["gradient norm"] = rel_error(
        distributed.clip_grad_norm(model, layout, float("inf")),
        torch.nn.utils.clip_grad_norm_(one_process.parameters(), float("inf")))
    worst = max(errors, key=errors.get)
    state_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    return {"rank": rank, "dp": args.dp, "ep": args.ep, "engine": args.engine,
            "compared": len(errors), "errors": errors, "max_rel_error": errors[worst],
            "worst": worst,
            "starved_experts": starve, "path": model.expert_paths()[0],
            "parameter_dtypes": state_dtypes,
            "sharded": any(isinstance(p, DTensor) for p in model.parameters())}


MODELS = ("ours", "hf")
# NCCL's kernels by the words in their names: FSDP2's all-gathers and reduce-scatters, the
# replicated engine's all-reduces, expert parallelism's all-to-alls (sendrecv on some versions).
NCCL_KERNELS = ("allgather", "reducescatter", "allreduce", "alltoall", "sendrecv")
# What `--model hf` runs, as results name it (bench's name for the same baseline).
HF_BASELINE = "hf_grouped_mm"
HF_PATH = "HF transformers MixtralForCausalLM, experts_implementation='grouped_mm', sdpa attention"


def check_hf_args(args) -> None:
    """The HF baseline is transformers' model as HF users train it: no expert parallelism (every
    rank holds all experts, so ep must be 1) and no FP8."""
    if args.ep != 1:
        raise ValueError(f"--model hf has no expert parallelism (transformers' MixtralForCausalLM "
                         f"keeps every expert on every rank): pass --ep 1 --dp <world size>, "
                         f"not --dp {args.dp} --ep {args.ep}")
    if args.precision != "bf16":
        raise ValueError(f"--model hf trains in bf16 only, not --precision {args.precision}: "
                         f"FP8 is what our model adds (use --model ours)")


def _bench_model(args, config, layout, device):
    """(module, forward for `train_step`, after_backward) of the benchmarked model, under the
    data-parallel engine. Both models start from the same seeded weights: HF's is a copy of
    ours (`hf_mixtral`), so shapes and values match."""
    compute, state = dtypes(args, config)
    torch.manual_seed(0)
    model = MoEForCausalLM(config.with_overrides(dtype=DTYPE_NAMES[compute]), device=device)
    if args.model == "hf":
        hf = hf_mixtral(model, "grouped_mm")
        del model  # only HF's copy of the weights stays on the device
        if args.activation_checkpointing:  # HF's decoder layers, as ours: before FSDP2
            distributed.checkpoint_activations(hf)
        after_backward = None
        if args.engine == "replicated":
            after_backward = lambda: distributed.average_gradients(hf, layout)  # noqa: E731
        else:
            hf.to(state)
            distributed.fully_shard_decoder(hf, hf.model.layers,
                                            mp_policy=distributed.mixed_precision(compute, state))
        # HF shifts labels=input_ids itself: the targets next_token_targets gives ours
        return hf, lambda inputs, targets: hf_training_loss(hf, inputs), after_backward
    model.set_expert_backend(args.backend)
    model.set_precision(args.precision)
    distributed.shard_experts(model, layout)
    return model, None, parallelize(model, args, layout, compute, state)


def predicted_peak_gib(config, *, batch: int, seq_len: int, dp: int, ep: int, engine: str,
                       precision: str, backend: str, state_dtype: str | None = None,
                       activation_checkpointing: bool = False) -> float | None:
    """What `memory.predict` expects one GPU of a bench run to peak at, in GiB, to set beside the
    measured peak (the HF baseline, `backend` HF_BASELINE, as our model with its shapes and
    grouped_torch experts). None for FP8 without TE experts: such a run stops before its step."""
    backend = backend if backend in memory.BACKENDS else "grouped_torch"
    if precision != "bf16" and backend not in TE_BACKENDS:
        return None
    return memory.gib(memory.predict(
        config, batch=batch, seq_len=seq_len, dp=dp, ep=ep, engine=engine,
        precision=precision, backend=backend, state_dtype=state_dtype,
        activation_checkpointing=activation_checkpointing).peak)


def bench(args, device) -> dict:
    """Training-step throughput of one (dp, ep) layout, per GPU, with the communication's share.
    `--model hf`: the HF baseline instead of ours, data parallel only (same engine, same
    optimizer, same batches)."""
    from torch.profiler import ProfilerActivity, profile

    if args.model == "hf":
        check_hf_args(args)
    world = dist.get_world_size()
    config = model_config(args)
    if device.type == "cpu" and args.dtype is None:
        config = config.with_overrides(dtype="float32")
    compute, state = dtypes(args, config)
    layout = distributed.init_layout(args.dp, args.ep, config.num_experts)
    ids = global_batch(config, world, args.batch, args.seq_len, device)
    rank = dist.get_rank()
    mine = ids[rank * args.batch:(rank + 1) * args.batch]
    model, forward, after_backward = _bench_model(args, config, layout, device)
    optimizer = make_optimizer(model, TrainSettings(lr=1e-5, steps=2, warmup_steps=0))

    def step():  # the training loop's step, timed as bench times it (no clipping, no sync)
        train_step(model, (mine, next_token_targets(mine)), optimizer, grad_clip=None,
                   forward=forward, guard=False, after_backward=after_backward)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    retries = allocator_retries(device)
    timing = time_fn(step, warmup=args.warmup, iters=args.iters, device=device)
    retries = None if retries is None else allocator_retries(device) - retries
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
                   for kind in NCCL_KERNELS}
    peak_gb = (torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda"
               else None)
    predicted_gb = predicted_peak_gib(
        config.with_overrides(dtype=DTYPE_NAMES[compute]), batch=args.batch,
        seq_len=args.seq_len, dp=args.dp, ep=args.ep, engine=args.engine,
        precision=args.precision, backend=args.backend if args.model == "ours" else HF_BASELINE,
        state_dtype=DTYPE_NAMES[state], activation_checkpointing=args.activation_checkpointing)
    result = {"rank": rank, "dp": args.dp, "ep": args.ep, "world": world, "engine": args.engine,
              "environment": environment() if rank == 0 else None, "preset": args.preset,
              "layers": config.num_layers,
              "model": args.model, "backend": HF_BASELINE if args.model == "hf" else args.backend,
              "precision": args.precision, "dtype": DTYPE_NAMES[compute],
              "state_dtype": DTYPE_NAMES[state],
              "activation_checkpointing": args.activation_checkpointing,
              "batch_per_gpu": args.batch, "seq_len": args.seq_len,
              "median_ms": timing.median_ms, "tokens_per_s_per_gpu": tokens_per_s,
              "pflops_per_gpu": 6 * config.active_params_per_token() * tokens_per_s / 1e15,
              "peak_memory_gb": peak_gb, "predicted_peak_gb": predicted_gb,
              "memory_prediction_error": (predicted_gb / peak_gb - 1 if peak_gb else None),
              "allocator_retries": retries,
              "nccl_kernel_ms_per_step": comm_ms,
              "path": HF_PATH if args.model == "hf" else model.expert_paths()[0]}
    if args.breakdown:  # the step's time by part, communication included (CPU: gloo)
        result["step_breakdown"] = profile_step(step, device=device, warmup=0).to_dict()
    return result


def train(args, device) -> dict:
    """Expert-parallel training on the shipped protein data with the course's loop
    (`train.train`): each rank its own batches, the gradients those of the global batch (the
    engine's reduction), clipped by the whole model's norm."""
    rank, world = dist.get_rank(), dist.get_world_size()
    config = model_config(args)
    compute, state = dtypes(args, config)
    layout = distributed.init_layout(args.dp, args.ep, config.num_experts)
    data = load_protein_data(config.max_seq_len, max_sequences=args.max_sequences)
    if args.hf_checkpoint:
        model, after_backward = from_hf_checkpoint(args, config, layout, device, compute,
                                                   state), None
    else:
        torch.manual_seed(0)  # the same initial weights on every rank
        model = MoEForCausalLM(config.with_overrides(dtype=DTYPE_NAMES[compute]), device=device)
        model.set_expert_backend(args.backend)
        distributed.shard_experts(model, layout)
        after_backward = parallelize(model, args, layout, compute, state)
    # The same settings on every rank (a checkpoint holds one copy); each rank trains on its
    # own share of the windows, as torch's DistributedSampler deals them out.
    settings = train_settings(args)
    checkpointing = (ShardedCheckpointing(args.checkpoint_dir, layout, args.checkpoint_every)
                     if args.checkpoint_dir else None)
    start = time.perf_counter()

    def log(record):
        if rank == 0 and record["step"] % max(1, args.steps // 10) == 0:
            print(f"step {record['step']:>5}  loss {record['lm_loss']:.3f} (rank 0)", flush=True)

    history = train_loop(model, data.train[rank::world], settings, on_step=log, progress=False,
                         checkpoint=checkpointing, resume=args.resume,
                         after_backward=after_backward,
                         clip_grad_norm=lambda max_norm: distributed.clip_grad_norm(
                             model, layout, max_norm))
    elapsed = time.perf_counter() - start
    losses = torch.tensor([r["lm_loss"] for r in history], device=device)
    dist.all_reduce(losses)  # one collective for the whole curve: the mean over ranks per step
    # The same mean curve on every rank: all of them agree whether the run diverged
    check_learned([{**r, "loss": loss / world} for r, loss in zip(history, losses.tolist())],
                  config.vocab_size, args.lr)
    val = evaluate(model, data.val, args.batch, max_batches=4)
    return {"rank": rank, "dp": args.dp, "ep": args.ep, "engine": args.engine,
            "history": [{"step": r["step"], "loss": loss / world, "elapsed_s": r["elapsed_s"]}
                        for r, loss in zip(history, losses.tolist())],
            "val_loss": val, "unigram_nats": data.unigram_nats,
            "tokens_per_s_per_rank": args.steps * args.batch * config.max_seq_len / elapsed}


MODES = {"check": check, "bench": bench, "train": train}


def train_settings(args):
    """The training settings of `--mode train`, the same on every rank."""

    return TrainSettings(steps=args.steps, batch_size=args.batch, lr=args.lr,
                         warmup_steps=max(1, args.steps // 10), eval_every=0)


def check_run_arguments(args: argparse.Namespace) -> None:
    """Refuse, before any process group or training, a count or learning rate out of range
    (named by its flag, as `python -m moe_tutorial train` names them), and a --checkpoint-dir
    the run cannot use: unwritable or a dangling link, held by another run, holding another
    run's checkpoints without --resume, or (--resume) holding a checkpoint saved with other
    settings. A ValueError (`checkpoint.CheckpointError`, `safe_io.FolderBusy`) whose message
    names the fix."""
    for flag in ("--dp", "--batch", "--seq-len", "--steps", "--max-sequences", "--iters"):
        check_count(flag, getattr(args, flag[2:].replace("-", "_")))
    check_count("--warmup", args.warmup, least=0)
    check_positive_number("--lr", args.lr)
    if args.mode != "train" or not args.checkpoint_dir:
        return
    check_directory(args.checkpoint_dir, args.resume, steps=dist_checkpoint.complete_steps)
    safe_io.check_folder_free(args.checkpoint_dir, "distributed training run")
    if args.resume:
        path = dist_checkpoint.latest(args.checkpoint_dir)
        saved = dist_checkpoint._read_meta(path)["run"].get("settings", {})
        check_same_run({"path": path}, "settings", saved, _settings_dict(train_settings(args)))


def parse_args(argv=None, check: bool = True) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moe_tutorial.perf.train_dist", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=sorted(MODES), default="check")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=None, help="default: the world size")
    parser.add_argument("--model", choices=MODELS, default="ours",
                        help="bench mode: ours, or hf (transformers' MixtralForCausalLM with "
                             "grouped_mm experts, bf16, --ep 1)")
    parser.add_argument("--engine", choices=ENGINES, default="fsdp2",
                        help="fsdp2 (torch's fully_shard on the (dp, ep) mesh), or replicated "
                             "(full copies, gradients averaged by hand: the baseline)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--layers", type=int, default=None,
                        help="the preset with this many decoder layers (default: the preset's)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="the compute dtype (default: the preset's; float32 for a CPU bench)")
    parser.add_argument("--state-dtype", choices=sorted(DTYPES), default=None,
                        help="fsdp2: the dtype of the sharded weights, their gradients and "
                             "AdamW's moments (default: the compute dtype)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each decoder layer in the backward pass")
    parser.add_argument("--backend", default="grouped_torch")
    parser.add_argument("--precision", default="bf16", choices=recipes.PRECISION_NAMES,
                        help="fp8: the fastest FP8 recipe this GPU runs (recipes.resolve)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-sequences", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--breakdown", action="store_true",
                        help="bench mode: also profile the step's time by part "
                             "(step_profile.StepBreakdown, as step_breakdown)")
    parser.add_argument("--hf-checkpoint", default=None, metavar="DIR",
                        help="train mode: start from a Hugging Face checkpoint (save_pretrained "
                             "directory; its config.json replaces --preset), each rank reading "
                             "only its shards")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="train mode: every rank saves its shards here "
                             "(dist_checkpoint.ShardedCheckpointing)")
    parser.add_argument("--checkpoint-every", type=int, default=100,
                        help="train mode: steps between checkpoints (and one after the last)")
    parser.add_argument("--resume", action="store_true",
                        help="train mode: continue from the newest complete checkpoint in "
                             "--checkpoint-dir, whatever layout saved it")
    parser.add_argument("--starve-rank", type=int, default=None,
                        help="check mode: route no token to this EP rank's experts")
    parser.add_argument("--out", default=None, help="rank 0 writes all ranks' results here")
    args = parser.parse_args(argv)
    if check:
        try:
            check_run_arguments(args)
        except ValueError as exc:  # the user's setup: one line (from rank 0), exit status 2
            if os.environ.get("RANK", "0") == "0":
                print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
    if args.model != "ours" and args.mode != "bench":
        parser.error(f"--model {args.model} is for --mode bench only")
    if args.hf_checkpoint and args.mode != "train":
        parser.error("--hf-checkpoint is for --mode train")
    for flag, value in (("--checkpoint-dir", args.checkpoint_dir), ("--out", args.out)):
        if value is not None and not str(value).strip():
            parser.error(f"{flag} is empty (an unset variable?): give a path, or leave {flag} out")
    if args.resume and not args.checkpoint_dir:
        parser.error("--resume continues from a checkpoint: give its --checkpoint-dir")
    return args


def run(args: argparse.Namespace, device: torch.device) -> dict:
    """This rank's result of `args.mode`, in an initialised process group (torchrun's, or a
    test's `ranks.run`)."""
    if args.ep is None:
        args.ep = dist.get_world_size() // args.dp
    return MODES[args.mode](args, device)


def claim_out(args: argparse.Namespace, claim: contextlib.ExitStack) -> bool:
    """Rank 0, the rank that writes `--out`, claims it into `claim` (`safe_io.claim_output`)
    before the work, so a second run writing the same file stops at once instead of both
    running and one result silently replacing the other. Every rank learns the outcome (one
    broadcast): a refused claim stops them all, none waiting in a collective for a rank 0 that
    stopped. Rank 0 says why in one line. True: this rank stops."""
    if not args.out:  # the same arguments on every rank: all skip the broadcast together
        return False
    refusal = [None]
    if dist.get_rank() == 0:
        try:  # an existing file is replaced, as before claims: `launch` gives a fresh name
            claim.enter_context(safe_io.claim_output(args.out, "`train_dist`", replace=True,
                                                     flag="--out"))
        except safe_io.REFUSALS as exc:
            refusal = [safe_io.refusal_line(exc)]
            print(f"error: {refusal[0]}", file=sys.stderr, flush=True)
    dist.broadcast_object_list(refusal, src=0)
    return refusal[0] is not None


def main(argv=None) -> int:
    args = parse_args(argv)
    device = _setup()

    try:
        with contextlib.ExitStack() as claim:
            if claim_out(args, claim):
                return 2
            try:
                result = run(args, device)
            except (ValueError, TrainingDiverged) as exc:
                # The user's setup or a failed training (a damaged checkpoint, a diverged loss):
                # the same on every rank, so one line from rank 0, which `launch` reports alone
                if dist.get_rank() == 0:
                    print(f"error: {exc}", file=sys.stderr, flush=True)
                return 1 if isinstance(exc, TrainingDiverged) else 2
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, result)
            if dist.get_rank() == 0:
                report = {"mode": args.mode, "results": gathered}
                print("RESULT " + json.dumps(report))
                if args.out:  # whole or not at all: `launch` trusts a file that exists
                    safe_io.write_json(args.out, report, replace=True)
    finally:
        dist.destroy_process_group()
    return 0


def torchrun_command(nproc: int, *args: str) -> list[str]:
    """The command `launch` runs: torchrun (as this Python's module) with `nproc` processes."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={nproc}", "-m", "moe_tutorial.perf.train_dist", *args]


def launch(nproc: int, *args: str, timeout: float | None = None, echo: bool = True) -> dict:
    """Run `torchrun --nproc_per_node=nproc -m moe_tutorial.perf.train_dist *args` as a subprocess
    (what a notebook calls), streaming its output; returns rank 0's gathered results. After
    `timeout` seconds torchrun is stopped (it stops its ranks): a rank stuck in a collective
    whose peer died must not hang the caller.

    The results come back through a file (`--out`), not the printed RESULT line: the ranks and
    torchrun share one pipe, and a line another process writes can land inside the RESULT line
    of a block-buffered rank, which then no longer parses."""
    if "--out" in args:
        raise ValueError("launch writes the results to its own --out file and returns them; "
                         "save the returned dict instead of passing --out")
    try:
        parsed = parse_args(list(args), check=False)
    except SystemExit:  # argparse's own message: the ranks print it, as before
        parsed = None
    if parsed is not None:
        check_run_arguments(parsed)  # before torchrun starts: one line, not every rank's
    with tempfile.TemporaryDirectory(prefix="train_dist_") as scratch:
        out = os.path.join(scratch, "results.json")
        cmd = torchrun_command(nproc, *args, "--out", out)
        lines, returncode, timed_out = _stream(cmd, timeout, echo)
        if timed_out:
            raise RuntimeError(f"{shlex.join(cmd)} timed out after {timeout:g} s and was "
                               f"stopped:\n" + "".join(lines[-30:]))
        detail = ""
        said = [line.removeprefix("error: ").strip() for line in lines
                if line.startswith("error: ")]
        if returncode != 0 and said:  # rank 0 said what the user can fix: that line alone
            raise RuntimeError(said[0])
        if returncode != 0:
            # The ranks' own exception lines say what went wrong; torchrun's summary does not.
            # (Qualified names too: a CUDA OOM is `torch.OutOfMemoryError`.) A rank that died
            # in C++ (SIGABRT, SIGSEGV) says so before torchrun's summary, in lines of its own.
            errors = [line for line in lines
                      if re.match(r"\[rank\d+\]: [\w.]*(Error|Exception)\b", line)]
            crashes = [line for line in lines if re.search(
                r"terminate called|what\(\):|Fatal Python error|Segmentation fault|bad_alloc",
                line)]
            detail = "".join(errors[:2] + crashes[:4]) or "".join(lines[-30:])
        if not os.path.exists(out):
            raise RuntimeError(f"{shlex.join(cmd)} failed (exit {returncode}):\n{detail}")
        with open(out) as f:
            results = json.load(f)
        if returncode != 0:
            # Every rank finished its work and rank 0 wrote the gathered results (atomically)
            # before a process died: the crash came while shutting down (seen on gloo, rarely:
            # "terminate called without an active exception"). The results are whole; say so.
            print(f"warning: {shlex.join(cmd)} exited {returncode} after every rank's results "
                  f"were gathered and written (a crash while shutting down); the results are "
                  f"complete:\n{detail}", file=sys.stderr)
            results["shutdown_crash"] = detail.strip()
        return results


def _stream(cmd: list[str], timeout: float | None, echo: bool) -> tuple[list[str], int, bool]:
    """Run `cmd`, echoing its output (the RESULT line aside); (lines, exit code, timed out)."""
    env = {**os.environ, **distributed.SAFE_NCCL_ENV}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    timed_out = threading.Event()

    def stop():
        timed_out.set()
        proc.terminate()

    watchdog = threading.Timer(timeout, stop) if timeout else None
    if watchdog:
        watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if echo and not line.startswith("RESULT "):
                print(line, end="")
        proc.wait()
    finally:
        if watchdog:
            watchdog.cancel()
        if proc.poll() is None:  # interrupted while reading (Ctrl-C): stop the ranks too
            proc.terminate()
            proc.wait()
    return lines, proc.returncode, timed_out.is_set()


if __name__ == "__main__":
    sys.exit(main())
