"""The course's clock: minutes per chapter and exercise from what a learner reads and does
(the method: docs/course.md, "How the times are made"), and the regions that state them: the
README's chapter table (`chapter_times`), docs/course.md's rates (`clock_table`) and each
chapter's header (`chapter_time`); `record_course_run` records a headless run's times.
"""

from __future__ import annotations

import html
import json
import math
import os
import re
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from tools.doc_results import (
    MARKER,
    NOTEBOOKS,
    REGION,
    RESULTS,
    RESULTS_LINK,
    ROOT,
    DocsError,
    load_result,
    md_table,
    region_block,
    result_link,
)

# ---------------------------------------------------------------------------------------------
# The chapters and their exercises: what each teaches, and how long it takes (README). The
# times come from one written method, the course's clock (docs/course.md, "How the times are
# made"), applied to the notebooks and to the recorded small-mode run of the course.

# One sentence per chapter notebook: what the learner takes away.
CHAPTER_LESSONS = {
    "00_setup": "Appendix, optional (start with 01): what your machine runs and why, the "
                "course's two modes, and the protein data every chapter trains on.",
    "01_naive_moe": "A Mixture-of-Experts layer from scratch: the router, the per-expert loop "
                    "that HF's eager experts run, the load-balancing loss, a first training run.",
    "02_grouped_linear": "Tokens sorted by expert and every expert run as one grouped GEMM "
                         "(`torch._grouped_mm`, TE `GroupedLinear`), checked equal to the loop.",
    "03_fp8_numerics": "FP8 and MXFP8 from first principles: the formats, block scales, and the "
                       "error they add to real activations, weights and gradients.",
    "04_fp8_training": "A GEMM on FP8 operands with their scales, then which TE recipe your "
                       "GPU trains with, the rows per expert it needs, and training under "
                       "`te.autocast`.",
    "05_fused_grouped_mlp": "The expert MLP as one `te.ops.Sequential` chain, the routing "
                            "weights inside its activation, and when TE fuses it.",
    "06_end_to_end": "The whole model from HF eager to the course's fastest step: time, MFU, "
                     "memory and loss on protein data.",
    "07_expert_parallel": "Expert parallelism: tokens exchanged all-to-all between processes, "
                          "and what each GPU holds under data vs expert parallelism.",
    "08_your_model": "Your own MoE (Qwen3-MoE, OLMoE, DeepSeek-V3 or your config.json): "
                     "analysed, converted from transformers, trained.",
    "09_deep_dive": "Optional, after the chapters: speed-of-light floors, idle gaps, a step with "
                    "no host sync, the compiled and in-backward optimizers, and the history of "
                    "the H200 runs.",
}
# Notebooks the table lists but its totals leave out: read them or not, the course is complete.
OPTIONAL_NOTEBOOKS = {"09_deep_dive"}
# The generated region of each chapter's header (the first markdown cell of its notebook): the
# chapter's time and its exercise's, and its run time, as the README's table states them.
CHAPTER_TIME = "chapter-time"
EXERCISES, SOLUTIONS = ROOT / "exercises", ROOT / "solutions"
COURSE_RUN = "cpu_course_small.json"  # the run the README's chapter table quotes

# The clock: minutes per thing a learner reads or does. Each rate is a stated assumption for a
# careful reader new to the subject, not a measurement; docs/course.md says why each is what it is.
PROSE_WORDS_PER_MINUTE = 170    # a notebook's markdown, read as technical prose
PRINTED_WORDS_PER_MINUTE = 200  # what its cells print (the recorded small-mode run): read alike
CODE_LINES_PER_MINUTE = 8       # code read and understood a line at a time (blank and comment-only
                                # lines not counted)
MINUTES_PER_PREDICTION = 2      # a `predict` question: read it, commit to an answer, read the grade
MINUTES_PER_FIGURE = 0.5        # a figure: a picture in the markdown or one the run drew
MINUTES_PER_FUNCTION = 10       # an exercise function to write (one solution region), its check
                                # run and its diagnosis read until it passes
MINUTES_PER_OPEN_QUESTION = 3   # an exercise's open question, answered in a few sentences
ROUND_TO = 5                    # each notebook's minutes, to the nearest 5 (at least 5)
# An exercise's optional last section: from the markdown cell that opens with this heading to the
# next level-2 heading (its score). The clock times it apart from the exercise, and no total counts it.
OPTIONAL_SECTION = "## Going further (optional)"

