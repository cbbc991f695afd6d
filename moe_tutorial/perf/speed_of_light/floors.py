"""The floor: each part's time at a device's rates, the larger of FLOPs / rate and bytes /
bandwidth (`floor`), and the step's, their sum; a missing rate leaves a lower bound.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ...moe.config import MoEConfig
from .rates import Rates
from .work import GEMM_OPERAND_FORMATS, StepWork, step_work


@dataclass(frozen=True)
class PartFloor:
    """One part's floor: compute_ms = FLOPs / rate (None: memory-bound, or its rate missing),
    memory_ms = bytes / bandwidth (None: bandwidth missing), floor_ms the larger of the two
    known (None: neither known: "not computable"); `complete` False when a term it needs is
    missing, so floor_ms is only a lower bound of its floor; `notes`: stand-ins and gaps."""

    compute_ms: float | None
    memory_ms: float | None
    floor_ms: float | None
    complete: bool
    profiler_part: str
    notes: tuple[str, ...] = ()

    @property
    def bound(self) -> str:
        """"compute", "memory" or "not computable": which term sets the floor."""
        if self.floor_ms is None:
            return "not computable"
        return "compute" if self.compute_ms is not None and self.floor_ms == self.compute_ms \
            else "memory"


@dataclass(frozen=True)
class Floor:
    """Every part's floor (`PartFloor`) for `work` at `rates`. `total_ms`: the step's floor,
    None when a part's is not complete; `lower_bound_ms`: the sum of what is known, a floor of
    the floor either way."""

    work: StepWork
    rates: Rates
    parts: dict[str, PartFloor]

    @property
    def complete(self) -> bool:
        return all(p.complete for p in self.parts.values())

    @property
    def lower_bound_ms(self) -> float:
        return sum(p.floor_ms for p in self.parts.values() if p.floor_ms is not None)

    @property
    def total_ms(self) -> float | None:
        return self.lower_bound_ms if self.complete else None

    def notes(self) -> list[str]:
        """Each note once, in part order."""
        return list(dict.fromkeys(note for p in self.parts.values() for note in p.notes))

    def to_dict(self) -> dict:
        return {"work": self.work.to_dict(),
                "parts": {name: {**asdict(p), "bound": p.bound} for name, p in self.parts.items()},
                "total_ms": self.total_ms, "lower_bound_ms": self.lower_bound_ms,
                "complete": self.complete, "notes": self.notes()}


def floor(work: StepWork, rates: Rates) -> Floor:
    """The floor of every part of `work` at `rates` (see the module docstring): FLOPs / rate
    for a part with matmul FLOPs, bytes / bandwidth for every part, the larger of the two."""
    if not isinstance(work, StepWork) or not isinstance(rates, Rates):
        raise ValueError(f"floor takes (step_work(...), Rates), got ({type(work).__name__}, "
                         f"{type(rates).__name__})")
    bandwidth, bandwidth_note = rates.rate("hbm_gb_per_s")
    parts = {}
    for name, w in work.parts.items():
        notes, compute_ms, complete = [], None, True
        if w.rate is not None:
            tflops, note = rates.rate(w.rate)
            notes += [note] if note else []
            complete = tflops is not None
            compute_ms = w.flops / (tflops * 1e9) if tflops else None  # TFLOP/s → FLOP/ms: ×1e9
        memory_ms = w.bytes / (bandwidth * 1e6) if bandwidth else None  # GB/s → bytes/ms: ×1e6
        if bandwidth is None and w.bytes:
            notes.append(bandwidth_note)
            complete = False
        known = [t for t in (compute_ms, memory_ms) if t is not None]
        parts[name] = PartFloor(compute_ms, memory_ms, max(known) if known else None,
                                complete, w.profiler_part, tuple(notes))
    return Floor(work, rates, parts)


def step_floors(config: MoEConfig, batch: int, seq_len: int, rates: Rates, *,
                optimizer: str = "adamw") -> dict[str, Floor]:
    """The step's floor with the GEMM operands in each format (`GEMM_OPERAND_FORMATS`) at these
    rates."""
    return {p: floor(step_work(config, batch, seq_len, precision=p, optimizer=optimizer), rates)
            for p in GEMM_OPERAND_FORMATS}
