"""The whole training step per variant, shown compactly: which variants run here and why the
others do not, their timed steps with MFU against a labelled peak, their loss curves, what the
public files of NVIDIA's recipe show (quoted), and the chapter's summary. Chapter 06 calls these;
each returns what it showed. The longer tables (the course's H200 run, TE's te_mixtral tutorial)
are in docs/notes/06_end_to_end.md."""

from __future__ import annotations

import importlib.util

import torch

from .. import display
from ..perf import bench, results, timing


def variants_here(caps, on_gpu: bool, compiled_baseline: bool, fp8_choice) -> tuple[list[str], dict[str, str]]:
    """Which of bench.TRAIN_VARIANTS run on this machine; a variant that cannot run is kept with
    the reason (the step table shows it), never dropped. Returns (variants, {variant: why not})."""
    fp8_runs = caps.has_te and on_gpu and fp8_choice.native
    has_transformers = importlib.util.find_spec("transformers") is not None
    variants, not_run = [], {}
    for v in bench.TRAIN_VARIANTS:
        if bench.VARIANTS[v].hf and not has_transformers:
            not_run[v] = "transformers is not installed (pip install -e '.[hf]')"
        elif v == "hf_grouped_mm_compiled" and not compiled_baseline:
            not_run[v] = "torch.compile is timed in full mode only (it compiles for minutes)"
        elif bench.VARIANTS[v].precision_kind == "fp8" and not fp8_runs:
            not_run[v] = (f"FP8 needs Transformer Engine on a CUDA GPU: {caps['fp8_current'].runs} "
                          f"({caps['fp8_current'].reason or 'no CUDA GPU'})")
        else:
            variants.append(v)
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


def show_step_table(rows: list[dict], not_run: dict, peaks: timing.Peaks, peak_label: str, title: str) -> dict:
    """bench.bench_train_step's rows as one table: ms/step, tokens/s, MFU against the peak of the
    row's own precision (an FP8 row against the FP8 peak), peak GiB, the first loss's difference
    from the first variant's, and tokens/s against HF eager's. Returns {variant: row} of the rows
    that ran and passed the loss check."""
    by = {r["variant"]: r for r in rows}
    ok = {v: r for v, r in by.items() if r.get("status") == "ok"}
    table = []
    for v in bench.TRAIN_VARIANTS:
        r = by.get(v)
        if r is None:
            table.append([v, "not run", "", "", "", "", "", not_run.get(v, "")[:90]])
        elif r.get("status") != "ok":
            table.append([v, r.get("status", "?").upper(), "", "", "", "", "",
                          (r.get("error") or f"loss differs by {r.get('loss_diff')}")[:120]])
        else:
            precision = bench.row_precision(r)
            table.append([v, f"{r['median_ms']:.1f}", f"{r['tokens_per_s']:,.0f}", precision,
                          timing.mfu_text(r["tflops"], peaks.of(precision), missing="–"),
                          "" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.1f}",
                          f"{r['loss_diff']:.1e}", _ratio_text(ratio(ok, v, "hf_eager"))])
    display.show_table(display.Table(
        ["variant", "ms/step", "tokens/s", "precision", "MFU (measured / datasheet peak)", "peak GiB",
         "Δ first loss", "vs HF eager"], table, title=title, note=f"peaks: {peak_label}"))
    return ok