_WORD = re.compile(r"[^\W_][\w'’.-]*")
# A prediction: `widgets.predict(...)` or a bare `predict(...)` (not `memory.predict` and the like)
_PREDICTION = re.compile(r"(?:\bwidgets\.|(?<![\w.]))predict\(")
_MARKDOWN_FIGURE = re.compile(r"!\[[^\]]*\]\(|<img\b")
_LINK_TARGET = re.compile(r"\]\([^)\s]*\)")  # a link's or picture's address: not read as prose
_FIGURE_MIME = ("image/", "application/vnd.plotly.v1+json")
_WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
_HTML_DROP = re.compile(r"<(script|style)\b.*?</\1>", re.DOTALL | re.IGNORECASE)
_HTML_TAG = re.compile(r"<[^>]+>")
SOLUTION_BEGIN, ANSWER_TAG = "### BEGIN SOLUTION", "answer"


@dataclass(frozen=True)
class Work:
    """What a learner meets in one notebook, counted: the clock's inputs. `printed_words` and
    `run_s` are None where no recorded run says them (they then count nothing, and say so)."""
    prose_words: int = 0
    code_lines: int = 0
    predictions: int = 0
    figures: int = 0
    printed_words: int | None = None
    run_s: float | None = None
    functions: int = 0
    open_questions: int = 0
    stale: bool = False  # the recorded run ran an earlier version of the notebook
    # An exercise's `OPTIONAL_SECTION`, counted alike but apart: not in this Work's minutes
    optional: Work | None = None

    def parts(self) -> dict[str, float]:
        """Minutes per kind of work (the clock's rates applied)."""
        return {"prose": self.prose_words / PROSE_WORDS_PER_MINUTE,
                "printed output": (self.printed_words or 0) / PRINTED_WORDS_PER_MINUTE,
                "code": self.code_lines / CODE_LINES_PER_MINUTE,
                "run": (self.run_s or 0.0) / 60,
                "predictions": self.predictions * MINUTES_PER_PREDICTION,
                "figures": self.figures * MINUTES_PER_FIGURE,
                "functions to write": self.functions * MINUTES_PER_FUNCTION,
                "open questions": self.open_questions * MINUTES_PER_OPEN_QUESTION}

    def exact_minutes(self) -> float:
        return sum(self.parts().values())

    def minutes(self) -> int:
        """The stated time: the sum of the parts to the nearest `ROUND_TO` minutes, at least
        that (a rounding small edits seldom move, so a header is not rewritten for a word)."""
        return ROUND_TO * max(1, math.floor(self.exact_minutes() / ROUND_TO + 0.5))


def _cells(notebook: Path) -> list[dict]:
    try:
        return json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    except (OSError, ValueError, KeyError) as exc:
        raise DocsError(f"{notebook}: not a readable notebook ({exc}); restore it from git") from None


def _code_lines(source: str) -> int:
    return sum(1 for line in source.splitlines()
               if line.strip() and not line.strip().startswith("#"))


def _source_work(cells: list[dict]) -> Work:
    words = lines = predictions = figures = 0
    for cell in cells:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            words += len(_WORD.findall(_LINK_TARGET.sub("]", REGION.sub("", source))))
            figures += len(_MARKDOWN_FIGURE.findall(source))
        elif cell["cell_type"] == "code":
            lines += _code_lines(source)
            predictions += len(_PREDICTION.findall(source))
    return Work(prose_words=words, code_lines=lines, predictions=predictions, figures=figures)


def notebook_work(notebook: Path) -> Work:
    """What the notebook's sources give the clock: its markdown's words (generated regions and
    link addresses left out: the time a region states must not move the time it states), its
    code lines, its predictions and the pictures its markdown shows."""
    return _source_work(_cells(notebook))


