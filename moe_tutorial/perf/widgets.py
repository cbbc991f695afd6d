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

`Table` (a plain-text and HTML table, no pandas) and `show_figure` are what the notebooks' closing
cells use; the course runner copies those outputs into its report.
"""

from __future__ import annotations

import html
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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
PLOTLY_MIME = "application/vnd.plotly.v1+json"
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
PALETTE = ("#636EFA", "#EF553B", "#00CC96", "#AB63FA", "#FFA15A", "#19D3F3", "#FF6692",
           "#B6E880", "#FF97FF", "#FECB52")


# ---------------------------------------------------------------------------------------------
# Where are we running, and what is installed?

def _ipython():
    """The running IPython shell, or None (plain Python, pytest)."""
    if "IPython" not in sys.modules:  # importing IPython just to ask would cost ~0.3 s
        return None
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def in_kernel() -> bool:
    """True inside a Jupyter kernel (JupyterLab, papermill, nbval), where widgets can display."""
    shell = _ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def _missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def plotly_go():
    """plotly.graph_objects, or None when plotly is not installed."""
    try:
        import plotly.graph_objects as go
    except ImportError:
        return None
    return go


def frontend_attached() -> bool:
    """Is a person likely watching? True in kernels that a Jupyter server started for a notebook
    (it sets $JPY_SESSION_NAME), or when $MOE_TUTORIAL_LIVE=always. False in the kernels of
    papermill and nbval, where live widgets would only cost time: the messages they send compete
    with the measured work for the CPU (a third of the tokens/s on 2 cores, measured)."""
    return os.environ.get(LIVE_ENV) == "always" or bool(os.environ.get(FRONTEND_ENV))


def live_support() -> tuple[bool, str]:
    """(True, "") when a live dashboard can be drawn here, else (False, why not)."""
    if not in_kernel():
        return False, "not running in a Jupyter kernel"
    if os.environ.get(LIVE_ENV) == "0":
        return False, f"${LIVE_ENV}=0"
    missing = _missing("plotly", "ipywidgets", "anywidget")
    if missing:
        return False, (f"{' and '.join(missing)} not installed (pip install {' '.join(missing)}; "
                       "plotly's FigureWidget needs anywidget)")
    if not frontend_attached():
        return False, (f"no Jupyter frontend attached, a headless run (${LIVE_ENV}=always "
                       "draws anyway)")
    return True, ""


def _display(obj, **kwargs):
    """IPython's display (patched in tests); prints the plain text outside IPython."""
    if _ipython() is None:
        text = obj.get("text/plain", "") if isinstance(obj, dict) else str(obj)
        if text:
            print(text)
        return None
    from IPython.display import display

    return display(obj, **kwargs)


# ---------------------------------------------------------------------------------------------
# Tables

def format_value(value) -> str:
    """A compact, readable rendering of a table cell: thousands separators, ~3-4 digits."""
    if value is None:
        return ""
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        magnitude = abs(value)
        if magnitude >= 1000:
            return f"{value:,.0f}"
        if magnitude >= 100:
            return f"{value:.1f}"
        if magnitude >= 1 or magnitude == 0:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def _is_number(text: str) -> bool:
    try:
        float(text.replace(",", "").rstrip("x×%"))
    except ValueError:
        return False
    return True


