"""The documents' measured numbers and the README's chart agree with benchmarks/results/
(tools.docs), and the README is a front door: short, and its first screen says what a
newcomer needs."""

import copy
import json
import re
import shutil
from dataclasses import replace

import pytest

from tools import benchmarks_page, chapter_clock, doc_results, docs
from tools.docs import main

BENCHMARKS = "docs/benchmarks.md"


def _region(text: str, name: str) -> re.Match:
    return next(m for m in doc_results.REGION.finditer(text) if m["name"] == name)


def test_the_committed_documents_agree_with_the_results(capsys):
    assert main(["--check"]) == 0, capsys.readouterr().err


@pytest.fixture
def copy_root(tmp_path):
    """A copy of the README, docs/ and the chart, to edit."""
    shutil.copy(docs.ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(docs.ROOT / "docs", tmp_path / "docs")
    return tmp_path


@pytest.fixture
def edited_number(copy_root):
    """The copy with one number of the training-step table changed by hand."""
    path = copy_root / BENCHMARKS
    text = path.read_text()
    region = _region(text, "h200-train-step")
    number = re.search(r"\| (\d+\.\d) \|", region["body"])
    start = region.start("body") + number.start(1)
    path.write_text(text[:start] + f"{float(number[1]) + 1:.1f}" + text[start + len(number[1]):])
    return copy_root


def test_a_hand_edited_number_fails_the_check_and_names_its_document_and_region(edited_number,
                                                                                  capsys):
    assert main(["--check", "--root", str(edited_number)]) == 1
    err = capsys.readouterr().err
    assert f"{BENCHMARKS}: region 'h200-train-step' differs" in err
    assert err.count("differs from the results") == 1  # only the edited region


def test_docs_restores_the_edited_region(edited_number):
    assert main(["--root", str(edited_number)]) == 0
    assert (edited_number / BENCHMARKS).read_text() == (docs.ROOT / BENCHMARKS).read_text()


def test_a_hand_edited_chart_fails_the_check_and_docs_redraws_it(copy_root, capsys):
    chart = copy_root / docs.CHART
    chart.write_text(chart.read_text().replace("76.6 ms", "66.6 ms"))
    assert main(["--check", "--root", str(copy_root)]) == 1
    assert f"{docs.CHART} differs from what h200.json draws" in capsys.readouterr().err
    assert main(["--root", str(copy_root)]) == 0
    assert chart.read_text() == (docs.ROOT / docs.CHART).read_text()


def test_the_chart_is_drawn_from_the_file_with_its_gpu_and_versions():
    report = doc_results.load_result("h200.json")
    env, chart = report["environment"], docs.train_step_chart()
    for version in (env["gpu"], env["torch"], env["transformer_engine"], env["cuda"]):
        assert version in chart
    steps = [r for r in report["results"] if r["part"] == "train" and r["status"] == "ok"]
    assert chart.count("<rect") == len(steps) + 1 + 3  # background, one bar each, legend
    for row in steps:
        assert f"{row['median_ms']:.1f} ms" in chart
    best = benchmarks_page._train_rows(report)[report["summary"]["train_step_best_variant"]]
    assert f'font-weight="bold">{best["median_ms"]:.1f} ms' in chart


def test_a_missing_document_is_one_line_naming_the_fix(tmp_path, capsys):
    assert main(["--check", "--root", str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "README.md: no such file" in err and "--root" in err


def test_a_lost_region_is_an_error_not_a_silent_pass(copy_root, capsys):
    path = copy_root / BENCHMARKS
    text = path.read_text()
    region = _region(text, "h200-targets")
    path.write_text(text[:region.start()] + text[region.end():])
    assert main(["--check", "--root", str(copy_root)]) == 1
    err = capsys.readouterr().err
    assert "region 'h200-targets' is in no document" in err and err.count("\n") == 1


def test_a_region_in_two_documents_is_an_error(copy_root, capsys):
    readme = copy_root / "README.md"
    body = _region((copy_root / BENCHMARKS).read_text(), "cpu-train")[0]
    readme.write_text(readme.read_text() + "\n" + body + "\n")
    assert main(["--check", "--root", str(copy_root)]) == 1
    assert (f"region 'cpu-train' is in README.md and {BENCHMARKS}"
            in capsys.readouterr().err)


def test_a_region_may_live_in_any_page_under_docs(copy_root, capsys):
    bench, other = copy_root / BENCHMARKS, copy_root / "docs" / "elsewhere.md"
    text = bench.read_text()
    region = _region(text, "cpu-train")
    bench.write_text(text[:region.start()] + text[region.end():])
    other.write_text("# Elsewhere\n\n" + region[0] + "\n")
    assert main(["--check", "--root", str(copy_root)]) == 0, capsys.readouterr().err
    other.write_text(other.read_text().replace("| 40 |", "| 41 |"))
    assert main(["--check", "--root", str(copy_root)]) == 1
    assert "docs/elsewhere.md: region 'cpu-train' differs" in capsys.readouterr().err


def test_links_are_written_from_the_document_that_holds_the_region():
    body = "see [`h200.json`](benchmarks/results/h200.json), [a](#anchor), [b](https://x.org)"
    assert docs._relative_links(body, "README.md") == body
    assert docs._relative_links(body, BENCHMARKS) == body.replace("(benchmarks/", "(../benchmarks/")


def test_mfu_of_fp8_rows_uses_the_fp8_peak_when_the_run_recorded_one():
    old = doc_results.load_result("h200_cudnn_attention_rope.json")  # written before bench measured FP8 peaks
    fp8_rows = [r for r in old["results"] if r["part"] == "train" and r["variant"].endswith("_fp8")]
    assert "not measured" in benchmarks_page.train_step_table(old)
    new = copy.deepcopy(old)
    new.update(dense_fp8_tflops_measured=1500.0, datasheet_fp8_tflops=2000.0)
    for row in new["results"]:
        if row["part"] == "train":
            row["precision"] = "fp8" if row["variant"].endswith("_fp8") else "bf16"
    table = benchmarks_page.train_step_table(new)
    assert "not measured" not in table
    for row in fp8_rows:  # own-precision MFU against FP8, then against bf16 (measured / datasheet)
        own = f"{100 * row['tflops'] / 1500:.1f}% / {100 * row['tflops'] / 2000:.1f}%"
        bf16 = (f"{100 * row['tflops'] / old['dense_bf16_tflops_measured']:.1f}% / "
                f"{100 * row['tflops'] / old['datasheet_bf16_tflops']:.1f}%")
        assert f"| {own} | {bf16} |" in table


# ---------------------------------------------------------------------------------------------
# The chapter table: reading time estimated, run time measured

def _notebook(path, markdown: str = "", code: str = ""):
    cells = [{"cell_type": "markdown", "metadata": {}, "source": [markdown]},
             {"cell_type": "code", "metadata": {}, "source": [code], "outputs": [],
              "execution_count": None}]
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4,
                                "nbformat_minor": 5}))
    return path