def _split_optional(cells: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the exercise's cells, its `OPTIONAL_SECTION`'s): the section runs from the markdown cell
    that opens with that heading to the next level-2 heading."""
    core, optional, inside = [], [], False
    for cell in cells:
        source = "".join(cell["source"]).lstrip()
        if cell["cell_type"] == "markdown" and source.startswith("## "):
            inside = source.startswith(OPTIONAL_SECTION)
        (optional if inside else core).append(cell)
    return core, optional


def _shown_text(text: str) -> str:
    """A stream's text as a reader sees it: of each line rewritten with carriage returns (a
    progress bar), only its last state."""
    return "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n"))


def printed_output(executed: Path) -> tuple[int, int]:
    """(words, figures) an executed notebook's outputs show a reader: streams as the terminal
    leaves them, each rich output's markdown, else its HTML's text, else its plain text; a
    picture or plotly figure is a figure; a live widget's placeholder shows nothing (its static
    result follows it)."""
    words = figures = 0
    for cell in _cells(executed):
        for out in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            if out.get("output_type") == "stream":
                words += len(_WORD.findall(_shown_text("".join(out.get("text", "")))))
                continue
            data = out.get("data") or {}
            if any(mime.startswith(_FIGURE_MIME) for mime in data):
                figures += 1
            elif _WIDGET_MIME in data:
                continue
            elif "text/markdown" in data:
                words += len(_WORD.findall("".join(data["text/markdown"])))
            elif "text/html" in data:
                text = _HTML_TAG.sub(" ", _HTML_DROP.sub(" ", "".join(data["text/html"])))
                words += len(_WORD.findall(html.unescape(text)))
            elif "text/plain" in data:
                words += len(_WORD.findall("".join(data["text/plain"])))
    return words, figures


def source_digest(notebook: Path) -> str:
    """A short hash of what a notebook's cells say (their types and sources), leaving out what a
    run or `docs` adds: papermill's injected parameters and the generated regions. An executed
    notebook and its source give the same digest while the chapter is unchanged."""
    import hashlib

    cells = [(c["cell_type"], REGION.sub("", "".join(c["source"])))
             for c in _cells(notebook)
             if "injected-parameters" not in c.get("metadata", {}).get("tags", [])]
    return hashlib.sha256(json.dumps(cells, ensure_ascii=False).encode()).hexdigest()[:16]


def chapter_notebooks(folder: Path | None = None) -> list[Path]:
    """The course's notebooks (`NN_*.ipynb`) in `folder` (default: this checkout's), in order."""
    return sorted((folder or NOTEBOOKS).glob("[0-9][0-9]_*.ipynb"))


def exercise_of(chapter: Path) -> Path | None:
    """The exercise notebook beside a chapter (the same number), None where it has none."""
    number = chapter.stem.split("_", 1)[0]
    found = sorted(EXERCISES.glob(f"{number}_*.ipynb"))
    return found[0] if found else None


def _runs() -> dict[str, dict]:
    return {r["notebook"]: r for r in load_result(COURSE_RUN)["runs"]}


def chapter_work(notebook: Path, run: dict | None = None) -> Work:
    """The clock's inputs for a chapter: its sources, and what the recorded run (`run`, its
    entry in `COURSE_RUN`) printed and took."""
    work = notebook_work(notebook)
    if run is None:
        return work
    return replace(work, run_s=run["seconds"], printed_words=run.get("printed_words"),
                   figures=work.figures + run.get("printed_figures", 0),
                   stale=run.get("source_digest") not in (None, source_digest(notebook)))


def exercise_work(exercise: Path) -> Work:
    """The clock's inputs for an exercise: what the learner reads is the exercise notebook;
    what they write, its solution's regions and open questions (the notebook of the same name
    in solutions/, the single source). The time to run each check and read its diagnosis is in
    the minutes per function: the exercises are not part of the recorded run. An exercise's
    `OPTIONAL_SECTION` is counted alike into `optional`, and left out of its own minutes."""
    solution = SOLUTIONS / exercise.name
    read = _split_optional(_cells(exercise))
    written = _split_optional(_cells(solution)) if solution.exists() else ([], [])

    def work(part: int) -> Work:
        cells = written[part]
        return replace(_source_work(read[part]),
                       functions=sum("".join(c["source"]).count(SOLUTION_BEGIN) for c in cells
                                     if c["cell_type"] == "code"),
                       open_questions=sum(ANSWER_TAG in c.get("metadata", {}).get("tags", [])
                                          for c in cells))
    return replace(work(0), optional=work(1) if read[1] or written[1] else None)


def reading_minutes(notebook: Path) -> int:
    """A notebook's minutes from its sources alone (prose, code, predictions, pictures; no run
    recorded), by the clock."""
    return notebook_work(notebook).minutes()


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s"


def _hours(minutes: int) -> str:
    hours, rest = divmod(minutes, 60)
    return f"{hours} h {rest:02d} min" if hours else f"{rest} min"


def _clock_rows() -> tuple[list[tuple[Path, Work, Path | None, Work | None]],
                           list[tuple[Path, Work, Path | None, Work | None]]]:
    """(counted, optional): per chapter notebook, its work and its exercise's."""
    runs = _runs()
    rows = []
    for notebook in chapter_notebooks():
        if notebook.stem not in CHAPTER_LESSONS:
            raise DocsError(f"chapter {notebook.stem} has no sentence in docs.CHAPTER_LESSONS: "
                            "add what it teaches there")
        exercise = exercise_of(notebook)
        rows.append((notebook, chapter_work(notebook, runs.get(notebook.stem)), exercise,
                     exercise_work(exercise) if exercise else None))
    return ([r for r in rows if r[0].stem not in OPTIONAL_NOTEBOOKS],
            [r for r in rows if r[0].stem in OPTIONAL_NOTEBOOKS])


