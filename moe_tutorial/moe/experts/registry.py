"""The expert backends by name: what each one is, whether it runs here, and how to switch.

`BACKENDS` maps a name to the class that runs it and the options it is built with; every
backend takes the same constructor arguments, converts from any other (`from_experts`) and runs
the same forward pass (`base.Experts`). `availability(name)` says whether the backend runs its
own kernels on this machine, and if not, in one line, what runs instead.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch

from ...precision import hardware
from .base import Experts, StackedExperts
from .grouped_torch import GroupedTorchExperts
from .naive import NaiveExperts
from .te_base import TEExperts, why_no_te
from .te_grouped_linear import TEGroupedLinearExperts
from .te_ops import TEOpsExperts
from .te_permute_grouped_mm import TEPermuteGroupedMMExperts


@dataclass(frozen=True)
class Backend:
    """A registered backend: its class, the options it is built with, and (where it has one)
    the part of Transformer Engine it runs, which a machine without TE replaces by PyTorch."""

    cls: type[Experts]
    options: dict = field(default_factory=dict)
    te_part: str | None = None


BACKENDS: dict[str, Backend] = {
    "naive": Backend(NaiveExperts),
    "grouped_torch": Backend(GroupedTorchExperts),
    "te_permute_grouped_mm": Backend(TEPermuteGroupedMMExperts,
                                     te_part="TE's permutation kernels"),
    "te_grouped_linear": Backend(TEGroupedLinearExperts, te_part="te.GroupedLinear"),
    "te_ops": Backend(TEOpsExperts, te_part="te.ops' grouped MLP"),
}
EXPERT_BACKENDS = tuple(BACKENDS)
# The backends on one stacked weight layout (`base.StackedExperts`), and those with TE's own
# per-expert parameters
STACKED_BACKENDS = tuple(name for name, b in BACKENDS.items() if issubclass(b.cls, StackedExperts))
TE_BACKENDS = tuple(name for name, b in BACKENDS.items() if issubclass(b.cls, TEExperts))


def _backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"unknown expert backend {name!r}; choose one of {EXPERT_BACKENDS}")
    return BACKENDS[name]


def availability(name: str) -> tuple[bool, str]:
    """(whether backend `name` runs its own kernels on this machine, one line saying what runs:
    for a TE backend without TE on a GPU, why, and that its pure-PyTorch counterpart runs)."""
    backend = _backend(name)
    if backend.te_part is None:
        return True, f"{name}: runs here"
    if torch.cuda.is_available() and hardware.transformer_engine() is not None:
        return True, f"{name}: {backend.te_part} on this GPU"
    return False, (f"{name}: pure-PyTorch stand-in of {backend.te_part} ({why_no_te()})")


def create(name: str, num_experts: int, hidden_size: int, intermediate_size: int, *,
           dtype=None, device=None, **options) -> Experts:
    """A new experts module of backend `name` (weights uninitialised, as nn.Parameter leaves
    them: initialise them, or `load_hf_weights`)."""
    backend = _backend(name)
    _check_options(name, backend, options)
    return backend.cls(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device,
                       **backend.options, **options)


def convert_experts(experts: Experts, name: str, **options) -> Experts:
    """An experts module running backend `name` with the same weights as `experts` (shared
    among the stacked-layout backends, copied through the HF layout to or from a TE one).
    `options` go to the backend's class (the TE backends take `align` and `cutlass`, te_ops also
    `glu_interleave_size` and `require_fused`)."""
    backend = _backend(name)
    _check_options(name, backend, options)
    return backend.cls.from_experts(experts, **backend.options, **options)


def _check_options(name: str, backend: Backend, options: dict) -> None:
    if options and not issubclass(backend.cls, TEExperts):
        raise ValueError(f"backend {name!r} takes no options, got {sorted(options)}")
    # Each TE backend takes its class's keyword options, less what the registry fixes and the
    # placement (dtype, device), which conversion takes from the experts converted.
    takes = {p.name for p in inspect.signature(backend.cls.__init__).parameters.values()
             if p.kind is p.KEYWORD_ONLY} - set(backend.options) - {"dtype", "device"}
    unknown = sorted(set(options) - takes)
    if unknown:
        raise ValueError(f"backend {name!r} takes no option {', '.join(unknown)}; its options: "
                         f"{', '.join(sorted(takes))}")


def backend_label(experts: Experts) -> str:
    """The experts module's backend as a figure's legend or a table should name it: the backend,
    and where its Transformer Engine part does not run here (no TE, or not on a CUDA device),
    what runs instead, e.g. "te_grouped_linear: pure-PyTorch stand-in of te.GroupedLinear"."""
    te_part = BACKENDS[experts.backend].te_part
    if te_part is None or experts.uses_te:
        return experts.backend
    return f"{experts.backend}: pure-PyTorch stand-in of {te_part}"


# The largest expert, in weight elements per projection (hidden × intermediate), for which
# `default_backend` picks `te_permute_grouped_mm` in bf16; above it, `te_ops`. From the expert
# layer's bf16 rows in benchmarks/results/h200.json (forward + backward, balanced routing):
# TE's permutation around torch._grouped_mm was the fastest bf16 path for every shape of at most
# 2048 × 7168 = 14.7M elements (the small, OLMoE, Qwen3, fine-grained and DeepSeek-V3 shapes;
# DeepSeek-V3's by under 1% over TE's GroupedLinear, a tie), and te.ops was for Mixtral's
# 4096 × 14336 = 58.7M (its cuBLAS GEMMs beat the CUTLASS grouped kernel there). The boundary
# lies between the two; `tests/moe/experts/test_experts.py` checks the rule against the committed rows.
SMALL_EXPERT_ELEMENTS = 16 * 2**20


def default_backend(hidden_size: int, intermediate_size: int, *, fp8: bool,
                    te_on_gpu: bool) -> str:
    """The expert backend the course picks for experts of this width: `te_ops` under an FP8
    recipe (FP8 runs through TE's GroupedLinear), `te_permute_grouped_mm` in bf16 for experts of
    at most `SMALL_EXPERT_ELEMENTS` weights per projection, `te_ops` for larger ones; without
    TE on a GPU (`te_on_gpu=False`), `grouped_torch`, the pure-PyTorch grouped path."""
    if not te_on_gpu:
        if fp8:
            raise ValueError("FP8 experts need Transformer Engine on a GPU; this machine has "
                             "none (train in bf16, or see recipes.recipe_for for the emulation)")
        return "grouped_torch"
    if fp8 or hidden_size * intermediate_size > SMALL_EXPERT_ELEMENTS:
        return "te_ops"
    return "te_permute_grouped_mm"
