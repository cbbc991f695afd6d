"""`make lab`'s copy into work/ (moe_tutorial/course/workspace.py): whole or not at all, a file
the learner never edited refreshed when the course changed it and an edited one kept (saying
so), never through a link, and a work/ that cannot be written or read in part still opened,
with one line for what could not be done.

Each case runs on a small clone made here (a chapter, a figure, an exercise, a solution, the
glossary), so a copy takes milliseconds. A kill is a real one (`os._exit` in a child process at
the worst moment: the bytes written, the rename not yet done); a full disk and a read-only
folder are the errors the system calls would raise (the tests may run as root, whom
permissions do not stop)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_tutorial import cli, safe_io
from moe_tutorial.course import workspace

ROOT = Path(__file__).resolve().parents[2]
CHAPTER = "notebooks/01_naive_moe.ipynb"
FIGURE = "notebooks/figures/router.png"
EXERCISE = "exercises/01_router.ipynb"


def chapter_text(words: str) -> str:
    return json.dumps({"cells": [{"cell_type": "markdown", "source": [words]}], "metadata": {},
                       "nbformat": 4, "nbformat_minor": 5})


@pytest.fixture
def clone(tmp_path) -> Path:
    repo = tmp_path / "clone"
    files = {CHAPTER: chapter_text("the router"), FIGURE: "\x89PNG figure bytes",
             EXERCISE: chapter_text("your turn"), "solutions/01_router.ipynb":
             chapter_text("the answer"), "docs/glossary.md": "# Glossary\n"}
    for name, text in files.items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    (repo / "moe_tutorial").mkdir()
    return repo


def prepare(clone: Path, capsys) -> list[str]:
    """`make lab`'s copy of `clone` into clone/work; the lines it printed."""
    assert workspace.prepare_workspace(repo=clone) == clone / "work"
    return capsys.readouterr().out.strip().splitlines()


def course_files(clone: Path) -> list[str]:
    return [str(p) for p in workspace._course_files(clone)]


def assert_whole_copy(clone: Path) -> None:
    for name in course_files(clone):
        assert (clone / "work" / name).read_bytes() == (clone / name).read_bytes(), name


def leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.name.endswith((".tmp", ".lock")))


def line_with(lines: list[str], *words: str) -> str:
    found = [line for line in lines if all(word in line for word in words)]
    assert len(found) == 1, lines
    return found[0]


# ---------------------------------------------------------------------------------------------
# Whole or not at all

def test_the_first_copy_is_whole_recorded_and_leaves_nothing_else(clone, capsys):
    lines = prepare(clone, capsys)
    assert_whole_copy(clone)
    line_with(lines, "added 5 file(s)", CHAPTER)
    record = json.loads((clone / "work" / workspace.RECORD).read_text())["files"]
    assert sorted(record) == sorted(course_files(clone))
    assert leftovers(clone / "work") == []


KILL_AT = """
import os, sys
from moe_tutorial import safe_io
from moe_tutorial.course import workspace
calls = 0
real = os.fsync
def fsync(fd):
    global calls
    real(fd)
    calls += 1
    if calls == int(sys.argv[2]):
        os._exit(9)  # killed: this file's bytes are written, its rename not done
safe_io.os.fsync = fsync
workspace.prepare_workspace(repo=sys.argv[1])
"""


