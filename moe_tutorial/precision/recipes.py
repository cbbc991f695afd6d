"""Which Transformer Engine recipe a machine trains with, and what the recipe asks of the data.

A model's precision is one `Precision` value (the recipe, the rows per expert it needs, its
label), resolved once from a name where the name comes in (`resolve`: "bf16", "fp8",
"closest_to_mxfp8" or a TE recipe name) and read from then on. `recipe_for(capabilities)` picks
the low-precision recipe this machine runs natively (MXFP8 on compute capability 10.x-11.x,
B200/B300; FP8 delayed, current or block scaling on Hopper) with an honest label, or MXFP8
emulated in PyTorch (`moe_tutorial.precision.quant`) where TE runs none. `alignment(name)` is
TE's own rule for the rows each expert's grouped GEMM needs, and `RecipeSpec` / `recipe_spec`
describe a recipe as plain data, so TE's decisions that read a recipe (alignment, the fused
grouped MLP) can be modelled on a machine without TE; the experts read the active one from
`te.autocast` (`active_recipe`).

The rules read the capability table (`hardware.evaluate`), never the GPU directly, so tests and
notebooks ask them about machines described by hand.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from . import hardware
from .quant import MX_BLOCK

TE_RECIPES = ("MXFP8BlockScaling", "Float8BlockScaling", "Float8CurrentScaling", "DelayedScaling")
EMULATED_MXFP8 = "emulated_mxfp8"
PREFERENCES = ("fastest", "closest_to_mxfp8")

# recipe -> (capability key, label)
_RECIPE_FACTS = {
    "MXFP8BlockScaling": ("mxfp8", "MXFP8 (native: compute capability 10.x-11.x, e.g. B200/B300)"),
    "Float8BlockScaling": ("fp8_block", "FP8 block scaling — Hopper's closest to MXFP8"),
    "Float8CurrentScaling": ("fp8_current", "FP8 per-tensor current scaling"),
    "DelayedScaling": ("fp8_delayed", "FP8 per-tensor delayed scaling (amax history)"),
}
# Most preferred first. Hopper, "fastest": delayed scaling measured fastest on the H200 in this
# course's benchmark (the te_ops rows of benchmarks/results/h200.json: current scaling pays an
# extra amax pass over every tensor); block scaling is the slower, closer-to-MX one.
_ORDER = {
    "fastest": ("MXFP8BlockScaling", "DelayedScaling", "Float8CurrentScaling",
                "Float8BlockScaling"),
    "closest_to_mxfp8": ("MXFP8BlockScaling", "Float8BlockScaling", "Float8CurrentScaling",
                         "DelayedScaling"),
}
# The FP8 format each recipe trains with in this course (Precision.build). MXFP8 and block
# scaling use E4M3 in both passes (per-block scales already cover the gradients' range, so E4M3's
# extra mantissa bit wins; BioNeMo's Mixtral recipe does this for MXFP8, and TE's fused grouped
# MLP declines anything else). Per-tensor current and delayed scaling use HYBRID: E4M3 forward,
# E5M2 for gradients, whose range one per-tensor scale cannot otherwise cover (TE's default).
_COURSE_FORMAT = {"Float8CurrentScaling": "HYBRID", "DelayedScaling": "HYBRID"}


def alignment(recipe_name: str | None) -> int:
    """Rows per expert a recipe's grouped GEMMs need: TE 2.20's own rule,
    `transformer_engine.pytorch.quantization.get_align_size_for_quantization` — 32 for MXFP8
    (one E8M0 scale per 32 rows of the columnwise copy), 128 for NVFP4, 16 for every other FP8
    recipe (Float8BlockScaling included). No recipe (bf16): 1. The MXFP8 emulation pads like MXFP8.
    The fused grouped MLP needs more (256 rows per expert): see `experts.FUSED_MLP_ROWS_PER_EXPERT`."""
    if recipe_name is None:
        return 1
    if recipe_name in ("MXFP8BlockScaling", EMULATED_MXFP8):
        return MX_BLOCK
    if recipe_name == "NVFP4BlockScaling":
        return 128
    if recipe_name in _RECIPE_FACTS:
        return 16
    raise ValueError(f"unknown recipe {recipe_name!r}; choose one of "
                     f"{TE_RECIPES + ('NVFP4BlockScaling', EMULATED_MXFP8)}")


@dataclass(frozen=True)
class RecipeSpec:
    """What TE's decisions read from a recipe object, as plain data, so those decisions can be
    modelled (and tested) on a machine without TE: the recipe class name, its FP8 format
    ("E4M3": E4M3 in both passes; "HYBRID": E4M3 forward, E5M2 backward) and, for NVFP4, whether
    the random Hadamard transform is off."""

    name: str
    fp8_format: str = "E4M3"
    disable_rht: bool = False

    @property
    def backward_format(self) -> str:
        return "E5M2" if self.fp8_format == "HYBRID" else "E4M3"

    def build(self):
        """The Transformer Engine recipe object this describes (needs TE)."""
        recipe = importlib.import_module("transformer_engine.common.recipe")
        if self.name == "NVFP4BlockScaling":
            return recipe.NVFP4BlockScaling(disable_rht=self.disable_rht)
        return getattr(recipe, self.name)(fp8_format=getattr(recipe.Format, self.fp8_format))


def active_recipe() -> RecipeSpec | None:
    """The recipe of the enclosing `te.autocast` (None outside one, or without TE): what TE's
    own ops read to decide how to quantize, so the course's experts read it the same way."""
    if hardware.transformer_engine() is None:
        return None
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    if not FP8GlobalStateManager.is_fp8_enabled():
        return None
    return recipe_spec(FP8GlobalStateManager.get_fp8_recipe())


