"""A result is written whole or not at all: a new file appears complete with nothing else beside
it, an earlier file is replaced only when asked, and an error or a full disk midway keeps the
earlier file and leaves no temporary file."""

from __future__ import annotations

import json

import pytest
from write_mishaps import full_disk, leftovers  # noqa: F401  (full_disk: a fixture)

from moe_tutorial import safe_io


def test_a_new_result_is_written_whole_and_leaves_nothing_else(tmp_path):
    safe_io.write_json(tmp_path / "r.json", {"loss": 1.5}, replace=False)
    assert json.loads((tmp_path / "r.json").read_text()) == {"loss": 1.5}
    assert leftovers(tmp_path) == []


def test_an_earlier_result_is_not_replaced_unasked(tmp_path):
    (tmp_path / "r.json").write_text("earlier")
    with pytest.raises(safe_io.UnsafeWrite, match="already exists.*--replace"):
        safe_io.write_json(tmp_path / "r.json", {}, replace=False)
    assert (tmp_path / "r.json").read_text() == "earlier"


def test_an_earlier_result_is_replaced_when_asked(tmp_path):
    (tmp_path / "r.json").write_text("earlier")
    safe_io.write_json(tmp_path / "r.json", [1], replace=True)
    assert json.loads((tmp_path / "r.json").read_text()) == [1]


def test_an_error_while_writing_keeps_the_earlier_file(tmp_path):
    (tmp_path / "r.json").write_text("earlier")
    with pytest.raises(ZeroDivisionError), safe_io.atomic_file(tmp_path / "r.json",
                                                                replace=True) as f:
        f.write(b"half")
        1 / 0
    assert (tmp_path / "r.json").read_text() == "earlier"
    assert leftovers(tmp_path) == []


def test_a_full_disk_keeps_the_earlier_file_and_says_so(tmp_path, full_disk):  # noqa: F811
    (tmp_path / "r.json").write_text("earlier")
    with pytest.raises(safe_io.WriteFailed, match="No space left.*nothing was changed"):
        safe_io.write_json(tmp_path / "r.json", {"new": 1}, replace=True)
    assert (tmp_path / "r.json").read_text() == "earlier"
    assert leftovers(tmp_path) == []


def test_a_folder_as_the_target_is_refused(tmp_path):
    with pytest.raises(safe_io.UnsafeWrite, match="is a directory; give a file name"):
        safe_io.write_json(tmp_path, {}, replace=True)


def test_a_missing_folder_is_one_clear_error(tmp_path):
    with pytest.raises(safe_io.WriteFailed, match="cannot be written.*choose a folder"):
        safe_io.write_json(tmp_path / "no" / "r.json", {}, replace=False)


def test_two_writers_never_share_a_temporary_name(tmp_path):
    names = {safe_io.temporary_name(tmp_path / "step_00000002.pt") for _ in range(50)}
    assert len(names) == 50


def test_a_result_that_appears_meanwhile_is_not_overwritten(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    with pytest.raises(safe_io.UnsafeWrite, match="appeared while"):
        with safe_io.atomic_file(path, replace=False) as f:
            f.write(b"mine")
            path.write_text("theirs")  # another program, between the check and the rename
    assert path.read_text() == "theirs" and leftovers(tmp_path) == []
