"""The whole training step per variant, shown: which variants run here and why the others do not,
their timed steps with MFU against a labelled peak, their loss curves, the recipes' published
numbers (quoted) and the course's committed H200 run next to this one. Chapter 06 calls these;
each returns what it showed."""

from __future__ import annotations

import importlib.util

import torch

from . import bench, results, timing, widgets

DESCRIPTIONS = {
    "hf_eager": "HF MixtralForCausalLM, experts_implementation='eager' (a loop over experts)",
    "hf_grouped_mm": "HF, experts_implementation='grouped_mm' (torch._grouped_mm; HF's default)",
    "hf_grouped_mm_compiled": "HF grouped_mm, model.forward under torch.compile (causal sdpa, no mask)",
    "ours_grouped_torch_bf16": "ours, grouped_torch experts (torch._grouped_mm)",
    "ours_te_grouped_linear_bf16": "ours, te.GroupedLinear experts",
    "ours_te_grouped_linear_fp8": "ours, te.GroupedLinear + te.Linear attention under te.autocast (FP8)",
    "ours_te_ops_bf16": "ours, te.ops grouped MLP (GroupedLinear, ScaledSwiGLU, GroupedLinear)",
    "ours_te_ops_fp8": "ours, te.ops grouped MLP + te.Linear attention under te.autocast (FP8)",
}


def variants_here(caps, on_gpu: bool, compiled_baseline: bool, fp8_choice) -> tuple[list[str], dict[str, str]]:
    """Which of bench.TRAIN_VARIANTS run on this machine, shown as a table; a variant that cannot
    run is listed with the reason, never dropped. Returns (variants, {variant: why not})."""
    fp8_runs = caps.has_te and on_gpu and fp8_choice.native
    has_transformers = importlib.util.find_spec("transformers") is not None
    variants, not_run = [], {}
    for v in bench.TRAIN_VARIANTS:
        if bench.VARIANTS[v].hf and not has_transformers:
            not_run[v] = "transformers is not installed (pip install -e '.[hf]')"
        elif v == "hf_grouped_mm_compiled" and not compiled_baseline:
            not_run[v] = ("torch.compile is timed only in full mode on a GPU (COMPILED_BASELINE=True forces it): on a "
                          "CPU it compiles C++ kernels for minutes")
        elif bench.VARIANTS[v].precision_kind == "fp8" and not fp8_runs:
            not_run[v] = (f"FP8 needs Transformer Engine on a CUDA GPU; here: {caps['fp8_current'].runs} "
                          f"({caps['fp8_current'].reason or 'no CUDA GPU'})")
        else:
            variants.append(v)
    te_note = ("" if caps.has_te and on_gpu else
               f"te_* variants run their pure-PyTorch counterparts here ({caps['te_grouped_linear'].reason or 'no CUDA GPU'})"
               ": same parameters and math, none of TE's kernels")
    widgets.show_table(widgets.Table(
        ["variant", "what it is", "runs here?"],
        [[v, DESCRIPTIONS[v], "yes" if v in variants else f"no: {not_run[v]}"] for v in bench.TRAIN_VARIANTS],
        title="training-step variants" + (f"; FP8 recipe {fp8_choice.name}" if fp8_runs else ""), note=te_note))
    return variants, not_run


def peaks_here(device: str, gpu: str | None) -> tuple[timing.Peaks, str]:
    """The peaks MFU divides by, and their label: on a GPU a dense matmul measured here (bf16, and
    FP8 where the tensor cores have it) beside NVIDIA's datasheet; on a CPU its fp32 matmul rate
    stands in the bf16 slot, labelled so."""
    if device == "cuda":
        peaks = timing.measure_peaks(device, gpu)
        fp8 = f"{peaks.fp8_measured:.0f}" if peaks.fp8_measured else "not measured (compute capability < 8.9)"
        return peaks, (f"dense 8192³ matmuls on this {gpu}: bf16 {peaks.bf16_measured:.0f} TFLOP/s (datasheet "
                       f"{peaks.bf16_datasheet or 'unknown'}), FP8 {fp8} TFLOP/s (datasheet {peaks.fp8_datasheet or 'unknown'})")
    peaks = timing.Peaks(bf16_measured=timing.dense_matmul_tflops("cpu", n=1024, dtype=torch.float32))
    return peaks, (f"an fp32 1024³ matmul on this CPU, {peaks.bf16_measured * 1e3:.0f} GFLOP/s, stands in for the 'bf16' "
                   "peak (no datasheet, no FP8 peak on a CPU)")


def ratio(ok: dict, v: str, base: str, key: str = "tokens_per_s") -> float | None:
    """ok[v][key] / ok[base][key], None where either did not run."""
    return ok[v][key] / ok[base][key] if v in ok and base in ok else None