def recipe_spec(recipe) -> RecipeSpec | None:
    """`RecipeSpec` of None (bf16: None), a recipe class name (with the format this course trains
    it in), a `Precision`, a `RecipeSpec`, or a Transformer Engine recipe object."""
    if recipe is None or isinstance(recipe, RecipeSpec):
        return recipe
    if isinstance(recipe, Precision):
        return recipe.recipe
    if isinstance(recipe, str):
        return RecipeSpec(recipe, _COURSE_FORMAT.get(recipe, "E4M3"))
    fmt = getattr(recipe, "fp8_format", None)  # a TE recipe: fp8_format is a Format enum
    return RecipeSpec(type(recipe).__name__, getattr(fmt, "name", "E4M3"),
                      bool(getattr(recipe, "disable_rht", False)))


@dataclass(frozen=True)
class Precision:
    """How a model trains, decided once from a name (`resolve`) and read from then on: in its
    own dtype (bf16: `recipe` None, no autocast) or under one low-precision recipe.

    `recipe`: the recipe as plain data; its name is a TE recipe class name, or "emulated_mxfp8"
    where TE runs none (then `native` is False: training stays in bf16 while `quant` reproduces
    MXFP8's numbers). `align`: rows per expert the recipe's grouped GEMMs need (`alignment`,
    TE's rule). `label`: what to call it; `reason`: why this machine gets it.
    """

    recipe: RecipeSpec | None
    label: str
    align: int = 1
    native: bool = True
    reason: str = ""

    @property
    def name(self) -> str:
        """"bf16", or the recipe's name (e.g. "DelayedScaling")."""
        return BF16_NAME if self.recipe is None else self.recipe.name

    def build(self):
        """The TE recipe object to enter `te.autocast` with (None for bf16), e.g.
        ``MXFP8BlockScaling(fp8_format=Format.E4M3)``, in the FP8 format this course trains the
        recipe in (`_COURSE_FORMAT`: E4M3 for the block-scaled recipes, HYBRID for the
        per-tensor ones)."""
        if self.recipe is None:
            return None
        if not self.native:
            raise RuntimeError(f"{self.name} is not a Transformer Engine recipe on this machine "
                               f"({self.reason}); its numerics run in moe_tutorial.precision.quant instead")
        return self.recipe.build()


BF16_NAME = "bf16"
BF16 = Precision(None, "bf16 (the model's dtype; fp32 on a CPU): no FP8 recipe")
# The names `resolve` takes: bf16, "fp8" (the fastest FP8 recipe this machine runs), the other
# preference, or a TE recipe by name.
PRECISION_NAMES = (BF16_NAME, "fp8", "closest_to_mxfp8") + TE_RECIPES


def resolve(precision: str | Precision, capabilities=None) -> Precision:
    """The `Precision` a name means on this machine (`capabilities`, default
    `hardware.capabilities()`): "bf16"; "fp8", the fastest FP8 recipe (`recipe_for`'s
    "fastest"); "closest_to_mxfp8"; or a TE recipe name (`PRECISION_NAMES`). A `Precision`
    is returned as it is. Where TE runs no FP8 recipe the result is MXFP8 emulated
    (`native` False), which only `quant` can run."""
    if isinstance(precision, Precision):
        return precision
    if precision not in PRECISION_NAMES:
        raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISION_NAMES}")
    if precision == BF16_NAME:
        return BF16
    caps = capabilities or hardware.capabilities()
    return recipe_for(caps, "fastest" if precision == "fp8" else precision)


