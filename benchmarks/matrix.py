"""The (dp, ep) benchmark matrix of one machine: every layout, bf16 and FP8, and the HF baseline.

    python -m benchmarks.matrix --gpus 8 --preset mixtral-7l --out benchmarks/results/h200x8.json
    python -m benchmarks.matrix --gpus 8 --preset mixtral-7l --dry-run  # the commands only
    python -m benchmarks.matrix --table benchmarks/results/h200x8.json   # render a result

(`--dry-run` on a machine without TE prints grouped_torch commands; add `--backend te_ops` to
see what a GPU machine with TE runs.)

Every layout dp × ep = gpus whose ep divides the number of experts (8 GPUs, 8 experts: dp1×ep8,
dp2×ep4, dp4×ep2, dp8×ep1) trains our model in each precision with the best expert backend this
machine has (te_ops where Transformer Engine runs on a GPU, grouped_torch elsewhere; every row
says what ran in `path`), then HF's MixtralForCausalLM (grouped_mm experts, bf16) data parallel
over all GPUs: the BioNeMo recipe's table, on this machine. Each run is one
`torchrun -m moe_tutorial.perf.train_dist --mode bench` launch (`train_dist.launch`), so a run that
fails — out of memory, say — is recorded with its error and the next one starts in fresh
processes. The JSON is rewritten after every run; a markdown table is printed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass

from moe_tutorial.moe.config import preset
from moe_tutorial.parallel import distributed
from moe_tutorial.perf import train_dist
from moe_tutorial.safe_io import REFUSALS, claim_output, refusal_line, write_json

# The precisions the matrix trains in (names `recipes.resolve` takes: the model's dtype and the
# fastest FP8 recipe), which are also the two peaks MFU is quoted against.
MATRIX_PRECISIONS = ("bf16", "fp8")
HF_LABEL = "HF grouped_mm"  # how tables name train_dist's `--model hf`


@dataclass(frozen=True)
class Settings:
    """What every run of the matrix shares."""

    preset: str
    batch: int  # sequences per GPU
    seq_len: int
    warmup: int
    iters: int

    @classmethod
    def from_report(cls, report: dict) -> Settings:
        """The settings a matrix report (its JSON) was run with."""
        return cls(**{name: report["settings"][name] for name in cls.__dataclass_fields__})

    def bench_args(self) -> list[str]:
        return ["--preset", self.preset, "--batch", str(self.batch), "--seq-len",
                str(self.seq_len), "--warmup", str(self.warmup), "--iters", str(self.iters)]


@dataclass(frozen=True)
class Run:
    """One row of the matrix: a model in a layout and a precision."""

    model: str  # "ours" | "hf" (train_dist's --model)
    dp: int
    ep: int
    precision: str
    backend: str
    engine: str = "fsdp2"  # train_dist's --engine: fsdp2, or replicated (the baseline)

    @property
    def label(self) -> str:
        label = HF_LABEL if self.model == "hf" else f"ours ({self.backend})"
        return label + (", replicated" if self.engine == "replicated" else "")

    @property
    def layout(self) -> str:
        return f"dp{self.dp}×ep{self.ep}"

    def bench_args(self, settings: Settings) -> list[str]:
        args = ["--mode", "bench", "--model", self.model, "--engine", self.engine,
                "--dp", str(self.dp), "--ep", str(self.ep), "--precision", self.precision]
        if self.model == "ours":
            args += ["--backend", self.backend]
        return args + settings.bench_args()


# ---------------------------------------------------------------------------------------------
# What runs

def parse_layout(text: str) -> tuple[int, int]:
    """'2x4' (or '2×4') → (dp, ep) = (2, 4)."""
    match = re.fullmatch(r"\s*(\d+)\s*[x×]\s*(\d+)\s*", text)
    if not match:
        raise ValueError(f"layout {text!r} is not DPxEP, e.g. 2x4 for dp=2, ep=4")
    return int(match[1]), int(match[2])


def chosen_layouts(gpus: int, num_experts: int,
                   requested: list[str] | None) -> list[tuple[int, int]]:
    """The `--layouts` asked for (each checked: it must use all `gpus` and split the experts
    evenly), or all of them."""
    if not requested:
        return distributed.layouts(gpus, num_experts)
    chosen = [parse_layout(text) for text in requested]
    for dp, ep in chosen:
        if dp * ep != gpus:
            raise ValueError(f"layout {dp}x{ep} uses {dp * ep} GPUs, not --gpus {gpus}: every "
                             f"layout of the matrix uses all of them (dp × ep = {gpus})")
        distributed.check_layout(gpus, dp, ep, num_experts)
    return chosen


def best_backend() -> tuple[str, str]:
    """(expert backend, why): te_ops where TE runs on a GPU, else its pure-PyTorch peer."""
    from moe_tutorial.precision import hardware

    caps = hardware.capabilities()
    if caps.has_te and caps.device == "cuda":
        return "te_ops", f"Transformer Engine {caps.env.te_version} on {caps.env.gpu_name}"
    missing = caps.env.te_import_error or "not installed"
    where = "a GPU" if caps.device == "cuda" else "no GPU"
    return "grouped_torch", f"no Transformer Engine on a GPU here ({where}; TE: {missing})"


def plan(gpus: int, layout_list: list[tuple[int, int]], precisions, backend: str,
         hf: bool = True, engines=("fsdp2",)) -> list[Run]:
    """Our model in every layout, precision and data-parallel engine, then the HF baseline
    (data parallel only) under each engine."""
    unknown = set(precisions) - set(MATRIX_PRECISIONS)
    if unknown:
        raise ValueError(f"unknown precision(s) {sorted(unknown)}; choose from "
                         f"{MATRIX_PRECISIONS}")
    unknown = set(engines) - set(train_dist.ENGINES)
    if unknown:
        raise ValueError(f"unknown engine(s) {sorted(unknown)}; choose from "
                         f"{train_dist.ENGINES}")
    runs = [Run("ours", dp, ep, precision, backend, engine) for engine in engines
            for dp, ep in layout_list for precision in precisions]
    if hf:
        runs += [Run("hf", gpus, 1, "bf16", train_dist.HF_BASELINE, engine) for engine in engines]
    return runs


# ---------------------------------------------------------------------------------------------
# Running it

def summarize_ranks(ranks: list[dict], peak_tflops: float | None) -> dict:
    """One row from every rank's bench result: the slowest rank's step time, the mean rate per
    GPU (every rank trains the same number of tokens), the largest memory and NCCL times.
    torch's NCCL backend runs `all_to_all_single` as grouped send/recv kernels (or NCCL's own
    all-to-all where it has one), so all-to-all time is the `sendrecv` and `alltoall` kernels
    together: nothing else in the step sends point to point. The data-parallel engine's own
    collectives: the replicated engine's all-reduces, FSDP2's all-gathers (weights) and
    reduce-scatters (gradients)."""
    pflops = statistics.mean(r["pflops_per_gpu"] for r in ranks)
    nccl = [r["nccl_kernel_ms_per_step"] for r in ranks if r["nccl_kernel_ms_per_step"]]
    memory = [r["peak_memory_gb"] for r in ranks if r["peak_memory_gb"] is not None]
    return {
        "median_ms": max(r["median_ms"] for r in ranks),
        "tokens_per_s_per_gpu": statistics.mean(r["tokens_per_s_per_gpu"] for r in ranks),
        "pflops_per_gpu": pflops,
        "mfu": pflops * 1e3 / peak_tflops if peak_tflops else None,
        "peak_memory_gb": max(memory) if memory else None,
        "all_to_all_ms": max(n["sendrecv"] + n["alltoall"] for n in nccl) if nccl else None,
        "all_reduce_ms": max(n["allreduce"] for n in nccl) if nccl else None,
        "dp_collectives_ms": max(n["allreduce"] + n.get("allgather", 0.0)
                                 + n.get("reducescatter", 0.0) for n in nccl) if nccl else None,
        "dtype": ranks[0]["dtype"],
        "path": ranks[0]["path"],
    }


def classify_failure(message: str) -> str:
    if "OutOfMemoryError" in message or "out of memory" in message.lower():
        return "OOM"
    return "timeout" if "timed out after" in message else "error"


def run_one(run: Run, settings: Settings, gpus: int, peak_tflops: float | None,
            timeout: float) -> dict:
    """Launch one run; its row, with status 'ok' and the metrics, or the failure and why."""
    args = run.bench_args(settings)
    row = {**asdict(run), "label": run.label, "layout": run.layout,
           "command": shlex.join(train_dist.torchrun_command(gpus, *args))}
    try:
        result = train_dist.launch(gpus, *args, timeout=timeout, echo=False)
    except RuntimeError as exc:  # the ranks' own error lines: recorded, and the matrix goes on
        return {**row, "status": classify_failure(str(exc)), "error": str(exc)}
    return {**row, "status": "ok", **summarize_ranks(result["results"], peak_tflops),
            "ranks": result["results"]}


def model_description(name: str) -> dict:
    config = preset(name)
    counts = config.parameter_counts()
    return {"preset": name, "layers": config.num_layers, "hidden_size": config.hidden_size,
            "intermediate_size": config.intermediate_size, "num_experts": config.num_experts,
            "top_k": config.top_k, "num_heads": config.num_heads,
            "num_kv_heads": config.num_kv_heads, "vocab_size": config.vocab_size,
            "dtype": config.dtype, "total_params": counts["total"],
            "expert_params": counts["expert"],
            "active_params_per_token": counts["active_per_token"]}


def predicted_peak_gib(config, run: Run, settings: Settings) -> float | None:
    """`train_dist.predicted_peak_gib` for one run of the matrix (GiB; None: FP8 without TE)."""
    return train_dist.predicted_peak_gib(
        config, batch=settings.batch, seq_len=settings.seq_len, dp=run.dp, ep=run.ep,
        engine=run.engine, precision=run.precision, backend=run.backend)


def run_matrix(runs: list[Run], settings: Settings, gpus: int, *, backend: tuple[str, str],
               out: str | None = None, timeout: float = 300, log=print) -> dict:
    """Every run in order, the report rewritten to `out` after each (an interrupted matrix
    keeps what it measured)."""
    from moe_tutorial.perf.timing import datasheet_tflops, environment

    env = {**environment(), "gpus_used": gpus}
    peaks = {precision: datasheet_tflops(env["gpu"], precision) for precision in MATRIX_PRECISIONS}
    config = preset(settings.preset)
    report = {"environment": env, "model": model_description(settings.preset),
              "settings": {**asdict(settings), "tokens_per_gpu_per_step":
                           settings.batch * settings.seq_len,
                           "backend": backend[0], "backend_reason": backend[1],
                           "optimizer": "torch AdamW (fused on a GPU), both models"},
              "peak_bf16_tflops_per_gpu": peaks["bf16"],
              "peak_fp8_tflops_per_gpu": peaks["fp8"],
              "conventions": (
                  "PFLOP/s per GPU = 6 x active params per token x tokens/s/GPU (the recipe's "
                  "convention; attention's score products not counted); MFU = that / the "
                  "datasheet dense peak of the run's precision (bf16 runs: "
                  "bench.DATASHEET_BF16_TFLOPS, FP8 runs: bench.DATASHEET_FP8_TFLOPS, the "
                  "recipe's convention). ms/step: the slowest rank's median; tokens/s and "
                  "PFLOP/s: mean over ranks; peak memory (torch's allocations, GiB) and NCCL "
                  "kernel ms per step (torch.profiler, waiting for peers included): the "
                  "largest rank."),
              "rows": [], "complete": False}
    for i, run in enumerate(runs, 1):
        log(f"[{i}/{len(runs)}] {run.label} {run.layout} {run.precision} ...")
        row = run_one(run, settings, gpus, peaks[run.precision], timeout)
        row["predicted_peak_gib"] = predicted_peak_gib(config, run, settings)
        report["rows"].append(row)
        log("    " + row_summary(row))
        write_report(report, out)
    report["complete"] = True
    write_report(report, out)
    return report


def write_report(report: dict, out: str | None) -> None:
    """The report so far to `out`, whole or not at all (`safe_io.write_json`): a run killed or
    a disk filled mid-write leaves the previous version. `main` refused a used `out` (without
    --replace) before the first run; each rewrite replaces this matrix's own file."""
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        write_json(out, report, replace=True)


