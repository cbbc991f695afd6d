"""A decision rule for your model: where grouped GEMM, FP8 and `te.ops` pay on this machine.

A sweep over hidden size × expert count × tokens per expert times one MoE layer's experts
(forward + backward, permutation included: `bench.bench_expert_layer`, which checks every
variant's output against the loop before timing it) in four ways:

    loop     the per-expert loop (HF "eager"), bf16 (fp32 on a CPU)
    grouped  the grouped layer: TE `GroupedLinear` on a GPU with TE, else `torch._grouped_mm`
    te_ops   `te.ops.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)`, bf16 (GPU with TE)
    fp8      `GroupedLinear` under the recipe `recipes.resolve("fp8", caps)` picks (GPU
             with a TE FP8 recipe; the PyTorch emulation reproduces FP8's numbers, not its speed)

then asks, per technique, where it pays (speedup > 1.05), loses (< 0.95) or is even, and states
the boundary in one quantity read off the data — the smallest size from which it always paid in
this sweep. The quantities: expert count for grouping (the loop launches its GEMMs once per
expert), tokens per expert × hidden for FP8 and te.ops (the rows × width each expert quantizes
or passes through elementwise, against GEMMs that grow with them). `decision_rule` turns the map
into one line; `committed_map` derives the same map from the committed H200 benchmark.

    shapes = decide.sweep_grid(SETUP.mode)
    rows = decide.run_sweep(shapes, device=SETUP.device, caps=hardware.capabilities())
    decisions = decide.decision_map(rows)
    print(decide.decision_rule(decisions))
    decide.show_decision(rows, decisions)

Every point of the grid has top-k 2 and intermediate = 3.5 × hidden (Mixtral-8x7B's 14336 /
4096), so the grid's top corner is Mixtral's layer; `sweep_shape` builds a point, and
`run_sweep` takes any `bench.ExpertShape` (one model's own shapes too).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import display
from ..precision import hardware, recipes
from . import results
from .bench import (
    EXPERT_SHAPES,
    ExpertShape,
    bench_expert_layer,
)

TOP_K = 2
INTERMEDIATE_RATIO = 3.5  # Mixtral-8x7B: 14336 / 4096
# small: seconds on a 2-core CPU, around the CPU course's small protein model (hidden 128, 8
# experts); full: from a small protein model's width through the course's small GPU shape
# (hidden 1024) up to Mixtral-8x7B's layer (hidden 4096, 8 experts, 2048 rows each), inside
# notebook 06's 5-minute budget on the H200. Measured there: a 4 × 2 × 3 grid up to 4096 rows per
# expert was still running after 60 s; hidden (256, 1024, 4096) × experts (8, 32) × rows (256,
# 2048) took 101 s of the notebook's 292 s, most of it the 32-expert loops at hidden 4096
# (386 and 483 ms per pass), so the full grid stops at 16 experts.
GRIDS = {
    "small": dict(hidden=(32, 128), experts=(4, 8, 16), tokens_per_expert=(16, 128)),
    "full": dict(hidden=(256, 1024, 4096), experts=(8, 16), tokens_per_expert=(256, 2048)),
}
TIMING = {"cpu": dict(warmup=1, iters=5), "cuda": dict(warmup=2, iters=10)}
ROUTING = "balanced"  # every expert gets ~tokens_per_expert rows: the sweep's stated size

PAYS = 1.05  # a speedup above this pays; below LOSES it loses; between, even (timing noise)
LOSES = 0.95
# A timing whose median is this many times its fastest iteration was disturbed (another process
# on the same cores or GPU): the table names those shapes instead of quietly trusting them.
NOISY_SPREAD = 1.5


# ---------------------------------------------------------------------------------------------
# The grid

def sweep_shape(hidden: int, experts: int, tokens_per_expert: int, *, top_k: int = TOP_K,
                intermediate_ratio: float = INTERMEDIATE_RATIO) -> ExpertShape:
    """One point of the sweep: `tokens_per_expert · experts / top_k` tokens routed top-k, each
    expert hidden → intermediate_ratio · hidden → hidden."""
    for name, value in (("hidden", hidden), ("experts", experts),
                        ("tokens_per_expert", tokens_per_expert), ("top_k", top_k)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if top_k > experts:
        raise ValueError(f"top_k={top_k} exceeds experts={experts}; choose top_k <= experts")
    if tokens_per_expert * experts % top_k:
        raise ValueError(f"tokens_per_expert={tokens_per_expert} × experts={experts} is not "
                         f"divisible by top_k={top_k}; choose sizes whose product is")
    intermediate = round(hidden * intermediate_ratio)
    if intermediate < 1:
        raise ValueError(f"intermediate_ratio={intermediate_ratio} gives intermediate "
                         f"{intermediate}; choose a ratio with ratio × hidden >= 1")
    return ExpertShape(f"h{hidden}_e{experts}_t{tokens_per_expert}",
                       tokens_per_expert * experts // top_k, hidden, intermediate, experts, top_k)


def sweep_grid(mode: str) -> list[ExpertShape]:
    """hidden × experts × tokens per expert of the course mode ("small": CPU-sized, "full": up
    to Mixtral's layer), top-k 2, intermediate 3.5 × hidden (`GRIDS`)."""
    if mode not in GRIDS:
        raise ValueError(f"mode {mode!r} is not a course mode; choose one of {sorted(GRIDS)}")
    grid = GRIDS[mode]
    return [sweep_shape(h, e, t) for h in grid["hidden"] for e in grid["experts"]
            for t in grid["tokens_per_expert"]]


def tokens_per_expert(shape: ExpertShape) -> float:
    """Rows each expert gets on average: tokens · top_k / experts (an int where it divides)."""
    rows, remainder = divmod(shape.tokens * shape.top_k, shape.experts)
    return rows if not remainder else shape.tokens * shape.top_k / shape.experts


# ---------------------------------------------------------------------------------------------
# The sweep

@dataclass(frozen=True)
class SweepVariant:
    """One way the sweep runs the experts: its name in the rows, the expert backend and precision
    `bench_expert_layer` runs, and why it cannot run here (None: it runs)."""

    name: str  # "loop" | "grouped" | "te_ops" | "fp8"
    backend: str
    precision: str  # "bf16" or a TE recipe name
    unavailable: str | None = None


def sweep_variants(caps: hardware.Capabilities, device) -> list[SweepVariant]:
    """The four variants on `device` of the machine `caps` describes, the loop first (the
    reference `bench_expert_layer` checks the others against)."""
    on_gpu = torch.device(device).type == "cuda"
    no_gpu = f"device {device}: Transformer Engine runs on CUDA GPUs only"
    te_ops_missing = (no_gpu if not on_gpu else None if caps.is_native("te_ops_grouped_mlp")
                      else caps["te_ops_grouped_mlp"].reason)
    grouped = ("te_grouped_linear" if on_gpu and caps.is_native("te_grouped_linear")
               else "grouped_torch")
    choice = recipes.resolve("fp8", caps)
    fp8_missing = (no_gpu if not on_gpu else None if choice.native
                   else f"no TE FP8 recipe runs here ({choice.reason}); the emulation in "
                        "moe_tutorial.precision.quant reproduces FP8's numbers, not its speed")
    # without a native recipe the FP8 row is never run; its precision then names the emulation
    return [SweepVariant("loop", "naive", "bf16"),
            SweepVariant("grouped", grouped, "bf16"),
            SweepVariant("te_ops", "te_ops", "bf16", te_ops_missing),
            SweepVariant("fp8", "te_grouped_linear", choice.name, fp8_missing)]


def _describe_shape(row: dict, shape: ExpertShape, variant: str) -> dict:
    row.update(variant=variant, hidden=shape.hidden, intermediate=shape.intermediate,
               experts=shape.experts, top_k=shape.top_k, tokens_per_expert=tokens_per_expert(shape))
    return row


def _relate(rows_of_shape: list[dict]) -> None:
    """Each timed row's speedup over the loop and over the bf16 grouped layer of its shape."""
    ms = {r["variant"]: r["median_ms"] for r in rows_of_shape if r.get("status") == "ok"}
    for r in rows_of_shape:
        if r.get("status") != "ok":
            continue
        if "loop" in ms:
            r["speedup_vs_loop"] = ms["loop"] / r["median_ms"]
        if "grouped" in ms:
            r["speedup_vs_bf16_grouped"] = ms["grouped"] / r["median_ms"]


def run_sweep(shapes: Sequence[ExpertShape], *, device, caps: hardware.Capabilities,
              progress: Callable[[int, int, dict], None] | None = None,
              warmup: int | None = None, iters: int | None = None) -> list[dict]:
    """Time every variant of `sweep_variants` on every shape (balanced routing; `TIMING`'s
    warm-up and iterations for the device unless given). One row per shape and variant:
    bench's fields (shape, backend, precision, median_ms, tflops, rel_error, path: what ran)
    plus variant, hidden, intermediate, experts, top_k, tokens_per_expert, speedup_vs_loop,
    speedup_vs_bf16_grouped, and status: "ok", bench's "wrong"/"OOM"/"unsupported"/"error", or
    "unavailable: <why>" for a variant this machine cannot run. `progress(i, n, row)` is
    called after each row (i from 1 to n)."""
    shapes = list(shapes)
    if not shapes:
        raise ValueError("no shapes to sweep; pass sweep_grid(mode) or a list of bench.ExpertShape")
    for shape in shapes:
        if not isinstance(shape, ExpertShape):
            raise ValueError(f"{shape!r} is not a bench.ExpertShape; build one with "
                             f"decide.sweep_shape(hidden, experts, tokens_per_expert)")
    names = [s.name for s in shapes]
    if len(set(names)) < len(names):
        raise ValueError(f"shape names repeat ({sorted({n for n in names if names.count(n) > 1})}): "
                         "the map keys speedups by name; pass each shape once")
    hardware.check_device(str(device))
    timing = dict(TIMING[torch.device(device).type])
    timing.update({k: v for k, v in (("warmup", warmup), ("iters", iters)) if v is not None})
    variants = sweep_variants(caps, device)
    runnable = [v for v in variants if v.unavailable is None]
    total, rows = len(shapes) * len(variants), []

    def emit(row, shape_rows):
        shape_rows.append(row)
        _relate(shape_rows)
        rows.append(row)
        if progress is not None:
            progress(len(rows), total, row)

    for shape in shapes:
        shape_rows: list[dict] = []
        order = iter(runnable)  # bench reports the variants in the order it was given them
        bench_expert_layer(
            shape, ROUTING, device=device, variants=[(v.backend, v.precision) for v in runnable],
            **timing, on_result=lambda r: emit(_describe_shape(r, shape, next(order).name),
                                               shape_rows))
        for v in variants:
            if v.unavailable is not None:
                emit(_describe_shape(dict(part="expert", shape=shape.name, routing=ROUTING,
                                          backend=v.backend, precision=v.precision,
                                          tokens=shape.tokens, flops=shape.flops(),
                                          status=f"unavailable: {v.unavailable}", path=None),
                                     shape, v.name), shape_rows)
    return rows


# ---------------------------------------------------------------------------------------------
# The decision map

@dataclass(frozen=True)
class Technique:
    """One speed-up the map judges: `candidate`'s time against `baseline`'s on each shape."""

    key: str
    title: str
    candidate: str  # sweep variant names
    baseline: str
    speedup_key: str  # the candidate row's field holding its speedup over the baseline
    quantity: str  # what the boundary is stated in (a key of QUANTITIES)
    short: str  # the rule's words: "FP8"
    versus: str  # "bf16"
    do: str  # "use FP8"
    dont: str  # "stay in bf16"


QUANTITIES: dict[str, Callable[[dict], float]] = {
    "experts": lambda r: r["experts"],
    "tokens per expert × hidden": lambda r: r["tokens_per_expert"] * r["hidden"],
}
TECHNIQUES = (
    Technique("grouped_gemm", "grouped GEMM vs the per-expert loop", "grouped", "loop",
              "speedup_vs_loop", "experts", "grouping", "the loop", "group the experts",
              "keep the per-expert loop"),
    Technique("fp8", "FP8 vs bf16 (grouped layer)", "fp8", "grouped", "speedup_vs_bf16_grouped",
              "tokens per expert × hidden", "FP8", "bf16", "use FP8", "stay in bf16"),
    Technique("te_ops", "te.ops grouped MLP vs GroupedLinear (bf16)", "te_ops", "grouped",
              "speedup_vs_bf16_grouped", "tokens per expert × hidden", "te.ops",
              "GroupedLinear", "use te.ops", "keep GroupedLinear"),
)


@dataclass(frozen=True)
class Verdict:
    """Where one technique paid in a sweep. `kind`: "always" / "never" (paid nowhere, lost
    somewhere) / "even" (within 5% everywhere) / "from" (paid on every shape
    with quantity >= threshold, not on the largest size below) / "up_to" (paid on every shape
    with quantity <= threshold, not above) / "mixed" (no single threshold) / "not measurable"
    (`reason` says why)."""

    technique: Technique
    kind: str
    threshold: float | None = None
    speedups: dict[str, float] = field(default_factory=dict)  # shape -> speedup
    sizes: dict[str, float] = field(default_factory=dict)  # shape -> the technique's quantity
    reason: str = ""

    def _shapes(self, test) -> list[str]:
        return [s for s, x in self.speedups.items() if test(x)]

    @property
    def pays(self) -> list[str]:
        return self._shapes(lambda x: x > PAYS)

    @property
    def loses(self) -> list[str]:
        return self._shapes(lambda x: x < LOSES)

    @property
    def even(self) -> list[str]:
        return self._shapes(lambda x: LOSES <= x <= PAYS)


def boundary(points: Sequence[tuple[float, float]]) -> tuple[str, float | None]:
    """(kind, threshold) of (size, speedup) points: see `Verdict`. Shapes of equal size pay at
    that size only if all of them pay."""
    if not points:
        return "not measurable", None
    speedups = [s for _, s in points]
    if all(s > PAYS for s in speedups):
        return "always", None
    if not any(s > PAYS for s in speedups):
        return ("even", None) if all(s >= LOSES for s in speedups) else ("never", None)
    sizes = sorted({size for size, _ in points})
    pays_at = {size: all(s > PAYS for z, s in points if z == size) for size in sizes}
    for kind, run in (("from", sizes[::-1]), ("up_to", sizes)):  # from the largest / smallest
        edge = None
        for size in run:
            if not pays_at[size]:
                break
            edge = size
        if edge is not None:
            return kind, edge
    return "mixed", None


_ROW_KEYS = ("variant", "shape", "status", "experts", "hidden", "tokens_per_expert")


def decision_map(rows: Sequence[dict]) -> dict[str, Verdict]:
    """{technique key: Verdict} from `run_sweep`'s (or `committed_rows`') rows."""
    rows = list(rows)
    if not rows:
        raise ValueError("no rows to decide from; pass run_sweep(...)'s rows")
    for row in rows:
        missing = [k for k in _ROW_KEYS if k not in row]
        if missing:
            raise ValueError(f"row {row.get('shape', row)!r} lacks {missing}; pass "
                             f"run_sweep(...)'s or committed_rows(...)'s rows")
    decisions = {}
    for t in TECHNIQUES:
        candidates = [r for r in rows if r["variant"] == t.candidate]
        timed = [r for r in candidates if r["status"] == "ok" and t.speedup_key in r]
        size_of = QUANTITIES[t.quantity]
        kind, threshold = boundary([(size_of(r), r[t.speedup_key]) for r in timed])
        reason = ""
        if kind == "not measurable":
            statuses = sorted({r["status"] for r in candidates})
            reason = (statuses[0].removeprefix("unavailable: ") if len(statuses) == 1
                      and statuses[0].startswith("unavailable: ")
                      else f"no shape timed both {t.candidate} and {t.baseline} "
                           f"(statuses: {', '.join(statuses) or 'no rows'})")
        decisions[t.key] = Verdict(t, kind, threshold,
                                   {r["shape"]: r[t.speedup_key] for r in timed},
                                   {r["shape"]: size_of(r) for r in timed}, reason)
    return decisions


# ---------------------------------------------------------------------------------------------
# The rule

def format_size(value: float, quantity: str) -> str:
    """A boundary as the rule states it: 2^k for a power of two from 1024, else the number."""
    if quantity == "experts":
        return f"{value:g}"
    exponent = math.log2(value) if value > 0 else 0.5
    if value >= 1024 and exponent.is_integer():
        return f"2^{int(exponent)}"
    return f"{value:,.0f}"


def _span(speedups: Sequence[float]) -> str:
    low, high = min(speedups), max(speedups)
    return f"{low:.2f}×" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}–{high:.2f}×"


