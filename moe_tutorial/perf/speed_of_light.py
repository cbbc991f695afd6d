"""The training step's speed of light: the time each part of the step cannot go below on a
device, from the model's shapes and the device's measured rates, next to what the profiler
measured (`step_profile.StepBreakdown`).

    rates = speed_of_light.Rates.from_committed()              # or measure_rates(device, ...)
    work = speed_of_light.step_work(cfg, batch=2, seq_len=4096, precision="fp8")
    floor = speed_of_light.floor(work, rates)                  # ms per part, and the total
    print(speed_of_light.format_table(floor, speed_of_light.compare(floor, breakdown)))

What a part must do (`step_work`): its tensor-core FLOPs (forward + backward) and the bytes it
must move through HBM at least — every tensor it reads read once, every tensor it writes written
once, nothing re-read that an ideal kernel would keep on chip. Its floor (`floor`):

    compute-bound parts (the GEMMs, attention)  max(FLOPs / FLOP rate, bytes / bandwidth)
    memory-bound parts (everything else)        bytes / bandwidth

A GEMM's floor is the larger of the two because its kernel must do both and at best overlaps
them; the elementwise parts' FLOPs run on CUDA cores at a few FLOPs per byte, far below the rate
that would bind, so only their bytes count. The step's floor is the sum of its parts' floors
(parts do not overlap in this single-stream step).

Parts (`PARTS`) and the profiler part each is compared with (`PROFILER_PART`): the profiler
classes every matmul kernel as "GEMMs", so the expert GEMMs, the attention projections, the
router and the lm_head are summed for that row; the loss (log-softmax and its gradient over the
logits) is "norms & elementwise" in the profiler's rules, and the token embedding's lookup is
"other". Nothing in a one-GPU step is communication, and no floor is spent waiting for launches.

Rates (`Rates`): dense GEMM rates in bf16 and FP8, the expert GEMMs' rate at the step's own
shapes (optional: the dense rate stands in, with a note), achievable HBM bandwidth, and causal
attention's rate (optional: the dense bf16 rate stands in, with a note). A rate nobody measured
is never guessed: the parts that need it are "not computable", and the step's floor is then a
partial sum, marked as a lower bound.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from .. import display
from ..arguments import check_count
from ..moe.config import MoEConfig, preset
from ..moe.model import ATTENTION_BACKENDS
from ..precision import hardware
from . import results, timing
from .step_parts import OTHER
from .step_parts import PARTS as PROFILER_PARTS
from .step_profile import (
    CHAPTER_LABELS,
    COURSE_BARS,
    StepBreakdown,
    breakdown_figure,
    chapter_breakdowns,
)

# The work model counts each GEMM's operands in the config's dtype or in FP8 (one byte): which
# recipe scales the FP8 operands does not change the minimum work.
GEMM_OPERAND_FORMATS = ("bf16", "fp8")
FP8_BYTES = 1
# Each FP8-quantized tensor is written twice: FP8 GEMMs on Hopper take only the "TN" layout, and
# MXFP8 on Blackwell scales along rows for one GEMM and along columns for another, so the
# backward GEMMs need a transposed (column-wise) copy next to the forward's row-wise one. TE's
# cast_transpose kernels write both from one read.
FP8_COPIES = 2
ROUTER_LOGIT_BYTES = 4  # the router's softmax runs in fp32 (model.Router)

PARTS = ("expert GEMMs", "attention projections", "router", "lm_head", "attention", "loss",
         "quantization", "permutation", "norms & elementwise", "embedding", "optimizer")
PROFILER_PART = {"expert GEMMs": "GEMMs", "attention projections": "GEMMs", "router": "GEMMs",
                 "lm_head": "GEMMs", "attention": "attention", "loss": "norms & elementwise",
                 "quantization": "quantization", "permutation": "permutation",
                 "norms & elementwise": "norms & elementwise", "embedding": OTHER,
                 "optimizer": "optimizer"}
OPTIMIZERS = ("adamw", "adamw_fp32")
RATE_FIELDS = ("dense_bf16_tflops", "dense_fp8_tflops", "expert_bf16_tflops",
               "expert_fp8_tflops", "hbm_gb_per_s", "attention_tflops")
# A rate that may be absent, and the rate that stands in for it.
STAND_INS = {"expert_bf16_tflops": "dense_bf16_tflops", "expert_fp8_tflops": "dense_fp8_tflops",
             "attention_tflops": "dense_bf16_tflops"}


# ---------------------------------------------------------------------------------------------
# The rates

@dataclass(frozen=True)
class Rates:
    """What a device achieves: TFLOP/s of dense GEMMs (bf16, FP8), of the step's expert GEMMs
    (bf16, FP8) and of causal attention; HBM bandwidth in GB/s (10^9 bytes/s). `sources` says
    where each came from ("measured now: ...", "<json path>: <field>", or "missing: why"); a
    missing rate is None."""

    device: str
    dense_bf16_tflops: float | None = None
    dense_fp8_tflops: float | None = None
    expert_bf16_tflops: float | None = None
    expert_fp8_tflops: float | None = None
    hbm_gb_per_s: float | None = None
    attention_tflops: float | None = None
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        for name in RATE_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value) or value <= 0):
                raise ValueError(f"Rates.{name}={value!r} must be a finite number > 0, or None "
                                 f"for a rate that was not measured")
        sources = {name: self.sources.get(name) or ("missing: not given" if getattr(self, name)
                                                    is None else "given")
                   for name in RATE_FIELDS}
        object.__setattr__(self, "sources", sources)

    def rate(self, name: str) -> tuple[float | None, str | None]:
        """(the rate `name`, a note when another rate stands in for it or it is missing)."""
        if name not in RATE_FIELDS:
            raise ValueError(f"unknown rate {name!r}; choose one of {RATE_FIELDS}")
        value = getattr(self, name)
        if value is not None:
            return value, None
        stand_in = STAND_INS.get(name)
        if stand_in is not None and getattr(self, stand_in) is not None:
            return getattr(self, stand_in), (f"{stand_in} stands in for {name}: "
                                             f"{self.sources[name]}")
        return None, f"{name}: {self.sources[name]}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Rates:
        if not isinstance(data, dict) or "device" not in data or set(data) - {
                f.name for f in fields(cls)}:
            raise ValueError(f"Rates.from_dict takes the dict Rates.to_dict() wrote (keys "
                             f"{['device', *RATE_FIELDS, 'sources']}), got {data!r:.200}")
        return cls(**data)

    @classmethod
    def from_committed(cls, path: str | Path = results.H200) -> Rates:
        """The rates a `python -m moe_tutorial bench` result file holds. With a `speed_of_light`
        section, its `rates`. Without one (h200.json as committed): the dense peaks the run
        measured (`dense_bf16_tflops_measured`, `dense_fp8_tflops_measured`, read by
        `timing.Peaks.from_dict`), and nothing else: such a file has no HBM bandwidth and no
        attention rate, and its expert-layer rows (`results` with part "expert", field
        `tflops`) time the whole routed expert MLP — permutation, SwiGLU and FP8 casts
        included, which are parts of their own here — so they are not the expert GEMMs' rate."""
        doc = results.read(path)
        if not isinstance(doc, dict):
            raise ValueError(f"{path}: not a benchmark report (a JSON object); pass the file "
                             f"`python -m moe_tutorial bench` wrote, e.g. {results.H200}")
        device = (doc.get("environment") or {}).get("gpu") or "unknown device"
        if "speed_of_light" in doc:
            rates = cls.from_dict(doc["speed_of_light"]["rates"])
            sources = {name: f"{path}: speed_of_light.rates.{name} ({how})"
                       for name, how in rates.sources.items()}
            return cls(**{**rates.to_dict(), "sources": sources})
        peaks = timing.Peaks.from_dict(doc)
        no_section = f"missing: {path} has no speed_of_light section"
        not_gemm_rates = (f"missing: {path}'s expert-layer rows time the whole expert MLP "
                          f"(permutation, SwiGLU, casts), not its GEMMs")
        sources = {"expert_bf16_tflops": not_gemm_rates, "expert_fp8_tflops": not_gemm_rates,
                   "hbm_gb_per_s": no_section, "attention_tflops": no_section}
        for name, key, value in (
                ("dense_bf16_tflops", "dense_bf16_tflops_measured", peaks.bf16_measured),
                ("dense_fp8_tflops", "dense_fp8_tflops_measured", peaks.fp8_measured)):
            sources[name] = f"{path}: {key}" if value is not None else f"missing: {path} has no {key}"
        return cls(device, peaks.bf16_measured, peaks.fp8_measured, sources=sources)


