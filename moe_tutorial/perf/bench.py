"""The benchmarks: the expert layer alone and the whole training step, every variant checked
against a reference before it is timed, with the run's environment and MFU peaks recorded —
what `python -m moe_tutorial bench` runs and `benchmarks/results/` holds. The clocks, FLOP
counts and peaks it measures with are in `timing`.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..arguments import check_count
from ..moe.batch import next_token_targets
from ..moe.config import preset
from ..moe.dispatch import run_experts
from ..moe.experts import SELF_QUANTIZING_BACKENDS, convert_experts, create, default_backend
from ..moe.hf_baseline import compile_for_training, hf_mixtral, hf_training_loss
from ..moe.model import MoEForCausalLM, route
from ..precision import hardware, recipes
from ..precision.quant import rel_error
from ..precision.recipes import supported_recipes
from ..train.graphed import GraphedTrainStep, capturable_adamw
from ..train.loop import (
    OPTIMIZERS,
    TrainingDiverged,
    TrainSettings,
    compiled_adamw,
    learning_rate,
    loss_of,
    make_optimizer,
    set_learning_rate,
    train,
    train_step,
)
from . import results
from .host_syncs import count_host_syncs
from .timing import (
    Peaks,
    allocator_retries,
    environment,
    expert_mlp_flops,
    measure_peaks,
    mfu_text,
    model_flops_per_token,
    peak_memory_gb,
    reset_memory,
    resident_gb,
    tflops,
    time_fn,
)

# ---------------------------------------------------------------------------------------------
# What is benchmarked

@dataclass(frozen=True)
class ExpertShape:
    """One MoE layer's expert problem: T tokens, hidden H, expert width I, E experts, top-k."""

    name: str
    tokens: int
    hidden: int
    intermediate: int
    experts: int
    top_k: int

    def flops(self) -> int:
        return expert_mlp_flops(self.tokens, self.top_k, self.hidden, self.intermediate)


EXPERT_SHAPES = {s.name: s for s in (
    ExpertShape("mixtral", 8192, 4096, 14336, 8, 2),  # Mixtral 8x7B: few, large experts
    ExpertShape("fine_grained", 16384, 2048, 768, 64, 8),  # many small experts
    ExpertShape("small", 16384, 1024, 2816, 8, 2),  # the course's small GPU shape
    # The shipped configs' expert layers (moe_tutorial/configs/; tests/test_bench.py checks these
    # against analyze.expert_shape of each config): the fine-grained MoEs people train today.
    ExpertShape("qwen3_30b_a3b", 16384, 2048, 768, 128, 8),  # Qwen3-MoE-30B-A3B
    ExpertShape("olmoe_1b_7b", 16384, 2048, 1024, 64, 8),  # OLMoE-1B-7B
    # DeepSeek-V3's routed experts (hidden 7168, moe_intermediate_size 2048, 256 experts, top-8;
    # its shared expert left out): between the small experts above and Mixtral's in width
    ExpertShape("deepseek_v3", 16384, 7168, 2048, 256, 8),
    ExpertShape("tiny", 512, 64, 128, 8, 2),  # CPU-sized: the harness's own tests
)}
FAMILY_SHAPES = ("qwen3_30b_a3b", "olmoe_1b_7b")
ROUTINGS = ("balanced", "skewed")

# Relative error (Frobenius norm) a variant's output may have against the bf16 loop before it is
# timed. bf16: the same math summed in another order (~1e-3 seen). FP8 (E4M3, 3 mantissa bits):
# each quantised operand carries ~2^-4/sqrt(3) ≈ 3.6% RMS rounding error; a GEMM of two such
# operands ~5%, two GEMMs in a row plus the quantised SwiGLU output ~7-9% — 0.15 leaves margin
# for per-tensor scaling's coarser small values while still catching a wrong result (~100%).
TOLERANCE = {"bf16": 2e-2, "fp8": 0.15}


