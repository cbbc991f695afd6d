"""Which TE recipe a machine trains with, its alignment, and recipes as plain data
(moe_tutorial.precision.recipes), on machines described by hand."""

import sys
import types

import pytest

from moe_tutorial.precision import hardware, recipes


def machine(kind, **overrides):
    return hardware.evaluate(hardware.fake_environment(kind, **overrides))


@pytest.mark.parametrize("kind,preference,name,align", [
    ("blackwell", "fastest", "MXFP8BlockScaling", 32),
    ("blackwell", "closest_to_mxfp8", "MXFP8BlockScaling", 32),
    ("hopper", "fastest", "DelayedScaling", 16),
    ("hopper", "closest_to_mxfp8", "Float8BlockScaling", 16),
    ("hopper", "DelayedScaling", "DelayedScaling", 16),
    ("blackwell", "Float8BlockScaling", "Float8BlockScaling", 16),
])
def test_recipe_for_gpus(kind, preference, name, align):
    choice = recipes.recipe_for(machine(kind), preference)
    assert (choice.name, choice.native, choice.align) == (name, True, align)
    assert choice.reason


def test_recipe_labels():
    assert recipes.recipe_for(machine("blackwell")).label == (
        "MXFP8 (native: compute capability 10.x-11.x, e.g. B200/B300)")
    hopper_block = recipes.recipe_for(machine("hopper"), "closest_to_mxfp8")
    assert hopper_block.label == "FP8 block scaling — Hopper's closest to MXFP8"
    assert "Device compute capability 10.0" in hopper_block.reason


@pytest.mark.parametrize("preference", recipes.PREFERENCES)
def test_recipe_for_cpu_is_emulated(preference):
    choice = recipes.recipe_for(machine("cpu"), preference)
    assert (choice.name, choice.native, choice.align) == ("emulated_mxfp8", False, 32)
    assert choice.label == "MXFP8 numerics emulated in PyTorch (no TE on this machine)"
    with pytest.raises(RuntimeError, match="not a Transformer Engine recipe"):
        choice.build()


def test_recipe_for_gpu_with_te_but_no_fp8():
    ampere = machine("hopper", gpu_name="NVIDIA A100", compute_capability=(8, 0), te_support={
        name: (False, "needs compute capability 8.9") for name in ("fp8", "fp8_block_scaling", "mxfp8")})
    choice = recipes.recipe_for(ampere)
    assert choice.name == "emulated_mxfp8" and "no TE FP8 recipe" in choice.label


def test_recipe_for_errors_name_the_gpu_the_recipe_and_the_alternatives():
    with pytest.raises(ValueError) as error:
        recipes.recipe_for(machine("hopper"), "MXFP8BlockScaling")
    message = str(error.value)
    for part in ("NVIDIA H200", "compute capability 9.0", "MXFP8BlockScaling", "Float8BlockScaling",
                 "Float8CurrentScaling", "DelayedScaling"):
        assert part in message
    with pytest.raises(ValueError, match="no CUDA GPU.*no TE recipe"):
        recipes.recipe_for(machine("cpu"), "Float8CurrentScaling")
    with pytest.raises(ValueError, match="unknown recipe preference 'bf16'.*closest_to_mxfp8"):
        recipes.recipe_for(machine("hopper"), "bf16")


def test_recipe_build_constructs_the_te_recipe(monkeypatch):
    """build() on a machine with TE, with TE's recipe module stood in for."""
    made = []

    class Format:
        E4M3, HYBRID = "E4M3", "HYBRID"

    fake = types.ModuleType("transformer_engine.common.recipe")
    fake.Format = Format
    for name in recipes.TE_RECIPES:
        setattr(fake, name, lambda fp8_format, name=name: made.append((name, fp8_format)) or name)
    monkeypatch.setitem(sys.modules, "transformer_engine.common.recipe", fake)

    for preference in recipes.TE_RECIPES:
        assert recipes.recipe_for(machine("blackwell"), preference).build() == preference
    assert made == [("MXFP8BlockScaling", "E4M3"), ("Float8BlockScaling", "E4M3"),
                    ("Float8CurrentScaling", "HYBRID"), ("DelayedScaling", "HYBRID")]


def test_recipe_capability_names_the_capability_row():
    assert recipes.recipe_capability("MXFP8BlockScaling") == "mxfp8"
    assert recipes.recipe_capability("DelayedScaling") == "fp8_delayed"
    with pytest.raises(ValueError, match="unknown TE recipe 'MXFP4'"):
        recipes.recipe_capability("MXFP4")


def test_alignment_is_tes_get_align_size_for_quantization():
    """TE 2.20, pytorch/quantization.py: 32 for MXFP8, 128 for NVFP4, 16 for every other recipe."""
    assert recipes.alignment("MXFP8BlockScaling") == 32
    assert recipes.alignment("NVFP4BlockScaling") == 128
    for name in ("Float8BlockScaling", "Float8CurrentScaling", "DelayedScaling"):
        assert recipes.alignment(name) == 16
    assert recipes.alignment(None) == 1 and recipes.alignment("emulated_mxfp8") == 32
    with pytest.raises(ValueError, match="unknown recipe 'FP8'"):
        recipes.alignment("FP8")


def test_recipe_spec_reads_names_choices_and_te_like_objects():
    assert recipes.recipe_spec(None) is None
    assert recipes.recipe_spec("DelayedScaling") == recipes.RecipeSpec("DelayedScaling", "HYBRID")
    assert recipes.recipe_spec("MXFP8BlockScaling").backward_format == "E4M3"

    class Format:  # stands for transformer_engine.common.recipe.Format
        def __init__(self, name):
            self.name = name

    class NVFP4BlockScaling:
        fp8_format, disable_rht = Format("E4M3"), True

    assert recipes.recipe_spec(NVFP4BlockScaling()) == recipes.RecipeSpec("NVFP4BlockScaling", "E4M3", True)


def test_resolve_turns_every_precision_name_into_one_value():
    hopper = machine("hopper")
    assert recipes.resolve("bf16", hopper) is recipes.BF16
    assert (recipes.BF16.name, recipes.BF16.align, recipes.BF16.build()) == ("bf16", 1, None)
    assert recipes.resolve("fp8", hopper) == recipes.recipe_for(hopper, "fastest")
    assert recipes.resolve("closest_to_mxfp8", hopper).name == "Float8BlockScaling"
    assert recipes.resolve("DelayedScaling", hopper).recipe == recipes.RecipeSpec("DelayedScaling",
                                                                                   "HYBRID")
    chosen = recipes.resolve("fp8", machine("blackwell"))
    assert recipes.resolve(chosen) is chosen  # a Precision is already resolved
    assert recipes.recipe_spec(chosen) == chosen.recipe == recipes.RecipeSpec("MXFP8BlockScaling")
    assert set(recipes.PRECISION_NAMES) >= {"bf16", "fp8", *recipes.TE_RECIPES}


def test_resolve_refuses_a_name_it_does_not_know():
    with pytest.raises(ValueError, match="unknown precision 'fp16'.*'bf16', 'fp8'"):
        recipes.resolve("fp16", machine("hopper"))


def test_a_precision_is_a_frozen_value():
    with pytest.raises(AttributeError):
        recipes.BF16.align = 32