def _ratio_text(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"


def what_ran(v: str, row: dict) -> str:
    variant = bench.VARIANTS[v]
    if variant.hf:
        return f"transformers {variant.backend}" + (" + torch.compile" if variant.compiled else "")
    return row.get("path", "")


def show_step_table(rows: list[dict], not_run: dict, peaks: timing.Peaks, peak_label: str, title: str) -> dict:
    """bench.bench_train_step's rows as one table: ms/step, tokens/s, TFLOP/s, MFU against the
    peak of the row's own precision (an FP8 row against the FP8 peak), peak GiB, the first loss
    against the first variant's, and tokens/s against HF eager's. Returns {variant: row} of the
    rows that ran and passed the loss check."""
    by = {r["variant"]: r for r in rows}
    ok = {v: r for v, r in by.items() if r.get("status") == "ok"}
    table = []
    for v in bench.TRAIN_VARIANTS:
        r = by.get(v)
        if r is None:
            table.append([v, "not run", "", "", "", "", "", "", "", not_run.get(v, "")[:90]])
        elif r.get("status") != "ok":
            table.append([v, r.get("status", "?").upper(), "", "", "", "", "", "", "",
                          (r.get("error") or f"loss differs by {r.get('loss_diff')}")[:160]])
        else:
            precision = bench.row_precision(r)
            table.append([v, f"{r['median_ms']:.1f}", f"{r['tokens_per_s']:,.0f}", f"{r['tflops']:.3g}", precision,
                          timing.mfu_text(r["tflops"], peaks.of(precision), missing="–"),
                          "" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.1f}",
                          f"{r['first_loss']:.4f} ({r['loss_diff']:.1e})", _ratio_text(ratio(ok, v, "hf_eager")),
                          what_ran(v, r)])
    widgets.show_table(widgets.Table(
        ["variant", "ms/step", "tokens/s", "TFLOP/s", "precision", "MFU vs its precision's peak (measured / datasheet)",
         "peak GiB", "first loss (Δ vs first)", "vs HF eager", "what ran"], table, title=title,
        note=f"peaks: {peak_label}"))
    return ok


