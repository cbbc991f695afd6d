"""Expert parallelism on CPU with gloo: 2 processes launched with torchrun must compute exactly
what one process computes (logits and every gradient), whatever the routing; a model sharded
over 2 `ranks.run` processes switches expert backend and precision and exports its full HF state
dict like the unsharded model."""

import copy
import shutil
import sys

import pytest
import torch
import torch.distributed as dist

from moe_tutorial.moe.config import preset
from moe_tutorial.moe.hf import to_hf_state_dict
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.parallel import distributed, ranks
from moe_tutorial.perf import train_dist
from moe_tutorial.perf.train_dist import launch
from moe_tutorial.precision.quant import rel_error

# fp32 on CPU: the only differences are the order of sums (tokens regrouped by the all-to-all,
# gradients averaged across ranks) — ~3e-7 relative seen; 1e-5 still catches any wrong routing,
# a missing 1/world or a gradient reduced over the wrong group (all >= 1e-1).
TOLERANCE = 1e-5


def _check(*args):
    result = launch(2, "--mode", "check", *args, timeout=300, echo=False)
    assert len(result["results"]) == 2
    return result["results"]


@pytest.mark.parametrize("layout, backend", [(("--dp", "1", "--ep", "2"), "grouped_torch"),
                                             (("--dp", "1", "--ep", "2"), "te_ops"),
                                             (("--dp", "2", "--ep", "1"), "naive"),
                                             (("--dp", "1", "--ep", "2", "--engine", "replicated"),
                                              "grouped_torch")])
def test_distributed_equals_single_process(layout, backend):
    engine = layout[-1] if "--engine" in layout else "fsdp2"
    for r in _check(*layout, "--backend", backend):
        assert r["max_rel_error"] < TOLERANCE, r
        assert r["engine"] == engine and r["sharded"] == (engine == "fsdp2"), r
    if "--ep" in layout and layout[layout.index("--ep") + 1] == "2":
        assert r["path"].startswith("EP 1/2 (experts 2..3)")


def test_an_ep_rank_that_receives_no_tokens():
    results = _check("--dp", "1", "--ep", "2", "--starve-rank", "1")
    assert results[0]["starved_experts"] == [2, 3]
    for r in results:
        assert r["max_rel_error"] < TOLERANCE, r


def test_starving_experts_keeps_every_router_of_the_model_off_them():
    """The starved rank above receives no tokens only if `starve_experts` reaches the routing the
    model's routers really call."""
    torch.manual_seed(0)
    model = MoEForCausalLM(preset("tiny"))
    hidden = torch.randn(64, model.config.hidden_size)
    starved = [0, 1]
    with train_dist.starve_experts(starved, model):
        chosen = {e for layer in model.model.layers
                  for e in layer.mlp.gate(hidden).indices.flatten().tolist()}
    assert chosen and not chosen & set(starved), chosen
    unstarved = set(model.model.layers[0].mlp.gate(hidden).indices.flatten().tolist())
    assert unstarved & set(starved), "the routing stays starved after the block"


def test_layout_errors_are_clear():
    with pytest.raises(ValueError, match="world size 6 does not factor as dp × ep = 2 × 2"):
        distributed.check_layout(6, 2, 2, 8)
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by ep=4"):
        distributed.check_layout(4, 1, 4, 6)
    with pytest.raises(ValueError, match="must both be >= 1"):
        distributed.check_layout(2, 0, 2, 8)


def _sharded_model_against_the_full_one() -> dict:
    """On each rank of 2 gloo processes: the tiny model, and a copy sharded over ep=2 whose
    experts then switch backend (te_ops: its pure-PyTorch counterpart here) and precision. What
    the sharded copy computes, reports and exports, against the full model."""
    config = preset("tiny")
    layout = distributed.init_layout(1, 2, config.num_experts)
    torch.manual_seed(0)
    full = MoEForCausalLM(config)
    sharded = distributed.shard_experts(copy.deepcopy(full), layout)
    sharded.set_expert_backend("te_ops").set_precision("bf16")
    ids = torch.randint(0, config.vocab_size, (2, 8),
                        generator=torch.Generator().manual_seed(dist.get_rank()))
    state, full_state = to_hf_state_dict(sharded), to_hf_state_dict(full)  # a collective
    return {"backend": sharded.expert_backend,
            "shard_sizes": [layer.mlp.experts.num_experts for layer in sharded.model.layers],
            "logits_error": rel_error(sharded(ids).logits, full(ids).logits),
            "path": sharded.expert_paths()[0],
            "state_keys_match": sorted(state) == sorted(full_state),
            "state_equal": all(torch.equal(state[k], full_state[k]) for k in full_state)}


@pytest.fixture(scope="module")
def sharded_runs():
    return ranks.run(_sharded_model_against_the_full_one, 2, timeout_s=120)


def test_a_sharded_model_switches_backend_and_precision(sharded_runs):
    for rank, r in enumerate(sharded_runs):
        assert r["backend"] == "te_ops" and r["shard_sizes"] == [2, 2]
        assert r["logits_error"] < TOLERANCE, r
        assert r["path"].startswith(f"EP {rank}/2 (experts {2 * rank}..{2 * rank + 1}): ")
        assert "pure-PyTorch counterpart" in r["path"]


def test_a_sharded_model_exports_all_its_experts(sharded_runs):
    """`to_hf_state_dict` gathers the shards: every rank gets the full model's HF state dict."""
    for r in sharded_runs:
        assert r["state_keys_match"] and r["state_equal"], r


def test_sharding_twice_is_refused():
    model = MoEForCausalLM(preset("tiny"))
    layout = distributed.Layout(dp=1, ep=2, dp_rank=0, ep_rank=0, dp_group=None, ep_group=None)
    distributed.shard_experts(model, layout)
    with pytest.raises(ValueError, match="already sharded"):
        distributed.shard_experts(model, layout)


