"""The live dashboard and the static tables/figures the notebooks end with (moe_tutorial.course.dashboard, moe_tutorial.course.widgets,
moe_tutorial.display)."""

import json
import time

import pytest

from moe_tutorial import display
from moe_tutorial.course import dashboard, widgets
from moe_tutorial.course.dashboard import LiveDashboard
from moe_tutorial.course.runner import local_kernel_config
from moe_tutorial.display import PLOTLY_MIME, Table

go = pytest.importorskip("plotly.graph_objects")


# --- tables ----------------------------------------------------------------------------------

def test_table_text_and_html():
    table = Table(["name", "ms", "speedup"], [["naive <loop>", 12.3456, "1.00x"], ["grouped", 1234.5, "7.50x"]],
                  title="timings", note="median of 5")
    text = table.text()
    lines = text.splitlines()
    assert lines[0] == "timings" and lines[-1] == "median of 5"
    assert "1,234" in text and "12.35" in text  # numbers formatted, thousands separated
    assert lines[3].index("12.35") + len("12.35") == lines[4].index("1,234") + len("1,234")  # right-aligned
    html = table.html()
    assert "<caption>timings</caption>" in html and "naive &lt;loop&gt;" in html  # escaped
    assert 'style="text-align:right">7.50x' in html
    bundle = table._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"} and str(table) == text


def test_table_rejects_ragged_rows():
    with pytest.raises(ValueError, match="2 cells.*3 columns"):
        Table(["a", "b", "c"], [[1, 2]])


def test_format_value():
    assert display.format_value(1234567) == "1,234,567"
    assert display.format_value(0.000123) == "0.000123"
    assert display.format_value(float("nan")) == "n/a"
    assert display.format_value(None) == ""


# --- the dashboard, headless -----------------------------------------------------------------

def _fill(dash):
    for experts in (2, 4, 8):
        dash.update("naive", experts, 100.0)
        dash.update("grouped", experts, 25.0 * experts)


def test_headless_dashboard_records_and_ends_static(capsys):
    dash = LiveDashboard("loop vs grouped", baseline="naive", x_title="experts", x_log=True)
    assert not dash.live  # no Jupyter kernel here
    _fill(dash)
    assert dash.speedups() == {"grouped": [(2, 0.5), (4, 1.0), (8, 2.0)]}
    summary = {r["variant"]: r for r in dash.summary()}
    assert summary["grouped"]["speedup"] == 1.0 and summary["naive"]["speedup"] == 1.0
    fig = dash.finish()
    assert isinstance(fig, go.Figure) and not isinstance(fig, go.FigureWidget)
    names = [t.name for t in fig.data]
    assert names.count("naive") == 1 and names.count("grouped") == 2  # throughput + speedup
    speedup = next(t for t in fig.data if t.name == "grouped" and t.showlegend is False)
    assert list(speedup.y) == [0.5, 1.0, 2.0]
    printed = capsys.readouterr().out  # outside IPython the table is printed
    assert "loop vs grouped" in printed and "median speedup vs naive" in printed
    assert "not measured (CUDA only)" in printed and dash.redraws == 0
    assert dash.finish(show=True) is not None and capsys.readouterr().out == ""  # once only


def test_headless_updates_cost_microseconds():
    dash = LiveDashboard("cheap", live=True)
    start = time.perf_counter()
    for step in range(20_000):
        dash.update("naive", step, 1000.0, loss=3.0)
    assert time.perf_counter() - start < 0.5
    assert dash.updates == 20_000 and dash.redraws == 0 and dash.overhead_s == 0.0


def test_train_callback_feeds_the_dashboard():
    import torch

    from moe_tutorial.moe.config import preset
    from moe_tutorial.moe.model import MoEForCausalLM
    from moe_tutorial.train.data import pack_sequences
    from moe_tutorial.train.loop import TrainSettings, train

    cfg = preset("tiny")
    packed = pack_sequences(["ACDEFGHIKLMNPQRSTVWY" * 8] * 8, cfg.max_seq_len)
    dash = LiveDashboard("train", panels=("throughput", "loss", "memory"), total=3)
    history = train(MoEForCausalLM(cfg, "naive"), packed, TrainSettings(steps=3, batch_size=2, warmup_steps=1,
                    eval_every=0), on_step=dash.train_callback("naive", "cpu"), progress=False)
    points = dash.series["naive"]
    assert [p.x for p in points] == [1, 2, 3]
    assert [p.metrics["loss"] for p in points] == [h["loss"] for h in history]
    assert all(p.memory_gb is None for p in points)  # not tracked on CPU
    assert torch.isfinite(torch.tensor([p.value for p in points])).all()
    fig = dash.figure()
    assert [t.name for t in fig.data].count("naive") == 2  # throughput and loss