def _phrase(v: Verdict, see_also: str) -> str:
    t = v.technique
    if v.kind == "not measurable":
        return f"{t.short}: not measurable here ({v.reason})" + (f" — {see_also}" if see_also else "")
    every = _span(list(v.speedups.values()))
    if v.kind == "always":
        return f"{t.do} always ({every} vs {t.versus})"
    if v.kind == "never":
        return f"{t.dont} ({t.short} {every} vs {t.versus})"
    if v.kind == "even":
        return f"{t.short} ≈ {t.versus} here ({every})"
    if v.kind == "mixed":
        return (f"{t.short} pays on {len(v.pays)} of {len(v.speedups)} shapes with no single "
                f"threshold in {t.quantity} ({every} vs {t.versus})")
    above = v.kind == "from"
    beyond = {shape: v.sizes[shape] >= v.threshold if above else v.sizes[shape] <= v.threshold
              for shape in v.speedups}
    inside = [s for shape, s in v.speedups.items() if beyond[shape]]
    outside = [s for shape, s in v.speedups.items() if not beyond[shape]]
    return (f"{t.do} only when {t.quantity} {'≥' if above else '≤'} "
            f"{format_size(v.threshold, t.quantity)} ({_span(inside)} vs {t.versus}; "
            f"{'below' if above else 'above'} it {_span(outside)})")


