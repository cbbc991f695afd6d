"""What a part of a training step is, and profiler events as parts: the ordered rule table `RULES`
(regex -> part) that `part_of` applies to a profiled event's names, and the events of a
torch.profiler run read as units of work (`kernel_units` on a GPU, `op_units` on a CPU) whose
time `attribute` splits among `PARTS`. `step_profile` measures with these; `idle_gaps` reads the
same CUDA kernels (`cuda_kernels`).
"""

from __future__ import annotations

import functools
import re
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

IDLE = "launch gaps / idle"
OTHER = "other"
PARTS = ("GEMMs", "attention", "quantization", "permutation", "optimizer",
         "norms & elementwise", "communication", OTHER, IDLE)
# One colour per part, the same in every chapter's figure (idle light grey: nothing ran).
COLORS = {"GEMMs": "#636EFA", "attention": "#AB63FA", "quantization": "#FFA15A",
          "permutation": "#19D3F3", "optimizer": "#00CC96", "norms & elementwise": "#FECB52",
          "communication": "#EF553B", OTHER: "#8C8C8C", IDLE: "#D9D9D9"}
SOURCES = ("cuda kernels", "cpu ops")


def _rule(part: str, pattern: str) -> tuple[str, re.Pattern]:
    return part, re.compile(pattern, re.IGNORECASE)


# Ordered: the first rule that matches any name of an event (its own, the op that launched it,
# the ops and ranges around that op) decides its part. Kernel names checked against TE 2.20.2's
# libtransformer_engine.so (its kernels' symbols) and transformer_engine/common/triton/.
RULES: tuple[tuple[str, re.Pattern], ...] = (
    # Collectives first: NCCL kernels (ncclDevKernel_SendRecv carries all-to-all), gloo, torch's
    # c10d ops (the wait for a functional collective included), TE's userbuffers; their names
    # contain "gather" / "reduce", which later rules would claim.
    _rule("communication", r"nccl|gloo|c10d|alltoall|all_to_all|allreduce|all_reduce|"
                           r"allgather|all_gather|reduce_?scatter|sendrecv|kuserbuffers|nvshmem"),
    # TE's random Hadamard transform fused with the NVFP4 cast (rht_gemm_device,
    # hadamard_transform_cast_fusion): quantization work, though named "gemm", and "hadamard"
    # contains "adam", which the optimizer rule would claim.
    _rule("quantization", r"hadamard|rht_gemm"),
    # Attention before GEMMs: cuDNN's SDPA kernels are named after their wgmma instructions and
    # flash kernels after their cutlass types; the ops inside torch's SDPA are attention too.
    _rule("attention", r"flash|fmha|sdpa|scaled_?dot_?product|attention|fused_attn"),
    # Before GEMMs and elementwise: torch's fused AdamW (FusedAdamMathFunctor), TE's FusedAdam
    # (multi_tensor_adam), and every op or kernel run inside Optimizer.step / zero_grad (torch's
    # per-parameter AdamW on a CPU is plain elementwise ops); gradient clipping's norm.
    _rule("optimizer", r"adam(?!ard)|optimizer\.(step|zero_grad)|sgd|_foreach_norm|lpnorm|"
                       r"l2norm|clip_grad"),
    # cuBLAS (nvjet, sm90_xmma, gemv, splitK reduce), CUTLASS (torch._grouped_mm, TE's grouped
    # GEMM and its setup kernels), and on a CPU the matmul ops and their autograd nodes.
    _rule("GEMMs", r"gemm|gemv|cutlass|xmma|nvjet|cublas|s16816|s1688|wgmma|"
                   r"^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|_grouped_mm|einsum|mv)$|"
                   r"^(Mm|Addmm|Bmm|Baddbmm|GroupedMm|Mv)Backward\d*$"),
    # TE's casts to FP8 / MXFP8 / NVFP4 and their scales: cast_transpose(_optimized|_general|
    # _fused), multi_cast_transpose, block_scaled(_1d)_cast_transpose, (group_)quantize_*,
    # dequantize, cast_fp8, partial_cast, amax kernels (current and delayed scaling),
    # compute_scale / scale_inv, MXFP8 scale swizzles, FP8 transposed copies with their dbias.
    _rule("quantization", r"cast_transpose|quantiz|cast_fp8|cast_only|partial_cast|"
                          r"group_cast|amax\w*_kernel|amax_and_scale|compute_?scale|scale_?inv|"
                          r"swizzle\w*scaling|block_scaling|nvfp4|transpose_general_kernel|dbias"),
    # The loss before permutation: its gather of the target logits is not token movement.
    _rule("norms & elementwise", r"cross_?entropy|nll_loss"),
    # The token embedding's lookup (an index_select) and its gradient: not expert permutation.
    _rule(OTHER, r"embedding"),
    # Token movement: TE's permute kernels (moe_permute/unpermute, the triton _permute_kernel,
    # row_id_map passes, chunk sorting, per-expert padding), the course's routing.permute /
    # unpermute (_Dispatch, _Combine), torch's index / gather / scatter / sort kernels and ops,
    # the naive loop's nonzero, and the router's top-k that decides where tokens go.
    _rule("permutation", r"moe_(un)?permute|_(un)?permute_kernel|_unpermute|row_id_map|"
                         r"sort_chunks|chunk_sort|multi_(un)?padding|splits_to_offsets|"
                         r"^_(Dispatch|Combine)(Backward)?$|index|gather|scatter|sort|topk|"
                         r"nonzero|bincount|histc|cumsum|repeat_interleave|searchsorted|"
                         r"masked_select"),
    # Norms, activations, softmax, casts between float types, copies and fills: torch's
    # elementwise / reduce / softmax / cat kernels, TE's activation kernels, memcpy / memset,
    # torch's foreach kernels outside the optimizer, and the matching aten ops on a CPU.
    _rule("norms & elementwise",
          r"elementwise|reduce_kernel|softmax|norm|act_kernel|gated|swiglu|silu|gelu|rope|"
          r"catarray|memcpy|memset|fill|foreach|multi_tensor_apply|"
          r"^aten::_?(add|sub|rsub|mul|div|neg|exp|log|pow|sqrt|rsqrt|reciprocal|sigmoid|relu|"
          r"tanh|sin|cos|abs|sign|clamp|maximum|minimum|lerp|addcmul|addcdiv|copy|zero|clone|"
          r"contiguous|to|to_copy|cat|stack|mean|sum|max|min|amax|where|masked_fill|eq|ne|gt|lt|"
          r"ge|le|logical_\w+|one_hot|threshold|aminmax)(_\w*)?$"),
)


