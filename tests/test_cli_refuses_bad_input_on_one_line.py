"""Bad and unusual input to the command line, the data reader and the training settings, one case
each, as a new user would type it. Each case asserts the right result, or a refusal that names the
bad value (or field) and says how to fix it — before any work starts, on one line `error: ...`
with exit status 2 for the command line. No case trains or benchmarks: the work itself is
replaced by a stand-in that fails the case if it is reached."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest
import torch

from moe_tutorial.cli import main
from moe_tutorial.perf import bench
from moe_tutorial.train import checkpoint, data
from moe_tutorial.train.data import FastaFormatError, ProteinTokenizer
from moe_tutorial.train.loop import TrainSettings

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")


class WorkStarted(Exception):
    """The command got past its checks and started its real work."""


@pytest.fixture(autouse=True)
def no_work(monkeypatch):
    """Loading the training data or running the benchmark ends the case: a refusal must come
    before either."""
    def work(*args, **kwargs):
        raise WorkStarted

    monkeypatch.setattr(data, "load_protein_data", work)
    monkeypatch.setattr(bench, "run", work)


def refused(capsys, argv: list[str], *words: str) -> str:
    """Run the command line in-process: it must refuse `argv` with exit status 2 and one line
    `error: ...` on stderr containing every one of `words`; returns that line."""
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's own refusals
        code = exit.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def started(argv: list[str]) -> None:
    """The command accepts `argv`: it gets as far as its real work."""
    with pytest.raises(WorkStarted):
        main(argv)


@pytest.fixture
def earlier(tmp_path):
    """An earlier run's result, which no command may replace unasked."""
    path = tmp_path / "earlier.json"
    path.write_text('{"val_loss_final": 2.88}')
    return path


# --- train: every argument refused before the data is loaded -----------------------------------

TRAIN_CASES = {
    "steps 0": (["--steps", "0"], ["steps=0", ">= 1"]),
    "steps negative": (["--steps", "-5"], ["steps=-5", ">= 1"]),
    "steps not a number": (["--steps", "many"], ["--steps", "'many'"]),
    "batch size 0": (["--batch-size", "0"], ["--batch-size=0", ">= 1"]),
    "lr negative": (["--lr", "-1"], ["lr=-1.0", "> 0"]),
    "lr nan": (["--lr", "nan"], ["lr=nan", "finite number > 0"]),
    "lr inf": (["--lr", "inf"], ["lr=inf", "finite number > 0"]),
    "unknown preset": (["--preset", "nope"], ["'nope'", "choose one of", "'tiny'"]),
    "unknown backend": (["--backend", "nope"], ["--backend 'nope'", "grouped_torch"]),
    "device not a device": (["--device", "gpu"], ["--device 'gpu'", "give cpu or cuda"]),
    "device not cpu or cuda": (["--device", "meta"], ["--device 'meta'", "cpu or cuda"]),
    "a course mode (train's flags say what runs)": (["--mode", "full"], ["--mode"]),
    "checkpoint every 0": (["--checkpoint-dir", "ckpt", "--checkpoint-every", "0"],
                           ["every=0", ">= 1"]),
    "keep 0 checkpoints": (["--checkpoint-dir", "ckpt", "--keep-checkpoints", "0"],
                           ["--keep-checkpoints=0", ">= 1"]),
    "resume without a directory": (["--resume"], ["--resume needs --checkpoint-dir"]),
    "unknown flag": (["--stpes", "10"], ["--stpes", "--help"]),
}


@pytest.mark.parametrize("flags, words", TRAIN_CASES.values(), ids=TRAIN_CASES)
def test_train_refuses_before_loading_data(capsys, tmp_path, monkeypatch, flags, words):
    monkeypatch.chdir(tmp_path)
    refused(capsys, ["train", "--preset", "tiny", *flags], *words)


@NO_GPU
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_train_refuses_a_gpu_this_machine_lacks(capsys, device):
    refused(capsys, ["train", "--device", device], f"--device {device!r}", "no CUDA GPU",
            "--device cpu")


