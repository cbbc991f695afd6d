"""The measured numbers the documents state, rendered from the files under `benchmarks/results/`.

Every measured number in `README.md` and the pages under `docs/` (today the README's chapter table
and `docs/benchmarks.md`) sits between two markers,

    <!-- BEGIN generated: NAME (python -m tools.docs) -->
    ...
    <!-- END generated: NAME -->

and is rendered here from the JSON the run wrote, so one file is the source of each number; the
README's headline chart (`docs/train-step-ladder.svg`) is drawn here from the same files:

    python -m tools.docs           # rewrite the regions and the chart from the results
    python -m tools.docs --check   # exit 1, with a diff per region, where they disagree

A re-run of a benchmark changes the documents by `docs`; a hand edit inside a region or of the
chart, or a result file that changed without `docs`, fails `--check` (tests/test_docs.py runs it
with the suite). Each region lives in exactly one document, whichever it is; a region lost or
doubled in an edit is an error. Figures published by others come from `published_recipe.json`,
each with the file it was published in. The output is a function of the committed files alone
(no date or time of day, fixed formats).

The README's chapter table is rendered too, by the course's clock (`Work`; the method is written
in docs/course.md, "How the times are made"): each chapter's minutes from what a learner reads and
does in it (prose, code, the output its cells print, their run time, its predictions and figures),
each exercise's from its prose, code, the functions to write and the open questions (its optional
last section, "Going further (optional)", timed apart and left out of the totals); the printed
output and the run times come from a headless small-mode run of the course (`python -m
moe_tutorial run`, recorded with `docs --record-run`). Each chapter's header states the same
times: a `chapter-time` region in the first markdown cell of a notebook under `notebooks/` is
rendered in place (a notebook without one is left alone), and `--check` fails where it disagrees;
so a chapter, an exercise or a solution edited without `docs` fails it too.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import html
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NOTEBOOKS = ROOT / "notebooks"
RESULTS_LINK = "benchmarks/results"  # a result file's link, from the repository's root
# The documents that may hold generated regions: the README and every page under docs/ (paths
# relative to the repository); and the generated chart
README_NAME, DOCS_DIR = "README.md", "docs"
CHART = "docs/train-step-ladder.svg"

_REGION = re.compile(
    r"<!-- BEGIN generated: (?P<name>[\w-]+) \(python -m tools.docs\) -->\n"
    r"(?P<body>.*?)<!-- END generated: (?P=name) -->", re.DOTALL)
_MARKER = re.compile(r"<!-- (BEGIN|END) generated: ([\w-]+)")


class DocsError(ValueError):
    """A document the generator cannot work on: missing, or its markers broken. The message is
    one line that names the file and the fix."""


@functools.cache
def _load(name: str) -> dict:
    try:
        with open(RESULTS / name) as f:
            return json.load(f)
    except FileNotFoundError:
        raise DocsError(f"{RESULTS / name}: no such result file; the documents quote it, so "
                        "restore it from git or re-run what wrote it") from None


def _link(name: str) -> str:
    return f"[`{name}`]({RESULTS_LINK}/{name})"


def _span(values, fmt: str) -> str:
    """'lo–hi' of the values in `fmt`, one value where both ends print alike."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}–{hi}"


