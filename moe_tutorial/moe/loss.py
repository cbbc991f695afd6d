"""The training loss's cross-entropy: `cross_entropy` is `F.cross_entropy(logits.float(), ...)`
without its fp32 copies of the logits when a gradient will be needed, as a chunked eager loop
(`_CrossEntropyWithGradient`) or compiled (`loss_and_gradient` under `torch.compile`)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .batch import IGNORE_INDEX


class _CrossEntropyWithGradient(torch.autograd.Function):
    """Mean cross-entropy of logits [N, V] whose gradient is computed during the forward pass,
    `chunk` rows at a time in fp32, and kept in the logits' dtype.

    `F.cross_entropy(logits.float())` keeps an fp32 log-softmax [N, V] for the backward pass
    (1 GiB for 8,192 tokens and a 32k vocabulary) on top of the fp32 copy it reads; this keeps
    only the bf16 gradient, softmax - one_hot, which the backward pass merely scales. Same
    numbers: both compute in fp32 and round the gradient to the logits' dtype."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index: int, chunk: int):
        valid = targets != ignore_index
        count = valid.sum()  # a tensor: no host sync
        loss = logits.new_zeros((), dtype=torch.float32)
        grad = torch.empty_like(logits)
        # Skipped positions gather token 0 and are then zeroed by `valid`; any other negative
        # target stays negative and fails the gather, where clamping it would train on token 0.
        gather_index = torch.where(valid, targets, 0).unsqueeze(1)
        for start in range(0, logits.shape[0], chunk):
            rows = slice(start, start + chunk)
            keep = valid[rows]
            target = gather_index[rows]
            # One kernel reads the bf16 logits and writes fp32 log-probabilities; the rest works
            # in place on that buffer and the last op writes the gradient rounded to bf16.
            log_probs = torch.log_softmax(logits[rows], dim=1, dtype=torch.float32)
            loss -= (log_probs.gather(1, target).squeeze(1) * keep).sum()
            probs = log_probs.exp_()
            probs.scatter_add_(1, target, torch.full_like(target, -1, dtype=probs.dtype))
            torch.mul(probs, (keep / count).unsqueeze(1), out=grad[rows])
        ctx.save_for_backward(grad)
        return loss / count

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None


def loss_and_gradient(logits: torch.Tensor, targets: torch.Tensor,
                      ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, its gradient with respect to the logits [N, V], in their dtype):
    `_CrossEntropyWithGradient`'s arithmetic written for `torch.compile`, in one piece with no
    in-place writes, so that Inductor can fuse the log-softmax, the exponential and the scaling
    that the eager loop runs as one kernel each over an fp32 copy of every chunk. Eager, it
    would hold several fp32 [N, V] intermediates at once: it is meant to be compiled
    (`cross_entropy(..., compiled=True)`)."""
    valid = targets != ignore_index
    count = valid.sum()
    gather_index = torch.where(valid, targets, 0).unsqueeze(1)
    log_probs = torch.log_softmax(logits, dim=1, dtype=torch.float32)
    loss = -(log_probs.gather(1, gather_index).squeeze(1) * valid).sum() / count
    one_hot = torch.zeros_like(log_probs).scatter_(1, gather_index, 1.0)
    grad = (log_probs.exp() - one_hot) * (valid / count).unsqueeze(1)
    return loss, grad.to(logits.dtype)


@functools.cache
def _compiled_loss_and_gradient():
    return torch.compile(loss_and_gradient, dynamic=False)


class _CompiledCrossEntropy(torch.autograd.Function):
    """`_CrossEntropyWithGradient` with the loss and gradient from the compiled
    `loss_and_gradient` (a GPU: torch.compile makes Triton kernels)."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index: int):
        loss, grad = _compiled_loss_and_gradient()(logits, targets, ignore_index)
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX,
                  chunk: int = 1024, compiled: bool = False) -> torch.Tensor:
    """`F.cross_entropy(logits.float(), targets, ignore_index=...)` (mean over the targets that
    are not `ignore_index`) for logits [N, V], without its fp32 copies of the logits when a
    gradient will be needed (see `_CrossEntropyWithGradient`). `compiled`: the loss and its
    gradient from `torch.compile`'s kernels (`loss_and_gradient`) instead of the chunked loop."""
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)
    if compiled:
        return _CompiledCrossEntropy.apply(logits, targets, ignore_index)
    return _CrossEntropyWithGradient.apply(logits, targets, ignore_index, chunk)