# ---------------------------------------------------------------------------------------------
# The table

def _number(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.1f} M" if n >= 1e6 else f"{n:,}"


def _percent(fraction) -> str:
    return "–" if fraction is None else f"{100 * fraction:.1f}%"


def failure_reason(row: dict) -> str:
    """What went wrong, in a line: the first rank's exception where there was one, else the
    launch's own message (exit code, timeout) and the last line of output."""
    first, *rest = row["error"].strip().splitlines()
    if rest and rest[0].startswith("[rank"):
        return rest[0].strip()[:300]
    summary = first.replace(row["command"], "the run").strip()
    return (summary + (" " + rest[-1].strip() if rest else ""))[:300]


def precision_label(row: dict) -> str:
    """fp32 where a 'bf16' run ran in fp32 (train_dist on a CPU), else the precision."""
    ran_fp32 = row.get("dtype") == "float32" and row["precision"] == "bf16"
    return "fp32" if ran_fp32 else row["precision"]


def row_mfu(row: dict, gpu_name: str | None) -> float | None:
    """A row's PFLOP/s per GPU over the datasheet peak of its precision (computed, not read from
    the row: reports written before FP8 rows had their own peak divided FP8 by the bf16 peak)."""
    from moe_tutorial.perf.timing import datasheet_tflops

    peak = datasheet_tflops(gpu_name, row["precision"])
    return row["pflops_per_gpu"] * 1e3 / peak if peak else None


