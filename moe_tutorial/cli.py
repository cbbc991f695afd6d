"""Command line: `python -m moe_tutorial info | lab | train | run | build | bench |
blackwell-dry-run | validate | speed-of-light | idle-gaps | analyze`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

# Each command imports the package inside its own functions: nearly every module imports torch,
# and an argument mistake or `--help` is answered before it loads.


class _Parser(argparse.ArgumentParser):
    """argparse with its mistakes on one line, `error: ...` and exit status 2, like the
    commands' own checks (instead of a usage block that can run to ten lines above it)."""

    def error(self, message: str):
        self.exit(2, f"error: {message}; see `{self.prog} --help`\n")


def _check_device(device: str | None) -> None:
    if device is not None:
        from .precision.hardware import check_device

        check_device(device)


def _check_output_file(args: argparse.Namespace, flag: str, path: str | None, *,
                       make_parents: bool) -> None:
    """An output file the command writes, checked before it starts (`safe_io.check_output`);
    `main` then claims it for the command (`safe_io.claim_output`), so a second command
    writing it stops before its work."""
    if path is not None:
        from .safe_io import check_output

        check_output(flag, path, replace=args.replace, make_parents=make_parents)
        args.outputs.append((flag, path, make_parents))


def _info(args: argparse.Namespace) -> int:
    from .precision.hardware import capabilities

    caps = capabilities(import_te=not args.no_te)
    if args.json:
        print(json.dumps(caps.to_dict(), indent=2))
    else:
        print(caps.describe_machine(), caps.table(), caps.chapter_plan(), sep="\n\n")
    if warning := caps.te_version_warning():
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def _lab(args: argparse.Namespace) -> int:
    """Prepare the learner's working copy (moe_tutorial/course/workspace.py), then become JupyterLab."""
    from .course import workspace

    try:
        argv = workspace.lab_command(args.jupyter_args)
    except (OSError, ValueError) as exc:  # no JupyterLab, no course, no working copy, busy
        print(f"error: {exc.strerror if isinstance(exc, OSError) and exc.strerror else exc}",
              file=sys.stderr)
        return 2
    os.execv(argv[0], argv)


