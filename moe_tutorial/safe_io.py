"""Writing a learner's results safely: whole or not at all, never through or over a link, never
over an earlier result unasked, one writer per folder and per result file; and reading what is
on disk without following a link or reading forever.

    check_target(path, replace=args.replace, flag="--json")   # before any work starts
    write_json(path, result, replace=True)                     # when the work is done
    with atomic_file(path, replace=True) as f:                 # any writer of bytes
        torch.save(state, f)
    with hold_folder("runs/small", "training run"):           # a second writer is refused
        ...
    with claim_output("bench.json", "`bench`", replace=False):  # one writer per result file
        ...                                                    # (its writes above go through)
    with open_regular(path, limit=1 << 20) as (f, size):      # a read that cannot hang
        ...

Whole or nothing: the bytes go to a temporary file of a unique name in the target's folder,
are flushed to disk, and only then renamed onto the target (a rename within one file system is
atomic), so a process killed at any moment, or a full disk, leaves the earlier file or the new
one, never half of either; a failed write removes its temporary file.

One writer per folder: `hold_folder` takes an exclusive `flock` on a lock file in the folder
and writes who holds it (pid, host, command, since when) into it. The kernel releases the lock
when its holder ends, however it ends, so the lock file a crashed holder left behind is
recognised as free (the lock is not held) and taken over; nothing has to guess whether a pid
is still alive. A result file is claimed the same way (`claim_output`, a lock file beside it)
for the whole of the command that writes it, so a second command writing the same file stops
before its work; every write through `atomic_file` respects a claim another process holds.

Never through a link: a lock, a result or a file the course reads from a checkpoint is opened
with `O_NOFOLLOW`, and a link where one should be is refused in one line.
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
    """A write refused before it starts: the target is an earlier result, a folder, or a
    link."""


class WriteFailed(OSError):
    """A write that could not finish (a full disk, no permission): nothing was changed."""


class FolderBusy(ValueError):
    """The folder is held by another writer (`hold_folder`); the message names it."""


class FileBusy(FolderBusy):
    """The result file is claimed by another command (`claim_output`); the message names it."""


# What a write refused before it starts, or one that could not finish, raises: each says in one
# line what was wrong and how to fix it (`refusal_line`).
REFUSALS = (UnsafeWrite, FolderBusy, WriteFailed)


def refusal_line(exc: Exception) -> str:
    """The one line a `REFUSALS` exception says (a `WriteFailed` holds it as its strerror)."""
    return exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)


class UnsafeRead(ValueError):
    """A file the course was about to read is a link, not a plain file, or larger than any it
    writes there (`open_regular`): refused before a byte is read."""


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
    if path.is_symlink():  # a link to the course's folders is named as such above
        raise UnsafeWrite(f"{name} is a link (to {os.readlink(path)}); a result is never written "
                          f"over or through a link: remove the link, or choose another file "
                          f"name")
    if path.is_dir():
        raise UnsafeWrite(f"{name} is a directory; give a file name in it, e.g. "
                          f"{path / 'results.json'}")
    if path.exists() and not replace:
        raise UnsafeWrite(f"{name} already exists (an earlier result?); {hint}, or choose "
                          f"another file name")


def check_output(flag: str, path: str, *, replace: bool, make_parents: bool) -> None:
    """A command's output file, checked before its work: named (not empty), not a directory
    or a link, not an earlier result (unless `replace`), and a place to write it (its folder
    exists, or with `make_parents` can be made, in a folder this user can write in).
    `ValueError` (`UnsafeWrite` among them) naming `flag` and the fix."""
    if not path.strip():
        raise ValueError(f"{flag} is empty (an unset variable?); give a file name, e.g. "
                         f"{flag} results.json, or leave the flag out")
    target = Path(path)
    check_target(target, replace=replace, flag=flag)
    folder = target.absolute().parent
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, not a directory; choose "
                         f"another path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: no permission to write in {existing}; choose "
                         f"another directory")
    if not make_parents and existing != folder:
        raise ValueError(f"{flag} {path}: the directory {folder} does not exist; create it "
                         f"first, or choose another path")


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
    `check_target` refuses; `FileBusy` while another process claims it (`claim_output`)."""
    path = Path(path)
    check_target(path, replace=replace)
    with contextlib.ExitStack() as claim:
        if _claim_key(path) not in _claimed:  # a writer's own claim lets its writes through
            claim.enter_context(claim_output(path, "a write", replace=replace))
        with _written_whole(path, replace, mode, encoding) as f:
            yield f


