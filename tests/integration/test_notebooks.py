"""The course notebooks: their structure, and every one of them run top to bottom under nbval in
small mode (`pytest --nbval-lax --nbval-current-env notebooks/NN_*.ipynb`), as CI does; the
environment nbval runs in is tests/notebook_conventions.py's. By hand:

    MOE_TUTORIAL_MODE=small python -m pytest --nbval-lax --nbval-current-env notebooks/
"""

import os

import pytest
from notebook_conventions import (
    EXECUTED_RUN_ENV,
    GPU_RECORD_PENDING,
    NOT_RUN,
    ROOT,
    assert_executed_in_small_mode,
    assert_parameters_and_no_outputs,
    assert_runs_under_nbval,
    assert_teaching_conventions,
    cells,
    figures_shown,
    source,
    tagged,
)

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
# 00 and the chapters 01-08; after them, an optional deep dive (09) that teaches no new step: it
# is run and checked for structure like every notebook, without a chapter's teaching shape.
CHAPTERS = [nb for nb in NOTEBOOKS if nb.name[:2] <= "08"]
DEEP_DIVE = "09_deep_dive"


def test_the_course_has_notebooks():
    assert [p.stem for p in NOTEBOOKS][:3] == ["00_setup", "01_naive_moe", "02_grouped_linear"]
    assert NOTEBOOKS[-1].stem == DEEP_DIVE, "the optional deep dive comes after the chapters"


def test_the_deep_dive_reads_committed_runs_and_names_its_prerequisites():
    deep_dive = ROOT / "notebooks" / f"{DEEP_DIVE}.ipynb"
    header = source(cells(deep_dive)[0])
    assert "Prerequisites" in header and "chapter-time" in header
    code = "\n".join(source(c) for c in cells(deep_dive) if c["cell_type"] == "code")
    for reader in ("run_history.", "speed_of_light.committed_section", "idle_gaps.committed"):
        assert reader in code, f"the deep dive reads the committed runs through {reader}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_structure(notebook):
    """One `parameters` cell whose defaults come from the environment, a `closing` cell (the
    runner's report shows it), no outputs in git, and nothing that raises on purpose."""
    assert_parameters_and_no_outputs(notebook)
    closing = tagged(notebook, "closing")
    assert closing and all(c["cell_type"] == "code" for c in closing)


@pytest.mark.parametrize("notebook", CHAPTERS, ids=lambda p: p.stem)
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
def test_notebook_runs_top_to_bottom_in_small_mode(notebook):
    """Under nbval; or, where $MOE_TUTORIAL_EXECUTED_RUN names a `make course` run of these
    sources (CI runs the course first), that run's execution of the notebook."""
    executed_run = os.environ.get(EXECUTED_RUN_ENV)
    if executed_run:
        assert_executed_in_small_mode(notebook, ROOT / executed_run)
    else:
        assert_runs_under_nbval(str(notebook.relative_to(ROOT)), cell_timeout=300, timeout=900)


def test_a_course_run_counts_only_for_the_source_it_ran_in_small_mode(tmp_path):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    source_nb = new_notebook(cells=[new_code_cell("MODE = ''", metadata={"tags": ["parameters"]}),
                                    new_code_cell("x = 1"), new_code_cell("print(x)")])
    notebook = tmp_path / "01_x.ipynb"
    nbformat.write(source_nb, notebook)
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    def executed(*, mode="small", code="print(x)", error=False, counts=(1, 2, 3, 4)):
        ran = new_notebook(cells=[
            new_code_cell("MODE = ''", metadata={"tags": ["parameters"]}),
            new_code_cell(f'MODE = "{mode}"\n', metadata={"tags": ["injected-parameters"]}),
            new_code_cell("x = 1"), new_code_cell(code)])
        for cell, count in zip(ran.cells, counts):
            cell.execution_count = count
        if error:
            ran.cells[-1].outputs = [new_output("error", ename="NameError", evalue="x", traceback=[])]
        nbformat.write(ran, run_dir / notebook.name)

    executed()
    assert_executed_in_small_mode(notebook, run_dir)
    for bad, message in [(dict(mode="full"), "small mode"), (dict(code="print(y)"), "another version"),
                         (dict(error=True), "NameError"), (dict(counts=(1, 2, 3, None)), "every cell")]:
        executed(**bad)
        with pytest.raises(AssertionError, match=message):
            assert_executed_in_small_mode(notebook, run_dir)
    (run_dir / notebook.name).unlink()
    with pytest.raises(AssertionError, match="did not execute"):
        assert_executed_in_small_mode(notebook, run_dir)


MAX_OUTPUT_WORDS = 600  # printed output a learner reads per chapter, in small mode


FIGURE_MIMES = ("image/", "application/vnd.plotly")


def output_words(executed: dict) -> int:
    """Words (2+ letters) of an executed notebook's outputs as a reader sees them: streams, and
    each display's text form (a table's text, not its HTML twin). A figure is seen, not read:
    its text form is the fallback a renderer without it would print, and the course's clock
    times it as a figure (tools/chapter_clock.printed_output)."""
    import re

    words = 0
    for cell in executed["cells"]:
        for output in cell.get("outputs", []):
            if any(mime.startswith(FIGURE_MIMES) for mime in output.get("data", {})):
                continue
            text = output.get("text") or output.get("data", {}).get("text/plain", "")
            words += len(re.findall(r"[A-Za-z]{2,}", "".join(text) if isinstance(text, list) else text))
    return words


@pytest.mark.parametrize("chapter", [nb for nb in CHAPTERS if nb.name[:2] >= "01"], ids=lambda p: p.stem)
def test_a_chapter_prints_at_most_600_words_in_small_mode_and_nothing_not_run(chapter):
    """Of the `make course` run CI names ($MOE_TUTORIAL_EXECUTED_RUN): what a learner reads under
    the cells stays short, and no cell says it did not run where a GPU run could be shown."""
    import json
    import re

    executed_run = os.environ.get(EXECUTED_RUN_ENV)
    if not executed_run:
        pytest.skip(f"needs an executed small-mode run: set ${EXECUTED_RUN_ENV} to a `make course` folder")
    executed = json.loads((ROOT / executed_run / chapter.name).read_text())
    assert output_words(executed) <= MAX_OUTPUT_WORDS, (
        f"{chapter.name} prints {output_words(executed)} words in small mode (at most {MAX_OUTPUT_WORDS})")
    said = [o for c in executed["cells"] for o in c.get("outputs", [])
            if re.search(NOT_RUN, json.dumps(o), re.I)]
    if chapter.stem in GPU_RECORD_PENDING:
        pytest.xfail(f"{chapter.stem}: {GPU_RECORD_PENDING[chapter.stem]}")
    assert not said, f"{chapter.name} has cells that did not run: {said[:2]}"


def test_output_words_read_streams_and_text_forms_only():
    executed = {"cells": [{"outputs": [{"output_type": "stream", "text": ["two words\n"]},
                                       {"output_type": "display_data",
                                        "data": {"text/plain": "three more words", "text/html": "<b>many many</b>"}}]}]}
    assert output_words(executed) == 5
    figure = {"output_type": "display_data",
              "data": {"application/vnd.plotly.v1+json": {}, "text/plain": "<plotly figure: many words>"}}
    executed["cells"][0]["outputs"].append(figure)
    assert output_words(executed) == 5
