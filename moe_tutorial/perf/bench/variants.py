"""The training step's variants: one way to run it each (`Variant`: our model's expert backend
and precision, or HF's baseline, with options), the sets the benchmark names (`LADDER` ...
`VARIANTS`), and each candidate change beside the ladder variant it changes, in this run and in
the committed ones.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from ...moe.hf_baseline import compile_for_training, hf_mixtral, hf_training_loss
from ...moe.model import MoEForCausalLM
from ...train.loop import TrainSettings, compiled_adamw, make_optimizer
from .. import results
from .expert_layer import precision_kind


@dataclass(frozen=True)
class Variant:
    """One way to run the training step: our model with an expert backend and a precision, or
    HF transformers' Mixtral (its experts implementation, optionally torch.compile'd). `name` is
    the label its results carry: any label for a variant of your own; `Variant.of` derives the
    benchmark's names from the options."""

    name: str  # the label results carry
    backend: str  # ours: the expert backend; HF: experts_implementation ("eager" / "grouped_mm")
    precision: str = "bf16"  # ours: "bf16", "fp8" or a TE recipe name; HF: bf16 only
    hf: bool = False
    compiled: bool = False  # HF: `hf_baseline.compile_for_training`
    # The training loss and its gradient from torch.compile's kernels (ours: the model's
    # `compiled_loss`)
    compiled_loss: bool = False
    # AdamW's step compiled (`train.compiled_adamw`): generic, so HF gets it too
    compiled_adamw: bool = False
    # Ours: every RMSNorm as torch.compile's kernels (the model's `compiled_norms`)
    compiled_norms: bool = False

    @classmethod
    def of(cls, backend: str, precision: str = "bf16", **options) -> Variant:
        """The variant of these options under its derived name: `hf_<backend>` then
        `_compiled` (the model compiled) and `_compiled_adamw`; ours `ours_<backend>_<precision>`
        then `_compiled` for the loss and AdamW compiled together, else `_compiled_loss` or
        `_compiled_adamw` for one of them, then `_compiled_norms`."""
        v = cls("", backend, precision, **options)
        if v.compiled_norms and v.hf:
            raise ValueError("compiled_norms is an option of our model; HF's norms are compiled "
                             "with the rest of its model (compiled=True)")
        if v.hf:
            parts = ["hf", backend, v.compiled and "compiled", v.compiled_adamw and "compiled_adamw"]
        else:
            compiled = ("compiled" if v.compiled_loss and v.compiled_adamw else
                        v.compiled_loss and "compiled_loss" or v.compiled_adamw and "compiled_adamw")
            parts = ["ours", backend, precision, compiled, v.compiled_norms and "compiled_norms"]
        return replace(v, name="_".join(part for part in parts if part))

    @property
    def changes(self) -> bool:
        """Whether this is a change of a ladder variant measured beside it (`candidate_base`)."""
        return self.compiled_loss or self.compiled_adamw or self.compiled_norms

    @property
    def precision_kind(self) -> str:
        """"fp8" or "bf16": the precision of the large GEMMs (the peak its MFU is quoted against)."""
        return precision_kind(self.precision)

    def build(self, config, device):
        """(the trained module, forward(inputs, targets) -> loss) from the seeded initial weights
        every variant shares. HF computes `labels=input_ids` targets itself: the same ones as
        `batch.next_token_targets`, which its forward is handed (comparable losses)."""
        torch.manual_seed(0)
        model = MoEForCausalLM(config, device=device)
        if not self.hf:
            model.set_expert_backend(self.backend)
            model.set_precision(self.precision)
            model.compiled_loss = self.compiled_loss
            model.compiled_norms = self.compiled_norms
            return model, None  # train_step's default: model(inputs, targets)

        hf = hf_mixtral(model, self.backend)
        del model  # only HF's copy of the weights stays on the device
        if self.compiled:
            hf = compile_for_training(hf)
        return hf, lambda inputs, targets: hf_training_loss(hf, inputs)

    def optimizer(self, module, lr: float, kind: str = "torch_adamw"):
        """HF's baseline as HF users run it: torch's fused AdamW over all parameters; ours: the
        course's `train.make_optimizer` (`kind`: torch's or TE's fused AdamW). `compiled_adamw`:
        torch's AdamW with its step compiled (`train.compiled_adamw`), for HF over all parameters
        too."""
        if self.compiled_adamw and kind != "torch_adamw":
            raise ValueError(f"variant {self.name} chooses its own optimizer; --optimizer "
                             f"{kind} does not apply to it")
        settings = TrainSettings(lr=lr, steps=2, warmup_steps=0)
        if self.hf:
            if self.compiled_adamw:
                return compiled_adamw([{"params": list(module.parameters())}], settings)
            return torch.optim.AdamW(module.parameters(), lr=lr,
                                     fused=next(module.parameters()).is_cuda or None)
        return make_optimizer(module, settings,
                              "torch_adamw_compiled" if self.compiled_adamw else kind)