def _work_of_source(work):
    """The part of a Work the notebook's sources give (no run)."""
    return (work.prose_words, work.code_lines, work.predictions, work.figures)


@pytest.mark.parametrize("words, code_lines, minutes", [
    (0, 0, 5),            # a minimum of 5
    (1000, 0, 5),         # 1000 words at 170 a minute: 5.9 minutes
    (1200, 0, 5),         # 7.1 minutes: to the nearest 5
    (1300, 0, 10),        # 7.6 rounds up
    (1000, 100, 20),      # + 100 lines at 8 a minute: 18.4
])
def test_reading_minutes_counts_prose_and_code(tmp_path, words, code_lines, minutes):
    code = "\n".join(["x = 1", "", "# a comment, not counted", "   "] * code_lines)
    path = _notebook(tmp_path / "01_x.ipynb", " ".join(["word"] * words), code)
    assert chapter_clock.reading_minutes(path) == minutes


def _tiny_chapter(folder):
    """A chapter of 400 prose words, a picture, 20 code lines and one prediction (and a call of
    another module's `predict`, which is no prediction of the learner's)."""
    code = "\n".join(["guess = widgets.predict('How fast?', ['1x', '2x'])",
                      "peak = memory.predict(config)", "# a comment", ""]
                     + [f"x{i} = {i}" for i in range(18)])
    return _notebook(folder / "01_tiny.ipynb", " ".join(["word"] * 400) + "\n![a figure](f.svg)",
                     code)


