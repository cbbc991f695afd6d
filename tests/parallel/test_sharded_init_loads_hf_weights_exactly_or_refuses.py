"""Building a model sharded from an HF checkpoint loads its weights exactly (bf16 weights into an
fp32 model), refuses a cast that would change their values (fp32 weights into a bf16 model)
naming both dtypes, and a random init leaves the padding token's embedding row at zero."""

from __future__ import annotations

import pytest
import torch

from moe_tutorial.moe.config import preset
from moe_tutorial.train.checkpoint import CheckpointError


def _mixtral_hf(dtype=torch.float32):
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(**preset("tiny").to_hf_config_kwargs())
    return transformers.MixtralForCausalLM._from_config(config, attn_implementation="sdpa",
                                                        dtype=dtype)


@pytest.fixture(scope="module")
def bf16_and_fp32_checkpoints(tmp_path_factory):
    """A tiny Mixtral saved by save_pretrained in bf16 and in fp32."""
    folders = {}
    for dtype in (torch.bfloat16, torch.float32):
        folder = tmp_path_factory.mktemp(str(dtype).removeprefix("torch."))
        _mixtral_hf(dtype).save_pretrained(folder, safe_serialization=True)
        folders[dtype] = folder
    return folders


def test_a_bf16_checkpoint_loads_into_fp32_exactly(bf16_and_fp32_checkpoints):
    from safetensors.torch import load_file

    from moe_tutorial.parallel.sharded_init import build_sharded

    folder = bf16_and_fp32_checkpoints[torch.bfloat16]
    model = build_sharded(preset("tiny"), None, "cpu", hf_checkpoint=folder)
    saved = load_file(str(folder / "model.safetensors"))
    assert torch.equal(model.lm_head.weight, saved["lm_head.weight"].float())


def test_an_fp32_checkpoint_into_a_bf16_model_is_refused_naming_both(bf16_and_fp32_checkpoints):
    from moe_tutorial.parallel.sharded_init import build_sharded

    with pytest.raises(CheckpointError, match=r"is F32, this model's weights torch.bfloat16: the "
                                              r"cast would change its values"):
        build_sharded(preset("tiny", dtype="bfloat16"), None, "cpu",
                      hf_checkpoint=bf16_and_fp32_checkpoints[torch.float32])


def test_a_sharded_random_init_leaves_the_padding_row_at_zero():
    from moe_tutorial.parallel.sharded_init import build_sharded

    model = build_sharded(preset("tiny", pad_token_id=3), None, "cpu")
    weight = model.model.embed_tokens.weight
    assert weight[3].abs().max() == 0 and weight[4].abs().max() > 0