def show_loss_curves(curves: list[dict], steps: int, lr: float, dtype: str) -> dict:
    """The loss curves' start and level (the mean of the last fifth of the steps), each against
    the first curve's; an FP8 curve is checked against the spread of the non-FP8 curves (they
    differ only in summation order), widened by that spread on each side. Returns {variant: level}."""
    tail_steps = max(1, steps // 5)  # where the curves level off, not the steep first steps
    level = {r["variant"]: sum(r["losses"][-tail_steps:]) / len(r["losses"][-tail_steps:])
             for r in curves if r["status"] == "ok"}
    plain = [x for v, x in level.items() if bench.VARIANTS[v].precision_kind != "fp8"]
    low, high = (min(plain), max(plain)) if plain else (float("nan"), float("nan"))
    band = high - low
    reference = next(iter(level), None)
    rows = []
    for r in curves:
        v = r["variant"]
        if r["status"] != "ok":
            rows.append([v, r["status"].upper(), "", "", (r.get("error") or "")[:160]])
            continue
        if bench.VARIANTS[v].precision_kind == "fp8":
            inside = low - band <= level[v] <= high + band
            verdict = (f"inside the {dtype} range widened by its spread ({low - band:.3f}–{high + band:.3f})" if inside
                       else f"outside {low - band:.3f}–{high + band:.3f}: a run this short is no verdict on FP8")
        else:
            verdict = f"{dtype}: spread {band:.3f} nats from summation order alone"
        rows.append([v, f"{r['losses'][0]:.4f}", f"{level[v]:.4f}", f"{level[v] - level[reference]:+.3f}", verdict])
    widgets.show_table(widgets.Table(
        ["variant", "loss at step 1", f"mean of the last {tail_steps} of {steps}", f"vs {reference or '—'}", "note"],
        rows, title=f"loss curves: {steps} steps, lr {lr:g}, protein sequences"))
    return level


def show_published() -> dict:
    """NVIDIA's published Mixtral-8x7B numbers (benchmarks/results/published_recipe.json, which
    names each source file): BioNeMo's like-for-like comparison with HF, its MXFP8 headline and
    Transformer Engine's te_mixtral tutorial, as ratios of their own numbers. Returns the file."""
    published = results.read("published_recipe.json")
    source = published["repository"]
    like = published["comparisons"]["hf_like_for_like"]
    tps, base = like["tokens_per_s_per_gpu"], like["tokens_per_s_per_gpu"][like["baseline"]]
    widgets.show_table(widgets.Table(
        ["configuration", "tokens/s per GPU", f"vs {like['baseline']}"],
        [[k, f"{v:,.0f}", f"{v / base:.2f}x"] for k, v in tps.items()],
        title=f"BioNeMo Mixtral recipe, {published['model']}: {like['gpus']}, {like['layout']}, sequence length "
              f"{like['seq_len']:,} — their numbers ({source}, {like['source_file']})"))
    headline = published["comparisons"]["mxfp8_headline"]
    te = headline["tokens_per_s_per_gpu"]
    first = next(iter(te.values()))
    widgets.show_table(widgets.Table(
        ["configuration", "layout", "micro-batch (tokens)", "tokens/s per GPU", f"vs {next(iter(te))}"],
        [[k, headline["layout"], f"{headline['micro_batch_tokens']:,}", f"{v:,}", f"{v / first:.3f}x"] for k, v in te.items()]
        + [["HF transformers, bf16 (same file)", headline["hf_row"]["layout"],
            f"{headline['hf_row']['micro_batch_tokens']:,}", f"{headline['hf_row']['tokens_per_s_per_gpu']:,}",
            "not comparable: another layout and micro-batch"]],
        title=f"BioNeMo's headline: {headline['gpus']}, sequence length {headline['seq_len']:,} ({source}, "
              f"{headline['source_file']})"))
    tutorial = published["te_mixtral_tutorial"]
    steps = list(tutorial["step_ms"].items())
    widgets.show_table(widgets.Table(
        ["configuration", "speed vs the row above", "speed vs the HF baseline (another layout)"],
        [[k, f"{steps[i - 1][1] / v:.2f}x" if i else "", f"{steps[0][1] / v:.2f}x" if i else ""]
         for i, (k, v) in enumerate(steps)],
        title=f"Transformer Engine's te_mixtral tutorial ({tutorial['repository']}, {tutorial['source_file']}): "
              f"{tutorial['gpus']}, sequence length {tutorial['seq_len']:,}; {tutorial['layout']}"))
    return published


def show_h200_next_to(ok: dict, label: str) -> dict:
    """The course's committed one-H200 run (benchmarks/results/h200.json, mixtral-2l, 2 × 4096)
    beside this run: tokens/s and the ratio to HF eager of each, for the variants this chapter
    times. Returns {variant: the H200 row}, empty where the file is missing."""
    found = results.find("h200.json")
    if found is None:
        return {}
    doc = results.read(found)
    env = doc["environment"]
    h200 = {r["variant"]: r for r in doc["results"]
            if r["part"] == "train" and r.get("status") == "ok" and r["variant"] in bench.TRAIN_VARIANTS}
    rows = []
    for v in bench.TRAIN_VARIANTS:
        here, there = ok.get(v), h200.get(v)
        rows.append([v, f"{here['tokens_per_s']:,.0f}" if here else "not run", _ratio_text(ratio(ok, v, "hf_eager")),
                     f"{there['median_ms']:.1f}" if there else "", f"{there['tokens_per_s']:,.0f}" if there else "",
                     _ratio_text(ratio(h200, v, "hf_eager"))])
    widgets.show_table(widgets.Table(
        ["variant", "this run: tokens/s", "this run: vs HF eager", "H200: ms/step", "H200: tokens/s", "H200: vs HF eager"],
        rows, title=f"this run ({label}) next to the course's {env['gpu']} run of {env['date']} (mixtral-2l, 2 × 4096; "
                    f"torch {env['torch']}, TE {env['transformer_engine']}, transformers {env['transformers']})"))
    return h200


def show_summary(ok: dict, not_run: dict, levels: dict, h200: dict, title: str, note: str) -> None:
    """Chapter 06's results in one table: per variant what ran, ms/step, tokens/s, against HF
    eager, the loss level of its curve, and the course's H200 tokens/s."""
    rows = []
    for v in bench.TRAIN_VARIANTS:
        r, there = ok.get(v), h200.get(v)
        h200_text = f"{there['tokens_per_s']:,.0f}" if there else ""
        level = f"{levels[v]:.3f}" if v in levels else ""
        if r is None:
            rows.append([v, f"not run: {not_run[v][:70]}" if v in not_run else "did not pass", "", "", "", level,
                         h200_text])
        else:
            rows.append([v, what_ran(v, r)[:70], f"{r['median_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
                         _ratio_text(ratio(ok, v, "hf_eager")), level, h200_text])
    widgets.show_table(widgets.Table(
        ["variant", "what ran", "ms/step", "tokens/s", "vs HF eager", "loss curve level", "course H200 tokens/s"],
        rows, title=title, note=note))
