"""dist_checkpoint on CPU with gloo (`ranks.run`): one training run saved on one (dp, ep) layout
and expert backend resumes on others, and continues exactly as it would have on the original.

The run, in three process groups and this process (each continuing the previous one's files):
1. dp2 × ep1, grouped_torch (stacked experts, FSDP2 gives each rank 2 of the 4): a step, an
   async save of step 1 while training goes on, two more steps (the losses to reproduce);
2. dp1 × ep2, te_grouped_linear (one weight per expert): resumes from step 1, steps 2 and 3,
   saves step 3, one more step, then a rank is killed while saving step 4;
3. dp3 × ep1, with te_ops (each expert's rows split unevenly: 43, 43, 42 of gate-up's 128),
   with grouped_torch (the 4 experts split 2, 2, 0) and replicated: resumes from step 3 (the
   killed save's folder ignored), a step, saves step 4, a step;
4. one process, no process group, another backend: resumes from what run 3 saved.
Every resume must give the weights and AdamW moments that were saved, bit for bit (compared as
whole tensors gathered from FSDP2's shards, experts in HF layout: not through dist_checkpoint's
keys), and the next steps the losses of the run that did not stop (fp32, 1e-5: the layouts sum
in other orders)."""

import copy
import dataclasses
import os
import signal

import pytest
import torch
import torch._dynamo  # FSDP2 imports it (2.6 s): here, ranks.run's launcher, not every rank
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from moe_tutorial.moe.batch import next_token_targets
from moe_tutorial.moe.config import preset
from moe_tutorial.moe.model import MoEForCausalLM, is_expert_parameter
from moe_tutorial.parallel import dist_checkpoint, distributed, ranks
from moe_tutorial.perf.dist_model import global_batch
from moe_tutorial.precision.quant import rel_error
from moe_tutorial.train.checkpoint import CheckpointError
from moe_tutorial.train.loop import TrainSettings, learning_rate, make_optimizer, train_step

CONFIG = preset("tiny", aux_loss_coef=0.0)  # the aux loss is per rank: it differs by layout
SETTINGS = TrainSettings(steps=8, warmup_steps=2, lr=1e-2, grad_clip=None)
GLOBAL_BATCH, SEQ_LEN = 6, 8  # 6 sequences a step: an equal share on 1, 2 or 3 ranks
TOLERANCE = 1e-5
MOMENTS = ("exp_avg", "exp_avg_sq")
# Without a process group DCP warns that it assumes one process: what these tests mean
SINGLE_PROCESS = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model(backend: str, layout, config=CONFIG, *, fsdp: bool = True, **options):
    """(model, a copy before FSDP2 to gather whole weights into, optimizer): the run's seeded
    model on `layout` (None: one process), experts sharded over ep, FSDP2 over all ranks
    unless `fsdp=False` (replicated weights, average_gradients' engine)."""
    torch.manual_seed(0)
    model = MoEForCausalLM(config).set_expert_backend(backend, **options)
    if layout is not None:
        distributed.shard_experts(model, layout)
    unsharded = copy.deepcopy(model, memo={id(layout): layout})  # the layout's groups: shared
    if layout is not None and fsdp:
        distributed.fully_shard_layout(model, layout)
    return model, unsharded, make_optimizer(model, SETTINGS)


