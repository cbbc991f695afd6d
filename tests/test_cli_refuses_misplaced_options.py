"""Options that belong elsewhere, refused in one line that names them and what is taken instead:
a backend's option given to another backend, a seed torch cannot take, an empty path where a
command writes."""

import pytest

from moe_tutorial.moe.experts.registry import convert_experts, create
from moe_tutorial.perf import train_dist
from moe_tutorial.train.loop import TrainSettings


def one_line(exc) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_an_option_of_another_te_backend_is_refused_with_the_backends_own():
    experts = create("grouped_torch", 4, 16, 32)
    with pytest.raises(ValueError) as exc:
        convert_experts(experts, "te_grouped_linear", glu_interleave_size=32)
    message = one_line(exc)
    assert "'te_grouped_linear' takes no option glu_interleave_size" in message
    assert "align" in message and "cutlass" in message


def test_a_misspelt_option_is_refused_with_the_backends_own():
    experts = create("grouped_torch", 4, 16, 32)
    with pytest.raises(ValueError) as exc:
        convert_experts(experts, "te_ops", interleave=True)
    message = one_line(exc)
    assert "'te_ops' takes no option interleave" in message
    assert "glu_interleave_size" in message and "require_fused" in message


def test_each_te_backend_still_takes_its_own_options():
    experts = create("grouped_torch", 4, 16, 32)
    assert convert_experts(experts, "te_grouped_linear", cutlass=True).backend == "te_grouped_linear"
    assert convert_experts(experts, "te_ops", glu_interleave_size=32).glu_interleave_size == 32


@pytest.mark.parametrize("seed", [2**64, 2**70, -1])
def test_a_seed_torch_cannot_take_is_refused(seed):
    with pytest.raises(ValueError) as exc:
        TrainSettings(seed=seed)
    assert "outside [0, 2**64 - 1]" in one_line(exc)


def test_the_largest_seed_torch_takes_is_kept():
    assert TrainSettings(seed=2**64 - 1).seed == 2**64 - 1


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--out"])
def test_an_empty_path_for_the_distributed_run_is_refused(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        train_dist.parse_args(["--mode", "train", flag, ""], check=False)
    assert exc.value.code == 2
    assert f"{flag} is empty" in capsys.readouterr().err


def test_a_parameters_cell_that_is_not_python_is_refused_before_anything_runs(tmp_path):
    import json

    from moe_tutorial.course.run_inputs import RunError, check_parameters

    notebook = tmp_path / "01_mine.ipynb"
    cell = {"cell_type": "code", "metadata": {"tags": ["parameters"]}, "outputs": [],
            "execution_count": None, "source": "MODE = \"\"\nSTEPS = (3\n"}
    notebook.write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4,
                                    "nbformat_minor": 5}))
    with pytest.raises(RunError) as exc:
        check_parameters({}, [notebook])
    message = one_line(exc)
    assert "01_mine.ipynb: its parameters cell is not valid Python (line" in message
