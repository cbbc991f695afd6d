"""moe_tutorial.perf.memory: the per-GPU memory prediction, checked against what the model really saves.

The heart of it: one forward pass of the real model on a CPU, every tensor saved for the backward
pass caught by `torch.autograd.graph.saved_tensors_hooks` and counted once per storage
(parameters left out), against `memory.saved_activations`. Then the whole-step prediction
against the peaks the course measured on H200s (benchmarks/results), consistency with
the training state in closed form, invariants, and the refusals of bad input.
"""

import json
from itertools import pairwise
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils.checkpoint import checkpoint

from moe_tutorial.moe.batch import next_token_targets
from moe_tutorial.moe.config import preset
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.parallel import distributed, ranks
from moe_tutorial.perf import fp8_storage, memory, memory_table
from moe_tutorial.perf.bench import TRAIN_VARIANTS

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"

# On torch 2.13 (CPU) the prediction is byte-exact for every config below. 0.5% leaves room for
# a torch release that saves a small index tensor ([tokens, top_k] int64) differently, and is
# still tighter than the smallest activation that matters: one [tokens, hidden] tensor is 0.8%
# (small fp32) to 1.6% (tiny) of everything these configs save, so missing one fails.
SAVED_TOLERANCE = 0.005

CONFIGS = {  # name: (config, [(batch, seq_len), ...])
    "tiny fp32": (preset("tiny"), [(1, 16), (3, 64)]),
    "tiny bf16": (preset("tiny", dtype="bfloat16"), [(2, 48)]),
    "small fp32": (preset("small"), [(2, 64)]),
    # 8 query heads sharing 2 key/value heads, 3 layers, bf16: every width differs
    "wide bf16": (preset("small", hidden_size=256, intermediate_size=384, num_heads=8,
                         num_kv_heads=2, num_layers=3, dtype="bfloat16"), [(1, 128)]),
}


