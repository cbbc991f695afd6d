"""The course runner (`python -m moe_tutorial run`): papermill execution, stop on failure, report."""

import json
import os
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("papermill")

from course_helpers import notebook, snapshot  # noqa: E402

from moe_tutorial.cli import main  # noqa: E402
from moe_tutorial.course import report, run_inputs  # noqa: E402
from moe_tutorial.course import runner as course  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "notebooks" / "00_setup.ipynb"





@pytest.fixture(scope="module")
def setup_run(tmp_path_factory):
    """00_setup executed by the runner, in small mode, with a parameter injected."""
    if not SETUP.exists():
        pytest.skip("notebooks/00_setup.ipynb is not in this checkout")
    out = tmp_path_factory.mktemp("run")
    return course.run_course([SETUP], out, mode="small", parameters={"N_EXAMPLES": 2})


def test_runner_injects_parameters(setup_run):
    assert setup_run.ok, setup_run.runs[0].error
    nb = nbformat.read(setup_run.out_dir / "00_setup.ipynb", as_version=4)
    injected = [c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", [])]
    assert len(injected) == 1
    assert 'MODE = "small"' in injected[0].source and "LIVE = False" in injected[0].source
    assert "N_EXAMPLES = 2" in injected[0].source
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert printed.count("\n>cath|") == 2  # the injected value took effect
    assert "course mode 'small'" in printed


def test_executed_copy_holds_its_closing_table_and_figure(setup_run):
    nb = nbformat.read(setup_run.out_dir / "00_setup.ipynb", as_version=4)
    outputs = report.closing_outputs(nb)
    html = "".join(o.get("data", {}).get("text/html", "") for o in outputs)
    text = "".join(o.get("data", {}).get("text/plain", "") for o in outputs)
    assert "00 · setup: this machine and the data" in html and "unigram baseline" in text
    assert any(report.PLOTLY_MIME in o.get("data", {}) for o in outputs)
    # store_widget_state=False and no widget outputs: the executed notebook stays small
    assert (setup_run.out_dir / "00_setup.ipynb").stat().st_size < 1_000_000
    assert setup_run.runs[0].seconds > 0 and setup_run.runs[0].status == "ok"


def test_report_is_self_contained_with_capabilities_and_closing_tables(setup_run):
    report = setup_run.report.read_text()
    assert "What this machine can run" in report
    assert "TE GroupedLinear" in report and "fused CuTe-DSL grouped MLP" in report  # capability table
    assert "00 · setup: this machine and the data" in report  # the closing table
    assert "Plotly.newPlot" in report and "<script src=" not in report  # figures, plotly.js inlined
    assert "torch" in report and "papermill" in report  # versions
    assert 'href="00_setup.html"' in report and 'href="00_setup.ipynb"' not in report


def test_every_executed_notebook_has_an_html_rendering_next_to_it(setup_run):
    """Readable without Jupyter: the page shows the notebook's text, outputs and closing table,
    and draws its figures with the plotly.js written next to it."""
    page = (setup_run.out_dir / "00_setup.html").read_text()
    assert setup_run.runs[0].html == setup_run.out_dir / "00_setup.html"
    assert "00 · setup: this machine and the data" in page and "course mode" in page
    assert page.count("Plotly.newPlot(") >= 1
    assert f'<script src="{course.PLOTLY_JS}"></script>' in page
    assert "window.Plotly = Plotly" in (setup_run.out_dir / course.PLOTLY_JS).read_text()
    assert "<plotly figure" not in page.split("</head>", 1)[1].replace("&lt;plotly figure", ""), \
        "every figure is drawn, not shown as its text form"
    manifest = json.loads((setup_run.out_dir / run_inputs.RUN_MANIFEST).read_text())["files"]
    assert {"00_setup.ipynb", "00_setup.html", course.PLOTLY_JS, "report.html"} <= set(manifest)
    executed = json.loads((setup_run.out_dir / "00_setup.ipynb").read_text())
    assert "widgets" not in executed["metadata"]  # store_widget_state=False


def test_the_html_rendering_embeds_the_images_the_notebook_links_to(tmp_path):
    """A chapter's markdown shows `figures/*.svg` from next to the source notebook; the rendering
    lives elsewhere (the run's folder), so it carries the picture itself."""
    source = tmp_path / "course" / "02_x.ipynb"
    (source.parent / "figures").mkdir(parents=True)
    (source.parent / "figures" / "idea.svg").write_text(
        '<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"><rect width="4" height="4"/></svg>')
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("![the idea](figures/idea.svg)")])
    nbformat.write(nb, source)
    run = course.NotebookRun("02_x", source, tmp_path / "out" / "02_x.ipynb")
    run.output.parent.mkdir()
    nbformat.write(nb, run.output)
    page = course.write_html(run).read_text()
    assert 'src="data:image/svg+xml;base64,' in page and "figures/idea.svg" not in page
    assert not [p.name for p in run.output.parent.iterdir() if p.name.endswith(".tmp")]


