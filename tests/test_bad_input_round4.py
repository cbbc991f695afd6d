"""A fourth probe of bad input, as a new user (and an unlucky one) would give it: the command
line, the Python API (which names its own arguments, never the command line's flags), the
notebooks' runner and builder, checkpoints, data and HF conversion. Each case asserts the right
outcome: nothing lost, nothing silently wrong, and a refusal on one line that names what was
wrong and how to fix it, never a traceback.

Every case runs in-process and small: no training step, no kernel (the runner's papermill is
replaced by `fast_papermill`), models of the tiny preset."""

from __future__ import annotations

import ast
import gzip
import json
import re
from pathlib import Path

import pytest
import torch
from course_helpers import WorkStarted, notebook, one_line_error, save_checkpoint

from moe_tutorial import safe_io
from moe_tutorial.cli import main
from moe_tutorial.course import exercise_build, lesson, run_inputs, runner
from moe_tutorial.moe.config import MoEConfig, preset
from moe_tutorial.moe.hf import from_hf, to_hf_state_dict
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.parallel import dist_checkpoint
from moe_tutorial.train import checkpoint, data
from moe_tutorial.train.checkpoint import CheckpointError, Checkpointing
from moe_tutorial.train.loop import TrainSettings, train

transformers = pytest.importorskip("transformers")


def refused(call, error=ValueError, *words: str, absent: tuple[str, ...] = ()) -> str:
    """`call()` raises `error` with one line holding every one of `words` and none of `absent`."""
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for word in words:
        assert word in message, message
    for word in absent:
        assert word not in message, message
    return message


FLAGS = ("--out", "--replace", "-p ", "--cell-timeout", "--live", "--mode", "--device",
         "--notebooks")


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return MoEForCausalLM(preset("tiny"))


# ---------------------------------------------------------------------------------------------
# The command line

@pytest.mark.parametrize("argv, words", [
    (["train", "--steps", "1.5"], ["--steps", "1.5"]),
    (["train", "--lr", "nan"], ["--lr=nan must be a finite number"]),
    (["train", "--backend", "nope"], ["--backend 'nope'", "grouped_torch"]),
    (["train", "--device", "tpu"], ["--device 'tpu'", "cpu or cuda"]),
    (["train", "--json", "nodir/x.json"], ["--json nodir/x.json", "does not exist"]),
    (["train", "--checkpoint-dir", "ck", "--checkpoint-every", "0"],
     ["--checkpoint-every=0 must be an integer >= 1"]),
    (["train", "--checkpoint-dir", "ck", "--keep-checkpoints", "0"],
     ["--keep-checkpoints=0 must be an integer >= 1"]),
    (["bench", "--iters", "0"], ["--iters=0 must be an integer >= 1"]),
    (["bench", "--warmup", "-1"], ["--warmup=-1 must be an integer >= 0"]),
    (["bench", "--layers", "0"], ["--layers=0 must be an integer >= 1"]),
    (["bench", "--batch", "0"], ["--batch=0 must be an integer >= 1"]),
    (["bench", "--merge", "missing.json"], ["--merge missing.json", "bench --out"]),
    (["analyze", "small", "--gpus", "0"], ["--gpus=0"]),
    (["speed-of-light", "--committed", "missing.json"], ["--committed missing.json"]),
    (["idle-gaps", "--variants", "nope"], ["'nope'"]),
    (["run", "--cell-timeout", "0", "--out", "r"], ["--cell-timeout 0", "--cell-timeout 300"]),
    (["run", "-p", "STEPS", "--out", "r"], ["NAME=VALUE"]),
])
def test_a_bad_flag_is_one_line_naming_the_flag(capsys, tmp_path, monkeypatch, no_work, argv,
                                                words):
    monkeypatch.chdir(tmp_path)
    one_line_error(capsys, argv, *words)