def _expand(*grids: dict) -> tuple[Variant, ...]:
    """`Variant.of` of every combination of each grid's values, in order (a grid maps an option
    to one value or a tuple of values; its last option varies fastest)."""
    return tuple(Variant.of(**dict(zip(grid, values))) for grid in grids
                 for values in itertools.product(*(v if isinstance(v, tuple) else (v,)
                                                   for v in grid.values())))


BF16_AND_FP8 = ("bf16", "fp8")
# The course's ladder, from HF's baselines to our fastest step without torch.compile: what `bench`
# runs by default and notebook 06 shows
LADDER = _expand(dict(hf=True, backend=("eager", "grouped_mm")),
                 dict(hf=True, backend="grouped_mm", compiled=True),
                 dict(backend="grouped_torch"),
                 dict(backend=("te_grouped_linear", "te_ops"), precision=BF16_AND_FP8))
# torch.compile for the parts TE does not own, the loss (with its gradient) and AdamW's step:
# both together, our fastest steps, which `bench` runs after the ladder on a GPU, with HF's
# compiled step given the same compiled AdamW (nothing MoE-specific in it)...
COMPILED_STEPS = _expand(dict(hf=True, backend="grouped_mm", compiled=True, compiled_adamw=True),
                         dict(backend="te_ops", precision=BF16_AND_FP8, compiled_loss=True,
                              compiled_adamw=True))
# ...and each alone, what each buys: named on the command line (`--train-variants`)
COMPILED_ALONE = _expand(dict(backend="te_ops", precision=BF16_AND_FP8, compiled_loss=True),
                         dict(backend="te_ops", precision=BF16_AND_FP8, compiled_adamw=True))
# te.GroupedLinear's experts with the loss and AdamW compiled as in the fastest steps, beside
# te.ops' (`COMPILED_STEPS`). Named on the command line
COMPILED_GROUPED_LINEAR = _expand(dict(backend="te_grouped_linear", precision=BF16_AND_FP8,
                                       compiled_loss=True, compiled_adamw=True))

# The fastest steps with every RMSNorm compiled too (its forward and backward each one kernel).
# Named on the command line, beside `COMPILED_STEPS`
COMPILED_NORMS = _expand(dict(backend="te_ops", precision=BF16_AND_FP8, compiled_loss=True,
                              compiled_adamw=True, compiled_norms=True))

VARIANTS = {v.name: v for v in (*LADDER, *COMPILED_STEPS, *COMPILED_ALONE,
                                *COMPILED_GROUPED_LINEAR, *COMPILED_NORMS)}
TRAIN_VARIANTS = tuple(v.name for v in LADDER)
# What `bench` runs after the ladder on a GPU, so the summary's best step and its fair HF twin
# come from one run
GPU_EXTRA_VARIANTS = tuple(v.name for v in COMPILED_STEPS)
# Each change of a ladder variant measured beside it (`candidate_gains`): alone, then together
CANDIDATE_VARIANTS = tuple(v.name for v in (*COMPILED_ALONE, *COMPILED_STEPS))