def make_routing(shape: ExpertShape, routing: str, seed: int = 0):
    """(weights fp32 [T, k], indices [T, k]) from random router logits. `skewed` adds a Zipf-like
    bias (expert e gets log(1/(e+1))·2), so a few experts take most tokens and the last ones few."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape.tokens, shape.experts, generator=gen)
    if routing == "skewed":
        logits = logits + 2.0 * torch.log(1.0 / torch.arange(1, shape.experts + 1))
    return route(logits, shape.top_k)


def precision_kind(precision: str) -> str:
    """'fp8' for a TE recipe, 'bf16' for the plain dtype (bf16 on a GPU, fp32 on a CPU)."""
    return "bf16" if precision in ("bf16", "fp32") else "fp8"


def _autocast(recipe):
    import contextlib

    if recipe is None:
        return contextlib.nullcontext()
    return hardware.transformer_engine().autocast(enabled=True, recipe=recipe)


# ---------------------------------------------------------------------------------------------
# The expert layer: forward + backward of the routed expert MLP, permutation included

def expert_variants(caps) -> list[tuple]:
    """(backend, precision) pairs this machine can run, or (backend, precision, options) where
    the backend is built with options: the loop, the grouped bf16 paths, each TE backend with
    TE's CUTLASS grouped GEMM (`cutlass=True`, Hopper only), and each TE backend under each FP8
    recipe TE runs here."""
    variants = [("naive", "bf16"), ("grouped_torch", "bf16"), ("te_permute_grouped_mm", "bf16"),
                ("te_grouped_linear", "bf16"), ("te_ops", "bf16")]
    # (TE backends run their PyTorch counterparts without TE)
    if caps.has_te and caps.device == "cuda":
        if (caps.env.compute_capability or (0, 0))[0] == 9:  # TE's CUTLASS switch: Hopper only
            variants += [("te_grouped_linear", "bf16", {"cutlass": True}),
                         ("te_ops", "bf16", {"cutlass": True})]
        for recipe in supported_recipes(caps):
            variants += [("te_grouped_linear", recipe), ("te_ops", recipe)]
    return variants


def bench_expert_layer(shape: ExpertShape, routing: str = "balanced", *, device="cuda",
                       variants: list[tuple[str, str]] | None = None, warmup: int = 3,
                       iters: int = 20, on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Time every variant on one shape/routing; the naive loop (bf16) is the reference each
    variant's output is checked against before it is timed. A variant (backend, precision,
    options) builds its backend with `options` (e.g. `{"cutlass": True}`), which its row
    records."""
    caps = hardware.capabilities()
    variants = variants or expert_variants(caps)
    # The row of the backend the course picks for this shape in bf16 (`experts.default_backend`)
    default = default_backend(shape.hidden, shape.intermediate, fp8=False,
                              te_on_gpu=caps.has_te and torch.device(device).type == "cuda")
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    torch.manual_seed(0)
    base = create("naive", shape.experts, shape.hidden, shape.intermediate, dtype=dtype,
                  device=device)
    torch.nn.init.normal_(base.gate_up_proj, std=0.02)
    torch.nn.init.normal_(base.down_proj, std=0.02)
    weights, indices = (t.to(device) for t in make_routing(shape, routing))
    hidden = torch.randn(shape.tokens, shape.hidden, device=device, dtype=dtype)
    grad_out = torch.randn_like(hidden)
    reference = loop_ms = None
    results = []
    for backend, precision, *more in variants:
        options = more[0] if more else {}
        label = "fp32" if precision == "bf16" and dtype == torch.float32 else precision
        row = dict(part="expert", shape=shape.name, routing=routing, backend=backend,
                   precision=label, tokens=shape.tokens, flops=shape.flops(), **options,
                   default=backend == default and precision == "bf16" and not options)
        experts = None
        try:
            for p in base.parameters():  # the loop's gradients: freed before a converted copy runs
                p.grad = None
            reset_memory(device)
            experts = convert_experts(base, backend, **options) if backend != "naive" else base
            recipe = None  # bf16, or a backend that quantizes by itself
            if backend not in SELF_QUANTIZING_BACKENDS:
                # the TE experts read the recipe, and its alignment, from autocast
                recipe = recipes.resolve(precision, caps).build()
            x = hidden.detach().clone().requires_grad_()
            w = weights.detach().clone().requires_grad_()

            path = None

            def step():
                nonlocal path
                for p in experts.parameters():
                    p.grad = None
                x.grad = w.grad = None
                with _autocast(recipe):
                    out, path = run_experts(experts, x, indices, w)
                out.backward(grad_out)
                return out

            out = step().detach()
            if reference is None:
                reference = out  # the first variant is the loop
            row["rel_error"] = rel_error(out, reference)
            row["tolerance"] = TOLERANCE[precision_kind(precision)]
            row["path"] = path
            if row["rel_error"] > row["tolerance"]:
                row["status"] = "wrong"  # not timed: a fast wrong answer is not a result
            else:
                t = time_fn(step, warmup=warmup, iters=iters, device=device)
                row.update(status="ok", median_ms=t.median_ms, min_ms=t.min_ms, timer=t.timer,
                           tflops=tflops(shape.flops(), t.median_ms),
                           peak_memory_gb=peak_memory_gb(device))
                if backend == "naive":
                    loop_ms = t.median_ms
                if loop_ms is not None:
                    row["speedup_vs_loop"] = loop_ms / t.median_ms
        except torch.cuda.OutOfMemoryError:
            row["status"] = "OOM"
        except Exception as exc:  # one broken variant must not hide the others' numbers
            row.update(_classify_error(exc))
        finally:
            if experts is not base:
                del experts
        results.append(row)
        if on_result is not None:
            on_result(row)
    return results


