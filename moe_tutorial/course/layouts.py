"""Expert-parallel layouts, shown: what one GPU holds under each layout, what each layout sends per
step, the launches that check and time them on this machine, and the course's 2 × H200 run read
from its committed file. Chapter 07 calls these; each returns the numbers it showed."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from unittest import mock

from .. import display
from ..parallel import distributed
from ..perf import memory, results
from ..perf.train_dist import launch

GB = 1e9


def _gib(nbytes: float) -> float:
    return nbytes / 2**30


# ---------------------------------------------------------------------------------------------
# Who holds what

def show_training_state(config, name: str, gpus=(1, 2, 4, 8)) -> dict:
    """A table of what one GPU holds of `config` (parameters and training state: weights,
    gradients, AdamW's two moments) under replicated data parallelism, FSDP2 and expert
    parallelism over each count of `gpus`. Returns {(kind, gpus): training-state bytes}."""
    layouts = {"dp": ("nothing", lambda g: (g, 1, "replicated")),
               "fsdp": ("everything (FSDP2)", lambda g: (g, 1, "fsdp2")),
               "ep": ("the experts", lambda g: (1, g, "replicated"))}
    rows, state = [], {}
    for n in gpus:
        for kind, (what, layout) in layouts.items():
            dp, ep, engine = layout(n)
            held = memory.parameters_per_rank(config, dp, ep, engine)
            state[kind, n] = memory.training_state(config, dp, ep, engine)["total"]
            if n == 1 and kind != "dp":
                continue  # one GPU is one GPU, whatever the layout
            fp32 = memory.training_state(config.with_overrides(dtype="float32"), dp, ep, engine)["total"]
            rows.append([n, f"dp{dp} × ep{ep}" + (" FSDP2" if engine == "fsdp2" else ""), what,
                         f"{held['expert'] / 1e9:.2f}", f"{held['dense'] / 1e9:.2f}",
                         f"{_gib(state[kind, n]):,.0f}", f"{_gib(fp32):,.0f}"])
    display.show_table(display.Table(
        ["GPUs", "layout", "what is split", "expert params (B)", "dense params (B)", "state, 8 B/param (GiB)",
         "state, 16 B/param (GiB)"],
        rows, title=f"{name}: what one GPU holds (memory.training_state; activations on top)"))
    return state


def show_mesh(dp: int, ep: int, num_experts: int) -> None:
    """The ranks of a dp × ep device mesh: the experts each holds, its ep group (the all-to-alls)
    and its dp group (the expert gradients). init_device_mesh lays ranks out row-major."""
    rows = []
    for rank in range(dp * ep):
        dp_rank, ep_rank = divmod(rank, ep)
        first = ep_rank * num_experts // ep
        rows.append([rank, dp_rank, ep_rank, f"{first}..{first + num_experts // ep - 1}",
                     str([dp_rank * ep + e for e in range(ep)]), str([d * ep + ep_rank for d in range(dp)])])
    display.show_table(display.Table(
        ["rank", "dp rank", "ep rank", "experts held", "ep group (all-to-all)", "dp group (expert gradients)"],
        rows, title=f"dp{dp} × ep{ep}: {dp * ep} processes, {num_experts} experts"))


# ---------------------------------------------------------------------------------------------
# Where this machine's launches run

@dataclass
class Launches:
    """Where this notebook's torchrun launches run: NCCL on GPUs (`gpus`), else gloo on CPU cores,
    one thread per process, CUDA hidden from them. `skipped` says why GPUs were not used in full
    mode (empty otherwise)."""
    nproc: int
    gpus: bool
    where: str
    skipped: str
    timeout: float

    @property
    def unit(self) -> str:
        return "GPU" if self.gpus else "process"

    def environment(self):
        """What the launched processes inherit (this kernel's torch is unaffected), restored on
        leaving the block; launch() adds distributed.SAFE_NCCL_ENV itself."""
        return mock.patch.dict(os.environ, {} if self.gpus else
                               {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"})

    def run(self, nproc: int, *args: str, echo: bool = True) -> dict:
        """`torchrun -m moe_tutorial.perf.train_dist *args` on `nproc` processes; rank 0's gathered
        results, with the launch's wall time in `wall_s`."""
        start = time.perf_counter()
        with self.environment():
            result = launch(nproc, *args, timeout=self.timeout, echo=echo)
        result["wall_s"] = time.perf_counter() - start
        return result


def where_to_launch(mode: str, device: str, nproc: int, timeout: float) -> Launches:
    """NCCL with one process per GPU in full mode with `nproc` GPUs, else gloo on CPU cores."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    on_gpus = mode == "full" and device == "cuda" and gpus >= nproc
    if on_gpus:
        return Launches(nproc, True, f"NCCL, one process per GPU ({gpus} × {torch.cuda.get_device_name(0)})", "",
                        timeout)
    skipped = ""
    if mode == "full":
        skipped = (f"{gpus} CUDA GPU here and {nproc} processes need {nproc} (NCCL ranks cannot share a GPU)"
                   if 0 < gpus < nproc else f"DEVICE is {device!r}" if gpus else "no CUDA GPU here")
    where = f"gloo on {nproc} CPU cores" + (" (CUDA hidden from them)" if gpus else "")
    return Launches(nproc, False, where, skipped, timeout)


# ---------------------------------------------------------------------------------------------
# Correctness: n processes against one

def correctness_layouts(nproc: int) -> list[tuple[str, tuple[str, ...]]]:
    """The four `train_dist --mode check` launches: experts sharded, data parallel (FSDP2 and
    replicated), and experts sharded with the last rank's experts never chosen."""
    n = str(nproc)
    return [(f"dp1 × ep{n}", ("--dp", "1", "--ep", n)),
            (f"dp{n} × ep1", ("--dp", n, "--ep", "1")),
            (f"dp{n} × ep1, replicated", ("--dp", n, "--ep", "1", "--engine", "replicated")),
            (f"dp1 × ep{n}, rank {nproc - 1} starved", ("--dp", "1", "--ep", n, "--starve-rank", str(nproc - 1)))]


def check_against_one_process(launches: Launches, tolerance: float) -> float:
    """Run the correctness launches (overlapping: they are checks, not timings) and show each
    launch's worst relative error over its ranks against the single process, and which tensor
    it was in. Returns the worst of all."""
    checks = correctness_layouts(launches.nproc)
    with launches.environment(), ThreadPoolExecutor(len(checks)) as pool:
        done = list(pool.map(lambda a: launch(launches.nproc, "--mode", "check", *a, timeout=launches.timeout,
                                              echo=False), [args for _, args in checks]))
    rows, worst = [], 0.0
    for (name, _), result in zip(checks, done):
        top = max(result["results"], key=lambda r: r["max_rel_error"])
        worst = max(worst, top["max_rel_error"])
        rows.append([name, f"{top['max_rel_error']:.1e}", top["worst"]])
    display.show_table(display.Table(
        ["layout", "max relative error", "in tensor"], rows,
        title=f"{launches.nproc} processes vs 1: logits and every gradient (tiny preset, fp32, {launches.where})",
        note=f"‖distributed − single‖ / ‖single‖ per tensor, worst rank; allowed {tolerance:g}"))
    return worst


# ---------------------------------------------------------------------------------------------
# What each layout sends, and how they scale

def layout_names(nproc: int, unit: str) -> list[tuple[str, int, int]]:
    """(name, dp, ep) of one process and of the two layouts of `nproc` processes."""
    return [(f"1 {unit}", 1, 1), (f"dp1 × ep{nproc}", 1, nproc), (f"dp{nproc} × ep1", nproc, 1)]


def show_communication(models: dict, nproc: int, unit: str = "GPU") -> dict:
    """Bytes one rank's collectives move per training step (distributed.communication_per_step)
    and its training state, for each {name: (config, tokens per rank)} and layout. Returns
    {(model name, layout name): counts, with `sent` (crossing all-to-all + ring all-reduce)}."""
    rows, out = [], {}
    for model_name, (cfg, tokens) in models.items():
        for name, dp, ep in layout_names(nproc, unit):
            c = distributed.communication_per_step(cfg, tokens, dp, ep)
            state = memory.training_state(cfg, dp, ep, "replicated")["total"]
            out[model_name, name] = dict(c, state_bytes=state,
                                         sent=c["all_to_all_remote_bytes"] + c["allreduce_sent_bytes"])
            rows.append([f"{model_name} ({cfg.dtype})", f"{tokens:,}", name, f"{c['all_to_all_bytes'] / GB:.4g}",
                         f"{c['all_to_all_remote_bytes'] / GB:.4g}", f"{c['dense_allreduce_bytes'] / GB:.4g}",
                         f"{c['expert_allreduce_bytes'] / GB:.4g}", f"{out[model_name, name]['sent'] / GB:.4g}",
                         f"{_gib(state):.3g}"])
    display.show_table(display.Table(
        ["model", "tokens per rank", "layout", "all-to-all (GB)", "… crossing (GB)", "dense all-reduce (GB)",
         "expert all-reduce (GB)", "sent (GB)", "state (GiB)"],
        rows, title="per step and rank (computed)",
        note="sent: the crossing all-to-all (balanced routing) + a ring all-reduce"))
    return out


def bench_layouts(launches: Launches, preset: str, *, batch: int, seq_len: int, iters: int, warmup: int,
                  precisions, backend: str) -> dict:
    """`train_dist --mode bench --engine replicated` for one process and both layouts, per
    precision, quietly (the table of `show_scaling` shows them). Returns {(precision, layout
    name): {ranks, wall_s, dp, ep}}."""
    runs = {}
    for precision in precisions:
        for name, dp, ep in layout_names(launches.nproc, launches.unit):
            args = ["--mode", "bench", "--preset", preset, "--dp", str(dp), "--ep", str(ep), "--backend", backend,
                    "--engine", "replicated", "--batch", str(batch), "--seq-len", str(seq_len), "--iters", str(iters),
                    "--warmup", str(warmup)] + (["--precision", precision] if launches.gpus else [])
            result = launches.run(dp * ep, *args, echo=False)
            runs[precision, name] = dict(ranks=result["results"], wall_s=result["wall_s"], dp=dp, ep=ep)
    return runs


def slowest_rank(run: dict) -> dict:
    """The slowest rank's result: it sets the pace of a synchronous step."""
    return min(run["ranks"], key=lambda r: r["tokens_per_s_per_gpu"])


def show_scaling(runs: dict, launches: Launches, preset: str) -> dict:
    """The bench launches as a table: per layout, ms/step, tokens/s per process and its ratio to
    the one-process run of the same script and precision (1.0: every process adds a whole one),
    and on GPUs the measured peak memory and NCCL time. Returns {(precision, layout name): that
    ratio}."""
    unit = launches.unit
    flop_unit, flop_scale = ("PFLOP/s", 1.0) if launches.gpus else ("GFLOP/s", 1e6)
    rows, scaling = [], {}
    for (precision, name), run in runs.items():
        r = slowest_rank(run)
        scaling[precision, name] = r["tokens_per_s_per_gpu"] / slowest_rank(runs[precision, f"1 {unit}"])[
            "tokens_per_s_per_gpu"]
        row = [name, precision, f"{r['median_ms']:.1f}", f"{r['tokens_per_s_per_gpu']:,.0f}",
               f"{scaling[precision, name]:.2f}", f"{r['pflops_per_gpu'] * flop_scale:.3g}"]
        if launches.gpus:  # measured on GPUs only (torch.profiler's NCCL kernels, CUDA's peak)
            nccl = [x["nccl_kernel_ms_per_step"] for x in run["ranks"] if x.get("nccl_kernel_ms_per_step")]
            row += [f"{r['peak_memory_gb']:.1f}" if r.get("peak_memory_gb") else "–",
                    f"{max(x['sendrecv'] + x['alltoall'] for x in nccl):.1f} / {max(x['allreduce'] for x in nccl):.1f}"
                    if nccl else "–"]
        rows.append(row)
    env = next(iter(runs.values()))["ranks"][0]["environment"]
    display.show_table(display.Table(
        ["layout", "precision", "ms/step", f"tokens/s per {unit}", f"vs 1 {unit} (same script)",
         f"{flop_unit} per {unit}"]
        + (["peak GiB", "all-to-all / all-reduce ms"] if launches.gpus else []), rows,
        title=f"measured here: {preset}, {launches.where}; slowest rank; torch {env['torch']}"
              + (f", TE {env['transformer_engine']}" if env.get("transformer_engine") else ""),
        note="NCCL kernel times from torch.profiler, waiting for the peer included" if launches.gpus else ""))
    return scaling


# ---------------------------------------------------------------------------------------------
# The course's 2 × H200 run, read from its file

H200X2 = "h200x2.json"


def show_h200x2() -> dict:
    """The committed 2 × H200 run (benchmarks/results/h200x2.json) as a table, labelled with its
    machine, date and versions. Its "1 GPU" rows are the distributed script run as one process,
    and "vs 1 process" divides by them. Returns {(precision, layout name): summary row}."""
    doc = results.read(H200X2)
    env = doc["environment"]
    rows, by = [], {}
    for s in doc["summary"]:
        name = "1 GPU" if s["gpus"] == 1 else s["layout"].replace("/", " × ")
        by[s["precision"], name] = s
        rows.append([name, s["precision"], f"{s['median_ms']:.1f}", f"{s['tokens_per_s_per_gpu']:,.0f}",
                     f"{s['scaling_efficiency_vs_1_gpu']:.2f}", f"{s['peak_memory_gb']:.1f}",
                     f"{s['nccl_alltoall_ms_per_step_max_rank']:.1f} / {s['nccl_allreduce_ms_per_step_max_rank']:.1f}"])
    display.show_table(display.Table(
        ["layout", "precision", "ms/step", "tokens/s per GPU", "vs 1 process (same script)", "peak GiB per GPU",
         "NCCL all-to-all / all-reduce ms"], rows,
        title=f"measured by the course on {env['machine']}, {env['date']}; torch {env['torch']}, "
              f"TE {env['transformer_engine']} ({results.path(H200X2).name})",
        note="1 GPU: this script as one process"))
    return by


def show_summary(launches: Launches, worst_error: float, scaling: dict, state: dict, comm: dict, losses: list,
                 h200: dict, preset: str, mode: str) -> None:
    """Chapter 07's results in one table: the correctness bound, the scaling measured here (where
    the processes ran: the title), the computed memory and traffic, the training run and the quoted
    2 × H200 ratios."""
    n, unit = launches.nproc, launches.unit
    ep, dp = f"dp1 × ep{n}", f"dp{n} × ep1"
    precisions = list(dict.fromkeys(precision for precision, _ in scaling))
    rows = [["correctness: max relative error vs 1 process", f"{worst_error:.1e}"],
            [f"here, {preset} {' · '.join(precisions)}: tokens/s per {unit} vs 1, {ep} / {dp}",
             " · ".join(f"{scaling[p, ep]:.2f} / {scaling[p, dp]:.2f}" for p in precisions)],
            [f"mixtral-2l: GB sent per GPU and step, {ep} / {dp} (computed)",
             f"{comm['mixtral-2l', ep]['sent'] / GB:.2f} / {comm['mixtral-2l', dp]['sent'] / GB:.2f}"],
            ["Mixtral-8x7B, 8 GPUs: training state GiB per GPU, dp8 / FSDP2 / ep8",
             f"{_gib(state['dp', 8]):,.0f} / {_gib(state['fsdp', 8]):,.0f} / {_gib(state['ep', 8]):,.0f}"],
            ["expert-parallel training: loss", f"{losses[0]:.3f} → {losses[-1]:.3f}"],
            ["2 × H200 (quoted): vs 1, dp1 × ep2 / dp2 × ep1, bf16 · FP8",
             " · ".join(f"{h200[p, 'dp1 × ep2']['scaling_efficiency_vs_1_gpu']:.2f} / "
                        f"{h200[p, 'dp2 × ep1']['scaling_efficiency_vs_1_gpu']:.2f}" for p in ("bf16", "fp8"))]]
    display.show_table(display.Table(["", "value"], rows, title=f"07 · expert parallelism ({mode} mode, {launches.where})"))
