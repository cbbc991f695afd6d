"""A model built on the meta device, sharded, and filled shard by shard from a checkpoint that
transformers' `save_pretrained` wrote: on 2 gloo ranks (dp1×ep2 and dp2×ep1) every rank's logits
must be HF's on its batch, and no rank may hold more of an expert stack than its shard."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moe_tutorial.moe.batch import next_token_targets
from moe_tutorial.moe.config import preset
from moe_tutorial.moe.hf import from_hf, to_hf_state_dict
from moe_tutorial.moe.model import MoEForCausalLM, is_expert_parameter
from moe_tutorial.parallel import distributed, ranks, sharded_init
from moe_tutorial.parallel.sharded_init import build_sharded, load_hf_shards
from moe_tutorial.perf import train_dist
from moe_tutorial.train.checkpoint import CheckpointError
from moe_tutorial.train.loop import TrainSettings, _adamw_groups

transformers = pytest.importorskip("transformers", minversion="5.0")

# fp32 sums in another order (~1e-7); a wrong expert, a transposed or swapped gate/up block is
# off by ~1 relative.
TOLERANCE = 1e-5
LAYOUTS = [(1, 2), (2, 1)]  # (dp, ep) on 2 ranks


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the checkpoint directory, the HF model, its config): a tiny random fp32 Mixtral."""
    config = preset("tiny")
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM._from_config(
        transformers.MixtralConfig(**config.to_hf_config_kwargs()), attn_implementation="sdpa",
        dtype=torch.float32)
    folder = tmp_path_factory.mktemp("mixtral")
    hf.save_pretrained(folder, safe_serialization=True)
    return folder, hf, config


def _relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def _train_step_loss(model: MoEForCausalLM, ids: torch.Tensor) -> float:
    """One AdamW step over the course's parameter groups, each updated by one multi-tensor
    (foreach) call as the fused GPU kernel updates it, which needs a group of one kind of tensor
    (DTensor shards, or the plain experts FSDP2 leaves out); the loss after it (finite if the
    step worked)."""
    optimizer = torch.optim.AdamW(_adamw_groups(model, TrainSettings(lr=1e-3)), lr=1e-3,
                                  foreach=True)
    model(ids, next_token_targets(ids)).loss.backward()
    optimizer.step()
    with torch.no_grad():
        return model(ids, next_token_targets(ids)).loss.item()


def test_transformers_saves_mixtral_experts_one_matrix_each(saved):
    folder, _, _ = saved
    keys = load_file(folder / "model.safetensors").keys()
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in keys
    assert not any(key.endswith("gate_up_proj") for key in keys)


def test_one_process_equals_hf(saved):
    folder, hf, config = saved
    ids = torch.randint(0, config.vocab_size, (2, 16))
    model = build_sharded(config, None, "cpu", hf_checkpoint=folder)
    assert _relative_error(model(ids).logits, hf(ids).logits) <= TOLERANCE


def test_the_stacked_layout_loads_too(saved, tmp_path):
    """transformers 5's own names (`mlp.experts.gate_up_proj` [E, 2I, H]), which
    `to_hf_state_dict` writes, load as the per-expert matrices do."""
    folder, hf, config = saved
    shutil.copy(folder / "config.json", tmp_path)
    reference = from_hf(hf)
    save_file({k: v.contiguous() for k, v in to_hf_state_dict(reference).items()},
              tmp_path / "model.safetensors")
    model = MoEForCausalLM(config, device="meta").materialize("cpu")
    load_hf_shards(model, tmp_path, None)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_random_init_from_meta_trains():
    config = preset("tiny")
    model = build_sharded(config, None, "cpu")
    assert not any(p.is_meta for p in model.parameters())
    ids = torch.randint(0, config.vocab_size, (2, 16))
    assert torch.isfinite(torch.tensor(_train_step_loss(model, ids)))


def _rank_check(folder: str, config, batches: dict, expected: dict) -> dict:
    """On every layout: build, shard, materialise and load; this rank's logits' error against
    HF's, how many elements it read and holds, the local rows of every expert stack, one
    training step's loss; and one step from a random init."""
    from torch.distributed.tensor import DTensor

    def local(tensor):
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    rank = torch.distributed.get_rank()
    read, rows = [], sharded_init._Checkpoint.rows

    def counted(*args):
        tensor = rows(*args)
        read.append(tensor.numel())
        return tensor

    sharded_init._Checkpoint.rows = counted  # this rank process's own copy of the class
    result = {}
    for dp, ep in LAYOUTS:
        layout = distributed.init_layout(dp, ep, config.num_experts)
        ids = batches[dp, ep][rank]
        read.clear()
        model = build_sharded(config, layout, "cpu", hf_checkpoint=folder)
        stacks = [layer.mlp.experts.gate_up_proj for layer in model.model.layers]
        result[dp, ep] = {
            "error": _relative_error(model(ids).logits, expected[dp, ep][rank]),
            "read": sum(read),
            "held": sum(local(p).numel() for p in model.parameters()),
            # FSDP2 shards every dense weight; the experts only where a dp group shares them
            # (`distributed.experts_outside_fsdp`: with dp = 1 they stay plain tensors)
            "dtensors": {kind: all(isinstance(p, DTensor) for name, p in model.named_parameters()
                                   if is_expert_parameter(name) == (kind == "experts"))
                         for kind in ("dense", "experts")},
            "global_rows": [tuple(s.shape) for s in stacks],
            "local_rows": [tuple(local(s).shape) for s in stacks],
            "loss_after_step": _train_step_loss(model, ids),
            "random_init_loss": _train_step_loss(build_sharded(config, layout, "cpu"), ids)}
    return result


