"""Exercises from solutions: `exercises/NN_*.ipynb` written from `solutions/NN_*.ipynb`.

    python -m moe_tutorial build [--check]

writes `exercises/NN_*.ipynb` from `solutions/NN_*.ipynb`, the single source of both. In a
solutions notebook, a *solution region* is a block of lines inside a function body (indented),
opened by `### BEGIN SOLUTION`, followed at once by a one-line `### HINT: <text>`, and closed by
`### END SOLUTION`:

    def route(logits, top_k):
        ### BEGIN SOLUTION
        ### HINT: softmax in float32 over the experts, torch.topk, divide the k weights by their sum
        probs = torch.softmax(logits.float(), dim=-1)
        ...
        ### END SOLUTION

In the exercise each region becomes two lines at the region's indentation,

        # YOUR CODE HERE (replace this line and the next; then run the check below)
        raise NotImplementedError("softmax in float32 over the experts, torch.topk, divide ...")

so the exercise notebook still runs top to bottom: defining the function raises nothing, calling it
raises NotImplementedError, which `moe_tutorial.course.checks` reports as "not implemented yet".
Two cell tags keep what only the solution should hold out of the exercise: a markdown cell tagged
`answer` (the model answer to an open question) becomes, in place, a cell that invites the
learner's own answer (`ANSWER_STUB`); a cell tagged `solution-only` (a note for the course's
authors) is left out. Every other cell, line and piece of metadata is copied unchanged, except what
running a notebook leaves behind: outputs, execution counts, cell timings (`execution`) and the notebook's `widgets` /
`papermill` metadata are stripped. The output is deterministic (byte-identical on every run). A
region outside a function body, without its hint, unclosed or nested is an error that names the
notebook, cell and line. `--check` writes nothing and fails (exit 1) when `exercises/` differs from
what the build would write, saying which file and how to fix it; CI runs it (tests/course/test_build.py).

A learner's work is never overwritten. Each exercise carries, in its metadata (`moe_tutorial_build`),
a hash of its cells' sources as the build wrote them; the build replaces an exercise only while
its cells still match (outputs do not count), and otherwise writes nothing and says which
notebook holds edits (`--replace` overwrites them). It never writes into solutions/, notebooks/
or the package, nor into a folder that holds files it did not write. Stale exercises (no solution
of that name any more) are deleted by the build when unchanged, kept otherwise; --check reports both.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..locations import checkout_roots, package_dir
from .report import source_text
from .run_inputs import (
    COMMAND_LINE,
    NOTEBOOK_GLOB,
    PYTHON_API,
    InputNames,
    _course_folder,
    default_notebooks_dir,
)

SOLUTION_BEGIN = "### BEGIN SOLUTION"
SOLUTION_END = "### END SOLUTION"
HINT_PREFIX = "### HINT:"
STUB_COMMENT = "# YOUR CODE HERE (replace this line and the next; then run the check below)"
ANSWER_TAG = "answer"  # a model answer: the exercise gets ANSWER_STUB in its place
SOLUTION_ONLY_TAG = "solution-only"  # left out of the exercise
ANSWER_STUB = "**Your answer:** *(double-click this cell and write it here)*"
_MARKER_LIKE = re.compile(r"^\s*###\s*(BEGIN|END)\s+SOLUTION|^\s*###\s*HINT\b", re.IGNORECASE)
_RUN_LEFTOVERS = {"cell": ("execution",), "notebook": ("widgets", "papermill")}
# The exercise notebook's metadata key under which the build records what it wrote: the hash of
# its cells' sources (`sources_digest`), so that the next build can tell a learner's edits.
BUILD_STAMP = "moe_tutorial_build"


class BuildError(ValueError):
    """A solution region the build cannot turn into a stub (the message says where and why)."""


def stub_source(source: str, where: str = "cell") -> tuple[str, int]:
    """A code cell's source with every solution region replaced by its stub, and how many
    regions there were. `where` names the cell in error messages."""
    lines = source.split("\n")
    out: list[str] = []
    regions = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped != SOLUTION_BEGIN:
            if _MARKER_LIKE.match(line):
                what = (f"{SOLUTION_END} without {SOLUTION_BEGIN}" if stripped == SOLUTION_END
                        else f"{HINT_PREFIX} outside a solution region" if stripped.startswith(HINT_PREFIX)
                        else f"{stripped!r} looks like a solution marker but is not "
                             f"{SOLUTION_BEGIN!r} / {SOLUTION_END!r} / {HINT_PREFIX!r}")
                raise BuildError(f"{where}, line {i + 1}: {what}")
            out.append(line)
            i += 1
            continue
        indent = line[: len(line) - len(line.lstrip())]
        if not indent:
            raise BuildError(
                f"{where}, line {i + 1}: {SOLUTION_BEGIN} must sit inside a function body "
                "(indented), so that the exercise still runs: the stub raises only when called")
        hint_line = lines[i + 1].strip() if i + 1 < len(lines) else ""
        hint = hint_line[len(HINT_PREFIX):].strip() if hint_line.startswith(HINT_PREFIX) else ""
        if not hint:
            raise BuildError(f"{where}, line {i + 2}: {SOLUTION_BEGIN} must be followed by a "
                             f"one-line '{HINT_PREFIX} <text>' (the stub's NotImplementedError "
                             "message)")
        end = i + 2
        while end < len(lines) and lines[end].strip() != SOLUTION_END:
            if _MARKER_LIKE.match(lines[end]):
                raise BuildError(f"{where}, line {end + 1}: {lines[end].strip()!r} inside the "
                                 f"solution region opened at line {i + 1} (regions do not nest; "
                                 "one hint per region)")
            end += 1
        if end == len(lines):
            raise BuildError(f"{where}, line {i + 1}: {SOLUTION_BEGIN} is never closed by "
                             f"{SOLUTION_END}")
        if not any(body.strip() for body in lines[i + 2:end]):
            raise BuildError(f"{where}, line {i + 1}: the solution region is empty")
        message = json.dumps(hint, ensure_ascii=False)  # a valid Python string literal
        out += [f"{indent}{STUB_COMMENT}", f"{indent}raise NotImplementedError({message})"]
        regions += 1
        i = end + 1
    return "\n".join(out), regions


def _lines(text: str) -> list[str]:
    """A source string as the list of lines Jupyter stores (each but the last keeps its \\n)."""
    return text.splitlines(keepends=True)


def exercise_notebook(solution: dict, where: str = "notebook") -> dict:
    """The exercise version of a solutions notebook (its JSON, as a dict): regions become stubs,
    run leftovers are stripped, everything else is copied. Raises BuildError for bad markers or
    a notebook without any solution region."""
    exercise = json.loads(json.dumps(solution))  # a deep copy that stays plain JSON
    regions = 0
    kept = []
    for number, cell in enumerate(exercise.get("cells", []), start=1):
        tags = cell.get("metadata", {}).get("tags", [])
        if SOLUTION_ONLY_TAG in tags:
            continue
        kept.append(cell)
        for key in _RUN_LEFTOVERS["cell"]:
            cell.get("metadata", {}).pop(key, None)
        if ANSWER_TAG in tags:
            if cell.get("cell_type") != "markdown":
                raise BuildError(f"{where}, cell {number}: a cell tagged {ANSWER_TAG!r} holds a "
                                 "model answer in prose: make it a markdown cell")
            cell["source"] = _lines(ANSWER_STUB)
            continue
        if cell.get("cell_type") != "code":
            continue
        source, found = stub_source(source_text(cell.get("source", "")), f"{where}, cell {number}")
        regions += found
        cell["source"] = _lines(source)
        cell["outputs"] = []
        cell["execution_count"] = None
    exercise["cells"] = kept
    for key in (*_RUN_LEFTOVERS["notebook"], BUILD_STAMP):  # the stamp is the build's to write
        exercise.get("metadata", {}).pop(key, None)
    if not regions:
        raise BuildError(f"{where}: no solution region ({SOLUTION_BEGIN} ... {SOLUTION_END}); "
                         "an exercise notebook needs at least one")
    return exercise


def notebook_json(nb: dict) -> str:
    """A notebook as Jupyter and nbformat write it: sorted keys, one-space indent, a final newline."""
    return json.dumps(nb, sort_keys=True, indent=1, ensure_ascii=False) + "\n"


def default_solutions_dir() -> Path:
    """`solutions/` of the current directory, else that of the clone the current directory is in."""
    return _course_folder("solutions")


def sources_digest(nb: dict) -> str:
    """What a learner writes in a notebook, hashed: every cell's type and source, in order.
    Running or opening a notebook (outputs, execution counts, metadata) leaves it unchanged."""
    cells = [[cell["cell_type"], source_text(cell["source"])] for cell in nb["cells"]]
    return hashlib.sha256(json.dumps(cells, ensure_ascii=False).encode()).hexdigest()


def stamp(exercise: dict, built_from: str) -> dict:
    """The exercise with the build's stamp in its metadata (see BUILD_STAMP)."""
    exercise.setdefault("metadata", {})[BUILD_STAMP] = {
        "built_from": built_from, "sources_sha256": sources_digest(exercise),
        "note": "written by `python -m moe_tutorial build`, which overwrites this notebook only "
                "while its cells are as it wrote them"}
    return exercise


