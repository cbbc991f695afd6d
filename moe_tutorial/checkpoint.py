"""Checkpoints of a training run: what `train.train` needs to continue exactly where it stopped.

A checkpoint is one file, `step_00000200.pt` in the run's directory, holding the model's and the
optimizer's state, the step, torch's random number generators, the history so far, and the
training settings and model configuration it was made with. The step is the whole state of the
learning-rate schedule (`train.learning_rate` is a function of it) and of the data stream
(`data.iterate_batches(start=step)` continues the same sequence of batches).

Written atomically: to a temporary file in the same directory, flushed to disk, then renamed
onto its final name (a rename within one file system is atomic), so a run killed at any moment
leaves the previous checkpoint or the new one, never half a file. The newest `keep` are kept.

    train(model, data.train, settings, checkpoint=Checkpointing("runs/small", every=50))
    train(model, data.train, settings, checkpoint=Checkpointing("runs/small", every=50),
          resume=True)   # after an interruption: same losses as an uninterrupted run
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

FORMAT = 1  # bumped when the file's layout changes; older files are refused by name
NAME = re.compile(r"step_(\d{8})\.pt")


class CheckpointError(ValueError):
    """A checkpoint a run cannot continue from: missing, unreadable, or made by another run."""


@dataclass(frozen=True)
class Checkpointing:
    """Where and how often `train.train` saves: every `every` steps and after the last one,
    keeping the newest `keep` files in `directory`. One process, one file per checkpoint;
    `dist_checkpoint.ShardedCheckpointing` is its counterpart for a (dp, ep) run, with the same
    two methods `train.train` calls."""

    directory: str | Path
    every: int = 100
    keep: int = 3

    def __post_init__(self):
        if self.every < 1 or self.keep < 1:
            raise ValueError(f"Checkpointing: every={self.every} and keep={self.keep} must be >= 1")

    def save(self, model, optimizer, step: int, history: list[dict], settings: dict,
             config: dict) -> None:
        save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
              "rng": rng_state(), "history": history, "settings": settings, "config": config},
             self.directory, step, self.keep)

    def resume(self, model, optimizer, settings: dict, config: dict) -> tuple[int, list[dict]]:
        """Load the newest checkpoint into the model and the optimizer; (its step, the history
        up to it). Refuses one made with other settings or another model."""
        state = load_latest(self.directory)
        check_same_run(state, "settings", state["settings"], settings)
        check_same_run(state, "model", state.get("config") or {}, config)
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(
                f"{state['path']} does not fit this model ({str(exc)[:300]}): was it saved with "
                f"another expert backend or precision? Resume with the same ones") from exc
        set_rng_state(state["rng"])
        return state["step"], state["history"]


def path_for(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}.pt"


def saved_steps(directory: str | Path, name: re.Pattern = NAME, *,
                folders: bool = False) -> list[int]:
    """The steps of the checkpoints in `directory`, oldest first: the entries whose whole name
    `name` matches (its group 1: the step), files or (`folders`) directories; anything else,
    temporary or partial, ignored. `dist_checkpoint` keeps its checkpoints as folders."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir()
                  if p.is_dir() == folders and (m := name.fullmatch(p.name)))


def save(state: dict, directory: str | Path, step: int, keep: int) -> Path:
    """Write `state` as the checkpoint of `step` atomically, then delete all but the newest `keep`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = path_for(directory, step)
    temporary = final.with_name(final.name + ".tmp")
    with open(temporary, "wb") as f:
        torch.save({"format": FORMAT, "step": step, **state}, f)
        f.flush()
        os.fsync(f.fileno())  # the bytes are on disk before the name points at them
    os.replace(temporary, final)
    for old in saved_steps(directory)[:-keep]:
        path_for(directory, old).unlink()
    return final


def load_latest(directory: str | Path) -> dict:
    """The newest checkpoint in `directory`, checked to be complete; a clear error otherwise
    (never an empty state that would silently restart the run)."""
    steps = saved_steps(directory)
    if not steps:
        raise CheckpointError(f"no checkpoint (step_*.pt) in {directory}: nothing to resume. "
                              f"Start the run without --resume (resume=False), or point "
                              f"--checkpoint-dir at the directory the run saved into")
    path = path_for(directory, steps[-1])
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a truncated or foreign file
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(exc).__name__}: "
                              f"{str(exc)[:200]}). Delete it to resume from the one before "
                              f"({'none left' if len(steps) == 1 else path_for(directory, steps[-2])})"
                              ) from exc
    missing = {"format", "step", "model", "optimizer", "rng", "history", "settings"} - set(state)
    if missing or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a checkpoint of this version of moe_tutorial "
                              f"(format {state.get('format')!r}, this version writes {FORMAT}; "
                              f"missing {sorted(missing)}): start a new run")
    state["path"] = path
    return state


def check_same_run(state: dict, what: str, saved: dict, now: dict) -> None:
    """Refuse to continue a run with different settings or model: name each differing field."""
    differing = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
    if differing:
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r}, now {now.get(k)!r}"
                           for k in differing)
        raise CheckpointError(f"{state['path']} was saved by a run with other {what} ({detail}). "
                              f"Resume with the checkpoint's {what}, or start a new run in "
                              f"another --checkpoint-dir")


def rng_state() -> dict:
    """torch's generators: the CPU one and, where CUDA is in use, every GPU's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