def _table(header: list[str], align: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


# ---------------------------------------------------------------------------------------------
# One H200: `python -m moe_tutorial bench` (h200.json)

BACKEND_LABELS = {"grouped_torch": "torch._grouped_mm", "te_grouped_linear": "te.GroupedLinear",
                  "te_permute_grouped_mm": "TE permutation + torch._grouped_mm",
                  "te_ops": "te.ops"}


# Results committed before TE's CUTLASS grouped GEMM became a backend option (`cutlass=True`,
# recorded in a row as "cutlass") name its rows "<backend>+cutlass"
COMMITTED_CUTLASS_SUFFIX = "+cutlass"


def _runs_cutlass(row: dict) -> bool:
    return bool(row.get("cutlass")) or row["backend"].endswith(COMMITTED_CUTLASS_SUFFIX)


def _backend(row: dict) -> str:
    return row["backend"].removesuffix(COMMITTED_CUTLASS_SUFFIX)


def _backend_label(row: dict) -> str:
    return (BACKEND_LABELS.get(_backend(row), _backend(row))
            + (" + CUTLASS" if _runs_cutlass(row) else ""))


def _expert_rows(report: dict, shape: str, routing: str = "balanced") -> list[dict]:
    return [r for r in report["results"]
            if r["part"] == "expert" and r["shape"] == shape and r["routing"] == routing]


def _fastest(rows: list[dict]) -> dict | None:
    ok = [r for r in rows if r.get("status") == "ok"]
    return min(ok, key=lambda r: r["median_ms"]) if ok else None


def _peaks(report: dict, kind: str) -> tuple[float | None, float | None]:
    """(measured, datasheet) dense TFLOP/s of `kind` ('bf16' | 'fp8') recorded with a run; None
    where the run did not record it (files from before bench measured an FP8 peak)."""
    from moe_tutorial.perf.timing import Peaks

    return Peaks.from_dict(report).of(kind)


def _peak_text(report: dict, kind: str) -> str:
    measured, datasheet = _peaks(report, kind)
    if measured is None and datasheet is None:
        return "not measured in this run"
    def show(v):
        return "not measured" if v is None else f"{v:,.0f}"
    return f"{show(measured)} TFLOP/s measured / {show(datasheet)} datasheet"


def h200_environment() -> str:
    report = _load("h200.json")
    env = report["environment"]
    sm = "sm_" + env["compute_capability"].replace(".", "")
    dates = sorted({part["date"][:10] for part in report.get("parts") or [env]})
    return (f"One {env['gpu']} ({sm}, driver {env['driver']}, CUDA {env['cuda']}), torch "
            f"{env['torch']}, Transformer Engine {env['transformer_engine']}, transformers "
            f"{env['transformers']}, Python {env['python']}; run in parts on "
            f"{' and '.join(dates)}. Dense matmul peaks measured in the training-step part, what "
            f"every MFU below divides by: bf16 {_peak_text(report, 'bf16')}; FP8 "
            f"{_peak_text(report, 'fp8')}.")


# (header, backends to choose the fastest of, precision, with TE's CUTLASS grouped GEMM); the
# loop comes first.
EXPERT_COLUMNS = [
    ("HF-eager-style loop", ("naive",), "bf16", False),
    ("`torch._grouped_mm`", ("grouped_torch",), "bf16", False),
    ("TE permutation + `torch._grouped_mm`", ("te_permute_grouped_mm",), "bf16", False),
    ("`te.GroupedLinear` bf16", ("te_grouped_linear",), "bf16", False),
    ("`te.ops` bf16", ("te_ops",), "bf16", False),
    ("+ CUTLASS grouped GEMM", ("te_grouped_linear", "te_ops"), "bf16", True),
    ("`te.ops` FP8 (DelayedScaling)", ("te_ops",), "DelayedScaling", False),
]
SHAPE_LABELS = {"mixtral": "Mixtral 8x7B", "fine_grained": "fine-grained", "small": "small",
                "qwen3_30b_a3b": "Qwen3-MoE-30B-A3B", "olmoe_1b_7b": "OLMoE-1B-7B",
                "deepseek_v3": "DeepSeek-V3 (routed experts)"}


def _expert_cell(row: dict | None, name_backend: bool) -> str:
    if row is None:
        return "–"
    if row.get("status") != "ok":
        return row.get("status", "?").upper()
    if row["backend"] == "naive":
        return f"{row['median_ms']:.1f} ms"
    detail = f", {_backend_label(row)}" if name_backend else ""
    return f"{row['median_ms']:.1f} ms ({row['speedup_vs_loop']:.2f}×{detail})"


def h200_expert_layer() -> str:
    """The expert-layer table, balanced routing: each column's fastest backend, the fastest
    cell of a row in bold."""
    from moe_tutorial.perf.bench import EXPERT_SHAPES

    report = _load("h200.json")
    shapes = list(dict.fromkeys(r["shape"] for r in report["results"] if r["part"] == "expert"))
    rows = []
    for shape in shapes:
        found = _expert_rows(report, shape)
        chosen = [_fastest([r for r in found if _backend(r) in backends and r["precision"] == p
                            and _runs_cutlass(r) == cutlass])
                  for _, backends, p, cutlass in EXPERT_COLUMNS]
        best = _fastest([r for r in chosen[1:] if r is not None])
        cells = [_expert_cell(r, len(col[1]) > 1) for r, col in zip(chosen, EXPERT_COLUMNS)]
        cells = [f"**{c}**" if r is best and r is not None else c for r, c in zip(chosen, cells)]
        s = EXPERT_SHAPES[shape]
        dims = f"({s.tokens}, {s.hidden}, {s.intermediate}, {s.experts}, {s.top_k})"
        rows.append([f"{SHAPE_LABELS.get(shape, shape)} {dims}"] + cells)
    table = _table(["shape (T, H, I, E, k)"] + [c[0] for c in EXPERT_COLUMNS],
                   ["---"] * (len(EXPERT_COLUMNS) + 1), rows)
    runs = _expert_shapes_by_run(report)
    if len(runs) < 2:
        return table
    return table + "\n\nThe rows come from " + str(len(runs)) + " runs on the same machine type " \
        "and versions (`bench --merge`): " + "; ".join(
            f"{', '.join(SHAPE_LABELS.get(s, s) for s in names)} on {part['date']} (dense bf16 "
            f"matmul {part['dense_bf16_tflops_measured']:.0f} TFLOP/s)" for part, names in runs) + "."


def _expert_shapes_by_run(report: dict) -> list[tuple[dict, list[str]]]:
    """(part, its expert shapes) for each part of a merged report that measured expert shapes;
    the parts' results lie in the report in part order."""
    runs, start = [], 0
    for part in report.get("parts") or []:
        rows = report["results"][start:start + part["results"]]
        start += part["results"]
        names = list(dict.fromkeys(r["shape"] for r in rows if r["part"] == "expert"))
        if names:
            runs.append((part, names))
    return runs


def _cutlass_ratios(experts: list[dict], shape: str) -> list[float]:
    """Time with TE's CUTLASS grouped GEMM over time without, per routing and TE backend."""
    ms = {(r["routing"], _backend(r), _runs_cutlass(r)): r["median_ms"] for r in experts
          if r["shape"] == shape and r["precision"] == "bf16" and r.get("status") == "ok"}
    return [t / ms[(routing, backend, False)]
            for (routing, backend, cutlass), t in ms.items() if cutlass]


def _loop_ms(name: str, shape: str) -> str:
    loop = _fastest([r for r in _expert_rows(_load(name), shape) if r["backend"] == "naive"])
    return f"{loop['median_ms']:.1f} ms in {_link(name)}"


def h200_expert_notes() -> str:
    from moe_tutorial.perf.bench import FAMILY_SHAPES, precision_kind

    experts = [r for r in _load("h200.json")["results"] if r["part"] == "expert"]
    fp8 = [r for r in experts
           if r.get("status") == "ok" and precision_kind(r["precision"]) == "fp8"]
    slower = [ratio - 1 for ratio in _cutlass_ratios(experts, "mixtral")]
    faster = [1 / ratio for ratio in _cutlass_ratios(experts, "fine_grained")]
    unsupported = sorted({f"`{_backend_label(r)}` with `{r['precision']}`"
                          for r in experts if r.get("status") == "unsupported"})
    # Every H200 file with the loop: how much a launch-bound time moves between runs.
    loops = [_loop_ms(name, "fine_grained")
             for name in ("h200.json", "h200_fused_norm_loss.json", "h200_cutlass_grouped_gemm.json")]
    lines = [
        f"- FP8 outputs are within {_span([r['rel_error'] for r in fp8], '.1%')} (relative, "
        f"Frobenius norm) of the bf16 loop's — E4M3's rounding; the check allows "
        f"{_span([r['tolerance'] for r in fp8], '.0%')}.",
        f"- TE's CUTLASS grouped GEMM (`NVTE_USE_CUTLASS_GROUPED_GEMM`) makes the fine-grained shape "
        f"{_span(faster, '.2f')}× faster and the Mixtral shape {_span(slower, '.0%')} slower (both "
        f"routings, both TE backends).",
    ]
    summary = _load("h200.json")["summary"]
    losses = [(SHAPE_LABELS.get(shape, shape), summary.get(f"expert_{shape}_best_fp8_vs_best_bf16"))
              for shape in FAMILY_SHAPES]
    losses = [(label, ratio) for label, ratio in losses if ratio is not None and ratio < 1]
    if losses:
        lines.append("- FP8 loses to bf16 with many small experts on this GPU: the fastest FP8 "
                     "cell over the fastest bf16 cell is " + ", ".join(
                         f"{ratio:.2f}× for {label}" for label, ratio in losses)
                     + " (balanced routing, the shapes above; no profile of where the FP8 time "
                     "goes was taken for these shapes).")
    if unsupported:
        lines.append(f"- Reported UNSUPPORTED (the library has no kernel for it on this GPU): "
                     f"{', '.join(unsupported)}.")
    lines.append("- The loop waits for the host once per expert (its shape depends on the "
                 "routing), so its time moves between runs on the same machine type and versions: "
                 "the fine-grained loop (balanced) took " + ", ".join(loops) + ".")
    per_expert = _loop_cost_per_expert_hit(experts, "deepseek_v3")
    if per_expert:
        lines.append(per_expert)
    return "\n".join(lines)


def _loop_cost_per_expert_hit(experts: list[dict], shape: str) -> str | None:
    """Why the loop is so slow with hundreds of large experts, from its two routings: both do
    the same FLOPs, so the extra time of the routing that reaches more experts is a cost per
    expert reached. HF's loop (and ours) indexes the 3-D weights, `gate_up_proj[e]`; autograd's
    `select_backward` answers each index with a zero gradient the size of *all* the experts'
    weights (`grad.new_zeros(input_sizes)` then `select_scatter`) that is then added into
    `.grad`."""
    from moe_tutorial.perf.bench import EXPERT_SHAPES

    loops = {r["routing"]: r for r in experts if r["shape"] == shape and r["backend"] == "naive"
             and r.get("status") == "ok"}
    if set(loops) != {"balanced", "skewed"}:
        return None
    hit = {k: int(re.search(r"over (\d+) experts", r["path"])[1]) for k, r in loops.items()}
    if hit["balanced"] == hit["skewed"]:
        return None
    s = EXPERT_SHAPES[shape]
    weight_gb = s.experts * 3 * s.hidden * s.intermediate * 2 / 1e9  # bf16 gate, up, down
    hbm = _load("h200.json")["speed_of_light"]["rates"]["hbm_gb_per_s"]
    slope = ((loops["balanced"]["median_ms"] - loops["skewed"]["median_ms"])
             / (hit["balanced"] - hit["skewed"]))
    one_pass = weight_gb / hbm * 1e3
    return (f"- The loop's {SHAPE_LABELS.get(shape, shape)} time is not its GEMMs: both routings "
            f"do the same FLOPs, yet balanced routing reaches {hit['balanced']} experts and takes "
            f"{loops['balanced']['median_ms']:,.0f} ms, skewed reaches {hit['skewed']} and takes "
            f"{loops['skewed']['median_ms']:,.0f} ms — {slope:.1f} ms per expert reached. Indexing "
            f"the 3-D weight `gate_up_proj[e]`, as HF's eager experts do, makes autograd's "
            f"`select_backward` build a zero gradient the size of all {s.experts} experts' weights "
            f"({weight_gb:.1f} GB in bf16) for each expert and add it into `.grad`: one pass over "
            f"{weight_gb:.1f} GB at the {hbm / 1e3:.2f} TB/s copy rate measured is {one_pass:.1f} ms, "
            f"so each expert reached costs about {slope / one_pass:.0f} such passes. A grouped "
            f"path indexes nothing per expert.")


TRAIN_LABELS = {"hf_eager": "HF `MixtralForCausalLM`, eager experts",
                "hf_grouped_mm": "HF, `grouped_mm` experts",
                "hf_grouped_mm_compiled": "HF, `grouped_mm` + `torch.compile`"}


def _train_rows(report: dict) -> dict[str, dict]:
    return {r["variant"]: r for r in report["results"] if r["part"] == "train"}


def _train_label(variant: str) -> str:
    from moe_tutorial.perf.bench import VARIANTS, candidate_base

    if variant in TRAIN_LABELS:
        return TRAIN_LABELS[variant]
    if variant not in VARIANTS:
        return f"`{variant}`"
    v = VARIANTS[variant]
    if v.hf:  # an HF candidate: its base's label and what it changes
        return TRAIN_LABELS[candidate_base(variant)] + _compiled_parts(v)
    return ("ours, " + ("`te.ops` grouped MLP" if v.backend == "te_ops"
                        else f"`{BACKEND_LABELS[v.backend]}`") + _compiled_parts(v))


def _compiled_parts(v) -> str:
    """' + the loss and AdamW compiled' and the like: a candidate's torch.compile changes."""
    parts = [what for what, on in (("the loss", v.compiled_loss), ("AdamW", v.compiled_adamw))
             if on]
    return f" + {' and '.join(parts)} compiled" if parts else ""


def _mfu(row: dict, report: dict, kind: str) -> str:
    """'measured / datasheet' MFU against `kind`'s dense peak, as bench prints it."""
    from moe_tutorial.perf.timing import mfu_text

    return mfu_text(row["tflops"], _peaks(report, kind), missing="not measured")


def train_step_table(report: dict) -> str:
    """The training-step table of a bench report: MFU against the peak of each row's precision
    (the headline for FP8 rows) and against the bf16 peak, each measured / datasheet."""
    from moe_tutorial.perf.bench import row_precision, step_floor_ms

    best = report["summary"]["train_step_best_variant"]
    # With a speed_of_light section: each row's floor (its precision's) and floor ÷ measured
    floors = bool(report.get("speed_of_light"))
    rows = []
    for variant, r in _train_rows(report).items():
        precision = row_precision(r)
        cells = [_train_label(variant), "FP8" if precision == "fp8" else precision]
        if r.get("status") != "ok":
            rows.append(cells + [r.get("status", "?").upper()] + ["–"] * (5 + bool(floors)))
            continue
        bold = (lambda s: f"**{s}**") if variant == best else (lambda s: s)
        mem = "–" if r.get("peak_memory_gb") is None else f"{r['peak_memory_gb']:.1f}"
        floor_cell = []
        if floors:
            floor_ms = step_floor_ms(r, report["speed_of_light"])
            floor_cell = ["–" if floor_ms is None else
                          f"{floor_ms:.1f} ({floor_ms / r['median_ms']:.0%})"]
        rows.append(cells + [bold(f"{r['median_ms']:.1f}"), bold(f"{r['tokens_per_s']:,.0f}"),
                             bold(f"{r['tflops']:.0f}"), _mfu(r, report, precision),
                             _mfu(r, report, "bf16"), mem] + floor_cell)
    return _table(["variant", "precision", "ms/step", "tokens/s", "TFLOP/s",
                   "MFU vs its precision's peak (measured / datasheet)",
                   "MFU vs bf16 peak (measured / datasheet)", "peak GiB"]
                  + ["floor ms (floor ÷ ms/step)"] * bool(floors),
                  ["---", "---", "---:", "---:", "---:", "---:", "---:", "---:"]
                  + ["---:"] * bool(floors), rows)


def _train_config(report: dict):
    """The model bench trained (its default on a GPU, `mixtral-2l`), checked against the FLOPs
    the file recorded so the README cannot describe another model than the one timed."""
    from moe_tutorial.moe.config import preset
    from moe_tutorial.perf.timing import model_flops_per_token

    config = preset("mixtral-2l")
    row = next(iter(_train_rows(report).values()))
    if model_flops_per_token(config, row["seq_len"]) * row["tokens"] != row["flops"]:
        raise ValueError("the training rows' FLOPs are not mixtral-2l's: update docs._train_config")
    return config, row


def h200_train_step() -> str:
    report = _load("h200.json")
    config, first = _train_config(report)
    ok = [r for r in _train_rows(report).values() if r.get("status") == "ok"]
    params = config.parameter_counts()["total"]
    return (
        f"**Training step** of `mixtral-2l` (Mixtral-8x7B widths, {config.num_layers} layers, "
        f"{params / 1e9:.1f} B parameters), batch {first['batch']} × {first['seq_len']} tokens, "
        f"forward + backward + AdamW step (torch's fused AdamW, but compiled by `torch.compile` "
        f"in the rows that say *AdamW compiled*), bf16 "
        f"parameters, same initial weights for every variant (first-step losses agree within "
        f"{max(r['loss_diff'] for r in ok):.1g} nats):\n\n"
        + train_step_table(report) + "\n\n"
        f"TFLOP/s = (6 × {config.active_params_per_token() / 1e6:.1f} M active parameters + 12 × "
        f"layers × seq × hidden) × tokens / time ({first['flops'] / 1e12:.1f} TFLOP per step). "
        f"MFU divides it by a dense matmul peak of the same run: bf16 "
        f"{_peak_text(report, 'bf16')}; FP8 {_peak_text(report, 'fp8')}. An FP8 row's headline "
        f"MFU is against the FP8 peak; against the bf16 peak it says how far past bf16's ceiling "
        f"FP8 took the step.")


# The course's targets: (summary key, the target with {} for its value, the value,
# higher is better).
TARGETS = [
    ("expert_mixtral_best_bf16_speedup_vs_loop",
     "expert layer, Mixtral shape, best bf16 ≥ {}× the loop", 1.75, True),
    ("expert_mixtral_best_fp8_speedup_vs_loop",
     "expert layer, Mixtral shape, best FP8 ≥ {}× the loop", 2.8, True),
    ("expert_finegrained_best_speedup_vs_loop", "expert layer, fine-grained shape ≥ {}× the loop",
     6.5, True),
    ("expert_finegrained_default_speedup_vs_loop",
     "expert layer, fine-grained shape, the course's default path ≥ {}× the loop", 7, True),
    ("train_step_speedup_vs_hf_eager", "training step ≥ {}× HF eager", 2.35, True),
    ("train_step_speedup_vs_hf_grouped_mm", "training step ≥ {}× HF grouped_mm", 1.75, True),
    ("train_step_speedup_vs_hf_grouped_mm_compiled",
     "training step ≥ {}× HF grouped_mm under torch.compile", 1.45, True),
    ("train_step_best_bf16_speedup_vs_hf_grouped_mm_compiled",
     "best bf16 training step ≥ {}× HF grouped_mm under torch.compile", 1.15, True),
    ("train_step_peak_mem_ratio_vs_hf_grouped_mm", "peak memory ≤ {}× HF grouped_mm's", 0.85,
     False),
    ("train_step_fraction_of_speed_of_light",
     "best step ≥ {}× of its speed of light (floor ÷ measured)", 0.8, True),
]


# The targets that set our step beside an HF step: key -> (the HF variant, our precision kind
# or None for any)
HF_TARGETS = {
    "train_step_speedup_vs_hf_eager": ("hf_eager", None),
    "train_step_speedup_vs_hf_grouped_mm": ("hf_grouped_mm", None),
    "train_step_speedup_vs_hf_grouped_mm_compiled": ("hf_grouped_mm_compiled", None),
    "train_step_best_bf16_speedup_vs_hf_grouped_mm_compiled": ("hf_grouped_mm_compiled", "bf16"),
    "train_step_peak_mem_ratio_vs_hf_grouped_mm": ("hf_grouped_mm", None),
}


def like_for_like(report: dict, hf_name: str, kind: str | None = None) -> tuple[dict, dict] | None:
    """(HF's row, our row) of a bench report, compared like with like: HF's step `hf_name`
    given the compiled AdamW where the run has that twin (`<hf_name>_compiled_adamw`), and our
    fastest step (of precision kind `kind`) that compiles nothing HF's step does not: its loss
    only where HF's model is compiled (HF's loss is part of its compiled forward), its AdamW
    only where HF's AdamW is compiled too. None where the run lacks either."""
    from moe_tutorial.perf.bench import VARIANTS, best_step

    train = {name: r for name, r in _train_rows(report).items() if r.get("status") == "ok"}
    hf = train.get(f"{hf_name}_compiled_adamw") or train.get(hf_name)
    theirs = VARIANTS.get(hf["variant"]) if hf else None
    if theirs is None:
        return None

    def same_compilation(row):
        ours = VARIANTS.get(row["variant"])
        return (ours is not None and not ours.hf and (theirs.compiled or not ours.compiled_loss)
                and (theirs.compiled_adamw or not ours.compiled_adamw))
    ours = best_step([r for r in train.values() if same_compilation(r)], kind)
    return (hf, ours) if ours else None


def _target_value(report: dict, key: str) -> tuple[float | None, str]:
    """A target's measured value and which rows gave it. The ratios against HF pair like with
    like (`like_for_like`), whatever pairing the run's own summary made."""
    from moe_tutorial.perf.bench import precision_kind, row_precision, step_floor_ms

    value = report["summary"].get(key)
    if key.startswith("expert_"):
        shape = "mixtral" if "mixtral" in key else "fine_grained"
        kind = "fp8" if "fp8" in key else "bf16" if "bf16" in key else None
        row = _fastest([r for r in _expert_rows(report, shape) if r["backend"] != "naive"
                        and (kind is None or precision_kind(r["precision"]) == kind)
                        and ("_default_" not in key or r.get("default"))])
        recipe = f", {row['precision']}" if precision_kind(row["precision"]) == "fp8" else ""
        return value, f"{_backend_label(row)}{recipe}"
    if key == "train_step_fraction_of_speed_of_light":
        best = _train_rows(report)[report["summary"]["train_step_best_variant"]]
        floor_ms = step_floor_ms(best, report["speed_of_light"])
        return value, (f"floor {floor_ms:.1f} ms ÷ {best['median_ms']:.1f} ms, "
                       f"{_train_label(best['variant'])}")
    pair = like_for_like(report, *HF_TARGETS[key])
    if pair is None:
        return None, ""
    hf, ours = pair
    ours_label = f"{_train_label(ours['variant'])}, {row_precision(ours).replace('fp8', 'FP8')}"
    if key.endswith("peak_mem_ratio_vs_hf_grouped_mm"):
        return (ours["peak_memory_gb"] / hf["peak_memory_gb"],
                f"{ours['peak_memory_gb']:.1f} vs {hf['peak_memory_gb']:.1f} GiB: {ours_label} "
                f"vs {_train_label(hf['variant'])}")
    return (ours["tokens_per_s"] / hf["tokens_per_s"],
            f"{ours_label} vs {_train_label(hf['variant'])}")


def h200_targets() -> str:
    report, recipe = _load("h200.json"), _load("published_recipe.json")["comparisons"]
    rows = []
    for key, what, target, higher in TARGETS:
        value, detail = _target_value(report, key)
        goal = what.format(f"{target:g}")
        if value is None:
            rows.append([goal, "not measured", ""])
            continue
        if value >= target if higher else value <= target:
            verdict = "met"
        elif higher:
            verdict = f"missed ({1 - value / target:.0%} short)"
        else:
            verdict = f"missed ({value / target - 1:.0%} over)"
        unit = "" if key == "train_step_fraction_of_speed_of_light" else "×"  # a fraction
        rows.append([goal, f"**{value:.2f}{unit}** ({detail})", verdict])
    headline, like = recipe["mxfp8_headline"], recipe["hf_like_for_like"]
    tps = like["tokens_per_s_per_gpu"]
    vs_hf = next(target for key, _, target, _ in TARGETS if key == "train_step_speedup_vs_hf_eager")
    te = headline["tokens_per_s_per_gpu"]
    return (_table(["target", "measured", ""], ["---", "---", "---"], rows) + "\n\n"
            "Each ratio against HF pairs like with like: HF's step given the compiled AdamW "
            "where the run has that row, against our fastest step that compiles nothing HF's "
            "does not (its loss only beside HF's compiled model, its AdamW only beside HF's "
            "compiled AdamW).\n\n"
            f"The {vs_hf:g}× target is kept as it was set. NVIDIA's post on the BioNeMo recipe "
            f"states \"up to {headline['published_speedup']:g}x\" {headline['published_speedup_of']} "
            f"(the post's claim). The recipe's public files give less over HF: on "
            f"{like['gpus']} (seq {like['seq_len']}) "
            f"{tps['TE MXFP8'] / tps[like['baseline']]:.2f}× for TE MXFP8 and "
            f"{tps['TE bf16'] / tps[like['baseline']]:.2f}× for TE bf16; the only ratio near "
            f"{headline['published_speedup']:g} in them is TE MXFP8 over TE bf16 on "
            f"{headline['gpus']} ({te['TE MXFP8'] / te['TE bf16']:.3f}), and reading the "
            f"headline as that ratio is the course's inference (see below).")


def h200_speed_of_light() -> str:
    """The step's speed of light from h200.json's `speed_of_light` section: the rates it was
    computed from, and per part of each profiled chapter step, measured against its floor."""
    report = _load("h200.json")
    section = report["speed_of_light"]
    rates, workload = section["rates"], section["workload"]
    variants = section["variants"]
    parts = [row["part"] for row in next(iter(variants.values()))["rows"]]
    rows = []
    for part in parts:
        cells = [part]
        for comparison in variants.values():
            row = next(r for r in comparison["rows"] if r["part"] == part)
            floor = "–" if not row["floor_ms"] else f"{row['floor_ms']:.1f}"
            cells.append(f"{row['measured_ms']:.1f} / {floor}")
        rows.append(cells)
    rows.append(["**whole step**"] + [
        f"**{c['measured_ms']:.1f} / {c['floor_ms']:.1f}** ({c['floor_ms'] / c['measured_ms']:.0%})"
        for c in variants.values()])
    return (
        f"Rates measured in the same run ({rates['device']}, {_link('h200_speed_of_light.json')}, "
        f"merged into {_link('h200.json')}): dense bf16 {rates['dense_bf16_tflops']:,.0f} and FP8 "
        f"{rates['dense_fp8_tflops']:,.0f} TFLOP/s, the step's expert GEMM shapes "
        f"{rates['expert_bf16_tflops']:,.0f} (bf16) and {rates['expert_fp8_tflops']:,.0f} (FP8) "
        f"TFLOP/s, HBM {rates['hbm_gb_per_s']:,.0f} GB/s, attention "
        f"{rates['attention_tflops']:,.0f} TFLOP/s. Each part's floor is its FLOPs at its rate or "
        f"its bytes at HBM's rate, whichever is longer (`speed_of_light.step_work`); the step's "
        f"floor is their sum: `{workload['preset']}`, batch {workload['batch']} × "
        f"{workload['seq_len']}, {workload['optimizer']}. Each chapter's step profiled "
        f"(`torch.profiler`, kernel time per part, ms measured / floor; the profiler's own "
        f"overhead lands in *launch gaps / idle*):\n\n"
        + _table(["part", *variants], ["---"] + ["---:"] * len(variants), rows))


# Measured and not adopted: the suffix of its variants' names in the committed runs (each beside
# its base variant, the name without it), what it changed, and the last commit whose package has
# its code (`git show <commit>:moe_tutorial/train/loop.py`)
NOT_ADOPTED = (("_step_in_backward", "AdamW stepped in the backward pass", "a777de2"),)


def not_adopted() -> str:
    """Each candidate measured and not adopted, with the commit its code is kept at, beside its
    base variant in every committed run that timed both (`run_history.gains_of_suffix`)."""
    from moe_tutorial.perf.run_history import gains_of_suffix

    parts = []
    for suffix, what, commit in NOT_ADOPTED:
        rows = [[f"{_train_label(g['base'])}, {g['precision'].replace('fp8', 'FP8')}",
                 f"{g['base_ms']:.1f} → {g['ms']:.1f}", f"{g['speedup']:.3f}×",
                 f"{g['base_peak_gb']:.1f} → {g['peak_gb']:.1f}",
                 _link(g["run"].removeprefix(RESULTS_LINK + "/"))]
                for g in gains_of_suffix(suffix, what)]
        parts.append(f"{what} (its code: commit `{commit}`):\n\n" + _table(
            ["variant", "ms/step: without → with it", "speedup", "peak GiB", "run"],
            ["---", "---:", "---:", "---:", "---"], rows))
    return "\n\n".join(parts)


def h200_compiled_candidates() -> str:
    """The torch.compile candidates, each beside its base variant in the same run,
    per committed run; then both together against the compiled HF step and the targets."""
    from moe_tutorial.perf.bench import committed_candidate_gains

    gains = committed_candidate_gains()
    rows = [[gain["technique"], f"{_train_label(gain['base'])}, "
             f"{gain['precision'].replace('fp8', 'FP8')}",
             f"{gain['base_ms']:.1f} → {gain['ms']:.1f}", f"{gain['speedup']:.3f}×",
             f"{gain['base_peak_gb']:.1f} → {gain['peak_gb']:.1f}", _link(Path(gain["run"]).name)]
            for gain in gains]
    last_run = Path(gains[-1]["run"]).name  # the newest run: it has both compiled together
    last = _load(last_run)
    train = _train_rows(last)
    hf, hf_twin = train["hf_grouped_mm_compiled"], train["hf_grouped_mm_compiled_compiled_adamw"]
    fp8, bf16 = train["ours_te_ops_fp8_compiled"], train["ours_te_ops_bf16_compiled"]
    env = last["environment"]
    target = {key: goal for key, _, goal, _ in TARGETS}
    return (
        f"One {env['gpu']}, torch {env['torch']}, TE {env['transformer_engine']}; each "
        f"candidate and its base variant in the same `bench --train-variants` run (medians of "
        f"the timed steps):\n\n"
        + _table(["what changes", "variant", "ms/step: base → candidate", "speedup", "peak GiB",
                  "run"], ["---", "---", "---:", "---:", "---:", "---"], rows)
        + f"\n\nWith both, in {_link(last_run)}: our FP8 step {fp8['median_ms']:.1f} ms and our "
        f"bf16 step {bf16['median_ms']:.1f} ms. AdamW compiled is no MoE technique, so HF's "
        f"compiled step got it too: {hf_twin['median_ms']:.1f} ms, against which our FP8 step is "
        f"{hf_twin['median_ms'] / fp8['median_ms']:.2f}× (the course's target "
        f"{target['train_step_speedup_vs_hf_grouped_mm_compiled']}×) and our bf16 step "
        f"{hf_twin['median_ms'] / bf16['median_ms']:.2f}× (target "
        f"{target['train_step_best_bf16_speedup_vs_hf_grouped_mm_compiled']}×). Against HF's "
        f"compiled step without it ({hf['median_ms']:.1f} ms), not like for like: "
        f"{hf['median_ms'] / fp8['median_ms']:.2f}× and {hf['median_ms'] / bf16['median_ms']:.2f}×.")


IDLE_GAPS_RUN = "h200_idle_gaps.json"


def h200_idle_gaps() -> str:
    """Each profiled variant's idle GPU time by cause (`idle_gaps`), where the best step's
    after-sync idle time comes from, and what its GPU work alone would take against HF."""
    from moe_tutorial.perf.idle_gaps import AFTER_SYNC, HOST_BEHIND, SHORT, IdleGaps

    run = _load(IDLE_GAPS_RUN)
    env, variants = run["environment"], run["variants"]
    gaps = {name: IdleGaps.from_dict(v["gaps"]) for name, v in variants.items()}
    rows = []
    for name, g in gaps.items():
        causes = g.ms_by_cause()
        rows.append([f"`{name}`", f"{variants[name]['median_ms']:.1f}", f"{g.busy_ms:.1f}",
                     f"{g.idle_ms:.1f}", f"{causes[AFTER_SYNC]:.1f}", f"{g.syncs_per_step:.0f}",
                     f"{causes[HOST_BEHIND]:.1f}", f"{causes[SHORT]:.1f}"])
    from moe_tutorial.perf.bench import variant

    ours = sorted((name for name in gaps if not variant(name).hf),
                  key=lambda name: variants[name]["median_ms"])
    best = ours[0]
    hf_busy = gaps["hf_grouped_mm_compiled"].busy_ms
    targets = {key: goal for key, _, goal, _ in TARGETS}
    # each precision's fastest step against its own target (the best step; the best bf16 step)
    goals = {"fp8": "train_step_speedup_vs_hf_grouped_mm_compiled",
             "bf16": "train_step_best_bf16_speedup_vs_hf_grouped_mm_compiled"}
    fastest = {}
    for name in ours:
        fastest.setdefault(variant(name).precision_kind, name)
    alone, reached = [], []
    for kind, name in fastest.items():
        ratio, goal = hf_busy / gaps[name].busy_ms, targets[goals[kind]]
        reached.append(ratio >= goal)
        alone.append(f"`{name}`'s {gaps[name].busy_ms:.1f} ms busy, HF's {ratio:.2f}× as much "
                     f"(its step's target, {goal}×: " + ("reached" if reached[-1] else "missed")
                     + ")")
    verdict = ("what separates these steps from their targets is time the GPU waits for the "
               "host, not kernel time" if all(reached) else
               "kernel time too holds back the steps whose GPU work alone misses its target")
    places = [r for r in gaps[best].rows if r["cause"] == AFTER_SYNC][:3]
    return (
        f"One {env['gpu']}, torch {env['torch']}, TE {env['transformer_engine']}, "
        f"`{run['preset']}`, batch {run['batch']} × {run['seq_len']}, {run['steps']} profiled "
        f"steps per variant, ms per step, in {_link(IDLE_GAPS_RUN)}. The profiler slows the "
        f"host, so busy + idle exceeds the unprofiled median and the idle columns are upper "
        f"bounds:\n\n"
        + _table(["variant", "ms/step (unprofiled)", "GPU busy", "GPU idle", "after a host sync",
                  "host syncs", "host behind, no sync", "gaps < 20 µs"],
                 ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:"], rows)
        + f"\n\nThe largest after-sync gaps of `{best}`, by the op that waited and the op "
        f"around it: "
        + "; ".join(f"`{r['where']}` {r['ms']:.2f} ms in {r['gaps']:.3g} gaps" for r in places)
        + f". The GPU work alone of each precision's fastest step, against the GPU work of the "
        f"compiled HF step in the same profiles ({hf_busy:.1f} ms busy{_unlike_adamw(ours)}): "
        + "; ".join(alone) + f". So {verdict}.")


def _unlike_adamw(ours: list[str]) -> str:
    """A label for a comparison of our steps with HF's compiled step where ours compile AdamW
    and HF's does not (the runs with no such HF row): what compiling AdamW bought HF's step
    where a run measured it."""
    from moe_tutorial.perf.bench import committed_candidate_gains, variant

    if not any(variant(name).compiled_adamw for name in ours):
        return ""
    hf = [g["speedup"] for g in committed_candidate_gains()
          if g["base"] == "hf_grouped_mm_compiled" and g["variant"].endswith("_compiled_adamw")]
    return ("; its AdamW not compiled, ours compiled, so not like for like: compiling AdamW made "
            f"HF's compiled step {_span(hf, '.3f')}× faster in the runs that measured it"
            if hf else "; its AdamW not compiled, ours compiled, so not like for like")


def _profile_ms(text: str, name: str) -> float:
    """CUDA total of one row of torch.profiler's table, in ms."""
    for line in text.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == name:
            value = cells[8]  # Name, 5 CPU columns, Self CUDA, Self CUDA %, CUDA total, ...
            scale = {"ms": 1.0, "us": 1e-3, "s": 1e3}[re.sub(r"[\d.]", "", value)]
            return float(re.sub(r"[^\d.]", "", value)) * scale
    raise ValueError(f"no profiler row {name!r}")


def _printed_train_rows(text: str) -> dict[str, tuple[float, float]]:
    """The training-step table bench printed (bench.TRAIN_HEADER's columns): variant ->
    (ms/step, peak memory in GiB), the last printed row of each variant."""
    rows = {}
    for line in text.splitlines():
        if re.match(r"^(hf|ours)_\S+\s+\d+\.\d+\s+[\d,]+\s+\d+\s+(bf16|fp8)\s", line):
            cells = line.split()
            rows[cells[0]] = (float(cells[1]), float(cells[-2]))
    return rows


def h200_profile() -> str:
    """Where the time goes, from the profile bench printed into h200.txt (the JSON keeps no
    profile), and the ratios without the optimizer step, all from that one run: the AdamW time
    of its profile and the step times and peaks of its training table."""
    report = _load("h200.json")
    text = (RESULTS / "h200.txt").read_text()
    variant, steps = re.search(r"^profile of (\S+), (\d+) steps$", text, re.MULTILINE).groups()
    def per_step(*names):
        return sum(_profile_ms(text, n) for n in names) / int(steps)
    adamw = per_step("Optimizer.step#AdamW.step")
    mlp = per_step("_OperationFuserAutogradFunction", "_OperationFuserAutogradFunctionBackward")
    train = _printed_train_rows(text)
    ours = train[variant][0] - adamw
    config, _ = _train_config(report)
    hf_memory = train["hf_grouped_mm"][1]
    def ratio(name):
        return (train[name][0] - adamw) / ours
    def memory(name):
        return train[name][1] / hf_memory
    return (
        f"Where the time goes (torch.profiler over {steps} steps of `{variant}`, in "
        f"{_link('h200.txt')}): the te.ops expert MLPs take {mlp:.1f} ms per step (forward + "
        f"backward), **the AdamW step {adamw:.1f} ms** — bandwidth-bound: "
        f"{config.parameter_counts()['total'] / 1e9:.1f} B bf16 parameters with bf16 moments. "
        f"Every step of the ladder runs the same fused AdamW over the same parameters, so the "
        f"optimizer caps "
        f"the ratios: with the profiled {adamw:.1f} ms taken off every step of the same run's "
        f"training table, our forward + backward is {ratio('hf_eager'):.2f}× HF eager's and "
        f"{ratio('hf_grouped_mm_compiled'):.2f}× the compiled model's. Peak memory against HF "
        f"grouped_mm's in that table: the bf16 te.ops step {memory('ours_te_ops_bf16'):.2f}×, the FP8 one "
        f"{memory('ours_te_ops_fp8'):.2f}× — it keeps FP8 copies of the expert weights for the "
        f"backward pass and FP8 copies of gradients during it.")


def h200_history() -> str:
    """The FP8 te.ops step of every committed one-H200 run of the ladder
    (`bench.committed_train_runs`), oldest first, beside HF eager and the run's fastest step."""
    from moe_tutorial.perf.bench import committed_train_runs, row_precision

    rows = []
    for run, report in committed_train_runs():
        train, env = _train_rows(report), report["environment"]
        best = (report.get("summary") or {}).get("train_step_best_variant")
        if "H200" not in (env.get("gpu") or "") or best is None or not {
                "ours_te_ops_fp8", "hf_eager"} <= train.keys():
            continue
        eager_ms = train["hf_eager"]["median_ms"]
        rows.append([env["date"].split()[0], f"{train['ours_te_ops_fp8']['median_ms']:.1f}",
                     f"{eager_ms / train['ours_te_ops_fp8']['median_ms']:.2f}×",
                     f"{_train_label(best)}, {row_precision(train[best]).replace('fp8', 'FP8')}: "
                     f"{eager_ms / train[best]['median_ms']:.2f}×",
                     _link(run.removeprefix(RESULTS_LINK + "/"))])
    return _table(["run", "te.ops FP8 ms/step", "vs HF eager, same run",
                   "the run's fastest step vs HF eager", "result file"],
                  ["---", "---:", "---:", "---", "---"], rows)


# ---------------------------------------------------------------------------------------------
# Two H200s: expert vs data parallelism (h200x2.json) and the matrix driver's run

def _layout(summary_row: dict) -> str:
    if summary_row["gpus"] == 1:
        return "1 GPU"
    return " × ".join(summary_row["layout"].split("/"))


def _nccl(summary_row: dict) -> str:
    """'all-to-all / all-reduce' ms per step, '–' for a collective the layout does not run."""
    if summary_row["gpus"] == 1:
        return "–"
    times = (summary_row["nccl_alltoall_ms_per_step_max_rank"],
             summary_row["nccl_allreduce_ms_per_step_max_rank"])
    return " / ".join(f"{t:.1f}" if t else "–" for t in times)


def h200x2_ep() -> str:
    from moe_tutorial.moe.config import preset
    from moe_tutorial.parallel.distributed import communication_per_step

    report = _load("h200x2.json")
    env, summary = report["environment"], report["summary"]
    rank = report["runs"][0]["ranks"][0]
    iters = re.search(r"--iters (\d+)", report["runs"][0]["command"])[1]
    order = sorted(summary, key=lambda r: r["precision"] != "bf16")  # stable: bf16 rows first
    rows = [[_layout(r), "FP8" if r["precision"] == "fp8" else r["precision"],
             f"{r['median_ms']:.1f}", f"{r['tokens_per_s_per_gpu']:,.0f}",
             f"{r['pflops_per_gpu']:.3f}", f"{r['scaling_efficiency_vs_1_gpu']:.2f}",
             f"{r['peak_memory_gb']:.1f}", _nccl(r)] for r in order]
    ep = [r for r in summary if r["layout"] == "dp1/ep2"]
    dp = [r for r in summary if r["layout"] == "dp2/ep1"]
    one = [r for r in summary if r["gpus"] == 1]
    tokens = rank["batch_per_gpu"] * rank["seq_len"]
    gradients = communication_per_step(preset(rank["preset"]), tokens, 2, 1)["allreduce_bytes"]
    one_fp8 = next(r["median_ms"] for r in one if r["precision"] == "fp8")
    single_fp8 = _printed_train_rows((RESULTS / "h200.txt").read_text())["ours_te_ops_fp8"][0]
    return (
        f"On {env['machine']}, torch {env['torch']}, TE {env['transformer_engine']} "
        f"({env['date']}): `{rank['preset']}` with the `{rank['backend']}` experts, batch "
        f"{rank['batch_per_gpu']} × {rank['seq_len']} tokens per GPU, median of {iters} steps; the "
        f"1-GPU row is the same script with one process, and \"vs 1 process\" divides by it. "
        f"Results: {_link('h200x2.json')}.\n\n"
        + _table(["layout", "precision", "ms/step", "tokens/s per GPU", "PFLOP/s per GPU",
                  "vs 1 process", "peak GiB per GPU", "NCCL all-to-all / all-reduce ms per step"],
                 ["---", "---", "---:", "---:", "---:", "---:", "---:", "---"], rows) + "\n\n"
        f"- EP halves each GPU's expert weights, gradients and optimizer state: "
        f"{_span([r['peak_memory_gb'] for r in ep], '.1f')} GiB per GPU under dp1 × ep2 against "
        f"{_span([r['peak_memory_gb'] for r in one], '.1f')} on one GPU; it exchanges only the "
        f"routed tokens (the all-to-all kernels, waiting for the peer included, take "
        f"{_span([r['nccl_alltoall_ms_per_step_max_rank'] / r['median_ms'] for r in ep], '.1%')} "
        f"of the step on the slower rank).\n"
        f"- DP keeps all weights on every GPU and all-reduces {gradients / 1e9:.1f} GB of bf16 "
        f"gradients per step ({_span([r['nccl_allreduce_ms_per_step_max_rank'] for r in dp], '.1f')} "
        f"ms, not yet overlapped with the backward pass), hence "
        f"{_span([r['scaling_efficiency_vs_1_gpu'] for r in dp], '.2f')} of the one-process rate.\n"
        f"- The one-process rows are this distributed script (it still flattens and copies the "
        f"gradients for `average_gradients`): {one_fp8:.1f} ms per FP8 step. The course's "
        f"non-distributed step of the same model and batch took {single_fp8:.1f} ms in "
        f"{_link('h200.txt')}'s run of another day, so the ratios above say what the second "
        f"GPU does to this script, not how two GPUs compare with the fastest one-GPU step.")


def _matrix_config(model: dict):
    """The 8-layer model of the 2-GPU matrix run: `mixtral-7l`'s widths with 8 layers (the
    preset had 8 then; that run is why it has 7), checked against the parameters recorded."""
    from moe_tutorial.moe.config import preset

    config = preset("mixtral-7l", num_layers=model["layers"])
    if config.parameter_counts()["total"] != model["total_params"]:
        raise ValueError(f"{model['preset']} is not mixtral-7l with {model['layers']} layers")
    return config


def h200x2_matrix() -> str:
    """The matrix driver's own table (matrix.markdown_table) of its 2-GPU run, without its
    line of expert paths (long and cut mid-word; the JSON has them), and what the memory
    prediction says of its largest rows."""
    from dataclasses import replace

    from benchmarks.matrix import Run, Settings, markdown_table, predicted_peak_gib
    from moe_tutorial.perf.timing import datasheet_tflops

    name = "h200x2_matrix_mixtral-8l.json"
    report = _load(name)
    gpu = report["environment"]["gpu"]
    table = "\n".join(line for line in markdown_table(report).splitlines()
                      if not line.startswith("Experts ("))
    rows = {(r["layout"], r["precision"]): r for r in report["rows"]}
    bf16, fp8 = rows[("dp2×ep1", "bf16")], rows[("dp2×ep1", "fp8")]
    config = _matrix_config(report["model"])
    settings = Settings.from_report(report)
    # These runs predate FSDP2 as train_dist's engine: replicated weights, all-reduced gradients.
    run = Run("ours", 2, 1, "bf16", report["settings"]["backend"], "replicated")
    hf_ran = any(r["model"] == "hf" for r in report["rows"])
    return (
        f"From {_link(name)}:\n\n{table}\n\n"
        f"MFU: PFLOP/s per GPU over the datasheet dense peak of the row's precision (bf16 "
        f"{datasheet_tflops(gpu, 'bf16'):g}, FP8 {datasheet_tflops(gpu, 'fp8'):g} TFLOP/s per "
        f"GPU). These rows ran with replicated weights and a hand-written gradient all-reduce "
        f"(now `--engine replicated`). dp2×ep1 bf16 peaked at {bf16['peak_memory_gb']:.1f} GiB "
        f"per GPU against {predicted_peak_gib(config, run, settings):.1f} GiB predicted "
        f"(`memory.predict`: weights, gradients, AdamW moments, the all-reduce buffer, "
        f"activations); dp2×ep1 FP8 ({fp8['status']}) is predicted at "
        f"{predicted_peak_gib(config, replace(run, precision='fp8'), settings):.1f} GiB: TE's "
        f"FP8 weight copies are freed layer by layer in the backward pass, before the "
        f"all-reduce, so memory does not explain that timeout."
        + ("" if hf_ran else " The HF row was not reached (the file ends incomplete)."))


def h200_fsdp2_world1() -> str:
    """The one-GPU check of FSDP2: the deepest Mixtral-width model `memory.predict` fits on one
    H200, its step through FSDP2 at world size 1 against the non-distributed step, each peak
    next to its prediction; and the same FSDP2 step before the experts were left out of it."""
    from moe_tutorial.moe.config import preset
    from moe_tutorial.perf import memory

    data = _load("h200_fsdp2_world1.json")
    fsdp2, single = data["fsdp2"]["results"][0], data["single"]["results"][0]
    before = data["before"]["fsdp2"]["results"][0]
    before_single = data["before"]["single"]["results"][0]
    env = fsdp2["environment"]
    config = preset(fsdp2["preset"], layers=_layers(data["fsdp2"]["command"]))

    ten = data["ten_layers"]
    ten_fsdp2, ten_single = ten["fsdp2"]["results"][0], ten["single"]["results"][0]

    def single_row(layers, r):
        config = preset(r.get("preset", fsdp2["preset"]), layers=layers)
        predicted = memory.gib(memory.predict(config, batch=r["batch"], seq_len=r["seq_len"],
                                              engine="single", backend=fsdp2["backend"]).peak)
        return [f"non-distributed (`bench`, `{r['variant']}`)", str(layers),
                f"{r['median_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
                f"{r['peak_memory_gb']:.1f}", f"{predicted:.1f}",
                f"{predicted / r['peak_memory_gb'] - 1:+.1%}"]

    def fsdp2_row(name, layers, r):
        return [name, str(layers), f"{r['median_ms']:.1f}", f"{r['tokens_per_s_per_gpu']:,.0f}",
                f"{r['peak_memory_gb']:.1f}", f"{r['predicted_peak_gb']:.1f}",
                f"{r['memory_prediction_error']:+.1%}"]
    ten_layers = _layers(ten["fsdp2"]["command"])
    rows = [single_row(config.num_layers, single),
            fsdp2_row("FSDP2, world size 1 (`train_dist`)", config.num_layers, fsdp2),
            single_row(ten_layers, ten_single),
            fsdp2_row("FSDP2, world size 1", ten_layers, ten_fsdp2),
            fsdp2_row("FSDP2, world size 1, experts under FSDP2 too (before; an earlier "
                      "run, its prediction then)", _layers(data["before"]["fsdp2"]["command"]),
                      before)]
    total = env["gpu_total_memory_bytes"]
    deepest = _deepest_fitting(fsdp2, total)
    diagnosis = data["before"]["diagnosis"]
    under = diagnosis["experts_under_fsdp2"]
    steps = 8  # the diagnosis counted over 8 timed steps (its `recorded_by`)
    allocs = under["per_8_timed_steps"]
    cpu = under["cpu_self_ms_per_step"]
    return (
        f"`memory.predict` puts the deepest Mixtral-width model that one {env['gpu']} "
        f"({total / 2**30:.1f} GiB as torch reports it, less the "
        f"{round(100 * memory.RESERVE_FRACTION)}% it keeps back) holds under FSDP2 at "
        f"{deepest} layers ({fsdp2['batch_per_gpu']} × {fsdp2['seq_len']} tokens, bf16)"
        + ("" if deepest == config.num_layers else
           f"; the runs below are at {config.num_layers} layers, made before the prediction "
           f"changed")
        + ". The same model through the non-distributed step and through FSDP2 at world size "
        "1:\n\n"
        f"`{fsdp2['preset']}` at {config.num_layers} layers ({config.parameter_counts()['total'] / 1e9:.1f} B "
        f"parameters), `{fsdp2['backend']}` experts, bf16 weights and AdamW state, "
        f"{fsdp2['batch_per_gpu']} × {fsdp2['seq_len']} tokens; {env['gpu']}, "
        f"torch {env['torch']}, TE {env['transformer_engine']}, {env['date']}; "
        f"{_link('h200_fsdp2_world1.json')}. Both ran in one GPU call (`{data['single']['command']}`; "
        f"`{data['fsdp2']['command']}`), and so did the pair at {ten_layers} layers.\n\n"
        + _table(["step", "layers", "ms/step", "tokens/s", "peak GiB", "predicted GiB",
                  "prediction error"], ["---", "---:", "---:", "---:", "---:", "---:", "---:"], rows)
        + f"\n\nFSDP2 at world size 1 took {fsdp2['median_ms'] / single['median_ms']:.3f}× the "
        f"non-distributed step's time at {config.num_layers} layers (medians of "
        f"{fsdp2['median_ms']:.1f} and {single['median_ms']:.1f} ms) and "
        f"{ten_fsdp2['median_ms'] / ten_single['median_ms']:.3f}× at {ten_layers} (the 10-layer "
        f"pair ran in an earlier call of the same day), and the caching allocator never had to "
        f"retry (`allocator_retries` {fsdp2['allocator_retries']} and "
        f"{ten_fsdp2['allocator_retries']}).\n\n"
        f"It used to take {before['median_ms'] / before_single['median_ms']:.2f}× at "
        f"{_layers(data['before']['fsdp2']['command'])} layers (the last row, "
        f"against that call's non-distributed {before_single['median_ms']:.1f} ms). With "
        f"one rank nothing is sharded, yet FSDP2 copied every layer's weights into unsharded "
        f"parameters before its forward and backward passes, and every gradient on its way to "
        f"its shard (torch 2.13's world-size-1 paths in `fsdp/_fully_shard/"
        f"_fsdp_param_group.py` and `_fsdp_collectives.py`). Most of those weights are the "
        f"experts', and their buffers came on top of a step that already filled "
        f"{diagnosis['non_distributed']['peak_gib']:.0f} of the GPU's GiB. A diagnostic run "
        f"(the same model, step and optimizer, by a script outside the package; "
        f"`before.diagnosis` in the JSON says how) counted "
        f"{allocs['num_alloc_retries'] / steps:.0f} allocator retries and "
        f"{allocs['num_device_alloc'] / steps:.0f} `cudaMalloc` + "
        f"{allocs['num_device_free'] / steps:.0f} `cudaFree` calls per step, "
        f"{cpu['cudaMalloc'] + cpu['cudaFree']:.0f} ms of CPU time in them (a `cudaFree` waits for "
        f"the GPU to finish everything queued), against none in the non-distributed step. "
        f"That is the idle time in the profile below. With dp = 1 each ep shard of the experts "
        f"lives on one rank anyway, so `fully_shard_layout` now leaves the experts out of FSDP2 "
        f"when no mixed-precision cast needs it (`distributed.experts_outside_fsdp`); FSDP2 "
        f"shards the dense weights only, and the experts' gradients get FSDP2's 1/world factor "
        f"from a hook.\n\n" + _fsdp2_world1_profiles(data))


def _deepest_fitting(run: dict, gpu_bytes: int) -> int:
    """The most layers of `run`'s preset whose FSDP2 world-1 step `memory.predict` fits in
    `gpu_bytes` (with `memory.fits`'s reserve), at the run's batch and backend."""
    from moe_tutorial.moe.config import preset
    from moe_tutorial.perf import memory

    def fits(layers: int) -> bool:
        config = preset(run["preset"], layers=layers)
        return memory.fits(memory.predict(config, batch=run["batch_per_gpu"],
                                          seq_len=run["seq_len"], engine="fsdp2",
                                          backend=run["backend"]), gpu_bytes)
    layers = 1
    while fits(layers + 1):
        layers += 1
    return layers


def _fsdp2_world1_profiles(data: dict) -> str:
    """The steps profiled per part (kernel time), side by side."""
    columns = {"non-distributed": data["profiles"]["single"]["step_breakdown"],
               "FSDP2, experts under FSDP2 (before)": data["before"]["profile"]["step_breakdown"],
               "FSDP2 now": data["ten_layers"]["fsdp2"]["results"][0]["step_breakdown"]}
    parts = list(columns["non-distributed"]["part_ms"])
    rows = [[part] + [f"{c['part_ms'][part]:.1f}" for c in columns.values()] for part in parts]
    rows.append(["**whole step (profiled)**"]
                + [f"**{c['total_ms']:.1f}**" for c in columns.values()])
    return ("Where the time goes at 10 layers, each step profiled (`torch.profiler`, kernel "
            "time per part of `step_profile.PARTS`, ms per step): FSDP2 now by its 10-layer "
            "run's `--breakdown`; before, "
            f"by `{data['before']['profile']['command']}`; the non-distributed step in an "
            f"earlier call, as `{data['profiles']['single']['command']}` (its chapter "
            f"{data['profiles']['single']['chapter']}):\n\n"
            + _table(["part", *columns], ["---", "---:", "---:", "---:"], rows))


def _layers(command: str) -> int:
    """The `--layers N` of a recorded command (its result rows record the preset, not the
    depth)."""
    return int(re.search(r"--layers (\d+)", command)[1])


def _choice(item: dict) -> str:
    """A recommendation's choice; None where nothing qualifies (no layout of the GPUs fits)."""
    return "none fits" if item["choice"] is None else str(item["choice"])


def h200_analyze() -> str:
    """`analyze MODEL --json` on the H200, with its measured sweep: per model, the sweep's rule
    and the recommendation for that GPU."""
    lines, newer = [], []
    for path in sorted((RESULTS / "h200_analyze").glob("*.json")):
        report = _load(f"h200_analyze/{path.name}")
        env, rec = report["environment"], report["recommendation"]
        sweep = rec["sweep"]
        if not sweep["ran"]:
            raise ValueError(f"{path}: no sweep ran; commit an analyze run made on a GPU")
        (machine, chosen), = rec["machines"].items()
        picks = ", ".join(f"{item['item']} {_choice(item)}" for item in chosen)
        lines.append(f"- `{report['model']['name']}` on {machine} ({env['date']}; torch "
                     f"{env['torch']}, TE {env['transformer_engine']}; {len(sweep['rows'])} "
                     f"timed runs; [`{path.name}`]({RESULTS_LINK}/h200_analyze/{path.name})): "
                     f"{sweep['rule']} Recommended: {picks}.")
        if _now_default_path(report, chosen):
            newer.append(f"`{report['model']['name']}`")
    if newer:
        lines.append(f"\nThese runs predate the `te_permute_grouped_mm` backend; `analyze` now "
                     f"recommends it instead of TE's grouped layers where the experts train in "
                     f"bf16 on a Hopper and have at most `experts.SMALL_EXPERT_ELEMENTS` weights "
                     f"per projection (`experts.default_backend`, from h200.json's expert rows): "
                     f"{', '.join(newer)}.")
    return "\n".join(lines)


def _now_default_path(report: dict, chosen: list[dict]) -> bool:
    """Whether today's `analyze` would swap this recorded bf16 recommendation (made on an H200)
    for the course's default small-expert path (`analyze.bf16_default_path`)."""
    from moe_tutorial.perf.analyze import bf16_default_path

    picks = {item["item"]: item["choice"] for item in chosen}
    config = report["model"]["config"]
    return picks["recipe"] == "bf16" and bf16_default_path(
        config["hidden_size"], config["intermediate_size"], picks["backend"]) is not None


# The GPU the Mixtral-8x7B memory table is for: an H200, as config.py's H200 arithmetic assumes.
H200_GIB = 140


def mixtral_8x7b_memory() -> str:
    """`memory.mixtral_8x7b_table` for 8 H200s in bf16 and FP8 (computed, not measured), as
    markdown, with the commands that would run its FSDP2 rows."""
    from moe_tutorial.perf import memory

    lines = []
    for precision in ("bf16", "fp8"):
        rows, _ = memory.mixtral_8x7b_table(H200_GIB * 2**30, precision=precision)
        settings = rows[0]["settings"]
        recipe = f" ({settings['recipe']})" if settings.get("recipe") else ""
        lines += [f"**{precision}{recipe}**, {settings['batch']} × {settings['seq_len']} tokens "
                  f"per GPU, `{settings['backend']}` experts:", "",
                  "| layout | state dtype | weights + grads + AdamW | FP8 weight copies "
                  "| gathered weights + grad buffers | activations + logits | peak GiB (moment) "
                  "| fits | why |", "|---|---|---:|---:|---:|---:|---:|---|---|"]
        for r in rows:
            gib = memory.gib
            lines.append(
                f"| {r['layout']} | {r['state_dtype']} "
                f"| {gib(r['parameters'] + r['gradients'] + r['optimizer_state']):.1f} "
                f"| {gib(r['fp8_weight_copies']):.1f} "
                f"| {gib(r['gathered_parameters'] + r['gradient_buffers']):.1f} "
                f"| {gib(r['activations'] + r['logits']):.1f} "
                f"| {gib(r['peak_bytes']):.1f} ({r['peak_phase']}) "
                f"| {'yes' if r['fits'] else '**no**'} | {r['why']} |")
        lines.append("")
    reserve = round(100 * memory.RESERVE_FRACTION)
    checkpointed = memory.predict(memory.preset("mixtral-8x7b"), batch=1, seq_len=4096, dp=8,
                                  ep=1, engine="fsdp2", precision="fp8",
                                  backend=memory.TABLE_BACKEND, state_dtype="float32",
                                  activation_checkpointing=True)
    lines.append(
        f"FSDP2 dp8 × ep1 in FP8 with activation checkpointing: "
        f"{memory.gib(checkpointed.peak):.1f} GiB ({checkpointed.peak_phase}).")
    lines.append(
        f"GPUs of {H200_GIB} GiB with {reserve}% kept for the CUDA context, NCCL and "
        f"fragmentation. To run the FSDP2 rows on 8 GPUs: `torchrun --nproc_per_node=8 -m "
        f"moe_tutorial.perf.train_dist --mode bench --preset mixtral-8x7b --dp 8 --ep 1 "
        f"--state-dtype float32 --batch 1 --seq-len 4096 --backend te_ops` (`--dp 4 --ep 2` for "
        f"dp4 × ep2; `--precision fp8 --activation-checkpointing` for FP8 at dp8).")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Published figures (published_recipe.json): quoted, not measured here

def published_recipe() -> str:
    """The recipe's like-for-like HF comparison, its post's headline quoted as the post's, and
    the files' only ratio near that headline, each with its source file, machine, layout and
    sequence length."""
    data = _load("published_recipe.json")
    like, headline = data["comparisons"]["hf_like_for_like"], data["comparisons"]["mxfp8_headline"]
    base = like["tokens_per_s_per_gpu"][like["baseline"]]
    chain = " → ".join(f"{name} {value:,.0f}" + ("" if value == base else f" ({value / base:.2f}×)")
                       for name, value in like["tokens_per_s_per_gpu"].items())
    tps = headline["tokens_per_s_per_gpu"]
    te = ", ".join(f"{name} {value:,.0f}" for name, value in tps.items())
    hf = headline["hf_row"]
    claim = headline["published_claim"]
    source = f"`{data['repository']}`"
    return (
        f"- Like for like with HF, {like['gpus']}, {like['layout']}, seq {like['seq_len']} "
        f"({source}, `{like['source_file']}`: {like['source_detail']}): {chain} tokens/s/GPU.\n"
        f"- The headline, quoted from {claim['source']}: \"{claim['text']}\" The recipe's public "
        f"files do not reproduce it: their {like['gpus']} comparison with HF is the row above. "
        f"The only ratio near {headline['published_speedup']:g} in them is TE MXFP8 over TE bf16 "
        f"on {headline['gpus']}, {headline['layout']}, seq {headline['seq_len']} ({source}, "
        f"`{headline['source_file']}`): {te} tokens/s/GPU, "
        f"{tps['TE MXFP8']:,.0f} / {tps['TE bf16']:,.0f} = {tps['TE MXFP8'] / tps['TE bf16']:.3f}. "
        f"That the post rounds this ratio is the course's reading, not the post's. "
        f"The same file's HF row ({hf['tokens_per_s_per_gpu']:,} tokens/s/GPU) is "
        f"{hf['layout']}, {hf['batch']}, {hf['setup']} (`{hf['source_script']}`); its last loss, "
        f"{hf['last_loss']:g} against the TE rows' {hf['te_rows_last_loss']:g}, says the TE rows did "
        f"not start from that checkpoint. TE/HF in that file compares different setups.")


# ---------------------------------------------------------------------------------------------
# The small protein MoE on a CPU: `python -m moe_tutorial train --json` (cpu_train_small.json)

def cpu_train() -> str:
    """What `train` printed, from its --json history: the evaluation rows, then the loss on all
    validation tokens against the unigram baseline, with the machine and versions."""
    run = _load("cpu_train_small.json")
    env, settings = run["environment"], run["settings"]
    rows = [["0", "", f"{run['val_loss_start']:.3f}", "", ""]]
    rows += [[str(r["step"]), f"{r['loss']:.3f}", f"{r['val_loss']:.3f}",
              f"{r['tokens_per_s']:,.0f}", f"{r['elapsed_s'] / 60:.2f}"]
             for r in run["history"] if "val_loss" in r]
    last = run["history"][-1]
    table = _table(["step", "train loss", "validation loss (8 batches)", "tokens/s", "minutes"],
                   ["---:"] * 5, rows)
    return (
        f"{table}\n\nOn all validation tokens the loss goes from **{run['val_loss_start']:.3f} to "
        f"{run['val_loss_final']:.3f} nats**, against a unigram baseline of "
        f"**{run['unigram_nats']:.3f} nats** ({run['val_loss_final'] - run['unigram_nats']:+.3f}): "
        f"{settings['steps']} steps of batch {settings['batch_size']}, "
        f"{last['elapsed_s'] / 60:.1f} minutes. Measured with `{settings['backend']}` experts on "
        f"{env['cpu_threads']} CPU threads, Python {env['python']}, torch {env['torch']}, seed "
        f"{settings['seed']}, {env['date']}: {_link('cpu_train_small.json')}.")


# ---------------------------------------------------------------------------------------------
# The chapters and their exercises: what each teaches, and how long it takes (README). The
# times come from one written method, the course's clock (docs/course.md, "How the times are
# made"), applied to the notebooks and to the recorded small-mode run of the course.

# One sentence per chapter notebook: what the learner takes away.
CHAPTER_LESSONS = {
    "00_setup": "Appendix, optional (start with 01): what your machine runs and why, the "
                "course's two modes, and the protein data every chapter trains on.",
    "01_naive_moe": "A Mixture-of-Experts layer from scratch: the router, the per-expert loop "
                    "that HF's eager experts run, the load-balancing loss, a first training run.",
    "02_grouped_linear": "Tokens sorted by expert and every expert run as one grouped GEMM "
                         "(`torch._grouped_mm`, TE `GroupedLinear`), checked equal to the loop.",
    "03_fp8_numerics": "FP8 and MXFP8 from first principles: the formats, block scales, and the "
                       "error they add to real activations, weights and gradients.",
    "04_fp8_training": "A GEMM on FP8 operands with their scales, then which TE recipe your "
                       "GPU trains with, the rows per expert it needs, and training under "
                       "`te.autocast`.",
    "05_fused_grouped_mlp": "The expert MLP as one `te.ops.Sequential` chain, the routing "
                            "weights inside its activation, and when TE fuses it.",
    "06_end_to_end": "The whole model from HF eager to the course's fastest step: time, MFU, "
                     "memory and loss on protein data.",
    "07_expert_parallel": "Expert parallelism: tokens exchanged all-to-all between processes, "
                          "and what each GPU holds under data vs expert parallelism.",
    "08_your_model": "Your own MoE (Qwen3-MoE, OLMoE, DeepSeek-V3 or your config.json): "
                     "analysed, converted from transformers, trained.",
    "09_deep_dive": "Optional, after the chapters: speed-of-light floors, idle gaps, a step with "
                    "no host sync, the compiled and in-backward optimizers, and the history of "
                    "the H200 runs.",
}
# Notebooks the table lists but its totals leave out: read them or not, the course is complete.
OPTIONAL_NOTEBOOKS = {"09_deep_dive"}
# The generated region of each chapter's header (the first markdown cell of its notebook): the
# chapter's time and its exercise's, and its run time, as the README's table states them.
CHAPTER_TIME = "chapter-time"
EXERCISES, SOLUTIONS = ROOT / "exercises", ROOT / "solutions"
COURSE_RUN = "cpu_course_small.json"  # the run the README's chapter table quotes

# The clock: minutes per thing a learner reads or does. Each rate is a stated assumption for a
# careful reader new to the subject, not a measurement; docs/course.md says why each is what it is.
PROSE_WORDS_PER_MINUTE = 170    # a notebook's markdown, read as technical prose
PRINTED_WORDS_PER_MINUTE = 200  # what its cells print (the recorded small-mode run): read alike
CODE_LINES_PER_MINUTE = 8       # code read and understood a line at a time (blank and comment-only
                                # lines not counted)
MINUTES_PER_PREDICTION = 2      # a `predict` question: read it, commit to an answer, read the grade
MINUTES_PER_FIGURE = 0.5        # a figure: a picture in the markdown or one the run drew
MINUTES_PER_FUNCTION = 10       # an exercise function to write (one solution region), its check
                                # run and its diagnosis read until it passes
MINUTES_PER_OPEN_QUESTION = 3   # an exercise's open question, answered in a few sentences
ROUND_TO = 5                    # each notebook's minutes, to the nearest 5 (at least 5)
# An exercise's optional last section: from the markdown cell that opens with this heading to the
# next level-2 heading (its score). The clock times it apart from the exercise, and no total counts it.
OPTIONAL_SECTION = "## Going further (optional)"

_WORD = re.compile(r"[^\W_][\w'’.-]*")
# A prediction: `widgets.predict(...)` or a bare `predict(...)` (not `memory.predict` and the like)
_PREDICTION = re.compile(r"(?:\bwidgets\.|(?<![\w.]))predict\(")
_MARKDOWN_FIGURE = re.compile(r"!\[[^\]]*\]\(|<img\b")
_LINK_TARGET = re.compile(r"\]\([^)\s]*\)")  # a link's or picture's address: not read as prose
_FIGURE_MIME = ("image/", "application/vnd.plotly.v1+json")
_WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
_HTML_DROP = re.compile(r"<(script|style)\b.*?</\1>", re.DOTALL | re.IGNORECASE)
_HTML_TAG = re.compile(r"<[^>]+>")
SOLUTION_BEGIN, ANSWER_TAG = "### BEGIN SOLUTION", "answer"


@dataclass(frozen=True)
class Work:
    """What a learner meets in one notebook, counted: the clock's inputs. `printed_words` and
    `run_s` are None where no recorded run says them (they then count nothing, and say so)."""
    prose_words: int = 0
    code_lines: int = 0
    predictions: int = 0
    figures: int = 0
    printed_words: int | None = None
    run_s: float | None = None
    functions: int = 0
    open_questions: int = 0
    stale: bool = False  # the recorded run ran an earlier version of the notebook
    # An exercise's `OPTIONAL_SECTION`, counted alike but apart: not in this Work's minutes
    optional: Work | None = None

    def parts(self) -> dict[str, float]:
        """Minutes per kind of work (the clock's rates applied)."""
        return {"prose": self.prose_words / PROSE_WORDS_PER_MINUTE,
                "printed output": (self.printed_words or 0) / PRINTED_WORDS_PER_MINUTE,
                "code": self.code_lines / CODE_LINES_PER_MINUTE,
                "run": (self.run_s or 0.0) / 60,
                "predictions": self.predictions * MINUTES_PER_PREDICTION,
                "figures": self.figures * MINUTES_PER_FIGURE,
                "functions to write": self.functions * MINUTES_PER_FUNCTION,
                "open questions": self.open_questions * MINUTES_PER_OPEN_QUESTION}

    def exact_minutes(self) -> float:
        return sum(self.parts().values())

    def minutes(self) -> int:
        """The stated time: the sum of the parts to the nearest `ROUND_TO` minutes, at least
        that (a rounding small edits seldom move, so a header is not rewritten for a word)."""
        return ROUND_TO * max(1, math.floor(self.exact_minutes() / ROUND_TO + 0.5))


def _cells(notebook: Path) -> list[dict]:
    try:
        return json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    except (OSError, ValueError, KeyError) as exc:
        raise DocsError(f"{notebook}: not a readable notebook ({exc}); restore it from git") from None


def _code_lines(source: str) -> int:
    return sum(1 for line in source.splitlines()
               if line.strip() and not line.strip().startswith("#"))


def _source_work(cells: list[dict]) -> Work:
    words = lines = predictions = figures = 0
    for cell in cells:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            words += len(_WORD.findall(_LINK_TARGET.sub("]", _REGION.sub("", source))))
            figures += len(_MARKDOWN_FIGURE.findall(source))
        elif cell["cell_type"] == "code":
            lines += _code_lines(source)
            predictions += len(_PREDICTION.findall(source))
    return Work(prose_words=words, code_lines=lines, predictions=predictions, figures=figures)


def notebook_work(notebook: Path) -> Work:
    """What the notebook's sources give the clock: its markdown's words (generated regions and
    link addresses left out: the time a region states must not move the time it states), its
    code lines, its predictions and the pictures its markdown shows."""
    return _source_work(_cells(notebook))


def _split_optional(cells: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the exercise's cells, its `OPTIONAL_SECTION`'s): the section runs from the markdown cell
    that opens with that heading to the next level-2 heading."""
    core, optional, inside = [], [], False
    for cell in cells:
        source = "".join(cell["source"]).lstrip()
        if cell["cell_type"] == "markdown" and source.startswith("## "):
            inside = source.startswith(OPTIONAL_SECTION)
        (optional if inside else core).append(cell)
    return core, optional


def _shown_text(text: str) -> str:
    """A stream's text as a reader sees it: of each line rewritten with carriage returns (a
    progress bar), only its last state."""
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n"))


def printed_output(executed: Path) -> tuple[int, int]:
    """(words, figures) an executed notebook's outputs show a reader: streams as the terminal
    leaves them, each rich output's markdown, else its HTML's text, else its plain text; a
    picture or plotly figure is a figure; a live widget's placeholder shows nothing (its static
    result follows it)."""
    words = figures = 0
    for cell in _cells(executed):
        for out in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            if out.get("output_type") == "stream":
                words += len(_WORD.findall(_shown_text("".join(out.get("text", "")))))
                continue
            data = out.get("data") or {}
            if any(mime.startswith(_FIGURE_MIME) for mime in data):
                figures += 1
            elif _WIDGET_MIME in data:
                continue
            elif "text/markdown" in data:
                words += len(_WORD.findall("".join(data["text/markdown"])))
            elif "text/html" in data:
                text = _HTML_TAG.sub(" ", _HTML_DROP.sub(" ", "".join(data["text/html"])))
                words += len(_WORD.findall(html.unescape(text)))
            elif "text/plain" in data:
                words += len(_WORD.findall("".join(data["text/plain"])))
    return words, figures


def source_digest(notebook: Path) -> str:
    """A short hash of what a notebook's cells say (their types and sources), leaving out what a
    run or `docs` adds: papermill's injected parameters and the generated regions. An executed
    notebook and its source give the same digest while the chapter is unchanged."""
    import hashlib

    cells = [(c["cell_type"], _REGION.sub("", "".join(c["source"])))
             for c in _cells(notebook)
             if "injected-parameters" not in c.get("metadata", {}).get("tags", [])]
    return hashlib.sha256(json.dumps(cells, ensure_ascii=False).encode()).hexdigest()[:16]


def chapter_notebooks(folder: Path | None = None) -> list[Path]:
    """The course's notebooks (`NN_*.ipynb`) in `folder` (default: this checkout's), in order."""
    return sorted((folder or NOTEBOOKS).glob("[0-9][0-9]_*.ipynb"))


def exercise_of(chapter: Path) -> Path | None:
    """The exercise notebook beside a chapter (the same number), None where it has none."""
    number = chapter.stem.split("_", 1)[0]
    found = sorted(EXERCISES.glob(f"{number}_*.ipynb"))
    return found[0] if found else None


def _runs() -> dict[str, dict]:
    return {r["notebook"]: r for r in _load(COURSE_RUN)["runs"]}


def chapter_work(notebook: Path, run: dict | None = None) -> Work:
    """The clock's inputs for a chapter: its sources, and what the recorded run (`run`, its
    entry in `COURSE_RUN`) printed and took."""
    work = notebook_work(notebook)
    if run is None:
        return work
    return replace(work, run_s=run["seconds"], printed_words=run.get("printed_words"),
                   figures=work.figures + run.get("printed_figures", 0),
                   stale=run.get("source_digest") not in (None, source_digest(notebook)))


def exercise_work(exercise: Path) -> Work:
    """The clock's inputs for an exercise: what the learner reads is the exercise notebook;
    what they write, its solution's regions and open questions (the notebook of the same name
    in solutions/, the single source). The time to run each check and read its diagnosis is in
    the minutes per function: the exercises are not part of the recorded run. An exercise's
    `OPTIONAL_SECTION` is counted alike into `optional`, and left out of its own minutes."""
    solution = SOLUTIONS / exercise.name
    read = _split_optional(_cells(exercise))
    written = _split_optional(_cells(solution)) if solution.exists() else ([], [])

    def work(part: int) -> Work:
        cells = written[part]
        return replace(_source_work(read[part]),
                       functions=sum("".join(c["source"]).count(SOLUTION_BEGIN) for c in cells
                                     if c["cell_type"] == "code"),
                       open_questions=sum(ANSWER_TAG in c.get("metadata", {}).get("tags", [])
                                          for c in cells))
    return replace(work(0), optional=work(1) if read[1] or written[1] else None)


def reading_minutes(notebook: Path) -> int:
    """A notebook's minutes from its sources alone (prose, code, predictions, pictures; no run
    recorded), by the clock."""
    return notebook_work(notebook).minutes()


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"


def _hours(minutes: int) -> str:
    hours, rest = divmod(minutes, 60)
    return f"{hours} h {rest:02d} min" if hours else f"{rest} min"


def _clock_rows() -> tuple[list[tuple[Path, Work, Path | None, Work | None]],
                           list[tuple[Path, Work, Path | None, Work | None]]]:
    """(counted, optional): per chapter notebook, its work and its exercise's."""
    runs = _runs()
    rows = []
    for notebook in chapter_notebooks():
        if notebook.stem not in CHAPTER_LESSONS:
            raise DocsError(f"chapter {notebook.stem} has no sentence in docs.CHAPTER_LESSONS: "
                            "add what it teaches there")
        exercise = exercise_of(notebook)
        rows.append((notebook, chapter_work(notebook, runs.get(notebook.stem)), exercise,
                     exercise_work(exercise) if exercise else None))
    return ([r for r in rows if r[0].stem not in OPTIONAL_NOTEBOOKS],
            [r for r in rows if r[0].stem in OPTIONAL_NOTEBOOKS])


