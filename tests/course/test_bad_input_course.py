"""Bad or unusual inputs to the builder (`python -m moe_tutorial build`) and the runner
(`python -m moe_tutorial run`), one case each: the right result, or one line (no traceback) that
names the bad value and says how to fix it, and nothing destroyed. The runner's cases use its fast
path (papermill without a kernel, tests/course/test_course.py), so nothing here executes a notebook."""

import json
import logging
import shutil
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("papermill")

from course_helpers import notebook, snapshot  # noqa: E402

from moe_tutorial.cli import main  # noqa: E402
from moe_tutorial.course import exercise_build  # noqa: E402

REGION = ("def double(x):\n    ### BEGIN SOLUTION\n    ### HINT: multiply by two\n"
          "    return 2 * x\n    ### END SOLUTION\n")


def _one_line_error(capsys, *needles: str) -> str:
    """The command printed exactly one line on stderr, an error naming every needle."""
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


# ---------------------------------------------------------------------------------------------
# The builder

def _solutions(root: Path, *sources: str) -> Path:
    """A solutions folder with one notebook per source (one code cell each)."""
    folder = root / "solutions"
    folder.mkdir()
    for number, source in enumerate(sources, start=1):
        nb = {"cells": [{"cell_type": "code", "id": f"c{number}", "metadata": {}, "outputs": [],
                         "execution_count": None, "source": source.splitlines(keepends=True)}],
              "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
        (folder / f"{number:02d}_ex.ipynb").write_text(exercise_build.notebook_json(nb))
    return folder


@pytest.fixture()
def built(tmp_path):
    """A tiny course, built: solutions/01_ex.ipynb and exercises/01_ex.ipynb."""
    solutions = _solutions(tmp_path, REGION)
    assert main(["build", "--solutions", str(solutions)]) == 0
    return tmp_path


def _build(root: Path, *extra: str) -> int:
    return main(["build", "--solutions", str(root / "solutions"), "--exercises",
                 str(root / "exercises"), *extra])


def _edit(exercise: Path) -> str:
    nb = json.loads(exercise.read_text())
    nb["cells"][0]["source"] = ["def double(x):\n", "    return x + x  # my answer\n"]
    exercise.write_text(exercise_build.notebook_json(nb))
    return exercise.read_text()


def test_build_refuses_the_checkouts_notebooks_folder(fake_checkout, capsys):
    shutil.rmtree(fake_checkout / "solutions")
    _solutions(fake_checkout, REGION)
    before = snapshot(fake_checkout)
    assert main(["build", "--exercises", "notebooks"]) == 2
    _one_line_error(capsys, "--exercises notebooks", "inside notebooks/", "never writes into")
    assert snapshot(fake_checkout) == before


def test_build_refuses_the_solutions_folder(built, capsys):
    before = snapshot(built / "solutions")
    assert main(["build", "--solutions", str(built / "solutions"), "--exercises",
                 str(built / "solutions")]) == 2
    _one_line_error(capsys, f"--exercises {built / 'solutions'}", "inside solutions/")
    assert snapshot(built / "solutions") == before


def test_build_refuses_a_folder_inside_the_solutions(built, capsys):
    assert _build(built, "--exercises", str(built / "solutions" / "out")) == 2
    _one_line_error(capsys, "inside solutions/")
    assert not (built / "solutions" / "out").exists()


def test_build_refuses_the_package(built, fake_checkout, capsys):
    assert main(["build", "--solutions", str(built / "solutions"), "--exercises",
                 "moe_tutorial/exercises"]) == 2
    _one_line_error(capsys, "inside moe_tutorial/")
    assert not (fake_checkout / "moe_tutorial" / "exercises").exists()


def test_build_refuses_a_folder_of_other_files(built, capsys):
    other = built / "elsewhere"
    other.mkdir()
    (other / "00_setup.ipynb").write_text("{}")
    (other / "notes.txt").write_text("mine")
    assert main(["build", "--solutions", str(built / "solutions"), "--exercises", str(other)]) == 2
    _one_line_error(capsys, f"--exercises {other} holds files the build did not write",
                    "00_setup.ipynb", "new or empty")
    assert snapshot(other) == {other / "00_setup.ipynb": b"{}", other / "notes.txt": b"mine"}


def test_build_refuses_a_file_as_exercises_folder(built, capsys):
    target = built / "file.txt"
    target.write_text("mine")
    assert main(["build", "--solutions", str(built / "solutions"), "--exercises", str(target)]) == 2
    _one_line_error(capsys, f"--exercises {target} is a file")
    assert target.read_text() == "mine"


def test_build_creates_a_new_exercises_folder(built):
    assert main(["build", "--solutions", str(built / "solutions"), "--exercises",
                 str(built / "new" / "exercises")]) == 0
    assert (built / "new" / "exercises" / "01_ex.ipynb").exists()


def test_build_a_missing_solutions_folder(tmp_path, capsys):
    assert main(["build", "--solutions", str(tmp_path / "nope")]) == 2
    _one_line_error(capsys, f"--solutions {tmp_path / 'nope'} does not exist", "give the folder")


def test_build_solutions_is_a_file(tmp_path, capsys):
    (tmp_path / "solutions.ipynb").write_text("{}")
    assert main(["build", "--solutions", str(tmp_path / "solutions.ipynb")]) == 2
    _one_line_error(capsys, "is not a folder", "give the folder")


def test_build_an_empty_solutions_folder(tmp_path, capsys):
    (tmp_path / "solutions").mkdir()
    assert main(["build", "--solutions", str(tmp_path / "solutions")]) == 2
    _one_line_error(capsys, "no solutions notebooks", "--solutions")


def test_build_a_solution_that_is_not_json(tmp_path, capsys):
    solutions = _solutions(tmp_path, REGION)
    (solutions / "01_ex.ipynb").write_text('{"cells": [\n  {"cell_type": "code",,}\n')
    assert main(["build", "--solutions", str(solutions)]) == 2
    _one_line_error(capsys, "solutions/01_ex.ipynb, line 2: not valid notebook JSON", "restore it")
    assert not (tmp_path / "exercises").exists()


def test_build_a_solution_that_is_json_but_nonotebook(tmp_path, capsys):
    solutions = _solutions(tmp_path, REGION)
    (solutions / "01_ex.ipynb").write_text("[1, 2]")
    assert main(["build", "--solutions", str(solutions)]) == 2
    _one_line_error(capsys, "solutions/01_ex.ipynb is JSON but not a notebook", "cells")


def test_build_a_cell_without_source(tmp_path, capsys):
    solutions = _solutions(tmp_path, REGION)
    nb = json.loads((solutions / "01_ex.ipynb").read_text())
    del nb["cells"][0]["source"]
    (solutions / "01_ex.ipynb").write_text(json.dumps(nb))
    assert main(["build", "--solutions", str(solutions)]) == 2
    _one_line_error(capsys, "solutions/01_ex.ipynb is JSON but not a notebook", "source")


@pytest.mark.parametrize("source,message", [
    ("def f():\n    return 1\n    ### END SOLUTION\n", "line 3: ### END SOLUTION without ### BEGIN SOLUTION"),
    ("def f():\n    ### BEGIN SOLUTION\n    ### HINT: h\n    return 1\n", "line 2: ### BEGIN SOLUTION is never closed"),
    ("def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n", "line 3: ### BEGIN SOLUTION must be followed by"),
    ("### BEGIN SOLUTION\n### HINT: h\nx = 1\n### END SOLUTION\n", "line 1: ### BEGIN SOLUTION must sit inside a function body"),
    ("def f():\n    ### begin solution\n    return 1\n", "line 2: '### begin solution' looks like a solution marker"),
    ("def f():\n    return 1\n", "no solution region"),
], ids=["end-without-begin", "unclosed", "no-hint", "not-in-a-function", "misspelt", "no-region"])
def test_build_malformed_markers(tmp_path, capsys, source, message):
    solutions = _solutions(tmp_path, source)
    assert main(["build", "--solutions", str(solutions)]) == 2
    _one_line_error(capsys, "solutions/01_ex.ipynb", message)
    assert not (tmp_path / "exercises").exists()


def test_build_keeps_an_edited_exercise(built, capsys):
    mine = _edit(built / "exercises" / "01_ex.ipynb")
    assert _build(built) == 1
    err = capsys.readouterr().err
    assert "exercises/01_ex.ipynb: it holds your edits" in err and "build --replace" in err
    assert (built / "exercises" / "01_ex.ipynb").read_text() == mine


def test_build_keeps_an_edited_exercise_when_the_solution_changed(built, capsys):
    mine = _edit(built / "exercises" / "01_ex.ipynb")
    solution = built / "solutions" / "01_ex.ipynb"
    solution.write_text(solution.read_text().replace("multiply by two", "double it"))
    assert _build(built, "--check") == 1
    err = capsys.readouterr().err
    assert "it holds your edits" in err and "copy your work out of exercises/" in err
    assert _build(built) == 1, "the command --check recommends must not destroy the edit"
    assert (built / "exercises" / "01_ex.ipynb").read_text() == mine


def test_build_replace_overwrites_an_edit_when_asked(built):
    _edit(built / "exercises" / "01_ex.ipynb")
    assert _build(built, "--replace") == 0
    assert "multiply by two" in (built / "exercises" / "01_ex.ipynb").read_text()


def test_build_keeps_a_notebook_it_did_not_write(built, capsys):
    (built / "exercises" / "01_ex.ipynb").write_text('{"cells": []}')
    assert _build(built) == 1
    assert "the build did not write it" in capsys.readouterr().err
    assert (built / "exercises" / "01_ex.ipynb").read_text() == '{"cells": []}'


def test_build_keeps_a_truncated_exercise(built, capsys):
    exercise = built / "exercises" / "01_ex.ipynb"
    exercise.write_text(exercise.read_text()[:200])
    half = exercise.read_text()
    assert _build(built) == 1
    assert "--replace" in capsys.readouterr().err
    assert exercise.read_text() == half


def test_build_replaces_an_exercise_that_was_only_run(built):
    exercise = built / "exercises" / "01_ex.ipynb"
    nb = json.loads(exercise.read_text())
    nb["cells"][0]["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["x\n"]}]
    nb["cells"][0]["execution_count"] = 3
    exercise.write_text(exercise_build.notebook_json(nb))
    assert _build(built) == 0
    assert json.loads(exercise.read_text())["cells"][0]["outputs"] == []


def test_build_keeps_a_stale_exercise_with_edits(built, capsys):
    stale = built / "exercises" / "07_old.ipynb"
    shutil.copy(built / "exercises" / "01_ex.ipynb", stale)
    mine = _edit(stale)
    assert _build(built) == 0
    assert "07_old.ipynb has no solutions/07_old.ipynb, but it holds your edits" in capsys.readouterr().out
    assert stale.read_text() == mine


def test_build_keeps_a_stale_notebook_it_did_not_write(built, capsys):
    (built / "exercises" / "07_mine.ipynb").write_text("{}")
    assert _build(built) == 0
    assert "the build did not write it, so the build leaves it" in capsys.readouterr().out
    assert (built / "exercises" / "07_mine.ipynb").read_text() == "{}"


def test_build_deletes_a_stale_exercise_it_wrote(built):
    stale = built / "exercises" / "07_old.ipynb"
    shutil.copy(built / "exercises" / "01_ex.ipynb", stale)
    assert _build(built) == 0 and not stale.exists()


def test_build_check_and_replace_together(built, capsys):
    with pytest.raises(SystemExit) as exit_:
        _build(built, "--check", "--replace")
    assert exit_.value.code == 2
    assert "--replace: not allowed with argument --check" in capsys.readouterr().err


def test_build_leaves_hidden_entries_of_jupyter_alone(built):
    checkpoints = built / "exercises" / ".ipynb_checkpoints"
    checkpoints.mkdir()
    (checkpoints / "01_ex-checkpoint.ipynb").write_text("{}")
    assert _build(built) == 0
    assert (checkpoints / "01_ex-checkpoint.ipynb").read_text() == "{}"


# ---------------------------------------------------------------------------------------------
# The runner

@pytest.fixture()
def nbs(tmp_path):
    folder = tmp_path / "nbs"
    folder.mkdir()
    notebook(folder / "01_a.ipynb", "print(1)", parameters="MODE = ''\nSTEPS = 0\nSEED = 0")
    notebook(folder / "02_b.ipynb", "print(2)", parameters="MODE = ''\nSTEPS = 0")
    return folder


def _run(nbs: Path, out: Path, *extra: str) -> int:
    return main(["run", "--mode", "small", "--notebooks", str(nbs / "01_a.ipynb"),
                 str(nbs / "02_b.ipynb"), "--out", str(out), *extra])


def test_run_twice_into_one_folder(nbs, tmp_path, fast_papermill, capsys):
    out = tmp_path / "out"
    assert _run(nbs, out) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert _run(nbs, out) == 2
    _one_line_error(capsys, f"--out {out} is not empty", "--replace")
    assert snapshot(out) == before


def test_run_into_a_folder_of_other_files(nbs, tmp_path, fast_papermill, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.txt").write_text("mine")
    assert _run(nbs, out) == 2
    _one_line_error(capsys, "is not empty (it holds thesis.txt)")
    assert snapshot(out) == {out / "thesis.txt": b"mine"}


def test_run_replace_into_a_folder_it_did_not_write(nbs, tmp_path, fast_papermill, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "report.html").write_text("my own report")
    assert _run(nbs, out, "--replace") == 2
    _one_line_error(capsys, "not a folder this runner wrote", "--replace leaves it alone")
    assert (out / "report.html").read_text() == "my own report"


def test_run_replace_keeps_files_it_did_not_write(nbs, tmp_path, fast_papermill, capsys):
    out = tmp_path / "out"
    assert _run(nbs, out) == 0
    (out / "notes.txt").write_text("mine")
    assert _run(nbs, out, "--replace") == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "report.html").exists()


def test_run_replace_where_an_output_name_is_not_the_runners(nbs, tmp_path, fast_papermill, capsys):
    out = tmp_path / "out"
    assert main(["run", "--mode", "small", "--notebooks", str(nbs / "01_a.ipynb"), "--out", str(out)]) == 0
    (out / "02_b.ipynb").write_text("my copy")
    capsys.readouterr()
    assert _run(nbs, out, "--replace") == 2
    _one_line_error(capsys, "holds 02_b.ipynb, which the runner did not write")
    assert (out / "02_b.ipynb").read_text() == "my copy" and (out / "report.html").exists()


def test_run_killed_mid_run_leaves_no_report(nbs, tmp_path, fast_papermill):
    out = tmp_path / "out"
    assert _run(nbs, out) == 0
    notebook(nbs / "02_b.ipynb", "STOP", parameters="MODE = ''")
    with pytest.raises(KeyboardInterrupt):
        _run(nbs, out, "--replace")
    assert not (out / "report.html").exists(), "no report outlives the run it describes"


def test_run_failing_notebook_report_says_so(nbs, tmp_path, fast_papermill):
    notebook(nbs / "02_b.ipynb", "FAIL", parameters="MODE = ''")
    assert _run(nbs, tmp_path / "out") == 1
    report = (tmp_path / "out" / "report.html").read_text()
    assert "1 of 2 notebooks ran" in report and "failed on purpose" in report
    assert not [p for p in (tmp_path / "out").iterdir() if p.suffix == ".tmp"]


@pytest.mark.parametrize("folder", ["notebooks", "exercises", "solutions", "moe_tutorial"])
def test_run_into_the_course(nbs, folder, fake_checkout, fast_papermill, capsys):
    before = snapshot(fake_checkout)
    assert _run(nbs, fake_checkout / folder / "run") == 2
    _one_line_error(capsys, f"inside the course's own {folder}/ folder", "--out runs/mine")
    assert snapshot(fake_checkout) == before


def test_run_onto_its_own_source(nbs, fast_papermill, capsys):
    source = (nbs / "01_a.ipynb").read_text()
    assert main(["run", "--mode", "small", "--notebooks", str(nbs / "01_a.ipynb"),
                 "--out", str(nbs)]) == 2
    _one_line_error(capsys, f"--out {nbs}", "would overwrite the notebook", "--out runs/mine")
    assert (nbs / "01_a.ipynb").read_text() == source and not (nbs / "report.html").exists()


def test_run_out_is_a_file(nbs, tmp_path, fast_papermill, capsys):
    (tmp_path / "out").write_text("mine")
    assert _run(nbs, tmp_path / "out") == 2
    _one_line_error(capsys, "is a file, not a folder")
    assert (tmp_path / "out").read_text() == "mine"


@pytest.mark.parametrize("args,flag", [
    (["-p", "MODE=full"], "use --mode full"), (["-p", "LIVE=True"], "use --live"),
    (["--live", "-p", "LIVE=False"], "leave --live out"), (["--device", "cpu", "-p", "DEVICE=cuda"], "use --device cuda"),
], ids=["mode", "live", "live-contradicted", "device-contradicted"])
def test_run_parameter_set_by_a_flag(nbs, tmp_path, fast_papermill, capsys, args, flag):
    assert _run(nbs, tmp_path / "out", *args) == 2
    _one_line_error(capsys, f"-p {args[-1].split('=')[0]}=", flag)
    assert not (tmp_path / "out").exists()


def test_run_unknown_parameter(nbs, tmp_path, fast_papermill, capsys):
    assert _run(nbs, tmp_path / "out", "-p", "STPES=3") == 2
    _one_line_error(capsys, "-p STPES", "STEPS")


def test_run_parameter_of_one_notebook_is_fine(nbs, tmp_path, fast_papermill):
    assert _run(nbs, tmp_path / "out", "-p", "SEED=3") == 0


def test_every_name_of_a_chained_assignment_is_a_parameter(tmp_path, fast_papermill):
    """The chapters' `MODE = DEVICE = LIVE = ""` (papermill's own reader skips that line)."""
    from moe_tutorial.course.run_inputs import parameter_defaults

    nb = notebook(tmp_path / "01_a.ipynb", "print(1)",
                  parameters='MODE = DEVICE = LIVE = ""\nSTEPS = BATCH_SIZE = 0')
    assert parameter_defaults(nb) == {"MODE": "", "DEVICE": "", "LIVE": "", "STEPS": 0,
                                      "BATCH_SIZE": 0}
    assert main(["run", "--notebooks", str(nb), "--out", str(tmp_path / "out"),
                 "-p", "BATCH_SIZE=2"]) == 0


def test_papermill_warns_nothing_about_parameters_the_runner_checked(caplog):
    """papermill's reader warns about a chained assignment and then calls its names unknown;
    where the runner has checked the parameters itself, neither warning reaches the learner."""
    from papermill.translators import PythonTranslator

    from moe_tutorial.course.run_inputs import parameters_already_checked

    cell = {"source": 'MODE = DEVICE = LIVE = ""\nSEED = 0'}
    with caplog.at_level("WARNING"):
        assert [p.name for p in PythonTranslator.inspect(cell)] == ["SEED"]
    assert "Unable to parse line 1" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"), parameters_already_checked():
        PythonTranslator.inspect(cell)
        logging.getLogger("papermill").warning("Passed unknown parameter: MODE")
        logging.getLogger("papermill").warning("something else")
    assert caplog.messages == ["something else"]


def test_run_parameter_only_a_second_parameters_cell_assigns(tmp_path, fast_papermill, capsys):
    """papermill injects after the first cell tagged `parameters`: a later one would undo it."""
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("SEED = 0", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("STEPS = 5", metadata={"tags": ["parameters"]})])
    nbformat.write(nb, tmp_path / "01_a.ipynb")
    assert main(["run", "--notebooks", str(tmp_path / "01_a.ipynb"), "--out",
                 str(tmp_path / "out"), "-p", "STEPS=3"]) == 2
    _one_line_error(capsys, "-p STEPS=3", "no selected notebook has a parameter 'STEPS'", "SEED")


@pytest.mark.parametrize("param", ["STEPS", "1STEPS=3", "=3"])
def test_run_parameter_syntax(nbs, tmp_path, capsys, param):
    with pytest.raises(SystemExit) as exit_:
        _run(nbs, tmp_path / "out", "-p", param)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"expected NAME=VALUE, got {param!r}" in err and "Traceback" not in err


def test_run_unknownnotebook(tmp_path, fake_checkout, capsys):
    assert main(["run", "--notebooks", "99", "--out", str(tmp_path / "out")]) == 2
    _one_line_error(capsys, "notebook '99' not found", "course notebooks: 00_setup")
    assert not (tmp_path / "out").exists()


def test_run_missing_notebook_path(tmp_path, capsys):
    assert main(["run", "--notebooks", str(tmp_path / "01_gone.ipynb"), "--out", str(tmp_path / "o")]) == 2
    _one_line_error(capsys, "01_gone.ipynb", "course notebooks:")


def test_run_notebook_that_is_not_json(nbs, tmp_path, fast_papermill, capsys):
    (nbs / "02_b.ipynb").write_text("{not json")
    assert _run(nbs, tmp_path / "out") == 2
    _one_line_error(capsys, "02_b.ipynb is not a readable notebook", "save it again")
    assert not (tmp_path / "out").exists()


def test_run_two_notebooks_of_one_name(nbs, tmp_path, fast_papermill, capsys):
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(nbs / "01_a.ipynb", other / "01_a.ipynb")
    assert main(["run", "--mode", "small", "--notebooks", str(nbs / "01_a.ipynb"),
                 str(other / "01_a.ipynb"), "--out", str(tmp_path / "out")]) == 2
    _one_line_error(capsys, "two selected notebooks are named 01_a.ipynb", "separate runs")


@pytest.mark.parametrize("timeout", ["0", "-5"])
def test_run_cell_timeout_not_positive(nbs, tmp_path, fast_papermill, capsys, timeout):
    assert _run(nbs, tmp_path / "out", "--cell-timeout", timeout) == 2
    _one_line_error(capsys, f"--cell-timeout {timeout}", "positive", "--cell-timeout 300")


def test_run_unknown_device(nbs, tmp_path, fast_papermill, capsys):
    assert _run(nbs, tmp_path / "out", "--device", "tpu") == 2
    _one_line_error(capsys, "--device 'tpu'", "give cpu or cuda")


def test_run_cuda_without_a_gpu(nbs, tmp_path, fast_papermill, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert _run(nbs, tmp_path / "out", "--device", "cuda") == 2
    _one_line_error(capsys, "--device 'cuda'", "no CUDA GPU", "--device cpu")


def test_run_bad_mode_in_the_environment(nbs, tmp_path, fast_papermill, capsys, monkeypatch):
    monkeypatch.setenv("MOE_TUTORIAL_MODE", "medium")
    assert main(["run", "--notebooks", str(nbs / "01_a.ipynb"), "--out", str(tmp_path / "out")]) == 2
    _one_line_error(capsys, "'medium'", "$MOE_TUTORIAL_MODE", "small")


def test_run_bad_mode_flag(nbs, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--mode", "medium", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and "invalid choice: 'medium'" in capsys.readouterr().err


def test_run_out_cannot_be_created(nbs, tmp_path, fast_papermill, capsys):
    (tmp_path / "file.txt").write_text("mine")
    assert _run(nbs, tmp_path / "file.txt" / "out") == 2
    _one_line_error(capsys, "file.txt/out cannot be written", "give a folder you can write to")
    assert (tmp_path / "file.txt").read_text() == "mine"