def show_loss_curves(curves: list[dict], steps: int, lr: float, dtype: str) -> dict:
    """The loss curves' level (the mean of the last fifth of the steps), each against the first
    curve's; an FP8 curve is checked against the spread of the non-FP8 curves (they differ only in
    summation order), widened by that spread on each side. Returns {variant: level}."""
    tail_steps = max(1, steps // 5)  # where the curves level off, not the steep first steps
    level = {r["variant"]: sum(r["losses"][-tail_steps:]) / len(r["losses"][-tail_steps:])
             for r in curves if r["status"] == "ok"}
    plain = [x for v, x in level.items() if bench.VARIANTS[v].precision_kind != "fp8"]
    low, high = (min(plain), max(plain)) if plain else (float("nan"), float("nan"))
    band = high - low
    baseline = next(iter(level), None)
    rows = []
    for r in curves:
        v = r["variant"]
        if r["status"] != "ok":
            rows.append([v, r["status"].upper(), "", (r.get("error") or "")[:120]])
            continue
        check = ""
        if bench.VARIANTS[v].precision_kind == "fp8":
            check = ("inside" if low - band <= level[v] <= high + band else
                     "outside (a run this short is no verdict on FP8)")
        rows.append([v, f"{level[v]:.4f}", f"{level[v] - level[baseline]:+.3f}", check])
    display.show_table(display.Table(
        ["variant", f"loss, mean of the last {tail_steps} steps", f"vs {baseline or '—'}",
         f"FP8: inside {low - band:.3f}–{high + band:.3f}?"],
        rows, title=f"loss curves: {steps} steps, lr {lr:g}, protein sequences; the {dtype} curves "
                    f"spread {band:.3f} nats (summation order)"))
    return level


def show_published() -> dict:
    """What the public files of NVIDIA's BioNeMo Mixtral-8x7B recipe show
    (benchmarks/results/published_recipe.json, which names each source file), quoted: tokens/s per
    GPU and the ratios within each machine's rows. TE's te_mixtral tutorial is in the notes.
    Returns the file."""
    published = results.read("published_recipe.json")
    like = published["comparisons"]["hf_like_for_like"]
    headline = published["comparisons"]["mxfp8_headline"]
    b200 = f"{like['gpus']}, {like['layout'].split(' (')[0]}, sequence {like['seq_len']:,}"
    b300 = f"{headline['gpus']}, {headline['layout']}, sequence {headline['seq_len']:,}"
    base = like["tokens_per_s_per_gpu"][like["baseline"]]
    rows = [[k, b200, f"{v:,.0f}", "baseline" if k == like["baseline"] else f"{v / base:.2f}x HF"]
            for k, v in like["tokens_per_s_per_gpu"].items()]
    te = headline["tokens_per_s_per_gpu"]
    first = next(iter(te))
    rows += [[k, b300, f"{v:,}", "" if k == first else f"{v / te[first]:.3f}x {first}"] for k, v in te.items()]
    hf = headline["hf_row"]
    rows.append(["HF transformers bf16", f"{headline['gpus']}, {hf['layout'].split(' (')[0]}",
                 f"{hf['tokens_per_s_per_gpu']:,}", "not comparable: another layout, batch and starting weights"])
    display.show_table(display.Table(
        ["configuration", "GPUs, layout", "tokens/s per GPU", "ratio"], rows,
        title=f"NVIDIA's {published['model']} recipe: its public files ({published['repository']}), quoted"))
    return published


def show_summary(ok: dict, not_run: dict, levels: dict, title: str, note: str = "") -> None:
    """Chapter 06's results in one table: per variant ms/step, tokens/s, tokens/s against HF
    eager, and the loss level of its curve; a variant that did not run says why ("—" for all where
    `ok` is empty: no run to show)."""
    rows = []
    for v in bench.TRAIN_VARIANTS:
        r = ok.get(v)
        level = f"{levels[v]:.3f}" if v in levels else ""
        if r is None:
            why = f"not run: {not_run[v][:60]}" if v in not_run else "did not pass" if ok else "—"
            rows.append([v, "", "", why, level])
        else:
            rows.append([v, f"{r['median_ms']:.1f}", f"{r['tokens_per_s']:,.0f}", _ratio_text(ratio(ok, v, "hf_eager")),
                         level])
    display.show_table(display.Table(["variant", "ms/step", "tokens/s", "vs HF eager", "loss curve level"],
                                     rows, title=title, note=note))
