"""A live throughput dashboard for training and benchmark loops, and static tables and figures.

A loop reports one point per step (or per benchmark configuration) and the dashboard draws it:

    dash = LiveDashboard("experts: loop vs grouped", baseline="naive", x_title="experts", total=12)
    for E in expert_counts:
        for backend in ("naive", "grouped_torch"):
            t = timing.time_fn(step, device=device)        # the timed region
            dash.update(backend, E, tokens / (t.median_ms / 1e3))   # outside it
    fig = dash.finish()          # a static plotly figure and a table, whatever the frontend

In JupyterLab the panels — tokens/s per variant, speedup against the baseline, memory (and
loss, for training) — and a progress bar redraw while the loop runs. Redraws are throttled to at
most `max_updates_per_s` (4) per second, and further when a redraw is slow (drawing stays under
~10% of the loop's time); `update` itself only appends to a list, so calling it every step costs
microseconds. The caller calls `update` *between* timed regions (`train`'s `on_step` runs after
the step's clock stops), so drawing never lands inside a measurement; the time spent drawing is
counted and shown under the table (`overhead_s`).

`finish()` replaces the live widget by a static `plotly.graph_objects.Figure` with the same panels
and prints a table, so a notebook executed headless or read without a kernel still shows every
number. Headless (papermill, nbval) nobody watches, and widget messages are not free there: they
are serialised by the kernel and processed by the executing client, on the same CPU cores as the
measured work (on 2 cores that cost a third of the training throughput). So a dashboard is live
only when a Jupyter frontend is attached — a kernel started by a Jupyter server (JupyterLab,
Notebook 7) has `$JPY_SESSION_NAME` set — or when `$MOE_TUTORIAL_LIVE=always` (e.g. VS Code);
otherwise it records silently and draws once, in `finish()`. `$MOE_TUTORIAL_LIVE=0` or
`live=False` (what the course runner passes) turns live drawing off everywhere.

It degrades instead of failing: without ipywidgets or anywidget (plotly >= 6's `FigureWidget`
needs both) it prints a one-line note and draws only the static figure at the end; without
plotly it prints the table only. Outside Jupyter (a script, pytest) it is never live.
"""

from __future__ import annotations

import html
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .. import display

MAX_UPDATES_PER_S = 4.0
MAX_DRAW_SHARE = 0.1  # redraws also wait 10x as long as the last one took: drawing stays < ~10%
LIVE_ENV = "MOE_TUTORIAL_LIVE"  # "0": never live; "always": live even without a frontend
# What $MOE_TUTORIAL_LIVE may hold: the notebooks' `parameters` cells read "0" and "false" as
# off and anything else as on, so a typo such as "off" would silently mean on.
LIVE_VALUES = ("", "1", "true", "always", "0", "false")


def check_live_setting() -> None:
    """Refuse a $MOE_TUTORIAL_LIVE the course does not read as one of its settings."""
    value = os.environ.get(LIVE_ENV)
    if value is not None and value not in LIVE_VALUES:
        raise ValueError(f"${LIVE_ENV}={value!r} is not a setting of the live widgets; set it to "
                         f"1 (live when a frontend is attached), always or 0 (never), or unset it")
FRONTEND_ENV = "JPY_SESSION_NAME"  # set by jupyter_server (JupyterLab, Notebook 7) for its kernels
PANEL_TITLES = {
    "throughput": "{y_title}",
    "speedup": "speedup vs {baseline}",
    "memory": "peak memory (GiB)",
    "loss": "training loss",
}
AXIS_TITLES = {  # each panel's y axis
    "throughput": "{y_title}",
    "speedup": "× {baseline}",
    "memory": "GiB",
    "loss": "loss",
}
DASHBOARD_CLASS = "moe-live-dashboard"  # CSS class of a live dashboard's widget box (browser tests)

