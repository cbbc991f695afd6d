"""Distributed checkpoints: every rank saves its own shards, and a run resumes on another layout.

`checkpoint.py` saves a one-process run into one file. A (dp, ep) run cannot: no rank holds the
whole model (FSDP2 keeps a slice of every weight, expert parallelism a block of the experts),
and gathering it onto one rank would need the memory sharding saved. Here each rank writes only
what it holds, with PyTorch's distributed checkpoint (DCP, `torch.distributed.checkpoint`):

    save(model, optimizer, "runs/ep", step=200, layout=layout)   # every rank calls it
    step = load(model, optimizer, "runs/ep", layout)           # the newest complete checkpoint

DCP stores every tensor under a key, with the global shape and the offsets of the piece each rank
wrote; loading, each rank asks for the rows *it* holds now, and DCP reads them from whichever
pieces overlap them. So a checkpoint resumes on another layout — dp2 × ep1 → dp1 × ep2, or one
process — as long as the keys and the global shapes do not depend on the layout.

For the dense weights they do not: a parameter is a DTensor under FSDP2 (its global shape and
this rank's slice of it), or a full tensor when replicated, under its name (`model.norm.weight`).
The experts' parameters are another matter. A rank's `mlp.experts` module holds only its ep
shard — experts [ep_rank·E/ep, (ep_rank+1)·E/ep), its expert 0 is the model's expert
ep_rank·E/ep — and each backend stores them its own way: `naive` and `grouped_torch` as two
stacked tensors `gate_up_proj [E/ep, 2I, H]`, `down_proj [E/ep, H, I]`; the TE backends as one
weight per expert (`gate_up.weight0` …, `mlp.0.weight0` …), te_ops with `glu_interleave_size`
with its gate and up rows interleaved. Their names and shapes change with ep and the backend.

So the experts are saved under keys of their own, one per expert of the whole model in Hugging
Face's per-expert layout, whatever the layout or backend:

    model.layers.{i}.mlp.experts.{e}.gate_up_proj   [2I, H]   e = the global expert number
    model.layers.{i}.mlp.experts.{e}.down_proj      [H, I]

and each rank hands DCP, under those keys, views of its own storage (no copy: DCP writes from
them and loads into them in place):

* a stacked backend: expert `j` of its stack is the model's expert first + j, a whole [2I, H]
  matrix (row j of `gate_up_proj`). Under FSDP2 the stack is split over the dp group along the
  experts as `torch.chunk` splits (⌈n/dp⌉ per rank, the last ranks fewer or none: 4 experts
  over 3 ranks are 2, 2, 0), so a rank writes and reads the experts of its chunk only;
* a TE backend: weight `j` is expert first + j. Under FSDP2 each weight is a DTensor split by
  rows over the dp group (43, 43 and 42 of 128 rows over 3 ranks): it goes in as it is, and
  DCP takes its global shape and this rank's rows from it;
* te_ops with interleaved gate/up rows: a de-interleaved copy (and, loading, a copy back). Only
  for weights whole on a rank: FSDP2's rows of an interleaved weight are scattered over HF's.

Replicated weights (average_gradients' engine) and one process give whole tensors; a tensor
several ranks hold alike DCP writes once. AdamW's moments (`exp_avg`, `exp_avg_sq`) have their
parameter's shape and sharding and go under the same keys; its `step` count is a scalar, the
same for every expert of a stack; the parameter groups' hyperparameters are saved too. The
learning-rate schedule is a function of the step (`train.learning_rate`), so the step number is
the schedule's whole state.

Crash safety. A checkpoint is written into `step_00000200.partial/`; only when every rank has
written its part (DCP's save returns once rank 0 has gathered every rank's results and written
the index, `.metadata`) does rank 0 add `meta.json` (step, model config, the layout it was saved
on) and rename the folder to `step_00000200/` — a rename is atomic. A rank killed before that
leaves a `.partial` folder, which `latest` ignores: the previous checkpoint stays the newest.
`meta.json` also holds the sha256 of every file of the checkpoint: a checkpoint is verified
before it is loaded, and a damaged one (a truncated or altered shard) is reported as damaged,
naming the file and the newest intact checkpoint. Pruning (`keep`) deletes only checkpoints
older than the one just written.

Nothing in a checkpoint's folder runs code or leads outside it when loaded: DCP's index is
unpickled only into its own classes, and the files `meta.json` names are plain files of the
folder (`dist_checkpoint_reader`).

`save(..., async_save=True)` returns as soon as the tensors are copied and writes them in a
background thread (DCP's `async_save`, its collectives on a gloo group of their own).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import shutil
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from .. import safe_io
from ..moe.experts import StackedExperts, TEExperts, deinterleave_glu, interleave_glu
from ..moe.model import is_expert_parameter
from ..train.checkpoint import (
    CheckpointError,
    check_arguments,
    check_directory,
    check_same_run,
    one_line,
    saved_steps,
)
from .dist_checkpoint_reader import (
    META,
    HostileCheckpoint,
    IndexedReader,
    WeightsOnlyPlanner,
    damage,
    read_index,
    read_meta,
)
from .distributed import Layout, check_layout

FORMAT = 1  # bumped when the keys or meta.json change; other formats are refused by name
NAME = re.compile(r"step_(\d{8})")
PARTIAL = ".partial"


def path_for(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}"


def complete_steps(directory: str | Path) -> list[int]:
    """The steps of the complete checkpoints in `directory` (folders; a `.partial` one is not
    complete), oldest first."""
    return saved_steps(directory, NAME, folders=True)


def latest(directory: str | Path) -> Path:
    """The newest complete checkpoint in `directory`; a clear error when there is none (the
    incomplete ones, `.partial` folders of saves that did not finish, are named)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} does not exist: no distributed checkpoint to resume "
                              f"from. Start the run without resuming, or point at the directory "
                              f"the run saved into")
    steps = complete_steps(directory)
    if not steps:
        partial = sorted(p.name for p in directory.glob(f"step_*{PARTIAL}"))
        detail = (f"; {', '.join(partial)} {'is' if len(partial) == 1 else 'are'} incomplete (a "
                  f"run stopped while saving: not every rank finished) and ignored"
                  if partial else "")
        raise CheckpointError(f"no complete checkpoint (step_*/) in {directory}{detail}. Start "
                              f"the run without resuming")
    return path_for(directory, steps[-1])


