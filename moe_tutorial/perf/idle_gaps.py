"""Why the GPU sits idle in a training step: every gap between its kernels, by what it waited for.

`step_profile` counts the GPU's idle time as one part, "launch gaps / idle". This module splits
that time gap by gap, from one torch.profiler trace (the kernels on the GPU's timeline and the
host's ops and CUDA runtime calls):

* **after a host sync**: the host waited for the GPU. `.item()`, `.tolist()` and `torch.equal` of
  a GPU tensor end in `cudaStreamSynchronize`, which returns only when the GPU has run everything
  queued, so the queue is empty and the GPU stays idle until the host has launched the next
  kernel. The gap is charged to the op that waited and the op around it (`where`).
* **host behind**: no sync, but the host launched the next kernel only after the GPU had finished
  the previous one (Python and framework work between launches). The gap is charged to the op
  that launched the kernel that ended it.
* **short gaps** (below `min_gap_us`): the latency between back-to-back launches, one row.

`with_stack=True` also records Python frames and charges a gap to the innermost function of the
course or a library instead. It slows the host down, which lengthens the very gaps measured, and
torch 2.11 (the H200's) did not link the frames to the ops (torch 2.13 does), so it is off by
default.

Only the span from the profiled steps' first kernel to their last counts (before it, the host
starts from an empty queue the profiler's own sync left; after it, that sync's wait). So
`idle_ms` is a little smaller than `step_profile`'s idle part of the same steps.

    gaps = idle_gaps.profile(step, device="cuda")   # step(): one whole training step
    gaps.show()
"""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import display
from ..arguments import check_count
from ..moe.config import preset
from . import bench, results, timing
from .step_parts import cuda_kernels
from .step_profile import profiled_steps

AFTER_SYNC = "after a host sync"
HOST_BEHIND = "host behind"
SHORT = "short gaps"
CAUSES = (AFTER_SYNC, HOST_BEHIND, SHORT)
# The CUDA runtime (and driver) calls in which the host waits for the GPU.
HOST_WAITS = re.compile(r"^cu(da)?(Stream|Device|Event|Ctx)Synchroni[sz]e")
# Python frames that say nothing about who asked: torch's module and autograd machinery, the
# profiler, context managers, builtins. The innermost frame not matching is where a gap is charged.
_PLUMBING = re.compile(r"torch/(nn/modules/module\.py|autograd/|_tensor\.py|utils/|_dynamo/|"
                       r"profiler/|_compile\.py|_ops\.py|_library/)|contextlib\.py|"
                       r"^<built-in|functools\.py")
# A sync may return a few µs before the profiler's clock puts the last kernel's end.
CLOCK_SLACK_US = 20.0
MAX_ROWS = 12  # the largest (cause, where) rows kept; the rest is summed into one row
COMMITTED = f"{results.FOLDER}/h200_idle_gaps.json"