def hf_twin(name: str) -> str:
    """HF's compiled step given what our step `name` adds outside the model: the compiled
    AdamW where ours compiles AdamW (the loss is part of HF's compiled model already). A
    committed variant whose code left the package is read by its name, as `Variant.of` built
    it: ours `_compiled` (loss and AdamW) or `_compiled_adamw`, HF `_compiled_adamw`."""
    v = VARIANTS.get(name)
    if v is not None:
        compiled_adamw = v.compiled_adamw
    else:
        parts = name.split("_")
        compiled_adamw = "compiled_adamw" in name or (
            name.startswith("ours_") and "compiled" in parts and "compiled_loss" not in name)
    return Variant.of("grouped_mm", hf=True, compiled=True, compiled_adamw=compiled_adamw).name


def candidate_base(name: str) -> str:
    """The ladder variant a candidate changes (`CANDIDATE_VARIANTS`): the same model, experts,
    precision and compilation, none of the candidate's changes."""
    v = VARIANTS[name]
    return Variant.of(v.backend, v.precision, hf=v.hf, compiled=v.compiled).name


def technique(name: str) -> str:
    """What a candidate variant changes, in words."""
    v = VARIANTS[name]
    changes = ["the loss and its gradient compiled"] if v.compiled_loss else []
    changes += ["AdamW's step compiled"] if v.compiled_adamw else []
    changes += ["the norms compiled"] if v.compiled_norms else []
    return " and ".join(changes)


def candidate_gains(train_rows: list[dict]) -> list[dict]:
    """Each candidate of one run beside its base variant from the same run (both ran): the
    technique, the two medians, the speedup, the two peaks."""
    ok = {r["variant"]: r for r in train_rows if r.get("status") == "ok"}
    gains = []
    for name in CANDIDATE_VARIANTS:
        base = candidate_base(name)
        if name in ok and base in ok:
            gains.append({"variant": name, "base": base, "technique": technique(name),
                          "precision": row_precision(ok[name]),
                          "base_ms": ok[base]["median_ms"], "ms": ok[name]["median_ms"],
                          "speedup": ok[base]["median_ms"] / ok[name]["median_ms"],
                          "base_peak_gb": ok[base]["peak_memory_gb"],
                          "peak_gb": ok[name]["peak_memory_gb"]})
    return gains


def committed_train_runs() -> list[tuple[str, dict]]:
    """(file, report) of every committed `bench` report with training-step rows
    (`results.committed`), oldest run first."""
    runs = []
    for path in results.committed():
        report = results.read(path)
        rows = report.get("results") if isinstance(report, dict) else None
        if isinstance(rows, list) and any(isinstance(r, dict) and r.get("part") == "train"
                                          for r in rows):
            runs.append((results.relative(path), report))
    return sorted(runs, key=lambda run: run[1]["environment"].get("date") or "")


def committed_candidate_gains() -> list[dict]:
    """`candidate_gains` of every committed run that timed a candidate beside its base, oldest
    run first, each gain with its `run` (file) and `gpu`."""
    gains = []
    for run, report in committed_train_runs():
        rows = [r for r in report["results"] if r.get("part") == "train"]
        gains += [{**gain, "run": run, "gpu": report["environment"]["gpu"]}
                  for gain in candidate_gains(rows)]
    return gains


def variant(name_or_variant: str | Variant) -> Variant:
    if isinstance(name_or_variant, Variant):
        return name_or_variant
    if name_or_variant not in VARIANTS:
        raise ValueError(f"unknown training variant {name_or_variant!r}; choose from "
                         f"{', '.join(VARIANTS)}; or pass a bench.Variant(label, backend, "
                         f"precision)")
    return VARIANTS[name_or_variant]


def row_precision(row: dict) -> str:
    """A training row's precision; files from before bench recorded it: the variant name's."""
    return row.get("precision") or VARIANTS[row["variant"]].precision_kind
