"""A sharded model that no rank ever holds whole: built on the meta device, sharded, then each
rank gives real storage to its own shards only and fills them, at random or from an HF
checkpoint read shard by shard.

    model = build_sharded(config, layout, device)                 # random init of the shards
    model = build_sharded(config, layout, device, hf_checkpoint="Mixtral-8x7B/")   # HF weights

`distributed.shard_experts` and `fully_shard_layout` need the full model first; on a real device
that is every weight on every rank, which is what sharding was for. On the meta device a tensor
has a shape and no storage, so the model is built and sharded there for free, and
`MoEForCausalLM.materialize` then allocates only what this rank holds (`to_empty`: FSDP2's
local shards, this rank's ep block of experts).

`load_hf_shards` fills them from a Hugging Face checkpoint directory (`save_pretrained`'s
`*.safetensors` and `config.json`). `safetensors.safe_open(...).get_slice(name)[a:b]` reads rows
a..b of a tensor from the file without the rest, so a rank reads only its rows: its FSDP2 slice
(`torch.chunk`'s split of dim 0, `dist_checkpoint._local_rows`) of a dense weight, and of the
experts only those of its FSDP2 chunk of its ep block.

The experts come in either of the layouts HF checkpoints use: transformers 5's stacked
`mlp.experts.gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]` (this model's own), or one matrix
per expert, as transformers 5.24's `save_pretrained` still writes Mixtral
(`block_sparse_moe.experts.{e}.w1.weight` the gate [I, H], `w3` the up projection, `w2` the down
projection [H, I]; Qwen-MoE and OLMoE checkpoints: `gate_proj`, `up_proj`, `down_proj`).
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from ..moe import families
from ..moe.config import MoEConfig
from ..moe.experts import StackedExperts
from ..moe.model import MoEForCausalLM
from ..train.checkpoint import CheckpointError
from .dist_checkpoint import _local_rows
from .distributed import Layout, fully_shard_layout, shard_experts

# The names one expert's matrices have in per-expert checkpoints: (gate, up, down).
PER_EXPERT_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))

# safetensors' dtype names, and the casts that keep every value (a wider float).
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16,
                      "F16": torch.float16}
EXACT_CASTS = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
               (torch.bfloat16, torch.float64), (torch.float16, torch.float64),
               (torch.float32, torch.float64)}

# MoEConfig fields that training sets, not the checkpoint's weights: they may differ from
# config.json (the weights are read into the model's dtype where that holds them exactly:
# `_Checkpoint.rows`).
TRAINING_FIELDS = ("aux_loss_coef", "init_std", "dtype", "max_seq_len",
                   "router_bias_update_rate")


def build_sharded(config: MoEConfig, layout: Layout | None, device, *,
                  hf_checkpoint: str | Path | None = None, mp_policy=None) -> MoEForCausalLM:
    """The model of `config` sharded over `layout` (`shard_experts`, then FSDP2's
    `fully_shard_layout`; None: one process, nothing sharded), with storage on `device` for
    this rank's shards only: randomly initialised (`reset_parameters`, each rank its own
    slices), or read from `hf_checkpoint` (`load_hf_shards`). Every rank calls it."""
    model = MoEForCausalLM(config, device="meta")
    if layout is not None:
        shard_experts(model, layout)
        fully_shard_layout(model, layout, mp_policy=mp_policy)
    model.materialize(device)
    if hf_checkpoint is None:
        model.reset_parameters()
        _zero_padding_row(model)
    else:
        load_hf_shards(model, hf_checkpoint, layout)
    return model


@torch.no_grad()
def _zero_padding_row(model: MoEForCausalLM) -> None:
    """The embedding's padding row (`MoEConfig.pad_token_id`) at zero on the rank holding it, as
    `reset_parameters` leaves it in a whole model."""
    pad = model.config.pad_token_id
    if pad is not None:
        local, first = _local_rows(model.model.embed_tokens.weight)
        if first <= pad < first + local.shape[0]:
            local[pad - first].zero_()


class _Checkpoint:
    """The tensors of a checkpoint's safetensors files under this model's names
    (`families.hf_key_to_ours`), each read by rows without loading the rest."""

    def __init__(self, files: list[Path], stack: contextlib.ExitStack):
        from safetensors import safe_open

        self.slices = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt"))
            for key in handle.keys():
                self.slices[families.hf_key_to_ours(key)] = (key, handle.get_slice(key))

    def __contains__(self, name: str) -> bool:
        return name in self.slices

    def rows(self, name: str, first: int, count: int, shape: tuple[int, ...],
             dtype: torch.dtype) -> torch.Tensor:
        """Rows first..first+count of tensor `name`, which must have the whole shape `shape` and
        a dtype that `dtype` holds exactly (the same, or a wider float: bf16 or fp16 into fp32)."""
        if name not in self.slices:
            raise CheckpointError(f"the checkpoint has no tensor {name!r} (nor its HF spelling): "
                                  f"it is not a checkpoint of this model's family")
        key, tensor = self.slices[name]
        saved = tuple(tensor.get_shape())
        if saved != tuple(shape):
            raise CheckpointError(f"the checkpoint's {key} has shape {list(saved)}, this model's "
                                  f"{list(shape)}: the checkpoint is of another model size")
        stored = SAFETENSORS_DTYPES.get(tensor.get_dtype())
        if stored != dtype and (stored, dtype) not in EXACT_CASTS:
            raise CheckpointError(f"the checkpoint's {key} is {tensor.get_dtype()}, this model's "
                                  f"weights {dtype}: the cast would change its values; build the "
                                  f"model in the checkpoint's dtype (MoEConfig(dtype=...)), or in "
                                  f"float32, which holds bf16 and fp16 exactly")
        return tensor[first:first + count]


def _files(hf_dir_or_files) -> tuple[Path, list[Path]]:
    """(the folder holding config.json, the safetensors files) of a checkpoint directory or a
    list of its files."""
    if isinstance(hf_dir_or_files, (str, Path)):
        folder = Path(hf_dir_or_files)
        if not folder.is_dir():
            raise CheckpointError(f"{folder} is not a directory: pass the directory that "
                                  f"save_pretrained wrote (its *.safetensors and config.json)")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{folder} holds no *.safetensors files: save the model with "
                                  f"save_pretrained(..., safe_serialization=True)")
        return folder, files
    files = [Path(f) for f in hf_dir_or_files]
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise CheckpointError(f"no safetensors files to read: {missing or 'an empty list'}")
    return files[0].parent, files


def check_hf_config(config: MoEConfig, folder: Path) -> None:
    """Refuse a checkpoint whose config.json describes another model than `config`, naming each
    differing field (the training settings of TRAINING_FIELDS may differ)."""
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder} has no config.json: nothing says which model its "
                              f"weights are of. Save it with save_pretrained")
    saved = asdict(MoEConfig.from_hf_config(AutoConfig.from_pretrained(folder)))
    differing = sorted(k for k, v in asdict(config).items()
                       if k not in TRAINING_FIELDS and saved[k] != v)
    if differing:
        detail = ", ".join(f"{k}: checkpoint {saved[k]!r}, model {getattr(config, k)!r}"
                           for k in differing)
        raise CheckpointError(f"{folder}/config.json describes another model ({detail}): build "
                              f"the model with MoEConfig.from_hf_config of the checkpoint's config")


def _expert_stack(checkpoint: _Checkpoint, prefix: str, first: int, count: int,
                  config: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_proj [count, 2I, H], down_proj [count, H, I]) of experts first..first+count of
    one layer (`prefix`: "model.layers.{i}.mlp.experts"), from the stacked or the per-expert
    layout, whichever the checkpoint has."""
    e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
    dtype = config.torch_dtype
    if not count:  # an FSDP2 chunk may be empty (fewer experts in the block than dp ranks)
        return torch.empty(0, 2 * i, h), torch.empty(0, h, i)
    if f"{prefix}.gate_up_proj" in checkpoint:
        return (checkpoint.rows(f"{prefix}.gate_up_proj", first, count, (e, 2 * i, h), dtype),
                checkpoint.rows(f"{prefix}.down_proj", first, count, (e, h, i), dtype))
    names = next((n for n in PER_EXPERT_NAMES if f"{prefix}.0.{n[0]}.weight" in checkpoint),
                 PER_EXPERT_NAMES[0])
    gate, up, down = (f"{prefix}.{{}}.{name}.weight" for name in names)

    def whole(name: str, shape: tuple[int, int]) -> torch.Tensor:
        return checkpoint.rows(name, 0, shape[0], shape, dtype)

    experts = range(first, first + count)
    gate_up = [torch.cat([whole(gate.format(x), (i, h)), whole(up.format(x), (i, h))])
               for x in experts]
    downs = [whole(down.format(x), (h, i)) for x in experts]
    return torch.stack(gate_up), torch.stack(downs)