def test_a_bad_layout_fails_the_launch_with_its_message():
    with pytest.raises(RuntimeError, match="does not factor as dp × ep"):
        launch(2, "--mode", "check", "--dp", "2", "--ep", "2", timeout=300, echo=False)


TRAIN = ("--mode", "train", "--steps", "8", "--batch", "4", "--max-sequences", "300",
         "--checkpoint-every", "4")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """8 steps of dp1 × ep2 training, every rank saving its shards at steps 4 and 8."""
    directory = tmp_path_factory.mktemp("ep_run")
    result = launch(2, *TRAIN, "--checkpoint-dir", str(directory), timeout=300, echo=False)
    return directory, result["results"]


def test_expert_parallel_training_runs(trained):
    for r in trained[1]:
        losses = [h["loss"] for h in r["history"]]
        assert len(losses) == 8 and losses[-1] < losses[0]
        assert r["val_loss"] < 3.3


def test_a_run_resumes_from_its_checkpoint_on_another_layout(trained):
    """As if the run had died after step 4: drop the step-8 checkpoint, resume on dp2 × ep1
    (replicated experts, FSDP2 over both ranks). Steps 5–8 see the same batches and the same
    weights, so their losses are the uninterrupted run's (fp32 sums in another order)."""
    directory, uninterrupted = trained
    shutil.rmtree(directory / "step_00000008")
    resumed = launch(2, *TRAIN, "--checkpoint-dir", str(directory), "--resume", "--dp", "2",
                     "--ep", "1", timeout=300, echo=False)["results"]
    want = [h["loss"] for h in uninterrupted[0]["history"]]
    got = [h["loss"] for h in resumed[0]["history"]]
    assert len(got) == 8  # steps 1–4 from the checkpoint's history (rank 0's records)
    assert got[4:] == pytest.approx(want[4:], rel=1e-5)
    assert (directory / "step_00000008").is_dir()  # saved again after the last step


def test_expert_parallel_benchmark_reports_per_gpu_numbers():
    result = launch(2, "--mode", "bench", "--iters", "2", "--warmup", "0", timeout=300, echo=False)
    rank0, rank1 = result["results"]
    assert rank0["environment"]["torch"] and rank1["environment"] is None
    for r in (rank0, rank1):
        assert r["tokens_per_s_per_gpu"] > 0 and r["pflops_per_gpu"] > 0 and r["median_ms"] > 0
        assert r["world"] == 2 and r["ep"] == 2
        assert r["layers"] == preset("tiny").num_layers  # the depth the step ran at
        assert r["allocator_retries"] is None  # counted on a GPU only
        # memory.predict's expectation is there to set beside a GPU's measured peak
        assert r["predicted_peak_gb"] > 0 and r["peak_memory_gb"] is None


def test_a_launch_past_its_timeout_is_stopped():
    """A rank stuck (here: a long training run) must not hang the caller, e.g. the matrix."""
    with pytest.raises(RuntimeError, match="timed out after 4 s and was stopped"):
        launch(2, "--mode", "train", "--steps", "100000", "--max-sequences", "300", timeout=4,
               echo=False)


def _fake_torchrun(script: str):
    """A stand-in for torchrun that runs `script` with OUT set to launch's --out path."""
    def command(nproc, *args):
        out = args[args.index("--out") + 1]
        return [sys.executable, "-c", f"OUT = {out!r}\n" + script]
    return command


def test_a_crash_after_the_results_were_written_keeps_them_and_says_so(monkeypatch, capsys):
    """A process that dies while shutting down, after rank 0 wrote every rank's results (seen on
    gloo: "terminate called without an active exception"), loses no measurement: launch returns
    the results, with the crash named in them and on stderr."""
    monkeypatch.setattr(train_dist, "torchrun_command", _fake_torchrun(
        "import json, os\njson.dump({'mode': 'bench', 'results': [1, 2]}, open(OUT, 'w'))\n"
        "print('terminate called without an active exception', flush=True)\nos.abort()"))
    result = launch(2, "--mode", "bench", echo=False)
    assert result["results"] == [1, 2]
    assert "terminate called" in result["shutdown_crash"]
    assert "after every rank's results were gathered" in capsys.readouterr().err


def test_a_crash_before_the_results_were_written_fails_the_launch(monkeypatch):
    monkeypatch.setattr(train_dist, "torchrun_command", _fake_torchrun(
        "import os\nprint('terminate called without an active exception', flush=True)\n"
        "os.abort()"))
    with pytest.raises(RuntimeError, match="terminate called"):
        launch(2, "--mode", "bench", echo=False)


def test_the_hf_baseline_takes_activation_checkpointing_too():
    """`--model hf --activation-checkpointing` recomputes HF's decoder layers as ours are
    (it was silently ignored before)."""
    from torch.distributed._composable import checkpoint

    args = train_dist.parse_args(["--mode", "bench", "--model", "hf", "--engine", "replicated",
                                  "--dp", "1", "--ep", "1", "--activation-checkpointing"])
    layout = distributed.Layout(1, 1, 0, 0, None, None)
    hf, _, _ = train_dist._bench_model(args, preset("tiny"), layout, torch.device("cpu"))
    assert hf.model.layers and all(checkpoint.state(layer) is not None
                                   for layer in hf.model.layers)
    args = train_dist.parse_args(["--mode", "bench", "--model", "hf", "--engine", "replicated",
                                  "--dp", "1", "--ep", "1"])
    hf, _, _ = train_dist._bench_model(args, preset("tiny"), layout, torch.device("cpu"))
    assert all(checkpoint.state(layer) is None for layer in hf.model.layers)