def _saved_bytes(model, run) -> int:
    """Bytes of the distinct storages saved for the backward pass while `run()` runs, the
    model's parameters left out. Functional collectives' outputs are wrapper tensors whose
    storage cannot be read: their payload (`.elem`) is counted."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        payload = t.elem if isinstance(t, AsyncCollectiveTensor) else t
        storage = payload.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _forward(model, batch: int, seq_len: int, seed: int = 1):
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len),
                        generator=torch.Generator().manual_seed(seed))
    return lambda: model(ids, next_token_targets(ids))


def _checkpoint_every_layer(model) -> None:
    """Each decoder layer under torch.utils.checkpoint (reentrant: its autograd Function saves
    the layer's input through save_for_backward, where the hooks see it)."""
    for layer in model.model.layers:
        forward = layer.forward
        layer.forward = lambda x, rotary, f=forward: checkpoint(f, x, rotary, use_reentrant=True)


@pytest.mark.parametrize("name", CONFIGS)
def test_saved_activations_are_what_the_model_saves(name):
    config, sizes = CONFIGS[name]
    torch.manual_seed(0)
    model = MoEForCausalLM(config)
    for batch, seq_len in sizes:
        measured = _saved_bytes(model, _forward(model, batch, seq_len))
        saved = memory.saved_activations(config, batch=batch, seq_len=seq_len, device="cpu")
        predicted = memory.saved_activation_bytes(saved, config.num_layers)
        assert predicted == pytest.approx(measured, rel=SAVED_TOLERANCE), (name, batch, seq_len)


@pytest.mark.parametrize("name", ["tiny bf16", "small fp32"])
def test_checkpointing_keeps_each_layers_input_only(name):
    """With every layer checkpointed the forward pass saves one [tokens, hidden] input per layer
    and the head's tensors. The prediction also counts the RoPE tables, which the hooks do not
    see here: the checkpoint keeps the `Rotary` object (a non-tensor argument) for the
    recomputation, so the tables stay in memory without being saved tensors."""
    config, sizes = CONFIGS[name]
    batch, seq_len = sizes[0]
    torch.manual_seed(0)
    model = MoEForCausalLM(config)
    _checkpoint_every_layer(model)
    measured = _saved_bytes(model, _forward(model, batch, seq_len))
    p = memory.predict(config, batch=batch, seq_len=seq_len, engine="single", device="cpu",
                       activation_checkpointing=True)
    saved = memory.saved_activations(config, batch=batch, seq_len=seq_len, device="cpu")
    head = saved["head"]
    predicted = (p.phases["forward"]["activations"] + head["loss gradient [tokens, vocab]"]
                 - head["RoPE tables"])
    assert predicted == pytest.approx(measured, rel=SAVED_TOLERANCE)
    assert p.phases["forward"]["activations"] < memory.predict(
        config, batch=batch, seq_len=seq_len, engine="single",
        device="cpu").phases["forward"]["activations"]


# The ranks' part of the expert-parallel check (module-level: ranks.run imports it by name).
def _measure_expert_parallel(cases: list) -> list:
    """On each rank of a gloo group, per case (preset, overrides, batch, seq_len): the bytes one
    forward pass of the model sharded over ep = world saves, and the rows each layer's local
    experts received."""
    results = []
    for name, overrides, batch, seq_len in cases:
        config = preset(name, **overrides)
        layout = distributed.init_layout(1, dist.get_world_size(), config.num_experts)
        torch.manual_seed(0)
        model = distributed.shard_experts(MoEForCausalLM(config), layout)
        rows = []
        for layer in model.model.layers:
            layer.mlp.experts.register_forward_hook(
                lambda module, args, out, rows=rows: rows.append(args[0].shape[0]))
        measured = _saved_bytes(model, _forward(model, batch, seq_len, seed=dist.get_rank()))
        results.append((measured, rows))
    return results


def test_expert_parallel_activations_on_two_ranks():
    """ep = 2 on 2 gloo processes: the dispatcher's all-to-alls, the received rows, the local
    experts. Each layer's experts get however many rows the routing sends (`expert_load`)."""
    cases = [("tiny", {}, 2, 32), ("tiny", {"dtype": "bfloat16"}, 2, 32), ("small", {}, 1, 64)]
    per_rank = ranks.run(_measure_expert_parallel, 2, cases, timeout_s=120)
    for rank, results in enumerate(per_rank):
        for (name, overrides, batch, seq_len), (measured, rows) in zip(cases, results):
            config = preset(name, **overrides)
            copies = batch * seq_len * config.top_k
            predicted = 0
            for received in rows:
                saved = memory.saved_activations(config, batch=batch, seq_len=seq_len, ep=2,
                                                 device="cpu", expert_load=received / copies)
                predicted += memory.layer_activation_bytes(saved)
            predicted += round(sum(saved["head"].values()))
            assert predicted == pytest.approx(measured, rel=SAVED_TOLERANCE), (rank, name)


# ---------------------------------------------------------------------------------------------
# The whole step against the peaks measured on H200s (torch 2.11, TE 2.20.2; peak = torch's
# max_memory_allocated). The step phase is exact arithmetic; the forward and backward moments
# approximate the backward sweep (a layer's saved tensors and its gradients counted together,
# its activation gradients not at all), which lands within 5% of every single-GPU step.

STEP_TOLERANCE = 0.05


def _measured_peaks() -> list[dict]:
    """(config, engine, dp, ep, backend, precision, measured GiB) of every recorded run."""
    m2l = preset("mixtral-2l")
    runs = []
    for row in json.loads((RESULTS / "h200.json").read_text())["results"]:
        # the ladder's steps (a candidate changes the loss or optimizer, not what is held)
        if row.get("part") == "train" and row["variant"] in TRAIN_VARIANTS and (
                row["variant"].startswith("ours_")):
            backend, precision = row["variant"].removeprefix("ours_").rsplit("_", 1)
            runs.append({"config": m2l, "engine": "single", "dp": 1, "ep": 1,
                         "backend": backend, "precision": precision, "batch": row["batch"],
                         "seq_len": row["seq_len"], "gib": row["peak_memory_gb"],
                         "run": row["variant"]})
    for run in json.loads((RESULTS / "h200x2.json").read_text())["runs"]:
        _, _, dp, ep, precision = run["run"].split("_")  # ep_n2_dp1_ep2_fp8
        runs.append({"config": m2l, "engine": "replicated", "dp": int(dp[2:]), "ep": int(ep[2:]),
                     "backend": "te_ops", "precision": precision, "batch": 2, "seq_len": 4096,
                     "gib": max(r["peak_memory_gb"] for r in run["ranks"]), "run": run["run"]})
    # The deepest Mixtral-width models one H200 holds, non-distributed and under FSDP2 at world
    # size 1 (its experts left out of FSDP2: `before` put them in, and is not this prediction's)
    world1 = json.loads((RESULTS / "h200_fsdp2_world1.json").read_text())
    for pair in (world1, world1["ten_layers"]):
        layers = int(pair["fsdp2"]["command"].split("--layers ")[1].split()[0])
        for engine, row in (("fsdp2", pair["fsdp2"]["results"][0]),
                            ("single", pair["single"]["results"][0])):
            runs.append({"config": preset("mixtral-2l", layers=layers), "engine": engine,
                         "dp": 1, "ep": 1, "backend": "te_ops", "precision": "bf16",
                         "batch": 2, "seq_len": 4096, "gib": row["peak_memory_gb"],
                         "run": f"mixtral-2l {layers} layers {engine}"})
    matrix = json.loads((RESULTS / "h200x2_matrix_mixtral-8l.json").read_text())
    deeper = preset("mixtral-7l", num_layers=matrix["model"]["layers"])
    assert deeper.parameter_counts()["total"] == matrix["model"]["total_params"]
    for row in matrix["rows"]:
        if row["status"] == "ok":
            settings = matrix["settings"]
            runs.append({"config": deeper, "engine": "replicated", "dp": row["dp"],
                         "ep": row["ep"], "backend": settings["backend"],
                         "precision": row["precision"], "batch": settings["batch"],
                         "seq_len": settings["seq_len"], "gib": row["peak_memory_gb"],
                         "run": f"mixtral-8l {row['layout']} {row['precision']}"})
    return runs


def _predicted_gib(run: dict) -> float:
    p = memory.predict(run["config"], batch=run["batch"], seq_len=run["seq_len"], dp=run["dp"],
                       ep=run["ep"], engine=run["engine"], backend=run["backend"],
                       precision=run["precision"])
    return memory.gib(p.peak)


def _two_layer_expert_parallel(run: dict) -> bool:
    return run["ep"] > 1 and run["config"].num_layers == 2


def test_prediction_matches_the_measured_h200_peaks():
    runs = [run for run in _measured_peaks() if not _two_layer_expert_parallel(run)]
    assert len(runs) >= 10
    for run in runs:
        assert _predicted_gib(run) == pytest.approx(run["gib"], rel=STEP_TOLERANCE), run["run"]


def test_known_gap_two_layer_expert_parallel():
    """mixtral-2l at dp1 × ep2 peaked 1.0 (bf16) and 2.0 GiB (FP8) above the prediction: its
    forward and backward moments miss about 2 GiB that the single-GPU runs do not, a transient
    of the exchange or of TE's backward under EP that this model lacks. Not one per layer:
    mixtral-8l at dp1 × ep2 would then peak far above its measured 58.3 GiB. Pinned here so
    that the gap is seen if it grows."""
    runs = [run for run in _measured_peaks() if _two_layer_expert_parallel(run)]
    assert runs
    for run in runs:
        assert 0 <= run["gib"] - _predicted_gib(run) <= 2.1, run["run"]


# ---------------------------------------------------------------------------------------------
# The training state in closed form: parameters, gradients and AdamW's 2 moments.

def test_training_state_shards_the_experts_over_ep_only():
    config = preset("mixtral-8x7b")
    counts = config.parameter_counts()
    dp8 = memory.parameters_per_rank(config, 8, 1)
    ep8 = memory.parameters_per_rank(config, 1, 8)
    assert dp8["total"] == counts["total"]
    assert ep8["total"] == counts["expert"] // 8 + counts["dense"]
    assert memory.training_state(config, 8, 1)["total"] == 8 * counts["total"]  # bf16: 4 × 2 B
    assert memory.training_state(preset("tiny"), 1, 2)["total"] == 16 * memory.parameters_per_rank(
        preset("tiny"), 1, 2)["total"]  # fp32: 4 × 4 B
    fp32 = config.with_overrides(dtype="float32")
    assert memory.training_state(fp32, 1, 8)["total"] == 16 * ep8["total"]
    with pytest.raises(ValueError, match="not divisible by ep=3"):
        memory.training_state(config, 1, 3)


def test_fsdp_shards_every_parameter_over_all_ranks():
    config = preset("mixtral-8x7b")
    counts = config.parameter_counts()
    ep8 = memory.training_state(config, 1, 8)
    for dp, ep in ((8, 1), (4, 2), (1, 8)):
        shard = memory.parameters_per_rank(config, dp, ep, "fsdp2")
        assert shard["total"] * 8 == pytest.approx(counts["total"], abs=16)  # 1/8 of everything
        assert shard["expert"] == counts["expert"] // 8
        assert memory.training_state(config, dp, ep, "fsdp2")["total"] == 8 * shard["total"]
        assert memory.training_state(config, dp, ep, "fsdp2", "float32")["total"] == (
            16 * shard["total"])  # fp32 shards and moments, bf16 compute
    fsdp8 = memory.training_state(config, 8, 1, "fsdp2")
    assert fsdp8["total"] < ep8["total"]  # EP keeps the dense 1.6 B on every rank
    # One decoder layer's full weights are gathered while it runs: 8 experts + attention, router.
    layer = (counts["total"] - 2 * config.vocab_size * config.hidden_size - config.hidden_size) // 32
    gathered = memory.predict(config, batch=1, seq_len=16, dp=8, ep=1, engine="fsdp2")
    assert gathered.sizes["layer_unsharded"] == 2 * layer
    assert memory.predict(config, batch=1, seq_len=16, dp=4, ep=2, engine="fsdp2").sizes[
        "layer_unsharded"] < 2 * layer  # with ep2 a layer holds only its 4 local experts
    replicated = memory.predict(config, batch=1, seq_len=16, dp=8, ep=1).phases["step"]
    assert replicated["gradient_buffers"] == 2 * counts["total"]  # the flat all-reduce copy


# ---------------------------------------------------------------------------------------------
# Invariants.

MIXTRAL = preset("mixtral-8x7b")


def _mixtral(**options):
    return memory.predict(MIXTRAL, batch=1, seq_len=4096, **options)


def test_fsdp_gathers_no_experts_that_one_rank_holds_alone():
    """With dp = 1 FSDP2 leaves the experts out (`distributed.experts_outside_fsdp`): a layer's
    gathered weights are its dense part; unless a mixed-precision cast needs FSDP2 for them."""
    params = memory.layer_parameters(MIXTRAL, ep=8)
    alone = _mixtral(dp=1, ep=8, engine="fsdp2")
    assert alone.sizes["layer_unsharded"] == 2 * params["layer_dense"]  # bf16
    cast = _mixtral(dp=1, ep=8, engine="fsdp2", state_dtype="float32")
    assert cast.sizes["layer_unsharded"] == 2 * (params["layer_dense"] + params["layer_experts"])
    assert alone.peak < _mixtral(dp=1, ep=8, engine="replicated").peak


def test_fsdp_state_shrinks_with_the_world():
    states = [_mixtral(dp=dp, engine="fsdp2").phases["step"]["optimizer_state"]
              for dp in (1, 2, 4, 8)]
    assert all(a > b for a, b in pairwise(states))
    assert states[0] / states[-1] == pytest.approx(8, rel=1e-6)
    # dp × ep = 8 either way: the state per rank is the same, the gathered layer smaller with ep
    fsdp8, fsdp4x2 = _mixtral(dp=8, engine="fsdp2"), _mixtral(dp=4, ep=2, engine="fsdp2")
    assert fsdp8.phases["step"]["parameters"] == pytest.approx(
        fsdp4x2.phases["step"]["parameters"], rel=1e-6)
    assert fsdp4x2.sizes["layer_unsharded"] < fsdp8.sizes["layer_unsharded"]


def test_expert_parallel_divides_the_experts_only():
    one, ep8 = memory.parameters_per_rank(MIXTRAL, 1, 1), memory.parameters_per_rank(MIXTRAL, 1, 8)
    assert ep8["expert"] * 8 == one["expert"] and ep8["dense"] == one["dense"]


def test_checkpointing_trades_activations_for_a_recomputed_layer():
    plain, checkpointed = _mixtral(ep=8), _mixtral(ep=8, activation_checkpointing=True)
    assert checkpointed.components["activations"] < plain.components["activations"] / 10
    assert checkpointed.peak < plain.peak


def test_fp8_adds_weight_copies_that_fsdp_does_not_shard():
    bf16 = _mixtral(dp=8, engine="fsdp2", backend="te_ops")
    fp8 = _mixtral(dp=8, engine="fsdp2", backend="te_ops", precision="fp8")
    assert bf16.components["fp8_weight_copies"] == 0
    copies = fp8.components["fp8_weight_copies"]
    # te.ops on Hopper keeps one byte per expert weight of every layer, gathered or not
    assert copies == MIXTRAL.parameter_counts()["expert"]
    assert fp8.peak > bf16.peak
    replicated = _mixtral(ep=8, backend="te_ops", precision="fp8")
    assert 0 < replicated.components["fp8_weight_copies"] < copies  # 1/8 of the experts


def test_fp8_storage_follows_te():
    hopper = fp8_storage.fp8_weight_copy_bytes("DelayedScaling", "hopper", "grouped_linear")
    blackwell = fp8_storage.fp8_weight_copy_bytes("DelayedScaling", "blackwell", "grouped_linear")
    assert (hopper, blackwell) == (2, 1)  # the transposed copy exists on Hopper only
    assert fp8_storage.fp8_weight_copy_bytes("DelayedScaling", "hopper", "ops") == 1
    assert fp8_storage.fp8_activation_bytes("MXFP8BlockScaling", "blackwell") == 1 + 1 / 32
    assert fp8_storage.fp8_activation_bytes("Float8BlockScaling", "hopper") == 1 + 4 / 128


def test_phases_and_serialisation():
    p = _mixtral(dp=4, ep=2, engine="fsdp2", precision="fp8", backend="te_ops",
                 state_dtype="float32")
    assert p.peak == max(p.totals.values()) == p.totals[p.peak_phase]
    assert all(p.components[name] >= parts.get(name, 0)
               for parts in p.phases.values() for name in p.components)
    assert json.loads(json.dumps(p.to_dict()))["peak"] == p.peak
    assert p.peak_phase in p.describe()
    assert memory.fits(p, p.peak, reserve_fraction=0) and not memory.fits(p, p.peak - 1, 0)


def test_mixtral_table():
    rows, text = memory_table.mixtral_8x7b_table(140 * 2**30)
    assert [(r["engine"], r["dp"], r["ep"]) for r in rows] == list(memory_table.TABLE_LAYOUTS)
    by_layout = {r["layout"]: r for r in rows}
    replicated = by_layout["replicated dp8×ep1"]
    assert not replicated["fits"] and replicated["breaks_on"] == "optimizer_state"
    assert all(r["fits"] for r in rows if r is not replicated)
    assert all(memory_table.table_layout_name(r) in text for r in rows) and "NO" in text
    # at dp1 × ep8 the experts are split: the text never calls that layout replicated
    assert "dp1×ep8 no FSDP" in text and "replicated" not in text
    assert all(sum(r[c] for c in memory_table.TABLE_COMPONENTS) == r["peak_bytes"] for r in rows)


# ---------------------------------------------------------------------------------------------
# Bad input: each refusal says what is wrong and how to fix it.

@pytest.mark.parametrize("options, words", [
    ({"ep": 3}, "not divisible by ep=3"),
    ({"engine": "ddp"}, "unknown engine 'ddp'"),
    ({"engine": "single", "dp": 2}, "use engine='replicated'"),
    ({"precision": "fp4"}, "unknown precision 'fp4'"),
    ({"precision": "fp8"}, "pass backend='te_ops'"),
    ({"backend": "naive"}, "unknown expert backend 'naive'"),
    ({"precision": "MXFP8BlockScaling", "backend": "te_ops"}, "cannot run MXFP8BlockScaling"),
    ({"arch": "ampere"}, "unknown arch 'ampere'"),
    ({"state_dtype": "float32"}, "use engine='fsdp2'"),
    ({"state_dtype": "fp32", "engine": "fsdp2"}, "unknown state_dtype 'fp32'"),
    ({"seq_len": 65536}, "exceeds the config's max_seq_len"),
    ({"batch": 0}, "batch=0 must be a positive whole number"),
    ({"device": "cpu", "backend": "te_ops"}, "use device='cuda'"),
    ({"ep": 8, "expert_load": 0}, "expert_load=0 must be a number in"),
])
def test_bad_input_is_refused_with_the_fix(options, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        memory.predict(MIXTRAL, **{"batch": 1, "seq_len": 4096, **options})


def test_bad_reserve_is_refused():
    with pytest.raises(ValueError, match="reserve_fraction=1.5 must be in"):
        memory.fits(_mixtral(ep=8), 1e12, reserve_fraction=1.5)