@dataclass(frozen=True)
class IdleGaps:
    """A profiled step's idle GPU time by cause (see the module docstring).

    idle_ms         ms per step with no kernel running, between the first kernel and the last
    busy_ms         ms per step with some kernel running, over the same span
    syncs_per_step  host waits for the GPU per step (every HOST_WAITS call the host made)
    rows            {"cause", "where", "ms", "gaps"} per step, largest first; the ms sum to idle_ms
    steps           how many steps were profiled
    min_gap_us      gaps shorter than this are one "short gaps" row
    """

    idle_ms: float
    busy_ms: float
    syncs_per_step: float
    rows: tuple[dict, ...]
    steps: int
    min_gap_us: float

    def __post_init__(self):
        check_count("IdleGaps.steps", self.steps)
        numbers = (self.idle_ms, self.busy_ms, self.syncs_per_step, self.min_gap_us)
        if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in numbers):
            raise ValueError(f"IdleGaps: idle_ms, busy_ms, syncs_per_step and min_gap_us must be "
                             f"finite numbers >= 0, got {numbers}")
        rows = tuple(dict(r) for r in self.rows)
        for row in rows:
            if set(row) != {"cause", "where", "ms", "gaps"} or row["cause"] not in CAUSES:
                raise ValueError(f"IdleGaps row {row} must have keys cause (one of {CAUSES}), "
                                 f"where, ms and gaps")
        total = sum(r["ms"] for r in rows)
        if abs(total - self.idle_ms) > 1e-6 * max(self.idle_ms, 1e-9):
            raise ValueError(f"IdleGaps: the rows sum to {total:.6g} ms, not idle_ms="
                             f"{self.idle_ms:.6g}: they must split the idle time exactly")
        object.__setattr__(self, "rows", rows)

    def ms_by_cause(self) -> dict[str, float]:
        """ms per step of each of `CAUSES`."""
        totals = dict.fromkeys(CAUSES, 0.0)
        for row in self.rows:
            totals[row["cause"]] += row["ms"]
        return totals

    def to_dict(self) -> dict:
        """Plain JSON-ready data (`from_dict` reads it back)."""
        return {**asdict(self), "rows": [dict(r) for r in self.rows]}

    @classmethod
    def from_dict(cls, data: dict) -> IdleGaps:
        """The gaps `to_dict` wrote (checked again: a hand-edited file fails here)."""
        fields = set(cls.__dataclass_fields__)
        if not isinstance(data, dict) or set(data) != fields:
            keys = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"IdleGaps.from_dict takes the dict to_dict() wrote (keys "
                             f"{sorted(fields)}), got {keys}")
        return cls(**{**data, "rows": tuple(data["rows"])})

    def sentence(self) -> str:
        """What the GPU waited for, in one sentence."""
        by_cause = self.ms_by_cause()
        share = by_cause[AFTER_SYNC] / self.idle_ms if self.idle_ms else 0.0
        waits = [r for r in self.rows if r["cause"] == AFTER_SYNC]
        top = (f"; the largest after-sync row is {waits[0]['where']} "
               f"({waits[0]['ms']:.2f} ms in {waits[0]['gaps']:.3g} gaps per step)" if waits else "")
        return (f"The GPU is idle {self.idle_ms:.2f} ms per step (busy {self.busy_ms:.2f}); "
                f"{by_cause[AFTER_SYNC]:.2f} ms ({100 * share:.0f}%) of it right after the host "
                f"waited for the GPU ({self.syncs_per_step:.3g} waits per step), "
                f"{by_cause[HOST_BEHIND]:.2f} ms with the host behind without a wait, "
                f"{by_cause[SHORT]:.2f} ms in gaps under {self.min_gap_us:g} µs{top}.")

    def table(self, title: str = "") -> display.Table:
        return display.Table(
            ["cause", "where (op, or Python function)", "ms / step", "gaps / step"],
            [[r["cause"], r["where"], f"{r['ms']:.3f}", f"{r['gaps']:.3g}"] for r in self.rows],
            title=title, note=self.sentence())

    def show(self, title: str = "where the GPU waits") -> None:
        display.show_table(self.table(title))


# A Python frame in a profile taken with_stack: an event of its own, named
# "path/file.py(line of the def): function", around the ops it called.
_PY_FRAME = re.compile(r"\.py\(\d+\): ")


def _frame(frame: str) -> str:
    """A Python frame's event name from the package root on: 'package/file.py(line): function'."""
    for root in ("site-packages/", "dist-packages/"):
        if root in frame:
            return frame.split(root, 1)[1]
    match = re.search(r"(moe_tutorial/.*)$", frame)
    return match.group(1) if match else os.path.basename(frame)


