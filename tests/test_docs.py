"""The README's measured numbers agree with benchmarks/results/ (moe_tutorial.docs)."""

import copy
import re

import pytest

from moe_tutorial import docs
from moe_tutorial.__main__ import main


def _region(text: str, name: str) -> re.Match:
    return next(m for m in docs._REGION.finditer(text) if m["name"] == name)


def test_the_committed_readme_agrees_with_the_results(capsys):
    assert main(["docs", "--check"]) == 0, capsys.readouterr().err


@pytest.fixture
def edited_readme(tmp_path):
    """A copy of the README with one number of the training-step table changed by hand."""
    text = docs.README.read_text()
    region = _region(text, "h200-train-step")
    number = re.search(r"\| (\d+\.\d) \|", region["body"])
    start = region.start("body") + number.start(1)
    edited = text[:start] + f"{float(number[1]) + 1:.1f}" + text[start + len(number[1]):]
    path = tmp_path / "README.md"
    path.write_text(edited)
    return path


def test_a_hand_edited_number_fails_the_check_and_names_its_region(edited_readme, capsys):
    assert main(["docs", "--check", "--readme", str(edited_readme)]) == 1
    err = capsys.readouterr().err
    assert "region 'h200-train-step' differs" in err
    assert err.count("differs from the results") == 1  # only the edited region


def test_docs_restores_the_edited_region(edited_readme):
    assert main(["docs", "--readme", str(edited_readme)]) == 0
    assert edited_readme.read_text() == docs.README.read_text()


def test_a_lost_region_is_an_error_not_a_silent_pass(tmp_path):
    text = docs.README.read_text()
    region = _region(text, "h200-targets")
    with pytest.raises(ValueError, match="'h200-targets' is missing"):
        docs.render(text[:region.start()] + text[region.end():])


def test_mfu_of_fp8_rows_uses_the_fp8_peak_when_the_run_recorded_one():
    old = docs._load("h200_cudnn_attention_rope.json")  # written before bench measured FP8 peaks
    fp8_rows = [r for r in old["results"] if r["part"] == "train" and r["variant"].endswith("_fp8")]
    assert "not measured" in docs.train_step_table(old)
    new = copy.deepcopy(old)
    new.update(dense_fp8_tflops_measured=1500.0, datasheet_fp8_tflops=2000.0)
    for row in new["results"]:
        if row["part"] == "train":
            row["precision"] = "fp8" if row["variant"].endswith("_fp8") else "bf16"
    table = docs.train_step_table(new)
    assert "not measured" not in table
    for row in fp8_rows:  # own-precision MFU against FP8, then against bf16 (measured / datasheet)
        own = f"{100 * row['tflops'] / 1500:.1f}% / {100 * row['tflops'] / 2000:.1f}%"
        bf16 = (f"{100 * row['tflops'] / old['dense_bf16_tflops_measured']:.1f}% / "
                f"{100 * row['tflops'] / old['datasheet_bf16_tflops']:.1f}%")
        assert f"| {own} | {bf16} |" in table
