"""The exercise builder writes only its own files, whole: it never writes through a link (to a
solution or elsewhere), keeps an edited exercise unless asked to replace it, leaves no temporary
file, and refuses on one line a solution it cannot read, an unclosed solution region, a path
under a file, a full disk and a folder another build holds; its Python API names its arguments,
not the flags."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from course_helpers import notebook, one_line_error
from refused_on_one_line import refused
from write_mishaps import full_disk  # noqa: F401  (a fixture)

from moe_tutorial import safe_io
from moe_tutorial.cli import main
from moe_tutorial.course import exercise_build

SOLUTION = ("def double(x):\n    ### BEGIN SOLUTION\n    ### HINT: multiply by two\n"
            "    return 2 * x\n    ### END SOLUTION\n")


@pytest.fixture
def solutions(tmp_path) -> Path:
    """A solutions folder of one notebook with one solution region."""
    folder = tmp_path / "solutions"
    folder.mkdir()
    notebook(folder / "01_router.ipynb", SOLUTION)
    return folder


def test_build_replace_never_writes_through_a_link_to_a_solution(capsys, solutions, tmp_path):
    exercises = tmp_path / "exercises"
    exercises.mkdir()
    before = (solutions / "01_router.ipynb").read_text()
    (exercises / "01_router.ipynb").symlink_to(solutions / "01_router.ipynb")
    assert main(["build", "--solutions", str(solutions), "--exercises", str(exercises),
                 "--replace"]) == 1
    assert "is a link to" in capsys.readouterr().err
    assert (solutions / "01_router.ipynb").read_text() == before


def test_build_never_writes_through_a_link_outside_the_course(capsys, solutions, tmp_path):
    exercises = tmp_path / "exercises"
    exercises.mkdir()
    mine = tmp_path / "my_notes.ipynb"
    mine.write_text("my notes")
    (exercises / "01_router.ipynb").symlink_to(mine)
    assert main(["build", "--solutions", str(solutions), "--exercises", str(exercises)]) == 1
    assert mine.read_text() == "my notes"


def test_build_check_reports_a_link(capsys, solutions, tmp_path):
    (tmp_path / "exercises").mkdir()
    (tmp_path / "exercises" / "01_router.ipynb").symlink_to(tmp_path / "gone.ipynb")
    assert main(["build", "--check", "--solutions", str(solutions), "--exercises",
                 str(tmp_path / "exercises")]) == 1
    assert "remove the link" in capsys.readouterr().err


def test_build_leaves_no_temporary_files(solutions, tmp_path):
    assert main(["build", "--solutions", str(solutions), "--exercises",
                 str(tmp_path / "exercises")]) == 0
    assert sorted(p.name for p in (tmp_path / "exercises").iterdir()) == ["01_router.ipynb"]


def test_build_keeps_an_edited_exercise_and_says_how_to_replace_it(capsys, solutions, tmp_path):
    exercises = tmp_path / "exercises"
    assert main(["build", "--solutions", str(solutions), "--exercises", str(exercises)]) == 0
    edited = exercises / "01_router.ipynb"
    nb = json.loads(edited.read_text())
    nb["cells"][0]["source"] = "def double(x):\n    return x + x  # my answer\n"
    edited.write_text(json.dumps(nb))
    assert main(["build", "--solutions", str(solutions), "--exercises", str(exercises)]) == 1
    assert "--replace" in capsys.readouterr().err
    assert "my answer" in edited.read_text()


def test_build_into_a_path_under_a_file_is_one_line(capsys, solutions, tmp_path):
    (tmp_path / "afile").write_text("x")
    assert main(["build", "--solutions", str(solutions), "--exercises",
                 str(tmp_path / "afile" / "exercises")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be made" in err[0], err


def test_build_on_a_full_disk_is_one_line_and_writes_nothing(capsys, solutions, tmp_path,
                                                             full_disk):  # noqa: F811
    assert main(["build", "--solutions", str(solutions), "--exercises",
                 str(tmp_path / "exercises")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left" in err[0], err
    assert list((tmp_path / "exercises").iterdir()) == []


def test_a_build_while_another_holds_the_exercises_is_refused_naming_it(capsys, solutions,
                                                                         tmp_path):
    with safe_io.hold_folder(tmp_path / "exercises", "exercise build"):
        assert main(["build", "--solutions", str(solutions), "--exercises",
                     str(tmp_path / "exercises")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"exercise build (pid {os.getpid()}" in err[0], err
    assert not (tmp_path / "exercises" / "01_router.ipynb").exists()


def test_build_of_an_unclosed_solution_region_is_one_line(capsys, solutions, tmp_path):
    notebook(solutions / "02_open.ipynb",
             "def f():\n    ### BEGIN SOLUTION\n    ### HINT: one\n    return 1\n")
    one_line_error(capsys, ["build", "--solutions", str(solutions), "--exercises",
                            str(tmp_path / "exercises")], "02_open.ipynb", "never closed")
    assert not (tmp_path / "exercises" / "01_router.ipynb").exists()


def test_build_of_a_solution_that_is_not_json_is_one_line(capsys, solutions, tmp_path):
    (solutions / "02_bad.ipynb").write_text("{not json")
    one_line_error(capsys, ["build", "--solutions", str(solutions), "--exercises",
                            str(tmp_path / "exercises")], "02_bad.ipynb", "not valid notebook JSON")


def test_build_api_names_its_arguments(solutions, tmp_path):
    refused(lambda: exercise_build.build_exercises(solutions, solutions / "ex"), exercise_build.BuildError,
            "exercises_dir=", absent=("--exercises",))
    edited = tmp_path / "exercises" / "01_router.ipynb"
    exercise_build.build_exercises(solutions, tmp_path / "exercises")
    edited.write_text(edited.read_text().replace("NotImplementedError", "NotImplementedError  #"))
    result = exercise_build.build_exercises(solutions, tmp_path / "exercises")
    assert result.refused and "replace=True" in result.refused[0], result.refused
    assert "--replace" not in result.refused[0]