def test_progress_says_where_the_run_is_and_for_how_long():
    """A line as each code cell starts, and a line while a long cell runs on (no terminal needed)."""
    lines, now = [], [100.0]
    progress = course.CellProgress(lambda text, **_: lines.append(text), clock=lambda: now[0])
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# title"),
                                         nbformat.v4.new_code_cell("x = 1"),
                                         nbformat.v4.new_code_cell("\n\ntrain(model, steps=" + "9" * 80 + ")")])
    with progress.notebook("[2/9] 02_grouped_linear"):
        now[0] += 5
        for index, cell in enumerate(nb.cells):
            progress.cell_started(nb, cell, index)
        now[0] += course.HEARTBEAT_S - 1
        progress.beat()  # not yet
        now[0] += 1
        progress.beat()
        progress.beat()  # said already
        now[0] += 65
        progress.beat()
    assert lines == [
        "[2/9] 02_grouped_linear · cell 1/2 · 5 s in this notebook, 5 s in all · x = 1",
        "[2/9] 02_grouped_linear · cell 2/2 · 5 s in this notebook, 5 s in all · "
        "train(model, steps=" + "9" * 38 + "...",  # the first line, cut at 60 characters
        "[2/9] 02_grouped_linear · cell 2/2 still running, 30 s so far · "
        "35 s in this notebook, 35 s in all",
        "[2/9] 02_grouped_linear · cell 2/2 still running, 1 min 35 s so far · "
        "1 min 40 s in this notebook, 1 min 40 s in all"]
    progress.beat()  # outside a notebook: nothing runs, nothing to say
    assert len(lines) == 4


def test_failing_notebook_stops_the_run_and_shows_its_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(course, "HEARTBEAT_S", 0.4)
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    first = notebook(nbs / "01_fine.ipynb", "import time\ntime.sleep(1.5)", "print('fine')",
                     parameters="MODE = ''")
    bad = notebook(nbs / "02_broken.ipynb", "x = 1", "raise ValueError('broken on purpose')")
    after = notebook(nbs / "03_after.ipynb", "print('never')")
    out = tmp_path / "out"
    code = main(["run", "--mode", "small", "--notebooks", str(first), str(bad), str(after),
                 "--out", str(out)])
    assert code == 1
    printed = capsys.readouterr().out
    assert "01_fine: ok" in printed and "02_broken: FAILED" in printed
    assert "ValueError: broken on purpose" in printed and "not run: 03_after" in printed
    # the progress lines: each code cell as it starts (parameters, injected parameters, code),
    # and the sleeping cell while it runs on
    assert re.search(r"^\[1/3\] 01_fine · cell 3/4 · \d+ s in this notebook, \d+ s in all · "
                     r"import time$", printed, re.M), printed
    assert re.search(r"^\[1/3\] 01_fine · cell 3/4 still running, 1 s so far", printed, re.M)
    assert re.search(r"^\[2/3\] 02_broken · cell 3/3 · .* · raise ValueError", printed, re.M)
    assert (out / "01_fine.ipynb").exists() and (out / "02_broken.ipynb").exists()
    assert not (out / "03_after.ipynb").exists() and not (out / "03_after.html").exists()
    rendered = (out / "02_broken.html").read_text()  # the failing notebook, its error in place
    assert "ValueError</span>: broken on purpose" in rendered
    report = (out / "report.html").read_text()
    assert "broken on purpose" in report and "1 of 3 notebooks ran" in report
    assert 'href="01_fine.html"' in report and 'href="02_broken.html"' in report


def test_missing_notebooks_folder_is_not_an_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_inputs, "default_notebooks_dir", lambda: tmp_path / "notebooks")
    assert main(["run", "--out", str(tmp_path / "out")]) == 0
    assert "No course notebooks found" in capsys.readouterr().out
    assert "What this machine can run" in (tmp_path / "out" / "report.html").read_text()


