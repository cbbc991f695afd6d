"""Checkpoints of a training run: what `train.train` needs to continue exactly where it stopped.

A checkpoint is one file, `step_00000200.pt` in the run's directory, holding the model's and the
optimizer's state, the step, torch's random number generators, the history so far, and the
training settings and model configuration it was made with. The step is the whole state of the
learning-rate schedule (`train.learning_rate` is a function of it) and of the data stream
(`data.iterate_batches(start=step)` continues the same sequence of batches).

Written atomically (`safe_io.atomic_file`): to a temporary file of a unique name in the same
directory, flushed to disk, then renamed onto its final name (a rename within one file system is
atomic), so a run killed at any moment, or a full disk, leaves the previous checkpoint or the
new one, never half a file. Beside each, `step_00000200.pt.sha256` holds its checksum: a
checkpoint is verified when read, and a damaged one is reported as damaged, naming the newest
good one. The newest `keep` of the run's checkpoints up to the one just written are kept.

Nothing on disk runs code: a checkpoint is read only as a plain file (never through a link, never
a device or a pipe that would be read forever) and unpickled only by torch's `weights_only`
loader, which builds tensors and plain values and refuses any other object by name. Whoever can
write the folder can rewrite the checksums too, so they guard against damage, not this.

One folder, one run: a run holds its directory while it trains (`Checkpointing.hold`), so a
second run into it is refused, naming the first; a new run (not resumed) is refused a directory
that holds another run's checkpoints, which it would overwrite and prune.

    train(model, data.train, settings, checkpoint=Checkpointing("runs/small", every=50))
    train(model, data.train, settings, checkpoint=Checkpointing("runs/small", every=50),
          resume=True)   # after an interruption: same losses as an uninterrupted run
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import safe_io
from ..arguments import check_count

FORMAT = 1  # bumped when the file's layout changes; older files are refused by name
NAME = re.compile(r"step_(\d{8})\.pt")
SHARDED_NAME = re.compile(r"step_(\d{8})(?:\.partial)?")  # dist_checkpoint's folders
CHECKSUM = ".sha256"  # suffix of the file beside a checkpoint that holds its sha256


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
        check_arguments("Checkpointing", self.directory, self.every, self.keep)

    @contextlib.contextmanager
    def hold(self, resume: bool):
        """Hold the directory for this run while the block runs (`safe_io.hold_folder`); refuse,
        before any training, a directory a new run must not write into (`check_directory`)."""
        check_directory(self.directory, resume)
        with safe_io.hold_folder(self.directory, "training run"):
            if not resume:  # checked again now that no other run can write there
                check_directory(self.directory, resume)
            yield

    def save(self, model, optimizer, step: int, history: list[dict], settings: dict,
             config: dict) -> None:
        save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
              "rng": rng_state(), "history": history, "settings": settings, "config": config,
              "expert_backend": getattr(model, "expert_backend", None)},
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
            saved, now = state.get("expert_backend"), getattr(model, "expert_backend", None)
            advice = (f"it was saved with --backend {saved} and this run uses {now}: resume "
                      f"with --backend {saved}" if saved is not None and saved != now else
                      "was it saved with another expert backend or precision? Resume with the "
                      "same ones")
            raise CheckpointError(f"{state['path']} does not fit this model "
                                  f"({one_line(exc, 240)}); {advice}") from exc
        set_rng_state(state["rng"])
        return state["step"], state["history"]


def check_arguments(what: str, directory, every, keep) -> None:
    """The checks of `Checkpointing`'s and `ShardedCheckpointing`'s arguments, as the command
    line's --checkpoint-dir, --checkpoint-every and --keep-checkpoints get them."""
    if not isinstance(directory, (str, os.PathLike)) or not str(directory):
        raise ValueError(f"{what}: directory={directory!r} must be a folder's path, e.g. "
                         f"'runs/small'")
    check_count(f"{what}.every", every)
    check_count(f"{what}.keep", keep)


