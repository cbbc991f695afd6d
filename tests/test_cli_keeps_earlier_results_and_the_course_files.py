"""The command line never loses a result or writes into the course: an earlier report is kept
unless `--replace` is given, a link into the course's own folders and a held or dangling
checkpoint folder are refused before any work, and a full disk keeps the earlier file; each
refusal is one line, never a traceback."""

from __future__ import annotations

import json

import pytest
from course_helpers import WorkStarted, one_line_error
from write_mishaps import course_dir, full_disk, holder, leftovers  # noqa: F401  (fixtures)

from moe_tutorial.cli import main


def test_validate_keeps_an_earlier_report(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "report.json").write_text("an earlier B200 report")
    one_line_error(capsys, ["validate"], "report.json already exists", "--replace")
    assert (tmp_path / "report.json").read_text() == "an earlier B200 report"


def test_validate_out_that_is_a_folder_is_refused(capsys, tmp_path):
    one_line_error(capsys, ["validate", "--out", str(tmp_path)], "is a directory")


def test_validate_into_a_missing_folder_is_made_not_refused(capsys, tmp_path, monkeypatch):
    """The check passes (the folder is made when the report is written); the work is what fails
    here, one line at a time and without a traceback, on a machine without a GPU."""
    from moe_tutorial.perf import blackwell

    def validate():
        raise WorkStarted

    monkeypatch.setattr(blackwell, "validate", validate)
    with pytest.raises(WorkStarted):
        main(["validate", "--out", str(tmp_path / "new" / "report.json")])


def test_blackwell_dry_run_keeps_an_earlier_result(capsys, tmp_path):
    earlier = tmp_path / "dry.json"
    earlier.write_text('{"summary": "earlier"}')
    one_line_error(capsys, ["blackwell-dry-run", "--out", str(earlier)], "--replace")
    assert earlier.read_text() == '{"summary": "earlier"}'


def test_train_json_through_a_link_into_the_course_is_refused(capsys, tmp_path,
                                                              course_dir, no_work):  # noqa: F811
    link = tmp_path / "result.json"
    link.symlink_to(course_dir / "solutions" / "01_router.ipynb")
    one_line_error(capsys, ["train", "--json", str(link), "--replace"], "solutions/",
                   "remove the link")
    assert (course_dir / "solutions" / "01_router.ipynb").read_text() == "the solution"


def test_analyze_json_into_a_linked_course_folder_is_refused(capsys, tmp_path,
                                                             course_dir):  # noqa: F811
    link = tmp_path / "results"
    link.symlink_to(course_dir / "notebooks")
    one_line_error(capsys, ["analyze", "tiny", "--json", str(link / "x.json")],
                   "leads through a link", "notebooks/")
    assert list((course_dir / "notebooks").iterdir()) == []


def test_train_checkpoint_dir_dangling_link_is_refused_before_training(capsys, tmp_path,
                                                                      no_work):
    (tmp_path / "ckpt").symlink_to(tmp_path / "mounted-disk")
    one_line_error(capsys, ["train", "--checkpoint-dir", str(tmp_path / "ckpt")],
                   "does not exist", "create that folder")


def test_train_into_a_held_checkpoint_dir_names_the_holder(capsys, holder, no_work):  # noqa: F811
    folder, process = holder
    one_line_error(capsys, ["train", "--checkpoint-dir", str(folder)], f"pid {process.pid}",
                   "another folder")


def test_analyze_json_on_a_full_disk_keeps_the_earlier_report(capsys, tmp_path,
                                                              full_disk):  # noqa: F811
    earlier = tmp_path / "a.json"
    earlier.write_text("earlier")
    code = main(["analyze", "tiny", "--no-sweep", "--json", str(earlier), "--replace"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "No space left" in err[0], err
    assert earlier.read_text() == "earlier" and leftovers(tmp_path) == []


def test_bench_merge_on_a_full_disk_keeps_the_earlier_merge(capsys, tmp_path,
                                                            full_disk):  # noqa: F811
    part = tmp_path / "part.json"
    part.write_text(json.dumps({"environment": {"torch": "2.13"}, "results": []}))
    earlier = tmp_path / "merged.json"
    earlier.write_text("earlier")
    code = main(["bench", "--merge", str(part), "--out", str(earlier), "--replace"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "nothing was changed" in err[0], err
    assert earlier.read_text() == "earlier" and leftovers(tmp_path) == []
