"""The comparison with a profiled step: a measured step against its floor, per profiler part
(`compare`), as a table, as a benchmark report's `speed_of_light` section and as bars beside
each profiled chapter; and the command line, `python -m moe_tutorial speed-of-light` (`run`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ... import display
from ...moe.config import preset
from ...precision import hardware
from .. import results, timing
from ..step_parts import PARTS as PROFILER_PARTS
from ..step_profile import (
    CHAPTER_LABELS,
    COURSE_BARS,
    StepBreakdown,
    breakdown_figure,
    chapter_breakdowns,
)
from .floors import Floor, step_floors
from .rates import Rates, measure_rates


@dataclass(frozen=True)
class Row:
    """One profiler part: measured ms per step, its floor (the sum of its parts' floors; None:
    not computable), whether that floor is complete, and measured / floor."""

    part: str
    measured_ms: float | None
    floor_ms: float | None
    complete: bool

    @property
    def ratio(self) -> float | None:
        if self.measured_ms is None or not self.floor_ms:
            return None
        return self.measured_ms / self.floor_ms


@dataclass(frozen=True)
class Comparison:
    """A measured step against its floor: per profiler part (`rows`, when a breakdown was
    given) and the whole step: measured_ms / floor as a percentage (above 100: slower than
    the floor). When the floor is incomplete the percentage is against its lower bound, so it
    overstates the distance to the floor; `complete` says which."""

    floor: Floor
    measured_ms: float
    rows: tuple[Row, ...]
    measured_by: str

    @property
    def percent_of_floor(self) -> float:
        return 100 * self.measured_ms / self.floor.lower_bound_ms

    def to_dict(self) -> dict:
        return {"measured_ms": self.measured_ms, "measured_by": self.measured_by,
                "floor_ms": self.floor.total_ms, "floor_lower_bound_ms": self.floor.lower_bound_ms,
                "complete": self.floor.complete, "percent_of_floor": self.percent_of_floor,
                "rows": [{**asdict(r), "ratio": r.ratio} for r in self.rows],
                "floor": self.floor.to_dict()}


def compare(floor: Floor, breakdown: StepBreakdown | None = None, *,
            step_ms: float | None = None) -> Comparison:
    """`floor` next to a measured step: `breakdown` (step_profile's profiled parts) gives the
    per-part rows; the step's time is `step_ms` (e.g. the benchmark's unprofiled median) if
    given, else the breakdown's profiled total."""
    if not isinstance(floor, Floor):
        raise ValueError(f"floor must be a speed_of_light.floor(...) result, got "
                         f"{type(floor).__name__}")
    if breakdown is not None and not isinstance(breakdown, StepBreakdown):
        raise ValueError(f"breakdown must be a step_profile.StepBreakdown, got "
                         f"{type(breakdown).__name__}")
    if step_ms is not None and (isinstance(step_ms, bool) or not isinstance(step_ms, (int, float))
                                or not math.isfinite(step_ms) or step_ms <= 0):
        raise ValueError(f"step_ms={step_ms!r} must be a finite number of milliseconds > 0")
    if breakdown is None and step_ms is None:
        raise ValueError("compare needs a measurement: a StepBreakdown, step_ms, or both")
    if not floor.lower_bound_ms > 0:
        raise ValueError("this floor has no computable part (every rate it needs is missing): "
                         "measure the rates (measure_rates) or read a file that has them")
    rows = []
    for part in PROFILER_PARTS if breakdown is not None else ():
        mine = [p for p in floor.parts.values() if p.profiler_part == part]
        known = [p.floor_ms for p in mine if p.floor_ms is not None]
        rows.append(Row(part, breakdown.part_ms[part],
                        sum(known) if known or not mine else None,
                        all(p.complete for p in mine)))
    measured_by = ("timed step" if step_ms is not None
                   else f"profiled step ({breakdown.source})")
    return Comparison(floor, float(step_ms if step_ms is not None else breakdown.total_ms),
                      tuple(rows), measured_by)


def _ms(value: float | None, complete: bool = True) -> str:
    if value is None:
        return "not computable"
    return f"{value:.2f}" + ("" if complete else " (≥)")