def _with_outputs(path):
    """The notebook at `path` as a run leaves it: a progress bar, a printed table, an HTML table,
    a plotly figure, a live widget's placeholder."""
    nb = json.loads(path.read_text())
    nb["cells"][1]["outputs"] = [
        {"output_type": "stream", "name": "stderr",
         "text": ["train:  10% one two\rtrain: 100% one two\n"]},           # 4 words shown
        {"output_type": "stream", "name": "stdout", "text": ["step loss\n", "1 2.97\n"]},  # 4
        {"output_type": "display_data", "metadata": {},
         "data": {"text/html": ["<style>p {x: y}</style><table><tr><td>a</td><td>b</td>"
                                "<td>&lt;c&gt;</td></tr></table>"],
                  "text/plain": ["<Table of three words and more>"]}},    # 3, from the HTML
        {"output_type": "display_data", "metadata": {},
         "data": {"application/vnd.plotly.v1+json": {}, "text/html": ["<div>plot</div>"]}},
        {"output_type": "display_data", "metadata": {},
         "data": {"application/vnd.jupyter.widget-view+json": {"model_id": "x"},
                  "text/plain": ["FigureWidget({...})"]}},
        {"output_type": "execute_result", "execution_count": 1, "metadata": {},
         "data": {"text/plain": ["0.5"]}},                                  # 1
    ]
    path.write_text(json.dumps(nb))
    return path


def test_the_clock_on_a_tiny_notebook(tmp_path):
    """The written method, applied: every count the clock reads, and the minutes they give."""
    chapter = _tiny_chapter(tmp_path)
    work = chapter_clock.notebook_work(chapter)
    assert _work_of_source(work) == (400 + 2, 20, 1, 1)  # "a figure": two words of alt text
    assert chapter_clock.printed_output(_with_outputs(chapter)) == (4 + 4 + 3 + 1, 1)
    run = {"notebook": "01_tiny", "seconds": 90.0, "printed_words": 400, "printed_figures": 1}
    work = chapter_clock.chapter_work(chapter, run)
    parts = work.parts()
    assert parts["prose"] == pytest.approx(402 / chapter_clock.PROSE_WORDS_PER_MINUTE)
    assert parts["printed output"] == pytest.approx(400 / chapter_clock.PRINTED_WORDS_PER_MINUTE)
    assert parts["code"] == pytest.approx(20 / chapter_clock.CODE_LINES_PER_MINUTE)
    assert parts["run"] == pytest.approx(1.5)
    assert parts["predictions"] == chapter_clock.MINUTES_PER_PREDICTION
    assert parts["figures"] == 2 * chapter_clock.MINUTES_PER_FIGURE  # the markdown's and the run's
    # 2.01 + 2 + 2 + 1.5 + 2 + 1 = 10.51 minutes, stated as 10
    assert work.exact_minutes() == pytest.approx(11.3647, abs=1e-3)
    assert work.minutes() == 10
    assert chapter_clock.chapter_work(chapter, {**run, "seconds": 240.0}).minutes() == 15  # 13.01
    # A run of this very version, or one recorded before runs kept a digest, is not stale; a
    # run of an earlier version is, and says so.
    assert not work.stale
    assert not chapter_clock.chapter_work(chapter, {**run, "source_digest": chapter_clock.source_digest(chapter)}).stale
    assert chapter_clock.chapter_work(chapter, {**run, "source_digest": "an earlier one"}).stale


def test_a_notebooks_digest_ignores_what_a_run_and_docs_add(tmp_path):
    chapter = _tiny_chapter(tmp_path)
    nb = json.loads(chapter.read_text())
    header = nb["cells"][0]["source"][0]
    nb["cells"][0]["source"] = [header + "\n" + doc_results.region_block("chapter-time", "*about 5 min*")]
    chapter.write_text(json.dumps(nb))
    digest = chapter_clock.source_digest(chapter)
    # Executed: the parameters papermill injects, outputs, the region's text rewritten by docs
    nb["cells"][0]["source"] = [header + "\n" + doc_results.region_block("chapter-time", "*about 10 min*")]
    nb["cells"].insert(1, {"cell_type": "code", "metadata": {"tags": ["injected-parameters"]},
                           "source": ["MODE = 'small'"], "outputs": [], "execution_count": 1})
    chapter.write_text(json.dumps(_with_outputs_of(nb)))
    assert chapter_clock.source_digest(chapter) == digest
    nb["cells"][2]["source"] = ["x = 2"]  # an edit of the chapter
    chapter.write_text(json.dumps(nb))
    assert chapter_clock.source_digest(chapter) != digest


def _with_outputs_of(nb):
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["hi\n"]}]
    return nb


