import json
import subprocess
import sys

from moe_tutorial.cli import main


def test_info_prints_the_capability_table(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "TE GroupedLinear" in out and "fused CuTe-DSL grouped MLP" in out


def test_info_lists_what_every_chapter_runs_on_a_cpu_machine(capsys, monkeypatch):
    from moe_tutorial.precision import hardware

    cpu = hardware.evaluate(hardware.fake_environment("cpu"))
    monkeypatch.setattr(hardware, "capabilities", lambda import_te=True: cpu)
    assert main(["info"]) == 0
    out = capsys.readouterr().out.split("What each chapter runs on this machine:\n")[1]
    rows = dict(line.split(None, 1) for line in out.splitlines())
    assert list(rows) == list(hardware.CHAPTER_FEATURES)  # every chapter, in order
    assert rows["01_naive_moe"] == "plain PyTorch: runs as written"
    assert "native" not in out  # a CPU runs no chapter's GPU path natively
    assert "gloo" in rows["07_expert_parallel"] and "emulated" in rows["04_fp8_training"]


def test_info_json(capsys):
    assert main(["info", "--json", "--no-te"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"environment", "features"}
    assert data["features"]["grouped_mm"]["status"] in ("native", "fallback")


def test_module_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "moe_tutorial", "info"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "feature" in result.stdout


def test_train_command_on_tiny_preset(tmp_path, capsys):
    out_file = tmp_path / "history.json"
    assert main(["train", "--preset", "tiny", "--steps", "6", "--batch-size", "4",
                 "--json", str(out_file)]) == 0
    printed = capsys.readouterr().out
    assert "validation loss" in printed and "unigram baseline" in printed
    history = json.loads(out_file.read_text())["history"]
    assert len(history) == 6 and "val_loss" in history[-1]