def _unrecorded(work: Work) -> bool:
    """Whether the recorded run says nothing of what this chapter prints (not in the run, or
    recorded before runs counted printed output)."""
    return work.printed_words is None


def chapter_times() -> str:
    """The README's chapter table: what each chapter teaches, its time and its exercise's by the
    clock, its run time in the committed headless run; then the totals, chapters and exercises
    apart, and where they come from."""
    run = _load(COURSE_RUN)
    counted, optional = _clock_rows()

    def row(notebook, work, exercise, exercise_work_):
        mark = "*" if _unrecorded(work) else "†" if work.stale else ""
        done = (f"[{exercise.stem}](exercises/{exercise.name}): {exercise_work_.minutes()} min"
                + _optional_minutes(exercise_work_) if exercise else "–")
        ran = "not measured yet" if work.run_s is None else _duration(work.run_s)
        return [f"[{notebook.stem}](notebooks/{notebook.name})", CHAPTER_LESSONS[notebook.stem],
                f"{work.minutes()} min{mark}", done, ran]

    rows = [row(*r) for r in counted]
    chapters = sum(work.minutes() for _, work, _, _ in counted)
    exercises = sum(w.minutes() for _, _, e, w in counted if e)
    extras = sum(w.optional.minutes() for _, _, e, w in counted if e and w.optional)
    ran = sum(work.run_s or 0.0 for _, work, _, _ in counted)
    first, last = counted[0][0].stem[:2], counted[-1][0].stem[:2]
    numbers = [e.stem[:2] for _, _, e, _ in counted if e]
    rows.append(["**in all**", f"chapters {first}–{last}; exercises {numbers[0]}–{numbers[-1]}",
                 f"**{_hours(chapters)}**",
                 f"**{_hours(exercises)}**" + (f" (+ {_hours(extras)} optional)" if extras else ""),
                 f"**{_duration(ran)}**"])
    rows += [row(*r) for r in optional]
    unrecorded = [n.stem for n, w, _, _ in counted + optional if _unrecorded(w)]
    stale = [n.stem for n, w, _, _ in counted + optional if w.stale and not _unrecorded(w)]
    env = run["environment"]
    note = f" {run['note']}" if run.get("note") else ""
    return (_table(["chapter", "you learn", "chapter time", "its exercise", f"run ({run['mode']} mode)"],
                   ["---", "---", "---:", "---", "---:"], rows)
            + "\n\nTimes by the course's clock ([how they are made](docs/course.md#how-the-times-are-"
            f"made)): a chapter's prose, code and printed output read, its cells run, its "
            f"predictions made; an exercise's prose and code read, {MINUTES_PER_FUNCTION} min per "
            f"function you write and {MINUTES_PER_OPEN_QUESTION} per open question"
            + ("; an exercise's last section, *Going further (optional)*, is timed apart "
               "(\"+ N min optional\"), outside the exercise's time and the exercises' total. "
               if extras else ". ")
            + (f"*: the recorded run counted no printed output for {', '.join(unrecorded)}, "
               "so none is in that time (record a run: docs/course.md says how). "
               if unrecorded else "")
            + (f"†: {', '.join(stale)} changed since the recorded run, whose printed output and "
               "run time that time still counts (record a run again: docs/course.md says how). "
               if stale else "")
            + f"Each run time was measured by `python -m moe_tutorial run` (what `make course` "
            f"runs) in {run['mode']} mode on {env['cpu_count']} CPU cores ({env['cpu_model']}, "
            f"torch {env['torch']}, {env['date'][:10]}): {_link(COURSE_RUN)}{_shared(run, env)}."
            f"{note}")