def where(event) -> str:
    """Who made a profiled host event: the innermost Python function around it that is not
    torch's plumbing (`_PLUMBING`), as 'file.py(line of its def): function', where the profile
    links Python frames to ops; otherwise the innermost op's name and the outermost enclosing
    op's (e.g. 'aten::copy_ in _OperationFuserAutogradFunctionBackward': a `.tolist()` inside
    te.ops' backward pass)."""
    names, node = [], event
    while node is not None:
        if _PY_FRAME.search(node.name) and not _PLUMBING.search(node.name):
            return _frame(node.name)
        names.append(node.name)
        node = node.cpu_parent
    ops = [n for n in names if "::" in n or n.endswith("Backward") or "Function" in n]
    if not ops:
        return names[0]
    return ops[0] if len(ops) == 1 else f"{ops[0]} in {ops[-1]}"


def attribute(kernels: Sequence, host_events: Sequence, *, steps: int,
              min_gap_us: float = 20.0) -> IdleGaps:
    """Split the idle time between `kernels` (objects with .start, .end in µs and .launched_by,
    the correlation id of the host event that launched them: `step_parts.cuda_kernels`) by
    cause, using `host_events` (torch.profiler `FunctionEvent`s: .id, .name, .time_range,
    .cpu_parent). `steps`: how many steps the kernels cover (results are per step). A
    host wait that returns after the last kernel (the caller's final sync) is not counted."""
    check_count("steps", steps)
    if not (isinstance(min_gap_us, (int, float)) and math.isfinite(min_gap_us) and min_gap_us >= 0):
        raise ValueError(f"min_gap_us={min_gap_us!r} must be a number >= 0 (µs)")
    spans = sorted((k.start, k.end, k.launched_by) for k in kernels if k.end > k.start)
    if not spans:
        raise ValueError("no kernel ran in the profiled steps: idle gaps need a CUDA step "
                         "(profile it on a GPU)")
    by_id = {e.id: e for e in host_events}
    last = max(end for _, end, _ in spans)
    # A wait returning after the last kernel is the caller's own final one (the profiler's), not
    # the step's.
    waits = sorted(((e.time_range.end, e) for e in host_events if HOST_WAITS.match(e.name)
                    and e.time_range.end <= last + CLOCK_SLACK_US), key=lambda w: w[0])
    busy_until = spans[0][0]
    rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    busy = 0.0
    for start, end, launched_by in spans:
        if start > busy_until:
            gap = start - busy_until
            if gap < min_gap_us:
                key = (SHORT, f"gaps under {min_gap_us:g} µs")
            else:
                wait = next((e for t, e in waits
                             if busy_until - CLOCK_SLACK_US <= t <= start), None)
                if wait is not None:
                    key = (AFTER_SYNC, where(wait))
                else:
                    launcher = by_id.get(launched_by)
                    key = (HOST_BEHIND, where(launcher) if launcher is not None else
                           "(no host event launched the next kernel)")
            rows[key][0] += gap
            rows[key][1] += 1
        busy += max(0.0, end - max(start, busy_until))  # overlapping kernels counted once
        busy_until = max(busy_until, end)
    ordered = sorted(rows.items(), key=lambda item: -item[1][0])
    kept, rest = ordered[:MAX_ROWS], ordered[MAX_ROWS:]
    table = [{"cause": cause, "where": place, "ms": us / 1e3 / steps, "gaps": count / steps}
             for (cause, place), (us, count) in kept]
    for cause in CAUSES:  # the rows left out, one per cause, so the rows still sum to the idle
        left = [(us, count) for (c, _), (us, count) in rest if c == cause]
        if left:
            table.append({"cause": cause, "where": f"{len(left)} other places",
                          "ms": sum(us for us, _ in left) / 1e3 / steps,
                          "gaps": sum(count for _, count in left) / steps})
    idle_us = sum(us for us, _ in rows.values())
    return IdleGaps(idle_ms=idle_us / 1e3 / steps, busy_ms=busy / 1e3 / steps,
                    syncs_per_step=len(waits) / steps, rows=tuple(table), steps=steps,
                    min_gap_us=float(min_gap_us))


