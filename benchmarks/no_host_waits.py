"""The sync-free steps beside the HF baselines, in one process on one GPU.

Runs the expert layer (forward + backward, permutation included) on one of `bench`'s shapes for
the bf16 loop, TE's paths and the sync-free backends, then the training step of `bench`'s model
(mixtral-2l, batch 2 × 4096) for the named variants, each row with its host-sync record
(`bench.sync_record`), and writes a report in `bench --out`'s format (environment, measured
peaks, results, summary), rewritten after every row so a run cut short keeps what it measured.
With `--curve-variants`, also their loss curves over `--curve-steps` steps
(`bench.graphed_loss_curves`: eager variants through the course's loop, graphed ones through
`GraphedTrainStep`) on the same batches of the shipped protein data.

    PYTHONPATH=.:$PYTHONPATH python3 benchmarks/no_host_waits.py --out FILE.json \\
        --train-variants hf_grouped_mm_compiled ours_sync_free_fp8_graphed ...
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.nn.attention import SDPBackend

from moe_tutorial.moe import model
from moe_tutorial.moe.batch import next_token_targets
from moe_tutorial.moe.config import preset
from moe_tutorial.moe.experts import sync_free
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.perf import bench, speed_of_light
from moe_tutorial.perf.timing import environment, measure_peaks
from moe_tutorial.train import graphed
from moe_tutorial.train.data import load_protein_data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--expert-shape", default="mixtral", choices=list(bench.EXPERT_SHAPES))
    parser.add_argument("--expert-backends", nargs="*", default=[
        "naive:bf16", "te_permute_grouped_mm:bf16", "sync_free:bf16",
        "te_ops:Float8CurrentScaling", "te_grouped_linear:Float8CurrentScaling",
        "sync_free_fp8:fp8_rowwise", "sync_free_fp8_wgrad:fp8_rowwise"], help="backend:precision pairs; the first is the reference")
    parser.add_argument("--train-variants", nargs="*", default=[])
    parser.add_argument("--curve-variants", nargs="*", default=[])
    parser.add_argument("--curve-steps", type=int, default=80)
    parser.add_argument("--curve-seq-len", type=int, default=256)
    parser.add_argument("--curve-lr", type=float, default=1e-3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--probe-graph", nargs=3, metavar=("ATTENTION", "ROPE", "BACKEND"),
                        help="only replay a graphed step of the tiny model with this attention "
                             "kernel (cudnn, flash, efficient), RoPE (te, torch) and expert "
                             "backend: whether replays and a read of the loss succeed (run each "
                             "in its own process: an illegal memory access ends the context)")
    args = parser.parse_args()
    if args.probe_graph:
        probe_graph(*args.probe_graph)
        return

    env = environment()
    peaks = measure_peaks("cuda", env["gpu"])
    print(f"{env['gpu']}: torch {env['torch']}, TE {env['transformer_engine']}; dense bf16 "
          f"{peaks.bf16_measured:.0f} TFLOP/s, FP8 {peaks.fp8_measured or 0:.0f} TFLOP/s")
    print("torch._scaled_grouped_mm:", torch.ops.aten._scaled_grouped_mm.default._schema)
    print("FP8 expert GEMM here:", sync_free.scaled_gemm_path(torch.device("cuda")))
    report = {"environment": env, **peaks.to_dict(), "results": [], "complete": False}

    def save(row=None):
        if row is not None:
            report["results"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "losses"})[:900], flush=True)
        report["summary"] = bench.summarize(report["results"])
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    if args.expert_backends:
        pairs = [tuple(p.split(":")) for p in args.expert_backends]
        for routing in ("balanced",):
            bench.bench_expert_layer(bench.EXPERT_SHAPES[args.expert_shape], routing,
                                     variants=pairs, iters=args.iters, on_result=save)
    if args.train_variants:
        config = preset("mixtral-2l")
        bench.bench_train_step(config, args.train_variants, batch=2, seq_len=4096,
                               iters=args.iters, on_result=save)
        save_floors(report, config, batch=2, seq_len=4096)
        save()
    if args.curve_variants:
        config = preset("mixtral-2l")
        windows = load_protein_data(args.curve_seq_len).train  # text to learn, unlike random ids
        for row in bench.graphed_loss_curves(config, args.curve_variants, steps=args.curve_steps,
                                             seq_len=args.curve_seq_len, lr=args.curve_lr,
                                             windows=windows):
            save(row)
    report["complete"] = True
    save()
    print(bench.format_summary(report["summary"]))


def save_floors(report: dict, config, *, batch: int, seq_len: int, device="cuda") -> None:
    """The step's speed-of-light floor per precision at rates measured now, in this process
    (`speed_of_light.step_floors`), and each timed training row's fraction of its floor."""
    rates = speed_of_light.measure_rates(device, config, batch, seq_len)
    floors = speed_of_light.step_floors(config, batch, seq_len, rates)
    report["speed_of_light"] = {"rates": rates.to_dict(),
                                "floors": {p: f.to_dict() for p, f in floors.items()}}
    for row in report["results"]:
        if row.get("part") == "train" and row.get("status") == "ok":
            total = floors[row["precision"]].total_ms
            row["floor_ms"] = total
            row["fraction_of_floor"] = None if total is None else total / row["median_ms"]
    print({p: f.total_ms for p, f in floors.items()}, "ms floors;",
          {r["variant"]: r.get("fraction_of_floor") for r in report["results"]
           if r.get("part") == "train"})


PROBE_ATTENTION = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                   "efficient": SDPBackend.EFFICIENT_ATTENTION}


def probe_graph(attention: str, rope: str, backend: str) -> None:
    """A graphed step of the tiny model (bf16) with one attention kernel, TE's fused RoPE or
    torch's, and one expert backend captured: prints whether eight calls (two eager, the
    capture, five replays) and a read of their losses succeed."""

    graphed.GRAPH_SAFE_ATTENTION_BACKENDS = [PROBE_ATTENTION[attention]]
    if rope == "torch":  # `Rotary` takes TE's kernel only where it finds TE
        model.hardware.transformer_engine = lambda: None
    config = preset("tiny").with_overrides(dtype="bfloat16")
    torch.manual_seed(0)
    net = MoEForCausalLM(config, device="cuda").set_expert_backend(backend)
    step = graphed.GraphedTrainStep(net, graphed.capturable_adamw(net, 1e-3))
    ids = torch.randint(0, config.vocab_size, (2, 64), device="cuda")
    label = f"graph probe attention={attention} rope={rope} backend={backend}"
    try:
        losses = [step((ids, next_token_targets(ids))).clone() for _ in range(8)]
        print(f"{label}: ok, losses", [round(x, 4) for x in torch.stack(losses).tolist()])
    except Exception as exc:
        print(f"{label}: {type(exc).__name__}: {exc}"[:400])


if __name__ == "__main__":
    main()