def _optional_minutes(work: Work) -> str:
    """What an exercise's optional section adds, as the README's table states it."""
    return f" (+ {work.optional.minutes()} min optional)" if work.optional else ""


def clock_table() -> str:
    """docs/course.md's breakdown: per chapter and per exercise, what the clock counted and the
    minutes it gives."""
    counted, optional = _clock_rows()

    def minutes(work):  # †: counted from a recorded run of an earlier version of the notebook
        return f"{work.exact_minutes():.1f} → **{work.minutes()}**" + "†" * work.stale

    def maybe(value, fmt="{:,}"):
        return "not recorded" if value is None else fmt.format(value)

    chapters = [[notebook.stem, f"{work.prose_words:,}", maybe(work.printed_words),
                 f"{work.code_lines:,}", maybe(work.run_s, "{:.0f} s"), str(work.predictions),
                 str(work.figures), minutes(work)]
                for notebook, work, _, _ in counted + optional]

    def exercise_row(name, work):
        return [name, f"{work.prose_words:,}", f"{work.code_lines:,}", str(work.functions),
                str(work.open_questions), str(work.predictions), str(work.figures), minutes(work)]

    exercises = [row for _, _, exercise, work in counted + optional if exercise
                 for row in [exercise_row(exercise.stem, work)]
                 + ([exercise_row(f"{exercise.stem}, going further (optional)", work.optional)]
                    if work.optional else [])]
    return (_table(["chapter", "prose words", "printed words", "code lines", "run",
                    "predictions", "figures", "minutes → stated"],
                   ["---"] + ["---:"] * 7, chapters) + "\n\n"
            + _table(["exercise", "prose words", "code lines", "functions to write",
                      "open questions", "predictions", "figures", "minutes → stated"],
                     ["---"] + ["---:"] * 7, exercises))


