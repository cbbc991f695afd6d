"""Writing a learner's results safely: whole or not at all, never through a link into the course,
never over an earlier result unasked, and one writer per folder.

    check_target(path, replace=args.replace, flag="--json")   # before any work starts
    write_json(path, result, replace=True)                     # when the work is done
    with atomic_file(path, replace=True) as f:                 # any writer of bytes
        torch.save(state, f)
    with hold_folder("runs/small", "training run"):           # a second writer is refused
        ...

Whole or nothing: the bytes go to a temporary file of a unique name in the target's folder,
are flushed to disk, and only then renamed onto the target (a rename within one file system is
atomic), so a process killed at any moment, or a full disk, leaves the earlier file or the new
one, never half of either; a failed write removes its temporary file. The rename replaces a link
itself, not the file it points to.

One writer per folder: `hold_folder` takes an exclusive `flock` on a lock file in the folder
and writes who holds it (pid, host, command, since when) into it. The kernel releases the lock
when its holder ends, however it ends, so the lock file a crashed holder left behind is
recognised as free (the lock is not held) and taken over; nothing has to guess whether a pid
is still alive.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import socket
import stat
import sys
import time
from pathlib import Path

from .locations import checkout_roots, package_dir

LOCK_NAME = ".moe-tutorial.lock"


class UnsafeWrite(ValueError):
    """A write refused before it starts: the target is an earlier result, a folder, or a link
    into the course's own folders."""


class WriteFailed(OSError):
    """A write that could not finish (a full disk, no permission): nothing was changed."""


class FolderBusy(ValueError):
    """The folder is held by another writer (`hold_folder`); the message names it."""


def course_folders(*near: Path) -> list[Path]:
    """The course's own folders (its package, and the chapters, solutions and package source of
    the clone the current directory or `near` is in), resolved. Not exercises/: the build writes
    there, and a learner's exercise is theirs."""
    return [package_dir()] + [root / name for root in checkout_roots(*near)
                              for name in ("notebooks", "solutions", "moe_tutorial")]


def _inside_course(path: Path) -> Path | None:
    """The course folder `path` (resolved) lies in, or None."""
    where = path.resolve()
    return next((f for f in course_folders(where) if where == f or where.is_relative_to(f)), None)