@pytest.mark.parametrize("kill_at", [5, 7])
def test_a_copy_killed_midway_leaves_no_half_file_and_the_next_completes_it(clone, capsys,
                                                                            kill_at):
    killed = subprocess.run([sys.executable, "-c", KILL_AT, str(clone), str(kill_at)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert killed.returncode == 9, killed.stderr
    work = clone / "work"
    copied = [n for n in course_files(clone) if (work / n).exists()]
    assert 0 < len(copied) < len(course_files(clone))
    for name in copied:  # never half a file: each there is the course's whole
        assert (work / name).read_bytes() == (clone / name).read_bytes(), name
    assert any(p.name.endswith(".tmp") for p in work.rglob(".*"))  # what the kill left
    lines = prepare(clone, capsys)
    assert_whole_copy(clone)
    line_with(lines, "added")
    assert not any("kept your edited" in line for line in lines)
    assert leftovers(work) == []


def test_a_full_disk_copies_nothing_partial_says_so_and_the_next_lab_completes(clone, capsys,
                                                                               monkeypatch):
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(safe_io.os, "fsync", full)
        lines = prepare(clone, capsys)
    line_with(lines, "could not write 6 file(s) (No space left on device", CHAPTER,
              "Lab starts")
    work = clone / "work"
    assert [p for p in work.rglob("*") if p.is_file() and p.name in
            {Path(n).name for n in course_files(clone)}] == []
    assert leftovers(work) == []
    lines = prepare(clone, capsys)
    assert_whole_copy(clone)
    line_with(lines, "added 5 file(s)")


def test_a_disk_that_fills_partway_keeps_what_was_copied_whole(clone, capsys, monkeypatch):
    real, calls = os.fsync, []

    def fills(fd):
        calls.append(fd)
        if len(calls) > 4:  # two files (a file and its claim's nothing: 2 fsyncs a file)
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd)

    with monkeypatch.context() as patch:
        patch.setattr(safe_io.os, "fsync", fills)
        lines = prepare(clone, capsys)
    line_with(lines, "could not write", "No space left")
    work = clone / "work"
    for name in course_files(clone):
        if (work / name).exists():
            assert (work / name).read_bytes() == (clone / name).read_bytes()
    prepare(clone, capsys)
    assert_whole_copy(clone)


def test_a_copy_cut_short_by_an_earlier_version_is_replaced_and_kept_beside(clone, capsys):
    """What the old, non-atomic copy left: an empty figure, half a chapter (not JSON)."""
    work = clone / "work"
    (work / "notebooks" / "figures").mkdir(parents=True)
    (work / FIGURE).write_bytes(b"")
    (work / CHAPTER).write_text(chapter_text("the router")[:30])
    lines = prepare(clone, capsys)
    line_with(lines, "replaced 2 copy(ies) cut short", "*.damaged")
    assert_whole_copy(clone)
    assert (work / (CHAPTER + ".damaged")).read_text() == chapter_text("the router")[:30]


# ---------------------------------------------------------------------------------------------
# Stale chapters: refreshed if never edited, kept (and said) if edited

def test_an_unedited_chapter_the_course_changed_is_refreshed(clone, capsys):
    prepare(clone, capsys)
    (clone / CHAPTER).write_text(chapter_text("the router, rewritten"))
    lines = prepare(clone, capsys)
    line_with(lines, "refreshed 1 file(s) you had not edited", CHAPTER)
    assert_whole_copy(clone)


def test_an_edited_chapter_the_course_changed_is_kept_saying_so(clone, capsys):
    prepare(clone, capsys)
    mine = chapter_text("my notes on the router")
    (clone / "work" / CHAPTER).write_text(mine)
    (clone / CHAPTER).write_text(chapter_text("the router, rewritten"))
    lines = prepare(clone, capsys)
    line_with(lines, "kept your edited", CHAPTER, "rename yours")
    assert (clone / "work" / CHAPTER).read_text() == mine
    assert not any("refreshed" in line for line in lines)


def test_an_edited_chapter_the_course_did_not_change_is_kept_quietly(clone, capsys):
    prepare(clone, capsys)
    mine = chapter_text("my notes")
    (clone / "work" / CHAPTER).write_text(mine)
    lines = prepare(clone, capsys)
    assert (clone / "work" / CHAPTER).read_text() == mine
    line_with(lines, "kept your 5 file(s)")
    assert not any("kept your edited" in line or "added" in line for line in lines)


def test_a_refreshed_chapter_is_refreshed_again_after_the_next_change(clone, capsys):
    prepare(clone, capsys)
    for version in ("second", "third"):
        (clone / CHAPTER).write_text(chapter_text(version))
        line_with(prepare(clone, capsys), "refreshed 1 file(s)")
    assert_whole_copy(clone)


def test_a_copy_made_before_records_existed_is_recognised_by_its_contents(clone, capsys):
    prepare(clone, capsys)
    (clone / "work" / workspace.RECORD).unlink()
    prepare(clone, capsys)  # identical to the course: recorded as the course's
    (clone / CHAPTER).write_text(chapter_text("changed"))
    line_with(prepare(clone, capsys), "refreshed 1 file(s)")


@pytest.mark.parametrize("record", ["not json", "link", "list"])
def test_an_unreadable_record_keeps_every_file_as_the_learners(clone, capsys, tmp_path, record):
    prepare(clone, capsys)
    path = clone / "work" / workspace.RECORD
    path.unlink()
    if record == "link":
        path.symlink_to("/dev/zero")
    else:
        path.write_text("[1]" if record == "list" else "{")
    (clone / "work" / CHAPTER).write_text(chapter_text("mine"))
    lines = prepare(clone, capsys)
    line_with(lines, "record of the files it copied", "kept as yours")
    assert (clone / "work" / CHAPTER).read_text() == chapter_text("mine")


# ---------------------------------------------------------------------------------------------
# Never through a link

def test_a_dangling_link_in_work_is_left_alone_and_nothing_written_through_it(clone, capsys):
    work = clone / "work"
    (work / "notebooks").mkdir(parents=True)
    (work / CHAPTER).symlink_to(clone / "notebooks" / "gone.ipynb")
    lines = prepare(clone, capsys)
    line_with(lines, "left 1 link(s)", CHAPTER)
    assert not (clone / "notebooks" / "gone.ipynb").exists()
    assert (work / CHAPTER).is_symlink()


def test_a_link_to_the_learners_own_file_is_left_as_it_is(clone, capsys, tmp_path):
    mine = tmp_path / "my_chapter.ipynb"
    mine.write_text("mine")
    (clone / "work" / "notebooks").mkdir(parents=True)
    (clone / "work" / CHAPTER).symlink_to(mine)
    (clone / CHAPTER).write_text(chapter_text("changed"))
    line_with(prepare(clone, capsys), "left 1 link(s)")
    assert mine.read_text() == "mine"


def test_a_work_folder_linked_into_the_course_is_never_written_into(clone, capsys):
    work = clone / "work"
    work.mkdir()
    (work / "notebooks").symlink_to(clone / "notebooks")
    (clone / "notebooks" / "new.ipynb").write_text(chapter_text("new"))
    before = sorted(p.name for p in (clone / "notebooks").rglob("*"))
    lines = prepare(clone, capsys)
    line_with(lines, "left 3 link(s)")
    assert sorted(p.name for p in (clone / "notebooks").rglob("*")) == before


def test_a_work_folder_that_is_a_link_into_the_course_is_refused(clone):
    (clone / "work").symlink_to(clone / "notebooks")
    with pytest.raises(FileExistsError, match="leads into the course's own notebooks/"):
        workspace.prepare_workspace(repo=clone)


def test_a_clone_marker_that_is_a_link_is_not_written_through(clone, capsys, tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("mine")
    (clone / "work").mkdir()
    (clone / "work" / workspace.CLONE_MARKER).symlink_to(victim)
    line_with(prepare(clone, capsys), "could not write 1 file(s)", workspace.CLONE_MARKER)
    assert victim.read_text() == "mine"


# ---------------------------------------------------------------------------------------------
# A work/ that cannot be written or read in part: Lab still starts, one line says what

@pytest.fixture
def read_only(monkeypatch, clone):
    """Every file or folder made under clone/work fails as on a read-only file system."""
    real_open, real_mkdir = os.open, os.mkdir
    work = str(clone / "work")

    def open_(path, flags, *args, **kwargs):
        if str(path).startswith(work) and flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args, **kwargs)

    def mkdir(path, *args, **kwargs):
        if str(path).startswith(work) and not os.path.isdir(path):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_mkdir(path, *args, **kwargs)

    def start(patch):
        patch.setattr(os, "open", open_)
        patch.setattr(os, "mkdir", mkdir)

    return start


def test_lab_starts_on_a_read_only_work_folder_with_one_line(clone, capsys, monkeypatch,
                                                             read_only):
    prepare(clone, capsys)
    (clone / "work" / EXERCISE).unlink()
    (clone / "notebooks" / "02_new.ipynb").write_text(chapter_text("new"))
    started = []
    monkeypatch.chdir(clone)
    monkeypatch.setattr(cli.os, "execv", lambda path, args: started.append(args))
    with monkeypatch.context() as patch:
        read_only(patch)
        cli.main(["lab"])
    out = capsys.readouterr().out.strip().splitlines()
    line_with(out, "could not write 2 file(s) (Read-only file system", EXERCISE, "Lab starts")
    assert len(started) == 1  # JupyterLab started on what is there


def test_a_read_only_work_folder_with_nothing_to_copy_says_nothing_wrong(clone, capsys,
                                                                          monkeypatch,
                                                                          read_only):
    prepare(clone, capsys)
    with monkeypatch.context() as patch:
        read_only(patch)
        lines = prepare(clone, capsys)
    line_with(lines, "kept your 5 file(s)")
    line_with(lines, "cannot be written (Read-only file system)", "Lab starts on it as it is")


def test_a_file_it_cannot_read_is_left_and_named_in_one_line(clone, capsys, monkeypatch):
    prepare(clone, capsys)
    unreadable = str(clone / "work" / CHAPTER)
    real_open = os.open

    def open_(path, flags, *args, **kwargs):
        if str(path) == unreadable:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(os, "open", open_)
        lines = prepare(clone, capsys)
    line_with(lines, "could not read", CHAPTER, "left as they are")


def test_a_work_folder_that_cannot_be_made_is_one_line_from_lab(clone, capsys, monkeypatch,
                                                                read_only):
    monkeypatch.chdir(clone)
    monkeypatch.setattr(cli.os, "execv", lambda path, args: pytest.fail("Lab started"))
    with monkeypatch.context() as patch:
        read_only(patch)
        code = cli.main(["lab"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "cannot be made (Read-only file system)" in err[0]


def test_a_second_lab_copying_at_the_same_time_is_refused_in_one_line(clone, capsys,
                                                                      monkeypatch):
    (clone / "work").mkdir()
    monkeypatch.chdir(clone)
    monkeypatch.setattr(cli.os, "execv", lambda path, args: pytest.fail("Lab started"))
    with safe_io.hold_folder(clone / "work", "`make lab`'s copy"):
        code = cli.main(["lab"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "is in use by `make lab`'s copy" in err[0], err