def test_an_exercise_counts_what_the_learner_reads_and_what_they_write(tmp_path, monkeypatch):
    exercises, solutions = tmp_path / "exercises", tmp_path / "solutions"
    exercises.mkdir(), solutions.mkdir()
    monkeypatch.setattr(chapter_clock, "SOLUTIONS", solutions)
    solved = ("def f(x):\n    ### BEGIN SOLUTION\n    ### HINT: add one\n    return x + 1\n"
              "    ### END SOLUTION\n\ndef g(x):\n    ### BEGIN SOLUTION\n    ### HINT: double\n"
              "    return 2 * x\n    ### END SOLUTION")
    _notebook(solutions / "01_ex.ipynb", "Why? " * 300, solved)
    nb = json.loads((solutions / "01_ex.ipynb").read_text())
    nb["cells"].append({"cell_type": "markdown", "metadata": {"tags": ["answer"]},
                        "source": ["The model answer."]})
    (solutions / "01_ex.ipynb").write_text(json.dumps(nb))
    stubbed = ("def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError('add one')\n\n"
               "def g(x):\n    # YOUR CODE HERE\n    raise NotImplementedError('double')")
    exercise = _notebook(exercises / "01_ex.ipynb", "Why? " * 300, stubbed)
    work = chapter_clock.exercise_work(exercise)
    assert (work.prose_words, work.code_lines, work.functions, work.open_questions) == (300, 4, 2, 1)
    # 1.5 + 0.4 + 2 × 10 + 3 = 24.9 minutes, stated as 25
    assert work.exact_minutes() == pytest.approx(25.2647, abs=1e-3) and work.minutes() == 25
    assert work.optional is None  # no "Going further (optional)" section


def _cell(kind, text, tags=()):
    cell = {"cell_type": kind, "metadata": {"tags": list(tags)} if tags else {}, "source": [text]}
    return cell | ({"outputs": [], "execution_count": None} if kind == "code" else {})


def test_an_exercises_optional_section_is_timed_apart(tmp_path, monkeypatch):
    """From its "Going further (optional)" heading to the next level-2 heading (the score), an
    exercise's last section is counted by the same rates, but apart: not in its minutes."""
    exercises, solutions = tmp_path / "exercises", tmp_path / "solutions"
    exercises.mkdir(), solutions.mkdir()
    monkeypatch.setattr(chapter_clock, "SOLUTIONS", solutions)

    def notebook(task, optional_task):
        cells = [_cell("markdown", "## 1. A task\n\n" + "Why? " * 200), _cell("code", task),
                 _cell("markdown", "## Open question\n\nWhy?"),
                 _cell("markdown", "A model answer.", ["answer"]),
                 _cell("markdown", chapter_clock.OPTIONAL_SECTION + "\n\n" + "More? " * 400),
                 _cell("markdown", "### A heading inside the section"),
                 _cell("code", optional_task + "\nprint(g(1))"),
                 _cell("markdown", "A model answer.", ["answer"]),
                 _cell("markdown", "## Your score"), _cell("code", "checks.summary()")]
        return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}

    solved = ("def f(x):\n    ### BEGIN SOLUTION\n    ### HINT: add one\n    return x + 1\n"
              "    ### END SOLUTION")
    stub = "def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError('add one')"
    (solutions / "01_ex.ipynb").write_text(json.dumps(notebook(solved, solved.replace("f(", "g("))))
    exercise = exercises / "01_ex.ipynb"
    exercise.write_text(json.dumps(notebook(stub, stub.replace("f(", "g("))))
    work = chapter_clock.exercise_work(exercise)
    # the exercise: 3 + 200 + 3 + 3 + 2 words (the score's heading ends the optional section), 2 + 1
    # code lines, one function, one open question: 211/170 + 3/8 + 10 + 3 = 14.616 min, stated as 15
    assert (work.prose_words, work.code_lines, work.functions, work.open_questions) == (211, 3, 1, 1)
    assert work.exact_minutes() == pytest.approx(14.6162, abs=1e-3) and work.minutes() == 15
    # the optional section: 3 + 400 + 5 + 3 words, 2 + 1 code lines (the stub and the print), one
    # function, one open question: 411/170 + 3/8 + 10 + 3 = 15.793 min, stated as 15
    extra = work.optional
    assert (extra.prose_words, extra.code_lines, extra.functions, extra.open_questions) == (411, 3, 1, 1)
    assert extra.exact_minutes() == pytest.approx(15.7926, abs=1e-3) and extra.minutes() == 15
    assert extra.optional is None