def expert_gemm_shapes(config: MoEConfig, batch: int, seq_len: int) -> list[tuple[int, int, int]]:
    """The (rows, in, out) of one expert's two forward GEMMs under balanced routing: each expert
    gets batch·seq_len·top_k / experts token copies (rounded up to 16 rows, the alignment TE
    pads FP8 experts to), gate-up hidden → 2·intermediate, down intermediate → hidden."""
    rows_per_expert = math.ceil(batch * seq_len * config.top_k / config.num_experts)
    rows = math.ceil(rows_per_expert / 16) * 16
    return [(rows, config.hidden_size, 2 * config.intermediate_size),
            (rows, config.intermediate_size, config.hidden_size)]


def _gemm_tflops(device, shapes: list[tuple[int, int, int]], dtype) -> float:
    """Measured rate of the GEMMs [m, k] × [k, n] of `shapes`, run back to back; FP8 as
    `timing.dense_matmul_tflops` runs it (`torch._scaled_mm`, per-tensor scales, bf16 out)."""
    calls = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(n, k, device=device).to(dtype).t()  # column-major, as _scaled_mm takes it
        if dtype == torch.float8_e4m3fn:
            one = torch.ones((), device=device)
            calls.append(lambda a=a, b=b, one=one: torch._scaled_mm(a, b, one, one,
                                                                   out_dtype=torch.bfloat16))
        else:
            calls.append(lambda a=a, b=b: a @ b)
    t = timing.time_fn(lambda: [call() for call in calls], warmup=3, iters=10, device=device)
    return timing.tflops(sum(2 * m * k * n for m, k, n in shapes), t.median_ms)