def chapter_time(notebook: Path) -> str:
    """A chapter header's line: its time and its exercise's by the clock, and its run time in
    the committed headless run (the numbers of the README's chapter table)."""
    run = _load(COURSE_RUN)
    work = chapter_work(notebook, _runs().get(notebook.stem))
    exercise = exercise_of(notebook)
    env = run["environment"]
    machine = (f"{env['cpu_count']} CPU cores" if env["gpu"] is None
               else f"{env['gpu_count']} × {env['gpu']}")
    ran = (f"{_duration(work.run_s)}, measured by `make course` "
           f"(`{RESULTS_LINK}/{COURSE_RUN}`)" if work.run_s is not None else "not measured yet")
    also = (f"; its exercise, `{exercise.stem}`, about {exercise_work(exercise).minutes()} min"
            if exercise else "")
    return (f"*Time: about {work.minutes()} min to read, run and predict{also} (the course's "
            f"clock, docs/course.md) · run ({run['mode']} mode, {machine}): {ran}*")


def _header_region(path: Path, text: str) -> tuple[int, int] | None:
    """The lines of the notebook's JSON `text` between its first markdown cell's chapter-time
    markers, as (first, end) line indices; None when that cell has no such region. Each line of
    a cell's source is one JSON string on one line of the file, so the region is rewritten in
    place and the rest of the file keeps its layout byte for byte."""
    try:
        cells = json.loads(text)["cells"]
    except (ValueError, KeyError, TypeError):
        raise DocsError(f"{path}: not a notebook's JSON; restore it from git") from None
    header = next((c for c in cells if c.get("cell_type") == "markdown"), None)
    source = "".join(header["source"]) if header else ""
    markers = [m[1] for m in _MARKER.finditer(source) if m[2] == CHAPTER_TIME]
    if not markers:
        return None
    if markers != ["BEGIN", "END"] or not any(m["name"] == CHAPTER_TIME
                                             for m in _REGION.finditer(source)):
        raise DocsError(f"{path}: the first markdown cell's {CHAPTER_TIME} markers do not pair "
                        f"up; write them as two lines, {_block(CHAPTER_TIME, '')!r}")
    lines = text.split("\n")
    begin = [i for i, line in enumerate(lines)
             if f"<!-- BEGIN generated: {CHAPTER_TIME} " in line]
    end = [i for i, line in enumerate(lines) if f"<!-- END generated: {CHAPTER_TIME} " in line]
    if len(begin) != 1 or len(end) != 1 or not begin[0] < end[0]:
        raise DocsError(f"{path}: the {CHAPTER_TIME} markers must each be one line of the first "
                        "markdown cell, and only there")
    return begin[0] + 1, end[0]


