"""The course notebooks: their structure, and every one of them run top to bottom under nbval in
small mode (`pytest --nbval-lax --nbval-current-env notebooks/NN_*.ipynb`), as CI does; the
environment nbval runs in is tests/notebook_conventions.py's. By hand:

    MOE_TUTORIAL_MODE=small python -m pytest --nbval-lax --nbval-current-env notebooks/
"""

import pytest
from notebook_conventions import (
    ROOT,
    assert_parameters_and_no_outputs,
    assert_runs_under_nbval,
    assert_teaching_conventions,
    cells,
    figures_shown,
    source,
    tagged,
)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_the_course_has_notebooks():
    assert [p.stem for p in NOTEBOOKS][:3] == ["00_setup", "01_naive_moe", "02_grouped_linear"]


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_structure(notebook):
    """One `parameters` cell whose defaults come from the environment, a `closing` cell (the
    runner's report shows it), no outputs in git, and nothing that raises on purpose."""
    assert_parameters_and_no_outputs(notebook)
    closing = tagged(notebook, "closing")
    assert closing and all(c["cell_type"] == "code" for c in closing)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_teaches_by_the_course_conventions(notebook):
    """A `recap` cell, a graded `predict` cell, figures with alt text; chapters 01-06 show a
    figure and link their exercise, whose solution links back."""
    assert_teaching_conventions(notebook)
    number = notebook.name[:2]
    if number == "00":
        return
    assert figures_shown(notebook), "a chapter shows at least one figure of its idea"
    exercise = next((ROOT / "exercises").glob(f"{number}_*.ipynb"))
    text = "".join(source(c) for c in cells(notebook) if c["cell_type"] == "markdown")
    assert f"(../exercises/{exercise.name})" in text, f"link the exercise: ../exercises/{exercise.name}"
    solution = ROOT / "solutions" / exercise.name
    back = "".join(source(c) for c in cells(solution) if c["cell_type"] == "markdown")
    assert f"(../notebooks/{notebook.name})" in back, f"{solution.name} should link ../notebooks/{notebook.name}"


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_under_nbval_in_small_mode(notebook):
    assert_runs_under_nbval(str(notebook.relative_to(ROOT)), cell_timeout=300, timeout=900)