def exercise_state(path: Path) -> str:
    """`generated`: the build wrote it and its cells are as written (overwriting it loses nothing);
    `edited`: the build wrote it and its cells changed since (a learner's work); `foreign`: not
    written by the build (no stamp, or not notebook JSON)."""
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
        written = nb["metadata"][BUILD_STAMP]["sources_sha256"]
        current = sources_digest(nb)
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError):
        return "foreign"
    return "generated" if current == written else "edited"


@dataclass
class BuildResult:
    written: list[Path] = field(default_factory=list)  # created or changed (not in --check)
    unchanged: list[Path] = field(default_factory=list)
    removed: list[Path] = field(default_factory=list)  # stale exercises without a solution
    kept: list[str] = field(default_factory=list)  # stale notebooks the build leaves: why
    problems: list[str] = field(default_factory=list)  # --check: what is out of date
    refused: list[str] = field(default_factory=list)  # a learner's notebook the build would replace

    @property
    def ok(self) -> bool:
        return not self.problems and not self.refused


def _differing_cells(old_text: str, new_text: str) -> str:
    try:
        old, new = json.loads(old_text), json.loads(new_text)
    except json.JSONDecodeError:
        return "it is not valid notebook JSON"
    old_cells, new_cells = old.get("cells", []), new.get("cells", [])
    differ = [n for n, (a, b) in enumerate(zip(old_cells, new_cells), start=1) if a != b]
    parts = []
    if differ:
        shown = ", ".join(map(str, differ[:8])) + (", ..." if len(differ) > 8 else "")
        parts.append(f"cell{'s' if len(differ) > 1 else ''} {shown} differ")
    if len(old_cells) != len(new_cells):
        parts.append(f"it has {len(old_cells)} cells, the build writes {len(new_cells)}")
    if not parts:
        parts.append("the notebook metadata or formatting differs")
    return "; ".join(parts)


