"""How many operations a step dispatches, and how much of them the experts issue: `torch.profiler`
counts of top-level ATen operations (what Python or autograd dispatched; on a GPU most launch a
kernel), and on a GPU the kernels, their durations and the idle gaps between them.

    profile = op_counts.profile_train_steps(model, step, steps=2, device="cpu")
    display.show_table(profile.table())
    op_counts.aten_ops_per_layer("naive", num_experts=64, hidden=128, intermediate=256, top_k=2)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from .. import display
from ..moe import dispatch, experts
from ..moe.model import route

EXPERTS_LABEL = "experts forward"
STEP_LABEL = "train step"


def _inside(event, predicate) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if predicate(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def top_level_ops(events) -> list:
    """ATen ops not called from inside another ATen op: what Python (or autograd) dispatched."""
    return [e for e in events if e.name.startswith("aten::")
            and not _inside(e, lambda name: name.startswith("aten::"))]


def _label_experts(model: torch.nn.Module) -> list:
    """Wrap every MoE layer's experts forward in a profiler range; returns the hook handles."""
    handles = []
    for layer in model.model.layers:
        def enter(module, args):
            module._profile_range = record_function(EXPERTS_LABEL).__enter__()

        def leave(module, args, output):
            module._profile_range.__exit__(None, None, None)
        handles += [layer.mlp.experts.register_forward_pre_hook(enter),
                    layer.mlp.experts.register_forward_hook(leave)]
    return handles


@dataclass
class StepOps:
    """Per training step: top-level ATen ops, those inside the experts' forward passes, CPU time
    (profiler on), and on a GPU the kernels and the share of time the GPU sat idle between them."""
    steps: int
    device: str
    layers: int
    ops: float
    expert_ops: float
    step_ms: float
    experts_ms: float
    gpu: dict = field(default_factory=dict)  # kernels, median_kernel_us, median_gap_us, idle (share)

    def table(self) -> display.Table:
        rows = [["top-level ATen ops per training step", f"{self.ops:,.0f}"],
                ["… of which in the experts' forward passes",
                 f"{self.expert_ops:,.0f} ({100 * self.expert_ops / self.ops:.0f}%)"],
                ["… per MoE layer forward", f"{self.expert_ops / self.layers:,.0f}"],
                ["CPU time per step (ms, profiler on)", f"{self.step_ms:,.1f}"],
                ["CPU time in the experts' forward (ms per step)",
                 f"{self.experts_ms:,.1f} ({100 * self.experts_ms / self.step_ms:.0f}%)"]]
        if self.gpu:
            rows += [["GPU kernels (and copies) per step", f"{self.gpu['kernels']:,.0f}"],
                     ["median kernel duration (µs)", f"{self.gpu['median_kernel_us']:.1f}"],
                     ["median gap between kernels (µs)", f"{self.gpu['median_gap_us']:.1f}"],
                     ["GPU idle between kernels (% of profiled time)", f"{100 * self.gpu['idle']:.0f}%"]]
        return display.Table(["training step", "measured"], rows,
                             title=f"torch.profiler over {self.steps} training steps ({self.device})")


def _gpu_summary(events, steps: int) -> dict:
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.name not in (EXPERTS_LABEL, STEP_LABEL)), key=lambda e: e.time_range.start)
    if not kernels:
        return {}
    durations = sorted(e.time_range.end - e.time_range.start for e in kernels)
    window = kernels[-1].time_range.end - kernels[0].time_range.start
    gaps = sorted(max(0.0, b.time_range.start - a.time_range.end) for a, b in zip(kernels, kernels[1:]))
    return dict(kernels=len(kernels) / steps, idle=1 - sum(durations) / window,
                median_gap_us=gaps[len(gaps) // 2] if gaps else 0.0,
                median_kernel_us=durations[len(durations) // 2])


def profile_train_steps(model: torch.nn.Module, step: Callable[[], object], *, steps: int,
                        device) -> StepOps:
    """Profile `steps` calls of `step` (one training step of `model`, an MoEForCausalLM) after one
    warm-up call, the experts' forward passes marked. On a GPU, synchronised around each step."""
    on_gpu = torch.device(device).type == "cuda"
    step()  # warm-up: the first step allocates optimizer state
    handles = _label_experts(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    try:
        if on_gpu:
            torch.cuda.synchronize()
        # acc_events: one cycle, nothing to clear; without it torch warns on stderr that events
        # are cleared between cycles (seen in chapter 01's output on an H100)
        with profile(activities=activities, acc_events=True) as prof:
            for _ in range(steps):
                with record_function(STEP_LABEL):
                    step()
                if on_gpu:
                    torch.cuda.synchronize()
    finally:
        for handle in handles:
            handle.remove()
    events = prof.events()
    ops = top_level_ops(events)
    cpu_ms = {label: sum(e.cpu_time_total for e in events if e.name == label) / steps / 1e3
              for label in (STEP_LABEL, EXPERTS_LABEL)}
    return StepOps(steps=steps, device=str(device), layers=len(model.model.layers),
                   ops=len(ops) / steps,
                   expert_ops=sum(_inside(e, lambda name: name == EXPERTS_LABEL) for e in ops) / steps,
                   step_ms=cpu_ms[STEP_LABEL], experts_ms=cpu_ms[EXPERTS_LABEL],
                   gpu=_gpu_summary(events, steps) if on_gpu else {})


def aten_ops_per_layer(backend: str, num_experts: int, *, hidden: int, intermediate: int, top_k: int,
                       tokens: int = 1024, device="cpu", seed: int = 0) -> int:
    """Top-level ATen ops of one MoE layer's experts, forward and backward, with `backend`
    (after one warm-up pass), for `tokens` tokens routed at random."""
    torch.manual_seed(seed)
    layer = experts.create(backend, num_experts, hidden, intermediate, device=device)
    torch.nn.init.normal_(layer.gate_up_proj, std=0.02)
    torch.nn.init.normal_(layer.down_proj, std=0.02)
    x = torch.randn(tokens, hidden, device=device, requires_grad=True)
    weights, indices = route(torch.randn(tokens, num_experts, device=device), top_k)
    dispatch.run_experts(layer, x, indices, weights)[0].sum().backward()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        dispatch.run_experts(layer, x, indices, weights)[0].sum().backward()
    return len(top_level_ops(prof.events()))
