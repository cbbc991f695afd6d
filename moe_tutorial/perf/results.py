"""The one reader of the course's committed results (`benchmarks/results/` of the repository), the
measurements the notebooks and the package quote.

They are found in the clone the current directory is in (`locations.checkout_root`), so a
notebook in notebooks/ or work/notebooks/ and a command run at the repository's root read the same
files. They are not shipped in the wheel: they are the repository's record of runs, one file per
run, which tools/docs.py and the tests read there too, and a copy inside the package would drift
from it. An installed package run outside a clone gets one line naming the missing file and where
it was looked for; `analyze` then says which quoted numbers it leaves out."""

from __future__ import annotations

import json
from pathlib import Path

from ..locations import checkout_root, outside_checkout

FOLDER = "benchmarks/results"
H200 = f"{FOLDER}/h200.json"  # the course's committed one-H200 run


def find(name: str | Path) -> Path | None:
    """The committed result file `name` (`h200.json`, or `benchmarks/results/h200.json` as the docs
    write it) of the clone the current directory is in; None outside a clone or where the clone
    has no such file (a notebook then says it quotes nothing)."""
    root = checkout_root()
    given = Path(name)
    prefix = tuple(FOLDER.split("/"))
    relative = Path(*given.parts[len(prefix):]) if given.parts[:len(prefix)] == prefix else given
    found = root / FOLDER / relative if root is not None and not given.is_absolute() else None
    return found if found is not None and found.is_file() else None


def path(name: str | Path) -> Path:
    """A result file: `name` as given where it exists (a run of your own), else the committed file
    of that name (`find`). A ValueError names the file and what to pass instead."""
    given = Path(name)
    if given.is_file():
        return given
    found = find(given)
    if found is not None:
        return found
    fix = f"pass the JSON that `python -m moe_tutorial bench` wrote, e.g. {H200}"
    root = None if given.is_absolute() else checkout_root()
    if root is None and not given.is_absolute():
        raise ValueError(f"{name}: no such results file, and {outside_checkout()}; {fix}")
    where = f" (nor in {root / FOLDER})" if root is not None else ""
    raise ValueError(f"{name}: no such results file{where}; {fix}")


def read(name: str | Path) -> dict:
    """The JSON of a result file (`path`)."""
    return json.loads(path(name).read_text())


# ---------------------------------------------------------------------------------------------
# What the committed H200 runs record beyond the chapters (the deep dive reads these)

# The one-H200 runs in the order they were made, each with what changed in the course's step
# before it ran (the same model and batch throughout: mixtral-2l, 2 x 4096 tokens).
H200_HISTORY = (
    (f"{FOLDER}/h200_fused_norm_loss.json",
     "RMSNorm as one kernel (`F.rms_norm`), the loss's gradient computed in the forward pass"),
    (f"{FOLDER}/h200_cudnn_attention_rope.json",
     "cuDNN attention, TE fused RoPE, q/k/v as one FP8 `te.Linear`, `log_softmax` in the loss"),
    (f"{FOLDER}/h200_mfu_peaks.json",
     "the same step measured again (no change to the step)"),
    (H200, "the ladder measured again"),
)

# The committed runs of optimizer and compilation experiments the course did not adopt, each
# timed beside the variant it changes, in the same run on one H200.
CANDIDATE_RUNS = (f"{FOLDER}/h200_step_in_backward_same_stream.json",
                  f"{FOLDER}/h200_step_in_backward_side_stream.json",
                  f"{FOLDER}/h200_compiled_candidates.json",
                  f"{FOLDER}/h200_compiled_candidates_rerun.json",
                  f"{FOLDER}/h200_compiled_step_in_backward.json")

# How a candidate's variant name says what it changed (suffixes, outermost last). `_compiled`
# on the course's own steps (`ours_*`) is the loss and AdamW's step compiled together; on HF's
# step it is the model compiled, part of the base.
_CANDIDATE_SUFFIXES = (("_step_in_backward", "AdamW stepped in the backward pass"),
                       ("_compiled_adamw", "AdamW's step compiled"),
                       ("_compiled_loss", "the loss and its gradient compiled"))