def render_chapter_time(path: Path, text: str) -> str:
    """The notebook's JSON `text` with its header's chapter-time region rewritten (unchanged
    when it has none)."""
    span = _header_region(path, text)
    if span is None:
        return text
    lines = text.split("\n")
    indent = re.match(r"\s*", lines[span[1]])[0]
    body = [f"{indent}{json.dumps(line + chr(10), ensure_ascii=False)},"
            for line in chapter_time(path).splitlines()]
    return "\n".join(lines[:span[0]] + body + lines[span[1]:])


def _shared(run: dict, env: dict) -> str:
    """A note when other work shared the machine during the run: its times are then longer
    than the machine alone would take."""
    load = run.get("load_average_15min_at_recording")
    if load is None or load <= env["cpu_count"]:
        return ""
    return (f"; other work shared the machine (load average {load:.1f} on {env['cpu_count']} "
            f"cores over the run's last 15 minutes), so a machine of its own runs faster")


def record_course_run(*run_dirs: str | Path, replace: bool = False, note: str | None = None) -> Path:
    """Write the run times of a headless course run (`python -m moe_tutorial run --out
    RUN_DIR`) into `benchmarks/results/`, with this machine's hardware and versions: call it on
    the machine that ran, right after the run. A course run in parts (`run --notebooks ...`
    into several folders) is recorded from all of them, each notebook once. Each time is
    papermill's duration of the executed notebook (kernel start included); beside it, the words
    and figures its outputs show (`printed_output`), which the clock reads. `note` says anything
    a reader of the numbers should know. Returns the file written."""
    from moe_tutorial.perf.timing import environment

    runs, modes = {}, set()
    for run_dir in map(Path, run_dirs):
        executed = sorted(run_dir.glob("[0-9][0-9]_*.ipynb"))
        if not executed:
            raise DocsError(f"{run_dir}: no executed notebooks (NN_*.ipynb) there; give the --out "
                            "folder of a `python -m moe_tutorial run`")
        for path in executed:
            meta = json.loads(path.read_text(encoding="utf-8"))["metadata"].get("papermill") or {}
            if meta.get("duration") is None or meta.get("exception"):
                raise DocsError(f"{path}: this notebook did not run to its end; record runs in "
                                "which every notebook passed")
            if path.stem in runs:
                raise DocsError(f"{path}: {path.stem} is in two of the folders; give each "
                                "notebook's run once")
            modes.add(meta.get("parameters", {}).get("MODE"))
            words, figures = printed_output(path)
            runs[path.stem] = {"notebook": path.stem, "seconds": round(meta["duration"], 1),
                               "started": meta["start_time"], "printed_words": words,
                               "printed_figures": figures, "source_digest": source_digest(path)}
    if len(modes) != 1 or None in modes:
        raise DocsError(f"{', '.join(map(str, run_dirs))}: the notebooks ran in modes "
                        f"{sorted(map(str, modes))}; record runs of one mode")
    mode = modes.pop()
    env = environment()
    env.update(cpu_count=os.cpu_count(), cpu_model=_cpu_model())
    machine = "cpu" if env["gpu"] is None else env["gpu"].split()[-1].lower()
    out = RESULTS / f"{machine}_course_{mode}.json"
    if out.exists() and not replace:
        raise DocsError(f"{out} exists; pass --replace to write this run over it")
    ordered = [runs[name] for name in sorted(runs)]
    record = {
        "what": f"python -m moe_tutorial run --mode {mode}: each notebook's run time, "
                "papermill's duration of the executed notebook (kernel start included), and "
                "what its outputs show a reader (docs.printed_output: words printed, figures "
                "drawn), for the course's clock",
        "mode": mode, "environment": env, "commit": _commit(),
        "load_average_15min_at_recording": round(os.getloadavg()[2], 2),
        **({"note": note} if note else {}),
        "runs": ordered, "total_s": round(sum(r["seconds"] for r in ordered), 1)}
    out.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return out


