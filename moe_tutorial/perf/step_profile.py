"""Where the time goes: one training step's time split by part, from torch.profiler.

Every chapter of the course makes the MoE training step faster by removing one bottleneck, and
the bottleneck moves: the naive loop is launch-bound, grouped GEMMs make it GEMM-bound, FP8 makes
quantization and the optimizer show, expert parallelism adds communication. This module measures
that as data (`StepBreakdown`: ms per step in each of `PARTS`) and draws it as one stacked bar per
step variant, with the same colour for a part in every chapter:

    bars = step_profile.chapter_breakdowns(cfg, upto="grouped", device=DEVICE, batch=4, seq_len=64)
    bars.show(title="where the time goes")        # the bars, a table, one sentence

What a part is comes from one ordered rule table, `RULES` (regex → part), applied by `part_of`
to the names of a profiled event: on a GPU a CUDA kernel, the op that launched it and the ops and
ranges around that op; on a CPU an aten op and the ops and ranges around it. The first rule that
matches any of those names wins, so a kernel launched inside `Optimizer.step` is optimizer time
whatever its name, and an `aten::empty` inside `aten::linear` is GEMM time. Names no rule
matches are "other".

Two ways of measuring, and the breakdown says which ran (`source`):

* "cuda kernels" (device cuda): GPU time. Each kernel's time goes to its part (when kernels of
  several streams overlap, each gets an equal share of the overlap); "launch gaps / idle" is the
  wall time of the profiled steps minus the time any kernel ran: the GPU waiting for the CPU to
  launch work. `launches_per_step` counts kernels.
* "cpu ops" (device cpu): the calling thread's time. Each aten op's own time (its duration minus
  the ops nested in it) goes to its part; "launch gaps / idle" is the time outside any op: Python,
  the autograd engine and the dispatcher between ops, the host-side cost that becomes launch gaps
  on a GPU. These are not GPU kernels: they say where the CPU spends the step. The profiled
  steps run on one thread (`torch.set_num_threads(1)`, restored after): an op's time is wall
  time, and with torch's intra-op worker threads a matmul's would include waiting for them. On
  shared cores a small matmul now and then waits milliseconds for a worker the system has not
  scheduled, and such stalls, not the matmuls' work, would decide the GEMMs part.
  `launches_per_step` counts top-level ops (those no other op called).

The profiler slows every op down a little, so a profiled step is somewhat slower than a timed one
(`timing.time_fn`); the parts are measured in the same profiled steps and sum to their total.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from .. import display
from ..arguments import check_count
from ..moe.config import PRESETS, preset
from ..moe.experts import Experts, backend_label
from ..precision import hardware
from .bench import Variant, random_batch, timed_step
from .step_parts import (
    COLORS,
    PARTS,
    SOURCES,
    attribute,
    cuda_kernels,
    kernel_units,
    op_units,
)
from .timing import reset_memory

# ---------------------------------------------------------------------------------------------
# The measured breakdown

@dataclass(frozen=True)
class StepBreakdown:
    """One training step's time by part (see the module docstring for what each source means).

    part_ms           ms per step in every part of `PARTS` (they sum to total_ms)
    total_ms          wall time per profiled step
    launches_per_step CUDA kernels ("cuda kernels") or top-level aten ops ("cpu ops") per step
    source            "cuda kernels" or "cpu ops": which measurement ran
    device, steps     where it ran, how many steps were profiled
    path              what the experts ran (e.g. `model.expert_paths()[0]`), "" if not known
    """

    part_ms: dict[str, float]
    total_ms: float
    launches_per_step: float
    source: str
    device: str
    steps: int
    path: str = ""

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"StepBreakdown.source={self.source!r} must be one of {SOURCES}")
        if set(self.part_ms) != set(PARTS):
            raise ValueError(f"StepBreakdown.part_ms names {sorted(self.part_ms)}; it needs "
                             f"exactly the parts {list(PARTS)}")
        values = [*self.part_ms.values(), self.total_ms, self.launches_per_step]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in values):
            raise ValueError(f"StepBreakdown: every ms and count must be a finite number >= 0, "
                             f"got part_ms={self.part_ms}, total_ms={self.total_ms}, "
                             f"launches_per_step={self.launches_per_step}")
        check_count("StepBreakdown.steps", self.steps)
        if not self.total_ms > 0:
            raise ValueError(f"StepBreakdown.total_ms={self.total_ms} must be > 0")
        parts_sum = sum(self.part_ms.values())
        if abs(parts_sum - self.total_ms) > 1e-6 * self.total_ms:
            raise ValueError(f"StepBreakdown: the parts sum to {parts_sum:.6g} ms, not "
                             f"total_ms={self.total_ms:.6g}: they must split the step exactly")
        object.__setattr__(self, "part_ms", {p: float(self.part_ms[p]) for p in PARTS})

    def share(self, part: str) -> float:
        """The fraction of the step spent in `part`."""
        if part not in PARTS:
            raise ValueError(f"unknown part {part!r}; choose one of {list(PARTS)}")
        return self.part_ms[part] / self.total_ms

    def dominant_part(self) -> str:
        """The part with the most time (the first in `PARTS` order on a tie)."""
        return max(PARTS, key=lambda part: self.part_ms[part])

    def to_dict(self) -> dict:
        """Plain JSON-ready data (`from_dict` reads it back)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StepBreakdown:
        """The breakdown `to_dict` wrote (checked again: a hand-edited file fails here)."""
        if not isinstance(data, dict):
            raise ValueError(f"StepBreakdown.from_dict takes the dict to_dict() wrote, got "
                             f"{type(data).__name__}")
        expected = set(cls.__dataclass_fields__)
        if set(data) - expected or not set(data) >= expected - {"path"}:
            raise ValueError(f"StepBreakdown.from_dict: keys {sorted(data)} are not the "
                             f"breakdown's fields {sorted(expected)}")
        return cls(**data)


