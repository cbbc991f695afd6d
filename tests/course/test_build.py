"""`python -m moe_tutorial build`: exercises/ generated from solutions/, and `--check`, which CI
runs (test_the_committed_exercises_are_up_to_date) so that a stale exercises/ fails `make test`."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_tutorial.cli import main
from moe_tutorial.course import exercise_build as course

ROOT = Path(__file__).resolve().parents[2]

REGION = '''import torch


def double(x):
    """Twice x."""
    y = x  # before the region
    ### BEGIN SOLUTION
    ### HINT: multiply by two
    y = 2 * x
    ### END SOLUTION
    return y


print("defined")'''


def test_a_region_becomes_a_stub_and_nothing_else_changes():
    stub, regions = course.stub_source(REGION)
    assert regions == 1
    assert stub == REGION.replace(
        '''    ### BEGIN SOLUTION
    ### HINT: multiply by two
    y = 2 * x
    ### END SOLUTION
''', f'''    {course.STUB_COMMENT}
    raise NotImplementedError("multiply by two")
''')
    namespace: dict = {}
    exec(stub, namespace)  # defining the function raises nothing ...
    with pytest.raises(NotImplementedError, match="^multiply by two$"):
        namespace["double"](3)  # ... calling it does


def test_hints_with_quotes_and_several_regions():
    source = ('def f():\n    ### BEGIN SOLUTION\n    ### HINT: use "x" and \'y\' \\ here\n'
              '    pass\n    ### END SOLUTION\n\n\ndef g():\n    if True:\n'
              '        ### BEGIN SOLUTION\n        ### HINT: second\n        return 1\n'
              '        ### END SOLUTION\n')
    stub, regions = course.stub_source(source)
    assert regions == 2
    namespace: dict = {}
    exec(stub, namespace)
    with pytest.raises(NotImplementedError) as info:
        namespace["f"]()
    assert str(info.value) == 'use "x" and \'y\' \\ here'
    assert '        raise NotImplementedError("second")' in stub


@pytest.mark.parametrize("source,message", [
    ("### BEGIN SOLUTION\n### HINT: h\nx = 1\n### END SOLUTION", "must sit inside a function body"),
    ("def f():\n    ### BEGIN SOLUTION\n    x = 1\n    ### END SOLUTION", "must be followed by"),
    ("def f():\n    ### BEGIN SOLUTION\n    ### HINT:\n    x = 1\n    ### END SOLUTION",
     "must be followed by"),
    ("def f():\n    ### BEGIN SOLUTION\n    ### HINT: h\n    x = 1", "is never closed"),
    ("def f():\n    x = 1\n    ### END SOLUTION", "without ### BEGIN SOLUTION"),
    ("def f():\n    ### HINT: h\n    x = 1", "outside a solution region"),
    ("def f():\n    ### BEGIN SOLUTION\n    ### HINT: h\n    ### BEGIN SOLUTION\n    ### END SOLUTION",
     "regions do not nest"),
    ("def f():\n    ### BEGIN SOLUTION\n    ### HINT: h\n\n    ### END SOLUTION", "is empty"),
    ("def f():\n    ### Begin Solution\n    x = 1", "looks like a solution marker"),
])
def test_bad_markers_are_errors_that_say_where(source, message):
    with pytest.raises(course.BuildError, match=message) as info:
        course.stub_source(source, "solutions/09_x.ipynb, cell 3")
    assert str(info.value).startswith("solutions/09_x.ipynb, cell 3, line ")


def _notebook(*cells, metadata=None) -> dict:
    return {"cells": list(cells), "metadata": metadata or {"kernelspec": {"name": "python3"}},
            "nbformat": 4, "nbformat_minor": 5}


def _code(source, **extra) -> dict:
    cell = {"cell_type": "code", "id": f"c{len(source)}", "metadata": {},
            "source": source.splitlines(keepends=True), "outputs": [], "execution_count": None}
    cell.update(extra)
    return cell


def test_exercise_notebook_strips_what_running_leaves_and_keeps_the_rest():
    markdown = {"cell_type": "markdown", "id": "m1", "metadata": {"tags": ["intro"]},
                "source": ["Uses `### BEGIN SOLUTION` in prose: not a marker.\n"]}
    ran = _code("print(1)", outputs=[{"output_type": "stream", "name": "stdout", "text": ["1\n"]}],
                execution_count=7, metadata={"tags": ["parameters"], "execution": {"t": 1}})
    solution = _notebook(markdown, ran, _code(REGION), metadata={
        "kernelspec": {"name": "python3"}, "widgets": {"state": {}}, "papermill": {"x": 1}})
    exercise = course.exercise_notebook(solution)
    assert exercise["cells"][0] == markdown
    assert exercise["cells"][1]["outputs"] == [] and exercise["cells"][1]["execution_count"] is None
    assert exercise["cells"][1]["metadata"] == {"tags": ["parameters"]}
    assert "raise NotImplementedError" in "".join(exercise["cells"][2]["source"])
    assert exercise["metadata"] == {"kernelspec": {"name": "python3"}}
    assert solution["cells"][1]["execution_count"] == 7, "the solution itself is not modified"
    with pytest.raises(course.BuildError, match="no solution region"):
        course.exercise_notebook(_notebook(markdown, ran), "solutions/07_y.ipynb")


def test_model_answers_and_authors_notes_stay_in_the_solution():
    question = {"cell_type": "markdown", "id": "q", "metadata": {}, "source": ["Why?"]}
    answer = {"cell_type": "markdown", "id": "a", "metadata": {"tags": ["answer"]},
              "source": ["Because the loop launches per expert."]}
    note = {"cell_type": "markdown", "id": "n", "metadata": {"tags": ["solution-only"]},
            "source": ["Edit solutions/, then build."]}
    exercise = course.exercise_notebook(_notebook(note, question, answer, _code(REGION)))
    assert [c["id"] for c in exercise["cells"]] == ["q", "a", exercise["cells"][2]["id"]]
    assert "".join(exercise["cells"][1]["source"]) == course.ANSWER_STUB
    assert "Because" not in json.dumps(exercise) and "Edit solutions" not in json.dumps(exercise)
    coded = {"cell_type": "code", "id": "c", "metadata": {"tags": ["answer"]}, "source": ["1"],
             "outputs": [], "execution_count": None}
    with pytest.raises(course.BuildError, match="markdown cell"):
        course.exercise_notebook(_notebook(coded, _code(REGION)))


@pytest.fixture()
def checkout(tmp_path):
    """A copy of solutions/ and exercises/ to build in."""
    shutil.copytree(ROOT / "solutions", tmp_path / "solutions")
    shutil.copytree(ROOT / "exercises", tmp_path / "exercises")
    return tmp_path


def test_build_is_deterministic(checkout):
    shutil.rmtree(checkout / "exercises")
    first = course.build_exercises(checkout / "solutions")
    assert len(first.written) == len(list((checkout / "solutions").glob("*.ipynb"))) >= 5
    before = {p.name: p.read_bytes() for p in (checkout / "exercises").iterdir()}
    second = course.build_exercises(checkout / "solutions")
    assert not second.written and len(second.unchanged) == len(first.written)
    assert before == {p.name: p.read_bytes() for p in (checkout / "exercises").iterdir()}
    assert before == {p.name: p.read_bytes() for p in (ROOT / "exercises").iterdir()}, \
        "the committed exercises are what the build writes"


def test_check_names_the_stale_file_and_the_fix(checkout):
    source = checkout / "solutions" / "01_router_and_loop.ipynb"
    nb = json.loads(source.read_text())
    nb["cells"][0]["source"].append("\nOne more sentence.")
    source.write_text(course.notebook_json(nb))
    (checkout / "exercises" / "02_permute_and_grouped_gemm.ipynb").unlink()
    # an exercise the build wrote whose solution is gone, and a notebook the learner made
    shutil.copy(checkout / "exercises" / "03_mxfp8_blocks.ipynb", checkout / "exercises" / "09_old.ipynb")
    (checkout / "exercises" / "08_mine.ipynb").write_text("{}")
    result = course.build_exercises(checkout / "solutions", check=True)
    assert not result.ok
    problems = "\n".join(result.problems)
    assert ("exercises/01_router_and_loop.ipynb is out of date with "
            "solutions/01_router_and_loop.ipynb (cell 1 differ") in problems
    assert "exercises/02_permute_and_grouped_gemm.ipynb is missing" in problems
    assert "exercises/09_old.ipynb has no solutions/09_old.ipynb: run `build_exercises()`" in problems
    assert "exercises/08_mine.ipynb has no solutions/08_mine.ipynb: the build leaves it" in problems
    assert (checkout / "exercises" / "09_old.ipynb").exists(), "--check writes nothing"
    fixed = course.build_exercises(checkout / "solutions")
    assert fixed.removed == [checkout / "exercises" / "09_old.ipynb"]
    assert (checkout / "exercises" / "08_mine.ipynb").read_text() == "{}", "not the build's to delete"
    assert fixed.kept and "08_mine.ipynb" in fixed.kept[0]
    (checkout / "exercises" / "08_mine.ipynb").unlink()
    assert course.build_exercises(checkout / "solutions", check=True).ok


def test_cli_build_and_check(checkout, capsys):
    args = ["--solutions", str(checkout / "solutions"), "--exercises", str(checkout / "exercises")]
    assert main(["build", "--check", *args]) == 0
    assert "exercises up to date" in capsys.readouterr().out
    (checkout / "exercises" / "03_mxfp8_blocks.ipynb").write_text("{}")
    assert main(["build", "--check", *args]) == 1
    err = capsys.readouterr().err
    assert "exercises/03_mxfp8_blocks.ipynb is out of date" in err
    assert "python -m moe_tutorial build" in err
    assert main(["build", *args]) == 1, "the build did not write that file: it leaves it"
    assert "exercises/03_mxfp8_blocks.ipynb: the build did not write it" in capsys.readouterr().err
    assert (checkout / "exercises" / "03_mxfp8_blocks.ipynb").read_text() == "{}"
    assert main(["build", "--replace", *args]) == 0
    assert "wrote" in capsys.readouterr().out
    broken = checkout / "solutions" / "05_te_ops_grouped_mlp.ipynb"
    broken.write_text(broken.read_text().replace("### END SOLUTION", "### END"))
    assert main(["build", *args]) == 2
    assert "error: solutions/05_te_ops_grouped_mlp.ipynb, cell " in capsys.readouterr().err


def test_the_committed_exercises_are_up_to_date():
    """What CI runs: `python -m moe_tutorial build --check` from the checkout."""
    result = subprocess.run([sys.executable, "-m", "moe_tutorial", "build", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "exercises up to date (8 notebooks)" in result.stdout


def _edit_a_stub(exercise: Path) -> str:
    """What a learner does: replace the first stub with an answer, and save."""
    nb = json.loads(exercise.read_text())
    cell = next(c for c in nb["cells"] if course.STUB_COMMENT in "".join(c["source"]))
    cell["source"] = ["def route(logits, top_k):\n", "    return 'my answer'\n"]
    exercise.write_text(course.notebook_json(nb))
    return exercise.read_text()


def test_build_never_overwrites_a_learners_edit(checkout, capsys):
    """An edited exercise survives the command that `build --check` recommends."""
    exercise = checkout / "exercises" / "01_router_and_loop.ipynb"
    mine = _edit_a_stub(exercise)
    source = checkout / "solutions" / "02_permute_and_grouped_gemm.ipynb"  # the course moves on
    nb = json.loads(source.read_text())
    nb["cells"][0]["source"].append("\nOne more sentence.")
    source.write_text(course.notebook_json(nb))
    args = ["--solutions", str(checkout / "solutions"), "--exercises", str(checkout / "exercises")]
    assert main(["build", "--check", *args]) == 1
    err = capsys.readouterr().err
    assert ("exercises/01_router_and_loop.ipynb is out of date with solutions/01_router_and_loop"
            ".ipynb: it holds your edits, which `python -m moe_tutorial build` keeps") in err
    assert "build --replace" in err
    assert main(["build", *args]) == 1
    err = capsys.readouterr().err
    assert "exercises/01_router_and_loop.ipynb: it holds your edits" in err and "nothing written" in err
    assert exercise.read_text() == mine
    assert "One more sentence" not in (checkout / "exercises" / source.name).read_text(), \
        "all or nothing: a refused build writes no other exercise either"
    assert main(["build", "--replace", *args]) == 0
    assert exercise.read_text() != mine and course.build_exercises(**_dirs(checkout), check=True).ok


def _dirs(checkout: Path) -> dict:
    return {"solutions_dir": checkout / "solutions", "exercises_dir": checkout / "exercises"}


def test_running_an_exercise_is_not_an_edit(checkout):
    """Outputs and execution counts are what running leaves, not work: the build may replace them."""
    exercise = checkout / "exercises" / "01_router_and_loop.ipynb"
    nb = json.loads(exercise.read_text())
    code = next(c for c in nb["cells"] if c["cell_type"] == "code")
    code["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["ran\n"]}]
    code["execution_count"] = 1
    exercise.write_text(course.notebook_json(nb))
    assert course.exercise_state(exercise) == "generated"
    result = course.build_exercises(**_dirs(checkout))
    assert result.written == [exercise] and not result.refused


@pytest.mark.parametrize("folder", ["notebooks", "solutions"])
def test_build_refuses_the_course_folders(checkout, folder, capsys, monkeypatch):
    """`build --exercises notebooks` must not delete the course's notebooks, nor `--exercises
    solutions` overwrite the solutions with stubs. Run in the copy `checkout`, as if it were the
    course's checkout, so that this test can do no harm even to a build without the guard."""
    shutil.copytree(ROOT / "notebooks", checkout / "notebooks")
    (checkout / "moe_tutorial").mkdir()  # a clone has the package's source at its root
    monkeypatch.chdir(checkout)
    before = {p: p.read_bytes() for p in checkout.rglob("*.ipynb")}
    assert main(["build", "--exercises", folder]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --exercises {folder} is inside {folder}/, which the build never "
                   "writes into; give the exercises/ folder (the default) or a new one\n")
    assert {p: p.read_bytes() for p in checkout.rglob("*.ipynb")} == before
    assert course.build_exercises(**_dirs(checkout), check=True).ok, "the build still works"