def _cpu_model() -> str | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return found[1].strip() if found else None


def _commit() -> str | None:
    """The checkout's commit, '+ changes' when its tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short=12", "HEAD")
        return head + (" + changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


# ---------------------------------------------------------------------------------------------
# The README's headline chart: the training-step ladder on one H200 (docs/train-step-ladder.svg)

_SVG_FONT = "font-family=\"Helvetica, Arial, sans-serif\""


def train_step_chart() -> str:
    """An SVG bar chart of every training-step variant in `h200.json`, slowest first: ms per
    step, the speedup over HF eager, and each step's speed-of-light floor (its precision's)."""
    from moe_tutorial.perf.bench import VARIANTS, row_precision, step_floor_ms

    report = _load("h200.json")
    env = report["environment"]
    sol_env = _load("h200_speed_of_light.json")["environment"]  # the rates' own part of the run
    rows = sorted((r for r in _train_rows(report).values() if r.get("status") == "ok"),
                  key=lambda r: -r["median_ms"])
    eager = _train_rows(report)["hf_eager"]["median_ms"]
    best = report["summary"]["train_step_best_variant"]
    label_w, bar_w, row_h, top, left = 400, 330, 26, 80, 12
    width, height = left + label_w + bar_w + 120, top + row_h * len(rows) + 80
    scale = bar_w / max(r["median_ms"] for r in rows)
    config, first = _train_config(report)
    dates = sorted({part["date"][:10] for part in report.get("parts") or [env]})
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" {_SVG_FONT} font-size="13">',
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
           f'<text x="{left}" y="24" font-size="16" font-weight="bold">'
           + escape(f"One training step of mixtral-2l ({config.num_layers} layers at Mixtral-8x7B "
                    f"widths, batch {first['batch']} × {first['seq_len']}): ms per step, shorter "
                    f"is faster") + "</text>",
           f'<text x="{left}" y="44" fill="#444444">'
           + escape(f"One {env['gpu']}, CUDA {env['cuda']}, torch {env['torch']}, Transformer "
                    f"Engine {env['transformer_engine']}, transformers {env['transformers']}")
           + "</text>",
           f'<text x="{left}" y="62" fill="#444444">'
           + escape(f"Medians of the timed steps, run on {' and '.join(dates)}: "
                    "benchmarks/results/h200.json") + "</text>"]
    for i, r in enumerate(rows):
        y = top + i * row_h
        variant = VARIANTS.get(r["variant"])
        hf = variant is not None and variant.hf
        fp8 = row_precision(r) == "fp8"
        color = "#9e9e9e" if hf else ("#3f7d00" if fp8 else "#76b900")
        weight = ' font-weight="bold"' if r["variant"] == best else ""
        label = _train_label(r["variant"]).replace("`", "") + (", FP8" if fp8 else ", bf16")
        length = r["median_ms"] * scale
        out.append(f'<text x="{left + label_w - 8}" y="{y + 17}" text-anchor="end"{weight}>'
                   f"{escape(label)}</text>")
        out.append(f'<rect x="{left + label_w}" y="{y + 4}" width="{length:.1f}" '
                   f'height="{row_h - 8}" fill="{color}"/>')
        floor_ms = step_floor_ms(r, report["speed_of_light"])
        if floor_ms is not None:
            x = left + label_w + floor_ms * scale
            out.append(f'<line x1="{x:.1f}" y1="{y + 1}" x2="{x:.1f}" y2="{y + row_h - 1}" '
                       f'stroke="#000000" stroke-width="2" stroke-dasharray="3,2"/>')
        out.append(f'<text x="{left + label_w + length + 6:.1f}" y="{y + 17}"{weight}>'
                   f"{r['median_ms']:.1f} ms ({eager / r['median_ms']:.2f}×)</text>")
    y = top + row_h * len(rows) + 22
    legend = [("#9e9e9e", "HF transformers"), ("#76b900", "the course's model, bf16"),
              ("#3f7d00", "the course's model, FP8")]
    x = left
    for color, text in legend:
        out.append(f'<rect x="{x}" y="{y - 11}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{x + 18}" y="{y}">{escape(text)}</text>')
        x += 18 + 7 * len(text) + 24
    y += 22
    out.append(f'<line x1="{left + 6}" y1="{y - 12}" x2="{left + 6}" y2="{y + 2}" '
               f'stroke="#000000" stroke-width="2" stroke-dasharray="3,2"/>')
    out.append(f'<text x="{left + 18}" y="{y}">'
               + escape(f"speed-of-light floor: the step's work in its precision, at the rates "
                        f"measured in h200_speed_of_light.json ({sol_env['date'][:10]})")
               + "</text>")
    out.append(f'<text x="{left}" y="{y + 22}" fill="#444444">'
               + escape("(×): speedup over HF eager; bold: the course's fastest step") + "</text>")
    return "\n".join(out + ["</svg>"]) + "\n"


# ---------------------------------------------------------------------------------------------
# The regions, rendering and checking

def regions() -> dict[str, Callable[[], str]]:
    """Region name -> its renderer."""
    return {
        "chapter-times": chapter_times,
        "clock": clock_table,
        "cpu-train": cpu_train,
        "h200-environment": h200_environment,
        "h200-expert-layer": h200_expert_layer,
        "h200-fsdp2-world1": h200_fsdp2_world1,
        "h200-analyze": h200_analyze,
        "h200-expert-notes": h200_expert_notes,
        "h200-train-step": h200_train_step,
        "h200-targets": h200_targets,
        "h200-speed-of-light": h200_speed_of_light,
        "not-adopted": not_adopted,
        "h200-compiled-candidates": h200_compiled_candidates,
        "h200-idle-gaps": h200_idle_gaps,
        "published-recipe": published_recipe,
        "h200-profile": h200_profile,
        "h200-history": h200_history,
        "h200x2-ep": h200x2_ep,
        "h200x2-matrix": h200x2_matrix,
        "mixtral-8x7b-memory": mixtral_8x7b_memory,
    }


def _block(name: str, body: str) -> str:
    return (f"<!-- BEGIN generated: {name} (python -m tools.docs) -->\n{body.rstrip()}\n"
            f"<!-- END generated: {name} -->")


_REPO_LINK = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:|#|/)")  # a link to a path in the repository


def _relative_links(body: str, document: str) -> str:
    """The region's links, written from the repository's root, as seen from `document`."""
    up = "../" * document.count("/")
    return _REPO_LINK.sub("](" + up, body) if up else body


def render(text: str, document: str = "README.md", names: set[str] | None = None) -> str:
    """`text`, the document at `document` (relative to the repository), with every generated
    region rewritten from the results. Refuses a text whose markers do not pair up or name a
    region twice or one no renderer knows; with `names`, also one that lacks any of them."""
    renderers = regions()
    found = [m[1] for m in _REGION.finditer(text)]
    markers = [m.groups() for m in _MARKER.finditer(text)]
    problems = []
    if len(markers) != 2 * len(found):
        problems.append("a BEGIN or END marker without its partner (or a malformed one)")
    problems += [f"region {n!r} appears {found.count(n)} times" for n in sorted(set(found))
                 if found.count(n) > 1]
    problems += [f"region {n!r} is missing" for n in sorted(names or ()) if n not in found]
    problems += [f"unknown region {n!r}" for n in found if n not in renderers]
    if problems:
        raise DocsError("; ".join(problems))
    return _REGION.sub(lambda m: _block(
        m["name"], _relative_links(renderers[m["name"]](), document)), text)


def _read(root: Path, document: str) -> str:
    path = root / document
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DocsError(f"{path}: no such file; run `python -m tools.docs` in a checkout "
                        "of the repository, or give --root the folder that holds README.md and "
                        "docs/") from None


def documents(root: Path = ROOT) -> list[str]:
    """The README and the markdown pages under docs/, relative to `root`."""
    return [README_NAME] + [f"{DOCS_DIR}/{page.name}"
                            for page in sorted((root / DOCS_DIR).glob("*.md"))]


def _placement(texts: dict[str, str]) -> dict[str, set[str]]:
    """document -> the regions it holds; an error for a region in no document or in two."""
    where = {doc: {m["name"] for m in _REGION.finditer(text)} for doc, text in texts.items()}
    problems = []
    for name in regions():
        holders = [doc for doc, names in where.items() if name in names]
        if len(holders) != 1:
            problems.append(f"region {name!r} is in " + (" and ".join(holders) if holders
                                                        else "no document"))
    if problems:
        raise DocsError("; ".join(problems) + " (each region belongs in exactly one of "
                        f"{README_NAME} and {DOCS_DIR}/*.md)")
    return where


def _rendered(root: Path) -> dict[str, tuple[str, str]]:
    """document or chart -> (its text now, its text from the results)."""
    texts = {doc: _read(root, doc) for doc in documents(root)}
    where = _placement(texts)
    out = {}
    for doc, text in texts.items():
        try:
            out[doc] = (text, render(text, doc, where[doc]))
        except DocsError as exc:
            raise DocsError(f"{root / doc}: {exc}") from None
    chart = root / CHART
    out[CHART] = (chart.read_text(encoding="utf-8") if chart.exists() else "",
                  train_step_chart())
    for notebook in chapter_notebooks(root / NOTEBOOKS.name):
        text = notebook.read_text(encoding="utf-8")
        out[f"{NOTEBOOKS.name}/{notebook.name}"] = (text, render_chapter_time(notebook, text))
    return out


def _header(text: str) -> str:
    """A notebook's first markdown cell, from its JSON."""
    cells = json.loads(text)["cells"]
    return next(("".join(c["source"]) for c in cells if c["cell_type"] == "markdown"), "")