def test_blackwell_dry_run_keeps_an_earlier_result(capsys, tmp_path):
    earlier = tmp_path / "dry.json"
    earlier.write_text('{"summary": "earlier"}')
    one_line_error(capsys, ["blackwell-dry-run", "--out", str(earlier)], "--replace")
    assert earlier.read_text() == '{"summary": "earlier"}'


def test_validate_into_a_missing_folder_is_made_not_refused(capsys, tmp_path, monkeypatch):
    """The check passes (the folder is made when the report is written); the work is what fails
    here, one line at a time and without a traceback, on a machine without a GPU."""
    from moe_tutorial.perf import blackwell

    def validate():
        raise WorkStarted

    monkeypatch.setattr(blackwell, "validate", validate)
    with pytest.raises(WorkStarted):
        main(["validate", "--out", str(tmp_path / "new" / "report.json")])


# ---------------------------------------------------------------------------------------------
# The notebooks' runner: the API names its arguments, the command line its flags

def _sized_notebook(folder: Path) -> Path:
    """A notebook whose parameters the setup cell checks as sizes, as the chapters do."""
    return notebook(folder / "01_a.ipynb",
                    "from moe_tutorial.course.lesson import setup\n"
                    "DEFAULTS = {'small': dict(steps=60, sizes=[2, 4]), "
                    "'full': dict(steps=400, sizes=[2, 4, 8])}\n"
                    "SETUP = setup(MODE, DEVICE, DEFAULTS, steps=STEPS, sizes=list(SIZES))",
                    parameters="MODE = ''\nDEVICE = ''\nLIVE = False\nSTEPS = 0\nSIZES = []\nSEED = 0")


@pytest.fixture
def sized(fake_checkout, fast_papermill) -> list[Path]:
    return [_sized_notebook(fake_checkout / "notebooks")]


def _api(notebooks, out="runs/mine", **kwargs):
    return lambda: runner.run_course(notebooks, Path(out), mode="small", **kwargs)


def test_api_names_replace_for_a_used_folder(sized):
    assert runner.run_course(sized, Path("runs/mine"), mode="small").ok
    message = refused(_api(sized), runner.RunError, "out_dir='runs/mine'", "replace=True",
                      absent=FLAGS)
    assert "not empty" in message


def test_api_names_out_dir_for_a_file(sized):
    Path("afile").write_text("mine")
    refused(_api(sized, "afile"), runner.RunError, "out_dir='afile' is a file",
            "e.g. out_dir='runs/mine'", absent=FLAGS)
    assert Path("afile").read_text() == "mine"


def test_api_names_out_dir_inside_the_course(sized):
    refused(_api(sized, "notebooks/mine"), runner.RunError, "out_dir='notebooks/mine'",
            absent=FLAGS)


def test_api_names_cell_timeout(sized):
    refused(_api(sized, cell_timeout=0), runner.RunError, "cell_timeout=0", "cell_timeout=300",
            absent=FLAGS)


def test_api_names_the_argument_that_sets_a_runner_parameter(sized):
    refused(_api(sized, parameters={"MODE": "full"}), runner.RunError,
            "parameters={'MODE': 'full'}", "mode='full'", absent=FLAGS)


def test_api_names_parameters_for_a_parameter_of_another_kind(sized):
    refused(_api(sized, parameters={"STEPS": 0.5}), runner.RunError,
            "parameters={'STEPS': 0.5}", "parameters={'STEPS': 0}", absent=FLAGS)


def test_api_names_parameters_for_an_unknown_parameter(sized):
    refused(_api(sized, parameters={"STEPZ": 5}), runner.RunError, "'STEPZ'", "STEPS",
            absent=FLAGS)


def test_api_refuses_parameters_that_are_not_a_mapping(sized):
    refused(_api(sized, parameters=[("STEPS", 5)]), runner.RunError, "NAME=VALUE",
            "parameters={'SEED': 1}")