def _check_build_folders(solutions_dir: Path, exercises_dir: Path, expected: set[str],
                         names: InputNames = PYTHON_API) -> None:
    """Refuse a solutions folder without notebooks, and an exercises folder the build must not
    write into: the solutions, the course's notebooks or package, a file, or a folder that holds
    things the build did not write (none of them an exercise of this course)."""
    if not solutions_dir.is_dir():
        raise BuildError(f"{names.given('solutions', solutions_dir)} "
                         f"{'is not a folder' if solutions_dir.exists() else 'does not exist'}; "
                         f"give the folder that holds the solutions notebooks ({NOTEBOOK_GLOB})")
    if not expected:
        raise BuildError(f"no solutions notebooks ({NOTEBOOK_GLOB}) in {solutions_dir}; give the "
                         f"folder that holds them with {names.solutions}")
    where = exercises_dir.resolve()
    clone = [root / name for root in checkout_roots(where)
             for name in ("solutions", "notebooks", "moe_tutorial")]
    for folder in (solutions_dir, *clone, default_notebooks_dir(), package_dir()):
        folder = folder.resolve()
        if where == folder or where.is_relative_to(folder):
            raise BuildError(f"{names.given('exercises', exercises_dir)} is inside "
                             f"{folder.name}/, which the build never writes into; give the "
                             "exercises/ folder (the default) or a new one")
    if exercises_dir.exists() and not exercises_dir.is_dir():
        raise BuildError(f"{names.given('exercises', exercises_dir)} is a file, not a folder; "
                         "give a folder")
    present = sorted(p for p in exercises_dir.iterdir() if not p.name.startswith(".")) \
        if exercises_dir.is_dir() else []
    ours = [p for p in present if p.name in expected
            or (p.suffix == ".ipynb" and exercise_state(p) != "foreign")]
    if present and not ours:
        listed = ", ".join(p.name for p in present[:3]) + (", ..." if len(present) > 3 else "")
        raise BuildError(f"{names.given('exercises', exercises_dir)} holds files the build did "
                         f"not write ({listed}); give the exercises/ folder (the default) or a "
                         "new or empty one")


