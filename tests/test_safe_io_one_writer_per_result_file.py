"""One writer per result file, never through a link, and a finished result never lost to a
stdout that closed early.

A command that writes a JSON result (`train --json`, `bench --out`, `analyze --json`,
`speed-of-light --out`, `validate --out`, ..., `benchmarks.matrix --out`, and `train_dist --out`
on its writing rank) claims the file for its whole run
(`safe_io.claim_output`, a lock beside it, as `hold_folder` locks a folder): a second command
writing the same file stops before its work, in one line naming the first; every write through
`safe_io` respects another process's claim. The holder here is another process, as a running
command would be."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from course_helpers import WorkStarted, one_line_error

from moe_tutorial import safe_io
from moe_tutorial.cli import main

ROOT = Path(__file__).resolve().parents[1]
CLAIMER = """
import sys, time
from moe_tutorial import safe_io
with safe_io.claim_output(sys.argv[1], "`bench`", replace=True):
    print("held", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def claimed(tmp_path):
    """(result.json, the process claiming it), as a running `bench --out result.json`."""
    target = tmp_path / "result.json"
    target.write_text('{"earlier": true}')
    process = subprocess.Popen([sys.executable, "-c", CLAIMER, str(target)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               cwd=ROOT)
    assert process.stdout.readline().strip() == "held"
    yield target, process
    process.kill()
    process.wait()


def no_leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".tmp", ".lock")))


# ---------------------------------------------------------------------------------------------
# The API

def test_a_write_to_a_file_another_process_claims_is_refused_naming_it(claimed):
    target, process = claimed
    with pytest.raises(safe_io.FileBusy, match=rf"is being written by `bench` \(pid "
                                               rf"{process.pid}"):
        safe_io.write_json(target, {"mine": 1}, replace=True)
    assert json.loads(target.read_text()) == {"earlier": True}


def test_a_claim_of_a_claimed_file_is_refused_in_one_line(claimed):
    target, process = claimed
    with pytest.raises(safe_io.FileBusy) as info:
        with safe_io.claim_output(target, "`analyze`", replace=True, flag="--json"):
            pass
    message = str(info.value)
    assert "\n" not in message and f"--json {target}" in message and "another file" in message


def test_a_claim_killed_with_its_process_frees_the_file(claimed):
    target, process = claimed
    process.send_signal(signal.SIGKILL)
    process.wait()
    safe_io.write_json(target, {"mine": 1}, replace=True)  # the kernel released the lock
    assert json.loads(target.read_text()) == {"mine": 1}
    assert no_leftovers(target.parent) == []


def test_a_claimer_writes_its_own_file_as_often_as_it_likes(tmp_path):
    target = tmp_path / "bench.json"
    with safe_io.claim_output(target, "`bench`", replace=False):
        for rows in range(3):  # bench rewrites its file as each row comes in
            safe_io.write_json(target, {"rows": rows}, replace=True)
        assert (tmp_path / ".bench.json.lock").is_file()
    assert json.loads(target.read_text()) == {"rows": 2}
    assert no_leftovers(tmp_path) == []