COMMITTED_HINT = "see decide.committed_map() for the committed H200 map"


def decision_rule(decisions: dict[str, Verdict], where: str = "this machine",
                  see_also: str = COMMITTED_HINT) -> str:
    """One line from the measured map: per technique, always / never / from which size on it
    paid, e.g. "On this machine (24 shapes): group the experts always (1.4–4.4× vs the loop);
    use FP8 only when tokens per expert × hidden ≥ 2^23 (...); te.ops ≈ GroupedLinear here".
    A technique not measurable here says why, then `see_also`."""
    if not isinstance(decisions, dict) or sorted(decisions) != sorted(t.key for t in TECHNIQUES) \
            or not all(isinstance(v, Verdict) for v in decisions.values()):
        raise ValueError("decision_rule takes decision_map(rows)'s result (a Verdict for each of "
                         f"{[t.key for t in TECHNIQUES]}), got {type(decisions).__name__}")
    shapes = set().union(*(v.speedups for v in decisions.values()))
    return (f"On {where} ({len(shapes)} shapes): "
            + "; ".join(_phrase(decisions[t.key], see_also) for t in TECHNIQUES) + ".")


# ---------------------------------------------------------------------------------------------
# The committed GPU results

def committed_rows(path: str | Path = results.H200, routing: str = ROUTING) -> list[dict]:
    """The expert-layer rows of a `python -m moe_tutorial bench` result file, as sweep rows: its
    shapes are `bench.EXPERT_SHAPES`; loop = naive, grouped = te_grouped_linear bf16, te_ops =
    te_ops bf16, fp8 = te_grouped_linear under the recipe `resolve("fp8", ...)` picks for
    the file's GPU (Hopper: DelayedScaling; Blackwell: MXFP8BlockScaling)."""
    report = results.read(path)
    env = report.get("environment", {})
    major = int(str(env.get("compute_capability") or "0").split(".")[0])
    kind = {9: "hopper", 10: "blackwell"}.get(major)
    if kind is None:
        raise ValueError(f"{path} was measured on {env.get('gpu') or 'a CPU'}; committed_rows "
                         "reads Hopper (9.x) or Blackwell (10.x) results")
    fp8 = recipes.resolve("fp8", hardware.evaluate(hardware.fake_environment(kind))).name
    variant_of = {("naive", "bf16"): "loop", ("te_grouped_linear", "bf16"): "grouped",
                  ("te_ops", "bf16"): "te_ops", ("te_grouped_linear", fp8): "fp8"}
    by_shape: dict[str, list[dict]] = {}
    for r in report.get("results", []):
        name = variant_of.get((r.get("backend"), r.get("precision")))
        if r.get("part") == "expert" and r.get("routing") == routing and name \
                and r.get("shape") in EXPERT_SHAPES:
            by_shape.setdefault(r["shape"], []).append(
                _describe_shape(dict(r), EXPERT_SHAPES[r["shape"]], name))
    if not by_shape:
        raise ValueError(f"{path} holds no expert-layer rows with routing {routing!r}; pass a "
                         "`python -m moe_tutorial bench` result that ran the expert part")
    for shape_rows in by_shape.values():
        _relate(shape_rows)
    return [r for shape_rows in by_shape.values() for r in shape_rows]