_BOTH_COMPILED = ("_compiled", "the loss and AdamW's step compiled")


def _candidate_base(variant: str) -> tuple[str, list[str]]:
    """The variant a candidate changes and what it changes, read from its name."""
    changes = []
    for suffix, words in _CANDIDATE_SUFFIXES:
        if variant.endswith(suffix):
            variant = variant.removesuffix(suffix)
            changes.insert(0, words)
    suffix, words = _BOTH_COMPILED
    if variant.startswith("ours_") and variant.endswith(suffix):
        variant = variant.removesuffix(suffix)
        changes.insert(0, words)
    return variant, changes


def _train_rows(report: dict) -> dict[str, dict]:
    return {r["variant"]: r for r in report["results"]
            if r.get("part") == "train" and r.get("status") == "ok"}


def h200_history() -> list[dict]:
    """The course's FP8 step (`ours_te_ops_fp8`) and HF's eager step in each committed one-H200
    run of `H200_HISTORY`: both medians from the same run, and their ratio."""
    history = []
    for name, change in H200_HISTORY:
        report = read(name)
        rows = _train_rows(report)
        ours, hf = rows["ours_te_ops_fp8"]["median_ms"], rows["hf_eager"]["median_ms"]
        history.append({"run": name, "date": report["environment"]["date"], "change": change,
                        "ours_fp8_ms": ours, "hf_eager_ms": hf, "speedup": hf / ours})
    return history


def candidate_gains() -> list[dict]:
    """Every candidate of `CANDIDATE_RUNS` beside its base variant from the same run (both ran):
    what it changes, the two medians, the speedup and the two peaks (GiB)."""
    gains = []
    for name in CANDIDATE_RUNS:
        report = read(name)
        rows = _train_rows(report)
        for variant, row in rows.items():
            base, changes = _candidate_base(variant)
            if not changes or base not in rows:
                continue
            gains.append({"run": name, "gpu": report["environment"]["gpu"],
                          "date": report["environment"]["date"], "variant": variant,
                          "base": base, "technique": " and ".join(changes),
                          "base_ms": rows[base]["median_ms"], "ms": row["median_ms"],
                          "speedup": rows[base]["median_ms"] / row["median_ms"],
                          "base_peak_gib": rows[base]["peak_memory_gb"],
                          "peak_gib": row["peak_memory_gb"]})
    return gains


def history_table():
    """`h200_history` as a table (one row per committed run, in order)."""
    from . import widgets

    return widgets.Table(
        ["run", "what changed before it", "ours_te_ops_fp8 ms/step", "hf_eager ms/step",
         "HF eager / ours, same run"],
        [[f"{Path(h['run']).name} ({h['date'][:10]})", h["change"], f"{h['ours_fp8_ms']:.1f}",
          f"{h['hf_eager_ms']:.1f}", f"{h['speedup']:.2f}x"] for h in h200_history()],
        title="the course's step on one H200, run after run (mixtral-2l, 2 × 4096 tokens; "
              "committed runs)")


def candidate_table():
    """`candidate_gains` as a table: each experiment against its base variant of the same run."""
    from . import widgets

    gains = candidate_gains()
    return widgets.Table(
        ["what changes", "base variant", "ms/step: base → candidate", "speedup",
         "peak GiB: base → candidate", "run"],
        [[g["technique"], g["base"], f"{g['base_ms']:.1f} → {g['ms']:.1f}", f"{g['speedup']:.3f}x",
          f"{g['base_peak_gib']:.1f} → {g['peak_gib']:.1f}", f"{Path(g['run']).name} ({g['date'][:10]})"]
         for g in gains],
        title=f"optimizer and compilation experiments on one {gains[0]['gpu']}, each beside its "
              "base variant in the same run (committed runs)")
