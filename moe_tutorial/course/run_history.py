"""The committed training-step runs read as a history, for the optional deep dive: the course's
FP8 step against HF's eager step run after run, the optimizer and compilation experiments each
beside the variant it changes, and the steps' host syncs beside their times. Runs are found by
what they hold (`bench.committed_train_runs`), so a new committed run needs no list updated
here."""

from __future__ import annotations

from pathlib import Path

from ..display import Table
from ..perf import bench

# the not-adopted candidate's suffix in committed rows, and what it changed
STEP_IN_BACKWARD, STEP_IN_BACKWARD_TECHNIQUE = "_step_in_backward", "AdamW stepped in the backward pass"


def _ok_rows(report: dict) -> dict[str, dict]:
    return {r["variant"]: r for r in report["results"]
            if r.get("part") == "train" and r.get("status") == "ok"}


def fp8_step_history() -> list[dict]:
    """The course's FP8 step (`ours_te_ops_fp8`) and HF's eager step in every committed run that
    timed both, oldest first: both medians from the same run, and their ratio."""
    history = []
    for run, report in bench.committed_train_runs():
        rows = _ok_rows(report)
        if "ours_te_ops_fp8" in rows and "hf_eager" in rows:
            ours, hf = rows["ours_te_ops_fp8"]["median_ms"], rows["hf_eager"]["median_ms"]
            history.append({"run": run, "date": report["environment"].get("date") or "",
                            "gpu": report["environment"]["gpu"], "ours_fp8_ms": ours,
                            "hf_eager_ms": hf, "speedup": hf / ours})
    return history


def gains_of_marker(marker: str, technique: str) -> list[dict]:
    """Every committed row whose variant is a base variant's name with `marker` added (e.g.
    `_step_in_backward` at its end; a candidate known only by its rows, its code gone), beside
    that base from the same run, oldest run first: the fields of `bench.candidate_gains`, with
    `technique` naming what the marker changed."""
    gains = []
    for run, report in bench.committed_train_runs():
        rows = _ok_rows(report)
        for name, row in rows.items():
            base = rows.get(name.replace(marker, "", 1))
            if marker not in name or base is None:
                continue
            gains.append({"variant": name, "base": base["variant"], "technique": technique,
                          "precision": bench.row_precision(base), "base_ms": base["median_ms"],
                          "ms": row["median_ms"], "speedup": base["median_ms"] / row["median_ms"],
                          "base_peak_gb": base["peak_memory_gb"], "peak_gb": row["peak_memory_gb"],
                          "run": run, "gpu": report["environment"]["gpu"]})
    return gains


def candidate_gains() -> list[dict]:
    """Every experiment the course did not adopt or adopted only in part, beside its base variant
    from the same run: the compiled loss and AdamW (`bench.committed_candidate_gains`) and AdamW
    stepped in the backward pass (committed rows only: its code left the package)."""
    return bench.committed_candidate_gains() + gains_of_marker(STEP_IN_BACKWARD,
                                                               STEP_IN_BACKWARD_TECHNIQUE)


def history_table() -> Table:
    """`fp8_step_history` as a table, one row per committed run."""
    return Table(["run", "GPU", "ours_te_ops_fp8 ms/step", "hf_eager ms/step",
                  "HF eager / ours, same run"],
                 [[f"{Path(h['run']).name} ({h['date'][:10]})", h["gpu"], f"{h['ours_fp8_ms']:.1f}",
                   f"{h['hf_eager_ms']:.1f}", f"{h['speedup']:.2f}x"] for h in fp8_step_history()],
                 title="the course's FP8 step against HF's eager step, run after run "
                       "(mixtral-2l, 2 × 4096 tokens; committed runs)")


def candidate_table() -> Table:
    """`candidate_gains` as a table: each experiment against its base variant of the same run."""
    return Table(["what changes", "base variant", "ms/step: base → candidate", "speedup",
                  "peak GiB: base → candidate", "run"],
                 [[g["technique"], g["base"], f"{g['base_ms']:.1f} → {g['ms']:.1f}",
                   f"{g['speedup']:.3f}x", f"{g['base_peak_gb']:.1f} → {g['peak_gb']:.1f}",
                   Path(g["run"]).name] for g in candidate_gains()],
                 title="optimizer and compilation experiments, each beside its base variant in "
                       "the same run (committed runs)")


def host_sync_rows() -> list[dict]:
    """Every committed training row that counted its host syncs (`host_syncs_per_step`), fastest
    first within each run, with its speed against HF's compiled step given the same optimizer
    (`bench.hf_twin`: with the compiled AdamW where the row compiles AdamW) of the same run,
    where that ran; `hf_pair` names it."""
    found = []
    for run, report in bench.committed_train_runs():
        rows = _ok_rows(report)
        for name, row in rows.items():
            if row.get("host_syncs_per_step") is None:
                continue
            twin = bench.hf_twin(name)
            hf = rows.get(twin)
            found.append({"run": run, "gpu": report["environment"]["gpu"], "variant": name,
                          "ms": row["median_ms"], "syncs": row["host_syncs_per_step"],
                          "hf_pair": twin,
                          "vs_hf_compiled": hf["median_ms"] / row["median_ms"] if hf else None})
    return sorted(found, key=lambda r: (r["run"], r["ms"]))


def host_sync_table() -> Table:
    """`host_sync_rows` as a table: each step's time, its host syncs, and its speed against the
    compiled HF step with the same optimizer, of the same run."""
    return Table(["variant", "ms/step", "host syncs per step",
                  "compiled HF, same AdamW / this, same run", "run"],
                 [[r["variant"], f"{r['ms']:.1f}", r["syncs"],
                   "-" if r["vs_hf_compiled"] is None else f"{r['vs_hf_compiled']:.2f}x",
                   f"{Path(r['run']).name} ({r['gpu']})"] for r in host_sync_rows()],
                 title="host syncs against time: the steps with none beside TE's "
                       "(mixtral-2l, 2 × 4096 tokens; committed runs; graphed steps also "
                       "clip gradients)")