def profile(step: Callable[[], object], *, device="cuda", steps: int = 3, warmup: int = 2,
            min_gap_us: float = 20.0, with_stack: bool = False) -> IdleGaps:
    """Run `step()` (one whole training step) `warmup` times, then `steps` times under
    torch.profiler (`with_stack`: with Python frames, see the module docstring), and attribute
    the GPU's idle gaps (`attribute`)."""
    # Refused before any step runs, with advice for this module (a CPU step has no kernels)
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device; pass 'cuda'") from exc
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: idle gaps are the GPU's, between its kernels; "
                         f"profile a CUDA step (on a CPU, step_profile's 'cpu ops' breakdown "
                         f"shows where the host spends the step)")
    prof, _ = profiled_steps(step, device=dev, steps=steps, warmup=warmup, with_stack=with_stack)
    host = [e for e in prof.events() if e.device_type.name == "CPU"]
    return attribute(cuda_kernels(prof), host, steps=steps, min_gap_us=min_gap_us)


def committed(path: str | Path = COMMITTED) -> dict:
    """The committed run (`python -m moe_tutorial idle-gaps`): its environment, and per variant
    the unprofiled median step time, what the experts ran and the `IdleGaps`."""
    data = results.read(path)
    return {**data, "variants": {name: {**v, "gaps": IdleGaps.from_dict(v["gaps"])}
                                 for name, v in data["variants"].items()}}


def run(variants: Sequence[str], *, preset_name: str = "mixtral-2l", batch: int = 2,
        seq_len: int = 4096, device="cuda", steps: int = 3, with_stack: bool = False,
        on_variant: Callable[[str, dict], None] | None = None) -> dict:
    """For each training-step variant of the benchmark (`bench.variant` names), built afresh in
    turn: its unprofiled median step time (`timing.time_fn`), what its experts ran, and its
    `IdleGaps` (`profile`). `on_variant(name, entry)` is called as each one finishes."""
    import gc

    for name in variants:
        bench.variant(name)  # unknown names refused before any work
    config = preset(preset_name)
    data = bench.random_batch(config, batch, seq_len, device)
    results = {}
    for name in variants:
        v = bench.variant(name)
        module, forward = v.build(config, device)
        step = bench.timed_step(module, forward, v.optimizer(module, 1e-5), data)
        median = timing.time_fn(step, warmup=3, iters=10, device=device).median_ms
        gaps = profile(step, device=device, steps=steps, warmup=1, with_stack=with_stack)
        paths = module.expert_paths() if hasattr(module, "expert_paths") else []
        entry = {"median_ms": median, "path": (paths[0] if paths else "") or "",
                 "gaps": gaps.to_dict()}
        results[name] = entry
        if on_variant is not None:
            on_variant(name, entry)
        del module, forward, step
        gc.collect()
        torch.cuda.empty_cache()
    return {"environment": timing.environment(), "preset": preset_name, "batch": batch,
            "seq_len": seq_len, "steps": steps, "with_stack": with_stack, "variants": results}


def busy_table(run: dict, baseline: str = "hf_grouped_mm_compiled"):
    """Each profiled step of a committed idle-gaps run (`committed`): its unprofiled median, the
    GPU's busy and idle time per profiled step, and its busy time against `baseline`'s busy time
    in the same profiles (busy against busy: like measures of one run)."""
    base_busy = run["variants"][baseline]["gaps"].busy_ms
    return display.Table(
        ["step", "ms per step, unprofiled", "GPU busy ms", "GPU idle ms", "host waits per step",
         f"{baseline} busy / this busy"],
        [[name, f"{e['median_ms']:.1f}", f"{e['gaps'].busy_ms:.1f}", f"{e['gaps'].idle_ms:.1f}",
          f"{e['gaps'].syncs_per_step:.3g}", f"{base_busy / e['gaps'].busy_ms:.2f}x"]
         for name, e in run["variants"].items()],
        title=f"GPU work and idle time per step ({run['environment']['gpu']}, TE "
              f"{run['environment']['transformer_engine']}; committed run)")