def test_the_tables_state_an_exercises_optional_section_apart(monkeypatch):
    extra = chapter_clock.Work(prose_words=340, functions=1)  # 340/170 + 10 = 12 minutes, stated as 10
    real = chapter_clock.exercise_work

    def with_extra(exercise):
        work = real(exercise)
        return replace(work, optional=extra) if exercise.stem.startswith("02_") else work

    monkeypatch.setattr(chapter_clock, "exercise_work", with_extra)
    table = chapter_clock.chapter_times()
    row = next(line for line in table.splitlines() if "[02_grouped_linear]" in line)
    assert f"{real(chapter_clock.exercise_of(chapter_clock.NOTEBOOKS / '02_grouped_linear.ipynb')).minutes()} min " \
           "(+ 10 min optional) |" in row
    counted = [chapter_clock.exercise_of(n) for n in chapter_clock.chapter_notebooks()
               if n.stem not in chapter_clock.OPTIONAL_NOTEBOOKS]
    works = [with_extra(e) for e in counted if e is not None]
    total = next(line for line in table.splitlines() if line.startswith("| **in all**"))
    assert (f"**{chapter_clock._hours(sum(w.minutes() for w in works))}** (+ "
            f"{chapter_clock._hours(sum(w.optional.minutes() for w in works if w.optional))} optional) |"
            in total)
    assert "*Going further (optional)*, is timed apart" in table
    clock = chapter_clock.clock_table()
    assert "| 02_permute_and_grouped_gemm, going further (optional) | 340 | 0 | 1 | 0 | 0 | 0 | " \
           "12.0 → **10** |" in clock


def test_the_chapter_table_states_chapters_and_exercises_apart_with_totals():
    run = doc_results.load_result(chapter_clock.COURSE_RUN)
    table = chapter_clock.chapter_times()
    runs = {r["notebook"]: r for r in run["runs"]}
    counted = [n for n in chapter_clock.chapter_notebooks() if n.stem not in chapter_clock.OPTIONAL_NOTEBOOKS]
    chapters = exercises = extras = 0
    for notebook in chapter_clock.chapter_notebooks():
        row = next(line for line in table.splitlines() if f"[{notebook.stem}]" in line)
        assert chapter_clock.CHAPTER_LESSONS[notebook.stem] in row
        work = chapter_clock.chapter_work(notebook, runs.get(notebook.stem))
        assert f"| {work.minutes()} min" in row
        exercise = chapter_clock.exercise_of(notebook)
        if exercise is not None:
            done = chapter_clock.exercise_work(exercise)
            optional = f" (+ {done.optional.minutes()} min optional)" if done.optional else ""
            assert f"[{exercise.stem}](exercises/{exercise.name}): " \
                   f"{done.minutes()} min{optional} |" in row
        if notebook in counted and exercise is not None:
            done = chapter_clock.exercise_work(exercise)
            exercises += done.minutes()
            extras += done.optional.minutes() if done.optional else 0
        if notebook in counted:
            chapters += work.minutes()
    total = sum(runs[n.stem]["seconds"] for n in counted)
    optional = f" (+ {chapter_clock._hours(extras)} optional)" if extras else ""
    assert (f"| **{chapter_clock._hours(chapters)}** | **{chapter_clock._hours(exercises)}**{optional} | "
            f"**{chapter_clock._duration(total)}** |") in table
    assert run["environment"]["torch"] in table


def test_an_optional_deep_dive_is_listed_after_the_total_and_not_counted(tmp_path, monkeypatch):
    for notebook in chapter_clock.chapter_notebooks():
        shutil.copy(notebook, tmp_path / notebook.name)
    monkeypatch.setattr(chapter_clock, "NOTEBOOKS", tmp_path)
    before = chapter_clock.chapter_times()
    deep_dive = next(iter(chapter_clock.OPTIONAL_NOTEBOOKS))
    _notebook(tmp_path / f"{deep_dive}.ipynb", " ".join(["word"] * 3000), "x = 1")
    after = chapter_clock.chapter_times().splitlines()
    total = next(i for i, line in enumerate(after) if line.startswith("| **in all**"))
    assert after[total] in before.splitlines()  # the same totals
    assert after[total + 1].startswith(f"| [{deep_dive}](notebooks/{deep_dive}.ipynb) | Optional")
    work = chapter_clock.chapter_work(tmp_path / f"{deep_dive}.ipynb", chapter_clock._runs().get(deep_dive))
    assert work.minutes() >= 15 and f"| {work.minutes()} min" in after[total + 1]