# ---------------------------------------------------------------------------------------------
# The training step: forward + backward + optimizer step of a whole model

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
    # The whole step (forward, backward, clipping, a capturable AdamW) replayed from one CUDA
    # graph (`train.graphed.GraphedTrainStep`): needs experts with no host read (`sync_free*`)
    graphed: bool = False
    # Ours, te_grouped_linear: each layer's expert counts read to the host once, for TE's
    # permutation kernel and both grouped GEMMs (the backend's `host_counts` option)
    host_counts: bool = False

    @classmethod
    def of(cls, backend: str, precision: str = "bf16", **options) -> Variant:
        """The variant of these options under its derived name: `hf_<backend>` then
        `_compiled` (the model compiled) and `_compiled_adamw`; ours `ours_<backend>_<precision>`
        (a self-quantizing backend's name already says its precision) then `_graphed`, and
        `_compiled` for the loss and AdamW compiled together, else `_compiled_loss` or
        `_compiled_adamw` for one of them; `_host_counts` after the precision."""
        v = cls("", backend, precision, **options)
        if v.host_counts and (v.hf or backend != "te_grouped_linear"):
            raise ValueError(f"host_counts is an option of our te_grouped_linear experts, not of "
                             f"{'HF' if v.hf else 'our'} {backend!r}")
        if v.hf:
            parts = ["hf", backend, v.compiled and "compiled", v.compiled_adamw and "compiled_adamw"]
        else:
            compiled = ("compiled" if v.compiled_loss and v.compiled_adamw else
                        v.compiled_loss and "compiled_loss" or v.compiled_adamw and "compiled_adamw")
            parts = ["ours", backend, backend not in SELF_QUANTIZING_BACKENDS and precision,
                     v.host_counts and "host_counts", v.graphed and "graphed", compiled]
        return replace(v, name="_".join(part for part in parts if part))

    @property
    def changes(self) -> bool:
        """Whether this is a change of a ladder variant measured beside it (`candidate_base`)."""
        return self.compiled_loss or self.compiled_adamw

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
            model.set_expert_backend(self.backend,
                                     **({"host_counts": True} if self.host_counts else {}))
            # A self-quantizing backend runs its own FP8 GEMMs in a bf16 model (no te.autocast)
            model.set_precision("bf16" if self.backend in SELF_QUANTIZING_BACKENDS
                                else self.precision)
            model.compiled_loss = self.compiled_loss
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
        too; `graphed`: the capturable AdamW the CUDA graph replays."""
        if self.graphed or self.compiled_adamw:
            if kind != "torch_adamw":
                raise ValueError(f"variant {self.name} chooses its own optimizer; --optimizer "
                                 f"{kind} does not apply to it")
            if self.graphed:
                return capturable_adamw(module, lr)
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
# No host read in the step (`sync_free`): eager, then the whole step in one CUDA graph (with
# gradient clipping, which the eager steps above leave out), then with the compiled loss inside
# the graph; FP8: the experts' GEMMs through torch's row-wise scaled grouped GEMM, the rest of the
# model in bf16. Named on the command line, beside the ladder
SYNC_FREE = _expand(dict(backend="sync_free"),
                    dict(backend="sync_free", graphed=True, compiled_loss=(False, True)),
                    dict(backend="sync_free_fp8", precision="fp8"),
                    dict(backend=("sync_free_fp8", "sync_free_fp8_wgrad"), precision="fp8",
                         graphed=True, compiled_loss=(False, True)))

# TE's own path with one host read per layer: te_grouped_linear with the counts read once, the
# loss and AdamW compiled as in the fastest steps. Named on the command line, beside
# `ours_te_grouped_linear_*_compiled` without it
ONE_HOST_READ = _expand(dict(backend="te_grouped_linear", precision=BF16_AND_FP8,
                             host_counts=(False, True), compiled_loss=True, compiled_adamw=True))

VARIANTS = {v.name: v for v in (*LADDER, *COMPILED_STEPS, *COMPILED_ALONE, *SYNC_FREE,
                                *ONE_HOST_READ)}
TRAIN_VARIANTS = tuple(v.name for v in LADDER)
# What `bench` runs after the ladder on a GPU, so the summary's best step and its fair HF twin
# come from one run
GPU_EXTRA_VARIANTS = tuple(v.name for v in COMPILED_STEPS)
# Each change of a ladder variant measured beside it (`candidate_gains`): alone, then together
CANDIDATE_VARIANTS = tuple(v.name for v in (*COMPILED_ALONE, *COMPILED_STEPS))


def hf_twin(name: str) -> str:
    """HF's compiled step given what our step `name` adds outside the model: the compiled
    AdamW where ours compiles AdamW (the loss is part of HF's compiled model already)."""
    v = VARIANTS.get(name)
    compiled_adamw = bool(v and v.compiled_adamw)
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


def _classify_error(exc: Exception) -> dict:
    """A variant that raised: 'unsupported' when the library says it has no kernel for it on
    this GPU (an honest result), 'error' otherwise (a bug to fix)."""
    message = f"{type(exc).__name__}: {exc}"[:500]
    if "CUBLAS_STATUS_NOT_SUPPORTED" in message:
        return dict(status="unsupported", error=message)
    return dict(status="error", error=message)


def _timed_step(module, forward, optimizer, batch, graphed: bool = False):
    """The training loop's own step (`train.train_step`) as the benchmark times it: no gradient
    clipping and no per-step host sync for the divergence guard — the step the committed
    measurements and HF's baseline step are. `graphed`: the whole step, gradient clipping
    included, replayed from one CUDA graph (`sync_free.GraphedTrainStep`; its first calls run
    eagerly, then it captures: the benchmark's warm-up calls)."""
    if graphed:
        step = GraphedTrainStep(module, optimizer, grad_clip=1.0, forward=forward)
        return lambda: step(batch)
    return lambda: train_step(module, batch, optimizer, grad_clip=None, forward=forward,
                              guard=False)


def _sync_record(step, on_gpu: bool, graphed: bool) -> dict:
    """How many times one more call of the (warmed-up) step makes the host wait for the GPU, and
    where (torch's sync debug mode: `sync_free.count_host_syncs`); for a graphed step also
    whether a call passes with that mode raising on the first sync."""
    if not on_gpu:
        return {}
    from collections import Counter

    count, places = count_host_syncs(step)
    record = {"host_syncs_per_step": count,
              "host_sync_places": dict(Counter(places).most_common(12))}
    if graphed:
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
            record["sync_debug_mode_error"] = "passed"
        except RuntimeError as exc:
            record["sync_debug_mode_error"] = f"raised: {exc}"[:300]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    return record


@torch.no_grad()
def _first_loss(module, forward, inputs, targets) -> float:
    """The loss at the initial weights (nothing of the forward pass outlives this call)."""
    return loss_of((forward or module)(inputs, targets)).item()


def _random_batch(config, batch: int, seq_len: int, device):
    """Seeded random token ids and their next-token targets (every variant gets the same)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen).to(device)
    return ids, next_token_targets(ids)


def bench_train_step(config, variants=TRAIN_VARIANTS, *, batch: int = 2, seq_len: int = 4096,
                     device="cuda", warmup: int = 5, iters: int = 20, lr: float = 1e-5,
                     optimizer: str = "torch_adamw",
                     on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Time forward + backward + optimizer step per variant (names or `Variant`s), after checking
    its first loss against the first variant's (same weights, same batch)."""
    inputs, targets = _random_batch(config, batch, seq_len, device)
    tokens = batch * seq_len
    flops_per_step = model_flops_per_token(config, seq_len) * tokens
    reference_loss = None
    results = []
    for v in map(variant, variants):
        row = dict(part="train", variant=v.name, batch=batch, seq_len=seq_len, tokens=tokens,
                   flops=flops_per_step, precision=v.precision_kind)
        module = forward = opt = None
        try:
            reset_memory(device)
            row["resident_before_gb"] = resident_gb(device)  # in this row's peak too
            module, forward = v.build(config, device)
            opt = v.optimizer(module, lr, optimizer)
            row["optimizer"] = type(opt).__module__ + "." + type(opt).__name__
            first_loss = _first_loss(module, forward, inputs, targets)
            if reference_loss is None:
                reference_loss = first_loss
            row.update(first_loss=first_loss, loss_diff=abs(first_loss - reference_loss))
            row["loss_tolerance"] = 0.05 if v.precision_kind == "fp8" else 0.02  # nats, at ~ln V
            if row["loss_diff"] > row["loss_tolerance"]:
                row["status"] = "wrong"
            else:
                retries = allocator_retries(device)
                step = _timed_step(module, forward, opt, (inputs, targets), v.graphed)
                t = time_fn(step, warmup=warmup, iters=iters, device=device)
                tokens_per_s = tokens / (t.median_ms / 1e3)
                row.update(status="ok", median_ms=t.median_ms, min_ms=t.min_ms, timer=t.timer,
                           tokens_per_s=tokens_per_s, tflops=tflops(flops_per_step, t.median_ms),
                           peak_memory_gb=peak_memory_gb(device))
                if retries is not None:  # the timed steps ran short of memory (timing.py)
                    row["allocator_retries"] = allocator_retries(device) - retries
                if not v.hf:
                    row["path"] = module.expert_paths()[0]
                if v.graphed:
                    row["grad_clip"] = 1.0
                row.update(_sync_record(step, torch.device(device).type == "cuda", v.graphed))
        except torch.cuda.OutOfMemoryError:
            row["status"] = "OOM"
        except Exception as exc:
            row.update(_classify_error(exc))
        finally:
            del module, forward, opt  # free this variant's ~30 GB before the next one
        results.append(row)
        if on_result is not None:
            on_result(row)
    return results


# ---------------------------------------------------------------------------------------------
# Summary, tables, the whole run

def best_step(train_rows, kind: str | None = None) -> dict | None:
    """Our fastest training-step row that ran (of precision kind "bf16" or "fp8" when `kind` is
    given; HF's baselines are never it), or None."""
    ours = [r for r in train_rows if r.get("status") == "ok" and r["variant"] in VARIANTS
            and not VARIANTS[r["variant"]].hf
            and (kind is None or precision_kind(row_precision(r)) == kind)]
    return max(ours, key=lambda r: r["tokens_per_s"]) if ours else None


def step_floor_ms(row: dict, speed_of_light: dict) -> float | None:
    """A training-step row's floor: the `speed_of_light` section's floor of the row's precision
    (None where that floor is incomplete)."""
    return speed_of_light["floors"][precision_kind(row_precision(row))]["total_ms"]


def summarize(results: list[dict], speed_of_light: dict | None = None) -> dict:
    """The headline ratios (medians from this run); None where this run lacks the variants.
    With the report's `speed_of_light` section (`python -m moe_tutorial speed-of-light`,
    merged in): the best step's floor in its precision over its measured time."""
    ok = [r for r in results if r.get("status") == "ok"]

    def expert_default(shape):  # the row `bench_expert_layer` marked as the course's pick
        rows = [r for r in ok if r["part"] == "expert" and r["shape"] == shape
                and r["routing"] == "balanced" and r.get("default")]
        return rows[0].get("speedup_vs_loop") if rows else None

    def expert_best(shape, kind=None):
        rows = [r for r in ok if r["part"] == "expert" and r["shape"] == shape
                and r["routing"] == "balanced" and r["backend"] != "naive"
                and (kind is None or precision_kind(r["precision"]) == kind)]
        loop = [r for r in ok if r["part"] == "expert" and r["shape"] == shape
                and r["routing"] == "balanced" and r["backend"] == "naive"]
        if not rows or not loop:
            return None
        return loop[0]["median_ms"] / min(r["median_ms"] for r in rows)

    train = {r["variant"]: r for r in ok if r["part"] == "train"}
    best = best_step(train.values())

    def vs(name, key="tokens_per_s"):
        if best is None or name not in train:
            return None
        if key == "peak_memory_gb":
            if best.get(key) is None or not train[name].get(key):
                return None
            return best[key] / train[name][key]
        return best[key] / train[name][key]

    best_bf16 = best_step(train.values(), "bf16")
    compiled = train.get("hf_grouped_mm_compiled")

    def like_for_like(row):  # our step over HF's compiled step given the same compiled AdamW
        twin = hf_twin(row["variant"]) if row else None
        return (twin, row["tokens_per_s"] / train[twin]["tokens_per_s"]) if twin in train else (twin, None)

    twin, twin_speedup = like_for_like(best)
    bf16_twin, bf16_twin_speedup = like_for_like(best_bf16)

    def fraction_of_floor():
        if best is None or not speed_of_light:
            return None
        floor_ms = step_floor_ms(best, speed_of_light)
        return floor_ms / best["median_ms"] if floor_ms is not None else None

    def fp8_vs_bf16(shape):  # > 1: FP8 pays for this shape; < 1: it loses, by this factor
        bf16, fp8 = expert_best(shape, "bf16"), expert_best(shape, "fp8")
        return fp8 / bf16 if bf16 and fp8 else None

    return {
        "expert_mixtral_best_bf16_speedup_vs_loop": expert_best("mixtral", "bf16"),
        "expert_mixtral_best_fp8_speedup_vs_loop": expert_best("mixtral", "fp8"),
        "expert_finegrained_best_speedup_vs_loop": expert_best("fine_grained"),
        # On the path `experts.default_backend` picks for the shape
        "expert_finegrained_default_speedup_vs_loop": expert_default("fine_grained"),
        # The shipped configs' fine-grained shapes (many small experts, top-8)
        **{f"expert_{shape}_best_bf16_speedup_vs_loop": expert_best(shape, "bf16")
           for shape in FAMILY_SHAPES},
        **{f"expert_{shape}_best_fp8_vs_best_bf16": fp8_vs_bf16(shape) for shape in FAMILY_SHAPES},
        "train_step_best_variant": best["variant"] if best else None,
        "train_step_speedup_vs_hf_eager": vs("hf_eager"),
        "train_step_speedup_vs_hf_grouped_mm": vs("hf_grouped_mm"),
        "train_step_speedup_vs_hf_grouped_mm_compiled": vs("hf_grouped_mm_compiled"),
        "train_step_peak_mem_ratio_vs_hf_grouped_mm": vs("hf_grouped_mm", "peak_memory_gb"),
        # What the grouped experts and fusions buy without FP8
        "train_step_best_bf16_speedup_vs_hf_grouped_mm_compiled": (
            best_bf16["tokens_per_s"] / compiled["tokens_per_s"] if best_bf16 and compiled
            else None),
        # Like with like: HF's compiled model with AdamW compiled where ours compiles it
        "train_step_like_for_like_hf": twin,
        "train_step_speedup_vs_like_for_like_hf": twin_speedup,
        "train_step_best_bf16_like_for_like_hf": bf16_twin,
        "train_step_best_bf16_speedup_vs_like_for_like_hf": bf16_twin_speedup,
        "train_step_fraction_of_speed_of_light": fraction_of_floor(),
    }


def format_summary(summary: dict) -> str:
    return "summary: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in summary.items())


def format_expert_row(r: dict) -> str:
    name = f"{r['shape']:<12} {r['routing']:<8} {r['backend']:<25} {r['precision']:<20}"
    if r.get("status") != "ok":
        return f"{name} {r.get('status', '?').upper():>9}  {r.get('error', '') or r.get('rel_error', '')}"
    mem = f"{r['peak_memory_gb']:.1f}" if r.get("peak_memory_gb") is not None else "-"
    speedup = f"{r['speedup_vs_loop']:7.2f}x" if "speedup_vs_loop" in r else "       -"
    return (f"{name} {r['median_ms']:9.2f} {r['tflops']:8.3g} {speedup} "
            f"{r['rel_error']:9.2e} {mem:>6}")


def row_precision(row: dict) -> str:
    """A training row's precision; files from before bench recorded it: the variant name's."""
    return row.get("precision") or VARIANTS[row["variant"]].precision_kind


def format_train_row(r: dict, peaks: Peaks) -> str:
    name = f"{r['variant']:<30}"
    if r.get("status") != "ok":
        return f"{name} {r.get('status', '?').upper():>9}  {r.get('error', '') or r.get('loss_diff', '')}"
    precision = row_precision(r)
    mem = f"{r['peak_memory_gb']:.1f}" if r.get("peak_memory_gb") is not None else "-"
    return (f"{name} {r['median_ms']:9.1f} {r['tokens_per_s']:11,.0f} {r['tflops']:8.3g} "
            f"{precision:>5} {mfu_text(r['tflops'], peaks.of(precision)):>15} "
            f"{mfu_text(r['tflops'], peaks.of('bf16')):>15} {mem:>6} {r['loss_diff']:9.1e}")


EXPERT_HEADER = (f"{'shape':<12} {'routing':<8} {'backend':<25} {'precision':<20} {'ms':>9} "
                 f"{'TFLOP/s':>8} {'vs loop':>8} {'rel.err':>9} {'GiB':>6}")
TRAIN_HEADER = (f"{'variant':<30} {'ms/step':>9} {'tokens/s':>11} {'TFLOP/s':>8} {'prec.':>5} "
                f"{'MFU own peak':>15} {'MFU bf16 peak':>15} {'GiB':>6} {'Δloss0':>9}")
MFU_LEGEND = ("MFU own peak: TFLOP/s over the dense peak of the row's precision (bf16 rows: bf16, "
              "FP8 rows: FP8), measured in this run / datasheet; MFU bf16 peak: over the bf16 "
              "peak for every row (torchtitan's convention)")


def default_preset(on_gpu: bool) -> str:
    """The training step's model when none is named: Mixtral's width on a GPU, tiny on a CPU."""
    return "mixtral-2l" if on_gpu else "tiny"


def default_seq_len(config, on_gpu: bool) -> int:
    """The training step's sequence length when none is given, within the model's context."""
    return min(4096 if on_gpu else 64, config.max_seq_len)


def check_run_arguments(*, device=None, shapes=None, routings=ROUTINGS, train_preset=None,
                        train_variants=None, batch=None, seq_len=None, warmup=None, iters=None,
                        optimizer="torch_adamw", train_layers=None) -> None:
    """Refuse the arguments `run` would otherwise fail on only after minutes of measuring, or
    replace by its defaults without a word: unknown names, sizes out of range (None: the
    device's default). `run` calls it first; the command line calls it before starting."""
    on_gpu = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu")).type == "cuda"
    for name, value, least in (("batch", batch, 1), ("seq_len", seq_len, 1),
                               ("warmup", warmup, 0), ("iters", iters, 1),
                               ("layers", train_layers, 1)):
        if value is not None:
            check_count(name, value, least=least)
    for what, names, known in (("expert shape", shapes or [], EXPERT_SHAPES),
                               ("routing", routings, ROUTINGS)):
        for name in names:
            if name not in known:
                raise ValueError(f"unknown {what} {name!r}; choose from {', '.join(known)}")
    for name in train_variants or []:
        variant(name)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {OPTIMIZERS}")
    config = preset(train_preset or default_preset(on_gpu))
    if seq_len is not None and seq_len > config.max_seq_len:
        raise ValueError(f"seq_len={seq_len} is longer than the {config.num_layers}-layer "
                         f"model's max_seq_len={config.max_seq_len}; choose seq_len <= "
                         f"{config.max_seq_len} or a preset with longer sequences")


def run(*, device=None, shapes=None, routings=ROUTINGS, expert=True, train=True,
        train_preset=None, train_layers=None, train_variants=None, batch=None, seq_len=None,
        warmup=None, iters=None, optimizer="torch_adamw", log=print,
        on_result: Callable[[dict], None] | None = None) -> dict:
    """The whole benchmark, sized for the device: Mixtral / fine-grained / small shapes and the
    `mixtral-2l` model (batch 2 × 4096) on a GPU; the `tiny` shape and model on a CPU.
    `train_layers`: the training step's model at another depth (as `train_dist --layers`)."""
    check_run_arguments(device=device, shapes=shapes, routings=routings,
                        train_preset=train_preset, train_variants=train_variants, batch=batch,
                        seq_len=seq_len, warmup=warmup, iters=iters, optimizer=optimizer,
                        train_layers=train_layers)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = torch.device(device).type == "cuda"
    shapes = shapes or (["mixtral", "fine_grained", "small"] if on_gpu else ["tiny"])
    warmup = warmup if warmup is not None else (3 if on_gpu else 1)
    iters = iters if iters is not None else (20 if on_gpu else 3)
    env = environment()
    log(f"benchmark on {env['gpu'] or 'CPU'}: torch {env['torch']}, TE "
        f"{env['transformer_engine'] or 'absent'}, transformers {env['transformers']}")
    peaks = measure_peaks(device, env["gpu"])
    if on_gpu:
        log(f"dense matmul (8192^3) measured: bf16 {peaks.bf16_measured:.0f} TFLOP/s (datasheet "
            f"{peaks.bf16_datasheet}), FP8 "
            + (f"{peaks.fp8_measured:.0f}" if peaks.fp8_measured else "-")
            + f" TFLOP/s (datasheet {peaks.fp8_datasheet})")
    results = []

    def report(row, line):
        log(line)
        if on_result is not None:
            on_result(row)

    if expert:
        log(f"\nexpert layer, forward + backward incl. permutation; TFLOP/s = 18·T·k·H·I / time; "
            f"median of {iters}\n{EXPERT_HEADER}")
        for name in shapes:
            for routing in routings:
                results += bench_expert_layer(EXPERT_SHAPES[name], routing, device=device,
                                              warmup=warmup, iters=iters,
                                              on_result=lambda r: report(r, format_expert_row(r)))
    if train:
        config = preset(train_preset or default_preset(on_gpu), layers=train_layers)
        if not on_gpu:
            config = config.with_overrides(dtype="float32")
        batch = batch or 2  # 0 was refused above: `or` replaces only None
        seq_len = seq_len or default_seq_len(config, on_gpu)
        variants = train_variants or ([*TRAIN_VARIANTS, *GPU_EXTRA_VARIANTS] if on_gpu else [
            "hf_eager", "hf_grouped_mm", "ours_grouped_torch_bf16", "ours_te_ops_bf16"])
        log(f"\ntraining step of {config.num_layers}-layer model (hidden {config.hidden_size}, "
            f"{config.num_experts} experts × {config.intermediate_size}, top-{config.top_k}), "
            f"batch {batch} × {seq_len}: forward + backward + optimizer step, median of {iters}.\n"
            f"TFLOP/s = (6 × {config.active_params_per_token():,} active params + 12 × layers × "
            f"seq × hidden) × tokens / time. {MFU_LEGEND}\n"
            f"{TRAIN_HEADER}")
        results += bench_train_step(config, variants, batch=batch, seq_len=seq_len, device=device,
                                    warmup=warmup if on_gpu else 1, iters=iters,
                                    optimizer=optimizer,
                                    on_result=lambda r: report(r, format_train_row(r, peaks)))
    summary = summarize(results)
    log("\n" + format_summary(summary))
    return {"environment": env, **peaks.to_dict(), "results": results, "summary": summary}


def merge_reports(reports: list[dict]) -> dict:
    """One report from the parts of a benchmark run as separate commands on the same machine
    (e.g. `--no-train` then `--no-expert`, each within a time limit): the results concatenated,
    the summary recomputed over all of them, each part's date and dense-matmul rate kept (the
    top-level rates: those of the last part with training-step rows, which MFU is quoted
    against). Refuses
    parts whose GPU or library versions differ: their ratios would not be comparable."""
    if not reports:
        raise ValueError("nothing to merge")
    first = reports[0]["environment"]
    for r in reports[1:]:
        # Keys one of them lacks (recorded only by a newer version of the course) are no
        # difference; the date is when each part ran.
        differ = sorted(k for k, v in r["environment"].items()
                        if k != "date" and k in first and first[k] != v)
        if differ:
            raise ValueError(f"cannot merge reports from different environments (differ in {differ})")
    # One run given twice (the same file, or a copy) would count every row twice
    twice = next(((i, j) for j, r in enumerate(reports) for i in range(j)
                  if r["results"] and reports[i]["results"] == r["results"]), None)
    if twice:
        raise ValueError(f"reports {twice[0]} and {twice[1]} hold the same results: the same run "
                         f"given twice; give each part once")
    incomplete = [i for i, r in enumerate(reports) if not r.get("complete", True)]
    if incomplete:
        raise ValueError(f"report(s) {incomplete} did not finish (complete=False): rerun them")
    results = [row for r in reports for row in r["results"]]
    # The speed-of-light part (`speed-of-light --out`, no results of its own) describes the
    # training-step rows' workload; the newest one wins
    sections = [r["speed_of_light"] for r in reports if r.get("speed_of_light")]
    speed_of_light = sections[-1] if sections else None
    if speed_of_light is not None:
        _check_same_workload(speed_of_light, results)
    return {"environment": reports[0]["environment"],  # its date: when the run started
            # A report merged before keeps its own parts: one entry per run, however merged
            "parts": [part for r in reports for part in r.get("parts") or [
                {"date": r["environment"].get("date"), **Peaks.from_dict(r).to_dict(),
                 "results": len(r["results"])}]],
            # The MFU of a training-step row is quoted against the peaks measured in its own run
            **Peaks.from_dict(next((r for r in reversed(reports) if any(
                row.get("part") == "train" for row in r["results"])), reports[-1])).to_dict(),
            "results": results, "summary": summarize(results, speed_of_light),
            **({"speed_of_light": speed_of_light} if speed_of_light else {}), "complete": True}


def _check_same_workload(speed_of_light: dict, results: list[dict]) -> None:
    """A floor is only the training-step rows' floor when it was computed for their batch and
    sequence length (and written by a course version that records its workload)."""
    workload = speed_of_light.get("workload")
    if workload is None:
        raise ValueError("the speed_of_light part records no workload (written by an older "
                         "version): rerun python -m moe_tutorial speed-of-light --out FILE")
    steps = {(r["batch"], r["seq_len"]) for r in results if r.get("part") == "train"}
    if steps - {(workload["batch"], workload["seq_len"])}:
        raise ValueError(f"the speed_of_light part is for batch {workload['batch']} × "
                         f"{workload['seq_len']}, the training-step rows for "
                         f"{sorted(steps)}: rerun speed-of-light with their --batch and --seq-len")


def profile_train_step(config, name: str | Variant, *, batch: int = 2, seq_len: int = 4096,
                       device="cuda", steps: int = 3, row_limit: int = 25) -> str:
    """torch.profiler over a few training steps of one variant (the step `bench_train_step`
    times): where the time goes (GPU time per kernel, kernel counts), as a printable table."""
    from torch.profiler import ProfilerActivity, profile

    v = variant(name)
    batch_ = _random_batch(config, batch, seq_len, device)
    module, forward = v.build(config, device)
    step = _timed_step(module, forward, v.optimizer(module, 1e-5), batch_)
    wall = time_fn(step, warmup=2, iters=3, device=device).median_ms
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    on_gpu = torch.device(device).type == "cuda"
    averages = prof.key_averages()
    sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    busy = ""
    if on_gpu:  # GPU time spent in kernels vs the step's wall time: the rest is idle (launch/sync)
        # Only the kernels themselves: operator rows repeat their kernels' time.
        kernels = [e for e in averages if e.device_type.name == "CUDA"]
        kernel_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
        launches = sum(e.count for e in kernels) / steps
        busy = (f"step {wall:.1f} ms (unprofiled median); kernels {kernel_ms:.1f} ms per step "
                f"({100 * kernel_ms / wall:.0f}% busy), {launches:.0f} kernel launches per step\n")
    return (f"profile of {v.name}, {steps} steps\n{busy}"
            + averages.table(sort_by=sort, row_limit=row_limit))


# ---------------------------------------------------------------------------------------------
# Loss curves: do the variants train alike?

def train_loss_curves(config, variants, *, steps: int = 30, batch: int = 4, seq_len: int = 256,
                      device="cuda", lr: float = 1e-3, windows: torch.Tensor | None = None,
                      timing_warmup: int = 3, check_learning: bool = True,
                      on_step: Callable[[str, dict], None] | None = None) -> list[dict]:
    """Train every variant for `steps` steps from the same initial weights on the same batches
    and return one row per variant with its loss curve — do the variants train alike?

    `variants`: names from `TRAIN_VARIANTS` (the HF baselines and our steps), or `Variant`s of
    our model with any backend and precision (e.g. ``Variant("te_ops DelayedScaling", "te_ops",
    "DelayedScaling")``). `windows`: token ids ``[n, >= seq_len]`` (e.g.
    `data.load_protein_data(seq_len).train`), used in order; default: random tokens. Every
    variant trains with the course's loop, `train.train` (AdamW, `lr` after a linear warm-up over
    the first tenth of the steps then cosine decay, gradients clipped to norm 1), so the curves
    differ only where the variants compute differently.

    Each row: variant, status ("ok"; "unavailable" when the variant cannot be set up on this
    machine, e.g. FP8 without TE; "error", "OOM", "diverged"), losses (one per step),
    ms_per_step (median wall time of the steps after `timing_warmup`; every step waits for its
    loss, so its wall time is complete), tokens_per_s, peak_memory_gb (CUDA only), path (what
    the experts ran), error. `on_step(label, record)` receives each step's `train` record (step,
    loss, step_ms, ...; e.g. for a `widgets.LiveDashboard`), outside the timing.
    `check_learning=False`: a timing run too short to learn, never "diverged" for a loss that
    did not fall (`train.train`'s option; a loss that is not finite still is).
    """
    if steps < 1 or batch < 1 or seq_len < 2:
        raise ValueError(f"need steps >= 1, batch >= 1, seq_len >= 2; "
                         f"got {steps}, {batch}, {seq_len}")
    windows = _curve_windows(config, windows, steps * batch, seq_len)
    ids = [windows[i * batch:(i + 1) * batch].to(device) for i in range(steps)]
    batches = [(x, next_token_targets(x)) for x in ids]
    settings = TrainSettings(steps=steps, batch_size=batch, lr=lr, warmup_steps=steps // 10,
                             eval_every=0)
    results = []
    for v in map(variant, variants):
        row = dict(part="curve", variant=v.name, steps=steps, batch=batch, seq_len=seq_len,
                   losses=[], status="ok")
        module = forward = None
        times: list[float] = []

        def record(r, label=v.name, times=times, row=row):
            row["losses"].append(r["loss"])
            times.append(r["step_ms"])
            if on_step is not None:
                on_step(label, r)

        try:
            reset_memory(device)
            try:
                module, forward = v.build(config, device)
            except ValueError as exc:  # refused by set_expert_backend / set_precision: say why
                row.update(status="unavailable", error=f"{type(exc).__name__}: {exc}"[:500])
                continue
            try:
                train(module, batches, settings, forward=forward, on_step=record, progress=False,
                      check_learning=check_learning)
            except TrainingDiverged as exc:
                row.update(status="diverged", error=str(exc)[:500])
            if times:
                row["ms_per_step"] = statistics.median(times[timing_warmup:] or times)
                row["tokens_per_s"] = batch * seq_len / (row["ms_per_step"] / 1e3)
            row["peak_memory_gb"] = peak_memory_gb(device)
            if not v.hf:
                row["path"] = module.expert_paths()[0]
        except torch.cuda.OutOfMemoryError:
            row["status"] = "OOM"
        except Exception as exc:  # one broken variant must not hide the others' curves
            row.update(_classify_error(exc))
        finally:
            del module, forward  # free this variant's memory before the next one
            results.append(row)
    return results


def _curve_windows(config, windows: torch.Tensor | None, needed: int,
                   seq_len: int) -> torch.Tensor:
    """The `needed` windows of `seq_len` token ids every variant of a curve trains on, in
    order: `windows` taken in turn (from the start again when they run out), or random ids."""
    if windows is None:
        gen = torch.Generator().manual_seed(0)
        windows = torch.randint(0, config.vocab_size, (needed, seq_len), generator=gen)
    if windows.shape[-1] < seq_len:
        raise ValueError(f"windows of {windows.shape[-1]} tokens are shorter than "
                         f"seq_len={seq_len}")
    return windows[torch.arange(needed) % windows.shape[0], :seq_len]


def graphed_loss_curves(config, variants, *, steps: int = 80, batch: int = 4, seq_len: int = 256,
                        lr: float = 1e-3, device="cuda",
                        windows: torch.Tensor | None = None) -> list[dict]:
    """Loss curves of `steps` steps from the same initial weights on the same batches: eager
    variants through `train_loss_curves` (the course's `train.train`), graphed ones
    (`Variant.graphed`) through `GraphedTrainStep` with the same settings (AdamW groups,
    betas, weight decay, the warm-up + cosine learning rate written into the graph's tensor lr
    before each step, clipping to norm 1). `windows`: token ids ``[n, >= seq_len]`` used in
    order (e.g. `data.load_protein_data(seq_len).train`); default: random tokens, which hold
    nothing to learn beyond a uniform guess. One row per variant, as `train_loss_curves`
    gives."""
    windows = _curve_windows(config, windows, steps * batch, seq_len)
    eager = [name for name in variants if not variant(name).graphed]
    rows = {row["variant"]: row for row in train_loss_curves(
        config, eager, steps=steps, batch=batch, seq_len=seq_len, device=device, lr=lr,
        windows=windows)} if eager else {}
    settings = TrainSettings(steps=steps, batch_size=batch, lr=lr, warmup_steps=steps // 10,
                             eval_every=0)
    for name in variants:
        if name in rows:
            continue
        v = variant(name)
        row = dict(part="curve", variant=name, steps=steps, batch=batch, seq_len=seq_len,
                   losses=[], status="ok", graphed=True)
        try:
            model, forward = v.build(config, device)
            optimizer = capturable_adamw(model, lr, settings)
            step = GraphedTrainStep(model, optimizer, grad_clip=settings.grad_clip,
                                    forward=forward)
            losses = []
            for i in range(steps):
                ids = windows[i * batch:(i + 1) * batch].to(device)
                set_learning_rate(optimizer, learning_rate(i, settings))
                losses.append(step((ids, next_token_targets(ids))).float().clone())
            row["losses"] = torch.stack(losses).tolist()  # one read, after the last step
            row["path"] = model.expert_paths()[0]
            del model, forward, optimizer, step
        except Exception as exc:  # one broken variant must not hide the others' curves
            row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
        rows[name] = row
    return [rows[name] for name in variants]