def test_api_refuses_a_live_that_is_not_true_or_false(sized):
    refused(_api(sized, live="no"), runner.RunError, "live='no'", "live=True", absent=FLAGS)
    assert not Path("runs/mine").exists()


def test_api_names_the_device_argument(sized):
    refused(_api(sized, device="tpu"), runner.RunError, "device 'tpu'", absent=FLAGS)


@pytest.mark.parametrize("param, words", [
    ("STEPS=-3", ["-p STEPS=-3: STEPS must be an integer >= 1", "-p STEPS=60",
                  "small mode's default 60"]),
    ("SIZES=[2, 0]", ["-p SIZES=[2, 0]: SIZES holds 0", "-p SIZES=[2, 4]"]),
])
def test_a_size_out_of_range_is_refused_before_any_notebook_runs(capsys, sized, param, words):
    one_line_error(capsys, ["run", "--mode", "small", "--out", "runs/mine", "-p", param], *words)
    assert not Path("runs/mine").exists()


def test_a_size_out_of_range_in_the_api_names_parameters(sized):
    refused(_api(sized, parameters={"STEPS": -3}), runner.RunError,
            "parameters={'STEPS': -3}: STEPS must be an integer >= 1", absent=FLAGS)


def test_a_size_in_range_and_an_empty_one_run(sized):
    assert runner.run_course(sized, Path("runs/a"), mode="small",
                             parameters={"STEPS": 5, "SIZES": [3]}).ok
    assert runner.run_course(sized, Path("runs/b"), mode="full", parameters={"STEPS": 0}).ok


def test_the_live_parameter_cannot_be_given_with_p(capsys, sized):
    one_line_error(capsys, ["run", "--out", "runs/mine", "-p", "LIVE=True"],
                   "LIVE is set by --live", "use --live")


def test_a_run_of_a_notebook_that_is_not_json_is_one_line(capsys, fake_checkout, fast_papermill):
    (fake_checkout / "notebooks" / "01_a.ipynb").write_text("{half a notebook")
    one_line_error(capsys, ["run", "--out", "runs/mine", "--notebooks", "01"],
                   "is not a readable notebook", "--notebooks")


def test_replace_never_overwrites_a_file_the_runner_did_not_write(capsys, sized):
    assert runner.run_course(sized, Path("runs/mine"), mode="small").ok
    manifest = Path("runs/mine") / run_inputs.RUN_MANIFEST
    made = json.loads(manifest.read_text())
    made["files"].remove("01_a.html")
    manifest.write_text(json.dumps(made))
    Path("runs/mine/01_a.html").write_text("my notes")
    one_line_error(capsys, ["run", "--out", "runs/mine", "--notebooks", "01", "--replace"],
                   "01_a.html", "did not write")
    assert Path("runs/mine/01_a.html").read_text() == "my notes"


# ---------------------------------------------------------------------------------------------
# The notebooks' setup cell: the LIVE parameter is checked as --live is

@pytest.mark.parametrize("live", ["no", 1, None])
def test_setup_checks_the_live_parameter(live):
    if live is None:
        assert lesson.setup("small", "cpu", live=None).mode == "small"
        return
    refused(lambda: lesson.setup("small", "cpu", live=live), ValueError,
            f"LIVE={live!r} is not True or False", "LIVE = True")


def test_setup_accepts_the_live_parameter_as_the_parameters_cell_reads_it(monkeypatch):
    monkeypatch.setenv("MOE_TUTORIAL_LIVE", "0")
    live = __import__("os").environ.get("MOE_TUTORIAL_LIVE", "1") not in ("0", "false")
    assert lesson.setup("small", "cpu", live=live).mode == "small"


def test_setup_refuses_a_live_setting_in_the_environment_with_the_flags_values(monkeypatch):
    monkeypatch.setenv("MOE_TUTORIAL_LIVE", "yes")
    refused(lambda: lesson.setup("small", "cpu", live=True), ValueError,
            "$MOE_TUTORIAL_LIVE='yes'", "always")


