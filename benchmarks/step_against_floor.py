"""The fastest training steps part by part against the speed-of-light floor, with the kernels of each part.

`speed-of-light --profile-upto` profiles the chapters' steps, which compile nothing. This profiles
any of the benchmark's variants (`bench.VARIANTS`: the compiled steps, and the candidates that
change them), one after another in one process on the same batch and seeded weights:

- the step timed (median of `--iters`, CUDA events on a GPU), its first loss beside the first
  variant's, and its peak memory (in one process: what an earlier variant left allocated counts);
- the profiled step split by part (`step_profile.profile_step`) beside each part's floor for the
  variant's precision (`speed_of_light.step_floors`, at rates measured in this process, or read
  from `--committed`): the gap to the floor, part by part;
- each part's largest kernels (GPU time and launches per step), named as the profiler names
  them, so the gap a part leaves points at the kernels that hold it.

    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/step_against_floor.py --out FILE.json \\
        --variants ours_te_ops_fp8_compiled ours_te_ops_fp8_compiled_compiled_norms

The file is rewritten after every variant, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch

from benchmarks.report_file import add_report_arguments, run_into_report
from moe_tutorial.moe.config import preset
from moe_tutorial.perf import bench, speed_of_light
from moe_tutorial.perf.step_parts import cuda_kernels, kernel_units
from moe_tutorial.perf.step_profile import profile_step, profiled_steps
from moe_tutorial.perf.timing import environment, peak_memory_gb, reset_memory, time_fn
from moe_tutorial.precision import hardware
from moe_tutorial.safe_io import write_json

KERNELS_PER_PART = 8


def kernels_by_part(prof, steps: int) -> dict[str, list[dict]]:
    """The profile's CUDA kernels summed by name within each part (the part `step_parts` gives
    the kernel from its own name and its launching op's), the largest `KERNELS_PER_PART` of each:
    GPU ms and launches per step."""
    kernels = cuda_kernels(prof)
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    # kernel_units gives each kernel its part, in the kernels' order
    for kernel, unit in zip(kernels, kernel_units(prof.events(), kernels), strict=True):
        entry = totals[(unit.part, kernel.name)]
        entry[0] += (kernel.end - kernel.start) / 1e3
        entry[1] += 1
    parts: dict[str, list[dict]] = defaultdict(list)
    for (part, name), (ms, count) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        if len(parts[part]) < KERNELS_PER_PART:
            parts[part].append({"kernel": name[:160], "ms_per_step": ms / steps,
                                "launches_per_step": count / steps})
    return dict(parts)


def measure(config, name: str, data, floors, args, reference_loss) -> dict:
    v = bench.variant(name)
    row = {"variant": name, "precision": v.precision_kind}
    reset_memory(args.device)
    model, forward = v.build(config, args.device)
    optimizer = v.optimizer(model, 1e-5)
    first = bench.initial_loss(model, forward, *data)
    row["first_loss"] = first
    row["loss_diff"] = None if reference_loss is None else abs(first - reference_loss)
    step = bench.timed_step(model, forward, optimizer, data)
    timed = time_fn(step, warmup=args.warmup, iters=args.iters, device=args.device)
    row.update(median_ms=timed.median_ms, min_ms=timed.min_ms, timer=timed.timer,
               peak_memory_gb=peak_memory_gb(args.device))
    if not v.hf:
        row["path"] = model.expert_paths()[0]
    breakdown = profile_step(step, device=args.device, steps=args.profile_steps, warmup=1)
    comparison = speed_of_light.compare(floors[v.precision_kind], breakdown)
    row["profiled"] = {"step_ms": breakdown.total_ms, "launches_per_step": breakdown.launches_per_step,
                       "source": breakdown.source}
    row["against_floor"] = comparison.to_dict()
    row["table"] = speed_of_light.format_table(comparison.floor, comparison)
    if torch.device(args.device).type == "cuda":
        prof, _ = profiled_steps(step, device=args.device, steps=args.profile_steps, warmup=1)
        row["kernels_by_part"] = kernels_by_part(prof, args.profile_steps)
    del model, optimizer, step
    return row


def run(args) -> dict:
    hardware.check_device(args.device)
    config = preset(args.preset)
    rates = (speed_of_light.Rates.from_committed(args.committed) if args.committed else
             speed_of_light.measure_rates(args.device, config, args.batch, args.seq_len))
    floors = speed_of_light.step_floors(config, args.batch, args.seq_len, rates)
    data = bench.random_batch(config, args.batch, args.seq_len, args.device)
    caps = hardware.capabilities()
    report = {"environment": environment(), "preset": args.preset, "batch": args.batch,
              "seq_len": args.seq_len, "device": str(args.device),
              "transformer_engine": caps.env.te_version if caps.has_te else None,
              "rates": rates.to_dict(), "floors_ms": {p: f.total_ms for p, f in floors.items()},
              "rows": []}
    reference_loss = None
    for name in args.variants:
        try:
            row = measure(config, name, data, floors, args, reference_loss)
        except torch.cuda.OutOfMemoryError:
            row = {"variant": name, "status": "OOM"}
        except Exception as exc:  # one variant's failure is a row with its reason
            row = {"variant": name, **bench.classify_error(exc)}
        else:
            row["status"] = "ok"
            if reference_loss is None:
                reference_loss = row["first_loss"]
            peak = row["peak_memory_gb"]  # None on a CPU
            print(f"{name}: {row['median_ms']:.1f} ms/step"
                  + (f", peak {peak:.1f} GiB" if peak is not None else "")
                  + f"\n{row['table']}\n", flush=True)
            for part, kernels in row.get("kernels_by_part", {}).items():
                print(f"  {part}: " + "; ".join(f"{k['kernel'][:60]} {k['ms_per_step']:.2f} ms"
                                                for k in kernels[:4]), flush=True)
        if row["status"] != "ok":
            print(f"{name}: {row['status']}: {row.get('error', '')}", flush=True)
        report["rows"].append(row)
        write_json(args.out, report, replace=True)  # the claim checked it before any work
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_report_arguments(parser)
    parser.add_argument("--preset", default="mixtral-2l")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--variants", nargs="+", required=True, choices=sorted(bench.VARIANTS),
                        metavar="VARIANT", help="names of bench.VARIANTS, timed in this order")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--committed", default=None, metavar="JSON",
                        help="read the floor's rates from a result file instead of measuring them")
    return run_into_report(parser, parser.parse_args(argv), run, "`benchmarks/step_against_floor.py`")


if __name__ == "__main__":
    sys.exit(main())