def _unrecorded(work: Work) -> bool:
    """Whether the recorded run says nothing of what this chapter prints (not in the run, or
    recorded before runs counted printed output)."""
    return work.printed_words is None


def chapter_times() -> str:
    """The README's chapter table: what each chapter teaches, its time and its exercise's by the
    clock, its run time in the committed headless run; then the totals, chapters and exercises
    apart, and where they come from."""
    run = load_result(COURSE_RUN)
    counted, optional = _clock_rows()

    def row(notebook, work, exercise, exercise_work_):
        mark = "*" if _unrecorded(work) else "†" if work.stale else ""
        done = (f"[{exercise.stem}](exercises/{exercise.name}): {exercise_work_.minutes()} min"
                + _optional_minutes(exercise_work_) if exercise else "–")
        ran = "not measured yet" if work.run_s is None else _duration(work.run_s)
        return [f"[{notebook.stem}](notebooks/{notebook.name})", CHAPTER_LESSONS[notebook.stem],
                f"{work.minutes()} min{mark}", done, ran]

    rows = [row(*r) for r in counted]
    chapters = sum(work.minutes() for _, work, _, _ in counted)
    exercises = sum(w.minutes() for _, _, e, w in counted if e)
    extras = sum(w.optional.minutes() for _, _, e, w in counted if e and w.optional)
    ran = sum(work.run_s or 0.0 for _, work, _, _ in counted)
    first, last = counted[0][0].stem[:2], counted[-1][0].stem[:2]
    numbers = [e.stem[:2] for _, _, e, _ in counted if e]
    rows.append(["**in all**", f"chapters {first}–{last}; exercises {numbers[0]}–{numbers[-1]}",
                 f"**{_hours(chapters)}**",
                 f"**{_hours(exercises)}**" + (f" (+ {_hours(extras)} optional)" if extras else ""),
                 f"**{_duration(ran)}**"])
    rows += [row(*r) for r in optional]
    unrecorded = [n.stem for n, w, _, _ in counted + optional if _unrecorded(w)]
    stale = [n.stem for n, w, _, _ in counted + optional if w.stale and not _unrecorded(w)]
    env = run["environment"]
    note = f" {run['note']}" if run.get("note") else ""
    return (md_table(["chapter", "you learn", "chapter time", "its exercise", f"run ({run['mode']} mode)"],
                   ["---", "---", "---:", "---", "---:"], rows)
            + "\n\nTimes by the course's clock ([how they are made](docs/course.md#how-the-times-are-"
            f"made)): a chapter's prose, code and printed output read, its cells run, its "
            f"predictions made; an exercise's prose and code read, {MINUTES_PER_FUNCTION} min per "
            f"function you write and {MINUTES_PER_OPEN_QUESTION} per open question"
            + ("; an exercise's last section, *Going further (optional)*, is timed apart "
               "(\"+ N min optional\"), outside the exercise's time and the exercises' total. "
               if extras else ". ")
            + (f"*: the recorded run counted no printed output for {', '.join(unrecorded)}, "
               "so none is in that time (record a run: docs/course.md says how). "
               if unrecorded else "")
            + (f"†: {', '.join(stale)} changed since the recorded run, whose printed output and "
               "run time that time still counts (record a run again: docs/course.md says how). "
               if stale else "")
            + f"Each run time was measured by `python -m moe_tutorial run` (what `make course` "
            f"runs) in {run['mode']} mode on {env['cpu_count']} CPU cores ({env['cpu_model']}, "
            f"torch {env['torch']}, {env['date'][:10]}): {result_link(COURSE_RUN)}{_shared(run, env)}."
            f"{note}")


