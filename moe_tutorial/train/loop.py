"""The one training loop: the command line, the notebooks, the expert-parallel launcher and the
benchmark's loss curves all train with `train`, and time or profile its `train_step`.

AdamW, linear warm-up then cosine decay to `min_lr_ratio × lr`, gradient clipping, loss = LM loss +
aux_loss_coef × load-balancing loss, a `tqdm.auto` progress bar with tokens/s, periodic
validation, a guard that stops with a clear message when the loss stops being finite, and
checkpoints to resume from (`checkpoint.Checkpointing`). Seeded: the same settings give the same
curve on the same machine, interrupted and resumed or not.

    history = train(model, data.train, TrainSettings(steps=300), val=data.val)
    history[-1]["val_loss"]

Each record of the returned history is a dict (step, lr, loss, lm_loss, aux_loss, grad_norm,
tokens, step_ms, elapsed_s (wall clock), tokens_per_s (training steps only), and val_loss on
evaluation steps), so a notebook can tabulate or plot it directly; `on_step(record)` receives
each one as it is made (live widgets).

A parallel layout plugs in through two hooks, as in torchtitan's one `train_step`:
`after_backward()` (expert parallelism averages its gradients there) and `clip_grad_norm(max)`
(the norm over every rank's shard, not just this rank's).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, is_dataclass

import torch
from tqdm.auto import tqdm

from ..arguments import check_count, check_positive_number
from ..moe.batch import check_batch
from ..moe.model import MoEForCausalLM, is_expert_parameter
from ..precision import hardware
from . import checkpoint as ckpt
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
    grad_clip: float | None = 1.0  # clip the gradient norm to this; None: no clipping
    eval_every: int = 50  # validation every N steps (and after the last step); 0 = never
    eval_batches: int = 8
    seed: int = 0

    def __post_init__(self):
        # Checked here, where the values enter, rather than in AdamW or `range` steps later.
        for name in ("steps", "batch_size", "eval_batches"):
            check_count(f"TrainSettings.{name}", getattr(self, name))
        for name in ("warmup_steps", "eval_every"):
            check_count(f"TrainSettings.{name}", getattr(self, name), least=0)
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            # ValueError, as for every bad setting: one type for callers to catch
            raise ValueError(f"TrainSettings.seed={self.seed!r} must be an integer")  # noqa: TRY004
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"TrainSettings.seed={self.seed} is outside [0, 2**64 - 1], the seeds "
                             "torch takes")
        if not self.warmup_steps < self.steps:
            raise ValueError(f"TrainSettings.warmup_steps={self.warmup_steps} must be in "
                             f"[0, steps={self.steps})")
        check_positive_number("TrainSettings.lr", self.lr)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainSettings.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if not 0 <= self.weight_decay < math.inf:
            raise ValueError(f"TrainSettings.weight_decay={self.weight_decay} must be a finite "
                             f"number >= 0")
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ValueError(f"TrainSettings.betas={self.betas} must be two numbers in [0, 1), "
                             f"e.g. (0.9, 0.95)")
        # Clipping to 0 would zero every gradient: the run would not learn, silently.
        if self.grad_clip is not None and not 0 < self.grad_clip < math.inf:
            raise ValueError(f"TrainSettings.grad_clip={self.grad_clip} must be a finite number "
                             f"> 0, or None for no clipping")


def learning_rate(step: int, s: TrainSettings) -> float:
    """Linear warm-up over `warmup_steps`, then cosine from lr to lr * min_lr_ratio (step 0-based)."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - 1 - s.warmup_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN or infinite, or the run ended with a loss worse
    than where it started or than guessing uniformly (`check_learned`). `history`: the records
    of the run up to there, when the run got that far."""

    def __init__(self, message: str, history: list[dict] | None = None):
        super().__init__(message)
        self.history = history or []


# How much worse than its start, or than the uniform guess, a run's loss may end before it counts
# as diverged: the noise of a few batches' mean loss around an untrained model's, not learning.
DIVERGENCE_MARGIN_NATS = 0.1


OPTIMIZERS = ("torch_adamw", "te_fused_adam", "torch_adamw_compiled")


def _adamw_groups(model: torch.nn.Module, s: TrainSettings) -> list[dict]:
    """The course's AdamW parameter groups: matrices decay, vectors (norm weights) do not; the
    routed experts' parameters (`mlp.experts.`) in groups of their own. Under FSDP2 with dp = 1
    the experts stay plain tensors while the rest are DTensor shards
    (`distributed.experts_outside_fsdp`), and one fused AdamW kernel takes one kind; the split
    depends on the model alone, so a checkpoint's groups match on every layout. Empty groups
    are left out."""
    groups = []
    for experts in (False, True):
        named = [(name, p) for name, p in model.named_parameters()
                 if p.requires_grad and is_expert_parameter(name) == experts]
        for decay in (True, False):
            params = [p for _, p in named if (p.dim() >= 2) == decay]
            if params:
                groups.append({"params": params,
                               "weight_decay": s.weight_decay if decay else 0.0})
    return groups


def make_optimizer(model: torch.nn.Module, s: TrainSettings,
                   kind: str = "torch_adamw") -> torch.optim.Optimizer:
    """AdamW; matrices decay, vectors (norm weights) do not.

    `torch_adamw` (the default): torch's AdamW, fused on a GPU. `te_fused_adam`: TE's
    FusedAdam, its moments kept in the parameters' dtype like torch's (fp32 moments would add 8
    bytes per parameter). With bf16 parameters TE's converts the moments through fp32 buffers
    and was slower than torch's fused AdamW on the H200 (`bench --optimizer te_fused_adam`
    measures both), so it is not the default. `torch_adamw_compiled`: torch's AdamW with its
    step compiled (`compiled_adamw`)."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {kind!r}; choose one of {OPTIMIZERS}")
    groups = _adamw_groups(model, s)
    first = next(model.parameters())
    if kind == "te_fused_adam":
        te = hardware.transformer_engine() if first.is_cuda else None
        if te is None:
            raise ValueError("te_fused_adam needs Transformer Engine and a CUDA device")
        moments = first.dtype if first.dtype in (torch.float32, torch.bfloat16) else torch.float32
        return te.optimizers.FusedAdam(groups, lr=s.lr, betas=s.betas, adam_w_mode=True,
                                       exp_avg_dtype=moments, exp_avg_sq_dtype=moments)
    if kind == "torch_adamw_compiled":
        return compiled_adamw(groups, s)
    return torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, fused=first.is_cuda or None)