def measure_rates(device, config: MoEConfig, batch: int, seq_len: int, *,
                  matmul_size: int | None = None, copy_bytes: int | None = None) -> Rates:
    """Measure the rates now on `device`: dense bf16 / FP8 GEMMs of `matmul_size`² (default
    8192 on a GPU, 512 on a CPU), the expert GEMMs at this step's shapes (`expert_gemm_shapes`),
    achievable bandwidth (`timing.copy_bandwidth_gb_per_s` of `copy_bytes`: 1 GiB on a GPU,
    64 MiB on a CPU, where it is the CPU's memcpy rate) and causal attention forward + backward
    at the model's heads (`timing.sdpa_tflops`, with the model's attention backends). FP8 needs
    a GPU with FP8 tensor cores (compute capability >= 8.9); elsewhere the FP8 rates are
    missing, and say why."""
    from torch.nn.attention import sdpa_kernel

    _check_shape_arguments(config, batch, seq_len)
    dev = torch.device(device)
    on_gpu = dev.type == "cuda"
    n = matmul_size or (8192 if on_gpu else 512)
    copy_bytes = copy_bytes or (2**30 if on_gpu else 2**26)
    check_count("matmul_size", n)
    has_fp8 = on_gpu and torch.cuda.get_device_capability(dev) >= (8, 9)
    name = torch.cuda.get_device_name(dev) if on_gpu else "cpu"
    fp8 = torch.float8_e4m3fn
    shapes = expert_gemm_shapes(config, batch, seq_len)
    shape_text = " and ".join(f"[{m}×{k}]·[{k}×{n_}]" for m, k, n_ in shapes)
    values = {"dense_bf16_tflops": timing.dense_matmul_tflops(dev, n),
              "expert_bf16_tflops": _gemm_tflops(dev, shapes, torch.bfloat16),
              "hbm_gb_per_s": timing.copy_bandwidth_gb_per_s(dev, copy_bytes)}
    with sdpa_kernel(ATTENTION_BACKENDS, set_priority=True):
        values["attention_tflops"] = timing.sdpa_tflops(
            dev, batch, seq_len, config.num_heads, config.num_kv_heads, config.head_dim)
    sources = {"dense_bf16_tflops": f"measured now: bf16 matmul {n}³ (timing.dense_matmul_tflops)",
               "expert_bf16_tflops": f"measured now: bf16 {shape_text}, one expert's forward GEMMs",
               "hbm_gb_per_s": (f"measured now: copy of {copy_bytes} bytes, "
                                + ("device to device (HBM)" if on_gpu else
                                   "the CPU's memcpy in main memory, not a GPU's HBM")),
               "attention_tflops": f"measured now: causal SDPA forward + backward, batch {batch}"
                                   f" × {seq_len}, {config.num_heads} heads "
                                   f"({config.num_kv_heads} kv), head_dim {config.head_dim}"}
    if has_fp8:
        values["dense_fp8_tflops"] = timing.dense_matmul_tflops(dev, n, dtype=fp8)
        values["expert_fp8_tflops"] = _gemm_tflops(dev, shapes, fp8)
        sources["dense_fp8_tflops"] = f"measured now: FP8 _scaled_mm {n}³"
        sources["expert_fp8_tflops"] = f"measured now: FP8 _scaled_mm {shape_text}"
    else:
        why = f"missing: {name} has no FP8 tensor cores (a GPU of compute capability >= 8.9)"
        sources["dense_fp8_tflops"] = sources["expert_fp8_tflops"] = why
    return Rates(name, **values, sources=sources)


# ---------------------------------------------------------------------------------------------
# The work of one training step

@dataclass(frozen=True)
class PartWork:
    """One part's minimum work per step: matmul FLOPs (forward + backward), the bytes it must
    move through memory, the `Rates` field its FLOPs run at (None: memory-bound), and the part
    of `step_profile.PARTS` it is measured in."""

    flops: int
    bytes: int
    rate: str | None
    profiler_part: str


@dataclass(frozen=True)
class StepWork:
    """`step_work`'s result: the work per part of one training step of `config`."""

    batch: int
    seq_len: int
    precision: str
    optimizer: str
    parts: dict[str, PartWork]

    def to_dict(self) -> dict:
        return asdict(self)


def _linear_elements(rows: int, inputs: int, outputs: int, weight_copies: int = 1) -> int:
    """Elements of the three tensors of a trained linear layer y = x·Wᵀ: x [rows, inputs],
    W [outputs, inputs] (`weight_copies` of them: one per expert), y and dy [rows, outputs]."""
    return rows * inputs + weight_copies * outputs * inputs + rows * outputs


