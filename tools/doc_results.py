"""What every generated document reads: the committed result files (`load_result`, each read once),
a link to one, a region's markers (`REGION`, `region_block`), and the markdown a region is written in (`md_table`, `value_span`). The region
modules (`benchmarks_page`, `chapter_clock`) and the chart (`ladder_chart`) share these;
`tools/docs.py` writes their regions.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
NOTEBOOKS = ROOT / "notebooks"
RESULTS_LINK = "benchmarks/results"  # a result file's link, from the repository's root


# A generated region: the markers around it, and its text between them.
REGION = re.compile(
    r"<!-- BEGIN generated: (?P<name>[\w-]+) \(python -m tools.docs\) -->\n"
    r"(?P<body>.*?)<!-- END generated: (?P=name) -->", re.DOTALL)
MARKER = re.compile(r"<!-- (BEGIN|END) generated: ([\w-]+)")


def region_block(name: str, body: str) -> str:
    return (f"<!-- BEGIN generated: {name} (python -m tools.docs) -->\n{body.rstrip()}\n"
            f"<!-- END generated: {name} -->")


class DocsError(ValueError):
    """A document the generator cannot work on: missing, or its markers broken. The message is
    one line that names the file and the fix."""


@functools.cache
def load_result(name: str) -> dict:
    try:
        with open(RESULTS / name) as f:
            return json.load(f)
    except FileNotFoundError:
        raise DocsError(f"{RESULTS / name}: no such result file; the documents quote it, so "
                        "restore it from git or re-run what wrote it") from None


def result_link(name: str) -> str:
    return f"[`{name}`]({RESULTS_LINK}/{name})"


def value_span(values, fmt: str) -> str:
    """'lo–hi' of the values in `fmt`, one value where both ends print alike."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return lo if lo == hi else f"{lo}–{hi}"


def md_table(header: list[str], align: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
