"""The summary, the tables and the whole run: the headline ratios of a run's rows, its printed
tables, `run` (what `python -m moe_tutorial bench` runs, sized for the device) and one report
merged from the parts of a run.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...arguments import check_count
from ...moe.config import preset
from ...train.loop import OPTIMIZERS
from ..timing import Peaks, environment, measure_peaks, mfu_text
from .expert_layer import EXPERT_SHAPES, FAMILY_SHAPES, ROUTINGS, bench_expert_layer, precision_kind
from .train_step import bench_train_step
from .variants import GPU_EXTRA_VARIANTS, TRAIN_VARIANTS, VARIANTS, hf_twin, row_precision, variant


def best_step(train_rows, kind: str | None = None) -> dict | None:
    """Our fastest training-step row that ran (of precision kind "bf16" or "fp8" when `kind` is
    given; HF's baselines are never it), or None."""
    ours = [r for r in train_rows if r.get("status") == "ok" and r["variant"] in VARIANTS
            and not VARIANTS[r["variant"]].hf
            and (kind is None or precision_kind(row_precision(r)) == kind)]
    return max(ours, key=lambda r: r["tokens_per_s"]) if ours else None


def step_floor_ms(row: dict, speed_of_light: dict) -> float | None:
    """A training-step row's floor: the `speed_of_light` section's floor of the row's precision
    (None where that floor is incomplete)."""
    return speed_of_light["floors"][precision_kind(row_precision(row))]["total_ms"]


def summarize(results: list[dict], speed_of_light: dict | None = None) -> dict:
    """The headline ratios (medians from this run); None where this run lacks the variants.
    With the report's `speed_of_light` section (`python -m moe_tutorial speed-of-light`,
    merged in): the best step's floor in its precision over its measured time."""
    ok = [r for r in results if r.get("status") == "ok"]

    def expert_default(shape):  # the row `bench_expert_layer` marked as the course's pick
        rows = [r for r in ok if r["part"] == "expert" and r["shape"] == shape
                and r["routing"] == "balanced" and r.get("default")]
        return rows[0].get("speedup_vs_loop") if rows else None

    def expert_best(shape, kind=None):
        rows = [r for r in ok if r["part"] == "expert" and r["shape"] == shape
                and r["routing"] == "balanced" and r["backend"] != "naive"
                and (kind is None or precision_kind(r["precision"]) == kind)]
        loop = [r for r in ok if r["part"] == "expert" and r["shape"] == shape
                and r["routing"] == "balanced" and r["backend"] == "naive"]
        if not rows or not loop:
            return None
        return loop[0]["median_ms"] / min(r["median_ms"] for r in rows)

    train = {r["variant"]: r for r in ok if r["part"] == "train"}
    best = best_step(train.values())

    def vs(name, key="tokens_per_s"):
        if best is None or name not in train:
            return None
        if key == "peak_memory_gb":
            if best.get(key) is None or not train[name].get(key):
                return None
            return best[key] / train[name][key]
        return best[key] / train[name][key]

    best_bf16 = best_step(train.values(), "bf16")
    compiled = train.get("hf_grouped_mm_compiled")

    def like_for_like(row):  # our step over HF's compiled step given the same compiled AdamW
        twin = hf_twin(row["variant"]) if row else None
        return (twin, row["tokens_per_s"] / train[twin]["tokens_per_s"]) if twin in train else (twin, None)

    twin, twin_speedup = like_for_like(best)
    bf16_twin, bf16_twin_speedup = like_for_like(best_bf16)

    def fraction_of_floor():
        if best is None or not speed_of_light:
            return None
        floor_ms = step_floor_ms(best, speed_of_light)
        return floor_ms / best["median_ms"] if floor_ms is not None else None

    def fp8_vs_bf16(shape):  # > 1: FP8 pays for this shape; < 1: it loses, by this factor
        bf16, fp8 = expert_best(shape, "bf16"), expert_best(shape, "fp8")
        return fp8 / bf16 if bf16 and fp8 else None

    return {
        "expert_mixtral_best_bf16_speedup_vs_loop": expert_best("mixtral", "bf16"),
        "expert_mixtral_best_fp8_speedup_vs_loop": expert_best("mixtral", "fp8"),
        "expert_finegrained_best_speedup_vs_loop": expert_best("fine_grained"),
        # On the path `experts.default_backend` picks for the shape
        "expert_finegrained_default_speedup_vs_loop": expert_default("fine_grained"),
        # The shipped configs' fine-grained shapes (many small experts, top-8)
        **{f"expert_{shape}_best_bf16_speedup_vs_loop": expert_best(shape, "bf16")
           for shape in FAMILY_SHAPES},
        **{f"expert_{shape}_best_fp8_vs_best_bf16": fp8_vs_bf16(shape) for shape in FAMILY_SHAPES},
        "train_step_best_variant": best["variant"] if best else None,
        "train_step_speedup_vs_hf_eager": vs("hf_eager"),
        "train_step_speedup_vs_hf_grouped_mm": vs("hf_grouped_mm"),
        "train_step_speedup_vs_hf_grouped_mm_compiled": vs("hf_grouped_mm_compiled"),
        "train_step_peak_mem_ratio_vs_hf_grouped_mm": vs("hf_grouped_mm", "peak_memory_gb"),
        # What the grouped experts and fusions buy without FP8
        "train_step_best_bf16_speedup_vs_hf_grouped_mm_compiled": (
            best_bf16["tokens_per_s"] / compiled["tokens_per_s"] if best_bf16 and compiled
            else None),
        # Like with like: HF's compiled model with AdamW compiled where ours compiles it
        "train_step_like_for_like_hf": twin,
        "train_step_speedup_vs_like_for_like_hf": twin_speedup,
        "train_step_best_bf16_like_for_like_hf": bf16_twin,
        "train_step_best_bf16_speedup_vs_like_for_like_hf": bf16_twin_speedup,
        "train_step_fraction_of_speed_of_light": fraction_of_floor(),
    }


def format_summary(summary: dict) -> str:
    return "summary: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in summary.items())


def format_expert_row(r: dict) -> str:
    name = f"{r['shape']:<12} {r['routing']:<8} {r['backend']:<25} {r['precision']:<20}"
    if r.get("status") != "ok":
        return f"{name} {r.get('status', '?').upper():>9}  {r.get('error', '') or r.get('rel_error', '')}"
    mem = f"{r['peak_memory_gb']:.1f}" if r.get("peak_memory_gb") is not None else "-"
    speedup = f"{r['speedup_vs_loop']:7.2f}x" if "speedup_vs_loop" in r else "       -"
    return (f"{name} {r['median_ms']:9.2f} {r['tflops']:8.3g} {speedup} "
            f"{r['rel_error']:9.2e} {mem:>6}")


def format_train_row(r: dict, peaks: Peaks) -> str:
    name = f"{r['variant']:<30}"
    if r.get("status") != "ok":
        return f"{name} {r.get('status', '?').upper():>9}  {r.get('error', '') or r.get('loss_diff', '')}"
    precision = row_precision(r)
    mem = f"{r['peak_memory_gb']:.1f}" if r.get("peak_memory_gb") is not None else "-"
    return (f"{name} {r['median_ms']:9.1f} {r['tokens_per_s']:11,.0f} {r['tflops']:8.3g} "
            f"{precision:>5} {mfu_text(r['tflops'], peaks.of(precision)):>15} "
            f"{mfu_text(r['tflops'], peaks.of('bf16')):>15} {mem:>6} {r['loss_diff']:9.1e}")


EXPERT_HEADER = (f"{'shape':<12} {'routing':<8} {'backend':<25} {'precision':<20} {'ms':>9} "
                 f"{'TFLOP/s':>8} {'vs loop':>8} {'rel.err':>9} {'GiB':>6}")
TRAIN_HEADER = (f"{'variant':<30} {'ms/step':>9} {'tokens/s':>11} {'TFLOP/s':>8} {'prec.':>5} "
                f"{'MFU own peak':>15} {'MFU bf16 peak':>15} {'GiB':>6} {'Δloss0':>9}")
MFU_LEGEND = ("MFU own peak: TFLOP/s over the dense peak of the row's precision (bf16 rows: bf16, "
              "FP8 rows: FP8), measured in this run / datasheet; MFU bf16 peak: over the bf16 "
              "peak for every row (torchtitan's convention)")


def default_preset(on_gpu: bool) -> str:
    """The training step's model when none is named: Mixtral's width on a GPU, tiny on a CPU."""
    return "mixtral-2l" if on_gpu else "tiny"


def default_seq_len(config, on_gpu: bool) -> int:
    """The training step's sequence length when none is given, within the model's context."""
    return min(4096 if on_gpu else 64, config.max_seq_len)


def check_run_arguments(*, device=None, shapes=None, routings=ROUTINGS, train_preset=None,
                        train_variants=None, batch=None, seq_len=None, warmup=None, iters=None,
                        optimizer="torch_adamw", train_layers=None) -> None:
    """Refuse the arguments `run` would otherwise fail on only after minutes of measuring, or
    replace by its defaults without a word: unknown names, sizes out of range (None: the
    device's default). `run` calls it first; the command line calls it before starting."""
    on_gpu = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda"
    for name, value, least in (("batch", batch, 1), ("seq_len", seq_len, 1),
                               ("warmup", warmup, 0), ("iters", iters, 1),
                               ("layers", train_layers, 1)):
        if value is not None:
            check_count(name, value, least=least)
    for what, names, known in (("expert shape", shapes or [], EXPERT_SHAPES),
                               ("routing", routings, ROUTINGS)):
        for name in names:
            if name not in known:
                raise ValueError(f"unknown {what} {name!r}; choose from {', '.join(known)}")
    for name in train_variants or []:
        variant(name)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {OPTIMIZERS}")
    config = preset(train_preset or default_preset(on_gpu))
    if seq_len is not None and seq_len > config.max_seq_len:
        raise ValueError(f"seq_len={seq_len} is longer than the {config.num_layers}-layer "
                         f"model's max_seq_len={config.max_seq_len}; choose seq_len <= "
                         f"{config.max_seq_len} or a preset with longer sequences")


def run(*, device=None, shapes=None, routings=ROUTINGS, expert=True, train=True,
        train_preset=None, train_layers=None, train_variants=None, batch=None, seq_len=None,
        warmup=None, iters=None, optimizer="torch_adamw", log=print,
        on_result: Callable[[dict], None] | None = None) -> dict:
    """The whole benchmark, sized for the device: Mixtral / fine-grained / small shapes and the
    `mixtral-2l` model (batch 2 × 4096) on a GPU; the `tiny` shape and model on a CPU.
    `train_layers`: the training step's model at another depth (as `train_dist --layers`)."""
    check_run_arguments(device=device, shapes=shapes, routings=routings,
                        train_preset=train_preset, train_variants=train_variants, batch=batch,
                        seq_len=seq_len, warmup=warmup, iters=iters, optimizer=optimizer,
                        train_layers=train_layers)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = torch.device(device).type == "cuda"
    shapes = shapes or (["mixtral", "fine_grained", "small"] if on_gpu else ["tiny"])
    warmup = warmup if warmup is not None else (3 if on_gpu else 1)
    iters = iters if iters is not None else (20 if on_gpu else 3)
    env = environment()
    log(f"benchmark on {env['gpu'] or 'CPU'}: torch {env['torch']}, TE "
        f"{env['transformer_engine'] or 'absent'}, transformers {env['transformers']}")
    peaks = measure_peaks(device, env["gpu"])
    if on_gpu:
        log(f"dense matmul (8192^3) measured: bf16 {peaks.bf16_measured:.0f} TFLOP/s (datasheet "
            f"{peaks.bf16_datasheet}), FP8 "
            + (f"{peaks.fp8_measured:.0f}" if peaks.fp8_measured else "-")
            + f" TFLOP/s (datasheet {peaks.fp8_datasheet})")
    results = []

    def report(row, line):
        log(line)
        if on_result is not None:
            on_result(row)

    if expert:
        log(f"\nexpert layer, forward + backward incl. permutation; TFLOP/s = 18·T·k·H·I / time; "
            f"median of {iters}\n{EXPERT_HEADER}")
        for name in shapes:
            for routing in routings:
                results += bench_expert_layer(EXPERT_SHAPES[name], routing, device=device,
                                              warmup=warmup, iters=iters,
                                              on_result=lambda r: report(r, format_expert_row(r)))
    if train:
        config = preset(train_preset or default_preset(on_gpu), layers=train_layers)
        if not on_gpu:
            config = config.with_overrides(dtype="float32")
        batch = batch or 2  # 0 was refused above: `or` replaces only None
        seq_len = seq_len or default_seq_len(config, on_gpu)
        variants = train_variants or ([*TRAIN_VARIANTS, *GPU_EXTRA_VARIANTS] if on_gpu else [
            "hf_eager", "hf_grouped_mm", "ours_grouped_torch_bf16", "ours_te_ops_bf16"])
        log(f"\ntraining step of {config.num_layers}-layer model (hidden {config.hidden_size}, "
            f"{config.num_experts} experts × {config.intermediate_size}, top-{config.top_k}), "
            f"batch {batch} × {seq_len}: forward + backward + optimizer step, median of {iters}.\n"
            f"TFLOP/s = (6 × {config.active_params_per_token():,} active params + 12 × layers × "
            f"seq × hidden) × tokens / time. {MFU_LEGEND}\n"
            f"{TRAIN_HEADER}")
        results += bench_train_step(config, variants, batch=batch, seq_len=seq_len, device=device,
                                    warmup=warmup if on_gpu else 1, iters=iters,
                                    optimizer=optimizer,
                                    on_result=lambda r: report(r, format_train_row(r, peaks)))
    summary = summarize(results)
    log("\n" + format_summary(summary))
    return {"environment": env, **peaks.to_dict(), "results": results, "summary": summary}


def merge_reports(reports: list[dict]) -> dict:
    """One report from the parts of a benchmark run as separate commands on the same machine
    (e.g. `--no-train` then `--no-expert`, each within a time limit): the results concatenated,
    the summary recomputed over all of them, each part's date and dense-matmul rate kept (the
    top-level rates: those of the last part with training-step rows, which MFU is quoted
    against). Refuses
    parts whose GPU or library versions differ: their ratios would not be comparable."""
    if not reports:
        raise ValueError("nothing to merge")
    first = reports[0]["environment"]
    for r in reports[1:]:
        # Keys one of them lacks (recorded only by a newer version of the course) are no
        # difference; the date is when each part ran.
        differ = sorted(k for k, v in r["environment"].items()
                        if k != "date" and k in first and first[k] != v)
        if differ:
            raise ValueError(f"cannot merge reports from different environments (differ in {differ})")
    # One run given twice (the same file, or a copy) would count every row twice
    twice = next(((i, j) for j, r in enumerate(reports) for i in range(j)
                  if r["results"] and reports[i]["results"] == r["results"]), None)
    if twice:
        raise ValueError(f"reports {twice[0]} and {twice[1]} hold the same results: the same run "
                         f"given twice; give each part once")
    incomplete = [i for i, r in enumerate(reports) if not r.get("complete", True)]
    if incomplete:
        raise ValueError(f"report(s) {incomplete} did not finish (complete=False): rerun them")
    results = [row for r in reports for row in r["results"]]
    # The speed-of-light part (`speed-of-light --out`, no results of its own) describes the
    # training-step rows' workload; the newest one wins
    sections = [r["speed_of_light"] for r in reports if r.get("speed_of_light")]
    speed_of_light = sections[-1] if sections else None
    if speed_of_light is not None:
        _check_same_workload(speed_of_light, results)
    return {"environment": reports[0]["environment"],  # its date: when the run started
            # A report merged before keeps its own parts: one entry per run, however merged
            "parts": [part for r in reports for part in r.get("parts") or [
                {"date": r["environment"].get("date"), **Peaks.from_dict(r).to_dict(),
                 "results": len(r["results"])}]],
            # The MFU of a training-step row is quoted against the peaks measured in its own run
            **Peaks.from_dict(next((r for r in reversed(reports) if any(
                row.get("part") == "train" for row in r["results"])), reports[-1])).to_dict(),
            "results": results, "summary": summarize(results, speed_of_light),
            **({"speed_of_light": speed_of_light} if speed_of_light else {}), "complete": True}


def _check_same_workload(speed_of_light: dict, results: list[dict]) -> None:
    """A floor is only the training-step rows' floor when it was computed for their batch and
    sequence length (and written by a course version that records its workload)."""
    workload = speed_of_light.get("workload")
    if workload is None:
        raise ValueError("the speed_of_light part records no workload (written by an older "
                         "version): rerun python -m moe_tutorial speed-of-light --out FILE")
    steps = {(r["batch"], r["seq_len"]) for r in results if r.get("part") == "train"}
    if steps - {(workload["batch"], workload["seq_len"])}:
        raise ValueError(f"the speed_of_light part is for batch {workload['batch']} × "
                         f"{workload['seq_len']}, the training-step rows for "
                         f"{sorted(steps)}: rerun speed-of-light with their --batch and --seq-len")