# ---------------------------------------------------------------------------------------------
# Measuring

REGION = "step_profile: profiled steps"  # the record_function around the profiled steps

def _device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device; pass 'cpu' or 'cuda'") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: step_profile measures 'cpu' or 'cuda' steps")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but torch sees no CUDA GPU here; pass device='cpu'")
    return dev


def profiled_steps(step: Callable[[], object], *, device, steps: int = 3, warmup: int = 2,
                   with_stack: bool = False):
    """Run `step()` `warmup` times, then `steps` times under torch.profiler (CPU activity, and
    CUDA on a CUDA device; `with_stack`: Python frames too) inside the range `REGION`; return
    the profiler and the checked device. On a GPU the region ends once the GPU has finished the
    last kernel; on a CPU the steps run on one thread (the module docstring says why)."""
    if not callable(step):
        raise ValueError(f"step must be a function running one training step, got "
                         f"{type(step).__name__}")
    check_count("steps", steps)
    check_count("warmup", warmup, least=0)
    dev = _device(device)
    on_gpu = dev.type == "cuda"

    def sync():
        if on_gpu:
            torch.cuda.synchronize(dev)

    threads = torch.get_num_threads()
    if not on_gpu:
        torch.set_num_threads(1)
    try:
        prof = _profile(step, steps, warmup, on_gpu, sync, with_stack)
    finally:
        torch.set_num_threads(threads)
    return prof, dev


def _profile(step, steps: int, warmup: int, on_gpu: bool, sync, with_stack: bool):
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(warmup):
        step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    # Kineto logs every profiler start and stop to stderr unless told otherwise, read when it
    # first starts: in a notebook those lines would land in the cell's output
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    # acc_events: one cycle here, so nothing accumulates; without it torch warns on stderr that
    # events are cleared between cycles (seen in the notebooks' outputs on the H200)
    with profile(activities=activities, with_stack=with_stack, acc_events=True) as prof:
        with record_function(REGION):
            for _ in range(steps):
                step()
            sync()  # inside the region: its end is when the GPU has finished the last kernel
    return prof


def profile_step(step: Callable[[], object], *, device, steps: int = 3,
                 warmup: int = 2) -> StepBreakdown:
    """Run `step()` `warmup` times, then `steps` times under torch.profiler, and split the
    profiled steps' time by part: kernel time on a CUDA device, the calling thread's op time on a
    CPU (the module docstring says what each means). `step` must run one whole training step
    (forward, backward, optimizer step), e.g. `bench.timed_step(...)`."""
    prof, dev = profiled_steps(step, device=device, steps=steps, warmup=warmup)
    on_gpu = dev.type == "cuda"
    events = prof.events()
    region = next(e for e in events if e.name == REGION)
    units = kernel_units(events, cuda_kernels(prof)) if on_gpu else op_units(events, region)
    start, end = region.time_range.start, region.time_range.end
    part_us = attribute(units, start, end)
    launches = sum(1 for u in units if u.depth == 0 and u.end > start and u.start < end)
    return StepBreakdown(part_ms={p: us / 1e3 / steps for p, us in part_us.items()},
                         total_ms=sum(part_us.values()) / 1e3 / steps,
                         launches_per_step=launches / steps,
                         source="cuda kernels" if on_gpu else "cpu ops", device=str(dev),
                         steps=steps)