COURSE = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", sorted(
    p.relative_to(COURSE).as_posix() for folder in ("notebooks", "solutions", "exercises")
    for p in (COURSE / folder).glob("[0-9][0-9]_*.ipynb")))
def test_every_notebook_hands_its_live_parameter_to_setup(path):
    """A notebook's LIVE reaches setup, which checks it: LIVE = "no" would otherwise draw the
    live widgets (a non-empty string is true) without a word."""
    cells = [c for c in json.loads((COURSE / path).read_text())["cells"] if c["cell_type"] == "code"]
    source = "\n".join("".join(c["source"]) for c in cells)
    if not re.search(r"^LIVE = ", source, re.MULTILINE):
        pytest.skip("no LIVE parameter")
    calls = [node for cell in cells for node in ast.walk(ast.parse("".join(cell["source"])))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup"]
    assert calls, "no setup(...) call"
    for call in calls:
        live = [k.value for k in call.keywords if k.arg == "live"]
        assert [getattr(v, "id", None) for v in live] == ["LIVE"], ast.unparse(call)[:200]


# ---------------------------------------------------------------------------------------------
# The builder

SOLUTION = ("def double(x):\n    ### BEGIN SOLUTION\n    ### HINT: multiply by two\n"
            "    return 2 * x\n    ### END SOLUTION\n")


@pytest.fixture
def solutions(tmp_path) -> Path:
    folder = tmp_path / "solutions"
    folder.mkdir()
    notebook(folder / "01_router.ipynb", SOLUTION)
    return folder


def test_build_of_an_unclosed_solution_region_is_one_line(capsys, solutions, tmp_path):
    notebook(solutions / "02_open.ipynb",
             "def f():\n    ### BEGIN SOLUTION\n    ### HINT: one\n    return 1\n")
    one_line_error(capsys, ["build", "--solutions", str(solutions), "--exercises",
                            str(tmp_path / "exercises")], "02_open.ipynb", "never closed")
    assert not (tmp_path / "exercises" / "01_router.ipynb").exists()


def test_build_of_a_solution_that_is_not_json_is_one_line(capsys, solutions, tmp_path):
    (solutions / "02_bad.ipynb").write_text("{not json")
    one_line_error(capsys, ["build", "--solutions", str(solutions), "--exercises",
                            str(tmp_path / "exercises")], "02_bad.ipynb", "not valid notebook JSON")


def test_build_keeps_an_edited_exercise_and_says_how_to_replace_it(capsys, solutions, tmp_path):
    exercises = tmp_path / "exercises"
    assert main(["build", "--solutions", str(solutions), "--exercises", str(exercises)]) == 0
    edited = exercises / "01_router.ipynb"
    nb = json.loads(edited.read_text())
    nb["cells"][0]["source"] = "def double(x):\n    return x + x  # my answer\n"
    edited.write_text(json.dumps(nb))
    assert main(["build", "--solutions", str(solutions), "--exercises", str(exercises)]) == 1
    assert "--replace" in capsys.readouterr().err
    assert "my answer" in edited.read_text()


def test_build_api_names_its_arguments(solutions, tmp_path):
    refused(lambda: exercise_build.build_exercises(solutions, solutions / "ex"), exercise_build.BuildError,
            "exercises_dir=", absent=("--exercises",))
    edited = tmp_path / "exercises" / "01_router.ipynb"
    exercise_build.build_exercises(solutions, tmp_path / "exercises")
    edited.write_text(edited.read_text().replace("NotImplementedError", "NotImplementedError  #"))
    result = exercise_build.build_exercises(solutions, tmp_path / "exercises")
    assert result.refused and "replace=True" in result.refused[0], result.refused
    assert "--replace" not in result.refused[0]


# ---------------------------------------------------------------------------------------------
# Checkpoints

def test_a_checkpoint_of_another_format_is_refused_by_name(tmp_path):
    path = save_checkpoint(tmp_path, 2)
    state = torch.load(path, weights_only=True)
    state["format"] = checkpoint.FORMAT + 1
    with safe_io.atomic_file(path, replace=True) as f:
        writer = safe_io.HashingWriter(f)
        torch.save(state, writer)
    checkpoint.checksum_path(path).write_text(writer.digest.hexdigest() + "\n")
    refused(lambda: checkpoint.load_latest(tmp_path), CheckpointError, "format",
            "start a new run")


def test_a_step_file_that_is_no_checkpoint_is_refused_not_a_traceback(tmp_path):
    path = checkpoint.path_for(tmp_path, 4)
    torch.save([1, 2, 3], path)
    checkpoint.checksum_path(path).write_text(safe_io.sha256_of(path) + "\n")
    refused(lambda: checkpoint.load_latest(tmp_path), CheckpointError, str(path),
            "not a checkpoint")


def test_a_checksum_file_of_garbage_is_damage_naming_the_intact_one(tmp_path):
    save_checkpoint(tmp_path, 2)
    newest = save_checkpoint(tmp_path, 4)
    checkpoint.checksum_path(newest).write_text("garbage\n")
    refused(lambda: checkpoint.load_latest(tmp_path), CheckpointError, "step_00000004.pt",
            "damaged", "step_00000002.pt")


def test_a_leftover_temporary_file_is_not_a_checkpoint(tmp_path):
    (tmp_path / "step_00000002.pt.tmp").write_bytes(b"half")
    refused(lambda: checkpoint.load_latest(tmp_path), CheckpointError, "nothing to resume")


def test_keep_one_leaves_exactly_the_newest(tmp_path):
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, keep=1)
    assert checkpoint.saved_steps(tmp_path) == [6]


