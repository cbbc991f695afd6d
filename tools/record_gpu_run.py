"""Record the course's GPU run for learners without a GPU (`moe_tutorial.course.gpu_replay`).

On a machine with a CUDA GPU, from the repository root:

    MOE_TUTORIAL_RECORD_GPU=1 python -m moe_tutorial run --mode full --out /tmp/gpu-run
    python -m tools.record_gpu_run /tmp/gpu-run benchmarks/results/gpu_course_full.json

reads every executed notebook of the run, keeps the outputs (text, tables, figures) and the kept
values of each `%%needs_gpu` cell under the digest of its source, and writes them, each chapter
with the GPU, the versions, its mode and the date, as one JSON file. Writing a file that exists
adds the run's chapters to it (a run of some chapters replaces only those). The environment is
read from this machine, which must be the one the run executed on; `--environment FILE` gives it
instead (a JSON of the same keys, with a `source` saying how it was established) for a run whose
executed notebooks were brought here from its GPU machine."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_tutorial.course.gpu_replay import cell_digest, compact_outputs, magic_names
from moe_tutorial.perf import timing


def environment() -> dict:
    """This GPU machine's hardware and versions, as every committed result records them
    (`perf.timing.environment`)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("record_gpu_run: no CUDA GPU here; record the run on the GPU machine it ran on")
    return timing.environment()


def chapter_cells(notebook: dict) -> list[dict]:
    cells = []
    for cell in notebook.get("cells", []):
        source = "".join(cell.get("source", ""))
        if cell.get("cell_type") != "code" or magic_names(source) is None:
            continue
        outputs, kept = compact_outputs(cell.get("outputs", []))
        if any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
            raise SystemExit(f"record_gpu_run: a %%needs_gpu cell failed in this run; fix it first:\n{source}")
        cells.append({"digest": cell_digest(source), "first_line": (source.split("\n") + [""])[1],
                      "outputs": outputs, "kept": kept})
    return cells


def record(run_dir: Path, out: Path, given_environment: dict | None = None) -> dict:
    record = json.loads(out.read_text()) if out.exists() else {"chapters": {}}
    for path in sorted(run_dir.glob("[0-9][0-9]_*.ipynb")):
        notebook = json.loads(path.read_text())
        papermill = notebook.get("metadata", {}).get("papermill", {})
        mode = (papermill.get("parameters") or {}).get("MODE") or "unknown"
        seconds = papermill.get("duration")
        env = {**(given_environment or environment()), "mode": mode}
        record["chapters"][path.stem] = {"environment": env, "cells": chapter_cells(notebook),
                                         "seconds": round(seconds, 1) if seconds else None}
    out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="the folder `moe_tutorial run --mode full` wrote")
    parser.add_argument("out", type=Path, help="the JSON to write (benchmarks/results/gpu_course_full.json)")
    parser.add_argument("--environment", type=Path, default=None,
                        help="the run's GPU and versions as JSON, when recording elsewhere")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        print(f"record_gpu_run: {args.run_dir} is not a run folder", file=sys.stderr)
        return 2
    given = json.loads(args.environment.read_text()) if args.environment else None
    done = record(args.run_dir, args.out, given)
    cells = sum(len(c["cells"]) for c in done["chapters"].values())
    print(f"wrote {args.out}: {cells} cells of {len(done['chapters'])} chapters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