def _linear_bytes(rows: int, inputs: int, outputs: int, *, operand_bytes: int,
                  output_bytes: int, weight_copies: int = 1) -> int:
    """Bytes a trained linear layer's three GEMMs move at least: forward y = x·Wᵀ, backward
    dx = dy·W and dW = dyᵀ·x. Each GEMM reads two operands and writes one output, so x, W and dy
    are each read twice (as operands, `operand_bytes` per element: 1 in FP8) and y, dx, dW each
    written once (`output_bytes`: TE's FP8 GEMMs write bf16), and y, dx, dW have the sizes of
    dy, x, W: bytes = elements × (2·operand_bytes + output_bytes)."""
    return (_linear_elements(rows, inputs, outputs, weight_copies)
            * (2 * operand_bytes + output_bytes))


def _linear_flops(rows: int, inputs: int, outputs: int) -> int:
    """A trained linear layer's three GEMMs: forward 2·rows·inputs·outputs, backward twice that."""
    return 3 * 2 * rows * inputs * outputs


def _check_shape_arguments(config, batch, seq_len) -> None:
    if not isinstance(config, MoEConfig):
        raise ValueError(f"config must be a MoEConfig (e.g. config.preset('mixtral-2l')), got "
                         f"{type(config).__name__}")
    check_count("batch", batch)
    check_count("seq_len", seq_len)
    if seq_len > config.max_seq_len:
        raise ValueError(f"seq_len={seq_len} is longer than the model's max_seq_len="
                         f"{config.max_seq_len}; choose seq_len <= {config.max_seq_len}")


