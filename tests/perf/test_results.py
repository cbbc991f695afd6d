"""The one reader of committed results (`perf.results`) and where the package finds files
(`locations`): a clone found from the current directory up, make lab's work/ copy included, and
one clear line outside any clone."""

import json
from pathlib import Path

import pytest

from moe_tutorial import locations
from moe_tutorial.course import run_history
from moe_tutorial.perf import results


@pytest.fixture()
def clone(tmp_path):
    """A clone with one committed result, and make lab's work/ copy inside it."""
    root = tmp_path / "clone"
    for folder in ("moe_tutorial", "notebooks", "solutions", "benchmarks/results",
                   "work/notebooks", "work/solutions"):
        (root / folder).mkdir(parents=True)
    (root / "benchmarks" / "results" / "run.json").write_text(json.dumps({"gpu": "H200"}))
    return root


@pytest.mark.parametrize("where", [".", "notebooks", "work/notebooks"])
def test_committed_results_are_found_from_anywhere_in_the_clone(clone, monkeypatch, where):
    monkeypatch.chdir(clone / where)
    committed = clone / "benchmarks" / "results" / "run.json"
    assert locations.checkout_root() == clone.resolve()
    assert results.find("run.json") == results.find("benchmarks/results/run.json")
    assert results.find("run.json").resolve() == committed.resolve()
    assert results.read("run.json") == {"gpu": "H200"}
    assert results.find("other.json") is None


def test_a_file_given_as_a_path_is_read_as_it_is(clone, tmp_path, monkeypatch):
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"gpu": "mine"}))
    monkeypatch.chdir(clone)
    assert results.read(mine) == {"gpu": "mine"}


def test_outside_a_clone_the_error_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert locations.checkout_root() is None and results.find(results.H200) is None
    with pytest.raises(ValueError) as raised:
        results.read(results.H200)
    message = str(raised.value)
    assert message.startswith(f"{results.H200}: no such results file, and no clone of the "
                              f"course's repository in {Path.cwd()}")
    assert "\n" not in message and "python -m moe_tutorial bench" in message


def test_a_missing_file_in_a_clone_names_the_folder(clone, monkeypatch):
    monkeypatch.chdir(clone)
    with pytest.raises(ValueError, match=r"other\.json: no such results file \(nor in .*"
                                         r"benchmarks/results\)"):
        results.path("other.json")
    with pytest.raises(ValueError, match=r"no such results file; pass the JSON"):
        results.path(clone / "absent.json")


def test_package_data_is_found_through_the_package():
    assert (locations.package_data("configs") / "qwen3-moe-30b-a3b.json").is_file()
    assert locations.package_dir() == Path(locations.__file__).resolve().parent
    assert (locations.import_root() / "moe_tutorial" / "locations.py").is_file()


def test_a_target_in_a_clone_is_guarded_from_outside_it(clone, tmp_path, monkeypatch):
    """Run from outside the clone, a write through a link into its notebooks/ is still refused."""
    from moe_tutorial import safe_io

    monkeypatch.chdir(tmp_path)
    target = clone / "notebooks" / "new" / "out.json"
    assert locations.checkout_roots(target) == [clone.resolve()]
    assert (clone / "notebooks").resolve() in safe_io.course_folders(target)
    link = tmp_path / "out.json"
    link.symlink_to(target)
    with pytest.raises(safe_io.UnsafeWrite, match="inside the course's own notebooks/ folder"):
        safe_io.check_target(link, replace=True)


def _train_report(rows, gpu="NVIDIA H200", date="2026-12-02 10:00:00 UTC"):
    return {"environment": {"gpu": gpu, "date": date},
            "results": [{"part": "train", "status": "ok", "peak_memory_gb": 20.0, **r} for r in rows]}