def _train_settings(args: argparse.Namespace):
    """The run's `TrainSettings`: the flags, with warm-up and evaluation every tenth of the run."""
    from .train.loop import TrainSettings

    return TrainSettings(steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                         warmup_steps=min(args.steps // 10, 100), seed=args.seed,
                         eval_every=max(args.steps // 10, 1))


def _check_train(args: argparse.Namespace) -> None:
    from .moe.config import preset
    from .moe.experts import EXPERT_BACKENDS
    from .train import checkpoint

    if args.checkpoint_dir is not None and not args.checkpoint_dir.strip():
        raise ValueError("--checkpoint-dir is empty (an unset variable?); give the folder to "
                         "save into, e.g. --checkpoint-dir runs/small, or leave the flag out "
                         "to train without checkpoints")
    if args.resume and not args.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir (the directory the run saved into)")
    if not 0 <= args.seed < 2**64:  # torch.manual_seed's range
        raise ValueError(f"--seed {args.seed} is outside [0, 2**64 - 1], the seeds torch "
                         f"takes; choose a smaller one, e.g. --seed 0")
    preset(args.preset)
    if args.backend not in EXPERT_BACKENDS:
        raise ValueError(f"--backend {args.backend!r} is not an expert backend; choose one of "
                         f"{', '.join(EXPERT_BACKENDS)}")
    _check_device(args.device)
    from .arguments import check_count, check_positive_number

    # The flags by their own names; TrainSettings checks the same values again for the API.
    check_count("--steps", args.steps)
    check_count("--batch-size", args.batch_size)
    check_positive_number("--lr", args.lr)
    _train_settings(args)
    _check_output_file(args, "--json", args.json, make_parents=False)
    if args.checkpoint_dir is not None:
        from .safe_io import check_folder_free

        check_count("--checkpoint-every", args.checkpoint_every)
        check_count("--keep-checkpoints", args.keep_checkpoints)
        checkpoint.Checkpointing(args.checkpoint_dir, args.checkpoint_every,
                                 args.keep_checkpoints)
        # a new run would overwrite and prune another run's checkpoints
        checkpoint.check_directory(args.checkpoint_dir, args.resume)
        check_folder_free(args.checkpoint_dir, "training run")


def _train(args: argparse.Namespace) -> int:
    import torch

    from .moe.config import preset
    from .moe.model import MoEForCausalLM
    from .safe_io import FolderBusy, write_json
    from .train.checkpoint import CheckpointError, Checkpointing
    from .train.data import load_protein_data
    from .train.loop import TrainingDiverged, evaluate, train

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    config = preset(args.preset)
    data = load_protein_data(config.max_seq_len, seed=args.seed)
    settings = _train_settings(args)
    windows = data.train.shape[0]
    if settings.batch_size > windows:  # known only now that the data is packed
        print(f"error: --batch-size {settings.batch_size} is more than the {windows:,} "
              f"training windows of preset {args.preset!r}; choose at most {windows}",
              file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    model = MoEForCausalLM(config, args.backend, device=device)
    print(f"preset {args.preset!r} ({sum(p.numel() for p in model.parameters()):,} "
          f"parameters), {args.backend} experts, {device}, {torch.get_num_threads()} threads")
    print(f"data: {data.num_sequences:,} sequences → {data.train.shape[0]:,} training windows of "
          f"{config.max_seq_len} tokens; unigram baseline {data.unigram_nats:.3f} nats")
    # Seeded: a resumed run's fresh model is the interrupted run's initial one, so this
    # starting point is the same either way.
    start = evaluate(model, data.val, settings.batch_size, settings.eval_batches)
    checkpoint = (Checkpointing(args.checkpoint_dir, args.checkpoint_every, args.keep_checkpoints)
                  if args.checkpoint_dir is not None else None)
    try:
        history = train(model, data.train, settings, val=data.val, checkpoint=checkpoint,
                        resume=args.resume)
    except (CheckpointError, FolderBusy) as exc:  # what is wrong, not a stack trace
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrainingDiverged as exc:  # a failed training: its step, loss and what to change
        print(f"error: {exc}", file=sys.stderr)
        return 1
    final = evaluate(model, data.val, settings.batch_size)  # all validation windows, not a sample
    if args.json:  # before anything is printed: a closed stdout cannot lose the result
        from .perf.timing import environment

        write_json(args.json, {
            "preset": args.preset, "device": device, "environment": environment(),
            "settings": {k: v for k, v in vars(args).items() if k not in ("run", "outputs")},
            "unigram_nats": data.unigram_nats, "val_loss_start": start,
            "val_loss_final": final, "history": history}, replace=args.replace)
    print(f"\n{'step':>6} {'train loss':>11} {'val loss':>9} {'tokens/s':>9} {'minutes':>8}")
    print(f"{0:>6} {'':>11} {start:>9.3f}")
    for r in history:
        if "val_loss" in r:
            print(f"{r['step']:>6} {r['loss']:>11.3f} {r['val_loss']:>9.3f} "
                  f"{r['tokens_per_s']:>9,.0f} {r['elapsed_s'] / 60:>8.2f}")
    print(f"\nvalidation loss (all {data.val[:, 1:].numel():,} validation tokens): {start:.3f} → "
          f"{final:.3f} nats; unigram baseline {data.unigram_nats:.3f} ({final - data.unigram_nats:+.3f})")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from .moe.config import preset
    from .perf import bench, timing

    partial: list[dict] = []

    def write(obj):  # whole or not at all: a full disk leaves the earlier file intact
        if args.out:
            from .safe_io import write_json

            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            # --out was checked before the work (refused if it held a result without
            # --replace); from then on it is this run's own file, rewritten as rows come in
            write_json(args.out, obj, replace=True)

    def keep(row):  # results so far reach the file even if the run is cut short
        partial.append(row)
        write({"environment": timing.environment(), "results": partial, "complete": False})

    if args.merge:
        try:
            report = bench.merge_reports([_read_report(path) for path in args.merge])
        except ValueError as exc:  # the parts given do not make one run: the user's files
            print(f"error: {exc}", file=sys.stderr)
            return 2
        write(report)
        print(bench.format_summary(report["summary"]))
        if args.out:
            print(f"wrote {args.out}")
        return 0
    report = bench.run(device=args.device, shapes=args.shapes, routings=args.routings,
                       expert=not args.no_expert, train=not args.no_train,
                       train_preset=args.preset, train_layers=args.layers,
                       train_variants=args.train_variants, batch=args.batch,
                       seq_len=args.seq_len, warmup=args.warmup, iters=args.iters,
                       optimizer=args.optimizer, on_result=keep)
    write({**report, "complete": True})
    if args.out:
        print(f"\nwrote {args.out}")
    for variant in args.profile or []:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        on_gpu = torch.device(device).type == "cuda"
        config = preset(args.preset or bench.default_preset(on_gpu), layers=args.layers)
        seq_len = args.seq_len or bench.default_seq_len(config, on_gpu)
        print("\n" + bench.profile_train_step(config, variant, batch=args.batch or 2,
                                              seq_len=seq_len, device=device))
    failed = [r for r in report["results"] if r.get("status") in ("error", "wrong")]
    for r in failed:
        print(f"FAILED: {r.get('variant') or (r['backend'], r['precision'])}: "
              f"{r.get('error') or 'output outside tolerance'}", file=sys.stderr)
    return 1 if failed else 0


def _read_report(path: str) -> dict:
    """A part for `bench --merge`: the JSON a `bench --out` wrote, or a one-line reason why not."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:  # missing, unreadable, or not JSON
        raise ValueError(f"--merge {path}: cannot read it as JSON ({exc}); give the files "
                         f"`bench --out` wrote") from None
    if not isinstance(report, dict) or not {"environment", "results"} <= report.keys():
        raise ValueError(f"--merge {path} is not a `bench --out` report (it has no "
                         f"'environment' and 'results'); give the files `bench --out` wrote")
    return report


def _check_bench(args: argparse.Namespace) -> None:
    from .arguments import check_count
    from .perf import bench

    _check_device(args.device)
    _check_output_file(args, "--out", args.out, make_parents=True)
    for flag, value, least in (("--batch", args.batch, 1), ("--seq-len", args.seq_len, 1),
                               ("--warmup", args.warmup, 0), ("--iters", args.iters, 1),
                               ("--layers", args.layers, 1)):
        if value is not None:  # by the flag's name; check_run_arguments names the API's
            check_count(flag, value, least=least)
    bench.check_run_arguments(device=args.device, shapes=args.shapes, routings=args.routings,
                              train_preset=args.preset, train_variants=args.train_variants,
                              batch=args.batch, seq_len=args.seq_len, warmup=args.warmup,
                              iters=args.iters, optimizer=args.optimizer,
                              train_layers=args.layers)
    for name in args.profile or []:
        bench.variant(name)


def _check_step_workload(args: argparse.Namespace) -> None:
    """--out, --preset, --batch and --seq-len of a command that profiles one training step
    (`_add_step_workload`)."""
    from .arguments import check_count
    from .moe.config import PRESETS

    _check_output_file(args, "--out", args.out, make_parents=True)
    if args.preset not in PRESETS:
        raise ValueError(f"--preset {args.preset!r} is not a preset; choose one of {sorted(PRESETS)}")
    check_count("--batch", args.batch)
    check_count("--seq-len", args.seq_len, least=2)


def _check_speed_of_light(args: argparse.Namespace) -> None:
    from .arguments import check_count

    _check_device(args.device)
    _check_step_workload(args)
    if args.layers is not None:
        check_count("--layers", args.layers)
    if args.committed and not Path(args.committed).is_file():
        raise ValueError(f"--committed {args.committed}: no such file; give a bench result JSON, "
                         f"e.g. benchmarks/results/h200.json")


def _speed_of_light(args: argparse.Namespace) -> int:
    import torch

    from .perf import speed_of_light

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    result = speed_of_light.run(preset_name=args.preset, layers=args.layers, batch=args.batch,
                                seq_len=args.seq_len, device=device, committed=args.committed,
                                optimizer=args.optimizer, profile_upto=args.profile_upto)
    if args.out:
        _write_json(result, args.out)
    return 0


def _check_idle_gaps(args: argparse.Namespace) -> None:
    import torch

    from .perf import bench

    _check_step_workload(args)
    for name in args.variants:
        bench.variant(name)
    if not torch.cuda.is_available():
        raise ValueError("idle-gaps profiles the GPU's idle time between kernels and torch sees "
                         "no CUDA GPU here; run it on a GPU (on a CPU, `bench --profile` shows "
                         "where the host spends the step)")


def _idle_gaps(args: argparse.Namespace) -> int:
    from .perf import idle_gaps

    def report(name, entry):
        gaps = idle_gaps.IdleGaps.from_dict(entry["gaps"])
        print(f"\n{name}: {entry['median_ms']:.1f} ms per step (unprofiled median); "
              f"experts: {entry['path'] or '-'}")
        gaps.show(title=f"{name}: where the GPU waits")

    result = idle_gaps.run(args.variants, preset_name=args.preset, batch=args.batch,
                           seq_len=args.seq_len, with_stack=args.python_stacks,
                           on_variant=report)
    if args.out:
        _write_json(result, args.out)
    return 0


def _check_analyze(args: argparse.Namespace) -> None:
    from .perf.analyze import FLAG_NAMES, check_arguments

    _check_output_file(args, "--json", args.json, make_parents=True)
    check_arguments(args.model, batch=args.batch, seq_len=args.seq_len, gpus=args.gpus,
                    gpu_gib=args.gpu_gib, names=FLAG_NAMES)


def _analyze(args: argparse.Namespace) -> int:
    from .perf.analyze import analyze, format_report

    report = analyze(args.model, batch=args.batch, seq_len=args.seq_len, gpus=args.gpus,
                     gpu_gib=args.gpu_gib, sweep=False if args.no_sweep else None)
    if args.json:  # before the report is printed: a closed stdout cannot lose it
        _write_json(report, args.json, say=False)
    print(format_report(report))
    if args.json:
        print(f"wrote {args.json}")
    return 0


# Each command's checks of its arguments, run before any of its work (see `main`).
def _check_validate(args: argparse.Namespace) -> None:
    _check_output_file(args, "--out", args.out, make_parents=True)


_CHECKS = {"validate": _check_validate, "train": _check_train, "bench": _check_bench, "speed-of-light": _check_speed_of_light,
           "analyze": _check_analyze, "idle-gaps": _check_idle_gaps,
           "blackwell-dry-run": _check_validate}  # an --out file, as validate's


def _add_step_workload(parser: argparse.ArgumentParser, *, out_help: str) -> None:
    """The training step a profiling command measures (`mixtral-2l`, 2 × 4096 by default, as
    the benchmark's GPU step) and where its JSON goes; checked by `_check_step_workload`."""
    parser.add_argument("--preset", default="mixtral-2l")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--out", default=None, help=out_help)
    parser.add_argument("--replace", action="store_true",
                        help="replace an existing --out file (else it is refused)")


def _write_json(doc: dict, path: str, *, say: bool = True) -> None:
    """`doc` into `path` whole or not at all; the command checked and claimed `path` before
    its work (`main`)."""
    from .safe_io import write_json

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_json(path, doc, replace=True)
    if say:
        print(f"wrote {path}")


def _blackwell_dry_run(args: argparse.Namespace) -> int:
    from .perf.blackwell import dry_run

    try:
        report = dry_run()
    except RuntimeError as exc:  # no TE or no GPU here: one line, not a traceback
        print(f"blackwell-dry-run: {exc}", file=sys.stderr)
        return 2
    _write_json(report, args.out)
    print(json.dumps(report["summary"], indent=1))
    agree = all(s["all_cases_agree_with_why_unfused"] for k, s in report["summary"].items()
                if k != "fused_selected")
    return 0 if report["summary"]["fused_selected"] and agree else 1


def _validate(args: argparse.Namespace) -> int:
    from .perf.blackwell import validate

    report = validate()
    _write_json(report, args.out)
    for what, why in report["skipped"].items():
        print(f"skipped {what}: {why}")
    return 0 if report["gpu_tests"]["exit_code"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m moe_tutorial", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="what this machine can run (the capability table) and "
                                       "what each chapter runs here")
    info.add_argument("--json", action="store_true", help="print machine-readable JSON")
    info.add_argument("--no-te", action="store_true", help="do not import Transformer Engine")
    info.set_defaults(run=_info)

    lab = sub.add_parser("lab", help="JupyterLab on your working copy of the course (work/, "
                                     "made on first use; your files there are never overwritten)")
    lab.add_argument("jupyter_args", nargs=argparse.REMAINDER,
                     help="after '--': more arguments for `jupyter lab`, e.g. "
                          "`lab -- --no-browser --port 8890`")
    lab.set_defaults(run=_lab)

    tr = sub.add_parser("train", help="train a protein MoE LM on the shipped CATH sequences")
    tr.add_argument("--preset", default="small")
    tr.add_argument("--backend", default="grouped_torch", help="expert backend")
    tr.add_argument("--device", default=None)
    tr.add_argument("--steps", type=int, default=400)
    tr.add_argument("--batch-size", type=int, default=16)
    tr.add_argument("--lr", type=float, default=3e-3)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--json", default=None, help="write the history to this JSON file")
    tr.add_argument("--replace", action="store_true",
                    help="replace an existing --json file (else it is refused)")
    tr.add_argument("--checkpoint-dir", default=None,
                    help="save model, optimizer, RNG and data position here (atomically)")
    tr.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    tr.add_argument("--keep-checkpoints", type=int, default=3, help="how many newest to keep")
    tr.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint in --checkpoint-dir (same settings)")
    tr.set_defaults(run=_train)

    from .course.exercise_build import add_build_command
    from .course.runner import add_run_command
    add_run_command(sub)  # `run`: execute the notebooks headless, write report.html
    add_build_command(sub)  # `build`: exercises/ from solutions/ (--check for CI)

    be = sub.add_parser("bench", help="benchmark the expert layer and the training step")
    be.add_argument("--device", default=None)
    be.add_argument("--shapes", nargs="+", default=None,
                    help="expert shapes: mixtral fine_grained small tiny (default by device)")
    be.add_argument("--routings", nargs="+", default=["balanced", "skewed"])
    be.add_argument("--no-expert", action="store_true", help="skip the expert-layer benchmark")
    be.add_argument("--no-train", action="store_true", help="skip the training-step benchmark")
    be.add_argument("--preset", default=None, help="model of the training step (default by device)")
    be.add_argument("--layers", type=int, default=None,
                    help="the training step's model with this many layers (default: the preset's)")
    be.add_argument("--train-variants", nargs="+", default=None,
                    help="default: the course's ladder (bench.TRAIN_VARIANTS); any name of "
                         "bench.VARIANTS, e.g. ours_te_ops_fp8_compiled_loss")
    be.add_argument("--batch", type=int, default=None)
    be.add_argument("--seq-len", type=int, default=None)
    be.add_argument("--warmup", type=int, default=None)
    be.add_argument("--iters", type=int, default=None)
    be.add_argument("--optimizer", default="torch_adamw", choices=["torch_adamw", "te_fused_adam"],
                    help="optimizer of our training-step variants (HF uses torch's fused AdamW)")
    be.add_argument("--out", default=None, help="write the results as JSON here")
    be.add_argument("--replace", action="store_true",
                    help="replace an existing --out file (else it is refused)")
    be.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="instead of running: merge the JSON files of separate parts of one run "
                         "(same machine and versions) into --out, summary recomputed")
    be.add_argument("--profile", nargs="+", default=None,
                    help="also print a torch.profiler table of these training-step variants")
    be.set_defaults(run=_bench)

    dry = sub.add_parser("blackwell-dry-run",
                         help="TE's own fusion decision for the course's te_ops MLP, as on a B200 "
                              "(needs TE on any CUDA GPU)")
    dry.add_argument("--out", default="benchmarks/results/h200_blackwell_dry_run.json")
    dry.add_argument("--replace", action="store_true",
                     help="replace an existing --out file (else it is refused)")
    dry.set_defaults(run=_blackwell_dry_run)

    va = sub.add_parser("validate", help="on a B200 (or any GPU): GPU tests, fused-path check, "
                                         "one timed step per variant, in one JSON")
    va.add_argument("--out", default="report.json")
    va.add_argument("--replace", action="store_true",
                    help="replace an existing --out file (else it is refused)")
    va.set_defaults(run=_validate)

    sol = sub.add_parser("speed-of-light",
                         help="the training step's floor per part from the model's shapes and "
                              "this device's measured rates, vs each chapter's profiled step")
    _add_step_workload(sol, out_help="write the speed_of_light section as JSON here")
    sol.add_argument("--layers", type=int, default=None,
                     help="the preset with this many layers (default: the preset's)")
    sol.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    sol.add_argument("--committed", default=None, metavar="JSON",
                     help="read the rates from a bench result file instead of measuring them")
    sol.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw_fp32"],
                     help="AdamW's state in the parameters' dtype, or fp32 master weights")
    sol.add_argument("--profile-upto", default=None,
                     choices=["naive", "grouped", "te_ops", "fp8"],
                     help="also profile each course chapter's step up to this one")
    sol.set_defaults(run=_speed_of_light)
    idle = sub.add_parser("idle-gaps",
                          help="on a GPU: each idle gap of the training step, by what the GPU "
                               "waited for (a host sync, or the host behind) and where")
    idle.add_argument("--variants", nargs="+", required=True,
                      help="training-step variants of the benchmark, e.g. ours_te_ops_fp8_compiled")
    _add_step_workload(idle, out_help="write the results as JSON here")
    idle.add_argument("--python-stacks", action="store_true",
                      help="also record Python frames (slows the host: longer gaps)")
    idle.set_defaults(run=_idle_gaps)
    an = sub.add_parser("analyze",
                        help="the course's analysis of your own MoE: parameters, expert GEMM "
                             "shapes, padding, fused-MLP conditions, memory per layout, and a "
                             "recommendation (after a short sweep on a GPU)")
    an.add_argument("model", help="a preset, a shipped config (qwen3-moe-30b-a3b, olmoe-1b-7b, "
                                  "deepseek-v3), or the path of an HF config.json (or its "
                                  "directory) or of a JSON file of MoEConfig fields")
    an.add_argument("--batch", type=int, default=1, help="sequences per GPU (memory, layout)")
    an.add_argument("--seq-len", type=int, default=None,
                    help="tokens per sequence (default: 4096, or the model's max_seq_len)")
    an.add_argument("--gpus", type=int, default=8, help="GPUs of the layouts (dp × ep)")
    an.add_argument("--gpu-gib", type=float, default=140.0, help="memory of each GPU in GiB")
    an.add_argument("--no-sweep", action="store_true",
                    help="on a GPU, skip the measured sweep (recommend from the arithmetic)")
    an.add_argument("--json", default=None, help="also write the report as JSON here")
    an.add_argument("--replace", action="store_true",
                    help="replace an existing --json file (else it is refused)")
    an.set_defaults(run=_analyze)

    args = parser.parse_args(argv)
    args.outputs = []  # (flag, path, make_parents) of the files the command writes
    check = _CHECKS.get(args.command)
    if check is not None:
        # Every argument is checked before any work starts. These checks see nothing but the
        # arguments, so a ValueError from them is the user's mistake: one line, exit status 2.
        # One raised once the work runs is a bug and keeps its traceback.
        try:
            check(args)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    from .safe_io import REFUSALS, StdoutThatMayClose, claim_output, refusal_line

    stdout = sys.stdout
    sys.stdout = StdoutThatMayClose(stdout)
    try:
        with contextlib.ExitStack() as claims:
            try:  # one writer per result file, from now until the command ends
                for flag, path, make_parents in args.outputs:
                    claims.enter_context(claim_output(
                        path, f"`{args.command}`", replace=args.replace, flag=flag,
                        make_parents=make_parents))
            except REFUSALS as exc:
                print(f"error: {refusal_line(exc)}", file=sys.stderr)
                return 2
            try:
                return args.run(args)
            except REFUSALS as exc:
                # a full disk, lost permission, a result file that appeared meanwhile: nothing
                # was changed, say so
                print(f"error: {refusal_line(exc)}", file=sys.stderr)
                return 1
    finally:
        sys.stdout.finish()
        sys.stdout = stdout


if __name__ == "__main__":
    sys.exit(main())