def test_find_notebooks(tmp_path):
    for name in ("00_setup", "01_naive_moe", "02_grouped_linear"):
        (tmp_path / f"{name}.ipynb").write_text("{}")
    (tmp_path / "scratch.ipynb").write_text("{}")
    assert [p.stem for p in course.find_notebooks(None, tmp_path)] == ["00_setup", "01_naive_moe",
                                                                       "02_grouped_linear"]
    picked = course.find_notebooks(["02", "00_setup.ipynb", "01_naive_moe"], tmp_path)
    assert [p.stem for p in picked] == ["02_grouped_linear", "00_setup", "01_naive_moe"]
    with pytest.raises(ValueError, match="'07' not found.*00_setup"):
        course.find_notebooks(["07"], tmp_path)


def test_kernel_starts_this_interpreter(monkeypatch):
    from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

    with course.kernel_for_this_python() as name:  # the normal case
        spec = KernelSpecManager().get_kernel_spec(name)
        assert course._same_interpreter(spec.argv[0])
    foreign = KernelSpec(argv=["/opt/other/bin/python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                         display_name="other", language="python")
    real_get = KernelSpecManager.get_kernel_spec
    monkeypatch.setattr(KernelSpecManager, "get_kernel_spec",
                        lambda self, n: foreign if n == "python3" else real_get(self, n))
    before = os.environ.get("JUPYTER_PATH")
    with course.kernel_for_this_python() as name:
        assert name != "python3"
        assert KernelSpecManager().get_kernel_spec(name).argv[0] == sys.executable
    assert os.environ.get("JUPYTER_PATH") == before


def test_run_command_is_registered(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "--notebooks" in capsys.readouterr().out


def test_report_renders_outputs():
    figures = report._FigureCounter()
    plot = report.render_output({"output_type": "display_data", "data": {
        report.PLOTLY_MIME: {"data": [{"type": "bar", "y": [1]}], "layout": {"title": {"text": "</script>"}}},
        "text/plain": "<plotly figure>"}}, figures)
    assert figures.count == 1 and "Plotly.newPlot" in plot and "</script>" not in plot.split("<script>")[1][:-9]
    assert report.render_output({"output_type": "stream", "name": "stdout", "text": "a < b"},
                                figures) == '<pre class="stream">a &lt; b</pre>'
    widget = {"output_type": "display_data", "data": {report.WIDGET_MIME: {}, "text/plain": "VBox()"}}
    assert report.render_output(widget, figures) == ""
    json.dumps(plot)





@pytest.fixture()
def two_notebooks(tmp_path):
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    return [notebook(nbs / "01_a.ipynb", "print(1)", parameters="MODE = ''\nSTEPS = 0"),
            notebook(nbs / "02_b.ipynb", "print(2)", parameters="MODE = ''")]


def test_a_second_run_into_the_same_folder_is_refused(tmp_path, two_notebooks, fast_papermill, capsys,
                                                      monkeypatch):
    """A second `run --out DIR` into a used folder is refused, never replaces the first run."""
    out = tmp_path / "out"
    args = ["run", "--mode", "small", "--notebooks", *map(str, two_notebooks), "--out", str(out)]
    assert main(args) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --out {out} is not empty (it holds .moe-tutorial-run.json, "
                   "01_a.html, 01_a.ipynb, ...); give a new folder, or add --replace to replace "
                   "an earlier run there\n")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    assert main([*args, "--replace"]) == 0
    # through `make course`, the same refusal in make's words
    monkeypatch.setenv(course.STARTED_BY_ENV, "make")
    assert main(args) == 2
    assert capsys.readouterr().err == (
        f"error: RUN_DIR={out} is not empty (it holds .moe-tutorial-run.json, 01_a.html, "
        "01_a.ipynb, ...); give a new folder, or add RUN_FLAGS=--replace to replace an earlier "
        "run there\n")


def test_replace_after_a_killed_run_leaves_no_old_report(tmp_path, two_notebooks, fast_papermill):
    """A run killed mid-way into an existing folder must not leave a half-run notebook next to an
    old report that still says "all notebooks ran". --replace removes the earlier run's
    files (its report first) and nothing else; the report is written last, atomically."""
    out = tmp_path / "out"
    assert course.run_course(two_notebooks, out, mode="small").ok
    assert "all notebooks ran" in (out / "report.html").read_text()
    (out / "notes.txt").write_text("mine")
    killed = two_notebooks[:1] + [notebook(two_notebooks[1].parent / "03_c.ipynb", "STOP")]
    with pytest.raises(KeyboardInterrupt):
        course.run_course(killed, out, mode="small", replace=True)
    assert sorted(p.name for p in out.iterdir()) == [".moe-tutorial-run.json", "01_a.html",
                                                     "01_a.ipynb", "03_c.ipynb", "notes.txt",
                                                     course.PLOTLY_JS]
    assert (out / "notes.txt").read_text() == "mine", "not the runner's file: left alone"
    done = course.run_course(two_notebooks, out, mode="small", replace=True)
    assert done.ok and "all notebooks ran" in done.report.read_text()
    assert not (out / "03_c.ipynb").exists(), "the killed run's file is gone with it"
    assert (out / "02_b.html").exists() and 'href="02_b.html"' in done.report.read_text()
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]








@pytest.mark.parametrize("folder", ["notebooks", "exercises", "solutions", "moe_tutorial"])
def test_a_run_never_writes_into_the_course(folder, fake_checkout, fast_papermill, capsys):
    """`run --out notebooks` (or any course folder) is refused and writes nothing there."""
    before = snapshot(fake_checkout)
    assert main(["run", "--notebooks", "00", "--out", folder]) == 2
    err = capsys.readouterr().err
    assert f"is inside the course's own {folder}/ folder" in err and "--out runs/mine" in err
    assert snapshot(fake_checkout) == before


def test_a_notebook_that_cannot_be_rendered_says_so(tmp_path, two_notebooks, fast_papermill,
                                                   monkeypatch, capsys):
    """The run's results stand without their HTML rendering, and the report says why it is
    missing instead of linking nothing."""
    def cannot_render(run, in_run):
        raise ValueError(f"no template for {run.name}")

    monkeypatch.setattr(course, "write_html", cannot_render)
    done = course.run_course(two_notebooks, tmp_path / "out", mode="small")
    assert done.ok and not (tmp_path / "out" / "01_a.html").exists()
    assert "01_a: no HTML rendering (ValueError: no template for 01_a)" in capsys.readouterr().out
    assert "not rendered (ValueError: no template for 01_a): 01_a.ipynb" in done.report.read_text()


def test_a_parameter_cannot_contradict_the_mode(tmp_path, two_notebooks, fast_papermill, capsys):
    """`run --mode small -p MODE=full` is refused: the parameters cannot contradict the mode the
    report states."""
    out = tmp_path / "out"
    assert main(["run", "--mode", "small", "-p", "MODE=full", "--notebooks",
                 *map(str, two_notebooks), "--out", str(out)]) == 2
    assert capsys.readouterr().err == ("error: -p MODE='full': MODE is set by --mode, not by -p; "
                                       "drop -p MODE and use --mode full\n")
    assert not out.exists()


def test_each_notebook_gets_the_cores_others_leave_free_and_the_report_says_so(
        tmp_path, two_notebooks, monkeypatch):
    """Run times depend on who else uses the cores: each notebook's torch gets the free ones
    (OMP_NUM_THREADS in its kernel's environment) and the report records them with the load."""
    import papermill

    samples = iter([(100, 400), (250, 600)] * 2)  # 150 of 200 jiffies busy: 3 of 4 cores
    monkeypatch.setattr(course, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(course.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(course.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(course.os, "getloadavg", lambda: (2.5, 2.0, 1.5))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    seen = []

    def execute_notebook(source, output, **_):
        seen.append(os.environ.get("OMP_NUM_THREADS"))
        Path(output).write_text(Path(source).read_text())

    monkeypatch.setattr(papermill, "execute_notebook", execute_notebook)
    done = course.run_course(two_notebooks, tmp_path / "out", mode="small", echo=lambda *a, **k: None)
    assert seen == ["1", "1"] and os.environ.get("OMP_NUM_THREADS") is None
    share = done.runs[0].cpu
    assert (share.cores, round(share.busy, 2), share.load_1min, share.threads) == (4, 3.0, 2.5, 1)
    assert "1 thread(s) of 4 cores (3.0 busy, load 2.50)" in done.report.read_text()


def test_a_thread_count_the_learner_set_is_kept(monkeypatch):
    monkeypatch.setattr(course, "_cpu_times", lambda: None)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    share = course.cpu_share()
    assert share.threads == 3 and share.threads_set_by_user and share.busy is None
    assert share.describe().startswith("3 thread(s) (OMP_NUM_THREADS) of ")
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert course.cpu_share().threads == share.cores  # nothing measured: every core
