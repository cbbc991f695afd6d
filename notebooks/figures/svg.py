"""The drawing primitives every figure script of the course uses: one page (a light card with
its title and alt text), boxes, arrows, text, brackets and a legend, all as SVG text.

Each figure is one script next to its SVG (`router_and_expert_loop.py` draws
`router_and_expert_loop.svg`): `svg()` returns the figure's text and `main(out_dir)` writes it.
`python notebooks/figures/draw_all.py` redraws them all. The output is a function of the scripts
alone — no dates, no fonts measured (text widths are estimated from the character count), every
coordinate printed with at most one decimal — so re-running a script rewrites the same bytes
(tests/notebooks/test_figures.py checks it).

Readable in JupyterLab's light and dark themes: everything is drawn on an explicit light card
(a rounded rect filling the viewBox, with a subtle border) in dark text, and every colour is a
pale fill with a dark stroke of enough contrast on that card.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from html import escape
from pathlib import Path

HERE = Path(__file__).resolve().parent
FONT = "DejaVu Sans, Arial, Helvetica, sans-serif"
MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"  # code in a figure
FONT_SIZE = 11
INK = "#1f2328"  # text: 15:1 on the card
MUTED = "#57606a"  # secondary text: 6:1 on the card
CARD, CARD_BORDER = "#ffffff", "#d0d7de"
LINE = "#555555"  # arrows and connectors


@dataclass(frozen=True)
class Colour:
    """A pale fill and the darker stroke drawn around it (text on the fill stays INK)."""

    fill: str
    stroke: str


BLUE = Colour("#dbe7fb", "#3a64b0")
ORANGE = Colour("#fde6cf", "#c26a12")
GREEN = Colour("#d5f2e3", "#1f8a53")
PURPLE = Colour("#e8dcf7", "#6f42c1")
RED = Colour("#fbdcdc", "#b42318")
TEAL = Colour("#d3f0f0", "#0f7b7b")
GREY = Colour("#eceef1", "#6e7781")
WHITE = Colour("#ffffff", "#8c959f")
# The experts of a figure, in order: every figure colours expert e with EXPERTS[e].
EXPERTS = (BLUE, ORANGE, GREEN, PURPLE)


def num(value: float) -> str:
    """A coordinate as SVG text: at most one decimal, no trailing zeros, never "-0"."""
    text = f"{value:.1f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def text_width(label: str, size: float = FONT_SIZE) -> float:
    """Estimated width of `label` in px (0.6 em a character: DejaVu Sans' average is below it)."""
    return len(label) * size * 0.6


def _attrs(**attrs) -> str:
    """SVG attributes from keyword arguments (underscores become dashes; None is left out)."""
    parts = []
    for key, value in attrs.items():
        if value is None:
            continue
        if isinstance(value, float | int) and not isinstance(value, bool):
            value = num(value)
        parts.append(f'{key.rstrip("_").replace("_", "-")}="{escape(str(value))}"')
    return " ".join(parts)


def element(tag: str, **attrs) -> str:
    """An empty SVG element: element("circle", cx=1, cy=2, r=3) -> <circle cx="1" cy="2" r="3"/>."""
    return f"<{tag} {_attrs(**attrs)}/>"


def text(x: float, y: float, label: str, *, size: float | None = None, weight: str | None = None,
         anchor: str | None = None, fill: str | None = None, italic: bool = False,
         family: str | None = None) -> str:
    """One line of text with its baseline at y (`anchor`: start, middle or end)."""
    attrs = _attrs(x=x, y=y, font_size=size, font_weight=weight, text_anchor=anchor, fill=fill,
                   font_style="italic" if italic else None, font_family=family)
    return f"<text {attrs}>{escape(label)}</text>"


def lines(x: float, y: float, labels: list[str] | tuple[str, ...], *, leading: float | None = None,
          **style) -> str:
    """Several lines of text, the first baseline at y, `leading` px apart."""
    step = leading or (style.get("size") or FONT_SIZE) * 1.35
    return "".join(text(x, y + i * step, label, **style) for i, label in enumerate(labels))


def rect(x: float, y: float, w: float, h: float, colour: Colour | None = None, *,
         rx: float = 4, stroke_width: float = 1, dash: str | None = None,
         fill: str | None = None, stroke: str | None = None) -> str:
    return element("rect", x=x, y=y, width=w, height=h, rx=rx or None,
                   fill=fill or (colour.fill if colour else "none"),
                   stroke=stroke or (colour.stroke if colour else None),
                   stroke_width=stroke_width if stroke_width != 1 else None, stroke_dasharray=dash)


def box(x: float, y: float, w: float, h: float, label: str | list[str], colour: Colour, *,
        size: float | None = None, weight: str | None = None, stroke_width: float = 1,
        dash: str | None = None, rx: float = 5) -> str:
    """A filled, outlined box with its label (one line or a list of lines) centred in it."""
    labels = [label] if isinstance(label, str) else label
    font = size or FONT_SIZE
    leading = font * 1.3
    first = y + h / 2 - (len(labels) - 1) * leading / 2 + font * 0.36
    return (rect(x, y, w, h, colour, rx=rx, stroke_width=stroke_width, dash=dash)
            + lines(x + w / 2, first, labels, leading=leading, size=size, weight=weight,
                    anchor="middle"))


def fit_width(label: str | list[str], size: float = FONT_SIZE, pad: float = 10) -> float:
    """The width of a box that holds `label` (its longest line) with `pad` px on each side."""
    labels = [label] if isinstance(label, str) else label
    return max(text_width(line, size) for line in labels) + 2 * pad


def line(x0: float, y0: float, x1: float, y1: float, *, colour: str = LINE,
         width: float = 1, dash: str | None = None) -> str:
    return element("line", x1=x0, y1=y0, x2=x1, y2=y1, stroke=colour, stroke_width=width,
                   stroke_dasharray=dash)


def circle(cx: float, cy: float, r: float, colour: Colour) -> str:
    return element("circle", cx=cx, cy=cy, r=r, fill=colour.fill, stroke=colour.stroke)


def curve(x0: float, y0: float, x1: float, y1: float, *, colour: str = LINE,
          width: float = 1.2) -> str:
    """An S-curve from (x0, y0) down (or up) to (x1, y1), leaving and arriving vertically."""
    mid = (y0 + y1) / 2
    return element("path", d=f"M{num(x0)},{num(y0)} C{num(x0)},{num(mid)} {num(x1)},{num(mid)} "
                              f"{num(x1)},{num(y1)}", fill="none", stroke=colour, stroke_width=width)


def _marker_id(colour: str) -> str:
    return "head-" + colour.lstrip("#").lower()


def arrow(x0: float, y0: float, x1: float, y1: float, *, colour: str = LINE,
          width: float = 1.2, dash: str | None = None) -> str:
    """A straight arrow from (x0, y0) whose head ends at (x1, y1)."""
    return element("line", x1=x0, y1=y0, x2=x1, y2=y1, stroke=colour, stroke_width=width,
                   stroke_dasharray=dash, marker_end=f"url(#{_marker_id(colour)})")


def path_arrow(d: str, *, colour: str = LINE, width: float = 1.2, dash: str | None = None) -> str:
    """An arrow along an SVG path (`d`), its head at the path's end."""
    return element("path", d=d, fill="none", stroke=colour, stroke_width=width,
                   stroke_dasharray=dash, marker_end=f"url(#{_marker_id(colour)})")


def bracket(x0: float, x1: float, y: float, label: str | list[str] = "", *, below: bool = True,
            colour: str = MUTED, size: float | None = None) -> str:
    """A square bracket spanning x0..x1 at height y, its tips pointing at what it groups
    (up when the bracket is below it), with `label` centred on its far side."""
    tip = -5 if below else 5
    shape = element("path", d=f"M{num(x0)},{num(y + tip)} V{num(y)} H{num(x1)} V{num(y + tip)}",
                    fill="none", stroke=colour)
    if not label:
        return shape
    font = size or FONT_SIZE
    labels = [label] if isinstance(label, str) else label
    first = y + font + 3 if below else y - 5 - (len(labels) - 1) * font * 1.3
    return shape + lines((x0 + x1) / 2, first, labels, leading=font * 1.3, size=size,
                         anchor="middle")


def vbracket(x: float, y0: float, y1: float, label: str | list[str] = "", *, right: bool = True,
             colour: str = MUTED, size: float | None = None) -> str:
    """A vertical bracket spanning y0..y1 at x, its label beside it (right or left)."""
    tip = -5 if right else 5
    shape = element("path", d=f"M{num(x + tip)},{num(y0)} H{num(x)} V{num(y1)} H{num(x + tip)}",
                    fill="none", stroke=colour)
    if not label:
        return shape
    font = size or FONT_SIZE
    labels = [label] if isinstance(label, str) else label
    first = (y0 + y1) / 2 - (len(labels) - 1) * font * 0.65 + font * 0.36
    return shape + lines(x + (6 if right else -6), first, labels, leading=font * 1.3, size=size,
                         anchor="start" if right else "end")


def legend(x: float, y: float, items: list[tuple[Colour, str]], *, gap: float = 22,
           size: float | None = None) -> tuple[str, float]:
    """Swatches with their meanings in one row from (x, y = text baseline). Returns (svg, right
    edge)."""
    parts = []
    for colour, label in items:
        parts.append(rect(x, y - 10, 14, 12, colour, rx=2) + text(x + 20, y, label, size=size))
        x += 20 + text_width(label, size or FONT_SIZE) + gap
    return "".join(parts), x - gap


class Figure:
    """One SVG page: a light card of `width` × `height` px with a <title>, a <desc> (the alt
    text, for screen readers) and the elements added to it, in order."""

    def __init__(self, width: float, height: float, title: str, desc: str):
        self.width, self.height = width, height
        self.title, self.desc = title, desc
        self.parts: list[str] = []

    def add(self, *parts: str) -> Figure:
        self.parts.extend(parts)
        return self

    def heading(self, label: str, *, x: float = 14, y: float = 24) -> Figure:
        return self.add(text(x, y, label, size=14, weight="bold"))

    def render(self) -> str:
        body = "\n".join(self.parts)
        markers = sorted(set(re.findall(r"url\(#head-([0-9a-f]{6})\)", body)))
        defs = "".join(
            f'<marker id="head-{c}" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="7" '
            f'markerHeight="7" orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#{c}"/></marker>'
            for c in markers)
        w, h = num(self.width), num(self.height)
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
            f'viewBox="0 0 {w} {h}" role="img" aria-labelledby="title desc" '
            f'font-family="{FONT}" font-size="{FONT_SIZE}" fill="{INK}">\n'
            f'<title id="title">{escape(self.title)}</title>\n'
            f'<desc id="desc">{escape(self.desc)}</desc>\n'
            + (f"<defs>{defs}</defs>\n" if defs else "")
            + f'<rect class="background" x="0.5" y="0.5" width="{num(self.width - 1)}" '
              f'height="{num(self.height - 1)}" rx="10" fill="{CARD}" stroke="{CARD_BORDER}"/>\n'
            + body + "\n</svg>\n")


def save(script: str, content: str, out_dir: str | Path | None = None) -> Path:
    """Write a figure script's SVG (`content`) as <script's stem>.svg into `out_dir` (default:
    next to the script) and return its path; LF line endings and UTF-8 on every platform."""
    path = Path(out_dir or HERE) / (Path(script).stem + ".svg")
    path.write_text(content, encoding="utf-8", newline="\n")
    return path