# ---------------------------------------------------------------------------------------------
# The keys: where each checkpoint entry lives in this rank's parameters

@dataclass(frozen=True)
class _Entry:
    """One checkpoint key and where its tensor lives in `parameter`: `view(t)` takes a tensor
    laid out like the parameter (the parameter itself, or an AdamW moment) and returns the
    entry's tensor in the backend's own row order. `glu_block`: that order interleaves gate and
    up rows in blocks of this many (te_ops' `glu_interleave_size`); the key holds HF's order."""

    key: str
    parameter: nn.Parameter
    view: Callable[[torch.Tensor], torch.Tensor]
    glu_block: int | None = None


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's rows of `tensor`, the index of the first one in the whole tensor). A plain
    tensor is whole. FSDP2 shards dim 0 over a 1-D mesh as `torch.chunk` does: ⌈n/size⌉ rows
    per rank in rank order, the last ranks fewer or none (DTensor's `Shard(0)`)."""
    if not isinstance(tensor, DTensor):
        return tensor, 0
    mesh = tensor.device_mesh
    if mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),):
        raise ValueError(f"an expert parameter sharded as {tensor.placements} over a "
                         f"{mesh.ndim}-D mesh: dist_checkpoint reads FSDP2's Shard(0) over one "
                         f"dp group (distributed.fully_shard_layout)")
    rows, size = tensor.shape[0], mesh.size()
    per_rank = -(-rows // size)
    first = min(mesh.get_local_rank() * per_rank, rows)
    local = tensor.to_local()
    if local.shape[0] != min(per_rank, rows - first):
        raise RuntimeError(f"this rank holds {local.shape[0]} of {rows} rows, not the "
                           f"{min(per_rank, rows - first)} of torch.chunk's split over {size}")
    return local, first


def _expert_entries(prefix: str, experts: nn.Module, first_expert: int) -> list[_Entry]:
    """The entries of one layer's experts module (this rank's ep shard, global experts
    `first_expert` …), one per (expert, projection) this rank holds any rows of."""
    if isinstance(experts, StackedExperts):
        entries = []
        for name in ("gate_up_proj", "down_proj"):
            parameter = getattr(experts, name)
            local, first = _local_rows(parameter)
            entries += [_Entry(f"{prefix}.{first_expert + first + j}.{name}", parameter,
                               lambda t, j=j: _local_rows(t)[0][j])
                        for j in range(local.shape[0])]
        return entries
    if isinstance(experts, TEExperts):
        fc1, fc2 = experts._linears()  # the gate-up and down GroupedLinear, whatever the backend
        block = getattr(experts, "glu_interleave_size", None)
        entries = []
        for j in range(experts.num_experts):
            entries.append(_Entry(f"{prefix}.{first_expert + j}.gate_up_proj",
                                  getattr(fc1, f"weight{j}"), _whole, block))
            entries.append(_Entry(f"{prefix}.{first_expert + j}.down_proj",
                                  getattr(fc2, f"weight{j}"), _whole))
        return entries
    raise ValueError(f"dist_checkpoint does not know the expert module {type(experts).__name__}: "
                     f"use one of the course's backends (experts.EXPERT_BACKENDS)")


def _entries(model: nn.Module, layout: Layout | None) -> list[_Entry]:
    """Every checkpoint entry of this rank: the dense parameters under their names, the
    experts under the per-expert keys of the module docstring."""
    config = model.config
    ep, ep_rank = (layout.ep, layout.ep_rank) if layout is not None else (1, 0)
    per_rank = config.num_experts // ep
    entries = [_Entry(name, p, _whole) for name, p in model.named_parameters()
               if not is_expert_parameter(name)]
    for i, layer in enumerate(model.model.layers):
        experts = layer.mlp.experts
        if experts.num_experts != per_rank:
            raise ValueError(f"layer {i} holds {experts.num_experts} experts, but with ep={ep} "
                             f"every rank holds {per_rank} of the {config.num_experts}: pass the "
                             f"layout the model was sharded for (distributed.shard_experts)")
        entries += _expert_entries(f"model.layers.{i}.mlp.experts", experts, ep_rank * per_rank)
    # Every parameter this rank holds rows of has a key (an expert stack's FSDP2 chunk may be
    # empty: 4 experts over 3 dp ranks leave the third none)
    covered = {id(entry.parameter) for entry in entries}
    missed = [name for name, p in model.named_parameters()
              if id(p) not in covered and _local_rows(p)[0].numel()]
    if missed:
        raise ValueError(f"parameters without a checkpoint key: {missed[:4]}")
    return entries


def _hf_rows(entry: _Entry, tensor: torch.Tensor,
             write_backs: list[Callable[[], None]] | None) -> torch.Tensor:
    """The tensor DCP reads or writes for `entry`, given a tensor laid out like its parameter:
    a view of it, or for interleaved gate/up rows a de-interleaved copy. `write_backs`: when
    loading, where the copy-back into the interleaved storage goes."""
    rows = entry.view(tensor)
    if entry.glu_block is None:
        return rows
    if isinstance(rows, DTensor):
        if rows.device_mesh.size() > 1:
            raise ValueError(f"{entry.key}: te_ops with glu_interleave_size={entry.glu_block} "
                             f"and its weights split by rows over dp={rows.device_mesh.size()} "
                             f"ranks: the rows a rank holds are not a block of HF's rows. Save "
                             f"with glu_interleave_size=None (same weights, another order)")
        rows = rows.to_local()
    staged = deinterleave_glu(rows, entry.glu_block)
    if write_backs is not None:
        write_backs.append(lambda: rows.copy_(interleave_glu(staged, entry.glu_block)))
    return staged


def _check_optimizer(entries: list[_Entry], optimizer: torch.optim.Optimizer) -> None:
    """An optimizer made before the model's parameters were replaced would save (or load) the
    state of parameters the model no longer has, and nothing for its own."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    stale = sorted({entry.key for entry in entries if id(entry.parameter) not in held})
    if stale:
        raise ValueError(f"the optimizer does not hold the parameters of {stale[:3]}: make it "
                         f"after set_expert_backend, shard_experts and fully_shard_layout, which "
                         f"replace the parameters")


@torch.no_grad()
def _state_dict(entries: list[_Entry], optimizer: torch.optim.Optimizer,
                write_backs: list[Callable[[], None]] | None = None) -> dict:
    """What DCP saves or loads into: {"model": key → tensor, "optimizer": {"state": key →
    {moment → tensor, "step": scalar}, "param_groups": the groups' hyperparameters}}."""
    model, state = {}, {}
    for entry in entries:
        model[entry.key] = _hf_rows(entry, entry.parameter, write_backs)
        state[entry.key] = {
            name: _hf_rows(entry, value, write_backs)
            if isinstance(value, torch.Tensor) and value.shape == entry.parameter.shape else value
            for name, value in optimizer.state.get(entry.parameter, {}).items()}
    groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}}


# ---------------------------------------------------------------------------------------------
# Save

@dataclass
class _Background:
    """This process's background saves. `group`: a gloo group of their own, made by the first
    one (a collective: every rank makes it in the same call), since their collectives run in a
    thread beside the training's and would interleave with them on one group. `pending`: the
    one in flight; the next save waits for it, so that two never run at once."""

    group: dist.ProcessGroup | None = None
    pending: Future | None = None


_background = _Background()


def _check_world(model: nn.Module, layout: Layout | None) -> None:
    """The layout fits the process group and the model (ep divides the experts)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if layout is None and world > 1:
        raise ValueError(f"{world} ranks and no layout: pass the (dp, ep) layout the model was "
                         f"sharded for (distributed.init_layout)")
    dp, ep = (layout.dp, layout.ep) if layout is not None else (1, 1)
    check_layout(world, dp, ep, model.config.num_experts)


def _is_coordinator() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path, *,
         step: int, layout: Layout | None = None, async_save: bool = False,
         keep: int | None = None, run: dict | None = None) -> Path | Future:
    """Save the model's and the optimizer's state as the checkpoint of `step` in
    `directory/step_{step:08d}/`; every rank calls it and writes only its own shards. `layout`:
    the (dp, ep) layout of the run (None: one process holding the whole model). `keep`: then
    delete all but the newest `keep` complete checkpoints, and the `.partial` folders of saves
    that did not finish. `run`: JSON-able facts of the run kept in `meta.json` beside the
    tensors (`ShardedCheckpointing` keeps the training settings and the history there).

    Returns the checkpoint's path once it is complete on every rank. `async_save=True` returns
    at once, when the tensors are copied (training may go on changing them), with a Future of
    that path; it completes on rank 0 once the checkpoint is complete, on the other ranks once
    their part is written. The next save waits for it; call its `result()` before the process
    ends (the write runs in a background thread)."""
    _check_world(model, layout)
    if _background.pending is not None:
        _background.pending.result()  # raises what that save raised
        _background.pending = None
    final = path_for(directory, step)
    partial = final.with_name(final.name + PARTIAL)
    if final.exists():  # every rank sees it (DCP's file system is shared), so all raise
        raise CheckpointError(f"{final} already holds a complete checkpoint of step {step}: "
                              f"save into another directory, or delete it first")
    if _is_coordinator() and partial.exists():
        shutil.rmtree(partial)  # a save of this step that did not finish, before a restart
    _barrier()
    entries = _entries(model, layout)
    _check_optimizer(entries, optimizer)
    state = _state_dict(entries, optimizer)
    dp, ep = (layout.dp, layout.ep) if layout is not None else (1, 1)
    meta = {"format": FORMAT, "step": step, "config": asdict(model.config),
            "optimizer_state": bool(optimizer.state),  # False before the optimizer's first step
            "saved_on": {"dp": dp, "ep": ep, "expert_backend": model.expert_backend},
            "torch": torch.__version__, "run": run or {}}

    def complete() -> Path:
        if _is_coordinator():
            _commit(partial, final, meta, keep)
        return final

    if not async_save:
        try:
            dcp.save(state, checkpoint_id=partial)
            complete()
        except (dcp.CheckpointException, OSError) as exc:  # DCP's is a BaseException
            raise _save_failed(final, exc) from None
        _barrier()  # no rank returns before the checkpoint is complete
        return final
    if _background.group is None and dist.is_initialized():
        _background.group = dist.new_group(backend="gloo")
    written = dcp.async_save(state, checkpoint_id=partial, process_group=_background.group)
    done: Future = Future()

    def finish(future: Future) -> None:
        try:
            future.result()
            done.set_result(complete())
        except (dcp.CheckpointException, OSError) as exc:  # the caller's result() raises it
            done.set_exception(_save_failed(final, exc))
        except Exception as exc:
            done.set_exception(exc)

    written.add_done_callback(finish)
    _background.pending = done
    return done


def _causes(exc: BaseException) -> str:
    """What went wrong, on one line: each rank's error for DCP's `CheckpointException`."""
    if isinstance(exc, dcp.CheckpointException):
        return "; ".join(f"rank {rank}: {type(error).__name__}: {one_line(error, 160)}"
                         for rank, (error, _) in exc.failures.items())[:400]
    return one_line(exc, 300)


def _save_failed(final: Path, exc: BaseException) -> CheckpointError:
    return CheckpointError(f"{final} could not be saved ({_causes(exc)}); the checkpoints before "
                           f"it are intact (a save that did not finish is ignored): free some "
                           f"space, or fix what is named, and resume")


def _commit(partial: Path, final: Path, meta: dict, keep: int | None) -> None:
    """Rank 0, once every rank's part is written: meta.json, then the atomic rename that makes
    the checkpoint complete; then the pruning that `keep` asks for."""
    files = {p.name: safe_io.sha256_of(p) for p in sorted(partial.iterdir()) if p.is_file()}
    # on disk before the name says the checkpoint is complete
    safe_io.write_json(partial / META, {**meta, "files": files}, replace=True)
    os.replace(partial, final)
    directory = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself on disk
    finally:
        os.close(directory)
    if keep is not None:  # never a newer checkpoint than this one: not this run's
        step = int(NAME.fullmatch(final.name).group(1))
        old = [path_for(final.parent, s) for s in complete_steps(final.parent) if s <= step]
        for folder in old[:-keep] + list(final.parent.glob(f"step_*{PARTIAL}")):
            if not folder.is_symlink():  # a link is someone's, not a checkpoint this run made
                shutil.rmtree(folder)


# ---------------------------------------------------------------------------------------------
# Load

_META_TYPES = {"step": int, "config": dict, "optimizer_state": bool, "run": dict}


def _read_meta(path: Path, needs: tuple[str, ...] = ("run",)) -> dict:
    """`path`'s meta.json, of this format, holding `needs` (keys of `_META_TYPES`) each of its
    type; `CheckpointError` in one line otherwise."""
    meta = read_meta(path)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} was written in format {meta.get('format')!r} and this "
                              f"version of moe_tutorial reads format {FORMAT}: start a new run")
    wrong = sorted(k for k in needs if not isinstance(meta.get(k), _META_TYPES[k]))
    if wrong:
        raise CheckpointError(f"{path}/{META} lacks {wrong} (or holds another type there): it "
                              f"is not a checkpoint this version of moe_tutorial wrote; move "
                              f"{path.name} away, or start a new run")
    return meta


def verified_latest(directory: str | Path) -> Path:
    """`latest`, verified (`damage`): a damaged checkpoint is a `CheckpointError` naming the
    damaged file and the newest intact checkpoint before it."""
    path = latest(directory)
    problem = damage(path)
    if problem is None:
        return path
    good = next((path_for(directory, s) for s in reversed(complete_steps(directory)[:-1])
                 if damage(path_for(directory, s)) is None), None)
    advice = (f"the newest intact one is {good}: move {path.name} away to resume from it"
              if good is not None else "no intact checkpoint is left: start a new run")
    raise CheckpointError(f"{path} is damaged ({problem}); {advice}")


@torch.no_grad()
def _create_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state, for the checkpoint's to be loaded into (DCP
    loads into existing tensors, and a fresh optimizer has none until its first step): one step
    with zero gradients at learning rate 0, which changes no weight."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(p in optimizer.state for p in params):
        return
    grads = [p.grad for p in params]
    rates = [group["lr"] for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    for p, grad in zip(params, grads):
        p.grad = grad


@torch.no_grad()
def load(model: nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path,
         layout: Layout | None = None) -> int:
    """Load the newest complete checkpoint in `directory` into the model and the optimizer, in
    place, whatever (dp, ep) layout and expert backend saved it; returns its step. Every rank
    calls it, with the model sharded as the run shards it (`shard_experts`, and
    `fully_shard_layout` when the run uses FSDP2) and the optimizer made for it. `layout`: None
    for one process holding the whole model.

    The optimizer's parameter groups keep their members (which parameters decay is decided by
    the model, not the checkpoint); their hyperparameters (lr, betas, weight decay, ...) are the
    checkpoint's. `checkpoint.CheckpointError` when there is no complete checkpoint, or it was
    saved by another model configuration (each differing field named)."""
    _check_world(model, layout)
    path = verified_latest(directory)
    meta = _read_meta(path, needs=tuple(_META_TYPES))
    check_same_run({"path": path}, "model", meta["config"], asdict(model.config))
    entries = _entries(model, layout)
    _check_optimizer(entries, optimizer)
    if meta["optimizer_state"]:
        _create_optimizer_state(optimizer)
    else:  # saved before the first step: the run goes on with an optimizer as fresh as it had
        optimizer.state.clear()
    write_backs: list[Callable[[], None]] = []
    state = _state_dict(entries, optimizer, write_backs)
    # every rank reads and checks the index itself before DCP uses it (read_index)
    reader = IndexedReader(path, read_index(path, meta))
    try:
        dcp.load(state, storage_reader=reader, planner=WeightsOnlyPlanner())
    except (dcp.CheckpointException, OSError) as exc:  # DCP's gathers every rank's errors
        failures = exc.failures.values() if isinstance(exc, dcp.CheckpointException) else []
        if any(isinstance(error, pickle.UnpicklingError) for error, _ in failures):
            raise HostileCheckpoint(f"{path} holds objects other than tensors and plain values, "
                                    f"as no checkpoint of the course does, and was not loaded "
                                    f"(nothing in it ran): move {path.name} away") from None
        raise CheckpointError(f"{path} does not fit this model and optimizer ({_causes(exc)})"
                              ) from None
    for write_back in write_backs:
        write_back()
    saved_groups = state["optimizer"]["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(f"{path} holds {len(saved_groups)} optimizer parameter groups, "
                              f"this optimizer has {len(optimizer.param_groups)}: make it as the "
                              f"run did (train.make_optimizer)")
    odd = next(((k, v) for group, saved in zip(optimizer.param_groups, saved_groups)
                for k, v in saved.items() if type(v) is not type(group.get(k))), None)
    if odd is not None:
        raise CheckpointError(f"{path} holds {odd[0]}={odd[1]!r} for the optimizer, not a value "
                              f"of the type AdamW takes: it is not a checkpoint the course "
                              f"wrote; move {path.name} away")
    for group, saved in zip(optimizer.param_groups, saved_groups):
        group.update(saved)
    return meta["step"]


@dataclass(frozen=True)
class ShardedCheckpointing:
    """`checkpoint.Checkpointing` for a (dp, ep) run, the same two methods `train.train` calls:
    every `every` steps and after the last one every rank saves its shards into `directory`
    (the newest `keep` complete checkpoints kept), and a resumed run loads them on whatever
    layout it has now. The training settings and the history travel in `meta.json`."""

    directory: str | Path
    layout: Layout | None
    every: int = 100
    keep: int = 3

    def __post_init__(self):
        check_arguments("ShardedCheckpointing", self.directory, self.every, self.keep)

    @contextlib.contextmanager
    def hold(self, resume: bool):
        """`checkpoint.Checkpointing.hold` for every rank: each refuses alike a directory a new
        run must not write into; rank 0 holds it for the run (`safe_io.hold_folder`)."""
        check_directory(self.directory, resume, steps=complete_steps)
        if not _is_coordinator():
            yield
            return
        with safe_io.hold_folder(self.directory, "distributed training run"):
            yield

    def save(self, model, optimizer, step: int, history: list[dict], settings: dict,
             config: dict) -> None:
        save(model, optimizer, self.directory, step=step, layout=self.layout, keep=self.keep,
             run={"settings": settings, "history": history})

    def resume(self, model, optimizer, settings: dict, config: dict) -> tuple[int, list[dict]]:
        """Load the newest complete checkpoint; (its step, the history up to it). Refuses one
        made with other settings (the model's configuration `load` checks)."""
        path = latest(self.directory)  # `load` verifies it
        run = _read_meta(path)["run"]
        if not (isinstance(run.get("settings", {}), dict)
                and isinstance(run.get("history", []), list)):
            raise CheckpointError(f"{path}/{META}'s run holds no settings and history of the "
                                  f"kind the course writes: move {path.name} away")
        check_same_run({"path": path}, "settings", run.get("settings", {}), settings)
        step = load(model, optimizer, self.directory, self.layout)
        return step, run.get("history", [])

