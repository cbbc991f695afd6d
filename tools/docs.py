"""The measured numbers the documents state, rendered from the files under `benchmarks/results/`.

Every measured number in `README.md` and the pages under `docs/` (today the README's chapter table
and `docs/benchmarks.md`) sits between two markers,

    <!-- BEGIN generated: NAME (python -m tools.docs) -->
    ...
    <!-- END generated: NAME -->

and is rendered here from the JSON the run wrote, so one file is the source of each number; the
README's headline chart (`docs/train-step-ladder.svg`) is drawn here from the same files:

    python -m tools.docs           # rewrite the regions and the chart from the results
    python -m tools.docs --check   # exit 1, with a diff per region, where they disagree

A re-run of a benchmark changes the documents by `docs`; a hand edit inside a region or of the
chart, or a result file that changed without `docs`, fails `--check` (tests/tools/test_docs.py runs it
with the suite). Each region lives in exactly one document, whichever it is; a region lost or
doubled in an edit is an error. Figures published by others come from `published_recipe.json`,
each with the file it was published in. The output is a function of the committed files alone
(no date or time of day, fixed formats).

The regions live in one module per document (`tools/benchmarks_page.py`: docs/benchmarks.md;
`tools/chapter_clock.py`: the README's chapter table, docs/course.md's clock and each chapter's
header; `tools/ladder_chart.py`: the chart); this module writes and checks them all.

The README's chapter table is rendered too, by the course's clock (`Work`; the method is written
in docs/course.md, "How the times are made"): each chapter's minutes from what a learner reads and
does in it (prose, code, the output its cells print, their run time, its predictions and figures),
each exercise's from its prose, code, the functions to write and the open questions (its optional
last section, "Going further (optional)", timed apart and left out of the totals); the printed
output and the run times come from a headless small-mode run of the course (`python -m
moe_tutorial run`, recorded with `docs --record-run`). Each chapter's header states the same
times: a `chapter-time` region in the first markdown cell of a notebook under `notebooks/` is
rendered in place (a notebook without one is left alone), and `--check` fails where it disagrees;
so a chapter, an exercise or a solution edited without `docs` fails it too.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from tools import benchmarks_page as page
from tools.chapter_clock import (
    chapter_notebooks,
    chapter_times,
    clock_table,
    record_course_run,
    render_chapter_time,
)
from tools.doc_results import MARKER, NOTEBOOKS, REGION, RESULTS_LINK, ROOT, DocsError, region_block
from tools.ladder_chart import CHART, train_step_chart

# The documents that may hold generated regions: the README and every page under docs/ (paths
# relative to the repository); and the generated chart
README_NAME, DOCS_DIR = "README.md", "docs"



# ---------------------------------------------------------------------------------------------
# The regions, rendering and checking

def regions() -> dict[str, Callable[[], str]]:
    """Region name -> its renderer."""
    return {
        "chapter-times": chapter_times,
        "clock": clock_table,
        "cpu-train": page.cpu_train,
        "h200-environment": page.h200_environment,
        "h200-expert-layer": page.h200_expert_layer,
        "h200-fsdp2-world1": page.h200_fsdp2_world1,
        "h200-analyze": page.h200_analyze,
        "h200-expert-notes": page.h200_expert_notes,
        "h200-train-step": page.h200_train_step,
        "h200-targets": page.h200_targets,
        "h200-speed-of-light": page.h200_speed_of_light,
        "not-adopted": page.not_adopted,
        "h200-compiled-candidates": page.h200_compiled_candidates,
        "h200-idle-gaps": page.h200_idle_gaps,
        "published-recipe": page.published_recipe,
        "h200-profile": page.h200_profile,
        "h200-history": page.h200_history,
        "h200x2-ep": page.h200x2_ep,
        "h200x2-matrix": page.h200x2_matrix,
        "mixtral-8x7b-memory": page.mixtral_8x7b_memory,
    }


_REPO_LINK = re.compile(r"\]\((?![a-z][a-z0-9+.-]*:|#|/)")  # a link to a path in the repository


def _relative_links(body: str, document: str) -> str:
    """The region's links, written from the repository's root, as seen from `document`."""
    up = "../" * document.count("/")
    return _REPO_LINK.sub("](" + up, body) if up else body


def render(text: str, document: str = "README.md", names: set[str] | None = None) -> str:
    """`text`, the document at `document` (relative to the repository), with every generated
    region rewritten from the results. Refuses a text whose markers do not pair up or name a
    region twice or one no renderer knows; with `names`, also one that lacks any of them."""
    renderers = regions()
    found = [m[1] for m in REGION.finditer(text)]
    markers = [m.groups() for m in MARKER.finditer(text)]
    problems = []
    if len(markers) != 2 * len(found):
        problems.append("a BEGIN or END marker without its partner (or a malformed one)")
    problems += [f"region {n!r} appears {found.count(n)} times" for n in sorted(set(found))
                 if found.count(n) > 1]
    problems += [f"region {n!r} is missing" for n in sorted(names or ()) if n not in found]
    problems += [f"unknown region {n!r}" for n in found if n not in renderers]
    if problems:
        raise DocsError("; ".join(problems))
    return REGION.sub(lambda m: region_block(
        m["name"], _relative_links(renderers[m["name"]](), document)), text)


def _read(root: Path, document: str) -> str:
    path = root / document
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DocsError(f"{path}: no such file; run `python -m tools.docs` in a checkout "
                        "of the repository, or give --root the folder that holds README.md and "
                        "docs/") from None


def documents(root: Path = ROOT) -> list[str]:
    """The README and the markdown pages under docs/, relative to `root`."""
    return [README_NAME] + [f"{DOCS_DIR}/{page.name}"
                            for page in sorted((root / DOCS_DIR).glob("*.md"))]


def _placement(texts: dict[str, str]) -> dict[str, set[str]]:
    """document -> the regions it holds; an error for a region in no document or in two."""
    where = {doc: {m["name"] for m in REGION.finditer(text)} for doc, text in texts.items()}
    problems = []
    for name in regions():
        holders = [doc for doc, names in where.items() if name in names]
        if len(holders) != 1:
            problems.append(f"region {name!r} is in " + (" and ".join(holders) if holders
                                                        else "no document"))
    if problems:
        raise DocsError("; ".join(problems) + " (each region belongs in exactly one of "
                        f"{README_NAME} and {DOCS_DIR}/*.md)")
    return where


def _rendered(root: Path) -> dict[str, tuple[str, str]]:
    """document or chart -> (its text now, its text from the results)."""
    texts = {doc: _read(root, doc) for doc in documents(root)}
    where = _placement(texts)
    out = {}
    for doc, text in texts.items():
        try:
            out[doc] = (text, render(text, doc, where[doc]))
        except DocsError as exc:
            raise DocsError(f"{root / doc}: {exc}") from None
    chart = root / CHART
    out[CHART] = (chart.read_text(encoding="utf-8") if chart.exists() else "",
                  train_step_chart())
    for notebook in chapter_notebooks(root / NOTEBOOKS.name):
        text = notebook.read_text(encoding="utf-8")
        out[f"{NOTEBOOKS.name}/{notebook.name}"] = (text, render_chapter_time(notebook, text))
    return out


def _header(text: str) -> str:
    """A notebook's first markdown cell, from its JSON."""
    cells = json.loads(text)["cells"]
    return next(("".join(c["source"]) for c in cells if c["cell_type"] == "markdown"), "")