def test_unknown_panel():
    with pytest.raises(ValueError, match="unknown panels"):
        LiveDashboard(panels=("throughput", "gpu temperature"))


# --- when live drawing is (not) possible ---------------------------------------------------

def test_live_only_with_a_frontend(monkeypatch):
    monkeypatch.setattr(display, "in_kernel", lambda: True)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.delenv("MOE_TUTORIAL_LIVE", raising=False)
    ok, why = widgets.live_support()
    assert not ok and "no Jupyter frontend attached" in why  # papermill, nbval
    monkeypatch.setenv("JPY_SESSION_NAME", "notebooks/01_naive_moe.ipynb")  # JupyterLab
    assert widgets.live_support() == (True, "")
    monkeypatch.setenv("MOE_TUTORIAL_LIVE", "0")
    assert not widgets.live_support()[0]
    monkeypatch.delenv("JPY_SESSION_NAME")
    monkeypatch.setenv("MOE_TUTORIAL_LIVE", "always")
    assert widgets.live_support() == (True, "")


def test_without_anywidget_a_note_then_static(monkeypatch, capsys):
    monkeypatch.setattr(display, "in_kernel", lambda: True)
    monkeypatch.setattr(display, "missing_modules", lambda *names: ["anywidget"])
    dash = LiveDashboard("degraded")
    notes = capsys.readouterr().out.strip().splitlines()
    assert len(notes) == 1 and "anywidget not installed" in notes[0] and not dash.live
    _fill(dash)
    assert isinstance(dash.finish(show=False), go.Figure)


def test_without_plotly_the_table_only(monkeypatch, capsys):
    monkeypatch.setattr(display, "plotly_go", lambda: None)
    dash = LiveDashboard("no plotly", baseline="naive")
    _fill(dash)
    assert dash.figure() is None and dash.finish() is None
    assert "no plotly" in capsys.readouterr().out


# --- live drawing (display calls captured; the widgets are real) ----------------------------

class _Handle:
    def __init__(self):
        self.updates = []

    def update(self, obj, **kwargs):
        self.updates.append(obj)


def test_live_redraws_are_throttled_and_end_as_a_static_figure(monkeypatch):
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    handle, shown = _Handle(), []

    def show_raw(obj, **kwargs):
        shown.append(obj)
        return handle if kwargs.get("display_id") else None

    monkeypatch.setattr(dashboard, "live_support", lambda: (True, ""))
    monkeypatch.setattr(display, "show_raw", show_raw)
    now = [0.0]
    dash = LiveDashboard("live", baseline="naive", total=2000, clock=lambda: now[0])
    assert dash.live and len(shown) == 1  # the widget box
    assert dashboard.DASHBOARD_CLASS in shown[0]._dom_classes  # what the browser tests look for
    for step in range(1000):  # 1000 updates over 10 simulated seconds
        now[0] += 0.01
        dash.update("naive", step, 100.0 + step)
        dash.update("grouped", step, 300.0 + step)
    assert 10 <= dash.redraws <= 4 * 10 + 1
    fw = dash._figure_widget
    throughput = [t for t in fw.data if t.name == "grouped" and t.showlegend is not False][0]
    assert len(throughput.x) > 1000 - 0.25 / 0.01  # the last redraw is at most 0.25 s old
    assert dash._progress.max == 2000 and 0 < dash._progress.value <= dash.updates
    fig = dash.finish()
    assert isinstance(fig, go.Figure) and len(fig.data[0].x) == 1000
    assert len(handle.updates) == 1 and PLOTLY_MIME in handle.updates[0]  # the widget became the figure
    json.dumps(handle.updates[0][PLOTLY_MIME])  # plain JSON, storable in a notebook
    assert any("text/html" in o for o in shown if isinstance(o, dict))  # then the table
    assert dash._widget is None and not dash.live


