"""A course run checks what it is given before any notebook runs: a bad device in the
environment, a `-p` parameter of another kind than its default or out of its range, LIVE given
with `-p` and a notebook that is not JSON are each refused on one line, making no output folder;
a parameter of its default's kind, in range or empty, runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from course_helpers import notebook, one_line_error
from sized_notebooks import sized  # noqa: F401  (a fixture)

from moe_tutorial.cli import main
from moe_tutorial.course import runner


def test_a_bad_device_in_the_environment_stops_a_run_before_any_notebook(
        capsys, fake_checkout, fast_papermill, monkeypatch):
    monkeypatch.setenv("MOE_TUTORIAL_DEVICE", "gpu")
    assert main(["run", "--out", "runs/mine"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "$MOE_TUTORIAL_DEVICE 'gpu'" in err[0], err
    assert not (fake_checkout / "runs" / "mine").exists()


@pytest.mark.parametrize("param, words", [
    ("STEPS=ten", "-p STEPS='ten': STEPS takes an integer, like its default: -p STEPS=0"),
    ("FLAG=1", "-p FLAG=1: FLAG takes True or False"),
    ("SIZES=8", "-p SIZES=8: SIZES takes a list"),
])
def test_a_run_parameter_of_another_kind_than_its_default_is_refused_before_running(
        capsys, fake_checkout, fast_papermill, param, words):
    notebook(fake_checkout / "notebooks" / "01_a.ipynb", "print(1)",
             parameters="MODE = ''\nSTEPS = 0\nFLAG = True\nSIZES = []\nRATE = 0.5")
    assert main(["run", "--out", "runs/mine", "-p", param]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not (fake_checkout / "runs" / "mine").exists()


def test_a_run_parameter_of_its_defaults_kind_runs(fake_checkout, fast_papermill):
    notebook(fake_checkout / "notebooks" / "01_a.ipynb", "print(1)",
             parameters="MODE = ''\nSTEPS = 0\nRATE = 0.5")
    assert main(["run", "--out", "runs/mine", "-p", "STEPS=5", "-p", "RATE=1"]) == 0


@pytest.mark.parametrize("param, words", [
    ("STEPS=-3", ["-p STEPS=-3: STEPS must be an integer >= 1", "-p STEPS=60",
                  "small mode's default 60"]),
    ("SIZES=[2, 0]", ["-p SIZES=[2, 0]: SIZES holds 0", "-p SIZES=[2, 4]"]),
])
def test_a_size_out_of_range_is_refused_before_any_notebook_runs(capsys, sized, param,  # noqa: F811
                                                                 words):
    one_line_error(capsys, ["run", "--mode", "small", "--out", "runs/mine", "-p", param], *words)
    assert not Path("runs/mine").exists()


def test_a_size_in_range_and_an_empty_one_run(sized):  # noqa: F811
    assert runner.run_course(sized, Path("runs/a"), mode="small",
                             parameters={"STEPS": 5, "SIZES": [3]}).ok
    assert runner.run_course(sized, Path("runs/b"), mode="full", parameters={"STEPS": 0}).ok


def test_the_live_parameter_cannot_be_given_with_p(capsys, sized):  # noqa: F811
    one_line_error(capsys, ["run", "--out", "runs/mine", "-p", "LIVE=True"],
                   "LIVE is set by --live", "use --live")


def test_a_run_of_a_notebook_that_is_not_json_is_one_line(capsys, fake_checkout, fast_papermill):
    (fake_checkout / "notebooks" / "01_a.ipynb").write_text("{half a notebook")
    one_line_error(capsys, ["run", "--out", "runs/mine", "--notebooks", "01"],
                   "is not a readable notebook", "--notebooks")