def _step(model, optimizer, step: int) -> float:
    """Training step `step` (0-based) on this rank's share of the step's global batch, at the
    schedule's learning rate; the global batch's loss (the mean over ranks)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    ids = global_batch(CONFIG, 1, GLOBAL_BATCH, SEQ_LEN, "cpu", seed=step).chunk(world)[rank]
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(step, SETTINGS)
    loss = train_step(model, (ids, next_token_targets(ids)), optimizer, grad_clip=None).loss
    loss = loss.detach()
    if dist.is_initialized():
        dist.all_reduce(loss)
    return loss.item() / world


def _whole(model, unsharded, of) -> dict[str, torch.Tensor]:
    """name → `of(parameter)` (the weight, or an AdamW moment) of the whole model, from every
    rank's shards: FSDP2's `full_tensor`, then the experts in HF layout [E, ...] from every ep
    rank (`full_hf_weights`), whatever the backend."""
    into = dict(unsharded.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            value = of(p)
            into[name].copy_(value.full_tensor() if isinstance(value, DTensor) else value)
    whole = {name: p.detach().clone() for name, p in unsharded.named_parameters()
             if not is_expert_parameter(name)}
    for i, layer in enumerate(unsharded.model.layers):
        gate_up, down = layer.mlp.dispatcher.full_hf_weights(layer.mlp.experts)
        whole[f"model.layers.{i}.experts.gate_up_proj"] = gate_up
        whole[f"model.layers.{i}.experts.down_proj"] = down
    return whole


def _snapshot(model, unsharded, optimizer) -> dict:
    """The whole training state, comparable across layouts and backends."""
    state = optimizer.state
    return {"weights": _whole(model, unsharded, lambda p: p),
            **{name: _whole(model, unsharded, lambda p, name=name: state[p][name])
               for name in MOMENTS},
            "adam_steps": sorted({s["step"].item() for s in state.values()})}


def _assert_same_state(got: dict, want: dict) -> None:
    assert got["adam_steps"] == want["adam_steps"]
    for part in ("weights", *MOMENTS):
        assert got[part].keys() == want[part].keys()
        for name, tensor in want[part].items():
            assert torch.equal(got[part][name], tensor), (part, name)


def _assert_same_losses(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for step, loss in want.items():
        assert rel_error(torch.tensor(got[step]), torch.tensor(loss)) < TOLERANCE, (step, got, want)


# ---------------------------------------------------------------------------------------------
# The ranks' parts (module-level: ranks.run imports them by name)

def _first_run(directory: str) -> dict:
    """dp2 × ep1 with stacked experts: step 1, saved in the background, then steps 2 and 3."""
    layout = distributed.init_layout(2, 1, CONFIG.num_experts)
    model, unsharded, optimizer = _model("grouped_torch", layout)
    _step(model, optimizer, 0)
    written = dist_checkpoint.save(model, optimizer, directory, step=1, layout=layout,
                                   async_save=True)
    saved = _snapshot(model, unsharded, optimizer)
    # the weights change while the checkpoint is written: it holds the ones of step 1
    losses = {2: _step(model, optimizer, 1), 3: _step(model, optimizer, 2)}
    return {"path": str(written.result()), "saved": saved, "losses": losses}


def _second_run(directory: str, results: str) -> None:
    """Resume on dp1 × ep2 with TE-layout experts; save step 3; die while saving step 4 (the
    results go to a file first: ranks.run returns nothing from a run a rank did not finish)."""
    layout = distributed.init_layout(1, 2, CONFIG.num_experts)
    model, unsharded, optimizer = _model("te_grouped_linear", layout)
    out = {"step": dist_checkpoint.load(model, optimizer, directory, layout),
           "resumed": _snapshot(model, unsharded, optimizer)}
    out["losses"] = {2: _step(model, optimizer, 1), 3: _step(model, optimizer, 2)}
    dist_checkpoint.save(model, optimizer, directory, step=3, layout=layout)
    out["saved"] = _snapshot(model, unsharded, optimizer)
    out["next_losses"] = {4: _step(model, optimizer, 3)}
    if dist.get_rank() == 0:
        torch.save(out, results)
    dist.barrier()
    if dist.get_rank() == 1:  # killed once its part of step 4 is written, before the index
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write_data(self, plan, planner).wait()
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = write_then_die
    dist_checkpoint.save(model, optimizer, directory, step=4, layout=layout)


# The third run's models: name → (backend, FSDP2?). Replicated weights are average_gradients'
# engine: every rank holds the whole model and saves the same tensors, which DCP writes once.
THIRD_RUN = {"te_ops": ("te_ops", True), "grouped_torch": ("grouped_torch", True),
             "replicated": ("naive", False)}


def _third_run(directory: str, saves: dict[str, str]) -> dict:
    """Resume on dp3 × ep1 with each model of THIRD_RUN; the FSDP2 ones train a step and save
    step 4 (into `saves[name]`), the replicated one saves step 3 again (its step would need
    average_gradients)."""
    layout = distributed.init_layout(3, 1, CONFIG.num_experts)
    out = {}
    for name, (backend, fsdp) in THIRD_RUN.items():
        model, unsharded, optimizer = _model(backend, layout, fsdp=fsdp)
        out[name] = {"step": dist_checkpoint.load(model, optimizer, directory, layout),
                     "resumed": _snapshot(model, unsharded, optimizer)}
        if not fsdp:
            dist_checkpoint.save(model, optimizer, saves[name], step=3, layout=layout)
            continue
        out[name]["losses"] = {4: _step(model, optimizer, 3)}
        dist_checkpoint.save(model, optimizer, saves[name], step=4, layout=layout)
        out[name]["saved"] = _snapshot(model, unsharded, optimizer)
        out[name]["next_losses"] = {5: _step(model, optimizer, 4)}
    out["refused"] = {}
    try:  # 4 experts over ep = 3
        dist_checkpoint.load(model, optimizer, directory, dataclasses.replace(layout, dp=1, ep=3))
    except ValueError as exc:
        out["refused"]["ep=3"] = str(exc)
    model, _, optimizer = _model("te_ops", layout, glu_interleave_size=32)
    try:  # a rank's rows of an interleaved gate-up weight are scattered over HF's
        dist_checkpoint.save(model, optimizer, directory, step=5, layout=layout)
    except ValueError as exc:
        out["refused"]["interleaved"] = str(exc)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("dist_checkpoint")
    directory = folder / "run"
    first = ranks.run(_first_run, 2, str(directory), timeout_s=120)[0]
    with pytest.raises(ranks.RankError) as killed:
        ranks.run(_second_run, 2, str(directory), str(folder / "second.pt"), timeout_s=120)
    after_kill = {p.name: sorted(os.listdir(p)) for p in directory.iterdir()}
    second = torch.load(folder / "second.pt")
    saves = {name: str(folder / name) for name in THIRD_RUN}
    third = ranks.run(_third_run, 3, str(directory), saves, timeout_s=120)[0]
    return {"first": first, "second": second, "killed": killed.value, "after_kill": after_kill,
            "third": third, "saves": saves, "directory": directory}


def test_a_dp2_checkpoint_resumes_on_dp1_ep2_with_te_layout_experts(runs):
    first, second = runs["first"], runs["second"]
    assert first["path"].endswith("step_00000001") and second["step"] == 1
    _assert_same_state(second["resumed"], first["saved"])
    _assert_same_losses(second["losses"], first["losses"])


def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint(runs):
    assert runs["killed"].type_name == ranks.PROCESS_DIED and runs["killed"].rank == 1
    folders = runs["after_kill"]
    assert sorted(folders) == ["step_00000001", "step_00000003", "step_00000004.partial"]
    # rank 1 wrote its part; DCP's index (.metadata) and meta.json never came
    assert any(name.startswith("__1_") for name in folders["step_00000004.partial"])
    assert not {".metadata", "meta.json"} & set(folders["step_00000004.partial"])
    assert {".metadata", "meta.json"} <= set(folders["step_00000003"])
    assert dist_checkpoint.latest(runs["directory"]).name == "step_00000003"
    assert runs["third"]["te_ops"]["step"] == 3  # resumed from it, the partial one ignored


@pytest.mark.parametrize("name", THIRD_RUN)
def test_uneven_fsdp_shards_and_replicas_resume(runs, name):
    second, third = runs["second"], runs["third"][name]
    assert third["step"] == 3
    _assert_same_state(third["resumed"], second["saved"])
    if "losses" in third:
        _assert_same_losses(third["losses"], second["next_losses"])


@SINGLE_PROCESS
@pytest.mark.parametrize("saved_by, resume_with", [("te_ops", "naive"),
                                                   ("grouped_torch", "te_grouped_linear"),
                                                   ("replicated", "grouped_torch")])
def test_one_process_resumes_a_three_rank_checkpoint(runs, saved_by, resume_with):
    """What the three ranks saved: after their step 4 under FSDP2, or step 3 replicated."""
    if saved_by == "replicated":
        step, saved, next_losses = 3, runs["second"]["saved"], runs["second"]["next_losses"]
    else:
        third = runs["third"][saved_by]
        step, saved, next_losses = 4, third["saved"], third["next_losses"]
    model, unsharded, optimizer = _model(resume_with, None)
    assert dist_checkpoint.load(model, optimizer, runs["saves"][saved_by]) == step
    _assert_same_state(_snapshot(model, unsharded, optimizer), saved)
    _assert_same_losses({step + 1: _step(model, optimizer, step)}, next_losses)


def test_layouts_it_cannot_use_are_refused(runs):
    refused = runs["third"]["refused"]
    assert "num_experts=4 is not divisible by ep=3" in refused["ep=3"]
    assert ("te_ops with glu_interleave_size=32 and its weights split by rows over dp=3 ranks"
            in refused["interleaved"])


# ---------------------------------------------------------------------------------------------
# One process, no process group


@SINGLE_PROCESS
def test_interleaved_gate_up_rows_are_saved_in_hf_order(tmp_path):
    """te_ops with glu_interleave_size=32 (the fused kernel's layout) resumes as grouped_torch
    and as itself; AdamW's hyperparameters are the checkpoint's; an async save; `keep`."""
    model, unsharded, optimizer = _model("te_ops", None, glu_interleave_size=32)
    _step(model, optimizer, 0)
    dist_checkpoint.save(model, optimizer, tmp_path, step=1)
    (tmp_path / "step_00000000.partial").mkdir()  # a save that did not finish
    saved = _snapshot(model, unsharded, optimizer)
    written = dist_checkpoint.save(model, optimizer, tmp_path, step=2, async_save=True, keep=1)
    assert written.result() == dist_checkpoint.path_for(tmp_path, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000002"]
    for backend, options in [("grouped_torch", {}), ("te_ops", {"glu_interleave_size": 32})]:
        model, unsharded, optimizer = _model(backend, None, **options)
        for group in optimizer.param_groups:
            group["betas"] = (0.5, 0.5)
        assert dist_checkpoint.load(model, optimizer, tmp_path) == 2
        _assert_same_state(_snapshot(model, unsharded, optimizer), saved)
        assert all(group["betas"] == SETTINGS.betas for group in optimizer.param_groups)


@SINGLE_PROCESS
def test_a_checkpoint_before_the_first_step_resumes_with_a_fresh_optimizer(tmp_path):
    model, _, optimizer = _model("grouped_torch", None)
    dist_checkpoint.save(model, optimizer, tmp_path, step=0)
    trained, _, trained_optimizer = _model("naive", None)
    _step(trained, trained_optimizer, 0)
    assert dist_checkpoint.load(trained, trained_optimizer, tmp_path) == 0
    assert not trained_optimizer.state
    for (name, p), q in zip(model.named_parameters(), trained.parameters()):
        assert torch.equal(p, q), name


@SINGLE_PROCESS
def test_bad_checkpoints_are_refused_by_name(tmp_path):
    model, _, optimizer = _model("grouped_torch", None)
    with pytest.raises(CheckpointError, match="nowhere does not exist"):
        dist_checkpoint.load(model, optimizer, tmp_path / "nowhere")
    (tmp_path / "step_00000005.partial").mkdir()
    with pytest.raises(CheckpointError, match=r"no complete checkpoint .*; step_00000005\.partial "
                                              r"is incomplete"):
        dist_checkpoint.load(model, optimizer, tmp_path)
    dist_checkpoint.save(model, optimizer, tmp_path, step=3)
    with pytest.raises(CheckpointError, match="already holds a complete checkpoint of step 3"):
        dist_checkpoint.save(model, optimizer, tmp_path, step=3)
    model.set_expert_backend("te_ops")  # new expert parameters, which the optimizer lacks
    with pytest.raises(ValueError, match=r"the optimizer does not hold the parameters of "
                                         r"\['model.layers.0.mlp.experts.0.down_proj'"):
        dist_checkpoint.save(model, optimizer, tmp_path, step=4)
    other, _, other_optimizer = _model("grouped_torch", None,
                                       CONFIG.with_overrides(intermediate_size=32, top_k=1))
    with pytest.raises(CheckpointError, match="other model \\(intermediate_size: checkpoint 64, "
                                              "now 32, top_k: checkpoint 2, now 1\\)"):
        dist_checkpoint.load(other, other_optimizer, tmp_path)