def test_a_file_that_appeared_before_the_claim_is_not_overwritten(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("someone else's")
    with pytest.raises(safe_io.UnsafeWrite, match="already exists"):
        with safe_io.claim_output(target, "`train`", replace=False):
            pass
    assert target.read_text() == "someone else's"


def test_a_lock_name_that_is_a_link_is_refused_and_its_target_kept(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("mine")
    safe_io.lock_for(tmp_path / "r.json").symlink_to(victim)
    with pytest.raises(safe_io.WriteFailed, match="is a link, where the course keeps its lock"):
        safe_io.write_json(tmp_path / "r.json", {"x": 1}, replace=True)
    assert victim.read_text() == "mine" and not (tmp_path / "r.json").exists()


def test_a_lock_name_that_is_a_fifo_is_refused_at_once(tmp_path):
    os.mkfifo(safe_io.lock_for(tmp_path / "r.json"))
    with pytest.raises(safe_io.WriteFailed, match="is not a plain file"):
        safe_io.write_json(tmp_path / "r.json", {"x": 1}, replace=True)


@pytest.mark.parametrize("dangling", [False, True])
def test_a_result_name_that_is_a_link_is_refused_and_both_kept(tmp_path, dangling):
    elsewhere = tmp_path / "elsewhere.json"
    if not dangling:
        elsewhere.write_text("kept")
    link = tmp_path / "r.json"
    link.symlink_to(elsewhere)
    with pytest.raises(safe_io.UnsafeWrite) as info:
        safe_io.write_json(link, {"x": 1}, replace=True)
    assert "\n" not in str(info.value) and "is a link" in str(info.value)
    assert link.is_symlink() and (dangling or elsewhere.read_text() == "kept")


def test_a_result_name_that_became_a_link_during_the_write_is_left_alone(tmp_path, monkeypatch):
    target = tmp_path / "r.json"
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("kept")
    real_fsync = safe_io.os.fsync

    def fsync_then_link(fd):
        real_fsync(fd)
        if not target.is_symlink():
            target.symlink_to(elsewhere)

    monkeypatch.setattr(safe_io.os, "fsync", fsync_then_link)
    with pytest.raises(safe_io.UnsafeWrite, match="became a link"):
        safe_io.write_json(target, {"x": 1}, replace=True)
    assert target.is_symlink() and elsewhere.read_text() == "kept"


# ---------------------------------------------------------------------------------------------
# The command line: the second command stops before its work

@pytest.mark.parametrize("argv", [
    ["analyze", "tiny", "--no-sweep", "--json", "{out}", "--replace"],
    ["bench", "--merge", "{part}", "--out", "{out}", "--replace"],
    ["train", "--preset", "tiny", "--json", "{out}", "--replace"],
    ["speed-of-light", "--preset", "tiny", "--out", "{out}", "--replace"],
    ["validate", "--out", "{out}", "--replace"],
    ["blackwell-dry-run", "--out", "{out}", "--replace"],
])
def test_a_second_command_writing_a_claimed_file_stops_before_its_work(claimed, capsys, no_work,
                                                                        argv):
    target, process = claimed
    part = target.with_name("part.json")
    part.write_text(json.dumps({"environment": {}, "results": []}))
    argv = [a.format(out=target, part=part) for a in argv]
    one_line_error(capsys, argv, "is being written by `bench`", f"pid {process.pid}",
                   "choose another file name")
    assert capsys.readouterr().out == ""  # nothing ran: no report, no "wrote"
    assert json.loads(target.read_text()) == {"earlier": True}


@pytest.mark.slow
def test_two_concurrent_commands_writing_one_file_leave_one_result_and_one_refusal(tmp_path):
    """Run together, one writes the file and the other stops in one line: refused while the
    first runs (`being written`), or, if the first finished already, refused the file it left
    (`already exists`). Never two "wrote" lines and one lost result."""
    target = tmp_path / "report.json"
    command = [sys.executable, "-m", "moe_tutorial", "analyze", "tiny", "--no-sweep", "--json",
               str(target)]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=ROOT) for _ in range(2)]
    results = sorted((run.wait(timeout=120), *run.communicate()) for run in runs)
    (ok, out, _), (refused, _, err) = results
    assert (ok, refused) == (0, 2), results
    assert f"wrote {target}" in out
    assert len(err.strip().splitlines()) == 1 and ("being written" in err or "already exists"
                                                   in err), err
    assert json.loads(target.read_text())["model"]
    assert no_leftovers(tmp_path) == []


def test_train_json_that_is_a_link_is_refused_before_training(tmp_path, capsys, no_work):
    elsewhere = tmp_path / "mine.json"
    elsewhere.write_text("mine")
    (tmp_path / "r.json").symlink_to(elsewhere)
    one_line_error(capsys, ["train", "--json", str(tmp_path / "r.json"), "--replace"],
                   "is a link", "remove the link")
    assert elsewhere.read_text() == "mine"


@pytest.mark.parametrize("flag", [["train", "--json"], ["analyze", "tiny", "--json"],
                                  ["bench", "--out"], ["validate", "--out"]])
def test_an_empty_result_name_is_refused(capsys, no_work, flag):
    one_line_error(capsys, [*flag, ""], "is empty", "leave the flag out")


@pytest.mark.parametrize("seed", ["18446744073709551616", "-1", str(10**40)])
def test_train_seed_outside_torchs_range_is_refused_before_training(capsys, no_work, seed):
    one_line_error(capsys, ["train", "--seed", seed], "--seed", "2**64 - 1")


def test_the_largest_seed_torch_takes_is_accepted(capsys, no_work):
    with pytest.raises(WorkStarted):
        main(["train", "--seed", str(2**64 - 1)])


# ---------------------------------------------------------------------------------------------
# Stdout that closes early, or cannot encode

class ClosedPipe(io.StringIO):
    """A stdout whose reader went away (`| head`): every write fails as a closed pipe does."""

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self):
        raise io.UnsupportedOperation("no descriptor")


def test_a_closed_stdout_loses_no_result_and_says_so_once(tmp_path, monkeypatch, capsys):
    target = tmp_path / "report.json"
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["analyze", "tiny", "--no-sweep", "--json", str(target)]) == 0
    assert json.loads(target.read_text())["model"]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stopped being read" in err[0] and "wrote its files" in err[0]
    assert isinstance(sys.stdout, ClosedPipe)  # main leaves stdout as it found it