class Table:
    """A small table that shows as HTML in Jupyter and as aligned text everywhere else.

    Cells may be strings (shown as given) or numbers (formatted by `format_value`). Numeric
    columns are right-aligned. `str(table)` is the text form; in a notebook, `table` (or
    `show_table(table)`) displays both forms and the frontend picks one.
    """

    def __init__(self, headers: Sequence[str], rows: Sequence[Sequence], *, title: str = "",
                 note: str = ""):
        self.headers = [str(h) for h in headers]
        self.rows = [[format_value(c) for c in row] for row in rows]
        for row in self.rows:
            if len(row) != len(self.headers):
                raise ValueError(f"row {row} has {len(row)} cells, the table has "
                                 f"{len(self.headers)} columns: {self.headers}")
        self.title = title
        self.note = note

    def _numeric_columns(self) -> list[bool]:
        return [bool(self.rows) and all(not r[i] or _is_number(r[i]) for r in self.rows)
                and any(r[i] for r in self.rows) for i in range(len(self.headers))]

    def text(self) -> str:
        numeric = self._numeric_columns()
        widths = [max([len(h)] + [len(r[i]) for r in self.rows]) for i, h in enumerate(self.headers)]

        def line(cells):
            return "  ".join(c.rjust(w) if num else c.ljust(w)
                             for c, w, num in zip(cells, widths, numeric)).rstrip()

        out = [self.title] if self.title else []
        out += [line(self.headers), "  ".join("-" * w for w in widths)]
        out += [line(r) for r in self.rows]
        if self.note:
            out.append(self.note)
        return "\n".join(out)

    def html(self) -> str:
        numeric = self._numeric_columns()

        def cell(tag, text, num):
            style = ' style="text-align:right"' if num else ' style="text-align:left"'
            return f"<{tag}{style}>{html.escape(text)}</{tag}>"

        parts = ['<table class="moe-table">']
        if self.title:
            parts.append(f"<caption>{html.escape(self.title)}</caption>")
        parts.append("<thead><tr>" + "".join(cell("th", h, n) for h, n in zip(self.headers, numeric))
                     + "</tr></thead><tbody>")
        for row in self.rows:
            parts.append("<tr>" + "".join(cell("td", c, n) for c, n in zip(row, numeric)) + "</tr>")
        parts.append("</tbody></table>")
        if self.note:
            parts.append(f'<p class="moe-table-note">{html.escape(self.note)}</p>')
        return "".join(parts)

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return self.text()

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/plain": self.text(), "text/html": self.html()}


def show_table(table: Table) -> None:
    """Display a table (HTML + text in Jupyter, text elsewhere)."""
    _display(table._repr_mimebundle_(), raw=True)


# ---------------------------------------------------------------------------------------------
# Static figures

def log_ticks(low: float, high: float) -> list[float]:
    """Tick values for a logarithmic axis over data in [low, high] (both > 0): 1, 2 and 5 times
    the powers of ten, or only the powers of ten over more than three decades; 1 to 9 times them
    where that leaves fewer than two ticks inside; [] where even that does (a range this narrow
    reads well with plotly's own ticks). One tick on each side beyond the data is included:
    plotly draws it where the axis's padding reaches it and hides it otherwise. Plotly's default
    on a log axis spanning about a decade labels the minor ticks by their first digit
    ("3 2 100 9 8 7 6 5 4 3")."""
    if not 0 < low <= high:
        raise ValueError(f"a log axis needs 0 < low <= high, got {low!r}, {high!r}")
    first, last = math.floor(math.log10(low)), math.ceil(math.log10(high))
    for mantissas in (((1,) if last - first > 3 else (1, 2, 5)), tuple(range(1, 10))):
        ticks = [float(f"{m}e{e}") for e in range(first - 1, last + 2) for m in mantissas]
        inside = [i for i, t in enumerate(ticks) if low * (1 - 1e-9) <= t <= high * (1 + 1e-9)]
        if len(inside) >= 2:
            return ticks[inside[0] - 1: inside[-1] + 2]
    return []