def test_train_json_in_a_missing_directory_is_refused_before_training(capsys, tmp_path):
    missing = tmp_path / "no" / "such" / "dir" / "x.json"
    refused(capsys, ["train", "--json", str(missing)], str(missing.parent), "does not exist",
            "create it")


def test_train_json_under_a_file_is_refused(capsys, earlier):
    refused(capsys, ["train", "--json", str(earlier / "x.json")], "is a file", "another path")


def test_train_json_that_is_a_directory_is_refused(capsys, tmp_path):
    refused(capsys, ["train", "--json", str(tmp_path)], "is a directory", "file name")


def test_train_does_not_overwrite_an_earlier_result(capsys, earlier):
    refused(capsys, ["train", "--json", str(earlier)], str(earlier), "already exists",
            "--replace")
    assert earlier.read_text() == '{"val_loss_final": 2.88}'


def test_train_replaces_when_asked(earlier):
    started(["train", "--json", str(earlier), "--replace"])


def test_train_does_not_start_over_an_earlier_runs_checkpoints(capsys, tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for step in (50, 100):
        checkpoint.path_for(directory, step).write_bytes(b"an earlier run's checkpoint")
    refused(capsys, ["train", "--checkpoint-dir", str(directory)], "[50, 100]", "--resume",
            "another directory")
    assert checkpoint.saved_steps(directory) == [50, 100]
    started(["train", "--checkpoint-dir", str(directory), "--resume"])


def test_train_checkpoint_dir_that_is_a_file_is_refused(capsys, earlier):
    refused(capsys, ["train", "--checkpoint-dir", str(earlier)], "is a file", "another path")


def test_train_good_arguments_reach_the_work(tmp_path):
    started(["train", "--preset", "tiny", "--steps", "3", "--json",
             str(tmp_path / "new.json"), "--checkpoint-dir", str(tmp_path / "new")])


def test_train_batch_larger_than_the_data_is_refused_before_training(capsys, monkeypatch,
                                                                     small_fasta):
    """How many windows the data has is known once it is loaded: refused then, not in the loop."""
    monkeypatch.undo()  # the real loader, reading a small file
    real = data.load_protein_data
    monkeypatch.setattr(data, "load_protein_data",
                        lambda seq_len, seed: real(seq_len, seed=seed, path=small_fasta))
    monkeypatch.setattr("moe_tutorial.moe.model.MoEForCausalLM", lambda *a, **k: pytest.fail("built"))
    refused(capsys, ["train", "--preset", "tiny", "--batch-size", "1000"], "--batch-size 1000",
            "choose at most")


def test_a_valueerror_during_the_work_keeps_its_traceback(monkeypatch):
    """Only the checks' errors are the user's: one raised by the work is a bug, shown whole."""
    def broken(*args, **kwargs):
        raise ValueError("a bug in the package")

    monkeypatch.setattr(data, "load_protein_data", broken)
    with pytest.raises(ValueError, match="a bug in the package"):
        main(["train", "--preset", "tiny"])


# --- bench: every argument refused before the benchmark starts ---------------------------------

BENCH_CASES = {
    "batch 0": (["--batch", "0"], ["batch=0", ">= 1"]),
    "seq len 0": (["--seq-len", "0"], ["--seq-len=0", ">= 1"]),
    "seq len beyond the model": (["--preset", "tiny", "--seq-len", "4096"],
                                 ["seq_len=4096", "max_seq_len=64"]),
    "warmup negative": (["--warmup", "-1"], ["warmup=-1", ">= 0"]),
    "iters 0": (["--iters", "0"], ["iters=0", ">= 1"]),
    "iters not a number": (["--iters", "few"], ["--iters", "'few'"]),
    "unknown shape": (["--shapes", "tiny", "nope"], ["'nope'", "mixtral, fine_grained"]),
    "unknown routing": (["--routings", "nope"], ["'nope'", "balanced, skewed"]),
    "unknown train variant": (["--train-variants", "nope"], ["'nope'", "hf_eager"]),
    "unknown profile variant": (["--profile", "nope"], ["'nope'", "hf_eager"]),
    "unknown preset": (["--preset", "nope"], ["'nope'", "choose one of"]),
    "device not a device": (["--device", "gpu"], ["--device 'gpu'", "give cpu or cuda"]),
    "unknown optimizer": (["--optimizer", "sgd"], ["'sgd'", "torch_adamw"]),
}


@pytest.mark.parametrize("flags, words", BENCH_CASES.values(), ids=BENCH_CASES)
def test_bench_refuses_before_measuring(capsys, flags, words):
    refused(capsys, ["bench", *flags], *words)


@NO_GPU
def test_bench_refuses_a_gpu_this_machine_lacks(capsys):
    refused(capsys, ["bench", "--device", "cuda"], "no CUDA GPU", "--device cpu")


def test_bench_does_not_overwrite_an_earlier_result(capsys, earlier):
    refused(capsys, ["bench", "--out", str(earlier)], "already exists", "--replace")
    assert earlier.read_text() == '{"val_loss_final": 2.88}'
    started(["bench", "--out", str(earlier), "--replace"])


def test_bench_out_under_a_file_is_refused(capsys, earlier):
    refused(capsys, ["bench", "--out", str(earlier / "sub" / "x.json")], "is a file")


def test_bench_out_in_a_new_directory_is_made(tmp_path):
    """`--out` makes its directory (results/<machine>/ of a new run): kept as it was."""
    started(["bench", "--out", str(tmp_path / "new" / "h200.json")])


@pytest.mark.parametrize("bad, words", [({"batch": 0}, "batch=0 must be an integer >= 1"),
                                        ({"seq_len": 0}, "seq_len=0 must be an integer >= 1"),
                                        ({"warmup": -1}, "warmup=-1 must be an integer >= 0"),
                                        ({"shapes": ["nope"]}, "unknown expert shape 'nope'")])
def test_bench_run_refuses_before_measuring(monkeypatch, bad, words):
    """`bench.run` itself, called from Python, refuses what it used to replace by its default
    (0) or pass on (-1), before it measures anything."""
    monkeypatch.undo()  # the real `run`
    monkeypatch.setattr(bench.summary, "environment", lambda: pytest.fail("measuring started"))
    with pytest.raises(ValueError, match=words):
        bench.run(device="cpu", **bad)


MERGE_CASES = {
    "missing part": (lambda tmp: [str(tmp / "nope.json")], ["nope.json", "cannot read"]),
    "not JSON": (lambda tmp: [str(tmp / "notes.txt")], ["notes.txt", "JSON", "bench --out"]),
    "not a report": (lambda tmp: [str(tmp / "other.json")], ["other.json", "not a `bench --out`"]),
    "other environment": (lambda tmp: [str(tmp / "a.json"), str(tmp / "b.json")],
                          ["different environments", "torch"]),
    "one file twice": (lambda tmp: [str(tmp / "c.json"), str(tmp / "c.json")],
                       ["the same run given twice"]),
}


@pytest.mark.parametrize("parts, words", MERGE_CASES.values(), ids=MERGE_CASES)
def test_bench_merge_names_the_bad_part(capsys, tmp_path, parts, words):
    (tmp_path / "notes.txt").write_text("not json")
    (tmp_path / "other.json").write_text('{"history": []}')
    for name, torch_version in (("a", "2.13"), ("b", "2.11")):
        report = {"environment": {"torch": torch_version}, "results": [], "complete": True}
        (tmp_path / f"{name}.json").write_text(json.dumps(report))
    one_row = {"environment": {"torch": "2.13"}, "complete": True,
               "results": [{"part": "train", "variant": "hf_eager", "status": "ok", "tokens_per_s": 1.0}]}
    (tmp_path / "c.json").write_text(json.dumps(one_row))
    refused(capsys, ["bench", "--merge", *parts(tmp_path)], *words)


def test_bench_merge_does_not_overwrite_unasked(capsys, tmp_path, earlier):
    part = tmp_path / "part.json"
    part.write_text(json.dumps({"environment": {"torch": "2.13"}, "results": []}))
    refused(capsys, ["bench", "--merge", str(part), "--out", str(earlier)], "--replace")
    assert earlier.read_text() == '{"val_loss_final": 2.88}'
    assert main(["bench", "--merge", str(part), "--out", str(earlier), "--replace"]) == 0
    assert json.loads(earlier.read_text())["complete"] is True


# --- the command line as a whole ----------------------------------------------------------------

CLI_CASES = {
    "no command": ([], ["required", "command"]),
    "misspelt command": (["trian"], ["'trian'", "train"]),
    "info unknown flag": (["info", "--jsn"], ["--jsn", "--help"]),
    "info extra argument": (["info", "table"], ["table", "--help"]),
}


@pytest.mark.parametrize("argv, words", CLI_CASES.values(), ids=CLI_CASES)
def test_command_line_mistakes_are_one_line(capsys, argv, words):
    refused(capsys, argv, *words)


def test_one_line_and_no_traceback_in_a_real_process(tmp_path):
    result = subprocess.run([sys.executable, "-m", "moe_tutorial", "train", "--steps", "0"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path,
                            check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: --steps=0 must be an integer >= 1"]
    assert result.stdout == ""


# --- the FASTA reader --------------------------------------------------------------------------

RECORDS = [("a", "MKV"), ("b", "ACD")]  # header, sequence


def fasta(tmp_path, content: bytes, name: str = "x.fa"):
    path = tmp_path / name
    path.write_bytes(content)
    return path


READ_CASES = {
    "UTF-8 byte-order mark": b"\xef\xbb\xbf>a\nMKV\n>b\nACD\n",
    "CRLF line endings": b">a\r\nMKV\r\n>b\r\nACD\r\n",
    "byte-order mark and CRLF": b"\xef\xbb\xbf>a\r\nMKV\r\n>b\r\nACD\r\n",
    "no newline at the end": b">a\nMKV\n>b\nACD",
    "tabs and blank lines": b">a\n\tMK V\n\n>b\nACD\n\n",
}


@pytest.mark.parametrize("content", READ_CASES.values(), ids=READ_CASES)
def test_fasta_variants_read_right(tmp_path, content):
    records = data.read_fasta(fasta(tmp_path, content))
    assert [(record.header, record.sequence) for record in records] == RECORDS


def test_fasta_with_a_byte_order_mark_gzipped(tmp_path):
    path = fasta(tmp_path, gzip.compress(b"\xef\xbb\xbf>a\nMKV\n>b\nACD\n"), "x.fa.gz")
    assert data.load_sequences(path) == ["MKV", "ACD"]


def test_lower_case_is_read_as_upper_case(tmp_path):
    path = fasta(tmp_path, b">a\nmkv\n>b\nAcD\n")
    tokenizer = ProteinTokenizer()
    assert [tokenizer.decode(tokenizer.encode(s)) for s in data.load_sequences(path)] == \
           ["MKV", "ACD"]


FASTA_ERRORS = {
    "empty file": (b"", None, ["empty file", "no FASTA records"]),
    "header without sequence": (b">a\nMKV\n>b\n>c\nACD\n", 3, ["'>b'", "no sequence"]),
    "unknown letter": (b">a\nMKV\n>b\nAC1D\n", 3, ["'1'", "ACDEFGHIKLMNPQRSTVWY"]),
    "sequence before any header": (b"MKV\n>a\nMKV\n", 1, ["expected a '>' header"]),
    # not at the start of the file: a character inside record a's sequence, named as such
    "a byte-order mark inside": (b">a\nMKV\n\xef\xbb\xbf>b\nACD\n", 1, ["'\\ufeff'", "'>a'"]),
}


@pytest.mark.parametrize("content, line, words", FASTA_ERRORS.values(), ids=FASTA_ERRORS)
def test_fasta_errors_name_file_and_line(tmp_path, content, line, words):
    path = fasta(tmp_path, content)
    with pytest.raises(FastaFormatError) as error:
        data.load_sequences(path)
    message = str(error.value)
    assert str(path) in message and all(word in message for word in words), message
    if line is not None:
        assert f"line {line}:" in message


# --- sizes given to the data functions ---------------------------------------------------------

@pytest.fixture
def small_fasta(tmp_path):
    return fasta(tmp_path, "".join(f">s{i}\n{'MKVL' * (i % 5 + 2)}\n"
                                   for i in range(200)).encode())


SIZE_CASES = {
    "seq_len not an integer": ({"seq_len": 2.5}, "seq_len=2.5"),
    "seq_len a string": ({"seq_len": "64"}, "seq_len='64'"),
    "seq_len 0": ({"seq_len": 0}, "seq_len=0"),
    "seq_len negative": ({"seq_len": -8}, "seq_len=-8"),
    "max_sequences negative": ({"max_sequences": -3}, "max_sequences=-3"),
    "max_sequences 0": ({"max_sequences": 0}, "max_sequences=0"),
    "max_sequences not an integer": ({"max_sequences": 2.5}, "max_sequences=2.5"),
}


@pytest.mark.parametrize("bad, words", SIZE_CASES.values(), ids=SIZE_CASES)
def test_load_protein_data_refuses_bad_sizes(monkeypatch, small_fasta, bad, words):
    monkeypatch.undo()  # the real loader
    arguments = {"seq_len": 16, "path": small_fasta} | bad
    with pytest.raises(ValueError, match=rf"{words} must be an integer >= 1"):
        data.load_protein_data(**arguments)


def test_max_sequences_keeps_that_many(monkeypatch, small_fasta):
    monkeypatch.undo()
    assert data.load_protein_data(16, path=small_fasta, max_sequences=40).num_sequences == 40


@pytest.mark.parametrize("bad, words", [({"min_length": 0}, "min_length=0 must be"),
                                        ({"min_length": 2.5}, "min_length=2.5 must be"),
                                        ({"on_invalid": "ignore"}, "'raise' or 'skip'")])
def test_load_sequences_refuses_bad_options(small_fasta, bad, words):
    with pytest.raises(ValueError, match=words):
        data.load_sequences(small_fasta, **bad)


def test_packing_and_batches_refuse_fractions():
    with pytest.raises(ValueError, match=r"seq_len=2.5 must be an integer >= 1"):
        data.pack_sequences(["MKV" * 10], 2.5)
    packed = data.pack_sequences(["MKV" * 10], 4)
    with pytest.raises(ValueError, match=r"batch_size=1.5 must be an integer >= 1"):
        next(data.iterate_batches(packed, 1.5))


# --- training settings -------------------------------------------------------------------------

SETTINGS_CASES = {
    "steps a fraction": ({"steps": 2.5}, "steps=2.5 must be an integer >= 1"),
    "steps a bool": ({"steps": True}, "steps=True must be an integer"),
    "eval_every negative": ({"eval_every": -1}, "eval_every=-1 must be an integer >= 0"),
    "seed a fraction": ({"seed": 1.5}, "seed=1.5 must be an integer"),
    "lr infinite": ({"lr": float("inf")}, "lr=inf must be a finite number > 0"),
    "grad_clip 0": ({"grad_clip": 0.0}, r"grad_clip=0.0 must be .* or None"),
    "betas of 1": ({"betas": (1.0, 0.95)}, r"betas=\(1.0, 0.95\) must be two numbers in \[0, 1\)"),
    "weight_decay negative": ({"weight_decay": -0.1}, "weight_decay=-0.1 must be a finite"),
}


@pytest.mark.parametrize("bad, words", SETTINGS_CASES.values(), ids=SETTINGS_CASES)
def test_train_settings_refuse_what_would_fail_later(bad, words):
    with pytest.raises(ValueError, match=words):
        TrainSettings(**bad)