def check(root: str | Path = ROOT, max_lines: int = 12) -> list[str]:
    """One short unified diff per region (or chart) whose text differs from what the results
    say; empty when the documents agree with them."""
    problems = []
    for doc, (current, wanted) in _rendered(Path(root)).items():
        if doc == CHART:
            if current != wanted:
                problems.append(f"{doc} " + ("is missing" if not current else
                                            "differs from what h200.json draws"))
            continue
        if doc.endswith(".ipynb"):
            current, wanted = _header(current), _header(wanted)
        now = {m["name"]: m["body"] for m in _REGION.finditer(current)}
        for m in _REGION.finditer(wanted):
            name, body = m["name"], m["body"]
            if now[name] != body:
                diff = list(difflib.unified_diff(now[name].splitlines(), body.splitlines(),
                                                 f"{doc}: {name}", f"from {RESULTS_LINK}: {name}",
                                                 n=0, lineterm=""))
                more = ([f"... ({len(diff) - max_lines} more diff lines)"]
                        if len(diff) > max_lines else [])
                problems.append(f"{doc}: region {name!r} differs from the results:\n"
                                + "\n".join(diff[:max_lines] + more))
    return problems


def write(root: str | Path = ROOT) -> list[str]:
    """Rewrite the regions and the chart under `root` from the results; the documents that
    changed."""
    root = Path(root)
    changed = []
    for doc, (current, wanted) in _rendered(root).items():
        if current != wanted:
            (root / doc).parent.mkdir(parents=True, exist_ok=True)
            (root / doc).write_text(wanted, encoding="utf-8")
            changed.append(doc)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docs",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 with a diff per region that disagrees")
    parser.add_argument("--root", default=None,
                        help="the folder holding README.md and docs/ to render or check (default: "
                             "this repository; the results are always this checkout's)")
    parser.add_argument("--record-run", metavar="RUN_DIR", nargs="+", default=None,
                        help="instead: record the notebooks' run times of a finished `run --out "
                             "RUN_DIR` (or of a run in parts, one folder each) with this machine's "
                             "hardware and versions in benchmarks/results/ (the README's chapter "
                             "table quotes them)")
    parser.add_argument("--replace", action="store_true",
                        help="with --record-run: write over an earlier record of that machine and "
                             "mode")
    parser.add_argument("--note", default=None,
                        help="with --record-run: what a reader of the times should know about the "
                             "run")
    args = parser.parse_args(argv)
    root = Path(args.root) if args.root else ROOT
    if args.record_run and (args.check or args.root):
        print("docs: --record-run writes a result file and renders nothing; run it without "
              "--check and --root, then `python -m tools.docs`", file=sys.stderr)
        return 2
    if not args.record_run and (args.replace or args.note):
        print("docs: --replace and --note go with --record-run RUN_DIR", file=sys.stderr)
        return 2
    try:
        if args.record_run:
            out = record_course_run(*args.record_run, replace=args.replace, note=args.note)
            print(f"wrote {out}")
            return 0
        if not args.check:
            changed = write(root)
            print(f"{root}: rewritten: {', '.join(changed)}" if changed else f"{root}: up to date")
            return 0
        problems = check(root)
    except DocsError as exc:  # a missing document, or markers lost in an edit: one line
        print(exc, file=sys.stderr)
        return 1
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"{root}: {len(problems)} generated part(s) disagree with benchmarks/results/; "
              "run `python -m tools.docs` to regenerate them", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
