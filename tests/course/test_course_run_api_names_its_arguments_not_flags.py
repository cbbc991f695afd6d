"""The course runner's Python API refuses bad arguments on one line naming the argument and its
fix as Python (`out_dir=`, `replace=True`, `parameters={...}`, `live=`, `device`), never the
command line's flags."""

from __future__ import annotations

from pathlib import Path

from refused_on_one_line import refused
from sized_notebooks import sized  # noqa: F401  (a fixture)

from moe_tutorial.course import runner

FLAGS = ("--out", "--replace", "-p ", "--cell-timeout", "--live", "--mode", "--device",
         "--notebooks")


def _api(notebooks, out="runs/mine", **kwargs):
    return lambda: runner.run_course(notebooks, Path(out), mode="small", **kwargs)


def test_api_names_replace_for_a_used_folder(sized):  # noqa: F811
    assert runner.run_course(sized, Path("runs/mine"), mode="small").ok
    message = refused(_api(sized), runner.RunError, "out_dir='runs/mine'", "replace=True",
                      absent=FLAGS)
    assert "not empty" in message


def test_api_names_out_dir_for_a_file(sized):  # noqa: F811
    Path("afile").write_text("mine")
    refused(_api(sized, "afile"), runner.RunError, "out_dir='afile' is a file",
            "e.g. out_dir='runs/mine'", absent=FLAGS)
    assert Path("afile").read_text() == "mine"


def test_api_names_out_dir_inside_the_course(sized):  # noqa: F811
    refused(_api(sized, "notebooks/mine"), runner.RunError, "out_dir='notebooks/mine'",
            absent=FLAGS)


def test_api_names_cell_timeout(sized):  # noqa: F811
    refused(_api(sized, cell_timeout=0), runner.RunError, "cell_timeout=0", "cell_timeout=300",
            absent=FLAGS)


def test_api_names_the_argument_that_sets_a_runner_parameter(sized):  # noqa: F811
    refused(_api(sized, parameters={"MODE": "full"}), runner.RunError,
            "parameters={'MODE': 'full'}", "mode='full'", absent=FLAGS)


def test_api_names_parameters_for_a_parameter_of_another_kind(sized):  # noqa: F811
    refused(_api(sized, parameters={"STEPS": 0.5}), runner.RunError,
            "parameters={'STEPS': 0.5}", "parameters={'STEPS': 0}", absent=FLAGS)


def test_api_names_parameters_for_an_unknown_parameter(sized):  # noqa: F811
    refused(_api(sized, parameters={"STEPZ": 5}), runner.RunError, "'STEPZ'", "STEPS",
            absent=FLAGS)


def test_api_refuses_parameters_that_are_not_a_mapping(sized):  # noqa: F811
    refused(_api(sized, parameters=[("STEPS", 5)]), runner.RunError, "NAME=VALUE",
            "parameters={'SEED': 1}")


def test_api_refuses_a_live_that_is_not_true_or_false(sized):  # noqa: F811
    refused(_api(sized, live="no"), runner.RunError, "live='no'", "live=True", absent=FLAGS)
    assert not Path("runs/mine").exists()


def test_api_names_the_device_argument(sized):  # noqa: F811
    refused(_api(sized, device="tpu"), runner.RunError, "device 'tpu'", absent=FLAGS)


def test_a_size_out_of_range_in_the_api_names_parameters(sized):  # noqa: F811
    refused(_api(sized, parameters={"STEPS": -3}), runner.RunError,
            "parameters={'STEPS': -3}: STEPS must be an integer >= 1", absent=FLAGS)