def test_the_check_fails_when_a_chapter_or_an_exercise_changes_without_docs(copy_root, tmp_path,
                                                                            monkeypatch, capsys):
    chapters, exercises = tmp_path / "chapters", tmp_path / "exercises"
    committed = chapter_clock.NOTEBOOKS / "01_naive_moe.ipynb"
    shutil.copytree(chapter_clock.NOTEBOOKS, chapters)
    shutil.copytree(chapter_clock.EXERCISES, exercises)
    monkeypatch.setattr(chapter_clock, "NOTEBOOKS", chapters)
    monkeypatch.setattr(chapter_clock, "EXERCISES", exercises)
    assert main(["--check", "--root", str(copy_root)]) == 0, capsys.readouterr().err
    _notebook(chapters / "01_naive_moe.ipynb", " ".join(["word"] * 6000), "x = 1")
    assert main(["--check", "--root", str(copy_root)]) == 1
    err = capsys.readouterr().err
    assert "README.md: region 'chapter-times' differs" in err
    assert "docs/course.md: region 'clock' differs" in err
    shutil.copy(committed, chapters / "01_naive_moe.ipynb")
    first = sorted(exercises.glob("01_*.ipynb"))[0]
    _notebook(first, " ".join(["word"] * 6000), "x = 1")
    assert main(["--check", "--root", str(copy_root)]) == 1
    assert "region 'chapter-times' differs" in capsys.readouterr().err


def _executed(folder, name, mode="small", duration=12.3, exception=None):
    path = _with_outputs(_notebook(folder / f"{name}.ipynb", "text", "x = 1"))
    nb = json.loads(path.read_text())
    nb["metadata"]["papermill"] = {"duration": duration, "exception": exception,
                                   "parameters": {"MODE": mode, "LIVE": False},
                                   "start_time": "2026-12-05T09:14:07+00:00"}
    path.write_text(json.dumps(nb))


@pytest.fixture
def results_dir(tmp_path, monkeypatch):
    folder = tmp_path / "results"
    folder.mkdir()
    monkeypatch.setattr(doc_results, "RESULTS", folder)
    monkeypatch.setattr(chapter_clock, "RESULTS", folder)  # where a recorded run is written
    return folder


def test_record_run_writes_each_notebooks_time_with_the_machine(tmp_path, results_dir, capsys):
    run = tmp_path / "run"
    run.mkdir()
    _executed(run, "00_setup", duration=12.34)
    _executed(run, "01_naive_moe", duration=60.0)
    (run / "report.html").write_text("not a notebook")
    assert main(["--record-run", str(run)]) == 0
    out = results_dir / "cpu_course_small.json"
    assert f"wrote {out}" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert [(r["notebook"], r["seconds"]) for r in record["runs"]] == [("00_setup", 12.3),
                                                                     ("01_naive_moe", 60.0)]
    # What each notebook printed, for the clock (`_with_outputs`: 12 words, one figure)
    assert {(r["printed_words"], r["printed_figures"]) for r in record["runs"]} == {(12, 1)}
    assert record["runs"][0]["source_digest"] == chapter_clock.source_digest(run / "00_setup.ipynb")
    assert record["mode"] == "small" and record["total_s"] == 72.3
    for key in ("torch", "python", "cpu_count", "cpu_model", "date"):
        assert key in record["environment"]
    # An earlier record stays unless --replace says otherwise
    assert main(["--record-run", str(run)]) == 1
    assert "exists; pass --replace" in capsys.readouterr().err
    assert main(["--record-run", str(run), "--replace"]) == 0


def test_record_run_joins_a_run_in_parts(tmp_path, results_dir):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    _executed(first, "00_setup", duration=10.0)
    _executed(second, "01_naive_moe", duration=20.0)
    assert main(["--record-run", str(second), str(first), "--note", "in two parts"]) == 0
    record = json.loads((results_dir / "cpu_course_small.json").read_text())
    assert [r["notebook"] for r in record["runs"]] == ["00_setup", "01_naive_moe"]
    assert record["total_s"] == 30.0 and record["note"] == "in two parts"


@pytest.mark.parametrize("argv", [["--replace"], ["--note", "n"], ["--check", "--record-run", "x"],
                                  ["--root", "x", "--record-run", "x"]])
