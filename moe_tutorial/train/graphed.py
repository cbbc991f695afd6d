"""The whole training step in one CUDA graph: forward, backward, gradient clipping and a
capturable AdamW, captured once and replayed (`GraphedTrainStep`). It needs a step with no host
read (the `sync_free` experts, `moe.experts.sync_free`) and static shapes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.nn.attention import SDPBackend

from ..moe.model import MoEForCausalLM
from .loop import TrainSettings, _adamw_groups, loss_of


def capturable_adamw(model: torch.nn.Module, lr: float, settings=None) -> torch.optim.AdamW:
    """The course's AdamW parameter groups (`train._adamw_groups`) in torch's AdamW with its state
    and learning rate on the device (`capturable=True`, a tensor lr: a schedule writes the value
    with `train.set_learning_rate` outside the graph), fused on a GPU."""
    settings = settings or TrainSettings(lr=lr, steps=2, warmup_steps=0)
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise ValueError(f"a capturable AdamW is for CUDA graphs; the model is on {device}")
    return torch.optim.AdamW(_adamw_groups(model, settings), lr=torch.tensor(lr, device=device),
                             betas=settings.betas, capturable=True, fused=True)


# The attention kernels a graphed step captures. cuDNN's fused attention, the model's first
# choice (`model.ATTENTION_BACKENDS`), is left out: the cuDNN frontend's captured graph can read
# host memory freed after capture (pytorch/pytorch#169849, open), and replayed here its losses
# leave the eager steps' curve while FlashAttention's follow it
# (benchmarks/results/h100_gpu_tests.txt, the graph probes).
GRAPH_SAFE_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                 SDPBackend.MATH]


@contextlib.contextmanager
def graph_safe_attention(module: torch.nn.Module) -> Iterator[None]:
    """Inside this block every model of ours in `module` chooses its attention kernels among
    `GRAPH_SAFE_ATTENTION_BACKENDS` (`MoEForCausalLM.set_attention_backends`); HF's attention
    keeps its own choice."""
    ours = [m for m in module.modules() if isinstance(m, MoEForCausalLM)]
    saved = [m.attention_backends for m in ours]
    for m in ours:
        m.set_attention_backends(GRAPH_SAFE_ATTENTION_BACKENDS)
    try:
        yield
    finally:
        for m, backends in zip(ours, saved):
            m.set_attention_backends(backends)


def train_step_body(forward: Callable, batch, params: list[torch.Tensor],
                    optimizer: torch.optim.Optimizer, grad_clip: float | None) -> torch.Tensor:
    """What `GraphedTrainStep` captures: forward, backward, gradient clipping (the global norm
    stays a device tensor), optimizer step; returns the loss, detached, on the device."""
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
        if not torch.cuda.is_available() or not all(p.is_cuda for p in self.params):
            raise ValueError("GraphedTrainStep captures a CUDA graph: its model must be on a CUDA "
                             "GPU (model.to('cuda')); elsewhere use train.loop.train_step")
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs = self.targets = self.loss = None
        self._side = torch.cuda.Stream()

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
            with torch.cuda.stream(self._side), graph_safe_attention(self.model):
                self.optimizer.zero_grad(set_to_none=True)
                loss = self._body()
            torch.cuda.current_stream().wait_stream(self._side)
            return loss
        if self.graph is None:
            # Gradients allocated inside the capture live in the graph's memory pool and are
            # rewritten (not accumulated) by every replay
            self.optimizer.zero_grad(set_to_none=True)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), graph_safe_attention(self.model):
                self.loss = self._body()
        self.graph.replay()
        return self.loss