def check(root: str | Path = ROOT, max_lines: int = 12) -> list[str]:
    """One short unified diff per region (or chart) whose text differs from what the results
    say; empty when the documents agree with them."""
    problems = []
    for doc, (current, wanted) in _rendered(Path(root)).items():
        if doc == CHART:
            if current != wanted:
                problems.append(f"{doc} " + ("is missing" if not current else
                                            "differs from what h200.json draws"))
            continue
        if doc.endswith(".ipynb"):
            current, wanted = _header(current), _header(wanted)
        now = {m["name"]: m["body"] for m in REGION.finditer(current)}
        for m in REGION.finditer(wanted):
            name, body = m["name"], m["body"]
            if now[name] != body:
                diff = list(difflib.unified_diff(now[name].splitlines(), body.splitlines(),
                                                 f"{doc}: {name}", f"from {RESULTS_LINK}: {name}",
                                                 n=0, lineterm=""))
                more = ([f"... ({len(diff) - max_lines} more diff lines)"]
                        if len(diff) > max_lines else [])
                problems.append(f"{doc}: region {name!r} differs from the results:\n"
                                + "\n".join(diff[:max_lines] + more))
    return problems


def write(root: str | Path = ROOT) -> list[str]:
    """Rewrite the regions and the chart under `root` from the results; the documents that
    changed."""
    root = Path(root)
    changed = []
    for doc, (current, wanted) in _rendered(root).items():
        if current != wanted:
            (root / doc).parent.mkdir(parents=True, exist_ok=True)
            (root / doc).write_text(wanted, encoding="utf-8")
            changed.append(doc)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docs",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 with a diff per region that disagrees")
    parser.add_argument("--root", default=None,
                        help="the folder holding README.md and docs/ to render or check (default: "
                             "this repository; the results are always this checkout's)")
    parser.add_argument("--record-run", metavar="RUN_DIR", nargs="+", default=None,
                        help="instead: record the notebooks' run times of a finished `run --out "
                             "RUN_DIR` (or of a run in parts, one folder each) with this machine's "
                             "hardware and versions in benchmarks/results/ (the README's chapter "
                             "table quotes them)")
    parser.add_argument("--replace", action="store_true",
                        help="with --record-run: write over an earlier record of that machine and "
                             "mode")
    parser.add_argument("--note", default=None,
                        help="with --record-run: what a reader of the times should know about the "
                             "run")
    args = parser.parse_args(argv)
    root = Path(args.root) if args.root else ROOT
    if args.record_run and (args.check or args.root):
        print("docs: --record-run writes a result file and renders nothing; run it without "
              "--check and --root, then `python -m tools.docs`", file=sys.stderr)
        return 2
    if not args.record_run and (args.replace or args.note):
        print("docs: --replace and --note go with --record-run RUN_DIR", file=sys.stderr)
        return 2
    try:
        if args.record_run:
            out = record_course_run(*args.record_run, replace=args.replace, note=args.note)
            print(f"wrote {out}")
            return 0
        if not args.check:
            changed = write(root)
            print(f"{root}: rewritten: {', '.join(changed)}" if changed else f"{root}: up to date")
            return 0
        problems = check(root)
    except DocsError as exc:  # a missing document, or markers lost in an edit: one line
        print(exc, file=sys.stderr)
        return 1
    for problem in problems:
        print(problem, file=sys.stderr)
    if problems:
        print(f"{root}: {len(problems)} generated part(s) disagree with benchmarks/results/; "
              "run `python -m tools.docs` to regenerate them", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