@functools.lru_cache(maxsize=65536)
def part_of(*names: str) -> str:
    """The part (one of `PARTS`) of a profiled event, from its names: its own first, then the op
    that launched it and the enclosing ops and ranges. The first rule of `RULES` that matches
    any of them wins; none: "other"."""
    if not names or not all(isinstance(n, str) for n in names):
        raise ValueError(f"part_of takes one or more event names (str), got {names!r}")
    for part, pattern in RULES:
        if any(pattern.search(name) for name in names):
            return part
    return OTHER



# The namespaces of the dispatcher's ops in a CPU profile (ranges, autograd nodes, Python
# functions have none of these).
OP_NAME = re.compile(r"^(aten|prims|c10d|_c10d_functional|c10d_functional)::")


@dataclass(frozen=True)
class Unit:
    """One profiled piece of work: an interval (µs) on the profile's timeline, how deep it is
    nested in others (an op in an op: 1), and its part."""

    start: float
    end: float
    depth: int
    part: str


def attribute(units: Sequence[Unit], start: float, end: float) -> dict[str, float]:
    """Split the interval [start, end] among `PARTS`: at every moment the innermost running units
    share the time equally (nested ops: the inner one; overlapping kernels of two streams: half
    each); moments when nothing runs are "launch gaps / idle". The result sums to end - start."""
    if not end > start:
        raise ValueError(f"the profiled region [{start}, {end}] is empty")
    marks = []
    for unit in units:
        lo, hi = max(unit.start, start), min(unit.end, end)
        if hi > lo:
            marks += [(lo, 1, unit.depth, unit.part), (hi, -1, unit.depth, unit.part)]
    marks.sort(key=lambda mark: mark[0])
    totals = dict.fromkeys(PARTS, 0.0)
    running: dict[int, Counter] = defaultdict(Counter)  # depth -> part -> units running

    def share(span: float) -> None:
        if not running:
            totals[IDLE] += span
            return
        innermost = running[max(running)]
        count = sum(innermost.values())
        for part, n in innermost.items():
            totals[part] += span * n / count

    now = start
    for time, change, depth, part in marks:
        if time > now:
            share(time - now)
            now = time
        running[depth][part] += change
        if not running[depth][part]:
            del running[depth][part]
            if not running[depth]:
                del running[depth]
    share(end - now)
    return totals


def event_names(event) -> tuple[str, ...]:
    """The event's name, then those of the ops and ranges around it, innermost first."""
    names = [event.name]
    parent = event.cpu_parent
    while parent is not None:
        names.append(parent.name)
        parent = parent.cpu_parent
    return tuple(names)


@dataclass(frozen=True)
class Kernel:
    """One CUDA kernel (memcpy / memset included): its name, its time in µs on the profile's
    clock (that of `FunctionEvent.time_range`), and the correlation id of the op that launched it
    (0: none)."""

    name: str
    start: float
    end: float
    launched_by: int


def cuda_kernels(prof) -> list[Kernel]:
    """The profile's CUDA kernels, read from kineto's own events: `FunctionEvent` carries the
    link to the launching op (`linked_correlation_id`) only in newer torch (2.13 has it, the
    H200's 2.11 does not); kineto's events have it in every version the course supports."""
    from torch.autograd import DeviceType

    results = prof.profiler.kineto_results
    origin = results.trace_start_ns()
    kernels = []
    for event in results.events():
        # record_function ranges reappear on the GPU's timeline as user annotations spanning
        # their kernels: they are not kernels (counted, they would split every kernel's time)
        if event.device_type() == DeviceType.CUDA and not event.is_user_annotation():
            start = (event.start_ns() - origin) / 1e3
            kernels.append(Kernel(event.name(), start, start + event.duration_ns() / 1e3,
                                   event.linked_correlation_id()))
    return kernels


def kernel_units(events, kernels: Sequence[Kernel]) -> list[Unit]:
    """Every kernel, named after itself, the op that launched it (the CPU event whose id is the
    kernel's correlation id) and that op's enclosing ops and ranges."""
    from torch.autograd import DeviceType

    ops = {e.id: e for e in events if e.device_type == DeviceType.CPU}
    units = []
    for kernel in kernels:
        op = ops.get(kernel.launched_by) if kernel.launched_by else None
        names = (kernel.name,) + (event_names(op) if op is not None else ())
        units.append(Unit(kernel.start, kernel.end, 0, part_of(*names)))
    return units


def op_units(events, region) -> list[Unit]:
    """The aten (and c10d) ops of the profiled thread, each as deep as the ops around it."""
    units = []
    for e in events:
        if e.thread != region.thread or not OP_NAME.match(e.name):
            continue
        names = event_names(e)
        depth = sum(1 for name in names[1:] if OP_NAME.match(name))
        units.append(Unit(e.time_range.start, e.time_range.end, depth, part_of(*names)))
    return units

