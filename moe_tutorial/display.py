"""What the package shows, at its smallest: a `Table` (plain text and HTML, no pandas), static plotly
figures (`show_figure`, with 1-2-5 ticks on log axes) and where they can be drawn (`in_kernel`,
`plotly_go`). Below every concern: `perf/` returns its numbers through these and `course/`
(the chapters' views, the live dashboard and widgets) builds on them.

Outside IPython a table prints as text and a figure is not drawn; without plotly a figure is
`None` and only its table shows.
"""

from __future__ import annotations

import html
import importlib.util
import json
import math
import sys
from collections.abc import Sequence

PLOTLY_MIME = "application/vnd.plotly.v1+json"
PALETTE = ("#636EFA", "#EF553B", "#00CC96", "#AB63FA", "#FFA15A", "#19D3F3", "#FF6692",
           "#B6E880", "#FF97FF", "#FECB52")


# Where are we running, and what is installed?

def ipython_shell():
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
    shell = ipython_shell()
    return shell is not None and getattr(shell, "kernel", None) is not None


def missing_modules(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def plotly_go():
    """plotly.graph_objects, or None when plotly is not installed."""
    try:
        import plotly.graph_objects as go
    except ImportError:
        return None
    return go



def show_raw(obj, **kwargs):
    """IPython's display (patched in tests); prints the plain text outside IPython."""
    if ipython_shell() is None:
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
    show_raw(table._repr_mimebundle_(), raw=True)


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
    if ipython_shell() is None:  # nowhere to draw outside IPython
        return None
    return show_raw(figure_bundle(fig), raw=True)