def adamw_bytes_per_parameter(optimizer: str, param_bytes: int) -> int:
    """Bytes AdamW moves per parameter and step. "adamw", torch's AdamW as the course runs it
    (`train.make_optimizer`), keeps its two moments in the parameters' dtype (p bytes): it reads
    the parameter, its gradient, exp_avg and exp_avg_sq (4p) and writes the parameter and both
    moments (3p): 7p, 14 bytes in bf16. "adamw_fp32", mixed precision with fp32 master weights:
    it reads the gradient (p) and the fp32 master weight and both fp32 moments (12), writes
    those three (12) and the working copy in the parameters' dtype (p): 24 + 2p, 28 in bf16."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {OPTIMIZERS}")
    return 7 * param_bytes if optimizer == "adamw" else 24 + 2 * param_bytes


def step_work(config: MoEConfig, batch: int, seq_len: int, *, precision: str = "bf16",
              optimizer: str = "adamw") -> StepWork:
    """The minimum work of one training step (forward, backward, optimizer step) of `config`
    on batch × seq_len tokens, per part of `PARTS`. `precision`: "bf16" (every GEMM in the
    config's dtype) or "fp8" (the expert GEMMs and the attention projections in FP8, as
    `model.set_precision` runs them; the router and lm_head stay in the config's dtype).
    `optimizer`: see `adamw_bytes_per_parameter`. Routing is taken as balanced (every token
    copy does the same work wherever it goes) and alignment padding as none."""
    _check_shape_arguments(config, batch, seq_len)
    if precision not in GEMM_OPERAND_FORMATS:
        raise ValueError(f"precision={precision!r}: choose one of {GEMM_OPERAND_FORMATS}")
    act = config.torch_dtype.itemsize  # bytes of an activation, weight or gradient element
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_layers
    heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
    tokens = batch * seq_len
    copies = tokens * config.top_k  # token copies the experts process
    fp8 = precision == "fp8"
    low = FP8_BYTES if fp8 else act  # operand bytes of the GEMMs that run in FP8
    # (rows, inputs, outputs, weight copies) of each layer's linears; q, k and v as one GEMM
    # (what the model runs in FP8, and the least traffic: x read once, not three times).
    qkv = (tokens, h, (heads + 2 * kv_heads) * d, 1)
    out_proj = (tokens, heads * d, h, 1)
    gate_up = (copies, h, 2 * inter, config.num_experts)
    down = (copies, inter, h, config.num_experts)

    def linears_bytes(shapes, operand_bytes):
        return sum(_linear_bytes(*s[:3], weight_copies=s[3], operand_bytes=operand_bytes,
                                 output_bytes=act) for s in shapes)

    x_bytes = tokens * h * act  # one [tokens, hidden] activation
    # Norms and elementwise, per layer. RMSNorm (two per layer): forward reads x, writes y (2);
    # backward reads dy and x, writes dx (3): 5 activations. Residual add (two per layer):
    # forward reads both summands, writes the sum (3); backward the residual stream's gradient
    # is the sum of the skip path's and the branch's (3): 6. RoPE on q and k: forward and
    # backward each read and write them. SwiGLU on the gate-up output [copies, 2·inter]: forward
    # reads it, writes [copies, inter] (3·copies·inter); backward reads dA and the gate-up output
    # and writes its gradient (1 + 2 + 2). Router softmax over fp32 logits [tokens, experts]:
    # forward reads and writes (2), backward reads probs and their gradient, writes dlogits (3).
    # Norm weights, the load-balancing loss and the routing weights' scale: ≤ 1/hidden of these.
    per_layer_elementwise = (2 * 5 * x_bytes + 2 * 6 * x_bytes
                             + 4 * tokens * (heads + kv_heads) * d * act
                             + 8 * copies * inter * act
                             + 5 * tokens * config.num_experts * ROUTER_LOGIT_BYTES)
    final_norm = 5 * x_bytes
    params = config.parameter_counts()
    parts = {  # name: (matmul FLOPs, bytes, the rate its FLOPs run at)
        # 18·T·k·H·I per layer (timing's count) at the expert GEMM rate of this precision.
        "expert GEMMs": (layers * timing.expert_mlp_flops(tokens, config.top_k, h, inter),
                         layers * linears_bytes((gate_up, down), low),
                         f"expert_{precision}_tflops"),
        # q/k/v and o: te.Linear in FP8, so the dense rate of this precision.
        "attention projections": (layers * sum(_linear_flops(*s[:3]) for s in (qkv, out_proj)),
                                  layers * linears_bytes((qkv, out_proj), low),
                                  f"dense_{precision}_tflops"),
        # The router and the lm_head stay in the config's dtype under FP8 (model.py).
        "router": (layers * _linear_flops(tokens, h, config.num_experts),
                   layers * linears_bytes([(tokens, h, config.num_experts, 1)], act),
                   "dense_bf16_tflops"),
        "lm_head": (_linear_flops(tokens, h, config.vocab_size),
                    linears_bytes([(tokens, h, config.vocab_size, 1)], act), "dense_bf16_tflops"),
        # Causal SDPA: 3 × 4·head_dim FLOPs per (query, key) pair and head (timing's count).
        # Bytes: forward reads q, k, v and writes o; backward reads q, k, v, o, do and writes
        # dq, dk, dv: q, o, do, dq have `heads` heads, k, v, dk, dv `kv_heads`: 6·(h + kv) in all.
        "attention": (layers * timing.attention_flops(batch, seq_len, heads, d),
                      layers * 6 * tokens * (heads + kv_heads) * d * act, "attention_tflops"),
        # The loss reads the logits once and writes their gradient once (the model computes it
        # in the forward pass: softmax - one_hot, scaled by 1 / targets).
        "loss": (0, 2 * tokens * config.vocab_size * act, None),
        # FP8: every operand of every FP8 GEMM — x, W and dy of each FP8 linear — is read once
        # in the activation dtype and written FP8_COPIES times in FP8, once per step (weights
        # change every step, so their FP8 copies are made again). Fusing the casts into the
        # kernels that produce those tensors would save the read; as the step runs, they are
        # separate kernels.
        "quantization": (0, fp8 * layers * (act + FP8_COPIES * FP8_BYTES) * sum(
            _linear_elements(*s) for s in (qkv, out_proj, gate_up, down)), None),
        # Dispatch: forward reads the tokens' rows and writes their copies grouped by expert;
        # combine: forward reads the experts' output copies and writes one row per token;
        # backward, each the other way round: 4 × (tokens + copies) rows of hidden. The row
        # maps and routing weights (integers and scalars per copy) are ≤ 1/hidden of that.
        "permutation": (0, layers * 4 * (tokens + copies) * h * act, None),
        "norms & elementwise": (0, layers * per_layer_elementwise + final_norm, None),
        # The lookup reads one row per token and writes it (2); backward reads dx and writes
        # the embedding's gradient, dense (every row: nn.Embedding's, which AdamW then reads).
        "embedding": (0, 3 * x_bytes + config.vocab_size * h * act, None),
        "optimizer": (0, params["total"] * adamw_bytes_per_parameter(optimizer, act), None),
    }
    parts = {name: PartWork(flops, nbytes, rate, PROFILER_PART[name])
             for name, (flops, nbytes, rate) in parts.items()}
    return StepWork(batch, seq_len, precision, optimizer, parts)


# ---------------------------------------------------------------------------------------------
# The floor

@dataclass(frozen=True)
class PartFloor:
    """One part's floor: compute_ms = FLOPs / rate (None: memory-bound, or its rate missing),
    memory_ms = bytes / bandwidth (None: bandwidth missing), floor_ms the larger of the two
    known (None: neither known: "not computable"); `complete` False when a term it needs is
    missing, so floor_ms is only a lower bound of its floor; `notes`: stand-ins and gaps."""

    compute_ms: float | None
    memory_ms: float | None
    floor_ms: float | None
    complete: bool
    profiler_part: str
    notes: tuple[str, ...] = ()

    @property
    def bound(self) -> str:
        """"compute", "memory" or "not computable": which term sets the floor."""
        if self.floor_ms is None:
            return "not computable"
        return "compute" if self.compute_ms is not None and self.floor_ms == self.compute_ms \
            else "memory"


@dataclass(frozen=True)
class Floor:
    """Every part's floor (`PartFloor`) for `work` at `rates`. `total_ms`: the step's floor,
    None when a part's is not complete; `lower_bound_ms`: the sum of what is known, a floor of
    the floor either way."""

    work: StepWork
    rates: Rates
    parts: dict[str, PartFloor]

    @property
    def complete(self) -> bool:
        return all(p.complete for p in self.parts.values())

    @property
    def lower_bound_ms(self) -> float:
        return sum(p.floor_ms for p in self.parts.values() if p.floor_ms is not None)

    @property
    def total_ms(self) -> float | None:
        return self.lower_bound_ms if self.complete else None

    def notes(self) -> list[str]:
        """Each note once, in part order."""
        return list(dict.fromkeys(note for p in self.parts.values() for note in p.notes))

    def to_dict(self) -> dict:
        return {"work": self.work.to_dict(),
                "parts": {name: {**asdict(p), "bound": p.bound} for name, p in self.parts.items()},
                "total_ms": self.total_ms, "lower_bound_ms": self.lower_bound_ms,
                "complete": self.complete, "notes": self.notes()}


def floor(work: StepWork, rates: Rates) -> Floor:
    """The floor of every part of `work` at `rates` (see the module docstring): FLOPs / rate
    for a part with matmul FLOPs, bytes / bandwidth for every part, the larger of the two."""
    if not isinstance(work, StepWork) or not isinstance(rates, Rates):
        raise ValueError(f"floor takes (step_work(...), Rates), got ({type(work).__name__}, "
                         f"{type(rates).__name__})")
    bandwidth, bandwidth_note = rates.rate("hbm_gb_per_s")
    parts = {}
    for name, w in work.parts.items():
        notes, compute_ms, complete = [], None, True
        if w.rate is not None:
            tflops, note = rates.rate(w.rate)
            notes += [note] if note else []
            complete = tflops is not None
            compute_ms = w.flops / (tflops * 1e9) if tflops else None  # TFLOP/s → FLOP/ms: ×1e9
        memory_ms = w.bytes / (bandwidth * 1e6) if bandwidth else None  # GB/s → bytes/ms: ×1e6
        if bandwidth is None and w.bytes:
            notes.append(bandwidth_note)
            complete = False
        known = [t for t in (compute_ms, memory_ms) if t is not None]
        parts[name] = PartFloor(compute_ms, memory_ms, max(known) if known else None,
                                complete, w.profiler_part, tuple(notes))
    return Floor(work, rates, parts)


# ---------------------------------------------------------------------------------------------
# Measured against the floor

@dataclass(frozen=True)
class Row:
    """One profiler part: measured ms per step, its floor (the sum of its parts' floors; None:
    not computable), whether that floor is complete, and measured / floor."""

    part: str
    measured_ms: float | None
    floor_ms: float | None
    complete: bool

    @property
    def ratio(self) -> float | None:
        if self.measured_ms is None or not self.floor_ms:
            return None
        return self.measured_ms / self.floor_ms


@dataclass(frozen=True)
class Comparison:
    """A measured step against its floor: per profiler part (`rows`, when a breakdown was
    given) and the whole step: measured_ms / floor as a percentage (above 100: slower than
    the floor). When the floor is incomplete the percentage is against its lower bound, so it
    overstates the distance to the floor; `complete` says which."""

    floor: Floor
    measured_ms: float
    rows: tuple[Row, ...]
    measured_by: str

    @property
    def percent_of_floor(self) -> float:
        return 100 * self.measured_ms / self.floor.lower_bound_ms

    def to_dict(self) -> dict:
        return {"measured_ms": self.measured_ms, "measured_by": self.measured_by,
                "floor_ms": self.floor.total_ms, "floor_lower_bound_ms": self.floor.lower_bound_ms,
                "complete": self.floor.complete, "percent_of_floor": self.percent_of_floor,
                "rows": [{**asdict(r), "ratio": r.ratio} for r in self.rows],
                "floor": self.floor.to_dict()}


def compare(floor: Floor, breakdown: StepBreakdown | None = None, *,
            step_ms: float | None = None) -> Comparison:
    """`floor` next to a measured step: `breakdown` (step_profile's profiled parts) gives the
    per-part rows; the step's time is `step_ms` (e.g. the benchmark's unprofiled median) if
    given, else the breakdown's profiled total."""
    if not isinstance(floor, Floor):
        raise ValueError(f"floor must be a speed_of_light.floor(...) result, got "
                         f"{type(floor).__name__}")
    if breakdown is not None and not isinstance(breakdown, StepBreakdown):
        raise ValueError(f"breakdown must be a step_profile.StepBreakdown, got "
                         f"{type(breakdown).__name__}")
    if step_ms is not None and (isinstance(step_ms, bool) or not isinstance(step_ms, (int, float))
                                or not math.isfinite(step_ms) or step_ms <= 0):
        raise ValueError(f"step_ms={step_ms!r} must be a finite number of milliseconds > 0")
    if breakdown is None and step_ms is None:
        raise ValueError("compare needs a measurement: a StepBreakdown, step_ms, or both")
    if not floor.lower_bound_ms > 0:
        raise ValueError("this floor has no computable part (every rate it needs is missing): "
                         "measure the rates (measure_rates) or read a file that has them")
    rows = []
    for part in PROFILER_PARTS if breakdown is not None else ():
        mine = [p for p in floor.parts.values() if p.profiler_part == part]
        known = [p.floor_ms for p in mine if p.floor_ms is not None]
        rows.append(Row(part, breakdown.part_ms[part],
                        sum(known) if known or not mine else None,
                        all(p.complete for p in mine)))
    measured_by = ("timed step" if step_ms is not None
                   else f"profiled step ({breakdown.source})")
    return Comparison(floor, float(step_ms if step_ms is not None else breakdown.total_ms),
                      tuple(rows), measured_by)


def _ms(value: float | None, complete: bool = True) -> str:
    if value is None:
        return "not computable"
    return f"{value:.2f}" + ("" if complete else " (≥)")


def format_table(floor: Floor, comparison: Comparison | None = None) -> str:
    """Printable text: the floor of every part (work, rate-bound time, memory-bound time, which
    binds), the step's floor, and with `comparison` the measured step against it per profiler
    part. "(≥)" marks a floor that misses a term: it is a lower bound."""
    if not isinstance(floor, Floor) or not (comparison is None
                                            or isinstance(comparison, Comparison)):
        raise ValueError("format_table takes (Floor, Comparison or None)")
    w = floor.work
    lines = [f"speed of light of one training step: batch {w.batch} × {w.seq_len}, "
             f"{w.precision}, {w.optimizer}; rates of {floor.rates.device}",
             f"{'part':<22} {'GFLOP':>9} {'GB moved':>9} {'compute ms':>11} {'memory ms':>10} "
             f"{'floor ms':>16}  bound"]
    for name, p in floor.parts.items():
        work = w.parts[name]
        lines.append(f"{name:<22} {work.flops / 1e9:>9.1f} {work.bytes / 1e9:>9.2f} "
                     f"{_ms(p.compute_ms) if work.rate else '-':>11} {_ms(p.memory_ms):>10} "
                     f"{_ms(p.floor_ms, p.complete):>16}  {p.bound}")
    total = (f"{floor.total_ms:.2f} ms" if floor.complete else
             f"at least {floor.lower_bound_ms:.2f} ms (parts marked (≥) or not computable "
             f"miss a rate)")
    lines.append(f"step floor: {total}")
    lines += [f"  note: {note}" for note in floor.notes()]
    lines += [f"  {name}: {how}" for name, how in floor.rates.sources.items()]
    if comparison is not None:
        lines.append(f"measured ({comparison.measured_by}) {comparison.measured_ms:.2f} ms = "
                     f"{comparison.percent_of_floor:.0f}% of the floor"
                     + ("" if floor.complete else " (of its lower bound: at most this)"))
        if comparison.rows:
            lines.append(f"{'profiler part':<22} {'measured ms':>11} {'floor ms':>16} "
                         f"{'measured / floor':>17}")
            for r in comparison.rows:
                ratio = f"{r.ratio:.2f}×" if r.ratio is not None else "-"
                lines.append(f"{r.part:<22} {r.measured_ms:>11.2f} "
                             f"{_ms(r.floor_ms, r.complete):>16} {ratio:>17}")
    return "\n".join(lines)


def section(rates: Rates, comparisons: dict[str, Comparison]) -> dict:
    """The benchmark file's `speed_of_light` section: the rates once, then per variant its
    floor and the comparison (JSON-ready; `Rates.from_committed` reads the rates back)."""
    if not isinstance(rates, Rates) or not isinstance(comparisons, dict) or not all(
            isinstance(c, Comparison) for c in comparisons.values()):
        raise ValueError("section takes (Rates, {variant name: Comparison})")
    return {"rates": rates.to_dict(),
            "variants": {name: c.to_dict() for name, c in comparisons.items()}}


def step_floors(config: MoEConfig, batch: int, seq_len: int, rates: Rates, *,
                optimizer: str = "adamw") -> dict[str, Floor]:
    """The step's floor with the GEMM operands in each format (`GEMM_OPERAND_FORMATS`) at these
    rates."""
    return {p: floor(step_work(config, batch, seq_len, precision=p, optimizer=optimizer), rates)
            for p in GEMM_OPERAND_FORMATS}


def committed_section(path: str | Path = results.H200) -> dict:
    """The `speed_of_light` section of a benchmark report (h200.json as committed): its rates,
    the floors and each profiled chapter's comparison."""
    doc = results.read(path)
    if not doc.get("speed_of_light"):
        raise ValueError(f"{path} has no speed_of_light section: run `python -m moe_tutorial "
                         f"speed-of-light --profile-upto fp8 --out FILE` on a GPU and merge FILE "
                         f"into it (`bench --merge`)")
    return doc["speed_of_light"]


def floor_bars(section: dict) -> dict[str, StepBreakdown]:
    """Each profiled step of a `speed_of_light` section as two bars for
    `step_profile.breakdown_figure`: the measured step by part, then its floor by part (a part
    with no floor, such as launch gaps, is 0 there)."""
    variants = {label: c for label, c in section.get("variants", {}).items() if c.get("rows")}
    if not variants:
        raise ValueError("this speed_of_light section has no profiled step: run speed-of-light "
                         "with --profile-upto")
    bars = {}
    for label, c in variants.items():
        measured = {row["part"]: row["measured_ms"] for row in c["rows"]}
        floor_ms = {row["part"]: row["floor_ms"] or 0.0 for row in c["rows"]}
        source = c["measured_by"].removeprefix("profiled step (").removesuffix(")")
        bars[label] = StepBreakdown(measured, c["measured_ms"], 0, source, "", 1)
        bars[f"{label}: floor"] = StepBreakdown(floor_ms, c["floor_lower_bound_ms"], 0, source,
                                                "", 1)
    return bars


def show_against_floor(section: dict, *, title: str) -> None:
    """Stacked bars (each profiled step, then its floor, by part), and one sentence per step:
    its floor over its time, and the parts furthest above their floors."""
    fig = breakdown_figure(floor_bars(section), title=title)
    if fig is None:
        print("plotly is not installed (pip install plotly): the sentences only.")
    else:
        fig.update_layout(xaxis_title="ms per training step: profiled (torch.profiler), and "
                                      "the floor from the measured rates")
        display.show_figure(fig)
    for label, c in section["variants"].items():
        gaps = sorted((r for r in c["rows"] if r["measured_ms"] is not None),
                      key=lambda r: r["measured_ms"] - (r["floor_ms"] or 0), reverse=True)[:3]
        named = ", ".join(f"{r['part']} {r['measured_ms'] - (r['floor_ms'] or 0):.1f} ms"
                          for r in gaps)
        print(f"{label}: {c['measured_ms']:.1f} ms against a floor of "
              f"{c['floor_lower_bound_ms']:.1f} ms ({c['floor_lower_bound_ms'] / c['measured_ms']:.0%}"
              f" of the speed of light); furthest above their floors: {named}.")


def for_course_bars(bars, *, mode: str, device) -> dict:
    """A `speed_of_light` section for the chapters' bars a notebook just profiled
    (`step_profile.course_bars(..., mode=mode)`): the rates measured now on `device`, the floors
    of the model and batch those bars ran, each bar against its precision's floor."""
    name, batch, seq_len = COURSE_BARS[mode]
    config = preset(name)
    rates = measure_rates(device, config, batch, seq_len)
    return section(rates, chapter_comparisons(bars, step_floors(config, batch, seq_len, rates)))


# ---------------------------------------------------------------------------------------------
# Command line: python -m moe_tutorial.perf.speed_of_light

def _chapter_precision(label: str) -> str:
    return "fp8" if label.startswith(CHAPTER_LABELS["fp8"]) else "bf16"


def chapter_comparisons(bars, floors: dict[str, Floor]) -> dict[str, Comparison]:
    """Each chapter's profiled step (`step_profile.ChapterBars`) against the floor of its
    precision (`floors`: {"bf16": Floor, "fp8": Floor})."""
    return {label: compare(floors[_chapter_precision(label)], b)
            for label, b in bars.breakdowns.items()}


def run(*, preset_name: str, batch: int, seq_len: int, device, committed: str | None = None,
        optimizer: str = "adamw", profile_upto: str | None = None,
        layers: int | None = None) -> dict:
    """`python -m moe_tutorial speed-of-light`: the rates (measured on `device`, or read from the
    `committed` result file), the step's floor in bf16 and FP8, and with `profile_upto` each
    course chapter's profiled step against its precision's floor; prints the tables and returns
    what `--out` writes: a part of a benchmark report (`environment`, no `results`, and the
    `speed_of_light` section with the `workload` it was computed for), which `bench --merge`
    adds to the report of the training-step run it describes. `layers`: the preset at another
    depth."""
    config = preset(preset_name, layers=layers)
    # Transformer Engine is imported (and what this process can run decided) before anything is
    # measured: a chapter that needs TE and does not get it is skipped or runs its PyTorch
    # counterpart, and the output says why (the reason TE did not import), never silently.
    caps = hardware.capabilities()
    rates = (Rates.from_committed(committed) if committed else
             measure_rates(device, config, batch, seq_len))
    floors = step_floors(config, batch, seq_len, rates, optimizer=optimizer)
    comparisons, skipped = {}, {}
    if profile_upto:
        bars = chapter_breakdowns(config, upto=profile_upto, device=device, batch=batch,
                                  seq_len=seq_len)
        comparisons = chapter_comparisons(bars, floors)
        skipped = dict(bars.skipped)
    for fl in floors.values():
        print(format_table(fl) + "\n")
    for label, c in comparisons.items():
        print(f"{label}:\n" + format_table(c.floor, c) + "\n")
    for label, why in skipped.items():
        print(f"{label}: not profiled here: {why}")
    te = caps.env.te_version if caps.has_te else None
    if not te:
        print(f"Transformer Engine: {caps.env.te_import_error or 'not installed'}")
    workload = {"preset": preset_name, "num_layers": config.num_layers, "batch": batch,
                "seq_len": seq_len, "optimizer": optimizer}
    return {"environment": timing.environment(), "results": [],
            "speed_of_light": {**section(rates, comparisons), "workload": workload,
                               "floors": {p: fl.to_dict() for p, fl in floors.items()},
                               "skipped": skipped, "transformer_engine": te,
                               "transformer_engine_error": None if te else caps.env.te_import_error}}