def test_an_ascii_only_stdout_prints_what_it_can_and_writes_the_result(tmp_path, monkeypatch):
    target = tmp_path / "report.json"
    ascii_out = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", ascii_out)
    assert main(["analyze", "tiny", "--no-sweep", "--json", str(target)]) == 0
    ascii_out.flush()
    assert json.loads(target.read_text())["model"]
    assert f"wrote {target}" in ascii_out.buffer.getvalue().decode("ascii")


@pytest.mark.slow
def test_train_writes_its_json_even_when_nothing_reads_what_it_prints(tmp_path, monkeypatch,
                                                                      capsys):
    from moe_tutorial.train import loop

    target = tmp_path / "train.json"
    monkeypatch.setattr(loop, "evaluate", lambda *args, **kwargs: 3.0)  # not the lesson here
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["train", "--preset", "tiny", "--steps", "2", "--batch-size", "2", "--json",
                 str(target)]) == 0
    assert len(json.loads(target.read_text())["history"]) == 2
    assert "stopped being read" in capsys.readouterr().err


def test_a_command_that_fails_leaves_no_folder_made_for_its_result(tmp_path, capsys):
    target = tmp_path / "new" / "deeper" / "dry_run.json"
    assert main(["blackwell-dry-run", "--out", str(target)]) == 2  # no TE or GPU here
    assert "blackwell-dry-run:" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_a_result_in_a_new_folder_is_written_there(tmp_path, capsys):
    target = tmp_path / "new" / "report.json"
    assert main(["analyze", "tiny", "--no-sweep", "--json", str(target)]) == 0
    assert json.loads(target.read_text())["model"] and no_leftovers(target.parent) == []


# ---------------------------------------------------------------------------------------------
# The benchmark matrix and train_dist: their --out is claimed before the first run

def test_a_matrix_writing_a_claimed_file_stops_before_its_first_run(claimed, monkeypatch,
                                                                    capsys):
    from benchmarks import matrix

    def work(*args, **kwargs):
        raise WorkStarted

    monkeypatch.setattr(matrix, "run_matrix", work)
    target, process = claimed
    with pytest.raises(SystemExit) as exit:
        matrix.main(["--gpus", "2", "--preset", "tiny", "--backend", "grouped_torch", "--out",
                     str(target), "--replace"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(err) == 1, err
    assert "is being written by `bench`" in err[0] and f"pid {process.pid}" in err[0]
    assert json.loads(target.read_text()) == {"earlier": True}


def test_the_matrix_holds_its_out_file_until_it_ends(tmp_path, monkeypatch):
    from benchmarks import matrix

    target = tmp_path / "new" / "matrix.json"

    def work(*args, **kwargs):  # a second writer while the runs go on is refused, naming it
        with pytest.raises(safe_io.FileBusy, match="being written by `benchmarks.matrix`"):
            with safe_io.claim_output(target, "`bench`", replace=True):
                pass
        raise WorkStarted

    monkeypatch.setattr(matrix, "run_matrix", work)
    with pytest.raises(WorkStarted):
        matrix.main(["--gpus", "2", "--preset", "tiny", "--backend", "grouped_torch", "--out",
                     str(target)])
    assert not (tmp_path / "new").exists()  # the claim is released; no report, no folder made


def _claim_out_on_this_rank(out: str) -> bool:
    from moe_tutorial.perf import train_dist

    with contextlib.ExitStack() as claim:
        return train_dist.claim_out(train_dist.parse_args(["--out", out], check=False), claim)


def test_every_train_dist_rank_stops_when_rank_0_cannot_claim_its_out(claimed):
    from moe_tutorial.parallel import ranks

    target, _ = claimed
    assert ranks.run(_claim_out_on_this_rank, 2, str(target), timeout_s=60) == [True, True]
    free = target.with_name("free.json")
    assert ranks.run(_claim_out_on_this_rank, 2, str(free), timeout_s=60) == [False, False]
    assert not safe_io.lock_for(free).exists() and not free.exists()  # released, unwritten


@pytest.mark.slow
def test_train_dist_writing_a_claimed_file_stops_every_rank_before_its_work(claimed):
    from moe_tutorial.perf import train_dist

    target, process = claimed
    run = subprocess.run(train_dist.torchrun_command(2, "--mode", "check", "--out", str(target)),
                         capture_output=True, text=True, timeout=180, cwd=ROOT)
    output = run.stdout + run.stderr
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert run.returncode != 0 and len(errors) == 1, output  # from rank 0 alone
    assert "is being written by `bench`" in errors[0] and f"pid {process.pid}" in errors[0]
    assert "RESULT" not in output  # no rank did its work
    assert json.loads(target.read_text()) == {"earlier": True}
