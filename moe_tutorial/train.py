"""The training loop the notebooks and benchmarks share.

AdamW, linear warm-up then cosine decay to `min_lr_ratio × lr`, gradient clipping, loss = LM loss +
aux_loss_coef × load-balancing loss, a `tqdm.auto` progress bar with tokens/s, periodic
validation, and a guard that stops with a clear message when the loss stops being finite.
Seeded: the same settings give the same curve on the same machine.

    history = train(model, data.train, TrainSettings(steps=300), val=data.val)
    history[-1]["val_loss"]

Each record of the returned history is a dict (step, lr, loss, lm_loss, aux_loss, grad_norm,
tokens, elapsed_s (wall clock), tokens_per_s (training steps only), and val_loss on evaluation steps), so a notebook can tabulate
or plot it directly; `on_step(record)` receives each one as it is made (live widgets).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from . import hardware
from .data import iterate_batches


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    warmup_steps: int = 30
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_every: int = 50  # validation every N steps (and after the last step); 0 = never
    eval_batches: int = 8
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainSettings.{name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"TrainSettings.warmup_steps={self.warmup_steps} must be in "
                             f"[0, steps={self.steps})")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainSettings: lr={self.lr} must be > 0 and "
                             f"min_lr_ratio={self.min_lr_ratio} in [0, 1]")


def learning_rate(step: int, s: TrainSettings) -> float:
    """Linear warm-up over `warmup_steps`, then cosine from lr to lr * min_lr_ratio (step 0-based)."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - 1 - s.warmup_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN or infinite."""


OPTIMIZERS = ("torch_adamw", "te_fused_adam")


def make_optimizer(model: torch.nn.Module, s: TrainSettings,
                   kind: str = "torch_adamw") -> torch.optim.Optimizer:
    """AdamW; matrices decay, vectors (norm weights) do not.

    `torch_adamw` (the default): torch's AdamW, fused on a GPU. `te_fused_adam`: TE's
    FusedAdam, its moments kept in the parameters' dtype like torch's (fp32 moments would add 8
    bytes per parameter). With bf16 parameters TE's converts the moments through fp32 buffers
    and was slower than torch's fused AdamW on the H200 (`bench --optimizer te_fused_adam`
    measures both), so it is not the default."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {kind!r}; choose one of {OPTIMIZERS}")
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    first = next(model.parameters())
    if kind == "te_fused_adam":
        te = hardware.transformer_engine() if first.is_cuda else None
        if te is None:
            raise ValueError("te_fused_adam needs Transformer Engine and a CUDA device")
        moments = first.dtype if first.dtype in (torch.float32, torch.bfloat16) else torch.float32
        return te.optimizers.FusedAdam(groups, lr=s.lr, betas=s.betas, adam_w_mode=True,
                                       exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    return torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, fused=first.is_cuda or None)


@torch.no_grad()
def evaluate(model: torch.nn.Module, packed: torch.Tensor, batch_size: int,
             max_batches: int | None = None) -> float:
    """Mean next-token cross-entropy (nats) over the first `max_batches` batches of `packed`."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    batches = iterate_batches(packed, min(batch_size, packed.shape[0]), shuffle=False, epochs=1)
    for i, (inputs, targets) in enumerate(batches):
        if max_batches is not None and i >= max_batches:
            break
        out = model(inputs.to(device), targets.to(device))
        total += out.lm_loss.item() * targets.numel()
        count += targets.numel()
    model.train(was_training)
    return total / count


def train(model: torch.nn.Module, packed: torch.Tensor, settings: TrainSettings = TrainSettings(),
          *, val: torch.Tensor | None = None, on_step: Callable[[dict], None] | None = None,
          progress: bool = True) -> list[dict]:
    """Train `model` on packed windows ([n, seq_len + 1] token ids); returns the history."""
    s = settings
    torch.manual_seed(s.seed)
    device = next(model.parameters()).device
    optimizer = make_optimizer(model, s)
    batches = iterate_batches(packed, s.batch_size, shuffle=True, seed=s.seed)
    model.train()
    history: list[dict] = []
    tokens_seen, train_time, start = 0, 0.0, time.perf_counter()
    bar = tqdm(range(s.steps), desc="training", unit="step", disable=not progress)
    for step in bar:
        step_start = time.perf_counter()
        lr = learning_rate(step, s)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
        out = model(inputs, targets)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        loss, grad_norm = out.loss.item(), grad_norm.item()  # one sync per step, for the guard
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise TrainingDiverged(
                f"step {step}: loss={loss}, gradient norm={grad_norm} — training diverged "
                f"(lr={lr:.3g}). Lower TrainSettings.lr (try {s.lr / 3:.3g}), lengthen warmup_steps, "
                f"or train in float32 / bfloat16 rather than float16.")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        tokens_seen += targets.numel()
        train_time += time.perf_counter() - step_start  # throughput excludes evaluation
        record = dict(step=step + 1, lr=lr, loss=loss, lm_loss=out.lm_loss.item(),
                      aux_loss=out.aux_loss.item(), grad_norm=grad_norm, tokens=tokens_seen,
                      elapsed_s=time.perf_counter() - start, tokens_per_s=tokens_seen / train_time)
        last = step + 1 == s.steps
        if val is not None and s.eval_every and ((step + 1) % s.eval_every == 0 or last):
            record["val_loss"] = evaluate(model, val, s.batch_size, s.eval_batches)
        history.append(record)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
        if on_step is not None:
            on_step(record)
    return history
