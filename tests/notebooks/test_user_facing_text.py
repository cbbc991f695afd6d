"""What a learner reads speaks of the course, never of how its work was organised: no issue
numbers, no tracker, no work sessions in the README, docs/, the notebooks, the exercises, the
solutions, or any text the package prints or generates."""

import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "moe_tutorial"

TRACKER_WORDS = re.compile(
    r"\bissues?\s+#?\d+"           # issue 19, issues 18, 19 and 21, issue #7
    r"|\bissue(?:'s|’s)"            # issue's target
    r"|\b(?:the|this|that|an|our) issue\b(?!s)"
    r"|\btracker\b"                 # the issue tracker
    r"|\bsessions?\b",              # an earlier session
    re.I)


def _markdown_and_notebooks() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for folder in ("notebooks", "exercises", "solutions"):
        files += sorted((ROOT / folder).glob("*.ipynb"))
    return files


def _text(path: Path) -> str:
    if path.suffix == ".ipynb":
        return "\n".join("".join(cell["source"]) for cell in
                         json.loads(path.read_text(encoding="utf-8"))["cells"])
    return path.read_text(encoding="utf-8")


def _hits(text: str) -> list[str]:
    return [f"{m[0]!r} in: {line.strip()[:120]}" for line in text.splitlines()
            for m in TRACKER_WORDS.finditer(line)]


@pytest.mark.parametrize("path", _markdown_and_notebooks(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_tracker_words_in_what_a_learner_reads(path):
    assert not _hits(_text(path))


def _package_strings(path: Path) -> str:
    """Every string literal of a module (docstrings and f-string parts included): what it prints,
    raises, renders, or what `help()` and the notebooks' `show_source` show."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return "\n".join(node.value for node in ast.walk(tree)
                     if isinstance(node, ast.Constant) and isinstance(node.value, str))


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_tracker_words_in_what_the_package_says(path):
    assert not _hits(_package_strings(path))


@pytest.mark.parametrize("text", [
    "issue 19's target", "issues 18, 19 and 21", "as the issue tracker states it",
    "an earlier session", "Issue #7", "the issue’s target"])
def test_the_scan_catches_tracker_words(text):
    assert _hits(text)


@pytest.mark.parametrize("text", [
    "the loop issues many small operations", "what the naive loop issue for one layer",
    "the GPU waits for the host"])
def test_the_scan_leaves_plain_english_alone(text):
    assert not _hits(text)
