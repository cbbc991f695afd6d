"""A training step the host never waits for: routing, permutation and expert GEMMs whose shapes
do not depend on the routing, so the whole step (forward, backward, clipping, AdamW) can be
captured once in a CUDA graph and replayed.

Where the other expert paths wait for the GPU
---------------------------------------------
`routing.permute` sizes its row buffer from the routing (`int(m_splits.sum())`), and TE's
`GroupedLinear` splits its input with a Python list of row counts (`split_sizes.tolist()`). Each
such read makes the host wait until the GPU has computed the counts; the kernels queued after it
start only once the host has launched them, so every wait shows as idle GPU time, and a step
with such a read cannot be captured in a CUDA graph (capture refuses a host read).

What this module does instead
-----------------------------
* `permute_static`: the token copies sorted by expert into a buffer whose row count is fixed by
  the shapes alone, `static_rows(T, k, E, align)`: T·k rows, plus room for every expert's
  alignment padding (E·(align-1), rounded up) where the GEMMs need each expert's rows to be a
  multiple of `align`. The per-expert counts and row offsets stay on the device (`index_add_`
  counts, cumulative sums); the rows no token uses are zero and belong to the last expert, so the
  GEMMs read them as zero rows, and their outputs and gradients are zero.
* Expert GEMMs that take the offsets as a device tensor: `torch._grouped_mm` (bf16), and for FP8
  on Hopper `torch._scaled_grouped_mm` with row-wise scales (`ScaledGroupedLinear`): the
  forward GEMM and the input-gradient GEMM in FP8 (E4M3); the weight-gradient GEMM, whose
  contraction runs over each expert's rows, in bf16 (`torch._grouped_mm`), or with
  `fp8_weight_gradient` in FP8 with a scale per expert and column
  (`quantize_columns_per_expert`). Without the FP8 kernel (a CPU, a GPU before Hopper, the meta
  device) the same quantized operands are multiplied after dequantizing them, and `last_path`
  says so.
* `GraphedTrainStep`: the whole training step in one CUDA graph, the optimizer a capturable
  AdamW (`capturable_adamw`).
* `host_sync_entry_points` / `count_host_syncs`: the detectors. On a GPU, torch's own sync debug
  mode; on a CPU, the step runs on the meta device (whose tensors hold no values, so any read of
  one raises) with the Python entry points that read values or sync patched to raise.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator

import torch
from torch.nn.attention import SDPBackend

from .routing import Permutation, _Dispatch, padded_rows, unpermute

# Rows per expert for the FP8 GEMMs: 16 rows of E4M3 are 16 bytes, so in the weight-gradient
# GEMM, whose operands are transposed and contract over the rows, every expert's slice starts
# 16-byte aligned (the alignment the grouped GEMMs' strides are checked against)
FP8_ROW_ALIGNMENT = 16
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
# Rows (or weight rows) whose largest magnitude is below this are scaled as if it were this:
# an all-zero row (the buffer's unused rows) quantizes to zeros instead of dividing by zero
AMAX_FLOOR = 1e-12


def static_rows(num_tokens: int, top_k: int, num_experts: int, align: int = 1) -> int:
    """Rows of `permute_static`'s buffer: T·k token copies, and where each expert's rows are
    padded to a multiple of `align`, room for the most padding any routing can need
    (E·(align-1)), rounded up to a multiple of `align`. Shapes only: no routing is read."""
    copies = num_tokens * top_k
    if align == 1:
        return copies
    return -(-(copies + num_experts * (align - 1)) // align) * align


def permute_static(hidden: torch.Tensor, indices: torch.Tensor, num_experts: int,
                   align: int = 1) -> tuple[torch.Tensor, Permutation]:
    """`routing.permute` without a host read: the token copies sorted by expert (stable) into a
    buffer of `static_rows(T, k, E, align)` rows, each expert's block starting at a multiple of
    `align`. Returns (rows [R, H], the `Permutation` that `routing.unpermute` inverts).

    The permutation's `m_splits` are the padded rows per expert with the buffer's unused tail
    added to the last expert, so `perm.offsets` (the GEMMs' row ends) end at R: every row of the
    buffer belongs to an expert, the unused ones are zero rows."""
    if not isinstance(align, int) or isinstance(align, bool) or align < 1:
        raise ValueError(f"align={align!r} must be a positive whole number of rows "
                         f"(1 = no padding)")
    num_tokens, top_k = indices.shape
    flat = indices.reshape(-1).long()  # index_add_ takes int64 indices
    order = torch.argsort(flat, stable=True)
    # index_add_ of ones counts without reading the indices' range (bincount reads it: a sync)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = padded_rows(counts, align)
    num_rows = static_rows(num_tokens, top_k, num_experts, align)
    # The unused tail goes to the last expert: a multiple of `align` (both sums are)
    m_splits = torch.cat([padded[:-1], padded[-1:] + (num_rows - padded.sum())])
    sorted_experts = flat[order]
    real_starts = torch.cumsum(counts, 0) - counts
    padded_starts = torch.cumsum(padded, 0) - padded
    rank_in_expert = torch.arange(flat.numel(), device=flat.device) - real_starts[sorted_experts]
    row_index = padded_starts[sorted_experts] + rank_in_expert
    assignment_rows = torch.empty_like(row_index).scatter_(0, order, row_index)
    perm = Permutation(order // top_k, row_index, assignment_rows.view(num_tokens, top_k),
                       counts, m_splits, num_rows, align)
    return _Dispatch.apply(hidden, perm), perm


# ---------------------------------------------------------------------------------------------
# Expert GEMMs with the offsets on the device

def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows `[offsets[e-1], offsets[e])` of x [R, K] times w[e]^T ([E, N, K] weights) for every
    expert, through `torch._grouped_mm` (differentiable; its backward takes the same offsets).
    Refuses, in one line, tensors the op cannot take rather than reading the offsets to loop."""
    from .experts import _grouped_mm_unusable

    reason = _grouped_mm_unusable(x, w)
    if reason is not None:
        raise ValueError(f"the sync-free experts need torch._grouped_mm, which cannot run here: "
                         f"{reason}")
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


def quantize_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values of `t` with one scale per row (over the last dimension): (q, dequantization
    scale), q * scale[..., None] ≈ t. The scale maps each row's largest magnitude to E4M3's
    largest finite value (448)."""
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=AMAX_FLOOR)
    scale = FP8_MAX / amax
    q = (t.float() * scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.reciprocal().squeeze(-1)


@functools.cache
def _compiled_quantize_rowwise():
    # One generated kernel per shape instead of six elementwise passes and a reduction; the
    # step's shapes are static, so each compiles once. Detached inputs: the quantized values
    # need no gradient, and one traced graph serves a tensor whether it requires one or not.
    compiled = torch.compile(quantize_rowwise, dynamic=False)
    return lambda t: compiled(t.detach())


def scaled_gemm_path(device: torch.device) -> str:
    """Which FP8 GEMM `ScaledGroupedLinear` runs on `device`: torch's row-wise scaled grouped
    GEMM where there is one (CUDA, compute capability 9.x: Hopper's kernel), else the emulation
    (the quantized operands dequantized, then `torch._grouped_mm`)."""
    if (device.type == "cuda" and hasattr(torch, "_scaled_grouped_mm")
            and torch.cuda.get_device_capability(device)[0] == 9):
        return "torch._scaled_grouped_mm"
    return "emulated FP8 (dequantized operands, torch._grouped_mm)"


def _scaled_grouped_mm(a_q, a_scale, b_q, b_scale, offsets, out_dtype):
    """out[rows of e] = (a_q * a_scale) @ (b_q[e] * b_scale[e])^T: a_q [R, K] E4M3 row-major with
    one scale per row, b_q [E, N, K] E4M3 with one scale per (expert, row)."""
    if scaled_gemm_path(a_q.device) == "torch._scaled_grouped_mm":
        # The kernel takes b column-major: [E, K, N] as a transposed view of [E, N, K]
        return torch._scaled_grouped_mm(a_q, b_q.transpose(-2, -1), a_scale, b_scale,
                                        offs=offsets, out_dtype=out_dtype)
    a = (a_q.float() * a_scale.unsqueeze(-1)).to(out_dtype)
    b = (b_q.float() * b_scale.unsqueeze(-1)).to(out_dtype)
    return torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets)


def quantize_columns_per_expert(t: torch.Tensor, offsets: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """E4M3 values of t [R, C] with one scale per (expert, column), over that expert's rows
    (`offsets`: the experts' row ends), returned transposed, row-major: (q [C, R], dequantization
    scales [E·C], expert-major), the operand layout of the weight-gradient GEMM, whose ragged
    dimension is the rows. No host read: each row's expert comes from `searchsorted`."""
    num_experts, num_rows = offsets.numel(), t.shape[0]
    rows = torch.arange(num_rows, device=t.device, dtype=offsets.dtype)
    expert_of_row = torch.searchsorted(offsets, rows, right=True).clamp_(max=num_experts - 1)
    magnitude = t.abs().float()
    amax = magnitude.new_zeros(num_experts, t.shape[1]).index_reduce_(0, expert_of_row, magnitude,
                                                                       "amax")
    scale = FP8_MAX / amax.clamp(min=AMAX_FLOOR)
    q = (t.float() * scale[expert_of_row]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.t().contiguous(), scale.reciprocal().reshape(-1)


def _scaled_weight_gradient(grad_out: torch.Tensor, x: torch.Tensor,
                            offsets: torch.Tensor) -> torch.Tensor:
    """dW[e] = dy[rows of e]^T x[rows of e] [E, N, K] with FP8 operands scaled per (expert,
    column): the 2-D × 2-D form of the scaled grouped GEMM (ragged rows)."""
    g_q, g_scale = quantize_columns_per_expert(grad_out, offsets)  # [N, R]
    x_q, x_scale = quantize_columns_per_expert(x, offsets)  # [K, R]
    if scaled_gemm_path(x.device) == "torch._scaled_grouped_mm":
        return torch._scaled_grouped_mm(g_q, x_q.t(), g_scale, x_scale, offs=offsets,
                                        out_dtype=x.dtype)
    num_experts, num_rows = offsets.numel(), x.shape[0]
    rows = torch.arange(num_rows, device=x.device, dtype=offsets.dtype)
    expert_of_row = torch.searchsorted(offsets, rows, right=True).clamp_(max=num_experts - 1)
    g = g_q.float() * g_scale.view(num_experts, -1)[expert_of_row].t()
    xs = x_q.float() * x_scale.view(num_experts, -1)[expert_of_row].t()
    return torch._grouped_mm(g.to(x.dtype), xs.t().to(x.dtype), offs=offsets)


class ScaledGroupedLinear(torch.autograd.Function):
    """`grouped_linear` with FP8 (E4M3) operands and row-wise scales: forward y = x w^T and the
    input gradient dy w in FP8; the weight gradient dy^T x in the input dtype, or with
    `fp8_weight_gradient` in FP8 too (scales per expert and column,
    `quantize_columns_per_expert`). Saves x and w as they are (no FP8 copies outlive the
    forward pass)."""

    @staticmethod
    def forward(ctx, x, w, offsets, quantize, fp8_weight_gradient=False):
        ctx.save_for_backward(x, w, offsets)
        ctx.quantize, ctx.fp8_weight_gradient = quantize, fp8_weight_gradient
        x_q, x_scale = quantize(x)
        w_q, w_scale = quantize(w)  # one scale per (expert, output feature), over the inputs
        return _scaled_grouped_mm(x_q, x_scale, w_q, w_scale, offsets, x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, w, offsets = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g_q, g_scale = ctx.quantize(grad_out)
            # dx = dy w: w^T [E, K, N] in rows, one scale per (expert, input feature)
            wt_q, wt_scale = ctx.quantize(w.transpose(-2, -1).contiguous())
            grad_x = _scaled_grouped_mm(g_q, g_scale, wt_q, wt_scale, offsets, x.dtype)
        if ctx.needs_input_grad[1] and ctx.fp8_weight_gradient:
            grad_w = _scaled_weight_gradient(grad_out, x, offsets)
        elif ctx.needs_input_grad[1]:
            grad_w = torch._grouped_mm(grad_out.t(), x, offs=offsets)  # [E, N, K]
        return grad_x, grad_w, None, None, None


def scaled_grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
                          fp8_weight_gradient: bool = False) -> torch.Tensor:
    """`grouped_linear` in FP8 (`ScaledGroupedLinear`); every expert's row count must be a
    multiple of `FP8_ROW_ALIGNMENT` (`permute_static(..., align=FP8_ROW_ALIGNMENT)` builds them)."""
    from .experts import _grouped_mm_unusable

    reason = _grouped_mm_unusable(x, w)
    if reason is not None:
        raise ValueError(f"the sync-free FP8 experts need torch._grouped_mm for the weight "
                         f"gradient, which cannot run here: {reason}")
    quantize = _compiled_quantize_rowwise() if x.is_cuda else quantize_rowwise
    return ScaledGroupedLinear.apply(x, w, offsets, quantize, fp8_weight_gradient)


def sync_free_experts(experts, hidden: torch.Tensor, indices: torch.Tensor,
                      weights: torch.Tensor, *, fp8: bool = False,
                      fp8_weight_gradient: bool = False) -> torch.Tensor:
    """The experts of `ExpertMLP` with no host read: `permute_static`, two grouped GEMMs with
    device offsets (`fp8`: `scaled_grouped_linear`, its weight gradient in FP8 too with
    `fp8_weight_gradient`), SwiGLU between them, `routing.unpermute` applying the routing
    weights."""
    from .experts import swiglu

    align = FP8_ROW_ALIGNMENT if fp8 else 1
    rows, perm = permute_static(hidden, indices, experts.num_experts, align)
    offsets = perm.offsets
    if fp8:
        def gemm(x, w, offs):
            return scaled_grouped_linear(x, w, offs, fp8_weight_gradient)
    else:
        gemm = grouped_linear
    h = gemm(rows, experts.gate_up_proj, offsets)
    y = gemm(swiglu(h), experts.down_proj, offsets)
    path = scaled_gemm_path(hidden.device) if fp8 else "torch._grouped_mm"
    wgrad = (" (weight gradient FP8)" if fp8_weight_gradient else " (weight gradient bf16)"
             if fp8 else "")
    experts.last_path = (f"permute_static ({perm.num_rows} rows, align {align}) → {path} → "
                         f"SwiGLU → {path}{wgrad}")
    return unpermute(y, perm, weights)


# ---------------------------------------------------------------------------------------------
# The whole step in one CUDA graph

def capturable_adamw(model: torch.nn.Module, lr: float, settings=None) -> torch.optim.AdamW:
    """The course's AdamW parameter groups (`train._adamw_groups`) in torch's AdamW with its state
    and learning rate on the device (`capturable=True`, a tensor lr: a schedule writes the value
    with `train.set_learning_rate` outside the graph), fused on a GPU."""
    from .train import TrainSettings, _adamw_groups

    settings = settings or TrainSettings(lr=lr, steps=2, warmup_steps=0)
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"a capturable AdamW is for CUDA graphs; the model is on {device}")
    return torch.optim.AdamW(_adamw_groups(model, settings), lr=torch.tensor(lr, device=device),
                             betas=settings.betas, capturable=True, fused=True)


# The attention kernels a graphed step captures. cuDNN's fused attention, the model's first
# choice (`model.ATTENTION_BACKENDS`), is left out: a CUDA graph holding it can fail on replay
# with an illegal memory access, the cuDNN frontend's captured graph reading host memory that
# was freed after capture (pytorch/pytorch#169849, open). FlashAttention-2 replays safely.
GRAPH_SAFE_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                 SDPBackend.MATH]


@contextlib.contextmanager
def graph_safe_attention() -> Iterator[None]:
    """Inside this block the model's attention chooses among `GRAPH_SAFE_ATTENTION_BACKENDS`
    (`model.Attention` reads `model.ATTENTION_BACKENDS` at every call)."""
    from . import model

    saved = model.ATTENTION_BACKENDS
    model.ATTENTION_BACKENDS = GRAPH_SAFE_ATTENTION_BACKENDS
    try:
        yield
    finally:
        model.ATTENTION_BACKENDS = saved


def train_step_body(forward: Callable, batch, params: list[torch.Tensor],
                    optimizer: torch.optim.Optimizer, grad_clip: float | None) -> torch.Tensor:
    """What `GraphedTrainStep` captures: forward, backward, gradient clipping (the global norm
    stays a device tensor), optimizer step; returns the loss, detached, on the device."""
    from .train import loss_of

    loss = loss_of(forward(*batch))
    loss.backward()
    if grad_clip is not None:
        torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()
    return loss.detach()


class GraphedTrainStep:
    """One training step (forward, backward, gradient clipping, AdamW) captured in a CUDA graph.

    `step((inputs, targets))` runs one real step on that batch and returns the loss (a device
    tensor; reading it is the caller's choice). The first `warmup` calls run eagerly on a side
    stream (as CUDA graph capture requires: lazy initialisation, the optimizer's state,
    torch.compile's kernels); the next call captures the step and replays it; every later call
    copies its batch into the graph's input buffers and replays. Every batch must have the
    captured shape; the model's routing must need no host read (`sync_free` experts).
    Attention runs FlashAttention-2 here (`graph_safe_attention`).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 grad_clip: float | None = 1.0, warmup: int = 2,
                 forward: Callable | None = None):
        if warmup < 1:
            raise ValueError(f"warmup={warmup}: at least one eager step must run before capture")
        self.model, self.optimizer, self.grad_clip = model, optimizer, grad_clip
        self.forward = forward or model
        self.warmup_left = warmup
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs = self.targets = self.loss = None
        self._side = torch.cuda.Stream() if torch.cuda.is_available() else None

    def _body(self) -> torch.Tensor:
        return train_step_body(self.forward, (self.inputs, self.targets), self.params,
                               self.optimizer, self.grad_clip)

    def _load(self, batch) -> None:
        inputs, targets = batch
        if self.inputs is None:
            self.inputs, self.targets = inputs.clone(), targets.clone()
        elif inputs.shape != self.inputs.shape or targets.shape != self.targets.shape:
            raise ValueError(f"a graphed step replays the shapes it captured: inputs "
                             f"{tuple(self.inputs.shape)}, got {tuple(inputs.shape)}; build "
                             f"another GraphedTrainStep for another batch shape")
        else:
            self.inputs.copy_(inputs, non_blocking=True)
            self.targets.copy_(targets, non_blocking=True)

    def __call__(self, batch) -> torch.Tensor:
        self._load(batch)
        if self.warmup_left:
            self.warmup_left -= 1
            self._side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._side), graph_safe_attention():
                self.optimizer.zero_grad(set_to_none=True)
                loss = self._body()
            torch.cuda.current_stream().wait_stream(self._side)
            return loss
        if self.graph is None:
            # Gradients allocated inside the capture live in the graph's memory pool and are
            # rewritten (not accumulated) by every replay
            self.optimizer.zero_grad(set_to_none=True)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), graph_safe_attention():
                self.loss = self._body()
        self.graph.replay()
        return self.loss


# ---------------------------------------------------------------------------------------------
# Detecting host syncs

class HostSync(RuntimeError):
    """A host read or device synchronisation where the step must have none."""


def _on_host(*args, **kwargs) -> bool:
    """Whether the call reads only tensors in host memory (no wait for a device)."""
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.device.type == "cpu" for t in tensors)


def _refuse(name: str, original: Callable, allow: Callable[..., bool] | None) -> Callable:
    @functools.wraps(original)
    def refused(*args, **kwargs):
        if _on_host(*args, **kwargs) or (allow is not None and allow(*args, **kwargs)):
            return original(*args, **kwargs)
        raise HostSync(f"{name} on a device tensor: the host reads its values (waits for the "
                       f"device); the sync-free step must not call it")
    return refused


def _is_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


# (owner, attribute, when it is allowed anyway): the Python entry points that read values or
# sync. Each one, on a device tensor, copies to the host and waits: scalars and lists (`item`,
# `tolist`, `__bool__` of `if t:`, `int(t)`), copies (`cpu`, `numpy`), ops whose output size
# depends on the values (nonzero, masked_select, unique, bincount, repeat_interleave without
# output_size, boolean-mask indexing), comparisons returning a Python bool (equal, allclose),
# and explicit synchronisation. Calls on host tensors only are let through (no device waits).
_ENTRY_POINTS = [
    (torch.Tensor, "item", None), (torch.Tensor, "tolist", None), (torch.Tensor, "numpy", None),
    (torch.Tensor, "cpu", None), (torch.Tensor, "__bool__", None), (torch.Tensor, "__int__", None),
    (torch.Tensor, "__float__", None), (torch.Tensor, "__index__", None),
    (torch.Tensor, "nonzero", None), (torch, "nonzero", None), (torch, "argwhere", None),
    (torch.Tensor, "masked_select", None), (torch, "masked_select", None),
    (torch.Tensor, "unique", None), (torch, "unique", None), (torch, "unique_consecutive", None),
    (torch.Tensor, "bincount", None), (torch, "bincount", None),
    (torch.Tensor, "repeat_interleave", lambda *a, **k: k.get("output_size") is not None),
    (torch, "repeat_interleave", lambda *a, **k: k.get("output_size") is not None),
    (torch, "where", lambda *a, **k: len(a) + len(k) > 1),  # where(cond) alone is nonzero
    (torch, "equal", None), (torch.Tensor, "equal", None), (torch, "allclose", None),
    (torch.Tensor, "__getitem__", lambda self, index: not _is_mask(index)),
    (torch.Tensor, "__setitem__", lambda self, index, value: not _is_mask(index)),
    (torch.cuda, "synchronize", None), (torch.cuda.Stream, "synchronize", None),
    (torch.cuda.Event, "synchronize", None),
]


@contextlib.contextmanager
def host_sync_entry_points() -> Iterator[None]:
    """Inside this block every Python entry point that reads a device tensor's values on the
    host or synchronises with the device raises `HostSync` (the list: `_ENTRY_POINTS`; reads of
    host tensors pass). Run a step on the meta device inside it, meta standing for the GPU: meta tensors hold no values, so an op that reads them outside
    these entry points (a sync inside a kernel's host code, e.g. an output sized by the data)
    raises too. Together: a CPU test that fails when a host read enters the step."""
    # (owner, name, its own attribute or None where it inherits the entry point)
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in _ENTRY_POINTS]
    try:
        for owner, name, allow in _ENTRY_POINTS:
            label = f"{getattr(owner, '__name__', owner)}.{name}"
            setattr(owner, name, _refuse(label, getattr(owner, name), allow))
        yield
    finally:
        for owner, name, own in saved:
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


def count_host_syncs(fn: Callable[[], object]) -> tuple[int, list[str]]:
    """Run `fn()` once on a GPU with torch's sync debug mode warning at every synchronising call
    (`torch.cuda.set_sync_debug_mode`: copies to the host, stream and device synchronisation,
    ops sized by the data) and return (how many, where: the innermost frame of the package or
    the library that made each). Work queued before `fn` is finished first, outside the count."""
    import traceback

    torch.cuda.synchronize()
    places: list[str] = []
    previous = torch.cuda.get_sync_debug_mode()
    original_show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "warnings.py" not in f.filename]
        places.append(" <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                                  for f in frames[-3:][::-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            warnings.showwarning = original_show
    torch.cuda.synchronize()
    return len(places), places


# ---------------------------------------------------------------------------------------------
# Do the graphed steps train alike?

def loss_curves(config, variants, *, steps: int = 80, batch: int = 4, seq_len: int = 256,
                lr: float = 1e-3, device="cuda") -> list[dict]:
    """Loss curves of `steps` steps from the same initial weights on the same batches: eager
    variants through `bench.train_loss_curves` (the course's `train.train`), graphed ones
    (`bench.Variant.graphed`) through `GraphedTrainStep` with the same settings (AdamW groups,
    betas, weight decay, the warm-up + cosine learning rate written into the graph's tensor lr
    before each step, clipping to norm 1). One row per variant, as `train_loss_curves` gives."""
    from . import bench
    from .model import next_token_targets
    from .train import TrainSettings, learning_rate, set_learning_rate

    gen = torch.Generator().manual_seed(0)
    windows = torch.randint(0, config.vocab_size, (steps * batch, seq_len), generator=gen)
    eager = [name for name in variants if not bench.variant(name).graphed]
    rows = {row["variant"]: row for row in bench.train_loss_curves(
        config, eager, steps=steps, batch=batch, seq_len=seq_len, device=device, lr=lr,
        windows=windows)} if eager else {}
    settings = TrainSettings(steps=steps, batch_size=batch, lr=lr, warmup_steps=steps // 10,
                             eval_every=0)
    for name in variants:
        if name in rows:
            continue
        v = bench.variant(name)
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