def _optional_minutes(work: Work) -> str:
    """What an exercise's optional section adds, as the README's table states it."""
    return f" (+ {work.optional.minutes()} min optional)" if work.optional else ""


def clock_table() -> str:
    """docs/course.md's breakdown: per chapter and per exercise, what the clock counted and the
    minutes it gives."""
    counted, optional = _clock_rows()

    def minutes(work):  # †: counted from a recorded run of an earlier version of the notebook
        return f"{work.exact_minutes():.1f} → **{work.minutes()}**" + "†" * work.stale

    def maybe(value, fmt="{:,}"):
        return "not recorded" if value is None else fmt.format(value)

    chapters = [[notebook.stem, f"{work.prose_words:,}", maybe(work.printed_words),
                 f"{work.code_lines:,}", maybe(work.run_s, "{:.0f} s"), str(work.predictions),
                 str(work.figures), minutes(work)]
                for notebook, work, _, _ in counted + optional]

    def exercise_row(name, work):
        return [name, f"{work.prose_words:,}", f"{work.code_lines:,}", str(work.functions),
                str(work.open_questions), str(work.predictions), str(work.figures), minutes(work)]

    exercises = [row for _, _, exercise, work in counted + optional if exercise
                 for row in [exercise_row(exercise.stem, work)]
                 + ([exercise_row(f"{exercise.stem}, going further (optional)", work.optional)]
                    if work.optional else [])]
    return (md_table(["chapter", "prose words", "printed words", "code lines", "run",
                    "predictions", "figures", "minutes → stated"],
                   ["---"] + ["---:"] * 7, chapters) + "\n\n"
            + md_table(["exercise", "prose words", "code lines", "functions to write",
                      "open questions", "predictions", "figures", "minutes → stated"],
                     ["---"] + ["---:"] * 7, exercises))


def chapter_time(notebook: Path) -> str:
    """A chapter header's line: its time and its exercise's by the clock, and its run time in
    the committed headless run (the numbers of the README's chapter table)."""
    run = load_result(COURSE_RUN)
    work = chapter_work(notebook, _runs().get(notebook.stem))
    exercise = exercise_of(notebook)
    env = run["environment"]
    machine = (f"{env['cpu_count']} CPU cores" if env["gpu"] is None
               else f"{env['gpu_count']} × {env['gpu']}")
    ran = (f"{_duration(work.run_s)}, measured by `make course` "
           f"(`{RESULTS_LINK}/{COURSE_RUN}`)" if work.run_s is not None else "not measured yet")
    also = (f"; its exercise, `{exercise.stem}`, about {exercise_work(exercise).minutes()} min"
            if exercise else "")
    return (f"*Time: about {work.minutes()} min to read, run and predict{also} (the course's "
            f"clock, docs/course.md) · run ({run['mode']} mode, {machine}): {ran}*")


def _header_region(path: Path, text: str) -> tuple[int, int] | None:
    """The lines of the notebook's JSON `text` between its first markdown cell's chapter-time
    markers, as (first, end) line indices; None when that cell has no such region. Each line of
    a cell's source is one JSON string on one line of the file, so the region is rewritten in
    place and the rest of the file keeps its layout byte for byte."""
    try:
        cells = json.loads(text)["cells"]
    except (ValueError, KeyError, TypeError):
        raise DocsError(f"{path}: not a notebook's JSON; restore it from git") from None
    header = next((c for c in cells if c.get("cell_type") == "markdown"), None)
    source = "".join(header["source"]) if header else ""
    markers = [m[1] for m in MARKER.finditer(source) if m[2] == CHAPTER_TIME]
    if not markers:
        return None
    if markers != ["BEGIN", "END"] or not any(m["name"] == CHAPTER_TIME
                                             for m in REGION.finditer(source)):
        raise DocsError(f"{path}: the first markdown cell's {CHAPTER_TIME} markers do not pair "
                        f"up; write them as two lines, {region_block(CHAPTER_TIME, '')!r}")
    lines = text.split("\n")
    begin = [i for i, line in enumerate(lines)
             if f"<!-- BEGIN generated: {CHAPTER_TIME} " in line]
    end = [i for i, line in enumerate(lines) if f"<!-- END generated: {CHAPTER_TIME} " in line]
    if len(begin) != 1 or len(end) != 1 or not begin[0] < end[0]:
        raise DocsError(f"{path}: the {CHAPTER_TIME} markers must each be one line of the first "
                        "markdown cell, and only there")
    return begin[0] + 1, end[0]


