"""One folder, one writer: a second writer is refused naming the first (in this process or
another), while a lock file that a crashed or killed writer left behind frees the folder."""

from __future__ import annotations

import json
import os
import signal

import pytest
from write_mishaps import holder, leftovers  # noqa: F401  (holder: a fixture)

from moe_tutorial import safe_io


def test_a_second_writer_is_refused_naming_the_first(tmp_path):
    with safe_io.hold_folder(tmp_path, "training run"):
        with pytest.raises(safe_io.FolderBusy, match=rf"training run \(pid {os.getpid()} on "):
            with safe_io.hold_folder(tmp_path, "build"):
                pass
    assert leftovers(tmp_path) == []


def test_a_lock_file_a_crash_left_behind_is_taken_over(tmp_path):
    (tmp_path / safe_io.LOCK_NAME).write_text(json.dumps(
        {"what": "training run", "pid": 999999, "host": "h", "command": "x", "started": 0}))
    with safe_io.hold_folder(tmp_path, "training run"):
        info = json.loads((tmp_path / safe_io.LOCK_NAME).read_text())
        assert info["pid"] == os.getpid()
    assert leftovers(tmp_path) == []


def test_a_running_holder_in_another_process_is_named(holder):  # noqa: F811
    folder, process = holder
    with pytest.raises(safe_io.FolderBusy, match=rf"pid {process.pid} on here.*`holder`"):
        safe_io.check_folder_free(folder, "training run")


def test_a_holder_killed_mid_run_frees_the_folder(holder):  # noqa: F811
    folder, process = holder
    process.send_signal(signal.SIGKILL)
    process.wait()
    safe_io.check_folder_free(folder, "training run")  # the kernel released its lock


def test_checking_a_missing_folder_makes_nothing(tmp_path):
    safe_io.check_folder_free(tmp_path / "new", "training run")
    assert not (tmp_path / "new").exists()