def row_summary(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {failure_reason(row)}"
    return (f"{row['median_ms']:.1f} ms/step, {row['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
            f"{row['pflops_per_gpu']:.3g} PFLOP/s/GPU; experts: {row['path'][:100]}")


def _peak_cell(row: dict) -> str:
    """The measured peak, with memory.predict's expectation beside it where the row has one
    (rows recorded before the prediction existed have none)."""
    peak, predicted = row["peak_memory_gb"], row.get("predicted_peak_gib")
    if peak is None or predicted is None:
        return _number(peak, ".1f")
    return f"{peak:.1f} (predicted {predicted:.1f}, {100 * (predicted / peak - 1):+.0f}%)"


def markdown_table(report: dict) -> str:
    """The matrix as a markdown table, with what was run above it and failures below."""
    env, model, settings = report["environment"], report["model"], report["settings"]
    machine = (f"{env['gpus_used']} × {env['gpu']}" if env.get("gpu")
               else f"{env['gpus_used']} CPU processes (gloo)")
    hf = next((r for r in report["rows"] if r["model"] == "hf" and r["status"] == "ok"), None)
    lines = [
        f"{model['preset']}: {model['layers']} layers, hidden {model['hidden_size']}, "
        f"{model['num_experts']} experts × {model['intermediate_size']}, top-{model['top_k']}, "
        f"{_count(model['total_params'])} parameters ({_count(model['active_params_per_token'])} "
        f"active per token); batch {settings['batch']} × {settings['seq_len']} tokens per GPU; "
        f"{machine}; torch {env['torch']}, TE {env.get('transformer_engine') or '–'}, "
        f"transformers {env.get('transformers') or '–'}; median of {settings['iters']} timed "
        f"steps after {settings['warmup']} warm-up steps.",
        "",
        "| model | layout | precision | ms/step | tokens/s per GPU | PFLOP/s per GPU "
        "| MFU (datasheet peak of its precision) "
        "| vs HF | peak GiB per GPU | all-to-all ms | all-reduce / FSDP ms | status |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    failures = []
    for row in report["rows"]:
        cells = [row["label"], row["layout"], precision_label(row)]
        if row["status"] == "ok":
            vs_hf = row["tokens_per_s_per_gpu"] / hf["tokens_per_s_per_gpu"] if hf else None
            cells += [_number(row["median_ms"], ".1f"),
                      _number(row["tokens_per_s_per_gpu"], ",.0f"),
                      _number(row["pflops_per_gpu"], ".3f"),
                      _percent(row_mfu(row, env.get("gpu"))),
                      _number(vs_hf, ".2f"), _peak_cell(row),
                      _number(row["all_to_all_ms"], ".1f"),
                      _number(row.get("dp_collectives_ms", row["all_reduce_ms"]), ".1f"),
                      "ok"]
        else:
            failures.append(row)
            cells += ["–"] * 8 + [f"**{row['status']}** ({len(failures)})"]
        lines.append("| " + " | ".join(cells) + " |")
    paths = {row["path"] for row in report["rows"]
             if row["status"] == "ok" and row["model"] == "ours"}
    lines += ["", f"Experts ({settings['backend']}: {settings['backend_reason']}): "
              + ("; ".join(sorted(p[:200] for p in paths)) or "none ran")]
    lines += [f"({i}) {row['label']} {row['layout']} {row['precision']}: {failure_reason(row)}"
              for i, row in enumerate(failures, 1)]
    if not report.get("complete", True):
        lines.append("(incomplete: the matrix was interrupted)")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line

def _check_gpus(gpus: int) -> None:
    import torch

    if torch.cuda.is_available() and gpus > torch.cuda.device_count():
        raise SystemExit(f"--gpus {gpus}: this machine has {torch.cuda.device_count()} GPUs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.matrix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, help="processes: one per GPU (CPU: gloo processes)")
    parser.add_argument("--preset", default=None,
                        help="model (default: mixtral-7l on a GPU, tiny on a CPU)")
    parser.add_argument("--layouts", nargs="+", default=None,
                        help="DPxEP layouts, e.g. 1x8 8x1 (default: every one that fits)")
    parser.add_argument("--precisions", nargs="+", default=list(MATRIX_PRECISIONS),
                        choices=MATRIX_PRECISIONS)
    parser.add_argument("--backend", default=None,
                        help="our expert backend (default: te_ops with TE on a GPU, else "
                             "grouped_torch)")
    parser.add_argument("--no-hf", action="store_true", help="skip the HF baseline")
    parser.add_argument("--engines", nargs="+", default=["fsdp2"], choices=train_dist.ENGINES,
                        help="data-parallel engines to run (add replicated for the baseline)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per GPU")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (default: the preset's max_seq_len, at most "
                             "4096 — as in the 2-GPU results)")
    # Few steps: 9 runs of the 8-GPU matrix in well under 10 minutes (each run also profiles
    # 3 steps for the NCCL times and pays torchrun's start-up).
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=6, help="timed steps (the median counts)")
    parser.add_argument("--timeout", type=float, default=300,
                        help="seconds per run before it is stopped and recorded as a timeout")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--replace", action="store_true",
                        help="--out may name an existing file, replaced by this matrix's report "
                             "(default: an existing --out is refused before anything runs)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the torchrun commands, run nothing")
    parser.add_argument("--table", metavar="FILE", default=None,
                        help="print the markdown table of an existing result JSON and exit")
    args = parser.parse_args(argv)
    if args.table:
        try:
            with open(args.table) as f:
                report = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            parser.error(f"--table {args.table}: not a readable result JSON ({exc}); give a file "
                         f"`--out` wrote")
        print(markdown_table(report))
        return 0
    if args.gpus is None:
        parser.error("--gpus is required (or --table FILE)")
    with contextlib.ExitStack() as claim:
        if args.out and not args.dry_run:
            # One writer per result file until the matrix ends (`safe_io.claim_output`): a
            # second matrix, or any course command, writing the same file stops here, before its
            # first run, instead of both running and one report silently replacing the other.
            try:
                claim.enter_context(claim_output(args.out, "`benchmarks.matrix`",
                                                 replace=args.replace, flag="--out",
                                                 make_parents=True))
            except REFUSALS as exc:
                parser.exit(2, f"error: {refusal_line(exc)}\n")
        return _plan_and_run(parser, args)


def _plan_and_run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The matrix `main` parsed (its --out claimed): the commands printed (--dry-run), or every
    run measured and its table printed."""
    import torch

    on_gpu = torch.cuda.is_available()
    name = args.preset or ("mixtral-7l" if on_gpu else "tiny")
    config = preset(name)
    settings = Settings(name, args.batch, args.seq_len or min(4096, config.max_seq_len),
                        args.warmup, args.iters)
    try:
        layout_list = chosen_layouts(args.gpus, config.num_experts, args.layouts)
    except ValueError as exc:
        parser.error(str(exc))
    backend, reason = ((args.backend, "chosen with --backend") if args.backend
                       else best_backend())
    runs = plan(args.gpus, layout_list, args.precisions, backend, hf=not args.no_hf,
                engines=args.engines)
    if args.dry_run:
        print(f"# {len(runs)} runs of {name} on {args.gpus} processes; "
              f"experts: {backend} ({reason})")
        for run in runs:
            peak = predicted_peak_gib(config, run, settings)
            print(f"# {run.label} {run.layout} {run.precision}: "
                  + ("FP8 needs Transformer Engine experts" if peak is None else
                     f"predicted peak {peak:.1f} GiB per GPU (memory.predict)"))
            print(shlex.join(train_dist.torchrun_command(args.gpus, *run.bench_args(settings))))
        return 0
    _check_gpus(args.gpus)
    report = run_matrix(runs, settings, args.gpus, backend=(backend, reason), out=args.out,
                        timeout=args.timeout)
    print("\n" + markdown_table(report))
    if args.out:
        print(f"\nwrote {args.out}")
    return 0 if all(row["status"] == "ok" for row in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
