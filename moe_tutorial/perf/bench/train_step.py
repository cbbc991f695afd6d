"""The training step: forward + backward + optimizer step of a whole model per variant, its
first loss checked against the first variant's before it is timed (`bench_train_step`), and
profiled by kernel (`profile_train_step`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...moe.batch import next_token_targets
from ...train.loop import loss_of, train_step
from ..host_syncs import count_host_syncs
from ..timing import (
    allocator_retries,
    model_flops_per_token,
    peak_memory_gb,
    reset_memory,
    resident_gb,
    tflops,
    time_fn,
)
from .expert_layer import classify_error
from .variants import TRAIN_VARIANTS, Variant, variant


def timed_step(module, forward, optimizer, batch):
    """The training loop's own step (`train.train_step`) as the benchmark times it: no gradient
    clipping and no per-step host sync for the divergence guard — the step the committed
    measurements and HF's baseline step are."""
    return lambda: train_step(module, batch, optimizer, grad_clip=None, forward=forward,
                              guard=False)


def sync_record(step, on_gpu: bool) -> dict:
    """How many times one more call of the (warmed-up) step makes the host wait for the GPU, and
    where (torch's sync debug mode: `host_syncs.count_host_syncs`)."""
    if not on_gpu:
        return {}
    from collections import Counter

    count, places = count_host_syncs(step)
    return {"host_syncs_per_step": count,
            "host_sync_places": dict(Counter(places).most_common(12))}


@torch.no_grad()
def initial_loss(module, forward, inputs, targets) -> float:
    """The loss at the initial weights (nothing of the forward pass outlives this call)."""
    return loss_of((forward or module)(inputs, targets)).item()


def random_batch(config, batch: int, seq_len: int, device):
    """Seeded random token ids and their next-token targets (every variant gets the same)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen).to(device)
    return ids, next_token_targets(ids)


def bench_train_step(config, variants=TRAIN_VARIANTS, *, batch: int = 2, seq_len: int = 4096,
                     device="cuda", warmup: int = 5, iters: int = 20, lr: float = 1e-5,
                     optimizer: str = "torch_adamw",
                     on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Time forward + backward + optimizer step per variant (names or `Variant`s), after checking
    its first loss against the first variant's (same weights, same batch)."""
    inputs, targets = random_batch(config, batch, seq_len, device)
    tokens = batch * seq_len
    flops_per_step = model_flops_per_token(config, seq_len) * tokens
    reference_loss = None
    results = []
    for v in map(variant, variants):
        row = dict(part="train", variant=v.name, batch=batch, seq_len=seq_len, tokens=tokens,
                   flops=flops_per_step, precision=v.precision_kind)
        module = forward = opt = None
        try:
            reset_memory(device)
            row["resident_before_gb"] = resident_gb(device)  # in this row's peak too
            module, forward = v.build(config, device)
            opt = v.optimizer(module, lr, optimizer)
            row["optimizer"] = type(opt).__module__ + "." + type(opt).__name__
            first_loss = initial_loss(module, forward, inputs, targets)
            if reference_loss is None:
                reference_loss = first_loss
            row.update(first_loss=first_loss, loss_diff=abs(first_loss - reference_loss))
            row["loss_tolerance"] = 0.05 if v.precision_kind == "fp8" else 0.02  # nats, at ~ln V
            if row["loss_diff"] > row["loss_tolerance"]:
                row["status"] = "wrong"
            else:
                retries = allocator_retries(device)
                step = timed_step(module, forward, opt, (inputs, targets))
                t = time_fn(step, warmup=warmup, iters=iters, device=device)
                tokens_per_s = tokens / (t.median_ms / 1e3)
                row.update(status="ok", median_ms=t.median_ms, min_ms=t.min_ms, timer=t.timer,
                           tokens_per_s=tokens_per_s, tflops=tflops(flops_per_step, t.median_ms),
                           peak_memory_gb=peak_memory_gb(device))
                if retries is not None:  # the timed steps ran short of memory (timing.py)
                    row["allocator_retries"] = allocator_retries(device) - retries
                if not v.hf:
                    row["path"] = module.expert_paths()[0]
                row.update(sync_record(step, torch.device(device).type == "cuda"))
        except torch.cuda.OutOfMemoryError:
            row["status"] = "OOM"
        except Exception as exc:
            row.update(classify_error(exc))
        finally:
            del module, forward, opt  # free this variant's ~30 GB before the next one
        results.append(row)
        if on_result is not None:
            on_result(row)
    return results


def profile_train_step(config, name: str | Variant, *, batch: int = 2, seq_len: int = 4096,
                       device="cuda", steps: int = 3, row_limit: int = 25) -> str:
    """torch.profiler over a few training steps of one variant (the step `bench_train_step`
    times): where the time goes (GPU time per kernel, kernel counts), as a printable table."""
    from torch.profiler import ProfilerActivity, profile

    v = variant(name)
    batch_ = random_batch(config, batch, seq_len, device)
    module, forward = v.build(config, device)
    step = timed_step(module, forward, v.optimizer(module, 1e-5), batch_)
    wall = time_fn(step, warmup=2, iters=3, device=device).median_ms
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    on_gpu = torch.device(device).type == "cuda"
    averages = prof.key_averages()
    sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    busy = ""
    if on_gpu:  # GPU time spent in kernels vs the step's wall time: the rest is idle (launch/sync)
        # Only the kernels themselves: operator rows repeat their kernels' time.
        kernels = [e for e in averages if e.device_type.name == "CUDA"]
        kernel_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
        launches = sum(e.count for e in kernels) / steps
        busy = (f"step {wall:.1f} ms (unprofiled median); kernels {kernel_ms:.1f} ms per step "
                f"({100 * kernel_ms / wall:.0f}% busy), {launches:.0f} kernel launches per step\n")
    return (f"profile of {v.name}, {steps} steps\n{busy}"
            + averages.table(sort_by=sort, row_limit=row_limit))