def test_slow_redraws_back_off(monkeypatch):
    pytest.importorskip("anywidget")
    monkeypatch.setattr(dashboard, "live_support", lambda: (True, ""))
    monkeypatch.setattr(display, "show_raw", lambda obj, **kw: _Handle() if kw.get("display_id") else None)
    now = [0.0]
    dash = LiveDashboard("slow", clock=lambda: now[0])
    real_specs = LiveDashboard._trace_specs

    def slow_specs(self):
        now[0] += 0.5  # pretend every redraw takes half a second ...
        return real_specs(self)

    monkeypatch.setattr(LiveDashboard, "_trace_specs", slow_specs)
    for step in range(100):  # ... with an update every second
        now[0] += 1.0
        dash.update("naive", step, 1.0)
    assert dash.redraws <= 0.1 * now[0] / 0.5 + 1  # drawing takes at most ~10% of the time


# --- in a real kernel (nbclient, like papermill) -----------------------------------------------

def test_in_a_kernel_the_live_widget_output_becomes_the_static_figure(tmp_path, monkeypatch):
    pytest.importorskip("anywidget")
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from nbformat.v4 import new_code_cell, new_notebook

    nb = new_notebook(cells=[new_code_cell(
        "from moe_tutorial.course.dashboard import LiveDashboard\n"
        "dash = LiveDashboard('in a kernel', baseline='naive', total=40)\n"
        "for step in range(20):\n"
        "    dash.update('naive', step, 100.0)\n"
        "    dash.update('grouped', step, 200.0)\n"
        "fig = dash.finish()\n"
        "print('redraws', dash.redraws, 'live', dash.live)")])
    monkeypatch.setenv("MOE_TUTORIAL_LIVE", "always")  # no browser here: force live drawing
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", store_widget_state=False,
                                     resources={"metadata": {"path": str(tmp_path)}},
                                     config=local_kernel_config(str(tmp_path)))  # no TCP port race
    client.execute()
    outputs = nb.cells[0].outputs
    kinds = [next(iter(o.get("data", {})), o.get("name")) for o in outputs]
    assert not any(o.output_type == "error" for o in outputs), outputs
    first = outputs[0]
    assert PLOTLY_MIME in first["data"], kinds  # display updated in place: no dead widget left
    assert "widget-view" not in json.dumps(nbformat.from_dict(nb)), "widget state must not be stored"
    assert any("text/html" in o.get("data", {}) and "in a kernel" in o["data"]["text/html"] for o in outputs)
    redraws = int(outputs[-1]["text"].split()[1])
    assert redraws >= 1 and "live False" in outputs[-1]["text"]  # it drew live, then closed


def test_a_headless_prediction_stays_unanswered_and_still_shows_the_measurement(capsys):
    guess = widgets.predict("Will FP8 be faster at hidden 128?", ["yes", "no"])
    out = capsys.readouterr().out
    assert "Predict: Will FP8 be faster at hidden 128? (yes / no)" in out
    assert "unanswered" in out and guess.answer is None
    guess.grade("no", "FP8 2.0 ms, bf16 1.5 ms.")
    assert guess.right is None and guess.verdict == "not answered yet"
    assert capsys.readouterr().out == ("– Not answered yet: the measurement says 'no'. "
                                       "FP8 2.0 ms, bf16 1.5 ms.\n")
    rows = widgets.predict("Padding rows at alignment 32?", range(0, 129))
    rows.grade(60, "")
    assert rows.right is None and "Not answered yet" in capsys.readouterr().out
    with pytest.raises(RuntimeError, match="grade"):
        widgets.predict("Ungraded?", ["yes", "no"]).right


def test_a_prediction_has_no_default_answer():
    with pytest.raises(TypeError, match="default"):
        widgets.predict("?", ["yes", "no"], default="yes")