def check_target(path: str | Path, *, replace: bool, flag: str | None = None,
                 hint: str = "pass --replace to replace it") -> None:
    """Refuse, before any work, a target that a write would lose something through: a folder,
    a link into the course's own folders, or (without `replace`) an existing file."""
    path = Path(path)
    name = f"{flag} {path}" if flag else str(path)
    folder = _inside_course(path)
    if folder is not None and Path(os.path.abspath(path)) != path.resolve():
        raise UnsafeWrite(f"{name} leads through a link to {path.resolve()}, inside the course's "
                          f"own {folder.name}/ folder, which is never written through a link; "
                          f"remove the link or choose a path outside the course's folders")
    if path.is_dir():
        raise UnsafeWrite(f"{name} is a directory; give a file name in it, e.g. "
                          f"{path / 'results.json'}")
    if (path.exists() or path.is_symlink()) and not replace:
        raise UnsafeWrite(f"{name} already exists (an earlier result?); {hint}, or choose "
                          f"another file name")


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):  # some file systems cannot sync a folder; the rename stands
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def temporary_name(path: Path) -> Path:
    """A name no other writer uses, hidden, in `path`'s folder (so the rename stays on one
    file system)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _describe(exc: OSError) -> str:
    return exc.strerror or str(exc)


@contextlib.contextmanager
def atomic_file(path: str | Path, *, replace: bool, mode: str = "wb", encoding: str | None = None):
    """A file object whose contents become `path` only when the block ends without an error:
    written to a temporary file beside it, flushed to disk, then renamed over it (or, without
    `replace`, only if `path` does not exist by then). `WriteFailed` when the bytes cannot be
    written (nothing changed: the temporary file is removed); `UnsafeWrite` for a target
    `check_target` refuses."""
    path = Path(path)
    check_target(path, replace=replace)
    temporary = temporary_name(path)
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies
    except OSError as exc:
        raise WriteFailed(exc.errno, f"{path} cannot be written ({_describe(exc)}); nothing was "
                                     f"changed: choose a folder you can write to") from None
    try:
        with os.fdopen(fd, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        if replace:
            os.replace(temporary, path)
        else:
            os.link(temporary, path)  # fails if `path` appeared meanwhile: never overwritten
            temporary.unlink()
        _fsync_folder(path.parent)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            temporary.unlink()
        if isinstance(exc, FileExistsError) and not replace:
            raise UnsafeWrite(f"{path} appeared while this was running; it was left as it is "
                              f"and nothing was written: choose another file name") from None
        if isinstance(exc, OSError) and not isinstance(exc, WriteFailed):
            raise WriteFailed(exc.errno, f"{path} could not be written ({_describe(exc)}); "
                                         f"nothing was changed (an earlier file there is intact): "
                                         f"free some space or choose another place") from None
        raise


def write_text(path: str | Path, text: str, *, replace: bool) -> Path:
    with atomic_file(path, replace=replace, mode="w", encoding="utf-8") as f:
        f.write(text)
    return Path(path)


def write_json(path: str | Path, doc, *, replace: bool) -> Path:
    """`doc` as indented JSON, written whole or not at all (`atomic_file`)."""
    return write_text(path, json.dumps(doc, indent=1) + "\n", replace=replace)


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class HashingWriter:
    """A write-only file object that hashes (sha256) what passes through it to `file`."""

    def __init__(self, file):
        self.file, self.digest = file, hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


# ---------------------------------------------------------------------------------------------
# One folder, one writer

def _holder(lock: Path) -> str:
    """Who holds `lock`, in words, from what it wrote into the lock file."""
    try:
        info = json.loads(lock.read_text(encoding="utf-8"))
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
        return (f"{info['what']} (pid {info['pid']} on {info['host']}, since {started}: "
                f"`{info['command']}`)")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not said which yet)"


@contextlib.contextmanager
def hold_folder(directory: str | Path, what: str):
    """Hold `directory` (made if missing) for one writer while the block runs; `FolderBusy`,
    naming the holder, if another process holds it. `what` says who holds it, e.g.
    "training run"; the lock file also names the pid, host and command."""
    directory = Path(directory)
    lock = directory / LOCK_NAME
    try:
        directory.mkdir(parents=True, exist_ok=True)
        while True:
            try:  # never through a link: the lock is truncated and written below
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                raise WriteFailed(exc.errno, f"{lock} is a link, where the course keeps its lock "
                                             f"file; remove the link (it is not the course's)") from None
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise WriteFailed(errno.EEXIST, f"{lock} is not a plain file, where the course "
                                                f"keeps its lock file; move it away")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise FolderBusy(f"{directory} is in use by {_holder(lock)}; wait for it to "
                                 f"finish or stop it, or use another folder") from None
            # The file may have been removed by its holder between our open and our lock: then
            # we hold a lock on a name no one else sees; take the current file instead.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(lock))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
    except WriteFailed:
        raise
    except OSError as exc:
        raise WriteFailed(exc.errno, f"{directory} cannot be used ({_describe(exc)}); choose a "
                                     f"folder you can write to") from None
    try:
        info = {"what": what, "pid": os.getpid(), "host": socket.gethostname(),
                "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else "",
                "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        yield directory
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()  # while still locked: a waiting opener re-checks the name (above)
        os.close(fd)


def check_folder_free(directory: str | Path, what: str) -> None:
    """`FolderBusy` now, before any work, if another process holds `directory`; holds nothing."""
    if Path(directory).is_dir():
        with hold_folder(directory, what):
            pass
