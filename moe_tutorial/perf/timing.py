"""Measuring speed honestly: clocks, FLOP counts, peaks, MFU and memory — the primitives every
harness (`bench`, `train_dist`, the notebooks' sweeps, the live widgets) measures with.

`time_fn(fn)` runs `fn` a few times to warm up (kernel selection, caches, lazy initialisation),
then times each of `iters` calls — with CUDA events on a GPU (GPU time of the queued work, no
Python-side guesswork), with `time.perf_counter` on a CPU — and reports the median, which
resists the occasional slow step better than the mean.

FLOPs are counted, not measured: a matmul of [m, k] × [k, n] is 2·m·k·n FLOPs, and a training
step (forward + backward) costs 3× the forward. For the expert MLP of one MoE layer (gate-up
H → 2I, down I → H, on T tokens × top_k experts):

    forward = 2·T·k·H·2I + 2·T·k·I·H = 6·T·k·H·I      forward + backward = 18·T·k·H·I

Memory is in GiB (2^30 bytes), the "GB" of this course's tables.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from ..precision import hardware


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    iters: int
    timer: str  # "cuda events" | "perf_counter"

    def to_dict(self) -> dict:
        return asdict(self)


def synchronize(device: torch.device | str | None) -> None:
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
        synchronize(device)
        events = {name: [] for name in fns}
        for _ in range(iters):
            for name, fn in fns.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                events[name].append((start, end))
        synchronize(device)
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


# Dense tensor-core peaks from NVIDIA's datasheets (no sparsity), TFLOP/s, per precision.
DATASHEET_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "B200": 2250.0, "B300": 2250.0}
DATASHEET_FP8_TFLOPS = {"H100": 1978.9, "H200": 1978.9, "B200": 4500.0, "B300": 4500.0}


def environment() -> dict:
    """Versions and hardware, recorded with every result."""
    caps = hardware.capabilities()
    e = caps.env
    return {"gpu": e.gpu_name, "gpu_count": e.gpu_count,
            "compute_capability": ".".join(map(str, e.compute_capability)) if e.compute_capability else None,
            "driver": e.driver_version, "cuda": e.cuda_version, "torch": e.torch_version,
            "transformer_engine": e.te_version if caps.has_te else None,
            "transformers": e.transformers_version, "python": e.python_version,
            "cpu_threads": torch.get_num_threads(),
            # The memory a GPU really has: what the memory arithmetic budgets against
            "gpu_total_memory_bytes": (torch.cuda.get_device_properties(0).total_memory
                                       if e.gpu_name and torch.cuda.is_available() else None),
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
    """Peak memory torch allocated on a CUDA `device` since the last reset, in GiB (2^30 bytes,
    as the course's "peak GiB" columns say); None on a CPU, where it is not tracked."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


def resident_gb(device=None) -> float | None:
    """Memory torch holds allocated on a CUDA `device` right now, in GiB; None on a CPU. Taken
    after `reset_memory`, it is what an earlier measurement left behind, which the next peak
    includes: a peak is a variant's own only where this is about 0."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.memory_allocated(device) / 2**30


def allocator_retries(device=None) -> int | None:
    """How many times torch's caching allocator on a CUDA `device` has found no cached block
    and no free memory, freed its whole cache (`cudaFree`, which waits for the GPU to finish
    everything queued) and tried again; None on a CPU. A step that makes it retry is short of
    memory, and pays with idle GPU time: take the count before and after timing it."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


def reset_memory(device) -> None:
    """Free what the last measurement left (Python garbage, torch's cached blocks) and restart
    the peak-memory counter, so the next measurement's peak is its own."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def model_flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token: 6 × active parameters (matmuls, forward + backward) plus
    attention's score and value products, 6 × 2 × layers × seq_len × hidden (causal masking not
    discounted, as in the usual MFU convention)."""
    return 6 * config.active_params_per_token() + 12 * config.num_layers * seq_len * config.hidden_size


def mfu_text(tflops_: float, peaks: tuple[float | None, float | None], missing: str = "-") -> str:
    """'measured% / datasheet%' MFU of one (measured, datasheet) peak pair; `missing` for a
    peak the run did not record (never a number from elsewhere)."""
    return " / ".join(f"{100 * tflops_ / p:.1f}%" if p else missing for p in peaks)


def copy_bandwidth_gb_per_s(device, nbytes: int = 2**30) -> float:
    """Achievable memory bandwidth in GB/s (10^9 bytes/s, the unit bandwidth is quoted in): the
    rate of one copy of `nbytes` bytes within `device`, which reads every byte once and writes it
    once, so 2 × nbytes cross the memory bus per copy. On a GPU that is HBM, timed with CUDA
    events; the default 1 GiB is far larger than the L2 cache (50 MB on an H100/H200), so the
    cache cannot serve it. On a CPU it is the rate of the CPU's memcpy in main memory
    (perf_counter), not a GPU's HBM: a number for this machine only."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
        raise ValueError(f"nbytes={nbytes!r} must be a positive int: the size of the copy in bytes, "
                         f"e.g. 2**30")
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)  # ones: pages really backed
    target = torch.empty_like(source)
    t = time_fn(lambda: target.copy_(source), warmup=3, iters=10, device=device)
    return 2 * nbytes / (t.median_ms * 1e-3) / 1e9


def attention_flops(batch: int, seq_len: int, heads: int, head_dim: int, *, causal: bool = True,
                    backward: bool = True) -> int:
    """Matmul FLOPs of scaled-dot-product attention over `heads` query heads. Per head and per
    (query, key) pair the score q·k costs 2·head_dim FLOPs and the weighted value p·v another
    2·head_dim, so forward = 4·head_dim per pair. A sequence has seq_len² pairs, or
    seq_len·(seq_len + 1)/2 under causal masking (a query sees itself and the keys before it).
    The backward pass runs twice the forward's matmuls (dV = Pᵀ·dO, dP = dO·Vᵀ, dQ = dS·K,
    dK = dSᵀ·Q): forward + backward = 3 × forward. FlashAttention's recomputation of the scores
    in the backward pass is the kernel's choice, not work the step needs, so it is not counted;
    nor is the softmax (no matmul). Grouped-query attention shares K and V among heads, not FLOPs.
    Non-causal, this is `model_flops_per_token`'s attention term (12 · seq_len · hidden per token
    and layer)."""
    pairs = seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len
    forward = 4 * batch * heads * head_dim * pairs
    return 3 * forward if backward else forward


def sdpa_tflops(device, batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
                dtype=torch.bfloat16, backward: bool = True) -> float:
    """Measured rate of causal `F.scaled_dot_product_attention` (forward + backward, or forward
    only) at these shapes, grouped-query when kv_heads < heads, in TFLOP/s of
    `attention_flops(causal=True)`: the rate attention's part of a training step can reach on
    this device. torch picks the kernel; call it under `torch.nn.attention.sdpa_kernel(...)` to
    measure the backend a model uses."""
    import torch.nn.functional as F

    if heads % kv_heads:
        raise ValueError(f"heads={heads} is not a multiple of kv_heads={kv_heads}: grouped-query "
                         f"attention shares each key/value head among heads / kv_heads query heads")
    q = torch.randn(batch, heads, seq_len, head_dim, device=device, dtype=dtype, requires_grad=backward)
    k, v = (torch.randn(batch, kv_heads, seq_len, head_dim, device=device, dtype=dtype,
                        requires_grad=backward) for _ in range(2))
    grad_out = torch.randn_like(q)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=kv_heads != heads)
        if backward:  # autograd.grad: nothing accumulates into .grad between calls
            torch.autograd.grad(out, (q, k, v), grad_out)

    t = time_fn(step, warmup=3, iters=10, device=device)
    flops = attention_flops(batch, seq_len, heads, head_dim, causal=True, backward=backward)
    return tflops(flops, t.median_ms)