def test_a_live_prediction_starts_unanswered_and_regrades_when_answered(monkeypatch):
    pytest.importorskip("ipywidgets")
    shown = []
    monkeypatch.setattr(widgets, "live_support", lambda: (True, ""))
    monkeypatch.setattr(display, "show_raw", lambda obj, **kw: shown.append(obj))
    guess = widgets.predict("Faster?", ["yes", "no"])
    assert guess._widget.value is None and guess.answer is None  # no button pressed
    guess.grade("no", "measured.")
    assert guess.right is None and "Not answered yet" in shown[-1].value
    assert "the measurement says &#x27;no&#x27;. measured." in shown[-1].value
    guess._widget.value = "yes"  # the learner clicks after the measurement ran
    assert guess.right is False and "Not this time" in shown[-1].value
    assert guess.verdict == "not this time"
    guess._widget.value = "no"
    assert "✓ Right" in shown[-1].value and guess.verdict == "right"
    rows = widgets.predict("Rows?", range(0, 129, 32))
    assert rows._widget.value is None and list(rows._widget.options) == [0, 32, 64, 96, 128]
    rows.grade(60, "", tolerance=4)
    assert rows.right is None
    rows._widget.value = 64
    assert rows.right is True and "✓ Right" in shown[-1].value
    rows._widget.value = 32
    assert rows.right is False


@pytest.mark.parametrize("choices", [["only"], ["yes", "yes"], range(0, 1)])
def test_a_prediction_needs_two_distinct_choices(choices):
    with pytest.raises(ValueError, match="two or more"):
        widgets.predict("?", choices)


# --- the routing-skew explorer ---------------------------------------------------------------

SKEW_SIZES = dict(tokens=64, num_experts=4, top_k=2, hidden=32, intermediate=64, iters=2)


def test_a_headless_skew_explorer_draws_once_at_its_default(monkeypatch, capsys):
    shown = []
    monkeypatch.setattr(display, "ipython_shell", lambda: object())  # displays go to `shown`
    monkeypatch.setattr(display, "show_raw", lambda obj, **kw: shown.append(obj))
    explorer = widgets.skew_explorer(**SKEW_SIZES, default_skew=0.5)
    assert not explorer.live and explorer.slider is None  # no frontend: nothing waits for input
    assert list(explorer.results) == [0.5]
    figure, table = shown
    assert PLOTLY_MIME in figure and "routing skew 0.50" in figure["text/plain"]
    text = table["text/plain"]
    assert "routing skew 0.50: 64 tokens, top-2 of 4 experts" in text
    assert "48 of 64 tokens" in text  # expert 0: 32 balanced + round(0.5 * (64 - 32))
    assert "straggler wait, ep=2" in text and "straggler wait, ep=4" in text
    assert "static (not running in a Jupyter kernel)" in text and "torch._grouped_mm" in text
    assert capsys.readouterr().out == ""  # outside a kernel: no note printed


def test_a_skew_explorer_in_a_headless_kernel_says_it_is_static(monkeypatch, capsys):
    monkeypatch.setattr(display, "in_kernel", lambda: True)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    monkeypatch.delenv("MOE_TUTORIAL_LIVE", raising=False)
    monkeypatch.setattr(display, "show_raw", lambda obj, **kw: None)
    explorer = widgets.SkewExplorer(**SKEW_SIZES)
    assert not explorer.live
    assert capsys.readouterr().out.startswith("skew explorer static at skew 0.00: no Jupyter "
                                              "frontend attached")


def test_moving_the_skew_slider_remeasures_once_per_value(monkeypatch):
    ipywidgets = pytest.importorskip("ipywidgets")
    from moe_tutorial.perf import skew

    shown, measured = [], []
    real = skew.grouped_gemm_efficiency

    def counted(splits, *args, **kwargs):
        measured.append(list(splits))
        return real(splits, *args, **kwargs)

    monkeypatch.setattr(skew, "grouped_gemm_efficiency", counted)
    monkeypatch.setattr(widgets, "live_support", lambda: (True, ""))
    monkeypatch.setattr(display, "show_raw", lambda obj, **kw: shown.append(obj))
    explorer = widgets.SkewExplorer(**SKEW_SIZES, ep=2)
    assert explorer.live and shown == [explorer._widget]
    slider, output = explorer.slider, explorer.output
    assert isinstance(slider, ipywidgets.FloatSlider) and not slider.continuous_update
    assert (slider.min, slider.max, slider.value) == (0.0, 1.0, 0.0)
    assert widgets.SKEW_SLIDER_CLASS in slider._dom_classes
    assert widgets.SKEW_OUTPUT_CLASS in output._dom_classes

    def shown_table():
        return next(o["data"]["text/plain"] for o in output.outputs if "text/html" in o["data"])

    assert "routing skew 0.00" in shown_table() and "ep=4" not in shown_table()
    assert any(PLOTLY_MIME in o["data"] for o in output.outputs)
    slider.value = 1.0  # what releasing the slider in the browser does
    assert explorer.skew == 1.0 and "routing skew 1.00" in shown_table()
    assert "64 of 64 tokens" in shown_table() and measured[-1] == [64, 22, 21, 21]
    slider.value = 0.0  # back: from the cache, nothing measured again
    assert len(measured) == 2 and "routing skew 0.00" in shown_table()