def test_two_ranks_load_their_shards_only(saved):
    folder, hf, config = saved
    torch.manual_seed(1)
    batches = {layout: [torch.randint(0, config.vocab_size, (2, 16)) for _ in range(2)]
               for layout in LAYOUTS}
    with torch.no_grad():
        expected = {layout: [hf(ids).logits for ids in ids_of_ranks]
                    for layout, ids_of_ranks in batches.items()}
    results = ranks.run(_rank_check, 2, str(folder), config, batches, expected, timeout_s=120)
    e, i, h = config.num_experts, config.intermediate_size, config.hidden_size
    for rank, result in enumerate(results):
        for (dp, ep), r in result.items():
            assert r["error"] <= TOLERANCE, (rank, dp, ep, r["error"])
            assert r["dtensors"] == {"dense": True, "experts": dp > 1}, (dp, ep, r["dtensors"])
            assert r["read"] == r["held"]  # its own rows, each read once
            # the stack holds this rank's ep block, and this rank only its dp chunk of it
            assert r["global_rows"] == [(e // ep, 2 * i, h)] * config.num_layers
            assert r["local_rows"] == [(e // ep // dp, 2 * i, h)] * config.num_layers
            assert all(torch.isfinite(torch.tensor([r["loss_after_step"],
                                                    r["random_init_loss"]])))
    print({f"rank{rank} dp{dp}xep{ep}": r["error"]
           for rank, result in enumerate(results) for (dp, ep), r in result.items()})


# ---------------------------------------------------------------------------------------------
# Checkpoints that do not fit

def _edited_copy(saved, tmp_path, edit_weights=None, edit_config=None):
    folder, _, _ = saved
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    if edit_weights:
        weights = load_file(tmp_path / "model.safetensors")
        edit_weights(weights)
        save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    if edit_config:
        hf_config = json.loads((tmp_path / "config.json").read_text())
        edit_config(hf_config)
        (tmp_path / "config.json").write_text(json.dumps(hf_config))
    return tmp_path


def _load(saved, folder):
    model = MoEForCausalLM(saved[2], device="meta").materialize("cpu")
    load_hf_shards(model, folder, None)


def test_a_missing_directory_is_named(saved, tmp_path):
    with pytest.raises(CheckpointError, match="nowhere is not a directory"):
        _load(saved, tmp_path / "nowhere")


def test_a_missing_tensor_is_named(saved, tmp_path):
    folder = _edited_copy(saved, tmp_path, edit_weights=lambda w: w.pop(
        "model.layers.1.block_sparse_moe.experts.2.w3.weight"))
    with pytest.raises(CheckpointError, match=r"no tensor 'model.layers.1.mlp.experts.2.w3"):
        _load(saved, folder)


def test_a_shape_mismatch_is_named(saved, tmp_path):
    def truncate(weights):
        weights["model.norm.weight"] = weights["model.norm.weight"][:-1].clone()

    with pytest.raises(CheckpointError, match=r"model.norm.weight has shape \[31\], this model's"):
        _load(saved, _edited_copy(saved, tmp_path, edit_weights=truncate))


def test_another_config_is_named(saved, tmp_path):
    folder = _edited_copy(saved, tmp_path, edit_config=lambda c: c.update(rms_norm_eps=1e-3))
    with pytest.raises(CheckpointError, match="norm_eps: checkpoint 0.001"):
        _load(saved, folder)


def test_train_dist_starts_from_an_hf_checkpoint(saved):
    """`train_dist --mode train --hf-checkpoint DIR` on dp1 × ep2: the first step's loss (the
    mean over the 2 ranks) is the loss the checkpoint's weights give on the two ranks' first
    batches, each rank its share of the windows; a replicated engine is refused up front."""
    from moe_tutorial.train.data import load_protein_data
    from moe_tutorial.train.loop import _batches

    folder, hf, config = saved
    args = ("--mode", "train", "--hf-checkpoint", str(folder), "--steps", "2", "--batch", "2",
            "--max-sequences", "100")
    history = train_dist.launch(2, *args, timeout=300, echo=False)["results"][0]["history"]
    data = load_protein_data(config.max_seq_len, max_sequences=100)
    model = from_hf(hf)
    losses = [model(*next(_batches(data.train[rank::2], 2, 0, 0))).lm_loss for rank in (0, 1)]
    assert len(history) == 2
    assert history[0]["loss"] == pytest.approx(torch.stack(losses).mean().item(), rel=1e-5)
    replicated = train_dist.parse_args([*args, "--engine", "replicated"])
    with pytest.raises(ValueError, match="--hf-checkpoint loads into FSDP2 shards"):
        train_dist.from_hf_checkpoint(replicated, config, None, "cpu", torch.float32,
                                      torch.float32)