def render_chapter_time(path: Path, text: str) -> str:
    """The notebook's JSON `text` with its header's chapter-time region rewritten (unchanged
    when it has none)."""
    span = _header_region(path, text)
    if span is None:
        return text
    lines = text.split("\n")
    indent = re.match(r"\s*", lines[span[1]])[0]
    body = [f"{indent}{json.dumps(line + chr(10), ensure_ascii=False)},"
            for line in chapter_time(path).splitlines()]
    return "\n".join(lines[:span[0]] + body + lines[span[1]:])


def _shared(run: dict, env: dict) -> str:
    """A note when other work shared the machine during the run: its times are then longer
    than the machine alone would take."""
    load = run.get("load_average_15min_at_recording")
    if load is None or load <= env["cpu_count"]:
        return ""
    return (f"; other work shared the machine (load average {load:.1f} on {env['cpu_count']} "
            f"cores over the run's last 15 minutes), so a machine of its own runs faster")


def record_course_run(*run_dirs: str | Path, replace: bool = False, note: str | None = None) -> Path:
    """Write the run times of a headless course run (`python -m moe_tutorial run --out
    RUN_DIR`) into `benchmarks/results/`, with this machine's hardware and versions: call it on
    the machine that ran, right after the run. A course run in parts (`run --notebooks ...`
    into several folders) is recorded from all of them, each notebook once. Each time is
    papermill's duration of the executed notebook (kernel start included); beside it, the words
    and figures its outputs show (`printed_output`), which the clock reads. `note` says anything
    a reader of the numbers should know. Returns the file written."""
    from moe_tutorial.perf.timing import environment

    runs, modes = {}, set()
    for run_dir in map(Path, run_dirs):
        executed = sorted(run_dir.glob("[0-9][0-9]_*.ipynb"))
        if not executed:
            raise DocsError(f"{run_dir}: no executed notebooks (NN_*.ipynb) there; give the --out "
                            "folder of a `python -m moe_tutorial run`")
        for path in executed:
            meta = json.loads(path.read_text(encoding="utf-8"))["metadata"].get("papermill") or {}
            if meta.get("duration") is None or meta.get("exception"):
                raise DocsError(f"{path}: this notebook did not run to its end; record runs in "
                                "which every notebook passed")
            if path.stem in runs:
                raise DocsError(f"{path}: {path.stem} is in two of the folders; give each "
                                "notebook's run once")
            modes.add(meta.get("parameters", {}).get("MODE"))
            words, figures = printed_output(path)
            runs[path.stem] = {"notebook": path.stem, "seconds": round(meta["duration"], 1),
                               "started": meta["start_time"], "printed_words": words,
                               "printed_figures": figures, "source_digest": source_digest(path)}
    if len(modes) != 1 or None in modes:
        raise DocsError(f"{', '.join(map(str, run_dirs))}: the notebooks ran in modes "
                        f"{sorted(map(str, modes))}; record runs of one mode")
    mode = modes.pop()
    env = environment()
    env.update(cpu_count=os.cpu_count(), cpu_model=_cpu_model())
    machine = "cpu" if env["gpu"] is None else env["gpu"].split()[-1].lower()
    out = RESULTS / f"{machine}_course_{mode}.json"
    if out.exists() and not replace:
        raise DocsError(f"{out} exists; pass --replace to write this run over it")
    ordered = [runs[name] for name in sorted(runs)]
    record = {
        "what": f"python -m moe_tutorial run --mode {mode}: each notebook's run time, "
                "papermill's duration of the executed notebook (kernel start included), and "
                "what its outputs show a reader (docs.printed_output: words printed, figures "
                "drawn), for the course's clock",
        "mode": mode, "environment": env, "commit": _commit(),
        "load_average_15min_at_recording": round(os.getloadavg()[2], 2),
        **({"note": note} if note else {}),
        "runs": ordered, "total_s": round(sum(r["seconds"] for r in ordered), 1)}
    out.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    return out


def _cpu_model() -> str | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return found[1].strip() if found else None


def _commit() -> str | None:
    """The checkout's commit, '+ changes' when its tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        head = git("rev-parse", "--short=12", "HEAD")
        return head + (" + changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None
