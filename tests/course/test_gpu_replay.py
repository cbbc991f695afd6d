"""A learner without a GPU sees the GPU: `%%needs_gpu` cells run on a CUDA device, record there,
and replay the committed GPU run's output (and kept values) everywhere else; a chapter whose marked
cell changed since that run fails here until the run is recorded again."""

import json
import re
from pathlib import Path

import nbformat
import pytest
from notebook_conventions import GPU_RECORD_PENDING, NOT_RUN

from moe_tutorial.course import gpu_replay
from moe_tutorial.course.runner import local_kernel_config
from tools import record_gpu_run

ROOT = Path(__file__).resolve().parents[2]
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
RECORD = ROOT / "benchmarks" / "results" / gpu_replay.RECORD_FILE


def marked_cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"
            and gpu_replay.magic_names("".join(c["source"])) is not None]


def test_digest_ignores_trailing_space_but_not_code():
    a = "%%needs_gpu x\nx = 1  \n\n"
    assert gpu_replay.cell_digest(a) == gpu_replay.cell_digest("%%needs_gpu x\nx = 1")
    assert gpu_replay.cell_digest(a) != gpu_replay.cell_digest("%%needs_gpu x\nx = 2")


def test_digest_ignores_comments_but_not_a_hash_inside_a_string():
    a = '%%needs_gpu x\nx = "#1"  # one\n# a note\nprint(x)'
    assert gpu_replay.cell_digest(a) == gpu_replay.cell_digest(
        '%%needs_gpu x\n# reworded\nx = "#1"\nprint(x)  # another')
    assert gpu_replay.cell_digest(a) != gpu_replay.cell_digest('%%needs_gpu x\nx = "#2"\nprint(x)')


def test_magic_names_reads_only_the_first_line():
    assert gpu_replay.magic_names("%%needs_gpu a b\nc = 1") == ["a", "b"]
    assert gpu_replay.magic_names("%%needs_gpu\nc = 1") == []
    assert gpu_replay.magic_names("x = 1\n%%needs_gpu a") is None


def test_compact_outputs_keeps_text_tables_and_kept_values_but_not_images():
    outputs = [{"output_type": "stream", "name": "stdout", "text": ["a\n", "b\n"]},
               {"output_type": "display_data", "data": {"text/plain": "t", "text/html": "<table/>",
                                                        "image/png": "AAAA"}},
               {"output_type": "display_data", "data": {gpu_replay.KEPT_MIME: {"x": 1.5}}},
               {"output_type": "display_data", "data": {"text/plain": "x" * (gpu_replay.MAX_OUTPUT_BYTES + 1)}}]
    compact, kept = gpu_replay.compact_outputs(outputs)
    assert compact[0] == {"stream": "stdout", "text": "a\nb\n"}
    assert compact[1] == {"data": {"text/plain": "t", "text/html": "<table/>"}}
    assert "too large" in compact[2]["data"]["text/plain"]
    assert kept == {"x": 1.5}


def _run(cells: list[str], tmp_path: Path, env: dict, monkeypatch) -> nbformat.NotebookNode:
    from nbclient import NotebookClient

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    # IPC sockets, as the runner's kernels: two kernels started at once by parallel test workers
    # cannot race for a TCP port ("Address already in use")
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}},
                   config=local_kernel_config(str(tmp_path))).execute()
    return nb


BODY = ("%%needs_gpu speedup rows\nimport sys\nspeedup = 1.25\nrows = [{'variant': 'fp8', 'ms': 80.0}]\n"
        "sys.stderr.write('a warning of the GPU process\\n')\nprint('measured on the GPU')")