def test_resuming_with_another_model_names_the_fields(tmp_path):
    torch.manual_seed(0)
    model = MoEForCausalLM(preset("tiny"))
    windows = torch.randint(3, 24, (8, 17))
    settings = TrainSettings(steps=1, batch_size=2, warmup_steps=0, eval_every=0)
    train(model, windows, settings, checkpoint=Checkpointing(tmp_path, every=1), progress=False)
    wider = MoEForCausalLM(preset("tiny").with_overrides(num_experts=8))
    refused(lambda: train(wider, windows, settings, checkpoint=Checkpointing(tmp_path, every=1),
                          resume=True, progress=False),
            CheckpointError, "num_experts: checkpoint 4, now 8", absent=("--",))


@pytest.mark.parametrize("arguments, words", [
    (dict(every=0), ["every=0"]), (dict(keep=-1), ["keep=-1"]),
    (dict(directory=""), ["directory=''"])])
def test_sharded_checkpointing_arguments_are_checked(tmp_path, arguments, words):
    arguments = {"directory": tmp_path, "layout": None, **arguments}
    refused(lambda: dist_checkpoint.ShardedCheckpointing(**arguments), ValueError, *words)


def test_a_distributed_checkpoint_folder_without_checkpoints_is_one_line(tmp_path):
    refused(lambda: dist_checkpoint.verified_latest(tmp_path), CheckpointError, str(tmp_path))


def test_resume_without_a_checkpointing_is_one_line(tiny_model):
    refused(lambda: train(tiny_model, torch.randint(3, 24, (4, 9)), TrainSettings(steps=1,
            batch_size=2, warmup_steps=0, eval_every=0), resume=True, progress=False),
            ValueError, "resume=True needs checkpoint=Checkpointing(directory)")


# ---------------------------------------------------------------------------------------------
# Data

def _fasta(tmp_path, raw: bytes, name: str = "x.fa") -> Path:
    path = tmp_path / name
    path.write_bytes(raw)
    return path