@torch.no_grad()
def load_hf_shards(model: MoEForCausalLM, hf_dir_or_files, layout: Layout | None) -> None:
    """Fill this rank's shards of `model` from an HF checkpoint (a `save_pretrained` directory,
    or a list of its safetensors files; its config.json is checked against the model's), each
    rank reading only its own rows. `layout`: the one the model was sharded with (None: one
    process, the whole model). Works on a materialised sharded model (`build_sharded`) and on a
    whole one alike; the experts must be the stacked `experts.StackedExperts` (the grouped_torch or naive
    backend: convert afterwards, before sharding). Every tensor the model holds is read;
    `CheckpointError` names a missing tensor or a shape that differs."""
    folder, files = _files(hf_dir_or_files)
    check_hf_config(model.config, folder)
    ep, ep_rank = (layout.ep, layout.ep_rank) if layout is not None else (1, 0)
    per_rank = model.config.num_experts // ep
    with contextlib.ExitStack() as stack:
        checkpoint = _Checkpoint(files, stack)
        persistent = model.state_dict().keys()
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name in persistent and ".mlp.experts." not in name:
                local, first = _local_rows(tensor)
                local.copy_(checkpoint.rows(name, first, local.shape[0], tuple(tensor.shape),
                                            local.dtype))
        for i, layer in enumerate(model.model.layers):
            _load_experts(layer.mlp.experts, checkpoint, f"model.layers.{i}.mlp.experts",
                          ep_rank * per_rank, model.config)


def _load_experts(experts: nn.Module, checkpoint: _Checkpoint, prefix: str, first_expert: int,
                  config: MoEConfig) -> None:
    """One layer's expert shard: the experts of its FSDP2 chunk (all of them unsharded) of the
    block that starts at global expert `first_expert`."""
    if not isinstance(experts, StackedExperts):
        raise ValueError(f"load_hf_shards loads stacked experts (StackedExperts); {prefix} is a "
                         f"{type(experts).__name__}: load into the grouped_torch backend and "
                         f"convert before sharding")
    gate_up, first = _local_rows(experts.gate_up_proj)
    down, _ = _local_rows(experts.down_proj)
    rows = _expert_stack(checkpoint, prefix, first_expert + first, gate_up.shape[0], config)
    gate_up.copy_(rows[0])
    down.copy_(rows[1])
