"""Exercise 04's checks: the recipe and row alignment for a machine."""

from __future__ import annotations

from ...precision import hardware, recipes
from .harness import (
    Case,
    Failure,
    expect_tuple,
    run_check,
)

# The package's implementation with the exercise's signature (`checks.reference`)

def reference_choose_recipe(caps, preference="fastest"):
    """recipes.recipe_for"""
    choice = recipes.recipe_for(caps, preference)
    return choice.name, choice.align


_ALIGN_WHY = {
    "MXFP8BlockScaling": "its scales cover 32 rows when the weight-gradient GEMM reads the "
                         "activations column-wise",
    "Float8BlockScaling": "TE's get_align_size_for_quantization pads every recipe but MXFP8 and "
                          "NVFP4 to 16 rows; block scaling's 1x128 and 128x128 tiles do not raise it",
    "Float8CurrentScaling": "FP8 tensor-core GEMMs need row counts that are multiples of 16",
    "DelayedScaling": "FP8 tensor-core GEMMs need row counts that are multiples of 16",
    recipes.EMULATED_MXFP8: "MXFP8's blocks are 32 values (the emulation pads like the real recipe)",
}


def _recipe_cases() -> list[Case]:
    env = hardware.fake_environment
    no_block = {"fp8": (True, ""), "fp8_block_scaling": (False, "FP8 block scaling requires CUDA "
                                                                 "12.9 or newer"),
                "mxfp8": (False, "Device compute capability 10.0 or higher required for MXFP8 "
                                 "execution.")}
    machines = [
        ("B200 (Blackwell)", env("blackwell")),
        ("H200 (Hopper)", env("hopper")),
        ("a CPU", env("cpu")),
        ("H100 with CUDA 12.8 (no FP8 block scaling)", env("hopper", gpu_name="NVIDIA H100",
                                                            cuda_version="12.8",
                                                            te_support=no_block)),
        ("L40S (Ada, compute capability 8.9)", env("hopper", gpu_name="NVIDIA L40S",
                                                   compute_capability=(8, 9), te_support=no_block)),
        ("an H200 without Transformer Engine", env("hopper", te_version=None, te_support={},
                                                   te_import_error="ImportError: No module named "
                                                                   "'transformer_engine'")),
        ("RTX PRO 6000 (Blackwell, compute capability 12.0: TE refuses MXFP8)",
         env("rtx_blackwell")),
    ]
    cases = []
    for name, environment in machines:
        caps = hardware.evaluate(environment)
        for preference in recipes.PREFERENCES:
            cases.append(Case(f"{name}, preference {preference!r}", (caps, preference),
                              {"machine": name}))
    return cases


def _verify_recipe(case: Case, call) -> None:
    caps, preference = case.args
    got = call(caps, preference)
    if isinstance(got, recipes.Precision):
        raise Failure("you returned recipes.recipe_for's Precision; the table below unpacks "
                      "two values, so return (choice.name, choice.align)")
    name, align = expect_tuple(got, 2, "(recipe name, alignment)")
    if not isinstance(name, str):
        raise Failure(f"your recipe name is {type(name).__name__} {name!r:.60}; return the TE "
                      "recipe class's name as a str, e.g. 'DelayedScaling'")
    want = recipes.recipe_for(caps, preference)
    machine = case.info["machine"]
    supported = recipes.supported_recipes(caps)
    if name != want.name:
        if name not in recipes.TE_RECIPES and name != recipes.EMULATED_MXFP8:
            raise Failure(f"{name!r} is not a recipe name: use a TE recipe class name "
                          f"({', '.join(recipes.TE_RECIPES)}) or {recipes.EMULATED_MXFP8!r}")
        if name in recipes.TE_RECIPES and name not in supported:
            feature = caps[recipes.recipe_capability(name)]
            native = ", ".join(supported) or f"nothing, so MXFP8 is emulated: {recipes.EMULATED_MXFP8}"
            raise Failure(f"{machine} cannot run {name} ({feature.reason}): choose among what "
                          f"caps says runs natively ({native})")
        if name == recipes.EMULATED_MXFP8:
            raise Failure(f"{machine} runs {', '.join(supported)} natively: emulate MXFP8 only "
                          "where no TE FP8 recipe runs")
        raise Failure(f"with preference {preference!r}, {machine} should use {want.name}, yours "
                      f"is {name}: {want.reason}")
    if not isinstance(align, int) or isinstance(align, bool):
        raise Failure(f"your alignment is {type(align).__name__} {align!r:.40}; return the rows "
                      f"per expert as an int ({want.align} for {want.name})")
    if align != want.align:
        raise Failure(f"{want.name} needs every expert's rows padded to a multiple of "
                      f"{want.align} ({_ALIGN_WHY[want.name]}); yours is {align!r}")


def check_choose_recipe(learner_fn) -> bool:
    """`choose_recipe(caps, preference) -> (recipe name, alignment)` against `recipes.recipe_for`
    on fake Blackwell, Hopper, Ada and CPU machines (`hardware.fake_environment`)."""
    return run_check("check_choose_recipe", learner_fn, _recipe_cases(), _verify_recipe,
                     against="recipes.recipe_for")