PROTEIN = b">a\nMKVLAAGLLLAAGKKEELWRRPQ\n>b\nMSTNPKPQRKTKRNTNRRPQDVKF\n"


@pytest.mark.parametrize("encoding, named", [
    ("utf-16", "UTF-16"), ("utf-16-le", "UTF-16"), ("utf-16-be", "UTF-16"),
    ("utf-32", "UTF-32"), ("utf-32-le", "UTF-32"), ("utf-32-be", "UTF-32")])
def test_a_wide_fasta_is_named_by_its_encoding(tmp_path, encoding, named):
    """With or without a byte-order mark; UTF-32LE's mark begins with UTF-16LE's."""
    path = _fasta(tmp_path, PROTEIN.decode().encode(encoding))
    refused(lambda: data.load_sequences(path), data.FastaFormatError, named, "UTF-8")
    with pytest.raises(data.FastaFormatError) as exc:
        data.load_sequences(path)
    assert f"-f {named} -t UTF-8" in str(exc.value)


def test_a_fastq_file_is_named_as_not_fasta(tmp_path):
    path = _fasta(tmp_path, b"@r1\nMKVLAAG\n+\nIIIIIII\n", "x.fq")
    refused(lambda: data.load_sequences(path), data.FastaFormatError, "line 1", "'>'")


def test_alignment_gaps_are_named_as_the_residue_and_its_record(tmp_path):
    path = _fasta(tmp_path, b">a\nMKV-LAAGLL\n")
    refused(lambda: data.load_sequences(path), data.FastaFormatError, "'-'", "'>a'", "line 1")


def test_a_folder_given_as_the_fasta_file_is_one_line(tmp_path):
    refused(lambda: data.load_sequences(tmp_path), FileNotFoundError, str(tmp_path))