def _machine_name(capabilities) -> str:
    env = capabilities.env
    if not env.cuda_available:
        return "this machine (no CUDA GPU)"
    major, minor = env.compute_capability
    return f"{env.gpu_name} (compute capability {major}.{minor})"


def recipe_capability(name: str) -> str:
    """The capability-table row (`hardware.capabilities()[key]`) that says whether TE recipe
    `name` runs here, e.g. "mxfp8" for MXFP8BlockScaling."""
    if name not in _RECIPE_FACTS:
        raise ValueError(f"unknown TE recipe {name!r}; choose one of {TE_RECIPES}")
    return _RECIPE_FACTS[name][0]


def supported_recipes(capabilities) -> list[str]:
    """The TE recipes this machine runs natively, from `hardware.evaluate(...)`'s table."""
    return [name for name in TE_RECIPES if capabilities.is_native(recipe_capability(name))]


def recipe_for(capabilities, preference: str = "fastest") -> Precision:
    """The recipe to train with on this machine.

    `preference`: "fastest", "closest_to_mxfp8", or a TE recipe name from `TE_RECIPES`.
    Blackwell: MXFP8BlockScaling for both preferences. Hopper: DelayedScaling (fastest)
    or Float8BlockScaling (closest to MXFP8). Without a TE FP8 recipe: MXFP8 emulated in
    PyTorch (`native=False`). A named recipe this machine cannot run is a ValueError.
    """
    supported = supported_recipes(capabilities)
    machine = _machine_name(capabilities)
    if preference in TE_RECIPES:
        if preference not in supported:
            key = _RECIPE_FACTS[preference][0]
            raise ValueError(
                f"{machine} cannot run {preference} ({capabilities[key].reason}); it supports "
                f"{', '.join(supported) if supported else 'no TE recipe'}"
                + ("" if supported else " - use preference 'fastest' or 'closest_to_mxfp8' for "
                                        "MXFP8 numerics emulated in PyTorch"))
        return _te_choice(preference, f"requested by name; {machine} runs it natively")
    if preference not in _ORDER:
        raise ValueError(f"unknown recipe preference {preference!r}; choose one of "
                         f"{list(PREFERENCES) + list(TE_RECIPES)}")
    for name in _ORDER[preference]:
        if name in supported:
            return _te_choice(name, _why(name, preference, capabilities, machine))
    if capabilities.has_te:
        label = "MXFP8 numerics emulated in PyTorch (no TE FP8 recipe on this GPU)"
    else:
        label = "MXFP8 numerics emulated in PyTorch (no TE on this machine)"
    return Precision(RecipeSpec(EMULATED_MXFP8), label, align=alignment(EMULATED_MXFP8),
                     native=False, reason=f"{machine}: {capabilities['mxfp8'].reason}")


def _te_choice(name: str, reason: str) -> Precision:
    return Precision(recipe_spec(name), _RECIPE_FACTS[name][1], align=alignment(name),
                     reason=reason)


def _why(name: str, preference: str, capabilities, machine: str) -> str:
    if name == "MXFP8BlockScaling":
        return f"{machine} runs MXFP8 GEMMs natively: the fastest recipe and MXFP8 itself"
    no_mx = f"{machine} has no MXFP8 GEMMs ({capabilities['mxfp8'].reason})"
    if name == "Float8BlockScaling":
        return f"{no_mx}; FP8 block scaling is the closest: per-block power-of-two scales"
    if name == "DelayedScaling" and preference == "fastest":
        return (f"{no_mx}; per-tensor delayed scaling measured fastest on the H200 (no extra amax "
                "pass: scales come from the amax history)")
    if name == "Float8CurrentScaling":
        return f"{no_mx}; per-tensor current scaling (scales from this step's amax)"
    return f"{no_mx}; delayed scaling is the only FP8 recipe left for '{preference}'"


def check_backend_runs(backend: str, precision: Precision, capabilities) -> None:
    """Refuse an expert backend and recipe that TE cannot run together here, before it fails
    deep inside cuBLAS."""
    cc = capabilities.env.compute_capability or (0, 0)
    if backend == "te_ops" and precision.name == "Float8BlockScaling" and cc[0] == 9:
        raise ValueError(
            "te.ops GroupedLinear with Float8BlockScaling finds no cuBLAS GEMM algorithm on "
            f"{capabilities.env.gpu_name} (compute capability {cc[0]}.{cc[1]}; TE 2.20 with CUDA "
            "13.0's cuBLASLt, rows padded to 16 or 128: benchmarks/results/"
            "h200_block_scaling_alignment.json; TE moves Hopper's block scaling to its grouped "
            "GEMM path only from cuBLASLt 13.6): use the te_grouped_linear backend, whose "
            "block-scaled GEMMs run there, or precision 'fp8' with te_ops")