def one_line(exc: BaseException, limit: int) -> str:
    """An exception's message on one line, at most `limit` characters: torch's own span
    several (load_state_dict lists each missing key on a line of its own)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit - 1] + "…"


def path_for(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}.pt"


def check_directory(directory: str | Path, resume: bool, *, flag: str = "--checkpoint-dir",
                    steps=None) -> None:
    """Refuse, before a run starts, a checkpoint directory it cannot or must not write into: a
    link to nowhere, a file, a folder without write permission, one holding the other kind's
    checkpoints (`steps` given: dist_checkpoint's folders, whose run refuses `.pt` files; else
    this module's files, whose run refuses checkpoint folders), or (a new run, not `resume`)
    one that holds another run's checkpoints, which the run would overwrite and prune."""
    directory = Path(directory)
    if directory.is_symlink() and not directory.exists():
        raise CheckpointError(f"{flag} {directory} is a link to {directory.readlink()}, which "
                              f"does not exist; create that folder, or choose another directory")
    if directory.exists() and not directory.is_dir():
        raise CheckpointError(f"{flag} {directory} is a file, not a directory; choose another "
                              f"path")
    existing = next(p for p in (directory.absolute(), *directory.absolute().parents)
                    if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(f"{flag} {directory}: no permission to write in {existing}; "
                              f"choose another directory")
    sharded = steps is not None  # dist_checkpoint passes its own: checkpoint folders
    other = saved_steps(directory, NAME if sharded else SHARDED_NAME, folders=not sharded)
    if other:
        kind, command = (("one-process checkpoints (step_*.pt files)", "`train`") if sharded else
                         ("distributed checkpoints (step_* folders)", "`train_dist`"))
        raise CheckpointError(f"{flag} {directory} holds the {kind} of a {command} run (steps "
                              f"{other}), which this run cannot continue or mix with its own; "
                              f"choose another directory")
    steps = (steps or saved_steps)(directory)
    if steps and not resume:
        raise CheckpointError(f"{flag} {directory} already holds the checkpoints of a run "
                              f"(steps {steps}); resume it (--resume, resume=True), or choose "
                              f"another directory for a new run")


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


def checksum_path(path: Path) -> Path:
    return path.with_name(path.name + CHECKSUM)


def save(state: dict, directory: str | Path, step: int, keep: int) -> Path:
    """Write `state` as the checkpoint of `step` atomically, its checksum beside it, then delete
    all but the newest `keep` of the checkpoints up to `step` (never a newer one, which is not
    this run's)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = path_for(directory, step)
    try:
        with safe_io.atomic_file(final, replace=True) as f:
            writer = safe_io.HashingWriter(f)
            torch.save({"format": FORMAT, "step": step, **state}, writer)
            # The checksum first: a checkpoint never has a name without its checksum
            safe_io.write_text(checksum_path(final), writer.digest.hexdigest() + "\n",
                               replace=True)
    except RuntimeError as exc:  # torch.save's own error when the disk fills
        raise safe_io.WriteFailed(None, f"{final} could not be written ({str(exc)[:200]}); "
                                        f"nothing was changed (the previous checkpoints are "
                                        f"intact): free some space and resume") from None
    older = [s for s in saved_steps(directory) if s <= step]
    for old in older[:-keep]:
        path_for(directory, old).unlink()
        checksum_path(path_for(directory, old)).unlink(missing_ok=True)
    return final


CHECKSUM_LIMIT = 1024  # a checksum file holds 64 hex digits and a newline


def _expected_checksum(path: Path) -> str:
    """The sha256 saved beside the checkpoint `path`; `_Damaged` when it cannot be read."""
    try:
        with safe_io.open_regular(checksum_path(path), limit=CHECKSUM_LIMIT) as (f, _):
            return f.read(CHECKSUM_LIMIT).decode("ascii", "replace").strip()
    except FileNotFoundError:
        raise _Damaged(f"its checksum file {checksum_path(path).name} is missing") from None
    except (OSError, safe_io.UnsafeRead) as exc:
        raise _Damaged(f"its checksum file cannot be read ({_reason(exc)})") from None


class _Damaged(Exception):
    """Why a checkpoint cannot be trusted, in words (`verify`, `_read`)."""


def _reason(exc: Exception) -> str:
    return str(exc) if isinstance(exc, safe_io.UnsafeRead) else (exc.strerror or str(exc))


def _read(path: Path, *, load: bool):
    """The checkpoint `path`, verified against its checksum, then (`load`) read by torch from
    the very bytes verified: a plain file opened once, never through a link, and unpickled
    only by torch's `weights_only` loader (tensors and plain containers: a hostile file cannot
    run code). `_Damaged` saying what is wrong."""
    expected = _expected_checksum(path)
    try:
        with safe_io.open_regular(path) as (f, size):
            if safe_io.sha256_of_open(f, size) != expected:
                raise _Damaged("its contents do not match the checksum saved with it")
            if not load:
                return None
            f.seek(0)
            try:
                return torch.load(f, map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as exc:  # weights_only refused an object: not ours
                refused = next((line.strip() for line in str(exc).splitlines()
                                if "GLOBAL" in line), one_line(exc, 120))
                raise _Damaged(f"it holds objects other than tensors and plain values, as no "
                               f"checkpoint of the course does, and was not loaded ({refused})"
                               ) from None
            except Exception as exc:  # torch raises several types for a truncated or foreign file
                raise _Damaged(f"torch cannot read it safely ({type(exc).__name__}: "
                               f"{one_line(exc, 200)})") from None
    except (OSError, safe_io.UnsafeRead) as exc:
        raise _Damaged(f"it cannot be read ({_reason(exc)})") from None


def verify(path: Path) -> str | None:
    """None if `path` matches the checksum saved beside it; else what is wrong, in words."""
    try:
        _read(path, load=False)
    except _Damaged as exc:
        return str(exc)
    return None


def load_latest(directory: str | Path) -> dict:
    """The newest checkpoint in `directory`, verified against its checksum and checked to be
    complete; a clear error otherwise (never an empty state that would silently restart the
    run): a damaged one is named, and so is the newest checkpoint before it that is intact."""
    steps = saved_steps(directory)
    if not steps:
        raise CheckpointError(f"no checkpoint (step_*.pt) in {directory}: nothing to resume. "
                              f"Start the run without --resume (resume=False), or point "
                              f"--checkpoint-dir at the directory the run saved into")
    path = path_for(directory, steps[-1])
    try:
        state = _read(path, load=True)
    except _Damaged as exc:
        good = next((path_for(directory, s) for s in reversed(steps[:-1])
                     if verify(path_for(directory, s)) is None), None)
        advice = (f"the newest intact one is {good}: move {path.name} away to resume from it"
                  if good is not None else "no intact checkpoint is left: start a new run")
        raise CheckpointError(f"{path} is damaged ({exc}); {advice}") from None
    if not isinstance(state, dict):  # a file of the right name that holds something else
        raise CheckpointError(f"{path} is not a checkpoint (it holds a {type(state).__name__}, "
                              f"not a training state): move it out of {directory}, or start a "
                              f"new run")
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
                              f"another directory")


def rng_state() -> dict:
    """torch's generators: the CPU one and, where CUDA is in use, every GPU's."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])