def test_a_recorded_cell_replays_its_output_and_values_on_a_cpu(tmp_path, monkeypatch):
    """The round trip: the cell runs as on a GPU (the magic bound to a cuda device) and records;
    the recorder keeps it; a CPU kernel then shows that output under its label and defines the
    kept names with the GPU's values."""
    on_gpu = ("from moe_tutorial.course import gpu_replay\n"
              "get_ipython().register_magic_function(gpu_replay.NeedsGpu('cuda'), 'cell', 'needs_gpu')")
    recorded = _run([on_gpu, BODY], tmp_path, {gpu_replay.RECORD_ENV: "1"}, monkeypatch)
    cells = record_gpu_run.chapter_cells(recorded)
    assert [c["kept"] for c in cells] == [{"speedup": 1.25, "rows": [{"variant": "fp8", "ms": 80.0}]}]
    record = {"chapters": {"99_test": {"cells": cells, "environment": {
        "gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "transformer_engine": "2.20.2", "cuda": "13.0",
        "mode": "full", "date": "2026-12-07"}}}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(record))
    monkeypatch.delenv(gpu_replay.RECORD_ENV)
    on_cpu = "from moe_tutorial.course.lesson import setup\nSETUP = setup('', 'cpu')"
    replayed = _run([on_cpu, BODY, "print(speedup * 2, rows[0]['variant'])", BODY], tmp_path,
                    {gpu_replay.REPLAY_ENV: str(path)}, monkeypatch)
    text = "".join(o.get("text", "") for o in replayed.cells[1].outputs)
    assert replayed.cells[1].outputs[0]["text"].startswith(
        "[committed GPU run: NVIDIA H100 80GB HBM3, torch 2.11.0, TE 2.20.2"), "the label comes first"
    assert "a warning of the GPU process" not in text
    assert "measured on the GPU" in text
    assert replayed.cells[2].outputs[0]["text"] == "2.5 fp8\n"
    again = replayed.cells[3].outputs[0]["text"]  # the same run's label, once in full is enough
    assert again.startswith("[committed GPU run on the NVIDIA H100 80GB HBM3, as at") and "torch" not in again


def test_an_edited_cell_says_so_and_sets_its_names_to_none(tmp_path, monkeypatch):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"chapters": {}}))
    on_cpu = "from moe_tutorial.course.lesson import setup\nSETUP = setup('', 'cpu')"
    nb = _run([on_cpu, BODY, "print(speedup, rows)"], tmp_path, {gpu_replay.REPLAY_ENV: str(path)}, monkeypatch)
    assert "holds no output of this version of it" in nb.cells[1].outputs[0]["text"]
    assert re.search(NOT_RUN, nb.cells[1].outputs[0]["text"]), "the tests must see a cell that did not run"
    assert nb.cells[2].outputs[0]["text"] == "None None\n"


def test_no_chapter_prints_not_run_here():
    """A cell that needs a GPU is marked and replays the GPU run; none says 'not run here'."""
    said = [p.name for p in CHAPTERS if re.search(NOT_RUN, p.read_text(), re.I)]
    assert not said, f"chapters that print 'not run here' instead of marking the cell %%needs_gpu: {said}"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_every_marked_cell_has_a_committed_gpu_output_of_its_current_source(chapter):
    cells = marked_cells(chapter)
    if not cells:
        pytest.skip(f"{chapter.name} has no %%needs_gpu cell")
    assert RECORD.exists(), f"no committed GPU run {RECORD.name}: record one (tools/record_gpu_run.py)"
    chapter_record = json.loads(RECORD.read_text())["chapters"].get(chapter.stem, {})
    if not chapter_record and chapter.stem in GPU_RECORD_PENDING:
        pytest.xfail(f"{chapter.stem}: {GPU_RECORD_PENDING[chapter.stem]}")
    env = chapter_record.get("environment", {})
    assert all(env.get(k) for k in ("gpu", "torch", "transformer_engine", "cuda", "mode", "date")), (
        f"{chapter.name}: the committed GPU run names no GPU, versions, mode or date: {env}")
    recorded = {c["digest"] for c in chapter_record.get("cells", [])}
    stale = [c.split("\n")[1] for c in cells if gpu_replay.cell_digest(c) not in recorded]
    if stale and chapter.stem in GPU_RECORD_PENDING:
        pytest.xfail(f"{chapter.stem}: {GPU_RECORD_PENDING[chapter.stem]}")
    assert not stale, (f"{chapter.name}: these %%needs_gpu cells changed since the committed GPU run "
                       f"of {env['date']}; re-record it on a GPU (tools/record_gpu_run.py): {stale}")