def compiled_adamw(groups: list[dict], s: TrainSettings) -> torch.optim.AdamW:
    """torch's AdamW whose `step` is compiled by `torch.compile`: Inductor writes the update of
    many parameters into a few generated kernels (Triton on a GPU), where the fused AdamW runs
    one hand-written kernel per chunk of parameters. The learning rate is a tensor so that a
    schedule changes its value (`set_learning_rate`), not the traced graph (a float would be
    traced in as a constant and recompiled each step); a tensor learning rate needs
    `capturable=True`, which keeps the step counts on the device too. The first step compiles
    (seconds to a minute)."""
    device = groups[0]["params"][0].device
    optimizer = torch.optim.AdamW(groups, lr=torch.tensor(s.lr, device=device), betas=s.betas,
                                  foreach=True, capturable=True)
    optimizer.step = torch.compile(optimizer.step)
    return optimizer


def set_learning_rate(optimizer, lr: float) -> None:
    """Every parameter group's learning rate to `lr`: written into a tensor learning rate
    (`compiled_adamw`'s), set as a float otherwise."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


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


Forward = Callable[[torch.Tensor, torch.Tensor], object]


def loss_of(output) -> torch.Tensor:
    """The loss a `forward` returned: the tensor itself, or its `.loss`."""
    return output if isinstance(output, torch.Tensor) else output.loss


@dataclass
class StepResult:
    loss: torch.Tensor
    parts: dict[str, torch.Tensor]  # the loss's terms the output named (lm_loss, aux_loss)
    grad_norm: torch.Tensor | None  # before clipping; None when not clipped


def train_step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
               optimizer: torch.optim.Optimizer, *, grad_clip: float | None = 1.0,
               forward: Forward | None = None, after_backward: Callable[[], None] | None = None,
               clip_grad_norm: Callable[[float], torch.Tensor] | None = None,
               guard: bool = True) -> StepResult:
    """One optimisation step on `batch` = (inputs, targets): forward, backward, `after_backward()`,
    gradient clipping, optimizer step. `forward(inputs, targets)` (default: the model) returns an
    output with `.loss` or the loss itself. `guard`: wait for the loss and the gradient norm and
    raise `TrainingDiverged` before a non-finite update is applied (the one host sync of the
    step; a benchmark that times the step turns it off to keep the GPU's queue full)."""
    inputs, targets = batch
    output = (forward or model)(inputs, targets)
    loss = loss_of(output)
    parts = {k: getattr(output, k) for k in ("lm_loss", "aux_loss")
             if getattr(output, k, None) is not None}
    # The logits ([batch, seq, vocab], fp32: 1 GiB at the benchmark's size) must not live on
    # through the backward pass and the optimizer step: only the scalars are kept.
    del output
    loss.backward()
    if after_backward is not None:
        after_backward()
    grad_norm = None
    if grad_clip is not None:
        grad_norm = (clip_grad_norm(grad_clip) if clip_grad_norm is not None
                     else torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    if guard:
        values = [loss.item()] + ([grad_norm.item()] if grad_norm is not None else [])
        if not all(math.isfinite(v) for v in values):
            raise TrainingDiverged(f"loss={values[0]}, gradient norm="
                                   f"{values[1] if grad_norm is not None else 'not computed'}")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if isinstance(model, MoEForCausalLM):
        model.update_router_biases()  # aux-loss-free balancing (sigmoid routers), else nothing
    return StepResult(loss, parts, grad_norm)


def check_learned(history: list[dict], vocab_size: int | None, lr: float) -> None:
    """`TrainingDiverged` if the run's loss ended worse (by more than DIVERGENCE_MARGIN_NATS)
    than its first step's, or than guessing every token uniformly (ln vocab_size): a finite loss
    that rose is a failed training all the same. The end is the mean training loss of the last
    tenth of the steps (at least one, at most ten), and the last validation loss where there is
    one."""
    if not history:
        return
    tail = history[-min(10, max(1, len(history) // 10)):]
    ended = sum(r["loss"] for r in tail) / len(tail)
    val = history[-1].get("val_loss")
    start = history[0]["loss"]
    uniform = math.log(vocab_size) if vocab_size else math.inf
    worst = max(ended, val if val is not None else -math.inf)
    if worst <= min(start, uniform) + DIVERGENCE_MARGIN_NATS:
        return
    which = ("validation loss" if val is not None and val >= ended else
             f"training loss (mean of the last {len(tail)} steps)")
    baseline = (f" and than guessing uniformly (ln {vocab_size} = {uniform:.3f})"
                if worst > uniform + DIVERGENCE_MARGIN_NATS else "")
    raise TrainingDiverged(
        f"step {history[-1]['step']}: the {which} ended at {worst:.3f} nats, worse than at the "
        f"start ({start:.3f}){baseline} — training diverged (lr={lr:.3g}). Lower the learning "
        f"rate (TrainSettings.lr, --lr; try {lr / 10:.3g}) or lengthen warmup_steps",
        history)


def _batches(data, batch_size: int, seed: int, start: int):
    """The run's batches from step `start` on: windows of a packed tensor [n, seq_len + 1]
    (shuffled per epoch, `data.iterate_batches`), or a given sequence of (inputs, targets)."""
    if isinstance(data, torch.Tensor):
        return iterate_batches(data, batch_size, shuffle=True, seed=seed, start=start)
    return iter(data[start:])


def train(model: torch.nn.Module, data, settings: TrainSettings = TrainSettings(), *,
          val: torch.Tensor | None = None, on_step: Callable[[dict], None] | None = None,
          progress: bool = True, forward: Forward | None = None,
          after_backward: Callable[[], None] | None = None,
          clip_grad_norm: Callable[[float], torch.Tensor] | None = None,
          checkpoint: ckpt.Checkpointing | None = None, resume: bool = False,
          check_learning: bool = True,
          optimizer: Callable[[torch.nn.Module, TrainSettings], torch.optim.Optimizer]
          | None = None) -> list[dict]:
    """Train `model` for `settings.steps` steps; returns the history (one record per step).

    `data`: packed windows ([n, seq_len + 1] token ids, batched and shuffled here), or a
    sequence of at least `steps` (inputs, targets) batches used in order. `forward`,
    `after_backward`, `clip_grad_norm`: see `train_step`. `checkpoint`: save there every
    `checkpoint.every` steps and after the last (`checkpoint.Checkpointing`: one file; or
    `dist_checkpoint.ShardedCheckpointing`: every rank of a (dp, ep) run its shards);
    `optimizer(model, settings)` builds the optimizer (default: `make_optimizer`, the course's
    AdamW), e.g. to train the same steps with another one.
    `resume=True` continues from the newest checkpoint in that directory
    (`checkpoint.CheckpointError` if there is none, or it is unreadable, or it was made with
    other settings or another model). The run holds that directory while it trains: another
    run into it is refused (`safe_io.FolderBusy`), and so is, without `resume`, a directory
    that holds another run's checkpoints (`checkpoint.CheckpointError`), before any step.

    `TrainingDiverged` when the loss stops being finite, or when the run ends with a loss
    worse than at its start or than guessing uniformly (`check_learned`); the exception's
    `history` holds the records up to there. `check_learning=False` leaves out the second
    check, for a run too short to learn (a timing run of a few steps)."""
    s = settings
    if resume and checkpoint is None:
        raise ValueError("resume=True needs checkpoint=Checkpointing(directory) to resume from")
    if not isinstance(data, torch.Tensor) and len(data) < s.steps:
        raise ValueError(f"{len(data)} batches given for {s.steps} steps")
    if isinstance(data, torch.Tensor) and isinstance(model, MoEForCausalLM):
        # Once, on the host copy: the forward pass range-checks only batches in host memory
        # (on a GPU the check would cost a sync per step), so the whole dataset is checked here.
        check_batch(model.config, data[:, :-1], data[:, 1:])
    holding = checkpoint.hold(resume) if checkpoint is not None else contextlib.nullcontext()
    with holding:
        history = _train_loop(model, data, s, val=val, on_step=on_step, progress=progress,
                              forward=forward, after_backward=after_backward,
                              clip_grad_norm=clip_grad_norm, checkpoint=checkpoint,
                              resume=resume, optimizer=optimizer or make_optimizer)
    # A distributed run's ranks each see their own batches' losses and could disagree (one
    # raising while the others wait in a collective): its launcher checks the mean over ranks.
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if check_learning and not distributed:
        check_learned(history, getattr(getattr(model, "config", None), "vocab_size", None), s.lr)
    return history


def _train_loop(model, data, s: TrainSettings, *, val, on_step, progress, forward,
                after_backward, clip_grad_norm, checkpoint, resume, optimizer) -> list[dict]:
    torch.manual_seed(s.seed)
    device = next(model.parameters()).device
    optimizer = optimizer(model, s)
    history: list[dict] = []
    first = 0
    if resume:
        first, history = checkpoint.resume(model, optimizer, _settings_dict(s),
                                           _config_dict(model))
    batches = _batches(data, s.batch_size, s.seed, first)
    model.train()
    last = history[-1] if history else {}
    tokens_seen = last.get("tokens", 0)
    train_time = tokens_seen / last["tokens_per_s"] if last else 0.0
    start = time.perf_counter() - last.get("elapsed_s", 0.0)
    bar = tqdm(range(first, s.steps), desc="training", unit="step", disable=not progress,
               initial=first, total=s.steps)
    for step in bar:
        step_start = time.perf_counter()
        lr = learning_rate(step, s)
        set_learning_rate(optimizer, lr)
        inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
        try:
            result = train_step(model, (inputs, targets), optimizer, grad_clip=s.grad_clip,
                                forward=forward, after_backward=after_backward,
                                clip_grad_norm=clip_grad_norm)
        except TrainingDiverged as exc:
            raise TrainingDiverged(
                f"step {step}: {exc} — training diverged (lr={lr:.3g}). Lower the learning rate "
                f"(TrainSettings.lr, --lr; try {s.lr / 3:.3g}), lengthen warmup_steps, or train "
                f"in float32 / bfloat16 rather than float16", history) from None
        step_s = time.perf_counter() - step_start
        tokens_seen += targets.numel()
        train_time += step_s  # throughput excludes evaluation and checkpoints
        record = dict(step=step + 1, lr=lr, loss=result.loss.item(), tokens=tokens_seen,
                      step_ms=step_s * 1e3, elapsed_s=time.perf_counter() - start,
                      tokens_per_s=tokens_seen / train_time)
        if result.grad_norm is not None:
            record["grad_norm"] = result.grad_norm.item()
        record.update({name: value.item() for name, value in result.parts.items()})
        done = step + 1 == s.steps
        if val is not None and s.eval_every and ((step + 1) % s.eval_every == 0 or done):
            record["val_loss"] = evaluate(model, val, s.batch_size, s.eval_batches)
        history.append(record)
        if checkpoint is not None and ((step + 1) % checkpoint.every == 0 or done):
            checkpoint.save(model, optimizer, step + 1, history, _settings_dict(s),
                            _config_dict(model))
        bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
        if on_step is not None:
            on_step(record)
    return history


def _settings_dict(s: TrainSettings) -> dict:
    return {**asdict(s), "betas": list(s.betas)}  # a list, as it reads back from the file


def _config_dict(model: torch.nn.Module) -> dict:
    """The architecture a checkpoint belongs to (our model's config; nothing for other modules,
    whose state dict's keys and shapes are checked on loading instead)."""
    config = getattr(model, "config", None)
    return asdict(config) if is_dataclass(config) else {}
