"""The regions of docs/benchmarks.md: the course's measured numbers (one H200, two H200s, the
8-GPU memory arithmetic, a CPU), each rendered from the result file that measured it, and the
figures NVIDIA published, quoted with their source.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from tools.doc_results import (
    RESULTS,
    RESULTS_LINK,
    load_result,
    md_table,
    result_link,
    value_span,
)

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
    report = load_result("h200.json")
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

    report = load_result("h200.json")
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
    table = md_table(["shape (T, H, I, E, k)"] + [c[0] for c in EXPERT_COLUMNS],
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
    loop = _fastest([r for r in _expert_rows(load_result(name), shape) if r["backend"] == "naive"])
    return f"{loop['median_ms']:.1f} ms in {result_link(name)}"


def h200_expert_notes() -> str:
    from moe_tutorial.perf.bench import FAMILY_SHAPES, precision_kind

    experts = [r for r in load_result("h200.json")["results"] if r["part"] == "expert"]
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
        f"- FP8 outputs are within {value_span([r['rel_error'] for r in fp8], '.1%')} (relative, "
        f"Frobenius norm) of the bf16 loop's — E4M3's rounding; the check allows "
        f"{value_span([r['tolerance'] for r in fp8], '.0%')}.",
        f"- TE's CUTLASS grouped GEMM (`NVTE_USE_CUTLASS_GROUPED_GEMM`) makes the fine-grained shape "
        f"{value_span(faster, '.2f')}× faster and the Mixtral shape {value_span(slower, '.0%')} slower (both "
        f"routings, both TE backends).",
    ]
    summary = load_result("h200.json")["summary"]
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
    hbm = load_result("h200.json")["speed_of_light"]["rates"]["hbm_gb_per_s"]
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
    return md_table(["variant", "precision", "ms/step", "tokens/s", "TFLOP/s",
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
    report = load_result("h200.json")
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
    report, recipe = load_result("h200.json"), load_result("published_recipe.json")["comparisons"]
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
    return (md_table(["target", "measured", ""], ["---", "---", "---"], rows) + "\n\n"
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
    report = load_result("h200.json")
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
        f"Rates measured in the same run ({rates['device']}, {result_link('h200_speed_of_light.json')}, "
        f"merged into {result_link('h200.json')}): dense bf16 {rates['dense_bf16_tflops']:,.0f} and FP8 "
        f"{rates['dense_fp8_tflops']:,.0f} TFLOP/s, the step's expert GEMM shapes "
        f"{rates['expert_bf16_tflops']:,.0f} (bf16) and {rates['expert_fp8_tflops']:,.0f} (FP8) "
        f"TFLOP/s, HBM {rates['hbm_gb_per_s']:,.0f} GB/s, attention "
        f"{rates['attention_tflops']:,.0f} TFLOP/s. Each part's floor is its FLOPs at its rate or "
        f"its bytes at HBM's rate, whichever is longer (`speed_of_light.step_work`); the step's "
        f"floor is their sum: `{workload['preset']}`, batch {workload['batch']} × "
        f"{workload['seq_len']}, {workload['optimizer']}. Each chapter's step profiled "
        f"(`torch.profiler`, kernel time per part, ms measured / floor; the profiler's own "
        f"overhead lands in *launch gaps / idle*):\n\n"
        + md_table(["part", *variants], ["---"] + ["---:"] * len(variants), rows))


# Measured and not adopted: the part of its variants' names in the committed runs that marks it
# (each beside its base variant, the name without it), what it changed, the last commit whose
# package has its code and the file that held it (`git show <commit>:<file>`)
NOT_ADOPTED = (("_step_in_backward", "AdamW stepped in the backward pass", "a777de2",
                "moe_tutorial/train/loop.py"),
               ("_host_counts", "Each layer's expert counts read to the host once, for TE's "
                "permutation kernel and both grouped GEMMs (`te_grouped_linear`'s `host_counts`)",
                "d0c4ad4", "moe_tutorial/moe/dispatch.py"))


def not_adopted() -> str:
    """Each candidate measured and not adopted, with the commit its code is kept at, beside its
    base variant in every committed run that timed both (`run_history.gains_of_marker`)."""
    from moe_tutorial.course.run_history import gains_of_marker

    parts = []
    for marker, what, commit, path in NOT_ADOPTED:
        rows = [[f"{_train_label(g['base'])}, {g['precision'].replace('fp8', 'FP8')}",
                 f"{g['base_ms']:.1f} → {g['ms']:.1f}", f"{g['speedup']:.3f}×",
                 f"{g['base_peak_gb']:.1f} → {g['peak_gb']:.1f}",
                 result_link(g["run"].removeprefix(RESULTS_LINK + "/"))]
                for g in gains_of_marker(marker, what)]
        parts.append(f"{what} (its code: commit `{commit}`, `{path}`):\n\n" + md_table(
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
             f"{gain['base_peak_gb']:.1f} → {gain['peak_gb']:.1f}", result_link(Path(gain["run"]).name)]
            for gain in gains]
    last_run = Path(gains[-1]["run"]).name  # the newest run: it has both compiled together
    last = load_result(last_run)
    train = _train_rows(last)
    hf, hf_twin = train["hf_grouped_mm_compiled"], train["hf_grouped_mm_compiled_compiled_adamw"]
    fp8, bf16 = train["ours_te_ops_fp8_compiled"], train["ours_te_ops_bf16_compiled"]
    env = last["environment"]
    target = {key: goal for key, _, goal, _ in TARGETS}
    return (
        f"One {env['gpu']}, torch {env['torch']}, TE {env['transformer_engine']}; each "
        f"candidate and its base variant in the same `bench --train-variants` run (medians of "
        f"the timed steps):\n\n"
        + md_table(["what changes", "variant", "ms/step: base → candidate", "speedup", "peak GiB",
                  "run"], ["---", "---", "---:", "---:", "---:", "---"], rows)
        + f"\n\nWith both, in {result_link(last_run)}: our FP8 step {fp8['median_ms']:.1f} ms and our "
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

    run = load_result(IDLE_GAPS_RUN)
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
        f"steps per variant, ms per step, in {result_link(IDLE_GAPS_RUN)}. The profiler slows the "
        f"host, so busy + idle exceeds the unprofiled median and the idle columns are upper "
        f"bounds:\n\n"
        + md_table(["variant", "ms/step (unprofiled)", "GPU busy", "GPU idle", "after a host sync",
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
            f"HF's compiled step {value_span(hf, '.3f')}× faster in the runs that measured it"
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
    report = load_result("h200.json")
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
        f"{result_link('h200.txt')}): the te.ops expert MLPs take {mlp:.1f} ms per step (forward + "
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
                     result_link(run.removeprefix(RESULTS_LINK + "/"))])
    return md_table(["run", "te.ops FP8 ms/step", "vs HF eager, same run",
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

    report = load_result("h200x2.json")
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
        f"Results: {result_link('h200x2.json')}.\n\n"
        + md_table(["layout", "precision", "ms/step", "tokens/s per GPU", "PFLOP/s per GPU",
                  "vs 1 process", "peak GiB per GPU", "NCCL all-to-all / all-reduce ms per step"],
                 ["---", "---", "---:", "---:", "---:", "---:", "---:", "---"], rows) + "\n\n"
        f"- EP halves each GPU's expert weights, gradients and optimizer state: "
        f"{value_span([r['peak_memory_gb'] for r in ep], '.1f')} GiB per GPU under dp1 × ep2 against "
        f"{value_span([r['peak_memory_gb'] for r in one], '.1f')} on one GPU; it exchanges only the "
        f"routed tokens (the all-to-all kernels, waiting for the peer included, take "
        f"{value_span([r['nccl_alltoall_ms_per_step_max_rank'] / r['median_ms'] for r in ep], '.1%')} "
        f"of the step on the slower rank).\n"
        f"- DP keeps all weights on every GPU and all-reduces {gradients / 1e9:.1f} GB of bf16 "
        f"gradients per step ({value_span([r['nccl_allreduce_ms_per_step_max_rank'] for r in dp], '.1f')} "
        f"ms, not yet overlapped with the backward pass), hence "
        f"{value_span([r['scaling_efficiency_vs_1_gpu'] for r in dp], '.2f')} of the one-process rate.\n"
        f"- The one-process rows are this distributed script (it still flattens and copies the "
        f"gradients for `average_gradients`): {one_fp8:.1f} ms per FP8 step. The course's "
        f"non-distributed step of the same model and batch took {single_fp8:.1f} ms in "
        f"{result_link('h200.txt')}'s run of another day, so the ratios above say what the second "
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

    from benchmarks.matrix import Run, Settings, markdown_table, predicted_peak_gib
    from moe_tutorial.perf.timing import datasheet_tflops

    name = "h200x2_matrix_mixtral-8l.json"
    report = load_result(name)
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
        f"From {result_link(name)}:\n\n{table}\n\n"
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

    data = load_result("h200_fsdp2_world1.json")
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
        f"{result_link('h200_fsdp2_world1.json')}. Both ran in one GPU call (`{data['single']['command']}`; "
        f"`{data['fsdp2']['command']}`), and so did the pair at {ten_layers} layers.\n\n"
        + md_table(["step", "layers", "ms/step", "tokens/s", "peak GiB", "predicted GiB",
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
            + md_table(["part", *columns], ["---", "---:", "---:", "---:"], rows))


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
        report = load_result(f"h200_analyze/{path.name}")
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
    for the course's default small-expert path (`recommend.bf16_default_path`)."""
    from moe_tutorial.perf.recommend import bf16_default_path

    picks = {item["item"]: item["choice"] for item in chosen}
    config = report["model"]["config"]
    return picks["recipe"] == "bf16" and bf16_default_path(
        config["hidden_size"], config["intermediate_size"], picks["backend"]) is not None