@contextlib.contextmanager
def _written_whole(path: Path, replace: bool, mode: str, encoding: str | None):
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
        if path.is_symlink():  # appeared while writing: replacing it would lose where it led
            raise UnsafeWrite(f"{path} became a link while this was running; it was left as it "
                              f"is and nothing was written: choose another file name")
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


# ---------------------------------------------------------------------------------------------
# Reading what is on disk: plain files only, never through a link, never without an end

@contextlib.contextmanager
def open_regular(path: str | Path, *, limit: int | None = None, what: str | None = None):
    """`path` opened for reading in binary, as (file, its size): never through a link (the last
    component is not followed), only a plain file (a device such as /dev/zero, a FIFO or a
    folder is refused before it could be read forever or block), and with `limit`, at most that
    many bytes. `UnsafeRead`, in one line naming `what` (default: the path), otherwise;
    `OSError` when it cannot be opened at all."""
    path = Path(path)
    name = what or str(path)
    try:  # O_NONBLOCK: opening a FIFO would wait for a writer; a plain file ignores it
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeRead(f"{name} is a link (to {os.readlink(path)}); the course reads only "
                             f"plain files there, never through a link: replace it with the "
                             f"file itself") from None
        raise
    info = os.fstat(fd)
    problem = (f"{name} is not a plain file (a device, a pipe or a folder), where the course "
               f"expects one it wrote; move it away" if not stat.S_ISREG(info.st_mode) else
               f"{name} holds {info.st_size:,} bytes, more than the {limit:,} the course ever "
               f"writes there: it is not the course's file; move it away"
               if limit is not None and info.st_size > limit else None)
    if problem is not None:
        os.close(fd)
        raise UnsafeRead(problem)
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as f:
        yield f, info.st_size


def sha256_of(path: str | Path, *, what: str | None = None) -> str:
    """The sha256 of the plain file `path` (`open_regular`: not through a link), of the bytes it
    held when opened: a file that grows meanwhile cannot keep the read going."""
    with open_regular(path, what=what) as (f, size):
        return sha256_of_open(f, size)


def sha256_of_open(f, size: int) -> str:
    """The sha256 of the next `size` bytes of the open binary file `f` (fewer if it ends)."""
    digest = hashlib.sha256()
    while size > 0 and (block := f.read(min(size, 1 << 20))):
        digest.update(block)
        size -= len(block)
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
# One folder, one writer; one result file, one writer

def _holder(lock: Path) -> str:
    """Who holds `lock`, in words, from what it wrote into the lock file."""
    try:
        info = json.loads(lock.read_text(encoding="utf-8"))
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
        return (f"{info['what']} (pid {info['pid']} on {info['host']}, since {started}: "
                f"`{info['command']}`)")
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not said which yet)"


def _lock(lock: Path, busy) -> int:
    """An open descriptor of `lock` (created if missing) holding an exclusive `flock` on it;
    `busy(holder in words)` is raised when another process holds it. Never through a link:
    the lock file is truncated and written by its holder."""
    while True:
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
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
            raise busy(_holder(lock)) from None
        # The file may have been removed by its holder between our open and our lock: then
        # we hold a lock on a name no one else sees; take the current file instead.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(lock, follow_symlinks=False))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