def profile_train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches, *,
                       device, steps: int = 3, warmup: int = 2,
                       forward: Callable | None = None) -> StepBreakdown:
    """`profile_step` of the course's own training step (`train.train_step`, as the benchmark
    times it: no clipping, no host sync) on `batches`: one (inputs, targets) batch or a list of
    them, used in turn. `forward`: as `train.train_step` takes it (HF models). The breakdown's
    `path` says what the experts ran (our model)."""
    if isinstance(batches, tuple) and len(batches) == 2 and all(
            isinstance(t, torch.Tensor) for t in batches):
        batches = [batches]
    if not isinstance(batches, Sequence) or not batches or not all(
            isinstance(b, tuple) and len(b) == 2 for b in batches):
        raise ValueError("batches must be an (inputs, targets) tuple of tensors or a non-empty "
                         "list of them, e.g. bench.random_batch(config, 4, 64, device)")
    steps_in_turn = itertools.cycle([timed_step(model, forward, optimizer, batch)
                                     for batch in batches])
    breakdown = profile_step(lambda: next(steps_in_turn)(), device=device, steps=steps,
                             warmup=warmup)
    paths = model.expert_paths() if hasattr(model, "expert_paths") else [""]
    return StepBreakdown(**{**breakdown.to_dict(), "path": paths[0] or ""})


# ---------------------------------------------------------------------------------------------
# Presentation

def _check_breakdowns(breakdowns) -> dict[str, StepBreakdown]:
    if not isinstance(breakdowns, dict) or not breakdowns or not all(
            isinstance(label, str) and isinstance(b, StepBreakdown)
            for label, b in breakdowns.items()):
        raise ValueError("breakdowns must be a non-empty dict {label: StepBreakdown}, e.g. "
                         "{'naive loop': profile_train_step(...)} or chapter_breakdowns(...)"
                         ".breakdowns")
    return breakdowns


def breakdown_figure(breakdowns: dict[str, StepBreakdown], *, title: str = "where the time goes"):
    """A plotly horizontal stacked bar: one bar per label (in the dict's order, top to bottom),
    one trace per part in its fixed colour, ms per step on x; hovering shows ms and %. None when
    plotly is not installed."""
    breakdowns = _check_breakdowns(breakdowns)
    go = display.plotly_go()
    if go is None:
        return None
    labels = list(breakdowns)
    fig = go.Figure()
    for part in PARTS:
        fig.add_trace(go.Bar(
            name=part, orientation="h", y=labels, marker=dict(color=COLORS[part]),
            x=[b.part_ms[part] for b in breakdowns.values()],
            customdata=[100 * b.share(part) for b in breakdowns.values()],
            hovertemplate=f"%{{y}}<br>{part}: %{{x:.3g}} ms (%{{customdata:.0f}}%)<extra></extra>"))
    sources = sorted({b.source for b in breakdowns.values()})
    fig.update_layout(barmode="stack", template="plotly_white", title=dict(text=title),
                      height=160 + 45 * len(labels), margin=dict(t=70, b=110),
                      xaxis_title=f"ms per training step (torch.profiler: {', '.join(sources)})",
                      yaxis=dict(autorange="reversed"),
                      legend=dict(orientation="h", yanchor="top", y=-0.35, xanchor="left", x=0))
    return fig


def breakdown_table(breakdowns: dict[str, StepBreakdown], *, title: str = "",
                    skipped: dict[str, str] | None = None) -> display.Table:
    """One row per label: ms per step, launches per step, what measured it, and each part's %;
    the note says what each row's experts ran and which steps were skipped, and why."""
    breakdowns = _check_breakdowns(breakdowns)
    headers = ["step", "ms / step", "launches / step", "measured"] + [f"{p} %" for p in PARTS]
    rows = [[label, b.total_ms, round(b.launches_per_step), b.source]
            + [f"{100 * b.share(p):.1f}" for p in PARTS] for label, b in breakdowns.items()]
    notes = ["launches: CUDA kernels (cuda kernels) or top-level aten ops (cpu ops) per step"]
    notes += [f"{label} ran {b.path}" for label, b in breakdowns.items() if b.path]
    notes += [f"skipped {label}: {why}" for label, why in (skipped or {}).items()]
    return display.Table(headers, rows, title=title, note="; ".join(notes))


