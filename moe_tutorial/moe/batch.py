"""A training batch as the model takes it: token ids [batch, seq] and the next-token targets
(`next_token_targets`; `IGNORE_INDEX` marks a position the loss skips), and `check_batch`, which
refuses a batch the model cannot take before any kernel runs, naming the value and the fix."""

from __future__ import annotations

import torch

from .config import MoEConfig

IGNORE_INDEX = -100  # target value that the loss skips (as in HF and torch's cross_entropy)


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """The targets of HF's `labels=input_ids` convention: position t predicts token t+1; the last
    position has no target (IGNORE_INDEX). With these our loss is the one HF computes."""
    return torch.cat([input_ids[:, 1:], torch.full_like(input_ids[:, :1], IGNORE_INDEX)], dim=1)


TOKEN_ID_DTYPES = (torch.int64, torch.int32)  # what nn.Embedding takes


def _check_token_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name} is a {type(value).__name__}, not a tensor of token ids "
                         f"[batch, seq]: wrap it with torch.tensor({name})")
    if value.dtype not in TOKEN_ID_DTYPES:
        raise ValueError(f"{name} has dtype {value.dtype}; token ids are integers (torch.long or "
                         f"torch.int32): convert with {name}.long()")


def _outside_vocabulary(ids: torch.Tensor, vocab_size: int) -> int | None:
    """The smallest id if it is negative, else the largest if it is >= vocab_size, else None."""
    low, high = (v.item() for v in torch.aminmax(ids))
    return low if low < 0 else high if high >= vocab_size else None


def check_batch(config: MoEConfig, input_ids, targets=None) -> None:
    """Refuse a batch the model cannot take, naming the value and the fix, before any kernel
    runs. `MoEForCausalLM.forward` calls it on every batch.

    Types, shapes and dtypes are checked always (free: no tensor is read). The token ids' range
    needs a min/max over the batch: checked where the batch is in host memory (microseconds),
    skipped for a batch already on a GPU, where reading the result would make the host wait for
    the device at every training step; a caller that moves batches to a GPU can call this on the
    host copy first. There, an out-of-range id fails in the embedding (a device-side assert) and
    a bad target in the loss's gather, never silently."""
    _check_token_tensor("input_ids", input_ids)
    shape = tuple(input_ids.shape)
    if len(shape) != 2:
        fix = ("add the batch dimension: input_ids.unsqueeze(0)" if len(shape) == 1
               else "reshape them to [batch, seq]")
        raise ValueError(f"input_ids has shape {shape}; the model takes token ids of shape "
                         f"[batch, seq]: {fix}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids has shape {shape}: no tokens; pass at least one sequence of "
                         f"at least one token")
    if shape[1] > config.max_seq_len:
        raise ValueError(f"sequence length {shape[1]} exceeds config.max_seq_len="
                         f"{config.max_seq_len}: cut the sequences to at most {config.max_seq_len}"
                         f" tokens, or build the model with a larger max_seq_len")
    if targets is not None:
        _check_token_tensor("targets", targets)
        if tuple(targets.shape) != shape:
            raise ValueError(
                f"targets has shape {tuple(targets.shape)}, input_ids {shape}: they must match "
                f"(targets[:, t] is the token after input_ids[:, t]; "
                f"next_token_targets(input_ids) builds them)")
    vocab = config.vocab_size
    if input_ids.device.type == "cpu":
        bad = _outside_vocabulary(input_ids, vocab)
        if bad is not None:
            raise ValueError(
                f"input_ids holds token id {bad}, outside the vocabulary [0, {vocab}) of "
                f"config.vocab_size={vocab}: tokenize with the tokenizer the model was built "
                f"for, or build the model with a larger vocab_size")
    if targets is not None and targets.device.type == "cpu":
        bad = _outside_vocabulary(torch.where(targets == IGNORE_INDEX, 0, targets), vocab)
        if bad is not None:
            raise ValueError(
                f"targets holds {bad}, neither a token id in [0, {vocab}) nor "
                f"IGNORE_INDEX={IGNORE_INDEX} (a position the loss skips): build them with "
                f"next_token_targets(input_ids)")