def frontend_attached() -> bool:
    """Is a person likely watching? True in kernels that a Jupyter server started for a notebook
    (it sets $JPY_SESSION_NAME), or when $MOE_TUTORIAL_LIVE=always. False in the kernels of
    papermill and nbval, where live widgets would only cost time: the messages they send compete
    with the measured work for the CPU (a third of the tokens/s on 2 cores, measured)."""
    return os.environ.get(LIVE_ENV) == "always" or bool(os.environ.get(FRONTEND_ENV))


def live_support() -> tuple[bool, str]:
    """(True, "") when a live dashboard can be drawn here, else (False, why not)."""
    if not display.in_kernel():
        return False, "not running in a Jupyter kernel"
    if os.environ.get(LIVE_ENV) == "0":
        return False, f"${LIVE_ENV}=0"
    missing = display.missing_modules("plotly", "ipywidgets", "anywidget")
    if missing:
        return False, (f"{' and '.join(missing)} not installed (pip install {' '.join(missing)}; "
                       "plotly's FigureWidget needs anywidget)")
    if not frontend_attached():
        return False, (f"no Jupyter frontend attached, a headless run (${LIVE_ENV}=always "
                       "draws anyway)")
    return True, ""


# The dashboard

@dataclass
class _Point:
    x: float
    value: float
    memory_gb: float | None = None
    metrics: dict = field(default_factory=dict)