def bottleneck_sentence(breakdowns: dict[str, StepBreakdown]) -> str:
    """One sentence on how the largest part moves from one step variant to the next."""
    breakdowns = _check_breakdowns(breakdowns)
    (first, b0), *rest = breakdowns.items()
    part = b0.dominant_part()
    clauses = [f"the {first} spends {100 * b0.share(part):.0f}% of its step in {part}"]
    for label, b in rest:
        now = b.dominant_part()
        verb = "still spends the most in" if now == part else "moves the largest part to"
        clauses.append(f"the {label} {verb} {now} ({100 * b.share(now):.0f}%)")
        part = now
    return "; ".join(clauses) + "."


def show_breakdowns(breakdowns: dict[str, StepBreakdown], *, title: str,
                    skipped: dict[str, str] | None = None) -> None:
    """Display the stacked bars (`breakdown_figure`), the table and the sentence; without plotly
    the table and the sentence only, saying so."""
    fig = breakdown_figure(breakdowns, title=title)
    if fig is None:
        print("plotly is not installed (pip install plotly): the table only.")
    else:
        display.show_figure(fig)
    display.show_table(breakdown_table(breakdowns, title=title, skipped=skipped))
    sentence = bottleneck_sentence(breakdowns)
    print(sentence[0].upper() + sentence[1:])


# ---------------------------------------------------------------------------------------------
# The course's chapters, one bar each

CHAPTERS = ("naive", "grouped", "te_ops", "fp8", "expert_parallel")
CHAPTER_LABELS = {"naive": "naive loop", "grouped": "grouped GEMM", "te_ops": "te.ops grouped MLP",
                  "fp8": "FP8 te.ops", "expert_parallel": "expert parallel (2 processes)"}
EP_PROCESSES = 2


@dataclass
class ChapterBars:
    """The chapters' breakdowns {label: StepBreakdown}, and the chapters that could not run here
    {label: why}."""

    breakdowns: dict[str, StepBreakdown]
    skipped: dict[str, str]

    def show(self, *, title: str = "where the time goes") -> None:
        show_breakdowns(self.breakdowns, title=title, skipped=self.skipped)

    def to_dict(self) -> dict:
        return {"breakdowns": {k: b.to_dict() for k, b in self.breakdowns.items()},
                "skipped": dict(self.skipped)}

    @classmethod
    def from_dict(cls, data: dict) -> ChapterBars:
        return cls({k: StepBreakdown.from_dict(b) for k, b in data["breakdowns"].items()},
                   dict(data["skipped"]))


def _chapter_variant(chapter: str, te_on_gpu: bool):
    """The bench.Variant of a single-process chapter. The grouped chapter runs TE's
    GroupedLinear where TE runs (a GPU), torch._grouped_mm elsewhere."""
    label = CHAPTER_LABELS[chapter]
    return {"naive": Variant(label, "naive"),
            "grouped": Variant(label, "te_grouped_linear" if te_on_gpu else "grouped_torch"),
            "te_ops": Variant(label, "te_ops"),
            "fp8": Variant(label, "te_ops", "fp8")}[chapter]