def test_record_runs_options_outside_it_are_refused(argv, capsys):
    assert main([*argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("docs: ") and err.count("\n") == 1


@pytest.mark.parametrize("problem, message", [
    ("failed", "did not run to its end"),
    ("modes", "ran in modes"),
    ("empty", "no executed notebooks"),
    ("twice", "is in two of the folders"),
])
def test_record_run_refuses_a_run_it_cannot_vouch_for(tmp_path, results_dir, capsys, problem,
                                                      message):
    run, other = tmp_path / "run", tmp_path / "other"
    run.mkdir(), other.mkdir()
    if problem != "empty":
        _executed(run, "00_setup")
        _executed(run, "01_naive_moe", mode="full" if problem == "modes" else "small",
                  exception=True if problem == "failed" else None)
    _executed(other, "00_setup" if problem == "twice" else "02_grouped_linear")
    assert main(["--record-run", str(run), str(other)]) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not list(results_dir.iterdir())


# ---------------------------------------------------------------------------------------------
# The README as a front door

def test_the_readme_fits_in_12_kb():
    assert len((docs.ROOT / "README.md").read_bytes()) <= 12 * 1024


def test_the_readmes_first_45_lines_say_what_a_newcomer_needs():
    first = "\n".join((docs.ROOT / "README.md").read_text().splitlines()[:45])
    for needed in ("make lab", "00_setup", "make course", "make test",  # how to start
                   "Know first", "**For**",  # for whom, and what to know first
                   "| CPU |", "| Hopper", "| Blackwell",  # what each kind of hardware gets
                   "chapter time", "its exercise", "**in all**"):  # how long it takes
        assert needed in first, needed
    for notebook in chapter_clock.chapter_notebooks():  # what each chapter teaches, and its times
        if notebook.stem not in chapter_clock.OPTIONAL_NOTEBOOKS:  # those come after the total
            assert f"[{notebook.stem}]" in first, notebook.stem


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", docs.documents(), ids=str)
def test_links_between_the_pages_lead_to_files_and_headings(page):
    path = docs.ROOT / page
    for target, anchor in re.findall(r"\]\(([^)#:\s]*)(?:#([^)\s]+))?\)", path.read_text()):
        if target == "docs/gpu.md" or (target == "gpu.md" and page.startswith("docs/")):
            continue  # the GPU page is written alongside, not by this generator
        linked = (path.parent / target).resolve() if target else path
        assert linked.exists(), f"{page} links {target}"
        if anchor and linked.suffix == ".md":
            text = linked.read_text()
            headings = re.findall(r"^#+ (.+)$", text, re.MULTILINE)
            explicit = re.findall(r'<a id="([^"]+)"></a>', text)  # the glossary's anchors
            assert anchor in {_slug(h) for h in headings} | set(explicit), \
                f"{page} links {target}#{anchor}"


# ---------------------------------------------------------------------------------------------
# Each chapter's header states its reading and run time

HEADER_REGION = ('    "<!-- BEGIN generated: chapter-time (python -m tools.docs) -->\\n",\n'
                 '    "<!-- END generated: chapter-time -->\\n",\n')


def _with_time_region(path):
    """The notebook at `path` with an empty chapter-time region: its own region's body removed,
    or an empty region added after its title line."""
    text = path.read_text(encoding="utf-8")
    if "<!-- BEGIN generated: chapter-time" in text:
        lines = text.splitlines(keepends=True)
        begin = next(i for i, line in enumerate(lines) if "BEGIN generated: chapter-time" in line)
        end = next(i for i, line in enumerate(lines) if "END generated: chapter-time" in line)
        path.write_text("".join(lines[:begin + 1] + lines[end:]), encoding="utf-8")
        return path
    title = re.search(r'^    "# .*\\n",\n', text, re.MULTILINE)
    path.write_text(text[:title.end()] + HEADER_REGION + text[title.end():], encoding="utf-8")
    return path


@pytest.fixture
def notebooks_root(copy_root):
    """The copy, with the chapters; 01 with an empty chapter-time region in its header."""
    shutil.copytree(docs.ROOT / "notebooks", copy_root / "notebooks")
    _with_time_region(copy_root / "notebooks" / "01_naive_moe.ipynb")
    return copy_root


def test_a_chapter_header_gets_its_reading_and_run_time_and_the_check_sees_drift(notebooks_root,
                                                                                capsys):
    chapter = notebooks_root / "notebooks" / "01_naive_moe.ipynb"
    assert main(["--check", "--root", str(notebooks_root)]) == 1
    assert "notebooks/01_naive_moe.ipynb: region 'chapter-time' differs" in capsys.readouterr().err
    empty = chapter.read_text(encoding="utf-8")
    assert main(["--root", str(notebooks_root)]) == 0
    assert main(["--check", "--root", str(notebooks_root)]) == 0, capsys.readouterr().err
    filled = chapter.read_text(encoding="utf-8")
    header = docs._header(filled)
    run = doc_results.load_result(chapter_clock.COURSE_RUN)
    entry = chapter_clock._runs()["01_naive_moe"]
    work = chapter_clock.chapter_work(chapter, entry)
    exercise = chapter_clock.exercise_of(chapter)
    assert (f"Time: about {work.minutes()} min to read, run and predict; its exercise, "
            f"`{exercise.stem}`, about {chapter_clock.exercise_work(exercise).minutes()} min") in header
    assert (f"run ({run['mode']} mode, {run['environment']['cpu_count']} CPU cores): "
            f"{chapter_clock._duration(entry['seconds'])}") in header
    # Only the region's lines changed; the rest of the file keeps its layout byte for byte.
    added = [line for line in filled.splitlines() if line not in empty.splitlines()]
    assert len(added) == 1 and "Time: about" in added[0]
    # The region's own words do not count: the time it states does not move the time it states
    assert chapter_clock.notebook_work(chapter) == chapter_clock.notebook_work(docs.ROOT / "notebooks" / chapter.name)
    chapter.write_text(filled.replace("Time: about", "Time: roughly"), encoding="utf-8")
    assert main(["--check", "--root", str(notebooks_root)]) == 1
    # The other chapters have no region: left as they are.
    for other in (notebooks_root / "notebooks").glob("0[2-8]_*.ipynb"):
        assert other.read_bytes() == (docs.ROOT / "notebooks" / other.name).read_bytes()


def test_a_chapter_time_marker_without_its_partner_is_one_line_naming_the_fix(notebooks_root,
                                                                              capsys):
    chapter = notebooks_root / "notebooks" / "01_naive_moe.ipynb"
    text = chapter.read_text(encoding="utf-8")
    chapter.write_text(text.replace("<!-- END generated: chapter-time -->", ""), encoding="utf-8")
    assert main(["--check", "--root", str(notebooks_root)]) == 1
    err = capsys.readouterr().err
    assert "01_naive_moe.ipynb: the first markdown cell's chapter-time markers do not pair up" in err
    assert err.count("\n") == 1


def test_reading_minutes_leave_out_generated_regions(tmp_path):
    region = doc_results.region_block("chapter-time", " ".join(["word"] * 500))
    plain = _notebook(tmp_path / "01_a.ipynb", " ".join(["word"] * 1000))
    with_region = _notebook(tmp_path / "01_b.ipynb", " ".join(["word"] * 1000) + "\n" + region)
    assert chapter_clock.reading_minutes(plain) == chapter_clock.reading_minutes(with_region) == 5


def test_each_not_adopted_candidate_names_a_commit_that_has_its_code_and_rows():
    """The measured report's not-adopted table points at a commit whose package still holds the
    candidate (it left the package since), and shows every committed row of it that ran beside
    its base variant."""
    import subprocess

    from moe_tutorial.perf.bench import committed_train_runs

    body = _region((docs.ROOT / BENCHMARKS).read_text(), "not-adopted")["body"]
    # what the commit must still hold
    code = {"_step_in_backward": "class StepInBackward",
            "_host_counts": "def _te_permute_with_host_counts"}
    shown_rows = 0
    for marker, _, commit, path in benchmarks_page.NOT_ADOPTED:
        shown = subprocess.run(["git", "show", f"{commit}:{path}"],
                               cwd=docs.ROOT, capture_output=True, text=True)
        if shown.returncode != 0 and "unknown revision" in shown.stderr:
            pytest.skip(f"no git history with {commit} here")
        assert code[marker] in shown.stdout, shown.stderr
        assert f"commit `{commit}`, `{path}`" in body
        for _, report in committed_train_runs():
            train = benchmarks_page._train_rows(report)
            for name, row in train.items():
                if marker in name and name.replace(marker, "", 1) in train:
                    shown_rows += 1
                    assert f"→ {row['median_ms']:.1f} |" in body, name
    rows = [line for line in body.splitlines()
            if line.startswith("| ") and "without → with it" not in line]
    assert shown_rows == len(rows)  # those rows, nothing else


def test_code_kept_at_a_commit_is_there():
    """Where a page says a candidate's code left the package and names the commit that keeps it
    (`commit `X`, `path``, `git show X:path`), that commit holds that file: the reader can look."""
    import subprocess

    pages = [*sorted((docs.ROOT / "docs").glob("*.md")), docs.ROOT / "notebooks" / "09_deep_dive.ipynb"]
    named = set()
    for page in pages:
        text = page.read_text()
        named |= set(re.findall(r"commit `([0-9a-f]{7,40})`,\s+`([\w/.]+\.py)`", text))
        named |= set(re.findall(r"git show\s+([0-9a-f]{7,40}):([\w/.]+\.py)", text))
    assert ("d0c4ad4", "moe_tutorial/moe/experts/sync_free.py") in named
    def in_git(name: str) -> bool:
        return subprocess.run(["git", "cat-file", "-e", name], cwd=docs.ROOT,
                              capture_output=True).returncode == 0

    for commit, path in sorted(named):
        if not in_git(f"{commit}^{{commit}}"):
            pytest.skip(f"no git history with {commit} here")
        assert in_git(f"{commit}:{path}"), f"{commit} has no {path}"
