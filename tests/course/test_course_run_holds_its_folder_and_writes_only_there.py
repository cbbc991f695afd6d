"""A course run writes only into its own output folder, which it holds while it runs: a folder
another process holds, the course's own notebooks (directly or through a link) and files the
runner did not write are refused before any notebook runs, making no folder; the folder is freed
when the run ends, and a lock file a crashed run left behind does not block the next one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from course_helpers import one_line_error
from sized_notebooks import sized  # noqa: F401  (a fixture)
from write_mishaps import holder, leftovers  # noqa: F401  (holder: a fixture)

from moe_tutorial import safe_io
from moe_tutorial.cli import main
from moe_tutorial.course import run_inputs, runner


def test_run_out_through_a_link_to_the_notebooks_is_refused(capsys, fake_checkout,
                                                            fast_papermill):
    (fake_checkout / "runs").mkdir()
    (fake_checkout / "runs" / "mine").symlink_to(fake_checkout / "notebooks")
    before = sorted(p.name for p in (fake_checkout / "notebooks").iterdir())
    assert main(["run", "--out", "runs/mine"]) == 2
    assert "course's own notebooks/" in capsys.readouterr().err
    assert sorted(p.name for p in (fake_checkout / "notebooks").iterdir()) == before


def test_a_run_refused_for_its_folder_makes_no_folder(capsys, fake_checkout, fast_papermill):
    assert main(["run", "--out", "notebooks/mine"]) == 2
    assert "course's own notebooks/" in capsys.readouterr().err
    assert not (fake_checkout / "notebooks" / "mine").exists()


def test_a_run_into_a_folder_another_process_holds_is_refused_naming_it(
        capsys, fake_checkout, fast_papermill, holder):  # noqa: F811
    folder, process = holder
    assert main(["run", "--out", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"pid {process.pid} on here" in err[0], err
    assert sorted(p.name for p in folder.iterdir()) == [safe_io.LOCK_NAME]


def test_the_runner_holds_its_folder_until_the_run_ends(fake_checkout, fast_papermill):
    notebooks = runner.find_notebooks()
    course = runner.prepare_run(notebooks, Path("runs/mine"))
    with pytest.raises(runner.RunError, match=rf"course run \(pid {os.getpid()}"):
        runner.prepare_run(notebooks, Path("runs/mine"), replace=True)
    runner.execute_run(course, echo=lambda *a, **k: None)
    assert course.ok and leftovers(Path("runs/mine")) == []
    again = runner.run_course(notebooks, Path("runs/mine"), replace=True, echo=lambda *a, **k: None)
    assert again.ok and leftovers(Path("runs/mine")) == []


def test_a_crashed_runs_lock_file_does_not_block_the_next_run(fake_checkout, fast_papermill):
    out = fake_checkout / "runs" / "mine"
    out.mkdir(parents=True)
    (out / safe_io.LOCK_NAME).write_text('{"what": "course run", "pid": 1}')  # no lock held
    course = runner.run_course(runner.find_notebooks(), out, echo=lambda *a, **k: None)
    assert course.ok and leftovers(out) == []


def test_replace_never_overwrites_a_file_the_runner_did_not_write(capsys, sized):  # noqa: F811
    assert runner.run_course(sized, Path("runs/mine"), mode="small").ok
    manifest = Path("runs/mine") / run_inputs.RUN_MANIFEST
    made = json.loads(manifest.read_text())
    made["files"].remove("01_a.html")
    manifest.write_text(json.dumps(made))
    Path("runs/mine/01_a.html").write_text("my notes")
    one_line_error(capsys, ["run", "--out", "runs/mine", "--notebooks", "01", "--replace"],
                   "01_a.html", "did not write")
    assert Path("runs/mine/01_a.html").read_text() == "my notes"