def test_a_candidate_is_set_beside_its_base_from_the_same_run(clone, monkeypatch):
    """Each experiment is set beside the variant it changes, from the same run; a candidate whose
    base did not run is left out."""
    folder = clone / "benchmarks" / "results"
    (folder / "run.json").write_text(json.dumps(_train_report([
        {"variant": "ours_te_ops_fp8", "median_ms": 80.0},
        {"variant": "ours_te_ops_fp8_compiled", "median_ms": 72.0},
        {"variant": "ours_te_ops_fp8_compiled_step_in_backward", "median_ms": 75.0},
        {"variant": "hf_grouped_mm_compiled", "median_ms": 100.0},
        {"variant": "hf_grouped_mm_compiled_compiled_adamw", "median_ms": 98.0},
        {"variant": "ours_te_ops_bf16_compiled_loss", "median_ms": 90.0}])))
    monkeypatch.chdir(clone)
    gains = {g["variant"]: g for g in run_history.candidate_gains()}
    assert set(gains) == {"ours_te_ops_fp8_compiled", "ours_te_ops_fp8_compiled_step_in_backward",
                          "hf_grouped_mm_compiled_compiled_adamw"}
    assert gains["ours_te_ops_fp8_compiled"]["base"] == "ours_te_ops_fp8"
    assert gains["ours_te_ops_fp8_compiled"]["speedup"] == pytest.approx(80 / 72)
    assert gains["ours_te_ops_fp8_compiled_step_in_backward"]["base"] == "ours_te_ops_fp8_compiled"
    assert gains["ours_te_ops_fp8_compiled_step_in_backward"]["technique"] == (
        "AdamW stepped in the backward pass")
    assert gains["hf_grouped_mm_compiled_compiled_adamw"]["base"] == "hf_grouped_mm_compiled"
    assert len(run_history.candidate_table().rows) == 3


def test_the_history_compares_two_medians_of_the_same_run(clone, monkeypatch):
    (clone / "benchmarks" / "results" / "run.json").write_text(json.dumps(_train_report([
        {"variant": "ours_te_ops_fp8", "median_ms": 80.0}, {"variant": "hf_eager", "median_ms": 160.0}])))
    monkeypatch.chdir(clone)
    [entry] = run_history.fp8_step_history()
    assert (entry["ours_fp8_ms"], entry["hf_eager_ms"], entry["speedup"]) == (80.0, 160.0, 2.0)
    assert run_history.history_table().rows[0][-1] == "2.00x"


def test_host_syncs_are_set_beside_the_like_for_like_hf_step_of_the_same_run(clone, monkeypatch):
    """Each step against HF's compiled step with the same optimizer: a step that compiles
    AdamW against HF's with the compiled AdamW, one with torch's fused AdamW (a committed
    sync-free row, whose variant left the package) against HF's with it."""
    (clone / "benchmarks" / "results" / "run.json").write_text(json.dumps(_train_report([
        {"variant": "hf_grouped_mm_compiled", "median_ms": 104.0, "host_syncs_per_step": 5},
        {"variant": "hf_grouped_mm_compiled_compiled_adamw", "median_ms": 100.0,
         "host_syncs_per_step": 4},
        {"variant": "ours_sync_free_bf16_graphed", "median_ms": 130.0, "host_syncs_per_step": 0},
        {"variant": "ours_te_ops_fp8_compiled", "median_ms": 80.0, "host_syncs_per_step": 12},
        {"variant": "ours_te_ops_fp8", "median_ms": 90.0}])))
    monkeypatch.chdir(clone)
    rows = run_history.host_sync_rows()
    assert [(r["variant"], r["syncs"]) for r in rows] == [
        ("ours_te_ops_fp8_compiled", 12), ("hf_grouped_mm_compiled_compiled_adamw", 4),
        ("hf_grouped_mm_compiled", 5),
        ("ours_sync_free_bf16_graphed", 0)]  # fastest first; the row without a count left out
    assert [r["hf_pair"] for r in rows] == [
        "hf_grouped_mm_compiled_compiled_adamw", "hf_grouped_mm_compiled_compiled_adamw",
        "hf_grouped_mm_compiled", "hf_grouped_mm_compiled"]
    assert [r["vs_hf_compiled"] for r in rows] == [1.25, 1.0, 1.0, 0.8]
    assert run_history.host_sync_table().rows[3][3] == "0.80x"


def test_the_committed_history_and_candidate_runs_read_back():
    history = run_history.fp8_step_history()
    assert len(history) >= 4 and [h["date"] for h in history] == sorted(h["date"] for h in history)
    gains = run_history.candidate_gains()
    techniques = {g["technique"] for g in gains}
    assert "AdamW stepped in the backward pass" in techniques and len(techniques) >= 3
    assert all(g["base"] != g["variant"] and g["speedup"] > 0 for g in gains)