def test_a_failed_measurement_shows_in_the_explorer(monkeypatch):
    pytest.importorskip("ipywidgets")
    from moe_tutorial.perf import skew

    monkeypatch.setattr(widgets, "live_support", lambda: (True, ""))
    monkeypatch.setattr(display, "show_raw", lambda obj, **kw: None)
    explorer = widgets.SkewExplorer(**SKEW_SIZES)

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(skew, "grouped_gemm_efficiency", out_of_memory)
    explorer.slider.value = 0.5
    (error,) = explorer.output.outputs
    assert error["text"] == "skew 0.50 could not be measured: RuntimeError: CUDA out of memory\n"


@pytest.mark.parametrize("options, match", [
    (dict(default_skew=2.0), "skew=2.0 must be a number from 0"),
    (dict(ep=3), "num_experts=4 is not divisible by ep=3"),
    (dict(alignments=()), r"alignments=\(\) must be a non-empty"),
    (dict(step=0), "step=0 must be in"),
])
def test_a_skew_explorer_refuses_bad_options_before_drawing(options, match):
    with pytest.raises(ValueError, match=match):
        widgets.SkewExplorer(**{**SKEW_SIZES, **options})


# --- axes and labels -------------------------------------------------------------------------

@pytest.mark.parametrize("low, high, ticks", [  # with one tick beyond the data on each side
    (28, 270, [20, 50, 100, 200, 500]),  # about a decade: 1-2-5, not "3 2 100 9 8 7 6 5 4 3"
    (0.3, 40, [0.2, 0.5, 1, 2, 5, 10, 20, 50]),
    (1, 1e6, [0.1, 1, 10, 100, 1e3, 1e4, 1e5, 1e6, 1e7]),  # over three decades: decades only
    (30, 80, [20, 30, 40, 50, 60, 70, 80, 90]),  # no two 1-2-5 values inside: every 1-9 multiple
    (28, 35, []),  # narrower still: plotly's own ticks
])
def test_log_ticks_are_decades_or_1_2_5(low, high, ticks):
    assert display.log_ticks(low, high) == pytest.approx(ticks)


def test_log_ticks_refuse_a_range_a_log_axis_cannot_show():
    with pytest.raises(ValueError, match="0 < low <= high"):
        display.log_ticks(0, 10)


def test_a_figure_shows_its_log_axes_with_clean_labels():
    """A displayed figure (what notebook 02 ends with: a log y axis over ~28-270 ms) gets 1-2-5
    ticks labelled as numbers; an axis with ticks of its own and a linear axis are left alone."""
    from plotly.subplots import make_subplots

    fig = go.Figure(make_subplots(rows=1, cols=2))
    fig.add_trace(go.Scatter(x=[2, 4, 64], y=[28.0, 41.5, 270.0]), row=1, col=1)
    fig.add_trace(go.Scatter(x=[2, 4, 64], y=[1.0, 1.2, 5.0]), row=1, col=2)
    fig.update_xaxes(type="log", tickvals=[2, 4, 64], row=1, col=1)
    fig.update_yaxes(type="log", row=1, col=1)
    layout = display.figure_bundle(fig)[PLOTLY_MIME]["layout"]
    assert layout["yaxis"]["tickvals"] == [20, 50, 100, 200, 500]
    assert layout["yaxis"]["ticktext"] == ["20", "50", "100", "200", "500"]
    assert layout["xaxis"]["tickvals"] == [2, 4, 64] and "ticktext" not in layout["xaxis"]
    assert "tickvals" not in layout["yaxis2"]
    assert fig.layout.yaxis.tickvals is None, "the caller's figure is not changed"
    assert [display.tick_label(v) for v in (0.05, 2, 500, 2000, 1.5e4, 1e7)] == [
        "0.05", "2", "500", "2k", "15k", "10M"]