def _check_build_writable(exercises_dir: Path, names: InputNames = PYTHON_API) -> None:
    """Refuse, before the first notebook is written, an exercises folder the build cannot write
    in (or make): all or nothing."""
    try:
        exercises_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BuildError(f"{names.given('exercises', exercises_dir)} cannot be made "
                         f"({exc.strerror or exc}); give a folder you can write in") from None
    if not os.access(exercises_dir, os.W_OK | os.X_OK):
        raise BuildError(f"{names.given('exercises', exercises_dir)}: no permission to write "
                         f"in it; make it writable (`chmod u+w {exercises_dir}`) or give "
                         "another folder")


def _read_solution(source: Path, where: str) -> dict:
    try:
        nb = json.loads(source.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise BuildError(f"{where} cannot be read ({exc}); restore it, e.g. from git") from None
    except json.JSONDecodeError as exc:
        raise BuildError(f"{where}, line {exc.lineno}: not valid notebook JSON ({exc.msg}); "
                         "fix it there or restore it, e.g. from git") from None
    if (not isinstance(nb, dict) or not isinstance(nb.get("cells"), list)
            or not all(isinstance(c, dict) and "cell_type" in c and "source" in c for c in nb["cells"])):
        raise BuildError(f"{where} is JSON but not a notebook (it needs a list of cells, each with "
                         "cell_type and source); restore it, e.g. from git")
    return nb


def build_exercises(solutions_dir: Path | None = None, exercises_dir: Path | None = None, *,
                    check: bool = False, replace: bool = False,
                    names: InputNames = PYTHON_API) -> BuildResult:
    """Generate `exercises_dir/NN_*.ipynb` from `solutions_dir/NN_*.ipynb` (see the docstring).

    Every notebook written carries the build's stamp (BUILD_STAMP). An exercise whose cells a
    learner changed since (or a notebook the build did not write) is never overwritten: the build
    writes nothing and lists each in `refused`, unless `replace`. Stale exercises (no solution)
    are deleted only when unchanged; others are listed in `kept`. With `check`, write nothing
    and list in `problems` every exercise that is missing, differs from what the build would
    write, or has no solution any more, each with a fix that loses no work. Raises BuildError
    for bad folders, solution notebooks or markers. `names`: how the messages name the inputs
    (the command line passes `COMMAND_LINE`)."""
    solutions_dir = Path(solutions_dir) if solutions_dir else default_solutions_dir()
    exercises_dir = Path(exercises_dir) if exercises_dir else solutions_dir.parent / "exercises"
    sources = sorted(solutions_dir.glob(NOTEBOOK_GLOB)) if solutions_dir.is_dir() else []
    expected = {s.name for s in sources}
    _check_build_folders(solutions_dir, exercises_dir, expected, names)
    result = BuildResult()
    build = names.build()
    fix = f"run {build} and commit exercises/"
    keep_work = (f"it holds your edits, which {build} keeps: copy your work out of "
                 f"{exercises_dir.name}/, then run {names.build(replace=True)}")
    foreign = (f"the build did not write it, and {build} leaves it: move it away, or run "
               f"{names.build(replace=True)} to overwrite it")
    to_write: list[tuple[Path, str]] = []
    for source in sources:
        where = f"{solutions_dir.name}/{source.name}"
        exercise = exercise_notebook(_read_solution(source, where), where)
        text = notebook_json(stamp(exercise, where))
        target = exercises_dir / source.name
        shown = f"{exercises_dir.name}/{target.name}"
        if target.is_symlink():  # the learner's own arrangement, and what it points to is theirs
            problem = (f"{shown} is a link to {os.readlink(target)}; the build never writes "
                       f"through a link (it would overwrite what the link points to): remove "
                       f"the link (`rm {target}`) and run {build} again")
            (result.problems if check else result.refused).append(problem)
            continue
        if not target.exists():
            state, existing = "missing", None
        else:
            state = exercise_state(target)
            existing = target.read_text(encoding="utf-8") if state != "foreign" else None
        if existing == text:
            result.unchanged.append(target)
        elif check:
            why = ("is missing" if state == "missing" else
                   f"is out of date with {where} ({_differing_cells(existing, text)})"
                   if state == "generated" else f"is out of date with {where}")
            advice = {"edited": keep_work, "foreign": foreign}.get(state, fix)
            result.problems.append(f"{shown} {why}: {advice}")
        elif state in ("missing", "generated") or replace:
            to_write.append((target, text))
        else:
            result.refused.append(f"{shown}: {keep_work if state == 'edited' else foreign}")
    to_remove = _stale_exercises(solutions_dir, exercises_dir, expected, check, fix, result)
    if result.refused:  # all or nothing: a build that stops half way would mix two versions
        return result
    if to_write or to_remove:
        _write_build(exercises_dir, to_write, to_remove, names, result)
    return result


def _stale_exercises(solutions_dir: Path, exercises_dir: Path, expected: set[str], check: bool,
                     fix: str, result: BuildResult) -> list[Path]:
    """The exercises without a solution: those the build wrote, to delete; the others kept (or,
    with `check`, each a problem with its fix), listed in `result`."""
    to_remove: list[Path] = []
    for stale in sorted(exercises_dir.glob(NOTEBOOK_GLOB)) if exercises_dir.is_dir() else []:
        if stale.name in expected:
            continue
        shown = f"{exercises_dir.name}/{stale.name}"
        state = exercise_state(stale)
        if check:
            advice = (f"{fix} (it deletes it)" if state == "generated"
                      else "the build leaves it; delete it or move it out of "
                           f"{exercises_dir.name}/ yourself")
            result.problems.append(f"{shown} has no {solutions_dir.name}/{stale.name}: {advice}")
        elif state == "generated":
            to_remove.append(stale)
        else:
            result.kept.append(f"{shown} has no {solutions_dir.name}/{stale.name}, but "
                               f"{'it holds your edits' if state == 'edited' else 'the build did not write it'}"
                               ", so the build leaves it")
    return to_remove


def _write_build(exercises_dir: Path, to_write: list[tuple[Path, str]], to_remove: list[Path],
                 names: InputNames, result: BuildResult) -> None:
    """Write and delete what the build decided, one build at a time, each file whole or not at
    all; raises BuildError naming what was written before a failure."""
    from .. import safe_io  # here: the one writer of the build's notebooks

    _check_build_writable(exercises_dir, names)
    try:
        with safe_io.hold_folder(exercises_dir, "exercise build"):  # one build at a time
            for target, text in to_write:  # each whole or not at all (safe_io.atomic_file)
                safe_io.write_text(target, text, replace=True)
                result.written.append(target)
            for stale in to_remove:
                stale.unlink()
                result.removed.append(stale)
    except safe_io.FolderBusy as exc:
        raise BuildError(str(exc)) from None
    except safe_io.WriteFailed as exc:
        raise BuildError(f"{exc.strerror}; the exercises written before it are "
                         f"{', '.join(p.name for p in result.written) or 'none'}") from None


def add_build_command(subparsers) -> argparse.ArgumentParser:
    """Add `build` to the `python -m moe_tutorial` command line."""
    build = subparsers.add_parser(
        "build", help="generate exercises/ from solutions/ (--check: fail when out of date)")
    what = build.add_mutually_exclusive_group()
    what.add_argument("--check", action="store_true",
                      help="write nothing; exit 1 when exercises/ is not what the build writes")
    what.add_argument("--replace", action="store_true",
                      help="overwrite exercises you edited (your edits are lost; without it the "
                           "build refuses and writes nothing)")
    build.add_argument("--solutions", default=None, metavar="DIR",
                       help="the solutions notebooks (default: ./solutions, else the checkout's)")
    build.add_argument("--exercises", default=None, metavar="DIR",
                       help="where the exercises go (default: exercises/ next to solutions/)")
    build.set_defaults(run=_build_command)
    return build


def _build_command(args: argparse.Namespace) -> int:
    try:
        result = build_exercises(args.solutions, args.exercises, check=args.check,
                                 replace=args.replace, names=COMMAND_LINE)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        for problem in result.problems:
            print(problem, file=sys.stderr)
        if result.ok:
            print(f"exercises up to date ({len(result.unchanged)} notebooks)")
        return 0 if result.ok else 1
    if result.refused:
        for refusal in result.refused:
            print(f"error: {refusal}", file=sys.stderr)
        print("nothing written", file=sys.stderr)
        return 1
    for path in result.written:
        print(f"wrote {path}")
    for path in result.removed:
        print(f"removed {path} (no solution notebook)")
    for kept in result.kept:
        print(kept)
    print(f"{len(result.written)} written, {len(result.unchanged)} unchanged, "
          f"{len(result.removed)} removed")
    return 0