def committed_map(path: str | Path = results.H200) -> dict[str, Verdict]:
    """`decision_map` of a GPU benchmark file (`committed_rows`). The committed H200 file holds
    the expert shapes of `bench.EXPERT_SHAPES` it measured — Mixtral's, a fine-grained one (64
    experts), the course's small GPU shape, Qwen3-30B-A3B's and OLMoE-1B-7B's — enough for a
    coarse boundary, not a sweep."""
    return decision_map(committed_rows(path))


# ---------------------------------------------------------------------------------------------
# Display

def _speedup_cells(rows: Sequence[dict], decisions: dict[str, Verdict]):
    """(shape names in the rows' order, {technique key: [speedup or None per shape]})."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    return shapes, {k: [v.speedups.get(s) for s in shapes] for k, v in decisions.items()}


def decision_figure(rows: Sequence[dict], decisions: dict[str, Verdict]):
    """A heat map of speedup per shape (x) and technique (y), coloured on a log scale diverging
    at 1.0 (blue pays, red loses); None without plotly."""
    go = display.plotly_go()
    if go is None:
        return None
    shapes, cells = _speedup_cells(rows, decisions)
    ticks = [0.25, 0.5, 0.8, 1.0, 1.25, 2.0, 4.0]
    fig = go.Figure(go.Heatmap(
        x=shapes, y=[v.technique.title for v in decisions.values()],
        z=[[math.log2(s) if s is not None else None for s in row] for row in cells.values()],
        text=[[f"{s:.2f}×" if s is not None else "n/a" for s in row] for row in cells.values()],
        texttemplate="%{text}", colorscale="RdBu", zmid=0,
        colorbar=dict(title="speedup", tickvals=[math.log2(t) for t in ticks],
                      ticktext=[f"{t:g}×" for t in ticks])))
    fig.update_layout(title="Where each technique pays (speedup; blue pays, red loses)",
                      xaxis_title="shape (h: hidden, e: experts, t: tokens per expert)",
                      height=320)
    return fig


def decision_table(rows: Sequence[dict], decisions: dict[str, Verdict],
                   title: str | None = None) -> display.Table:
    """One line per shape: its sizes, the loop's time and each technique's speedup; titled by
    `title` (default: `decision_rule(decisions)`), with what each variant ran (or why not)
    underneath."""
    shapes, cells = _speedup_cells(rows, decisions)
    first = {r["shape"]: r for r in rows}
    loop_ms = {r["shape"]: r.get("median_ms") for r in rows if r["variant"] == "loop"}
    ran = {}
    for r in rows:
        ran.setdefault(r["variant"], r["status"] if r["status"].startswith("unavailable")
                       else f"{r['backend']} {r['precision']}")
    table_rows = [[s, first[s]["hidden"], first[s]["experts"], first[s]["tokens_per_expert"],
                   format_size(first[s]["tokens_per_expert"] * first[s]["hidden"],
                               "tokens per expert × hidden"), loop_ms.get(s)]
                  + [c[i] if c[i] is not None else "-" for c in cells.values()]
                  for i, s in enumerate(shapes)]
    timed = [r for r in rows if r["status"] == "ok" and r.get("min_ms")]
    noisy = sorted({r["shape"] for r in timed if r["median_ms"] > NOISY_SPREAD * r["min_ms"]})
    spread = (f"\n{len(noisy)} of {len(shapes)} shapes had a timing whose median exceeds "
              f"{NOISY_SPREAD}× its fastest iteration ({', '.join(noisy)}): something else ran "
              "on this machine meanwhile; rerun before trusting them" if noisy else "")
    return display.Table(
        ["shape", "hidden", "experts", "tokens/expert", "tokens/expert × hidden", "loop ms"]
        + [f"{v.technique.short} vs {v.technique.versus}" for v in decisions.values()],
        table_rows, title=title if title is not None else decision_rule(decisions),
        note="ran: " + "; ".join(f"{name} = {what}" for name, what in ran.items()) + spread)


def show_decision(rows: Sequence[dict], decisions: dict[str, Verdict] | None = None, *,
                  title: str | None = None):
    """Show the heat map (where plotly is installed; else a note says so) and the table
    (`decision_table`); returns the figure (None without plotly). `decisions`: default
    `decision_map(rows)`."""
    decisions = decisions if decisions is not None else decision_map(rows)
    fig = decision_figure(rows, decisions)
    if fig is None:
        print("plotly is not installed (pip install plotly): the table only")
    display.show_figure(fig)
    display.show_table(decision_table(rows, decisions, title))
    return fig