def test_a_truncated_gzip_fasta_is_named_as_corrupt(tmp_path):
    raw = gzip.compress(PROTEIN * 50)
    path = _fasta(tmp_path, raw[: len(raw) // 2], "x.fa.gz")
    refused(lambda: data.load_sequences(path), data.FastaFormatError, "corrupt gzip")


def test_windows_line_ends_and_a_stop_codon_read_as_protein(tmp_path):
    path = _fasta(tmp_path, b">a\r\nMKVLAAG\r\nLLLAAG*\r\n")
    assert data.load_sequences(path) == ["MKVLAAGLLLAAG"]


def test_a_single_sequence_is_too_few_to_split_and_says_so(tmp_path):
    path = _fasta(tmp_path, b">a\nMKVLAAGLLLAAGKKEEL\n")
    refused(lambda: data.load_protein_data(8, path=path), ValueError, "1 sequences",
            "validation")


def test_a_window_longer_than_the_data_is_one_line(tmp_path):
    path = _fasta(tmp_path, PROTEIN * 30)
    refused(lambda: data.load_protein_data(10_000, path=path), ValueError, "seq_len + 1")


@pytest.mark.parametrize("packed, words", [
    ([[1, 2, 3]], ["a tensor"]),
    (torch.arange(10), ["1 dimension"]),
    (torch.rand(8, 5), ["torch.float32", "token ids"]),
    (torch.zeros(8, 1, dtype=torch.long), ["seq_len + 1"]),
])
def test_batches_of_something_not_packed_windows_are_refused(packed, words):
    refused(lambda: next(data.iterate_batches(packed, 2)), ValueError, "packed", *words)


def test_a_token_id_outside_the_vocabulary_is_named():
    refused(lambda: data.ProteinTokenizer().decode([999]), ValueError, "999", "vocabulary")


def test_on_invalid_takes_only_its_two_values():
    refused(lambda: data.load_sequences(on_invalid="ignore"), ValueError, "'raise' or 'skip'")


# ---------------------------------------------------------------------------------------------
# The Python API of the model and the training loop

def test_a_gpu_model_on_a_machine_without_one_is_one_line():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    refused(lambda: MoEForCausalLM(preset("tiny"), device="cuda"), ValueError, "device",
            "no CUDA GPU")


def test_an_unknown_expert_backend_is_named():
    refused(lambda: MoEForCausalLM(preset("tiny"), "nope"), ValueError, "'nope'", "grouped_torch")


def test_a_config_field_spelled_as_hf_spells_it_is_named():
    refused(lambda: preset("tiny").with_overrides(num_experts_per_tok=2), ValueError,
            "num_experts_per_tok", "top_k")


def test_train_settings_of_zero_steps_are_refused():
    refused(lambda: TrainSettings(steps=0), ValueError, "steps=0")


def test_token_ids_as_floats_are_named(tiny_model):
    refused(lambda: tiny_model(torch.rand(1, 4)), ValueError, "torch.float32", ".long()")


# ---------------------------------------------------------------------------------------------
# HF conversion: exact or refused by name

def _hf_mixtral(dtype=torch.float32):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(**preset("tiny").to_hf_config_kwargs())
    return transformers.MixtralForCausalLM(config).to(dtype)


def test_weights_for_an_hf_model_of_a_narrower_dtype_are_refused_by_name(tiny_model):
    message = refused(lambda: to_hf_state_dict(tiny_model, torch.bfloat16), ValueError,
                      "torch.bfloat16", "torch.float32", "would round")
    assert re.search(r"model\.\S+ \(torch\.float32\)", message), message


def test_weights_for_an_hf_model_of_a_wider_dtype_convert_exactly():
    torch.manual_seed(0)
    bf16 = MoEForCausalLM(preset("tiny").with_overrides(dtype="bfloat16"))
    ours = to_hf_state_dict(bf16)
    wide = to_hf_state_dict(bf16, torch.float32)
    hf = _hf_mixtral(torch.float32)
    hf.load_state_dict(wide, strict=True)
    for name, value in hf.state_dict().items():
        assert value.dtype == torch.float32
        assert torch.equal(value.to(torch.bfloat16), ours[name]), name


def test_weights_that_a_narrower_dtype_holds_exactly_convert(tiny_model):
    model = MoEForCausalLM(preset("tiny"))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # every value a bf16 value
    hf = _hf_mixtral(torch.bfloat16)
    hf.load_state_dict(to_hf_state_dict(model, torch.bfloat16), strict=True)
    for name, value in to_hf_state_dict(model).items():
        assert torch.equal(hf.state_dict()[name].float(), value), name


def test_a_dtype_that_is_no_float_dtype_is_refused(tiny_model):
    refused(lambda: to_hf_state_dict(tiny_model, "bfloat16"), ValueError, "'bfloat16'",
            "hf_model.dtype")


def test_an_hf_model_without_weights_is_refused():
    with torch.device("meta"):
        hf = _hf_mixtral()
    refused(lambda: from_hf(hf), ValueError, "meta", "from_pretrained")


def test_an_hf_config_given_as_a_dict_is_named_as_a_dict():
    config = transformers.MixtralConfig(**preset("tiny").to_hf_config_kwargs()).to_dict()
    refused(lambda: MoEConfig.from_hf_config(config), ValueError, "dict", "mixtral",
            "MixtralConfig")


def test_an_hf_base_model_without_its_head_is_named():
    refused(lambda: from_hf(_hf_mixtral().model), ValueError, "lm_head",
            "MixtralForCausalLM")


def test_an_hf_model_in_float64_is_refused_with_the_cast():
    refused(lambda: from_hf(_hf_mixtral(torch.float64)), ValueError,
            "torch.float64", "hf_model.to(torch.float32)")


def test_a_dense_hf_config_is_refused_naming_the_families():
    llama = transformers.LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=1, num_attention_heads=2)
    refused(lambda: MoEConfig.from_hf_config(llama), ValueError, "'llama'", "MixtralForCausalLM")