def format_table(floor: Floor, comparison: Comparison | None = None) -> str:
    """Printable text: the floor of every part (work, rate-bound time, memory-bound time, which
    binds), the step's floor, and with `comparison` the measured step against it per profiler
    part. "(≥)" marks a floor that misses a term: it is a lower bound."""
    if not isinstance(floor, Floor) or not (comparison is None
                                            or isinstance(comparison, Comparison)):
        raise ValueError("format_table takes (Floor, Comparison or None)")
    w = floor.work
    lines = [f"speed of light of one training step: batch {w.batch} × {w.seq_len}, "
             f"{w.precision}, {w.optimizer}; rates of {floor.rates.device}",
             f"{'part':<22} {'GFLOP':>9} {'GB moved':>9} {'compute ms':>11} {'memory ms':>10} "
             f"{'floor ms':>16}  bound"]
    for name, p in floor.parts.items():
        work = w.parts[name]
        lines.append(f"{name:<22} {work.flops / 1e9:>9.1f} {work.bytes / 1e9:>9.2f} "
                     f"{_ms(p.compute_ms) if work.rate else '-':>11} {_ms(p.memory_ms):>10} "
                     f"{_ms(p.floor_ms, p.complete):>16}  {p.bound}")
    total = (f"{floor.total_ms:.2f} ms" if floor.complete else
             f"at least {floor.lower_bound_ms:.2f} ms (parts marked (≥) or not computable "
             f"miss a rate)")
    lines.append(f"step floor: {total}")
    lines += [f"  note: {note}" for note in floor.notes()]
    lines += [f"  {name}: {how}" for name, how in floor.rates.sources.items()]
    if comparison is not None:
        lines.append(f"measured ({comparison.measured_by}) {comparison.measured_ms:.2f} ms = "
                     f"{comparison.percent_of_floor:.0f}% of the floor"
                     + ("" if floor.complete else " (of its lower bound: at most this)"))
        if comparison.rows:
            lines.append(f"{'profiler part':<22} {'measured ms':>11} {'floor ms':>16} "
                         f"{'measured / floor':>17}")
            for r in comparison.rows:
                ratio = f"{r.ratio:.2f}×" if r.ratio is not None else "-"
                lines.append(f"{r.part:<22} {r.measured_ms:>11.2f} "
                             f"{_ms(r.floor_ms, r.complete):>16} {ratio:>17}")
    return "\n".join(lines)


def section(rates: Rates, comparisons: dict[str, Comparison]) -> dict:
    """The benchmark file's `speed_of_light` section: the rates once, then per variant its
    floor and the comparison (JSON-ready; `Rates.from_committed` reads the rates back)."""
    if not isinstance(rates, Rates) or not isinstance(comparisons, dict) or not all(
            isinstance(c, Comparison) for c in comparisons.values()):
        raise ValueError("section takes (Rates, {variant name: Comparison})")
    return {"rates": rates.to_dict(),
            "variants": {name: c.to_dict() for name, c in comparisons.items()}}


def committed_section(path: str | Path = results.H200) -> dict:
    """The `speed_of_light` section of a benchmark report (h200.json as committed): its rates,
    the floors and each profiled chapter's comparison."""
    doc = results.read(path)
    if not doc.get("speed_of_light"):
        raise ValueError(f"{path} has no speed_of_light section: run `python -m moe_tutorial "
                         f"speed-of-light --profile-upto fp8 --out FILE` on a GPU and merge FILE "
                         f"into it (`bench --merge`)")
    return doc["speed_of_light"]


def floor_bars(section: dict) -> dict[str, StepBreakdown]:
    """Each profiled step of a `speed_of_light` section as two bars for
    `step_profile.breakdown_figure`: the measured step by part, then its floor by part (a part
    with no floor, such as launch gaps, is 0 there)."""
    variants = {label: c for label, c in section.get("variants", {}).items() if c.get("rows")}
    if not variants:
        raise ValueError("this speed_of_light section has no profiled step: run speed-of-light "
                         "with --profile-upto")
    bars = {}
    for label, c in variants.items():
        measured = {row["part"]: row["measured_ms"] for row in c["rows"]}
        floor_ms = {row["part"]: row["floor_ms"] or 0.0 for row in c["rows"]}
        source = c["measured_by"].removeprefix("profiled step (").removesuffix(")")
        bars[label] = StepBreakdown(measured, c["measured_ms"], 0, source, "", 1)
        bars[f"{label}: floor"] = StepBreakdown(floor_ms, c["floor_lower_bound_ms"], 0, source,
                                                "", 1)
    return bars


