"""Measuring speed honestly: timing, FLOP counting, throughput, MFU and peak memory.

`time_fn(fn)` runs `fn` a few times to warm up (kernel selection, caches, lazy initialisation),
then times each of `iters` calls — with CUDA events on a GPU (GPU time of the queued work, no
Python-side guesswork), with `time.perf_counter` on a CPU — and reports the median, which
resists the occasional slow step better than the mean.

FLOPs are counted, not measured: a matmul of [m, k] × [k, n] is 2·m·k·n FLOPs, and a training
step (forward + backward) costs 3× the forward. For the expert MLP of one MoE layer (gate-up
H → 2I, down I → H, on T tokens × top_k experts):

    forward = 2·T·k·H·2I + 2·T·k·I·H = 6·T·k·H·I      forward + backward = 18·T·k·H·I
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from .lesson import rel_error


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    iters: int
    timer: str  # "cuda events" | "perf_counter"

    def to_dict(self) -> dict:
        return asdict(self)


def _synchronize(device: torch.device | str | None) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], *, warmup: int = 3, iters: int = 20,
            device: torch.device | str | None = None) -> Timing:
    """Median time of `fn()` over `iters` calls after `warmup` untimed ones.

    `device` says where `fn` queues its work: "cuda..." → CUDA events around each call;
    anything else → wall-clock time (`fn` must then finish its work before returning, as CPU
    code does).
    """
    return time_fns({"fn": fn}, warmup=warmup, iters=iters, device=device)["fn"]


def time_fns(fns: dict[str, Callable[[], object]], *, warmup: int = 3, iters: int = 20,
             device: torch.device | str | None = None) -> dict[str, Timing]:
    """`time_fn` for several variants at once, interleaved: every round times each variant
    once, so a slow spell of the machine (another process, a notebook frontend drawing a
    figure on the same cores, GPU clocks settling) lands on all of them alike instead of
    on whichever ran first. Returns {name: Timing}."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    on_cuda = device is not None and torch.device(device).type == "cuda"
    times: dict[str, list[float]] = {name: [] for name in fns}
    if on_cuda:
        _synchronize(device)
        events = {name: [] for name in fns}
        for _ in range(iters):
            for name, fn in fns.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                events[name].append((start, end))
        _synchronize(device)
        times = {name: [start.elapsed_time(end) for start, end in pairs]
                 for name, pairs in events.items()}
    else:
        for _ in range(iters):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: Timing(statistics.median(t), min(t), max(t), iters,
                         "cuda events" if on_cuda else "perf_counter") for name, t in times.items()}


def expert_mlp_flops(tokens: int, top_k: int, hidden: int, intermediate: int,
                     backward: bool = True) -> int:
    """Active-expert FLOPs of one MoE layer's SwiGLU experts (see the module docstring)."""
    forward = 6 * tokens * top_k * hidden * intermediate
    return 3 * forward if backward else forward


def tflops(flops: float, ms: float) -> float:
    """Achieved TFLOP/s for `flops` in `ms` milliseconds."""
    return flops / (ms * 1e-3) / 1e12


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
    ExpertShape("tiny", 512, 64, 128, 8, 2),  # CPU-sized: the harness's own tests
)}
ROUTINGS = ("balanced", "skewed")

# Dense tensor-core peaks from NVIDIA's datasheets (no sparsity), TFLOP/s, per precision.
DATASHEET_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "B200": 2250.0, "B300": 2250.0}
DATASHEET_FP8_TFLOPS = {"H100": 1978.9, "H200": 1978.9, "B200": 4500.0, "B300": 4500.0}

# Relative error (Frobenius norm) a variant's output may have against the bf16 loop before it is
# timed. bf16: the same math summed in another order (~1e-3 seen). FP8 (E4M3, 3 mantissa bits):
# each quantised operand carries ~2^-4/sqrt(3) ≈ 3.6% RMS rounding error; a GEMM of two such
# operands ~5%, two GEMMs in a row plus the quantised SwiGLU output ~7-9% — 0.15 leaves margin
# for per-tensor scaling's coarser small values while still catching a wrong result (~100%).
TOLERANCE = {"bf16": 2e-2, "fp8": 0.15}