def test_log_ticks_read_plotlys_typed_arrays():
    np = pytest.importorskip("numpy")
    fig = go.Figure(go.Scatter(x=[1, 2, 3], y=np.array([3.0, 12.0, 40.0])))
    fig.update_yaxes(type="log")
    layout = display.figure_bundle(fig)[PLOTLY_MIME]["layout"]
    assert layout["yaxis"]["tickvals"] == [2, 5, 10, 20, 50]


def test_every_live_panel_has_a_y_axis_title():
    dash = LiveDashboard("titles", baseline="naive", panels=("throughput", "speedup", "memory", "loss"))
    _fill(dash)
    fig = dash.figure()
    titles = [fig.layout[f"yaxis{'' if i == 1 else i}"].title.text for i in range(1, 5)]
    assert titles == ["tokens/s", "× naive", "GiB", "loss"]
    widget = dash._empty_figure(go.FigureWidget)  # the live figure is laid out the same way
    assert widget.layout.yaxis.title.text == "tokens/s" and widget.layout.yaxis2.title.text == "× naive"


STAND_IN = "te_grouped_linear: pure-PyTorch stand-in of te.GroupedLinear"


def test_a_label_names_a_variant_in_the_legend_and_the_table(capsys):
    """A TE backend that ran its stand-in is drawn and tabled as what it is; its points and
    its speedup still key on the variant."""
    dash = LiveDashboard("labels", baseline="naive", x_title="experts", panels=("throughput", "speedup"))
    for x in (2, 4):
        dash.update("naive", x, 100.0)
        dash.update("te_grouped_linear", x, 150.0, label=STAND_IN)
    fig = dash.finish()
    assert {t.name for t in fig.data} == {"naive", STAND_IN}
    assert dash.speedups() == {"te_grouped_linear": [(2, 1.5), (4, 1.5)]}
    assert STAND_IN in dash.table().text() and STAND_IN in capsys.readouterr().out


def test_a_label_given_later_renames_the_live_trace(monkeypatch):
    pytest.importorskip("anywidget")
    monkeypatch.setattr(dashboard, "live_support", lambda: (True, ""))
    monkeypatch.setattr(display, "show_raw", lambda obj, **kw: _Handle() if kw.get("display_id") else None)
    now = [0.0]
    dash = LiveDashboard("live labels", baseline="naive", panels=("throughput",), clock=lambda: now[0])
    dash.update("te_grouped_linear", 1, 1.0)
    now[0] += 1
    dash.update("te_grouped_linear", 2, 1.0, label=STAND_IN)
    assert dash.redraws == 2
    assert [t.name for t in dash._figure_widget.data] == [STAND_IN]
    assert STAND_IN in dash._status.value


def test_a_te_backend_without_te_is_labelled_as_its_stand_in():
    torch = pytest.importorskip("torch")
    from moe_tutorial.moe import experts

    mlp = experts.create("grouped_torch", 4, 8, 16)
    assert experts.backend_label(mlp) == "grouped_torch"
    te = experts.convert_experts(mlp, "te_grouped_linear")
    ops = experts.convert_experts(mlp, "te_ops")
    if torch.cuda.is_available() and te.uses_te:  # where TE runs, the backend is what it says
        assert experts.backend_label(te) == "te_grouped_linear"
        return
    assert not te.uses_te and experts.backend_label(te) == STAND_IN
    assert experts.backend_label(ops) == "te_ops: pure-PyTorch stand-in of te.ops' grouped MLP"
    mlp = experts.convert_experts(mlp, "te_permute_grouped_mm")  # on the CPU: routing.permute
    assert experts.backend_label(mlp) == ("te_permute_grouped_mm: pure-PyTorch stand-in of "
                                          "TE's permutation kernels")