def chapter_breakdowns(cfg, *, upto: str, device, batch: int = 4, seq_len: int = 64,
                       steps: int = 3, warmup: int = 2,
                       launch: Callable[..., dict] | None = None) -> ChapterBars:
    """One `StepBreakdown` per course chapter from the first up to `upto` (one of `CHAPTERS`),
    each the course's model (`cfg`, the same seeded weights) trained a few steps on the same
    random batch with that chapter's experts: the naive loop, grouped GEMMs, the te.ops grouped
    MLP, FP8, expert parallelism. A chapter this machine cannot run (FP8 without TE on a GPU,
    expert parallelism without 2 GPUs) is in `skipped` with the reason. Where TE's experts run
    their pure-PyTorch counterparts (no GPU), the label says so.

    Expert parallelism runs in torchrun processes (`train_dist --mode bench --breakdown`);
    `launch` is `train_dist.launch` (passed in: train_dist imports this module); rank 0's
    breakdown is shown. It needs `cfg` to be one of `config.PRESETS` (any dtype)."""
    if upto not in CHAPTERS:
        raise ValueError(f"upto={upto!r} is not a chapter; choose one of {CHAPTERS}")
    check_count("batch", batch)
    check_count("seq_len", seq_len, least=2)
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"seq_len={seq_len} is longer than the model's max_seq_len="
                         f"{cfg.max_seq_len}; choose seq_len <= {cfg.max_seq_len}")
    chapters = CHAPTERS[:CHAPTERS.index(upto) + 1]
    if "expert_parallel" in chapters and launch is None:
        raise ValueError("upto='expert_parallel' runs torchrun processes: pass "
                         "launch=train_dist.launch")
    dev = _device(device)
    te_on_gpu = dev.type == "cuda" and hardware.capabilities().has_te
    data = random_batch(cfg, batch, seq_len, dev)
    bars = ChapterBars({}, {})
    for chapter in chapters:
        if chapter == "expert_parallel":
            _expert_parallel_bar(bars, cfg, dev, launch, batch=batch, seq_len=seq_len,
                                 warmup=warmup, backend=_expert_parallel_backend(te_on_gpu))
            continue
        variant = _chapter_variant(chapter, te_on_gpu)
        reset_memory(dev)
        try:
            model, forward = variant.build(cfg, dev)
        except ValueError as exc:  # refused by set_precision / set_expert_backend: say why
            bars.skipped[variant.name] = str(exc)
            continue
        optimizer = variant.optimizer(model, 1e-5)
        breakdown = profile_train_step(model, optimizer, data, device=dev, steps=steps,
                                       warmup=warmup, forward=forward)
        # TE's experts without TE run their pure-PyTorch counterparts: the bar says so
        experts = model.model.layers[0].mlp.experts
        counterpart = isinstance(experts, Experts) and backend_label(experts) != experts.backend
        bars.breakdowns[variant.name + (" (PyTorch counterpart)" if counterpart else "")] = breakdown
        del model, optimizer
    return bars


# The model every chapter's bar profiles, per course mode: (preset, batch, seq_len). The small
# model on a CPU, in seconds; Mixtral-8x7B's width on a GPU, the benchmark's shape, where
# the GEMMs are large enough for the bottleneck to move from launches to the math.
COURSE_BARS = {"small": ("tiny", 4, 64), "full": ("mixtral-2l", 1, 4096)}


def course_bars(upto: str, *, mode: str, device,
                launch: Callable[..., dict] | None = None) -> ChapterBars:
    """`chapter_breakdowns` at the course's sizes for `mode` (`COURSE_BARS`), so that every
    notebook draws the same bars: bf16 on a GPU, fp32 on a CPU."""
    if mode not in COURSE_BARS:
        raise ValueError(f"mode={mode!r}: choose one of {sorted(COURSE_BARS)}")
    name, batch, seq_len = COURSE_BARS[mode]
    dtype = "bfloat16" if _device(device).type == "cuda" else "float32"
    return chapter_breakdowns(preset(name, dtype=dtype), upto=upto, device=device, batch=batch,
                              seq_len=seq_len, launch=launch)


def _expert_parallel_backend(te_on_gpu: bool) -> str:
    """The experts of the expert-parallel bar: te.ops where TE runs, torch._grouped_mm elsewhere."""
    return "te_ops" if te_on_gpu else "grouped_torch"


def _preset_name(cfg) -> str | None:
    """The preset `cfg` is (its dtype aside: train_dist picks the dtype per device), or None."""
    return next((name for name, p in PRESETS.items()
                 if p.with_overrides(dtype=cfg.dtype) == cfg), None)


def _expert_parallel_bar(bars: ChapterBars, cfg, dev: torch.device, launch, *, batch: int,
                         seq_len: int, warmup: int, backend: str) -> None:
    label = CHAPTER_LABELS["expert_parallel"]
    if dev.type == "cuda" and torch.cuda.device_count() < EP_PROCESSES:
        bars.skipped[label] = (f"needs {EP_PROCESSES} GPUs (one NCCL process each); this "
                               f"machine has {torch.cuda.device_count()}")
        return
    name = _preset_name(cfg)
    if name is None:
        bars.skipped[label] = ("train_dist builds its model from a preset name, and this config "
                               "is none of config.PRESETS")
        return
    report = launch(EP_PROCESSES, "--mode", "bench", "--breakdown", "--preset", name,
                    "--backend", backend, "--batch", str(batch), "--seq-len", str(seq_len),
                    "--warmup", str(warmup), "--iters", "1", echo=False)
    rank0 = report["results"][0]
    bars.breakdowns[label] = StepBreakdown.from_dict({**rank0["step_breakdown"],
                                                      "path": rank0["path"]})