def make_routing(shape: ExpertShape, routing: str, seed: int = 0):
    """(weights fp32 [T, k], indices [T, k]) from random router logits. `skewed` adds a Zipf-like
    bias (expert e gets log(1/(e+1))·2), so a few experts take most tokens and the last ones few."""
    from .routing import route

    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(shape.tokens, shape.experts, generator=gen)
    if routing == "skewed":
        logits = logits + 2.0 * torch.log(1.0 / torch.arange(1, shape.experts + 1))
    return route(logits, shape.top_k)


def environment() -> dict:
    """Versions and hardware, recorded with every result."""
    from . import hardware

    caps = hardware.capabilities()
    e = caps.env
    return {"gpu": e.gpu_name, "gpu_count": e.gpu_count,
            "compute_capability": ".".join(map(str, e.compute_capability)) if e.compute_capability else None,
            "driver": e.driver_version, "cuda": e.cuda_version, "torch": e.torch_version,
            "transformer_engine": e.te_version if caps.has_te else None,
            "transformers": e.transformers_version, "python": e.python_version,
            "cpu_threads": torch.get_num_threads(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def dense_matmul_tflops(device, n: int = 8192, dtype=torch.bfloat16) -> float:
    """Measured rate of one large dense matmul: the ceiling MFU is quoted against. For
    `torch.float8_e4m3fn` it times `torch._scaled_mm` (E4M3 × E4M3 with per-tensor scales,
    bf16 output: the FP8 GEMM TE's per-tensor recipes run)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    if dtype == torch.float8_e4m3fn:
        one = torch.ones((), device=device)
        b = b.t()  # _scaled_mm takes its second operand column-major
        fn = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)  # noqa: E731
    else:
        fn = lambda: a @ b  # noqa: E731
    t = time_fn(fn, warmup=3, iters=10, device=device)
    return tflops(2 * n ** 3, t.median_ms)


def datasheet_tflops(gpu_name: str | None, precision: str = "bf16") -> float | None:
    """NVIDIA's dense peak of `precision` ("bf16" or "fp8") for this GPU; None if unknown."""
    table = {"bf16": DATASHEET_BF16_TFLOPS, "fp8": DATASHEET_FP8_TFLOPS}[precision]
    for key, value in table.items():
        if gpu_name and key in gpu_name:
            return value
    return None


@dataclass(frozen=True)
class Peaks:
    """The rates MFU is quoted against, per precision: measured in this run (a large dense
    matmul) and from the datasheet. MFU of a run = its TFLOP/s over the peak of ITS precision
    (the BioNeMo recipe's convention; torchtitan divides FP8 runs by the bf16 peak instead, so
    the tables show that too, labelled)."""

    bf16_measured: float | None = None
    bf16_datasheet: float | None = None
    fp8_measured: float | None = None
    fp8_datasheet: float | None = None

    def of(self, precision: str) -> tuple[float | None, float | None]:
        """(measured, datasheet) peak of "bf16" or "fp8"."""
        if precision == "fp8":
            return self.fp8_measured, self.fp8_datasheet
        return self.bf16_measured, self.bf16_datasheet

    def to_dict(self) -> dict:
        return {"dense_bf16_tflops_measured": self.bf16_measured,
                "datasheet_bf16_tflops": self.bf16_datasheet,
                "dense_fp8_tflops_measured": self.fp8_measured,
                "datasheet_fp8_tflops": self.fp8_datasheet}

    @classmethod
    def from_dict(cls, doc: dict) -> Peaks:
        """From a benchmark JSON (older files have no FP8 peaks: those stay None)."""
        return cls(doc.get("dense_bf16_tflops_measured"), doc.get("datasheet_bf16_tflops"),
                   doc.get("dense_fp8_tflops_measured"), doc.get("datasheet_fp8_tflops"))


def measure_peaks(device, gpu_name: str | None = None) -> Peaks:
    """Peaks of this device: both dense rates measured on a GPU (FP8 where the GPU has FP8
    tensor cores, compute capability >= 8.9), datasheet values by GPU name; nothing on a CPU."""
    if torch.device(device).type != "cuda":
        return Peaks()
    gpu_name = gpu_name or torch.cuda.get_device_name(device)
    has_fp8 = torch.cuda.get_device_capability(device) >= (8, 9)
    return Peaks(dense_matmul_tflops(device), datasheet_tflops(gpu_name),
                 dense_matmul_tflops(device, dtype=torch.float8_e4m3fn) if has_fp8 else None,
                 datasheet_tflops(gpu_name, "fp8"))


def peak_memory_gb(device=None) -> float | None:
    """Peak memory torch allocated on a CUDA `device` since the last reset, in GiB (2^30 bytes;
    the "GB" of this course's tables); None on a CPU, where it is not tracked."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def _reset_memory(device) -> None:
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _precision_kind(precision: str) -> str:
    """'fp8' for a TE recipe, 'bf16' for the plain dtype (bf16 on a GPU, fp32 on a CPU)."""
    return "bf16" if precision in ("bf16", "fp32") else "fp8"


def _autocast(recipe):
    import contextlib

    from . import hardware

    if recipe is None:
        return contextlib.nullcontext()
    return hardware.transformer_engine().autocast(enabled=True, recipe=recipe)


# ---------------------------------------------------------------------------------------------
# The expert layer: forward + backward of the routed expert MLP, permutation included

def expert_variants(caps) -> list[tuple[str, str]]:
    """(backend, precision) pairs this machine can run: the loop, the grouped bf16 paths, and
    each TE backend under each FP8 recipe TE runs here."""
    from .recipes import supported_recipes

    variants = [("naive", "bf16"), ("grouped_torch", "bf16"), ("te_grouped_linear", "bf16"),
                ("te_ops", "bf16")]  # TE backends run their PyTorch counterparts without TE
    if caps.has_te and caps.device == "cuda":
        if (caps.env.compute_capability or (0, 0))[0] == 9:  # TE's CUTLASS switch: Hopper only
            variants += [(f"te_grouped_linear{CUTLASS}", "bf16"), (f"te_ops{CUTLASS}", "bf16")]
        for recipe in supported_recipes(caps):
            variants += [("te_grouped_linear", recipe), ("te_ops", recipe)]
    return variants


# A backend name ending in this runs inside `experts.cutlass_grouped_gemm()` (forward and backward).
CUTLASS = "+cutlass"


def bench_expert_layer(shape: ExpertShape, routing: str = "balanced", *, device="cuda",
                       variants: list[tuple[str, str]] | None = None, warmup: int = 3,
                       iters: int = 20, on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Time every variant on one shape/routing; the naive loop (bf16) is the reference each
    variant's output is checked against before it is timed. A backend named `<backend>+cutlass`
    runs `<backend>` with TE's CUTLASS grouped GEMM (`experts.cutlass_grouped_gemm`)."""
    import contextlib

    from . import hardware, recipes
    from .experts import ExpertMLP, convert_experts, cutlass_grouped_gemm

    caps = hardware.capabilities()
    variants = variants or expert_variants(caps)
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    torch.manual_seed(0)
    base = ExpertMLP(shape.experts, shape.hidden, shape.intermediate, "naive", dtype=dtype,
                     device=device)
    torch.nn.init.normal_(base.gate_up_proj, std=0.02)
    torch.nn.init.normal_(base.down_proj, std=0.02)
    weights, indices = (t.to(device) for t in make_routing(shape, routing))
    hidden = torch.randn(shape.tokens, shape.hidden, device=device, dtype=dtype)
    grad_out = torch.randn_like(hidden)
    reference = loop_ms = None
    results = []
    for backend, precision in variants:
        label = "fp32" if precision == "bf16" and dtype == torch.float32 else precision
        row = dict(part="expert", shape=shape.name, routing=routing, backend=backend,
                   precision=label, tokens=shape.tokens, flops=shape.flops())
        experts = None
        try:
            _reset_memory(device)
            module_backend = backend.removesuffix(CUTLASS)
            gemm = cutlass_grouped_gemm if backend.endswith(CUTLASS) else contextlib.nullcontext
            experts = (convert_experts(base, module_backend) if backend != "naive" else base)
            recipe = None
            if precision != "bf16":
                choice = recipes.recipe_for(caps, precision)
                recipe = choice.build()  # the TE experts read it, and its alignment, from autocast
            x = hidden.detach().clone().requires_grad_()
            w = weights.detach().clone().requires_grad_()

            def step():
                for p in experts.parameters():
                    p.grad = None
                x.grad = w.grad = None
                with gemm():
                    with _autocast(recipe):
                        out = experts(x, indices, w)
                    out.backward(grad_out)
                return out

            out = step().detach()
            if reference is None:
                reference = out  # the first variant is the loop
            row["rel_error"] = rel_error(out, reference)
            row["tolerance"] = TOLERANCE[_precision_kind(precision)]
            row["path"] = experts.last_path + (" [NVTE_USE_CUTLASS_GROUPED_GEMM=1]"
                                               if gemm is cutlass_grouped_gemm else "")
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

OUR_VARIANTS = {  # variant -> (expert backend, precision): the course's steps, in order
    "ours_grouped_torch_bf16": ("grouped_torch", "bf16"),
    "ours_te_grouped_linear_bf16": ("te_grouped_linear", "bf16"),
    "ours_te_grouped_linear_fp8": ("te_grouped_linear", "fp8"),
    "ours_te_ops_bf16": ("te_ops", "bf16"),
    "ours_te_ops_fp8": ("te_ops", "fp8"),
}
HF_VARIANTS = ("hf_eager", "hf_grouped_mm", "hf_grouped_mm_compiled")
TRAIN_VARIANTS = HF_VARIANTS + tuple(OUR_VARIANTS)


def _classify_error(exc: Exception) -> dict:
    """A variant that raised: 'unsupported' when the library says it has no kernel for it on
    this GPU (an honest result), 'error' otherwise (a bug to fix)."""
    message = f"{type(exc).__name__}: {exc}"[:500]
    if "CUBLAS_STATUS_NOT_SUPPORTED" in message:
        return dict(status="unsupported", error=message)
    return dict(status="error", error=message)


def _build_ours(config, device, backend: str, precision: str):
    """(loss_fn(input_ids) -> loss, model): our model from the seeded initial weights, with
    this expert backend and precision, trained on HF's next-token targets (comparable losses)."""
    from .model import MoEForCausalLM, next_token_targets

    torch.manual_seed(0)
    model = MoEForCausalLM(config, device=device)
    model.set_expert_backend(backend)
    model.set_precision(precision)
    return (lambda ids: model(ids, next_token_targets(ids)).loss), model


def _build_train_variant(variant: str, config, device):
    """(loss_fn(input_ids) -> loss, the trained module) for a variant, all from the same seeded
    initial weights."""
    if variant.startswith("hf_"):
        from .hf_baseline import compile_for_training, hf_mixtral, hf_training_loss
        from .model import MoEForCausalLM

        torch.manual_seed(0)
        impl = "eager" if variant == "hf_eager" else "grouped_mm"
        hf = hf_mixtral(MoEForCausalLM(config, device=device), impl)
        if variant.endswith("_compiled"):
            hf = compile_for_training(hf)
        return (lambda ids: hf_training_loss(hf, ids)), hf

    if variant not in OUR_VARIANTS:
        raise ValueError(f"unknown training variant {variant!r}; choose from {TRAIN_VARIANTS}")
    return _build_ours(config, device, *OUR_VARIANTS[variant])


def train_precision(variant: str) -> str:
    """"fp8" or "bf16": the precision of a training variant's large GEMMs (its MFU's peak)."""
    return "fp8" if variant.endswith("_fp8") else "bf16"


def model_flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token: 6 × active parameters (matmuls, forward + backward) plus
    attention's score and value products, 6 × 2 × layers × seq_len × hidden (causal masking not
    discounted, as in the usual MFU convention)."""
    return 6 * config.active_params_per_token() + 12 * config.num_layers * seq_len * config.hidden_size


def _make_train_optimizer(variant, module, lr, device, optimizer):
    from .train import TrainSettings, make_optimizer

    if variant.startswith("hf_"):  # the baseline as HF users run it: torch's fused AdamW
        return torch.optim.AdamW(module.parameters(), lr=lr,
                                 fused=torch.device(device).type == "cuda" or None)
    return make_optimizer(module, TrainSettings(lr=lr, steps=2, warmup_steps=0), optimizer)


def bench_train_step(config, variants=TRAIN_VARIANTS, *, batch: int = 2, seq_len: int = 4096,
                     device="cuda", warmup: int = 5, iters: int = 20, lr: float = 1e-5,
                     optimizer: str = "torch_adamw",
                     on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Time forward + backward + optimizer step per variant, after checking its first loss against
    the first variant's (same weights, same batch)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen).to(device)
    tokens = batch * seq_len
    flops_per_step = model_flops_per_token(config, seq_len) * tokens
    reference_loss = None
    results = []
    for variant in variants:
        row = dict(part="train", variant=variant, batch=batch, seq_len=seq_len, tokens=tokens,
                   flops=flops_per_step, precision=train_precision(variant))
        loss_fn = module = opt = None
        try:
            _reset_memory(device)
            loss_fn, module = _build_train_variant(variant, config, device)
            opt = _make_train_optimizer(variant, module, lr, device, optimizer)
            row["optimizer"] = type(opt).__module__ + "." + type(opt).__name__
            with torch.no_grad():
                first_loss = loss_fn(ids).item()
            if reference_loss is None:
                reference_loss = first_loss
            row.update(first_loss=first_loss, loss_diff=abs(first_loss - reference_loss))
            kind = row["precision"]
            row["loss_tolerance"] = 0.05 if kind == "fp8" else 0.02  # nats, at initial loss ~ln V
            if row["loss_diff"] > row["loss_tolerance"]:
                row["status"] = "wrong"
            else:
                def step():
                    loss = loss_fn(ids)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)

                t = time_fn(step, warmup=warmup, iters=iters, device=device)
                tokens_per_s = tokens / (t.median_ms / 1e3)
                row.update(status="ok", median_ms=t.median_ms, min_ms=t.min_ms, timer=t.timer,
                           tokens_per_s=tokens_per_s, tflops=tflops(flops_per_step, t.median_ms),
                           peak_memory_gb=peak_memory_gb(device))
                if hasattr(module, "expert_paths"):
                    row["path"] = module.expert_paths()[0]
        except torch.cuda.OutOfMemoryError:
            row["status"] = "OOM"
        except Exception as exc:
            row.update(_classify_error(exc))
        finally:
            del loss_fn, module, opt  # free this variant's ~30 GB before the next one
        results.append(row)
        if on_result is not None:
            on_result(row)
    return results


# ---------------------------------------------------------------------------------------------
# Summary, tables, the whole run

def summarize(results: list[dict]) -> dict:
    """The headline ratios (medians from this run); None where this run lacks the variants."""
    ok = [r for r in results if r.get("status") == "ok"]

    def expert_best(shape, kind=None):
        rows = [r for r in ok if r["part"] == "expert" and r["shape"] == shape
                and r["routing"] == "balanced" and r["backend"] != "naive"
                and (kind is None or _precision_kind(r["precision"]) == kind)]
        loop = [r for r in ok if r["part"] == "expert" and r["shape"] == shape
                and r["routing"] == "balanced" and r["backend"] == "naive"]
        if not rows or not loop:
            return None
        return loop[0]["median_ms"] / min(r["median_ms"] for r in rows)

    train = {r["variant"]: r for r in ok if r["part"] == "train"}
    ours = [r for v, r in train.items() if v.startswith("ours_")]
    best = max(ours, key=lambda r: r["tokens_per_s"]) if ours else None

    def vs(name, key="tokens_per_s"):
        if best is None or name not in train:
            return None
        if key == "peak_memory_gb":
            if best.get(key) is None or not train[name].get(key):
                return None
            return best[key] / train[name][key]
        return best[key] / train[name][key]

    return {
        "expert_mixtral_best_bf16_speedup_vs_loop": expert_best("mixtral", "bf16"),
        "expert_mixtral_best_fp8_speedup_vs_loop": expert_best("mixtral", "fp8"),
        "expert_finegrained_best_speedup_vs_loop": expert_best("fine_grained"),
        "train_step_best_variant": best["variant"] if best else None,
        "train_step_speedup_vs_hf_eager": vs("hf_eager"),
        "train_step_speedup_vs_hf_grouped_mm": vs("hf_grouped_mm"),
        "train_step_speedup_vs_hf_grouped_mm_compiled": vs("hf_grouped_mm_compiled"),
        "train_step_peak_mem_ratio_vs_hf_grouped_mm": vs("hf_grouped_mm", "peak_memory_gb"),
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


def mfu_text(tflops_: float, peaks: tuple[float | None, float | None], missing: str = "-") -> str:
    """'measured% / datasheet%' MFU of one (measured, datasheet) peak pair; `missing` for a
    peak the run did not record (never a number from elsewhere)."""
    return " / ".join(f"{100 * tflops_ / p:.1f}%" if p else missing for p in peaks)


def row_precision(row: dict) -> str:
    """A training row's precision; files from before bench recorded it: the variant name's."""
    return row.get("precision") or train_precision(row["variant"])


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
                 f"{'TFLOP/s':>8} {'vs loop':>8} {'rel.err':>9} {'GB':>6}")
TRAIN_HEADER = (f"{'variant':<30} {'ms/step':>9} {'tokens/s':>11} {'TFLOP/s':>8} {'prec.':>5} "
                f"{'MFU own peak':>15} {'MFU bf16 peak':>15} {'GB':>6} {'Δloss0':>9}")
MFU_LEGEND = ("MFU own peak: TFLOP/s over the dense peak of the row's precision (bf16 rows: bf16, "
              "FP8 rows: FP8), measured in this run / datasheet; MFU bf16 peak: over the bf16 "
              "peak for every row (torchtitan's convention)")


def run(*, device=None, shapes=None, routings=ROUTINGS, expert=True, train=True,
        train_preset=None, train_variants=None, batch=None, seq_len=None, warmup=None,
        iters=None, optimizer="torch_adamw", log=print,
        on_result: Callable[[dict], None] | None = None) -> dict:
    """The whole benchmark, sized for the device: Mixtral / fine-grained / small shapes and the
    `mixtral-2l` model (batch 2 × 4096) on a GPU; the `tiny` shape and model on a CPU."""
    from .config import preset

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
        config = preset(train_preset or ("mixtral-2l" if on_gpu else "tiny"))
        if not on_gpu:
            config = config.with_overrides(dtype="float32")
        batch = batch or 2
        seq_len = seq_len or (4096 if on_gpu else 64)
        variants = train_variants or [v for v in TRAIN_VARIANTS if on_gpu or v in (
            "hf_eager", "hf_grouped_mm", "ours_grouped_torch_bf16", "ours_te_ops_bf16")]
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
    the summary recomputed over all of them, each part's date and dense-matmul rate kept. Refuses
    parts whose GPU or library versions differ: their ratios would not be comparable."""
    if not reports:
        raise ValueError("nothing to merge")
    def versions(report):
        return {k: v for k, v in report["environment"].items() if k != "date"}
    for r in reports[1:]:
        if versions(r) != versions(reports[0]):
            differ = sorted(k for k in versions(r) if versions(r)[k] != versions(reports[0]).get(k))
            raise ValueError(f"cannot merge reports from different environments (differ in {differ})")
    incomplete = [i for i, r in enumerate(reports) if not r.get("complete", True)]
    if incomplete:
        raise ValueError(f"report(s) {incomplete} did not finish (complete=False): rerun them")
    results = [row for r in reports for row in r["results"]]
    return {"environment": reports[0]["environment"],  # its date: when the run started
            "parts": [{"date": r["environment"].get("date"),
                       **Peaks.from_dict(r).to_dict(), "results": len(r["results"])}
                      for r in reports],
            **Peaks.from_dict(reports[-1]).to_dict(),
            "results": results, "summary": summarize(results), "complete": True}


def profile_train_step(config, variant: str, *, batch: int = 2, seq_len: int = 4096,
                       device="cuda", steps: int = 3, row_limit: int = 25) -> str:
    """torch.profiler over a few training steps of one variant: where the time goes (GPU time
    per kernel, kernel counts), as a printable table."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, config.vocab_size, (batch, seq_len),
                        generator=torch.Generator().manual_seed(0)).to(device)
    loss_fn, module = _build_train_variant(variant, config, device)
    optimizer = _make_train_optimizer(variant, module, 1e-5, device, "torch_adamw")

    def step():
        loss_fn(ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    wall = time_fn(step, warmup=2, iters=3, device=device).median_ms
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(device).type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        _synchronize(device)
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
    return (f"profile of {variant}, {steps} steps\n{busy}"
            + averages.table(sort_by=sort, row_limit=row_limit))


# ---------------------------------------------------------------------------------------------
# Loss curves: do the variants train alike?

def _build_curve_variant(variant, config, device):
    """(label, loss_fn(ids) -> loss, module) for a TRAIN_VARIANTS name or a
    (label, backend, precision) tuple of our model; same seeded initial weights either way."""
    if isinstance(variant, str):
        return (variant, *_build_train_variant(variant, config, device))
    label, backend, precision = variant
    return (label, *_build_ours(config, device, backend, precision))


def train_loss_curves(config, variants, *, steps: int = 30, batch: int = 4, seq_len: int = 256,
                      device="cuda", lr: float = 1e-3, windows: torch.Tensor | None = None,
                      timing_warmup: int = 3,
                      on_step: Callable[[str, dict], None] | None = None) -> list[dict]:
    """Train every variant for `steps` steps from the same initial weights on the same batches
    and return one row per variant with its loss curve — do the variants train alike?

    `variants`: names from `TRAIN_VARIANTS` (the HF baselines and our steps), or
    ``(label, expert backend, precision)`` tuples for our model with any backend and precision
    (e.g. ``("te_ops DelayedScaling", "te_ops", "DelayedScaling")``). `windows`: token ids
    ``[n, >= seq_len]`` (e.g. `data.load_protein_data(seq_len).train`), used in order; default:
    random tokens. Every variant gets the same optimizer — torch AdamW (fused on a GPU), betas
    (0.9, 0.95), no weight decay, `lr` after a linear warm-up over the first tenth of the steps,
    gradients clipped to norm 1 — so the curves differ only where the variants compute
    differently.

    Each row: variant, status ("ok"; "unavailable" when the variant cannot be set up on this
    machine, e.g. FP8 without TE; "error", "OOM", "diverged"), losses (one per step),
    ms_per_step (median wall time of the steps after `timing_warmup`; every step ends with
    `loss.item()`, which waits for the GPU), tokens_per_s, peak_memory_gb (CUDA only), path
    (what the experts ran), error. `on_step(label, record)` receives each step's
    ``{step, loss, ms, tokens_per_s}`` (e.g. for a `widgets.LiveDashboard`), outside the timing.
    """
    import math

    if steps < 1 or batch < 1 or seq_len < 2:
        raise ValueError(f"need steps >= 1, batch >= 1, seq_len >= 2; "
                         f"got {steps}, {batch}, {seq_len}")
    needed = steps * batch
    if windows is None:
        gen = torch.Generator().manual_seed(0)
        windows = torch.randint(0, config.vocab_size, (needed, seq_len), generator=gen)
    if windows.shape[-1] < seq_len:
        raise ValueError(f"windows of {windows.shape[-1]} tokens are shorter than "
                         f"seq_len={seq_len}")
    order = torch.arange(needed) % windows.shape[0]  # the same batches, same order, for all
    batches = [windows[order[i * batch:(i + 1) * batch], :seq_len] for i in range(steps)]
    warmup_steps = max(1, steps // 10)
    on_cuda = torch.device(device).type == "cuda"
    results = []
    for variant in variants:
        label = variant if isinstance(variant, str) else variant[0]
        row = dict(part="curve", variant=label, steps=steps, batch=batch, seq_len=seq_len,
                   losses=[], status="ok")
        loss_fn = module = opt = None
        try:
            _reset_memory(device)
            try:
                label, loss_fn, module = _build_curve_variant(variant, config, device)
            except ValueError as exc:  # refused by set_expert_backend / set_precision: say why
                row.update(status="unavailable", error=f"{type(exc).__name__}: {exc}"[:500])
                continue
            params = [p for p in module.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0,
                                    fused=on_cuda or None)
            times = []
            for step, ids in enumerate(batches):
                for group in opt.param_groups:
                    group["lr"] = lr * min(1.0, (step + 1) / warmup_steps)
                start = time.perf_counter()
                loss = loss_fn(ids.to(device))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                value = loss.item()  # waits for the GPU: the step's wall time is complete
                ms = (time.perf_counter() - start) * 1e3
                times.append(ms)
                if not math.isfinite(value):
                    row.update(status="diverged", error=f"loss {value} at step {step + 1}")
                    break
                row["losses"].append(value)
                if on_step is not None:
                    on_step(label, dict(step=step + 1, loss=value, ms=ms,
                                        tokens_per_s=ids.numel() / (ms / 1e3)))
            timed = times[timing_warmup:] or times
            row["ms_per_step"] = statistics.median(timed)
            row["tokens_per_s"] = batch * seq_len / (row["ms_per_step"] / 1e3)
            row["peak_memory_gb"] = peak_memory_gb(device)
            if hasattr(module, "expert_paths"):
                row["path"] = module.expert_paths()[0]
        except torch.cuda.OutOfMemoryError:
            row["status"] = "OOM"
        except Exception as exc:  # one broken variant must not hide the others' curves
            row.update(_classify_error(exc))
        finally:
            del loss_fn, module, opt  # free this variant's memory before the next one
            results.append(row)
    return results