# The GPU the Mixtral-8x7B memory table is for: an H200, as config.py's H200 arithmetic assumes.
H200_GIB = 140


def mixtral_8x7b_memory() -> str:
    """`memory_table.mixtral_8x7b_table` for 8 H200s in bf16 and FP8 (computed, not measured), as
    markdown, with the commands that would run its FSDP2 rows."""
    from moe_tutorial.moe.config import preset
    from moe_tutorial.perf import memory, memory_table

    lines = []
    for precision in ("bf16", "fp8"):
        rows, _ = memory_table.mixtral_8x7b_table(H200_GIB * 2**30, precision=precision)
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
    checkpointed = memory.predict(preset("mixtral-8x7b"), batch=1, seq_len=4096, dp=8,
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
    data = load_result("published_recipe.json")
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
    run = load_result("cpu_train_small.json")
    env, settings = run["environment"], run["settings"]
    rows = [["0", "", f"{run['val_loss_start']:.3f}", "", ""]]
    rows += [[str(r["step"]), f"{r['loss']:.3f}", f"{r['val_loss']:.3f}",
              f"{r['tokens_per_s']:,.0f}", f"{r['elapsed_s'] / 60:.2f}"]
             for r in run["history"] if "val_loss" in r]
    last = run["history"][-1]
    table = md_table(["step", "train loss", "validation loss (8 batches)", "tokens/s", "minutes"],
                   ["---:"] * 5, rows)
    return (
        f"{table}\n\nOn all validation tokens the loss goes from **{run['val_loss_start']:.3f} to "
        f"{run['val_loss_final']:.3f} nats**, against a unigram baseline of "
        f"**{run['unigram_nats']:.3f} nats** ({run['val_loss_final'] - run['unigram_nats']:+.3f}): "
        f"{settings['steps']} steps of batch {settings['batch_size']}, "
        f"{last['elapsed_s'] / 60:.1f} minutes. Measured with `{settings['backend']}` experts on "
        f"{env['cpu_threads']} CPU threads, Python {env['python']}, torch {env['torch']}, seed "
        f"{settings['seed']}, {env['date']}: {result_link('cpu_train_small.json')}.")
