"""Every chapter (notebooks/01-08) has the same shape, read from its JSON alone (no kernel):

- a header stating its reading and run time (the `chapter-time` region `python -m tools.docs`
  fills), its prerequisites and a link to its exercise;
- the idea first: the first code cell after the parameters and the imports is plain PyTorch,
  at most 30 lines, checked by an assert, with at most 2 calls into the course's package;
- small code cells: none over 40 lines, the median at most 12;
- the conclusions in markdown: at most 150 words printed from string literals;
- every glossary link leads to an entry of docs/glossary.md, and no paragraph of 40 words or more
  is copied from one chapter into another;
- no prediction comes with a preselected answer (notebooks, solutions and exercises);
- the lesson, not the lab notebook: no source-line citation (`file.py:NNN`), no env-var or cuBLASLt
  lore in the markdown, at most one mention of a results file, at most 1,200 words of markdown;
  the engineering notes in `docs/notes/NN_<name>.md`, linked once at the chapter's end;
- the README's first notebook runs a checked router and expert loop within its first 3 code
  cells and 300 words.

Lines are non-blank lines. The measures are those the course's authors check chapters with.
"""

from __future__ import annotations

import ast
import json
import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / "notebooks").glob("0[1-8]_*.ipynb"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
GLOSSARY = ROOT / "docs" / "glossary.md"

# The terms the chapters link, each an entry of the glossary under exactly this anchor.
GLOSSARY_ANCHORS = {
    "expert", "router", "top-k", "routing-weights", "balancing-loss", "token-copy", "permutation",
    "gemm", "grouped-gemm", "host-sync", "cuda-graph", "side-stream", "kernel-launch",
    "dgrad-wgrad", "epilogue", "cutlass-cublas", "cute-dsl", "swiglu", "te-ops", "fusion", "fp8",
    "e4m3-e5m2", "amax", "scaling-factor", "current-scaling", "delayed-scaling", "block-scaling",
    "mxfp8", "ocp-mx", "cvt-rn-satfinite", "nvfp4", "hadamard-transform", "recipe", "autocast",
    "alignment-padding", "flops", "mfu", "speed-of-light", "hbm", "sdpa", "rope", "fsdp2",
    "data-parallel", "expert-parallel", "all-to-all", "reduce-scatter", "device-mesh",
    "small-mode", "papermill", "nbval",
}
TIME_REGION = ("<!-- BEGIN generated: chapter-time (python -m tools.docs) -->",
               "<!-- END generated: chapter-time -->")
GLOSSARY_LINK = re.compile(r"\]\(\.\./docs/glossary\.md(?:#([^)\s]*))?\)")
MAX_IDEA_LINES, MAX_IDEA_PACKAGE_CALLS = 30, 2
MAX_CELL_LINES, MAX_MEDIAN_LINES = 40, 12
MAX_PRINTED_WORDS = 150
MAX_MARKDOWN_WORDS, MAX_RESULTS_MENTIONS = 1200, 1
CITATION = re.compile(r"[\w/.-]+\.(?:py|cuh|cu|cpp|h):\d+")
LORE = re.compile(r"cuBLASLt|\bNVTE_[A-Z_]+")
RESULTS_MENTION = re.compile(r"benchmarks/results|\bh[12]00[\w-]*\.(?:json|txt)")
FIRST_AHA_CODE_CELLS, FIRST_AHA_WORDS = 3, 300
REPEATED_PARAGRAPH_WORDS = 40
PRINTING = ("print", "Markdown", "display_markdown", "HTML")  # calls whose text a reader reads


def _cells(notebook: Path) -> list[dict]:
    return json.loads(notebook.read_text(encoding="utf-8"))["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def _lines(source: str) -> int:
    return sum(1 for line in source.splitlines() if line.strip())


def _parse(source: str) -> ast.Module:
    """A code cell as Python, its IPython magics and shell escapes left out."""
    return ast.parse("\n".join("" if line.lstrip().startswith(("%", "!")) else line
                               for line in source.splitlines()))


def _chapters() -> list:
    return [pytest.param(nb, id=nb.stem) for nb in CHAPTERS]


def _only_setup(source: str) -> bool:
    """Imports, constants, settings read from the environment and the lesson's `SETUP =
    setup(...)` (`moe_tutorial.course.lesson.setup`: mode, device, sizes): nothing a reader
    learns from."""
    for statement in _parse(source).body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            continue
        if (isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Call)
                and isinstance(statement.value.func, ast.Name) and statement.value.func.id == "setup"):
            continue
        if isinstance(statement, (ast.Assign, ast.AnnAssign)) and not any(
                isinstance(node, ast.Call) and not (isinstance(node.func, ast.Attribute)
                                                    and node.func.attr in ("get", "getenv"))
                for node in ast.walk(statement)):
            continue
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
            continue
        return False
    return True


def _first_idea_cell(cells: list[dict]) -> str | None:
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        if "parameters" in cell.get("metadata", {}).get("tags", []) or _only_setup(_source(cell)):
            continue
        return _source(cell)
    return None


def _package_names(cells: list[dict]) -> set[str]:
    """The names the notebook binds to the course's package (`from moe_tutorial.x import y`,
    `import moe_tutorial`)."""
    names = set()
    for cell in cells:
        if cell["cell_type"] != "code":
            continue
        for node in ast.walk(_parse(_source(cell))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "moe_tutorial":
                names.update(alias.asname or alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                names.update((alias.asname or alias.name).split(".")[0] for alias in node.names
                             if alias.name.split(".")[0] == "moe_tutorial")
    return names


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _calls_named(tree: ast.AST, names: set[str]) -> list[str]:
    return [ast.unparse(node.func) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and _root_name(node.func) in names]


def _is_check(tree: ast.AST) -> bool:
    """An `assert` statement, or a call of an assert function (`torch.testing.assert_close`)."""
    return any(isinstance(node, ast.Assert) or (
        isinstance(node, ast.Call) and (getattr(node.func, "attr", None) or getattr(node.func, "id", "")
                                        ).startswith("assert"))
        for node in ast.walk(tree))


def printed_words(source: str) -> int:
    """Words (2+ letters) in the string literals, f-strings' text included, of the calls that put
    text in front of the reader (`PRINTING`)."""
    words = 0
    for node in ast.walk(_parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name in PRINTING:
                for arg in node.args:
                    for sub in ast.walk(arg):
                        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                            words += len(re.findall(r"[A-Za-z]{2,}", sub.value))
    return words


def _paragraphs(notebook: Path) -> list[str]:
    """The notebook's markdown paragraphs, whitespace normalised."""
    return [" ".join(block.split()) for cell in _cells(notebook) if cell["cell_type"] == "markdown"
            for block in re.split(r"\n\s*\n", _source(cell)) if block.strip()]


def _glossary_anchors() -> list[str]:
    return re.findall(r'^<a id="([^"]+)"></a>$', GLOSSARY.read_text(encoding="utf-8"), re.MULTILINE)


# ---------------------------------------------------------------------------------------------
# Each chapter

def test_the_chapters_are_there():
    assert [nb.name[:2] for nb in CHAPTERS] == [f"{n:02d}" for n in range(1, 9)]


@pytest.mark.parametrize("chapter", _chapters())
def test_a_chapter_header_states_its_time_prerequisites_and_exercise(chapter):
    header = next(_source(c) for c in _cells(chapter) if c["cell_type"] == "markdown")
    missing = [what for what, there in [
        ("the chapter-time region (an empty BEGIN/END pair that `python -m tools.docs` fills)",
         all(marker in header for marker in TIME_REGION)),
        ("'Prerequisites'", "Prerequisites" in header),
        (f"a link to ../exercises/{chapter.name[:2]}_*.ipynb",
         re.search(rf"\]\(\.\./exercises/{chapter.name[:2]}_[^)]*\.ipynb\)", header)),
    ] if not there]
    assert not missing, f"{chapter.name}'s first markdown cell lacks " + "; ".join(missing)


@pytest.mark.parametrize("chapter", _chapters())
def test_a_chapter_opens_with_the_idea_in_plain_pytorch(chapter):
    cells = _cells(chapter)
    idea = _first_idea_cell(cells)
    assert idea is not None, f"{chapter.name} has no code cell after its parameters and imports"
    tree = _parse(idea)
    calls = _calls_named(tree, _package_names(cells))
    problems = [problem for problem, bad in [
        (f"{_lines(idea)} lines (at most {MAX_IDEA_LINES})", _lines(idea) > MAX_IDEA_LINES),
        ("no assert or torch.testing.assert_close checks it", not _is_check(tree)),
        (f"{len(calls)} calls into the package ({', '.join(calls)}; at most "
         f"{MAX_IDEA_PACKAGE_CALLS})", len(calls) > MAX_IDEA_PACKAGE_CALLS),
    ] if bad]
    assert not problems, (f"{chapter.name}'s first code cell after its parameters and imports: "
                          + "; ".join(problems) + f"\n{idea}")


@pytest.mark.parametrize("chapter", _chapters())
def test_a_chapter_is_built_of_small_code_cells(chapter):
    sizes = [(_lines(_source(c)), i) for i, c in enumerate(_cells(chapter)) if c["cell_type"] == "code"]
    long = [f"cell {i}: {n} lines" for n, i in sizes if n > MAX_CELL_LINES]
    median = statistics.median(n for n, _ in sizes)
    assert not long and median <= MAX_MEDIAN_LINES, (
        f"{chapter.name}: code cells over {MAX_CELL_LINES} lines: {long or 'none'}; median "
        f"{median} lines (at most {MAX_MEDIAN_LINES})")


@pytest.mark.parametrize("chapter", _chapters())
def test_a_chapter_says_its_conclusions_in_markdown_not_in_prints(chapter):
    per_cell = [(printed_words(_source(c)), i) for i, c in enumerate(_cells(chapter))
                if c["cell_type"] == "code"]
    total = sum(n for n, _ in per_cell)
    most = sorted(per_cell, reverse=True)[:3]
    assert total <= MAX_PRINTED_WORDS, (
        f"{chapter.name} prints {total} words from string literals (at most "
        f"{MAX_PRINTED_WORDS}); most in cells " + ", ".join(f"{i} ({n})" for n, i in most))


def _markdown(chapter: Path) -> str:
    return "\n".join(_source(c) for c in _cells(chapter) if c["cell_type"] == "markdown")


def markdown_words(text: str) -> int:
    """Words of 2+ letters, as a reader counts them (link targets and markup add none)."""
    return len(re.findall(r"[A-Za-z]{2,}", re.sub(r"\]\([^)]*\)", "]", text)))


@pytest.mark.parametrize("chapter", _chapters())
def test_a_chapter_leaves_its_engineering_notes_to_its_notes_page(chapter):
    markdown = _markdown(chapter)
    code = "\n".join(_source(c) for c in _cells(chapter) if c["cell_type"] == "code")
    notes = f"../docs/notes/{chapter.stem}.md"
    problems = [problem for problem, bad in [
        (f"source-line citations {CITATION.findall(markdown + code)}", CITATION.search(markdown + code)),
        (f"env-var/cuBLASLt lore {sorted(set(LORE.findall(markdown)))}", LORE.search(markdown)),
        (f"{len(RESULTS_MENTION.findall(markdown))} mentions of a results file (at most "
         f"{MAX_RESULTS_MENTIONS})", len(RESULTS_MENTION.findall(markdown)) > MAX_RESULTS_MENTIONS),
        (f"{markdown_words(markdown)} words of markdown (at most {MAX_MARKDOWN_WORDS})",
         markdown_words(markdown) > MAX_MARKDOWN_WORDS),
        (f"no notes page {notes[3:]}", not (ROOT / notes[3:]).is_file()),
        (f"{markdown.count(notes)} links to {notes} (exactly one)", markdown.count(notes) != 1),
    ] if bad]
    assert not problems, f"{chapter.name}: " + "; ".join(problems)


def _readme_first_notebook() -> Path:
    start = (ROOT / "README.md").read_text().split("## Start", 1)[1]
    return ROOT / re.search(r"(notebooks/\d\d_\w+\.ipynb)", start).group(1)


def test_the_first_notebook_runs_a_checked_moe_within_three_code_cells_and_300_words():
    first = _readme_first_notebook()
    cells = _cells(first)
    code = [i for i, c in enumerate(cells) if c["cell_type"] == "code"][:FIRST_AHA_CODE_CELLS]
    aha = next((i for i in code if re.search(r"\.topk\(|topk\(", _source(cells[i]))
                and re.search(r"for \w+ in range", _source(cells[i])) and _is_check(_parse(_source(cells[i])))),
               None)
    assert aha is not None, (f"{first.name}: none of its first {FIRST_AHA_CODE_CELLS} code cells runs "
                             f"the router (topk) and the expert loop with a check")
    words = sum(markdown_words(_source(c)) for c in cells[:aha] if c["cell_type"] == "markdown")
    assert words <= FIRST_AHA_WORDS, f"{first.name}: {words} words of markdown before the first MoE runs"


# ---------------------------------------------------------------------------------------------
# Across the chapters

def test_the_glossary_has_one_entry_per_course_term():
    anchors = _glossary_anchors()
    assert sorted(a for a in set(anchors) if anchors.count(a) > 1) == [], "an anchor twice"
    assert set(anchors) == GLOSSARY_ANCHORS, (
        f"missing: {sorted(GLOSSARY_ANCHORS - set(anchors))}; "
        f"not a course term: {sorted(set(anchors) - GLOSSARY_ANCHORS)}")
    entries = re.findall(r'^<a id="([^"]+)"></a>\n\*\*[^*]+\*\*[^\n]*:', GLOSSARY.read_text(),
                         re.MULTILINE)
    assert sorted(entries) == sorted(anchors), "each anchor line is followed by '**term**: ...'"


def test_every_glossary_link_leads_to_an_entry():
    anchors = set(_glossary_anchors())
    broken = []
    for folder in ("notebooks", "exercises", "solutions"):
        for notebook in sorted((ROOT / folder).glob("*.ipynb")):
            for cell in _cells(notebook):
                if cell["cell_type"] == "markdown":
                    broken += [f"{folder}/{notebook.name}: #{anchor}"
                               for anchor in GLOSSARY_LINK.findall(_source(cell))
                               if anchor not in anchors]
    assert not broken, "links to no glossary entry: " + ", ".join(broken)


def copied_paragraphs(notebooks: list[Path]) -> dict[str, list[str]]:
    """Paragraph -> the notebooks (by number) it appears in, for those of
    `REPEATED_PARAGRAPH_WORDS` words or more that appear in two or more."""
    where: dict[str, set[str]] = {}
    for notebook in notebooks:
        for paragraph in _paragraphs(notebook):
            if len(paragraph.split()) >= REPEATED_PARAGRAPH_WORDS:
                where.setdefault(paragraph, set()).add(notebook.name[:2])
    return {p: sorted(nbs) for p, nbs in where.items() if len(nbs) > 1}


def test_no_paragraph_is_copied_from_one_chapter_into_another():
    copied = copied_paragraphs(NOTEBOOKS)
    assert not copied, "\n".join(f"in {', '.join(nbs)}: {p[:100]}..." for p, nbs in copied.items())


def test_no_prediction_comes_with_a_preselected_answer():
    preset = []
    for folder in ("notebooks", "exercises", "solutions"):
        for notebook in sorted((ROOT / folder).glob("*.ipynb")):
            for i, cell in enumerate(_cells(notebook)):
                if cell["cell_type"] != "code" or "predict(" not in _source(cell):
                    continue
                preset += [f"{folder}/{notebook.name} cell {i}" for node in ast.walk(_parse(_source(cell)))
                           if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("widgets.predict")
                           and (len(node.args) > 2 or any(k.arg == "default" for k in node.keywords))]
    assert not preset, "predictions with a default answer (it starts unanswered): " + ", ".join(preset)


# ---------------------------------------------------------------------------------------------
# The measures themselves

def test_printed_words_count_string_literals_of_printing_calls_only():
    source = ('print("three words here", f"and {x} two")\n'
              'Markdown(f"**bold** text")\n'
              'label = "not printed at all"\n'
              'print(label)\n')
    assert printed_words(source) == 7


def test_the_idea_cell_is_the_first_that_is_not_parameters_or_imports():
    cells = [{"cell_type": "code", "metadata": {"tags": ["parameters"]}, "source": ["MODE = 'x'"]},
             {"cell_type": "markdown", "metadata": {}, "source": ["# text"]},
             {"cell_type": "code", "metadata": {}, "source": [
                 "import torch\nfrom moe_tutorial.moe import routing as r\nSEED = os.environ.get('S')"]},
             {"cell_type": "code", "metadata": {}, "source": [
                 "from moe_tutorial.course.lesson import setup\nDEFAULTS = {'small': {'steps': 1}, 'full': {'steps': 2}}\n"
                 "SETUP = setup(MODE, DEVICE, DEFAULTS, steps=list(STEPS))"]},
             {"cell_type": "code", "metadata": {}, "source": [
                 "x = torch.randn(3)\ny = r.route(x, 1)\nassert y is not None"]}]
    idea = _first_idea_cell(cells)
    assert idea.startswith("x = torch.randn")
    assert _calls_named(_parse(idea), _package_names(cells)) == ["r.route"]
    assert _is_check(_parse(idea)) and _is_check(_parse("torch.testing.assert_close(a, b)"))
    assert not _is_check(_parse("torch.allclose(a, b)"))


def test_a_paragraph_copied_into_two_notebooks_is_found_whatever_its_line_breaks(tmp_path):
    long = " ".join(f"word{i}" for i in range(REPEATED_PARAGRAPH_WORDS))
    short = "a short paragraph both say"
    for name, text in [("01_a", f"# A\n\n{long}\n\n{short}"),
                       ("02_b", f"# B\n\n{long.replace(' ', chr(10), 3)}\n\n{short}")]:
        (tmp_path / f"{name}.ipynb").write_text(json.dumps(
            {"cells": [{"cell_type": "markdown", "metadata": {}, "source": [text]}]}))
    assert copied_paragraphs(sorted(tmp_path.glob("*.ipynb"))) == {long: ["01", "02"]}
