"""The rates a device achieves: dense and expert GEMMs in bf16 and FP8, HBM bandwidth, causal
attention (`Rates`); measured now (`measure_rates`) or read from a benchmark report
(`Rates.from_committed`). A rate nobody measured is missing, never guessed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from ...arguments import check_count
from ...moe.config import MoEConfig
from ...moe.model import ATTENTION_BACKENDS
from .. import results, timing
from .work import _check_shape_arguments

RATE_FIELDS = ("dense_bf16_tflops", "dense_fp8_tflops", "expert_bf16_tflops",
               "expert_fp8_tflops", "hbm_gb_per_s", "attention_tflops")
# A rate that may be absent, and the rate that stands in for it.
STAND_INS = {"expert_bf16_tflops": "dense_bf16_tflops", "expert_fp8_tflops": "dense_fp8_tflops",
             "attention_tflops": "dense_bf16_tflops"}


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
