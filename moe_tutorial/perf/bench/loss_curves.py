"""Loss curves: do the variants train alike? Each variant trained from the same initial weights
on the same batches, eagerly with the course's loop or replayed from one CUDA graph.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from ...moe.batch import next_token_targets
from ...train.loop import TrainingDiverged, TrainSettings, train
from ..timing import peak_memory_gb, reset_memory
from .expert_layer import classify_error
from .variants import variant


def train_loss_curves(config, variants, *, steps: int = 30, batch: int = 4, seq_len: int = 256,
                      device="cuda", lr: float = 1e-3, windows: torch.Tensor | None = None,
                      timing_warmup: int = 3, check_learning: bool = True,
                      on_step: Callable[[str, dict], None] | None = None,
                      optimizer: Callable | None = None) -> list[dict]:
    """Train every variant for `steps` steps from the same initial weights on the same batches
    and return one row per variant with its loss curve — do the variants train alike?

    `variants`: names from `TRAIN_VARIANTS` (the HF baselines and our steps), or `Variant`s of
    our model with any backend and precision (e.g. ``Variant("te_ops DelayedScaling", "te_ops",
    "DelayedScaling")``). `windows`: token ids ``[n, >= seq_len]`` (e.g.
    `data.load_protein_data(seq_len).train`), used in order; default: random tokens. Every
    variant trains with the course's loop, `train.train` (AdamW, `lr` after a linear warm-up over
    the first tenth of the steps then cosine decay, gradients clipped to norm 1), so the curves
    differ only where the variants compute differently.

    Each row: variant, status ("ok"; "unavailable" when the variant cannot be set up on this
    machine, e.g. FP8 without TE; "error", "OOM", "diverged"), losses (one per step),
    ms_per_step (median wall time of the steps after `timing_warmup`; every step waits for its
    loss, so its wall time is complete), tokens_per_s, peak_memory_gb (CUDA only), path (what
    the experts ran), error. `on_step(label, record)` receives each step's `train` record (step,
    loss, step_ms, ...; e.g. for a `widgets.LiveDashboard`), outside the timing.
    `check_learning=False`: a timing run too short to learn, never "diverged" for a loss that
    did not fall (`train.train`'s option; a loss that is not finite still is). `optimizer`:
    `train.train`'s, to train every variant with another optimizer than the course's AdamW.
    """
    if steps < 1 or batch < 1 or seq_len < 2:
        raise ValueError(f"need steps >= 1, batch >= 1, seq_len >= 2; "
                         f"got {steps}, {batch}, {seq_len}")
    windows = _curve_windows(config, windows, steps * batch, seq_len)
    ids = [windows[i * batch:(i + 1) * batch].to(device) for i in range(steps)]
    batches = [(x, next_token_targets(x)) for x in ids]
    settings = TrainSettings(steps=steps, batch_size=batch, lr=lr, warmup_steps=steps // 10,
                             eval_every=0)
    results = []
    for v in map(variant, variants):
        row = dict(part="curve", variant=v.name, steps=steps, batch=batch, seq_len=seq_len,
                   losses=[], status="ok")
        module = forward = None
        times: list[float] = []

        def record(r, label=v.name, times=times, row=row):
            row["losses"].append(r["loss"])
            times.append(r["step_ms"])
            if on_step is not None:
                on_step(label, r)

        try:
            reset_memory(device)
            try:
                module, forward = v.build(config, device)
            except ValueError as exc:  # refused by set_expert_backend / set_precision: say why
                row.update(status="unavailable", error=f"{type(exc).__name__}: {exc}"[:500])
                continue
            try:
                train(module, batches, settings, forward=forward, on_step=record, progress=False,
                      check_learning=check_learning, optimizer=optimizer)
            except TrainingDiverged as exc:
                row.update(status="diverged", error=str(exc)[:500])
            if times:
                row["ms_per_step"] = statistics.median(times[timing_warmup:] or times)
                row["tokens_per_s"] = batch * seq_len / (row["ms_per_step"] / 1e3)
            row["peak_memory_gb"] = peak_memory_gb(device)
            if not v.hf:
                row["path"] = module.expert_paths()[0]
        except torch.cuda.OutOfMemoryError:
            row["status"] = "OOM"
        except Exception as exc:  # one broken variant must not hide the others' curves
            row.update(classify_error(exc))
        finally:
            del module, forward  # free this variant's memory before the next one
            results.append(row)
    return results


def _curve_windows(config, windows: torch.Tensor | None, needed: int,
                   seq_len: int) -> torch.Tensor:
    """The `needed` windows of `seq_len` token ids every variant of a curve trains on, in
    order: `windows` taken in turn (from the start again when they run out), or random ids."""
    if windows is None:
        gen = torch.Generator().manual_seed(0)
        windows = torch.randint(0, config.vocab_size, (needed, seq_len), generator=gen)
    if windows.shape[-1] < seq_len:
        raise ValueError(f"windows of {windows.shape[-1]} tokens are shorter than "
                         f"seq_len={seq_len}")
    return windows[torch.arange(needed) % windows.shape[0], :seq_len]
