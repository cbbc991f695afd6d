"""Reading a distributed checkpoint without trusting it: nothing in its folder can run code, and
nothing outside its folder is read.

Whoever can write a checkpoint's folder can rewrite its checksums too (`meta.json`), so they
guard against damage, not against a hostile file. What DCP itself would trust:

* `.metadata`, the index of every tensor, which torch's `FileSystemReader.read_metadata`
  reads with plain `pickle.load` (torch/distributed/checkpoint/filesystem.py): any object, any
  code. Here it is unpickled by `_MetadataUnpickler`, which builds only the classes a DCP index
  is made of (torch.distributed.checkpoint.metadata's dataclasses, `_StorageInfo`,
  `torch.Size`, dtypes and layouts, `pathlib.PosixPath`) and refuses any other global by name,
  before it is called. The index is then checked: every entry points into a shard file that
  `meta.json` lists, inside the byte range of that file, with no storage transform.
* non-tensor entries (the optimizer's hyperparameters), which DCP's `DefaultLoadPlanner`
  loads with `torch.load(weights_only=False)` (default_planner.py, `load_bytes`): here with
  `weights_only=True` (`_WeightsOnlyPlanner`). Its tensors DCP already loads so.

And every file `meta.json` names is a plain name inside the checkpoint's folder, a plain file
(never a link, a device such as /dev/zero or a pipe), read up to the size it had when opened.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path, PosixPath, PurePosixPath

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .. import safe_io
from ..train.checkpoint import CheckpointError, one_line

META = "meta.json"
INDEX = ".metadata"  # DCP's index of the tensors (torch.distributed.checkpoint.filesystem)
META_LIMIT = 256 << 20  # meta.json: the config, the checksums, the settings and the history
INDEX_LIMIT = 1 << 30  # .metadata: a few hundred bytes per tensor and shard of the model


class HostileCheckpoint(CheckpointError):
    """A checkpoint whose files hold what the course never writes there (objects other than
    DCP's index, names outside the folder): refused before it is used."""


def _allowed_globals() -> dict[tuple[str, str], object]:
    allowed = {("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
               for name in (*dcp_metadata.__all__, "_MEM_FORMAT_ENCODING")
               if isinstance(getattr(dcp_metadata, name, None), type)}
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("pathlib", "PosixPath")] = PosixPath  # StorageMeta.checkpoint_id
    allowed[("pathlib", "PurePosixPath")] = PurePosixPath
    allowed.update({("torch", name): value for name, value in vars(torch).items()
                    if isinstance(value, torch.dtype)})
    return allowed


class _RefusedGlobal(pickle.UnpicklingError):
    """A global a DCP index never holds, named `module.name`."""


class _MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that finds only the globals of a DCP index (`_allowed_globals`)."""

    allowed = _allowed_globals()

    def find_class(self, module: str, name: str):
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise _RefusedGlobal(f"{module}.{name}") from None


def read_meta(path: Path) -> dict:
    """`path`'s meta.json, a JSON object (never through a link, bounded); `CheckpointError`
    naming what is wrong."""
    try:
        with safe_io.open_regular(path / META, limit=META_LIMIT, what=f"{path / META}") as (f, n):
            meta = json.loads(f.read(n).decode("utf-8"))
    except (OSError, ValueError) as exc:  # UnsafeRead, UnicodeDecodeError, JSON: ValueErrors
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else one_line(exc, 200)
        raise CheckpointError(f"{path} is not a complete distributed checkpoint (its {META} "
                              f"cannot be read: {reason}). Move it away to resume from the one "
                              f"before") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}/{META} holds a {type(meta).__name__}, not the object the "
                              f"course writes: move {path.name} away to resume from the one "
                              f"before")
    return meta


def listed_files(path: Path, meta: dict) -> dict[str, str]:
    """meta.json's {file name: sha256}, each a plain name inside `path` (no folder, no `..`),
    `.metadata` among them; `HostileCheckpoint` otherwise."""
    files = meta.get("files")
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                              for k, v in files.items()):
        raise HostileCheckpoint(f"{path}/{META} holds no checksums of its files; move "
                                f"{path.name} away to resume from the one before")
    outside = [name for name in files if name in ("", ".", "..") or "/" in name
               or "\\" in name or "\0" in name]
    if outside:
        raise HostileCheckpoint(f"{path}/{META} names {outside[0]!r}, which is not a file of "
                                f"the checkpoint's own folder: it is not the course's; move "
                                f"{path.name} away")
    if INDEX not in files:
        raise HostileCheckpoint(f"{path}/{META} does not list DCP's index {INDEX}; move "
                                f"{path.name} away to resume from the one before")
    return files


def damage(path: Path) -> str | None:
    """None if every file meta.json lists matches its checksum; else what is wrong, in words.
    Only plain files inside `path`, read up to their size when opened (`open_regular`)."""
    if path.is_symlink():
        return f"it is a link (to {path.readlink()}), not a folder the course saved"
    try:
        files = listed_files(path, read_meta(path))
    except CheckpointError as exc:
        return str(exc)
    for name, expected in files.items():
        try:
            actual = safe_io.sha256_of(path / name, what=str(path / name))
        except safe_io.UnsafeRead as exc:
            return str(exc)
        except OSError as exc:
            return f"{path / name} cannot be read ({exc.strerror or exc})"
        if actual != expected:
            return f"{path / name} does not match the checksum saved with it"
    return None


def read_index(path: Path, meta: dict) -> Metadata:
    """DCP's index of the checkpoint `path`, unpickled with `_MetadataUnpickler` and checked:
    every tensor's bytes lie in a shard file meta.json lists, within it, untransformed.
    `HostileCheckpoint` in one line otherwise: nothing in it has run."""
    files = listed_files(path, meta)
    sizes = {}
    try:
        with safe_io.open_regular(path / INDEX, limit=INDEX_LIMIT, what=str(path / INDEX)) as (
                f, size):
            index = _MetadataUnpickler(io.BytesIO(f.read(size))).load()
        for name in files:
            with safe_io.open_regular(path / name, what=str(path / name)) as (_, sizes[name]):
                pass
    except _RefusedGlobal as exc:
        raise HostileCheckpoint(f"{path / INDEX} asks for {one_line(exc, 120)}, which no DCP "
                                f"index holds, and was not loaded (nothing in it ran): it is "
                                f"not the course's; move {path.name} away") from None
    except (OSError, ValueError, EOFError, TypeError, AttributeError, IndexError,
            pickle.UnpicklingError) as exc:
        raise HostileCheckpoint(f"{path / INDEX} is not a DCP index the course wrote "
                                f"({one_line(exc, 160)}); move {path.name} away") from None
    if not isinstance(index, Metadata) or not isinstance(index.storage_data, dict):
        raise HostileCheckpoint(f"{path / INDEX} holds a {type(index).__name__}, not a DCP "
                                f"index; move {path.name} away")
    for key, where in index.storage_data.items():
        bad = (not isinstance(where, _StorageInfo) or where.relative_path not in sizes
               or where.relative_path in (INDEX, META) or where.transform_descriptors
               or not all(isinstance(v, int) and v >= 0 for v in (where.offset, where.length))
               or where.offset + where.length > sizes[where.relative_path])
        if bad:
            raise HostileCheckpoint(f"{path / INDEX} places {getattr(key, 'fqn', key)!r} at "
                                    f"{where!r}, not within a shard file meta.json lists: it is "
                                    f"not the course's; move {path.name} away")
    return index


class IndexedReader(FileSystemReader):
    """DCP's file reader with the index already read and checked (`read_index`), instead of
    unpickling `.metadata` itself."""

    def __init__(self, path: Path, index: Metadata):
        super().__init__(path)
        self.index = index

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self.index.storage_meta is None:  # as FileSystemReader.read_metadata does
            self.index.storage_meta = StorageMeta()
        self.index.storage_meta.load_id = self.load_id
        return self.index


class WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, its non-tensor entries loaded by torch's `weights_only`
    loader (plain values only) instead of a full unpickling."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        # DefaultLoadPlanner.load_bytes, with weights_only=True (its own passes False)
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                        loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