class LiveDashboard:
    """Live tokens/s (or any throughput) per variant, speedup against a baseline, memory, loss,
    and a progress bar; a static figure and a table at the end. See the module docstring.

    title       the figure's title
    baseline    the variant the others are compared with (speedup panel)
    total       expected number of `update` calls (the progress bar's length)
    live        draw while running (when possible here); False: only the final static output
    x_title     what x is: "step", "experts", "tokens"...
    y_title     what the value is (default "tokens/s")
    panels      any of "throughput", "speedup", "memory", "loss", in display order
    x_log       logarithmic x axis (sweeps over powers of two)
    """

    def __init__(self, title: str = "throughput", *, baseline: str | None = None,
                 total: int | None = None, live: bool = True, x_title: str = "step",
                 y_title: str = "tokens/s",
                 panels: Sequence[str] = ("throughput", "speedup", "memory"),
                 x_log: bool = False, max_updates_per_s: float = MAX_UPDATES_PER_S,
                 clock: Callable[[], float] = time.perf_counter):
        unknown = [p for p in panels if p not in PANEL_TITLES]
        if unknown or not panels:
            raise ValueError(f"unknown panels {unknown}; choose from {list(PANEL_TITLES)}")
        if not max_updates_per_s > 0:
            raise ValueError(f"max_updates_per_s={max_updates_per_s} must be > 0")
        self.title, self.baseline, self.total = title, baseline, total
        self.x_title, self.y_title, self.x_log = x_title, y_title, x_log
        self.panels = tuple(panels)
        self.min_interval = 1.0 / max_updates_per_s
        self._clock = clock
        self.series: dict[str, list[_Point]] = {}
        self.labels: dict[str, str] = {}  # variant -> what the legend and table call it
        self.updates = 0
        self.redraws = 0  # live redraws so far
        self.overhead_s = 0.0  # time spent drawing (live) and building the final figure
        self.note = ""  # the one-line note printed when live drawing was asked for but is off
        self.off_reason = ""  # why it is off
        self.finished = False
        self._last_draw = -math.inf
        self._interval = self.min_interval  # grows when redraws are slow (see _redraw)
        self._widget = None
        self._handle = None
        self._traces: dict[tuple[str, str], int] = {}
        self._live_tickvals: list | None = None
        self.live = False
        if live:
            ok, why = live_support()
            if ok:
                self._start_live()
            else:
                self.off_reason = why
                if display.in_kernel():  # live widgets were asked for and cannot be had: say why, once
                    self.note = f"live dashboard off: {why}; static figure and table at the end."
                    print(self.note)
        if display.plotly_go() is None and display.in_kernel():
            print("plotly is not installed (pip install plotly): the dashboard prints its table only.")

    # --- recording ---------------------------------------------------------------------------
    def update(self, variant: str, x: float, value: float, *, memory_gb: float | None = None,
               label: str | None = None, **metrics: float) -> None:
        """Record one point (e.g. tokens/s of `variant` at step x). Call it outside timed
        regions; it redraws only when the last redraw is at least 1/max_updates_per_s old.
        `label`: what the legend and the table call the variant, where its name alone would
        mislead (`experts.backend_label`: a TE backend that ran its pure-PyTorch stand-in)."""
        self.series.setdefault(variant, []).append(_Point(x, float(value), memory_gb, metrics))
        if label is not None:
            self.labels[variant] = label
        self.updates += 1
        if self.live and self._clock() - self._last_draw >= self._interval:
            self._redraw()

    def train_callback(self, variant: str, device=None) -> Callable[[dict], None]:
        """An `on_step` for `moe_tutorial.train.loop.train`: tokens/s, loss and (on CUDA) peak memory
        of every step. train() calls it after the step's clock has stopped."""
        from ..perf.timing import peak_memory_gb  # torch is imported only by code that trains

        def on_step(record: dict) -> None:
            metrics = {"loss": record["loss"]}
            if "val_loss" in record:
                metrics["val_loss"] = record["val_loss"]
            self.update(variant, record["step"], record["tokens_per_s"],
                        memory_gb=peak_memory_gb(device), **metrics)
        return on_step

    # --- derived numbers ---------------------------------------------------------------------
    def speedups(self) -> dict[str, list[tuple[float, float]]]:
        """variant -> [(x, value / baseline value at the same x)] for every non-baseline variant."""
        if self.baseline is None or self.baseline not in self.series:
            return {}
        base = {p.x: p.value for p in self.series[self.baseline]}
        return {name: [(p.x, p.value / base[p.x]) for p in points if base.get(p.x)]
                for name, points in self.series.items() if name != self.baseline}

    def summary(self) -> list[dict]:
        """One dict per variant: points, last x, last and median value, speedup, peak memory."""
        speedups = self.speedups()
        rows = []
        for name, points in self.series.items():
            memory = [p.memory_gb for p in points if p.memory_gb is not None]
            ratios = [r for _, r in speedups.get(name, [])]
            rows.append(dict(
                variant=name, points=len(points), last_x=points[-1].x, last=points[-1].value,
                median=statistics.median(p.value for p in points),
                speedup=(statistics.median(ratios) if ratios else
                         (1.0 if name == self.baseline else None)),
                peak_memory_gb=max(memory) if memory else None,
                loss=points[-1].metrics.get("loss")))
        return rows

    def table(self) -> display.Table:
        show_loss = any(r["loss"] is not None for r in self.summary())
        headers = ["variant", "points", f"last {self.x_title}", f"last {self.y_title}",
                   f"median {self.y_title}"]
        if self.baseline:
            headers.append(f"median speedup vs {self.baseline}")
        headers.append("peak memory (GiB)")
        if show_loss:
            headers.append("last loss")
        rows = []
        for r in self.summary():
            row = [self.label(r["variant"]), r["points"], display.format_value(r["last_x"]), r["last"], r["median"]]
            if self.baseline:
                row.append("" if r["speedup"] is None else f"{r['speedup']:.2f}x")
            row.append("not measured (CUDA only)" if r["peak_memory_gb"] is None
                       else f"{r['peak_memory_gb']:.2f}")
            if show_loss:
                row.append("" if r["loss"] is None else f"{r['loss']:.3f}")
            rows.append(row)
        mode = (f"live, {self.redraws} redraws" if self.redraws
                else "static" + (f" ({self.off_reason.split(' (')[0]})" if self.off_reason else ""))
        note = f"dashboard: {mode}; {self.overhead_s * 1e3:.0f} ms spent drawing, outside timed regions"
        return display.Table(headers, rows, title=self.title, note=note)

    # --- figures -----------------------------------------------------------------------------
    def _panel_titles(self) -> list[str]:
        return [PANEL_TITLES[p].format(y_title=self.y_title, baseline=self.baseline or "baseline")
                for p in self.panels]

    def label(self, variant: str) -> str:
        """What the legend and the table call `variant` (see `update`'s `label`)."""
        return self.labels.get(variant, variant)

    def _color(self, variant: str) -> str:
        return display.PALETTE[list(self.series).index(variant) % len(display.PALETTE)]

    def _trace_specs(self) -> list[tuple[tuple[str, str], int, dict]]:
        """(key, panel column, trace properties) of every trace the data calls for."""
        specs = []
        col = {p: i + 1 for i, p in enumerate(self.panels)}
        mode = "lines" if max((len(p) for p in self.series.values()), default=0) > 30 else "lines+markers"
        if "throughput" in col:
            for name, points in self.series.items():
                specs.append(((("throughput", name)), col["throughput"], dict(
                    type="scatter", mode=mode, name=self.label(name), legendgroup=name,
                    x=[p.x for p in points], y=[p.value for p in points],
                    line=dict(color=self._color(name)))))
        if "speedup" in col:
            for name, pairs in self.speedups().items():
                specs.append((("speedup", name), col["speedup"], dict(
                    type="scatter", mode=mode, name=self.label(name), legendgroup=name,
                    showlegend=False, x=[x for x, _ in pairs], y=[r for _, r in pairs],
                    line=dict(color=self._color(name)))))
        if "memory" in col:
            names = [n for n, pts in self.series.items() if any(p.memory_gb is not None for p in pts)]
            specs.append((("memory", ""), col["memory"], dict(
                type="bar", name="peak memory", showlegend=False, x=[self.label(n) for n in names],
                y=[max(p.memory_gb for p in self.series[n] if p.memory_gb is not None) for n in names],
                marker=dict(color=[self._color(n) for n in names]))))
        if "loss" in col:
            for name, points in self.series.items():
                pts = [p for p in points if "loss" in p.metrics]
                specs.append((("loss", name), col["loss"], dict(
                    type="scatter", mode=mode, name=self.label(name), legendgroup=name,
                    showlegend=False, x=[p.x for p in pts], y=[p.metrics["loss"] for p in pts],
                    line=dict(color=self._color(name)))))
        return specs

    def _layout(self, fig) -> None:
        # The legend goes under the panels: above them it collides with a long title.
        fig.update_layout(title=dict(text=self.title), height=420, margin=dict(t=80, b=110),
                          legend=dict(orientation="h", yanchor="top", y=-0.3, xanchor="left", x=0),
                          template="plotly_white")
        for i, panel in enumerate(self.panels, start=1):
            fig.update_xaxes(title_text=self.x_title if panel != "memory" else "",
                             type="log" if self.x_log and panel != "memory" else None,
                             row=1, col=i)
            fig.update_yaxes(title_text=AXIS_TITLES[panel].format(
                y_title=self.y_title, baseline=self.baseline or "baseline"), row=1, col=i)
        if "speedup" in self.panels:
            fig.add_hline(y=1.0, line=dict(color="gray", dash="dot"),
                          row=1, col=self.panels.index("speedup") + 1)

    def _label_log_axis(self, fig, live: bool = False) -> None:
        """On a logarithmic x axis, label the measured points rather than decades."""
        xs = sorted({p.x for pts in self.series.values() for p in pts})
        if not (self.x_log and 0 < len(xs) <= 16) or (live and xs == self._live_tickvals):
            return
        if live:
            self._live_tickvals = xs
        for i, panel in enumerate(self.panels, start=1):
            if panel != "memory":
                fig.update_xaxes(tickvals=xs, row=1, col=i)

    def _empty_figure(self, figure_class):
        from plotly.subplots import make_subplots

        fig = figure_class(make_subplots(rows=1, cols=len(self.panels),
                                         subplot_titles=self._panel_titles()))
        self._layout(fig)
        return fig

    def figure(self):
        """A static `plotly.graph_objects.Figure` of everything recorded (None without plotly)."""
        go = display.plotly_go()
        if go is None:
            return None
        fig = self._empty_figure(go.Figure)
        for _, column, props in self._trace_specs():
            fig.add_trace(_make_trace(go, props), row=1, col=column)
        self._label_log_axis(fig)
        if "memory" in self.panels and not any(
                p.memory_gb is not None for pts in self.series.values() for p in pts):
            axis = self.panels.index("memory") + 1
            suffix = "" if axis == 1 else str(axis)
            fig.add_annotation(text="not measured<br>(CUDA peak allocation only)",
                               xref=f"x{suffix} domain", yref=f"y{suffix} domain", x=0.5, y=0.5,
                               showarrow=False, font=dict(color="gray"))
        return fig

    # --- live drawing ------------------------------------------------------------------------
    def _start_live(self) -> None:
        start = self._clock()
        try:
            import ipywidgets
            import plotly.graph_objects as go

            self._figure_widget = self._empty_figure(go.FigureWidget)
            self._progress = ipywidgets.IntProgress(value=0, min=0, max=max(self.total or 1, 1),
                                                    description="progress")
            self._status = ipywidgets.HTML(value="waiting for the first point…")
            self._widget = ipywidgets.VBox([
                ipywidgets.HBox([self._progress, self._status]), self._figure_widget])
            self._widget.add_class(DASHBOARD_CLASS)
            self._handle = display.show_raw(self._widget, display_id=True)
            self.live = True
        except Exception as exc:  # a broken widget stack must not stop the training loop
            self.off_reason = f"{type(exc).__name__}: {exc}"
            self.note = f"live dashboard off: {self.off_reason}; static output at the end."
            print(self.note)
            self._widget = None
        self.overhead_s += self._clock() - start

    def _redraw(self) -> None:
        start = self._clock()
        go = display.plotly_go()
        fw = self._figure_widget
        specs = self._trace_specs()
        for key, column, props in specs:  # new variants get their traces first
            if key not in self._traces:
                fw.add_trace(_make_trace(go, props), row=1, col=column)
                self._traces[key] = len(fw.data) - 1
        with fw.batch_update():
            for key, _, props in specs:
                trace = fw.data[self._traces[key]]
                trace.x, trace.y = props["x"], props["y"]
                if trace.name != props["name"]:  # a label given after the trace was drawn
                    trace.name = props["name"]
                if props["type"] == "bar":
                    trace.marker.color = props["marker"]["color"]
            self._label_log_axis(fw, live=True)
        if self.total:
            self._progress.max = max(self.total, self.updates)
        self._progress.value = self.updates
        name, points = next(reversed(self.series.items()))
        last = points[-1]
        extra = "".join(f" · {k} {v:.3f}" for k, v in last.metrics.items() if k == "loss")
        self._status.value = (f"&nbsp;{html.escape(self.label(name))}: {display.format_value(last.value)} "
                              f"{html.escape(self.y_title)} at {html.escape(self.x_title)} "
                              f"{display.format_value(last.x)}{extra}")
        self.redraws += 1
        self._last_draw = self._clock()
        cost = self._last_draw - start
        self.overhead_s += cost
        self._interval = max(self.min_interval, cost / MAX_DRAW_SHARE)

    # --- the end -----------------------------------------------------------------------------
    def finish(self, *, show: bool = True, table: bool = True):
        """Replace the live view by a static figure and show the table (`table=False`: the
        figure only); returns the figure (a plotly `Figure`, or None without plotly). Safe to
        call more than once; `show=False` displays nothing."""
        start = self._clock()
        fig = self.figure()
        self.overhead_s += self._clock() - start
        if show and not self.finished:
            if self._handle is not None and fig is not None:
                display.show_figure(fig, display_id=self._handle)  # the widget's output becomes the figure
            else:
                display.show_figure(fig)
            if table or fig is None:
                display.show_table(self.table())
        self.close()
        self.finished = True
        return fig

    def close(self) -> None:
        """Remove the live widget without showing anything (e.g. after an error)."""
        if self._widget is not None:
            self._widget.close()
            self._widget = None
        self.live = False

    def __enter__(self) -> LiveDashboard:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.close()


def _make_trace(go, props: dict):
    props = dict(props)
    kind = props.pop("type")
    return go.Bar(**props) if kind == "bar" else go.Scatter(**props)


