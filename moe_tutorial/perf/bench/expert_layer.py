"""The expert layer alone: forward + backward of the routed expert MLP, permutation included, on
the course's shapes (`EXPERT_SHAPES`) and routings, every variant checked against the naive loop
before it is timed. With what every part of the benchmark reads: a precision's kind (its
tolerance, the peak its MFU is quoted against) and a failed variant's status.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ...moe.dispatch import run_experts
from ...moe.experts import convert_experts, create, default_backend
from ...moe.model import route
from ...precision import hardware, recipes
from ...precision.quant import rel_error
from ...precision.recipes import supported_recipes
from ..timing import expert_mlp_flops, peak_memory_gb, reset_memory, tflops, time_fn


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


def classify_error(exc: Exception) -> dict:
    """A variant that raised: 'unsupported' when the library says it has no kernel for it on
    this GPU (an honest result), 'error' otherwise (a bug to fix)."""
    message = f"{type(exc).__name__}: {exc}"[:500]
    if "CUBLAS_STATUS_NOT_SUPPORTED" in message:
        return dict(status="unsupported", error=message)
    return dict(status="error", error=message)


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


def _expert_problem(shape: ExpertShape, routing: str, device, dtype):
    """What every variant of one shape/routing runs on, seeded: the naive loop with its weights
    (the reference, and the weights each variant is converted from), the routing weights and
    indices, the hidden states and the output gradient."""
    torch.manual_seed(0)
    base = create("naive", shape.experts, shape.hidden, shape.intermediate, dtype=dtype,
                  device=device)
    torch.nn.init.normal_(base.gate_up_proj, std=0.02)
    torch.nn.init.normal_(base.down_proj, std=0.02)
    weights, indices = (t.to(device) for t in make_routing(shape, routing))
    hidden = torch.randn(shape.tokens, shape.hidden, device=device, dtype=dtype)
    grad_out = torch.randn_like(hidden)
    return base, weights, indices, hidden, grad_out


def _expert_step(experts, recipe, x, w, indices, grad_out):
    """(step, path): `step()` runs forward + backward of `experts` on the leaves `x` (hidden
    states) and `w` (routing weights) under `recipe` and returns the output; `path()` says what
    the last step ran."""
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

    return step, lambda: path


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
    base, weights, indices, hidden, grad_out = _expert_problem(shape, routing, device, dtype)
    reference = loop_ms = None
    results = []
    for backend, precision, *more in variants:
        options = more[0] if more else {}
        label = "fp32" if precision == "bf16" and dtype == torch.float32 else precision
        row = dict(part="expert", shape=shape.name, routing=routing, backend=backend,
                   precision=label, tokens=shape.tokens, flops=shape.flops(), **options,
                   default=backend == default and precision == "bf16" and not options)
        experts = step = None
        try:
            for p in base.parameters():  # the loop's gradients: freed before a converted copy runs
                p.grad = None
            reset_memory(device)
            experts = convert_experts(base, backend, **options) if backend != "naive" else base
            # the TE experts read the recipe, and its alignment, from autocast
            recipe = recipes.resolve(precision, caps).build()
            x = hidden.detach().clone().requires_grad_()
            w = weights.detach().clone().requires_grad_()
            step, path = _expert_step(experts, recipe, x, w, indices, grad_out)
            out = step().detach()
            if reference is None:
                reference = out  # the first variant is the loop
            row["rel_error"] = rel_error(out, reference)
            row["tolerance"] = TOLERANCE[precision_kind(precision)]
            row["path"] = path()
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
            row.update(classify_error(exc))
        finally:
            if experts is not base:
                del experts, step  # the step holds the converted experts too
        results.append(row)
        if on_result is not None:
            on_result(row)
    return results