def show_against_floor(section: dict, *, title: str) -> None:
    """Stacked bars (each profiled step, then its floor, by part), and one sentence per step:
    its floor over its time, and the parts furthest above their floors."""
    fig = breakdown_figure(floor_bars(section), title=title)
    if fig is None:
        print("plotly is not installed (pip install plotly): the sentences only.")
    else:
        fig.update_layout(xaxis_title="ms per training step: profiled (torch.profiler), and "
                                      "the floor from the measured rates")
        display.show_figure(fig)
    for label, c in section["variants"].items():
        gaps = sorted((r for r in c["rows"] if r["measured_ms"] is not None),
                      key=lambda r: r["measured_ms"] - (r["floor_ms"] or 0), reverse=True)[:3]
        named = ", ".join(f"{r['part']} {r['measured_ms'] - (r['floor_ms'] or 0):.1f} ms"
                          for r in gaps)
        print(f"{label}: {c['measured_ms']:.1f} ms against a floor of "
              f"{c['floor_lower_bound_ms']:.1f} ms ({c['floor_lower_bound_ms'] / c['measured_ms']:.0%}"
              f" of the speed of light); furthest above their floors: {named}.")


def for_course_bars(bars, *, mode: str, device) -> dict:
    """A `speed_of_light` section for the chapters' bars a notebook just profiled
    (`step_profile.course_bars(..., mode=mode)`): the rates measured now on `device`, the floors
    of the model and batch those bars ran, each bar against its precision's floor."""
    name, batch, seq_len = COURSE_BARS[mode]
    config = preset(name)
    rates = measure_rates(device, config, batch, seq_len)
    return section(rates, chapter_comparisons(bars, step_floors(config, batch, seq_len, rates)))


# ---------------------------------------------------------------------------------------------
# Command line: python -m moe_tutorial.perf.speed_of_light

def _chapter_precision(label: str) -> str:
    return "fp8" if label.startswith(CHAPTER_LABELS["fp8"]) else "bf16"


def chapter_comparisons(bars, floors: dict[str, Floor]) -> dict[str, Comparison]:
    """Each chapter's profiled step (`step_profile.ChapterBars`) against the floor of its
    precision (`floors`: {"bf16": Floor, "fp8": Floor})."""
    return {label: compare(floors[_chapter_precision(label)], b)
            for label, b in bars.breakdowns.items()}


def run(*, preset_name: str, batch: int, seq_len: int, device, committed: str | None = None,
        optimizer: str = "adamw", profile_upto: str | None = None,
        layers: int | None = None) -> dict:
    """`python -m moe_tutorial speed-of-light`: the rates (measured on `device`, or read from the
    `committed` result file), the step's floor in bf16 and FP8, and with `profile_upto` each
    course chapter's profiled step against its precision's floor; prints the tables and returns
    what `--out` writes: a part of a benchmark report (`environment`, no `results`, and the
    `speed_of_light` section with the `workload` it was computed for), which `bench --merge`
    adds to the report of the training-step run it describes. `layers`: the preset at another
    depth."""
    config = preset(preset_name, layers=layers)
    # Transformer Engine is imported (and what this process can run decided) before anything is
    # measured: a chapter that needs TE and does not get it is skipped or runs its PyTorch
    # counterpart, and the output says why (the reason TE did not import), never silently.
    caps = hardware.capabilities()
    rates = (Rates.from_committed(committed) if committed else
             measure_rates(device, config, batch, seq_len))
    floors = step_floors(config, batch, seq_len, rates, optimizer=optimizer)
    comparisons, skipped = {}, {}
    if profile_upto:
        bars = chapter_breakdowns(config, upto=profile_upto, device=device, batch=batch,
                                  seq_len=seq_len)
        comparisons = chapter_comparisons(bars, floors)
        skipped = dict(bars.skipped)
    for fl in floors.values():
        print(format_table(fl) + "\n")
    for label, c in comparisons.items():
        print(f"{label}:\n" + format_table(c.floor, c) + "\n")
    for label, why in skipped.items():
        print(f"{label}: not profiled here: {why}")
    te = caps.env.te_version if caps.has_te else None
    if not te:
        print(f"Transformer Engine: {caps.env.te_import_error or 'not installed'}")
    workload = {"preset": preset_name, "num_layers": config.num_layers, "batch": batch,
                "seq_len": seq_len, "optimizer": optimizer}
    return {"environment": timing.environment(), "results": [],
            "speed_of_light": {**section(rates, comparisons), "workload": workload,
                               "floors": {p: fl.to_dict() for p, fl in floors.items()},
                               "skipped": skipped, "transformer_engine": te,
                               "transformer_engine_error": None if te else caps.env.te_import_error}}