@contextlib.contextmanager
def _holding(lock: Path, fd: int, what: str):
    """Say who holds `lock` (in it) while the block runs; then release and remove it."""
    try:
        info = {"what": what, "pid": os.getpid(), "host": socket.gethostname(),
                "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else "",
                "started": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            lock.unlink()  # while still locked: a waiting opener re-checks the name (above)
        os.close(fd)


@contextlib.contextmanager
def hold_folder(directory: str | Path, what: str):
    """Hold `directory` (made if missing) for one writer while the block runs; `FolderBusy`,
    naming the holder, if another process holds it. `what` says who holds it, e.g.
    "training run"; the lock file also names the pid, host and command."""
    directory = Path(directory)
    lock = directory / LOCK_NAME

    def busy(holder: str) -> FolderBusy:
        return FolderBusy(f"{directory} is in use by {holder}; wait for it to finish or stop "
                          f"it, or use another folder")

    fd = _take_lock(lock, busy, lambda: directory.mkdir(parents=True, exist_ok=True),
                    lambda why: f"{directory} cannot be used ({why}); choose a folder you can "
                                f"write to")
    with _holding(lock, fd, what):
        yield directory


def _take_lock(lock: Path, busy, prepare, cannot) -> int:
    """`_lock(lock, busy)` after `prepare()` (making the lock's folder); an OS error of either
    becomes one `WriteFailed` line, `cannot(the error in words)`."""
    try:
        prepare()
        return _lock(lock, busy)
    except WriteFailed:
        raise
    except OSError as exc:
        raise WriteFailed(exc.errno, cannot(_describe(exc))) from None


def check_folder_free(directory: str | Path, what: str) -> None:
    """`FolderBusy` now, before any work, if another process holds `directory`; holds nothing."""
    if Path(directory).is_dir():
        with hold_folder(directory, what):
            pass


def lock_for(path: str | Path) -> Path:
    """The lock file of the result file `path`: hidden, beside it."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


_claimed: set[str] = set()  # the result files this process claims (`claim_output`)


def _claim_key(path: Path) -> str:
    return os.path.join(os.path.realpath(path.parent), path.name)


@contextlib.contextmanager
def claim_output(path: str | Path, what: str, *, replace: bool, flag: str | None = None,
                 make_parents: bool = False):
    """Claim the result file `path` for this process while the block runs, so a second
    command writing it stops at once (`FileBusy`, naming the first), before its work, instead
    of both running and the later rename silently dropping the earlier result. The target is
    checked (`check_target`) again once claimed; this process's own writes to it
    (`atomic_file`) go through. `make_parents`: create its folder if missing."""
    path = Path(path)
    name = f"{flag} {path}" if flag else str(path)
    check_target(path, replace=replace, flag=flag)
    lock = lock_for(path)

    def busy(holder: str) -> FileBusy:
        return FileBusy(f"{name} is being written by {holder}; wait for it to finish or stop "
                        f"it, or choose another file name")

    made = [p for p in (path.parent, *path.parent.parents) if not p.exists()] if make_parents else []
    fd = _take_lock(lock, busy, lambda: made and path.parent.mkdir(parents=True, exist_ok=True),
                    lambda why: f"{path} cannot be written ({why}); nothing was changed: choose "
                                f"a folder you can write to")
    key = _claim_key(path)
    try:
        with _holding(lock, fd, what):
            check_target(path, replace=replace, flag=flag)  # the file as it is, now ours
            _claimed.add(key)
            try:
                yield path
            finally:
                _claimed.discard(key)
    finally:
        for folder in made:  # the folders made for a result that was never written
            with contextlib.suppress(OSError):
                folder.rmdir()


# ---------------------------------------------------------------------------------------------
# Printing what a command found: its stdout may close early

class StdoutThatMayClose:
    """The command's stdout, which may stop being read (`| head`) or be unable to encode a
    character (an ASCII-only terminal): the command runs to its end and writes its result
    files either way, and says once, on stderr, that its printed output was cut short."""

    def __init__(self, stream):
        self.stream, self.closed_early = stream, False

    def write(self, text: str) -> int:
        if not self.closed_early:
            try:
                try:
                    self.stream.write(text)
                except UnicodeEncodeError:
                    encoding = getattr(self.stream, "encoding", None) or "ascii"
                    self.stream.write(text.encode(encoding, "replace").decode(encoding))
            except (BrokenPipeError, ValueError):  # ValueError: written after it was closed
                self._stop()
        return len(text)

    def flush(self) -> None:
        if not self.closed_early:
            try:
                self.stream.flush()
            except (BrokenPipeError, ValueError):
                self._stop()

    def _stop(self) -> None:
        self.closed_early = True
        with contextlib.suppress(OSError, ValueError, AttributeError):
            # Python flushes stdout again at exit: into nothing, not into a second error
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())

    def finish(self) -> None:
        self.flush()
        if self.closed_early:
            print("note: the output stopped being read before the command ended (stdout "
                  "closed, e.g. by `| head`); the command ran to its end and wrote its files",
                  file=sys.stderr)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)