def tick_label(value: float) -> str:
    """A tick value as a short label: 0.05, 2, 500, 2k, 10M."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


_TYPED_ARRAYS = {"f8": "d", "f4": "f", "i1": "b", "u1": "B", "i2": "h", "u2": "H", "i4": "i",
                 "u4": "I", "i8": "q", "u8": "Q"}


def _numbers(values) -> list[float]:
    """The finite numbers of a trace's x or y in plotly JSON (a list, or plotly's base64 typed
    array {"dtype", "bdata"}); anything else (categories) is left out."""
    if isinstance(values, dict) and values.get("dtype") in _TYPED_ARRAYS and "bdata" in values:
        import array
        import base64

        typed = array.array(_TYPED_ARRAYS[values["dtype"]])
        typed.frombytes(base64.b64decode(values["bdata"]))
        values = typed.tolist()
    if not isinstance(values, list):
        return []
    return [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(v)]


def label_log_axes(fig_json: dict) -> dict:
    """Give every logarithmic axis of a figure (plotly JSON) that has no tick values of its own
    the `log_ticks` of its data, labelled by `tick_label`. Returns `fig_json`, changed in place."""
    layout = fig_json.setdefault("layout", {})
    for name, axis in list(layout.items()):
        if not (isinstance(axis, dict) and name[:5] in ("xaxis", "yaxis") and
                axis.get("type") == "log" and "tickvals" not in axis):
            continue
        letter, ref = name[0], name[0] + name[5:]  # "yaxis2" -> trace["yaxis"] == "y2"
        values = [v for trace in fig_json.get("data", [])
                  if trace.get(f"{letter}axis", letter) == ref
                  for v in _numbers(trace.get(letter)) if v > 0]
        ticks = log_ticks(min(values), max(values)) if values else []
        if ticks:
            axis.update(tickmode="array", tickvals=ticks, ticktext=[tick_label(t) for t in ticks])
    return fig_json


def figure_bundle(fig) -> dict:
    """The display bundle of a static plotly figure: plotly's own JSON mimetype (JupyterLab
    renders it with its plotly extension, the course report with plotly.js) plus a line of text
    for text-only readers (papermill logs, nbval). Log axes get 1-2-5 ticks (`label_log_axes`)."""
    import plotly.io as pio

    fig_json = label_log_axes(json.loads(pio.to_json(fig, validate=False)))
    title = fig.layout.title.text or "figure"
    names = sorted({t.name for t in fig.data if t.name})
    text = f"<plotly figure: {title}; {len(fig.data)} traces" + (
        f" ({', '.join(names)})>" if names else ">")
    return {PLOTLY_MIME: {"data": fig_json.get("data", []), "layout": fig_json.get("layout", {}),
                          "config": {"displaylogo": False}},
            "text/plain": text}


def show_figure(fig, *, display_id=None):
    """Display a static plotly figure (see `figure_bundle`); returns the display handle."""
    if fig is None:
        return None
    if display_id is not None:  # replace what that display showed (the live widget)
        return display_id.update(figure_bundle(fig), raw=True)
    if _ipython() is None:  # nowhere to draw outside IPython
        return None
    return _display(figure_bundle(fig), raw=True)


# ---------------------------------------------------------------------------------------------
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
                if in_kernel():  # live widgets were asked for and cannot be had: say why, once
                    self.note = f"live dashboard off: {why}; static figure and table at the end."
                    print(self.note)
        if plotly_go() is None and in_kernel():
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
        from .timing import peak_memory_gb  # torch is imported only by code that trains

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

    def table(self) -> Table:
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
            row = [self.label(r["variant"]), r["points"], format_value(r["last_x"]), r["last"], r["median"]]
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
        return Table(headers, rows, title=self.title, note=note)

    # --- figures -----------------------------------------------------------------------------
    def _panel_titles(self) -> list[str]:
        return [PANEL_TITLES[p].format(y_title=self.y_title, baseline=self.baseline or "baseline")
                for p in self.panels]

    def label(self, variant: str) -> str:
        """What the legend and the table call `variant` (see `update`'s `label`)."""
        return self.labels.get(variant, variant)

    def _color(self, variant: str) -> str:
        return PALETTE[list(self.series).index(variant) % len(PALETTE)]

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
        go = plotly_go()
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
            self._handle = _display(self._widget, display_id=True)
            self.live = True
        except Exception as exc:  # a broken widget stack must not stop the training loop
            self.off_reason = f"{type(exc).__name__}: {exc}"
            self.note = f"live dashboard off: {self.off_reason}; static output at the end."
            print(self.note)
            self._widget = None
        self.overhead_s += self._clock() - start

    def _redraw(self) -> None:
        start = self._clock()
        go = plotly_go()
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
        self._status.value = (f"&nbsp;{html.escape(self.label(name))}: {format_value(last.value)} "
                              f"{html.escape(self.y_title)} at {html.escape(self.x_title)} "
                              f"{format_value(last.x)}{extra}")
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
                show_figure(fig, display_id=self._handle)  # the widget's output becomes the figure
            else:
                show_figure(fig)
            if table or fig is None:
                show_table(self.table())
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


# ---------------------------------------------------------------------------------------------
# Predict, then measure

class Prediction:
    """A question the learner answers before a measurement, graded by it in one sentence.

        guess = predict("Will FP8 be faster than bf16 at hidden 128?", ["yes", "no"])
        ...                                          # the measurement
        guess.grade("no" if fp8_ms > bf16_ms else "yes", f"FP8 {fp8_ms:.1f} ms, bf16 {bf16_ms:.1f} ms")

    It starts unanswered: nothing is preselected, so a guess is always the learner's own. With a
    Jupyter frontend attached the question is a row of buttons (a drop-down of the numbers, for
    a `range`), none pressed, and the grade follows the answer: pick one, or change it after the
    measurement, and the sentence changes. Headless (papermill, nbval, a script) nobody can
    answer: the grade says "not answered yet" and still shows what the measurement says and why,
    and nothing waits for input."""

    def __init__(self, question: str, choices, *, live: bool = True):
        numeric = isinstance(choices, range)
        if numeric:
            if len(choices) < 2:
                raise ValueError(f"a prediction needs two or more choices; got {choices!r}")
        else:
            choices = [str(c) for c in choices]
            if len(choices) < 2 or len(set(choices)) != len(choices):
                raise ValueError(f"a prediction needs two or more distinct choices; got {choices}")
        self.question, self.choices = question, choices
        self._widget = self._output = None
        self._graded: tuple | None = None
        if live and live_support()[0]:
            import ipywidgets

            if numeric:
                self._widget = ipywidgets.Dropdown(options=list(choices), value=None,
                                                   description="your guess")
            else:
                self._widget = ipywidgets.ToggleButtons(options=choices, value=None)
            _display(ipywidgets.VBox([ipywidgets.HTML(f"<b>Predict:</b> {question}"),
                                      self._widget]))
        else:
            options = (f"a number in {choices.start}..{choices.stop - 1}" if numeric
                       else " / ".join(choices))
            print(f"Predict: {question} ({options})\n"
                  f"  [a headless run has no one to answer: it stays unanswered]")

    @property
    def answer(self):
        """The learner's answer, or None while nothing is picked."""
        return self._widget.value if self._widget is not None else None

    def grade(self, truth, why: str, *, tolerance: float = 0) -> None:
        """Say whether the answer matches `truth` (a choice, or a number within `tolerance`),
        with `why`: what the measurement showed; `right` then holds whether it matched (None
        while unanswered). (It returns nothing: a `True` / `False` would print under a notebook
        cell ending in it.)"""
        self._graded = (truth, why, tolerance)
        if self._widget is not None and self._output is None:
            import ipywidgets

            self._output = ipywidgets.HTML()
            self._widget.observe(lambda _: self._render(), names="value")
            _display(self._output)
        self._render()

    @property
    def right(self) -> bool | None:
        """Whether the answer (as it is now) matches the measurement, None while unanswered;
        `grade` first."""
        if self._graded is None:
            raise RuntimeError("grade(truth, why) the prediction before asking whether it was right")
        truth, _, tolerance = self._graded
        if self.answer is None:
            return None
        if isinstance(self.choices, range):
            return abs(self.answer - truth) <= tolerance
        return self.answer == str(truth)

    @property
    def verdict(self) -> str:
        """'right', 'not this time' or 'not answered yet', for a summary table; `grade` first."""
        return {True: "right", False: "not this time", None: "not answered yet"}[self.right]

    def _render(self) -> None:
        truth, why, _ = self._graded
        if self.answer is None:
            sentence = f"– Not answered yet: the measurement says {truth!r}. {why}"
        else:
            sentence = (f"{'✓ Right' if self.right else '✗ Not this time'}: you predicted "
                        f"{self.answer!r}, the measurement says {truth!r}. {why}")
        if self._output is not None:
            self._output.value = f"<p>{html.escape(sentence)}</p>"
        else:
            print(sentence)


def predict(question: str, choices, *, live: bool = True) -> Prediction:
    """Ask `question` before a measurement (`choices`: a list of answers, or a `range` for a
    number), unanswered until the learner picks; grade it after with `.grade(truth, why)`. See
    `Prediction`."""
    return Prediction(question, choices, live=live)


# ---------------------------------------------------------------------------------------------
# Routing skew, explored with a slider

SKEW_SLIDER_CLASS = "moe-skew-slider"  # CSS classes a browser test finds the explorer by
SKEW_OUTPUT_CLASS = "moe-skew-output"
SKEW_EXPLORER_CLASS = "moe-skew-explorer"


class SkewExplorer:
    """A slider from balanced routing (0) to one hot expert (1) and what that skew costs, for
    `tokens` tokens routed to `top_k` of `num_experts` experts of size `hidden` × `intermediate`:
    the token copies per expert, the padding waste per alignment, the expert-parallel straggler
    wait per `ep`, and the grouped GEMMs' rate against balanced routing, measured on `device`
    (all from `moe_tutorial.perf.skew`). A plotly figure and a `Table` show them.

        explorer = skew_explorer(4096, 8, 2, 128, 256, device=SETUP.device)

    With a Jupyter frontend attached (see `live_support`) the slider redraws the output when it
    is released (`continuous_update=False`); every skew is measured once and cached, so going
    back is instant. Headless (papermill, nbval, a script) nobody moves it, so the explorer draws
    once at `default_skew`, says it is static and why, and waits for nothing.

    ep          expert-parallel sizes to show the straggler wait for (default: 2 and 4 where
                they divide num_experts)
    alignments  rows-per-expert alignments to show the padding waste for
    iters       timed calls per measurement (median; each skew also times balanced routing)
    """

    def __init__(self, tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 *, ep: int | Sequence[int] | None = None, alignments: Sequence[int] | None = None,
                 device="cpu", dtype=None, default_skew: float = 0.0, step: float = 0.05,
                 iters: int = 5, live: bool = True):
        from . import skew  # skew imports torch; tables load without it

        self.tokens, self.num_experts, self.top_k = tokens, num_experts, top_k
        self.hidden, self.intermediate = hidden, intermediate
        self.device, self.dtype, self.iters = device, dtype, iters
        self.alignments = skew.DEFAULT_ALIGNMENTS if alignments is None else tuple(alignments)
        if ep is None:
            ep = [size for size in (2, 4) if size <= num_experts and num_experts % size == 0]
        self.eps = (ep,) if isinstance(ep, int) else tuple(ep)
        if not 0 < step <= 1:
            raise ValueError(f"step={step!r} must be in (0, 1]: the slider's increment of skew")
        # Everything that skew refuses is refused now, before anything is drawn.
        self._balanced = self._routing_costs(skew.skewed_splits(tokens, num_experts, top_k, 0.0))
        skew.skewed_splits(tokens, num_experts, top_k, default_skew)
        self.results: dict[float, dict] = {}  # skew -> measure(skew), the cache
        self.skew = default_skew
        self.live, self.off_reason = False, ""
        self.slider = self.output = self._widget = None
        ok, why = live_support() if live else (False, "live=False")
        if ok:
            self._start_live(step)
        else:
            self.off_reason = why
            if live and in_kernel():  # a slider was asked for and cannot be had: say why, once
                print(f"skew explorer static at skew {default_skew:.2f}: {why}; with a Jupyter "
                      f"frontend attached its slider redraws this.")
            self._show_static()

    # --- numbers ---------------------------------------------------------------------------
    def _routing_costs(self, splits: list[int]) -> dict:
        from . import skew  # skew imports torch; tables load without it

        return {"splits": splits, "padding": skew.padding_waste(splits, self.alignments),
                "stragglers": {size: skew.straggler_wait(splits, size) for size in self.eps}}

    def measure(self, skew_value: float) -> dict:
        """Everything the explorer shows at `skew_value` (cached): "skew", "splits", "padding"
        (per alignment), "stragglers" (per ep), "gemm" (`skew.grouped_gemm_efficiency`), and
        "balanced": the splits, padding and stragglers of balanced routing."""
        from . import skew  # skew imports torch; tables load without it

        key = round(float(skew_value), 6)
        if key not in self.results:
            splits = skew.skewed_splits(self.tokens, self.num_experts, self.top_k, key)
            gemm = skew.grouped_gemm_efficiency(splits, self.hidden, self.intermediate,
                                                device=self.device, dtype=self.dtype,
                                                iters=self.iters)
            self.results[key] = {"skew": key, **self._routing_costs(splits), "gemm": gemm,
                                 "balanced": self._balanced}
        return self.results[key]

    def table(self, skew_value: float | None = None) -> Table:
        """The numbers at `skew_value` (default: the slider's) next to balanced routing's."""
        r = self.measure(self.skew if skew_value is None else skew_value)
        balanced, gemm = r["balanced"], r["gemm"]

        def padding(costs, align):
            waste = costs["padding"][align]
            return f"{waste['padding_rows']:,} rows ({waste['fraction']:.1%})"

        def wait(costs, size):
            s = costs["stragglers"][size]
            return f"{s['wait']:.1%} (rows per rank {'/'.join(map(str, s['rows_per_rank']))})"

        rows = [["token copies of expert 0 (the hot one)",
                 f"{r['splits'][0]:,} of {self.tokens:,} tokens", f"{balanced['splits'][0]:,}"]]
        rows += [[f"padding at alignment {a}", padding(r, a), padding(balanced, a)]
                 for a in self.alignments]
        rows += [[f"straggler wait, ep={size}", wait(r, size), wait(balanced, size)]
                 for size in self.eps]
        rows += [["grouped GEMMs, forward",
                  f"{gemm['skewed_ms']:.2f} ms, {gemm['skewed_tflops']:.3g} TFLOP/s",
                  f"{gemm['balanced_ms']:.2f} ms, {gemm['balanced_tflops']:.3g} TFLOP/s"],
                 ["GEMM efficiency (balanced ms / this ms)", f"{gemm['efficiency']:.2f}", "1.00"]]
        mode = ("live: move the slider" if self.live
                else f"static ({self.off_reason.split(' (')[0]})")
        note = (f"measured here: {gemm['path']}, {gemm['dtype']}, median of {self.iters} "
                f"({gemm['timer']}), interleaved with balanced routing; the straggler wait "
                f"assumes time ∝ rows. Explorer: {mode}.")
        return Table(["", "this skew", "balanced routing"], rows, note=note,
                     title=f"routing skew {r['skew']:.2f}: {self.tokens:,} tokens, "
                           f"top-{self.top_k} of {self.num_experts} experts")

    def figure(self, skew_value: float | None = None):
        """A static plotly figure of the numbers at `skew_value` (None without plotly)."""
        go = plotly_go()
        if go is None:
            return None
        from plotly.subplots import make_subplots

        r = self.measure(self.skew if skew_value is None else skew_value)
        gemm = r["gemm"]
        fig = go.Figure(make_subplots(rows=1, cols=4, horizontal_spacing=0.07, subplot_titles=[
            "token copies per expert", "padding, % of rows", "EP straggler wait, % idle",
            f"GEMM TFLOP/s (efficiency {gemm['efficiency']:.2f})"]))
        fig.add_trace(go.Bar(x=list(range(self.num_experts)), y=r["splits"], name="this skew",
                             marker_color=PALETTE[1], showlegend=False), row=1, col=1)
        fig.add_hline(y=self.tokens * self.top_k / self.num_experts, row=1, col=1,
                      line=dict(color="gray", dash="dot"), annotation_text="balanced")
        fig.add_trace(go.Bar(x=[f"align {a}" for a in self.alignments],
                             y=[100 * r["padding"][a]["fraction"] for a in self.alignments],
                             marker_color=PALETTE[3], showlegend=False), row=1, col=2)
        fig.add_trace(go.Bar(x=[f"ep={size}" for size in self.eps],
                             y=[100 * r["stragglers"][size]["wait"] for size in self.eps],
                             marker_color=PALETTE[4], showlegend=False), row=1, col=3)
        fig.add_trace(go.Bar(x=["balanced", "this skew"],
                             y=[gemm["balanced_tflops"], gemm["skewed_tflops"]],
                             marker_color=[PALETTE[0], PALETTE[1]], showlegend=False), row=1, col=4)
        # Fixed ranges where the bound is known, so moving the slider moves the bars, not the axes.
        fig.update_yaxes(range=[0, self.tokens * 1.05], row=1, col=1)
        fig.update_yaxes(range=[0, 100], row=1, col=3)
        fig.update_xaxes(title_text="expert", row=1, col=1)
        fig.update_annotations(font_size=13)  # the panel titles: four side by side
        fig.update_layout(title=dict(text=f"routing skew {r['skew']:.2f}"), height=360,
                          margin=dict(t=80, b=50), template="plotly_white")
        return fig

    # --- drawing ---------------------------------------------------------------------------
    def _show_static(self) -> None:
        fig = self.figure()
        show_figure(fig)
        show_table(self.table())

    def _outputs(self) -> tuple[dict, ...]:
        """The output widget's content at the slider's skew: the figure and the table."""
        fig = self.figure()
        bundles = ([figure_bundle(fig)] if fig is not None else []) + [self.table()._repr_mimebundle_()]
        return tuple({"output_type": "display_data", "data": b, "metadata": {}} for b in bundles)

    def _start_live(self, step: float) -> None:
        import ipywidgets

        self.slider = ipywidgets.FloatSlider(
            value=self.skew, min=0.0, max=1.0, step=step, continuous_update=False,
            readout_format=".2f", description="routing skew: balanced → one hot expert",
            style={"description_width": "initial"}, layout=ipywidgets.Layout(width="640px"))
        self.slider.add_class(SKEW_SLIDER_CLASS)
        self.output = ipywidgets.Output()
        self.output.add_class(SKEW_OUTPUT_CLASS)
        self._widget = ipywidgets.VBox([self.slider, self.output])
        self._widget.add_class(SKEW_EXPLORER_CLASS)
        self.live = True
        self.output.outputs = self._outputs()
        self.slider.observe(self._on_slider, names="value")
        _display(self._widget)

    def _on_slider(self, change) -> None:
        """Redraw at the slider's new value. A failure is shown in the output: raised inside a
        widget callback it would only reach the frontend's log, where nobody looks."""
        self.skew = change["new"]
        try:
            self.output.outputs = self._outputs()
        except Exception as exc:
            self.output.outputs = ({"output_type": "stream", "name": "stderr",
                                    "text": f"skew {self.skew:.2f} could not be measured: "
                                            f"{type(exc).__name__}: {exc}\n"},)


def skew_explorer(tokens: int, num_experts: int, top_k: int, hidden: int, intermediate: int,
                  **options) -> SkewExplorer:
    """Show a routing-skew slider and what skew costs here (see `SkewExplorer` for `options`)."""
    return SkewExplorer(tokens, num_experts, top_k, hidden, intermediate, **options)
