"""What routing skew costs: from balanced routing to one hot expert, in rows, idle ranks and time.

A router that sends every expert the same number of token copies is the best case for the three
places skew bites, and one that sends every token to the same expert is the worst:

* padding — each expert's rows are padded to the recipe's alignment (`routing.permute`); skew
  changes how many experts end on a partial block (`padding_waste`);
* expert parallelism — experts are sharded contiguously over `ep` ranks, so the rank holding the
  hot expert works while the others wait at the all-to-all (`straggler_wait`);
* the grouped GEMM — the same total rows, split unevenly, run at a different rate
  (`grouped_gemm_efficiency`, measured live on this machine).

`skewed_splits` turns one number, the skew in [0, 1], into the token copies each expert receives,
and `routing_for_splits` into routing indices [T, k] that produce exactly those counts, so a real
MoE layer can be run at any skew. `course.widgets.SkewExplorer` puts all of it behind a slider.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..moe.experts import grouped_mm, swiglu
from ..moe.routing import check_top_k, padded_rows
from ..parallel.distributed import check_layout, rows_per_rank
from . import timing

DEFAULT_ALIGNMENTS = (16, 32, 128)  # TE's rows per expert: FP8 recipes, MXFP8, NVFP4 (recipes.alignment)


def _check_whole(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be a whole number >= {minimum}")


def _check_splits(splits: Sequence[int]) -> list[int]:
    """The splits as a list of ints: one non-negative row count per expert, at least one expert."""
    splits = list(splits)
    if not splits or any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in splits):
        raise ValueError(f"splits={splits!r} must be one whole, non-negative row count per expert "
                         f"(what skewed_splits returns)")
    return splits


def _even_shares(total: int, parts: int) -> list[int]:
    """`total` split over `parts` as evenly as whole numbers allow, the larger shares first."""
    quotient, remainder = divmod(total, parts)
    return [quotient + (i < remainder) for i in range(parts)]


def skewed_splits(tokens: int, num_experts: int, top_k: int, skew: float) -> list[int]:
    """Token copies per expert (the `m_splits` before padding) of `tokens` tokens routed to
    `top_k` of `num_experts` experts each, at a routing `skew` in [0, 1].

    Expert 0 is the hot expert. At skew 0 it has its balanced share b = ceil(T·k/E); at skew s it
    has b + round(s·(T − b)), rising linearly to T at skew 1, where every token picks it (once:
    a token picks an expert at most once). The other T·k minus that many copies are spread over
    experts 1..E−1 as evenly as whole numbers allow. So skew 0 is balanced routing (T·k/E each,
    the remainder one extra copy for the first experts), skew 1 one hot expert with every token's
    other k−1 choices spread over the rest. The counts always sum to T·k, and none exceeds T."""
    _check_whole("tokens", tokens, 1)
    _check_whole("num_experts", num_experts, 1)
    check_top_k(top_k, num_experts)
    if isinstance(skew, bool) or not isinstance(skew, (int, float)) or not 0 <= skew <= 1:
        raise ValueError(f"skew={skew!r} must be a number from 0 (balanced routing) to 1 (every "
                         f"token picks expert 0)")
    copies = tokens * top_k
    balanced_hot = _even_shares(copies, num_experts)[0]
    hot = balanced_hot + math.floor(skew * (tokens - balanced_hot) + 0.5)
    if num_experts == 1:  # one expert takes every copy (top_k is then 1)
        return [copies]
    return [hot] + _even_shares(copies - hot, num_experts - 1)


def routing_for_splits(splits: Sequence[int], top_k: int) -> torch.Tensor:
    """Expert indices [T, k] (int64; T = sum(splits) / k) whose copies per expert are `splits`,
    with no token picking an expert twice.

    The copies are laid out expert by expert, and copy i goes to token i mod T, slot i // T:
    an expert's copies are consecutive and at most T of them, so they land on distinct tokens."""
    splits = _check_splits(splits)
    check_top_k(top_k, len(splits))
    copies = sum(splits)
    if copies % top_k or copies == 0:
        raise ValueError(f"splits={splits} hold {copies} token copies, which is not a positive "
                         f"multiple of top_k={top_k}: every token makes top_k copies")
    tokens = copies // top_k
    if max(splits) > tokens:
        raise ValueError(f"an expert has {max(splits)} copies but there are only {tokens} tokens: "
                         f"a token picks an expert at most once, so no split may exceed T")
    experts_in_order = torch.repeat_interleave(torch.arange(len(splits)), torch.tensor(splits))
    return experts_in_order.view(top_k, tokens).T.contiguous()


def padded_splits(splits: Sequence[int], align: int) -> list[int]:
    """Rows per expert after padding to `align`: `routing.padded_rows`, the rule `routing.permute`
    pads by."""
    splits = _check_splits(splits)
    _check_whole("align", align, 1)
    return padded_rows(torch.tensor(splits), align).tolist()


def padding_waste(splits: Sequence[int],
                  alignments: Sequence[int] = DEFAULT_ALIGNMENTS) -> dict[int, dict]:
    """Per alignment: {"rows": the real rows, "rows_padded": the rows after every expert's block
    is padded to the alignment, "padding_rows": their difference, "fraction": the share of the
    padded rows that are padding, i.e. of the grouped GEMMs' work spent on zeros}."""
    splits = _check_splits(splits)
    if isinstance(alignments, int) or not alignments:
        raise ValueError(f"alignments={alignments!r} must be a non-empty sequence of row "
                         f"alignments, e.g. (16, 32, 128)")
    waste = {}
    for align in alignments:
        rows, rows_padded = sum(splits), sum(padded_splits(splits, align))
        waste[align] = {"rows": rows, "rows_padded": rows_padded,
                        "padding_rows": rows_padded - rows,
                        "fraction": (rows_padded - rows) / rows_padded if rows_padded else 0.0}
    return waste


def straggler_wait(splits: Sequence[int], ep: int) -> dict:
    """How long expert-parallel ranks wait for the slowest one, assuming time ∝ rows.

    Experts are sharded contiguously over `ep` ranks (as `distributed` shards them), so rank r's
    load is the rows of its E/ep experts. Every rank waits at the all-to-all for the most loaded
    one; `wait` = 1 − mean/max is the share of that rank's time the average rank spends idle
    (0 when balanced, 1 − 1/ep when one rank gets every row). Returns {"ep", "rows_per_rank",
    "slowest_rank", "wait"}."""
    splits = _check_splits(splits)
    _check_whole("ep", ep, 1)
    check_layout(ep, 1, ep, len(splits))  # the experts must split evenly over the ranks
    loads = rows_per_rank(torch.tensor(splits), ep).tolist()
    slowest = max(loads)
    wait = 1 - (sum(loads) / ep) / slowest if slowest else 0.0
    return {"ep": ep, "rows_per_rank": loads, "slowest_rank": loads.index(slowest), "wait": wait}


def grouped_gemm_efficiency(splits: Sequence[int], hidden: int, intermediate: int, *,
                            device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                            warmup: int = 2, iters: int = 5, seed: int = 0) -> dict:
    """The grouped expert MLP's GEMMs (forward: gate-up, SwiGLU, down — what the grouped_torch
    backend runs between permute and unpermute, through `experts.grouped_mm`) timed at these
    splits and at balanced splits of the same rows, interleaved (`timing.time_fns`).

    Returns {"path": which grouped GEMM ran (torch._grouped_mm, or the per-expert loop and why),
    "rows", "skewed_ms", "balanced_ms", "skewed_tflops", "balanced_tflops", "efficiency":
    balanced_ms / skewed_ms (below 1: skew made the same work slower), "dtype", "timer"}.
    `dtype` defaults to bfloat16 on a GPU and float32 on a CPU."""
    splits = _check_splits(splits)
    _check_whole("hidden", hidden, 1)
    _check_whole("intermediate", intermediate, 1)
    rows, num_experts = sum(splits), len(splits)
    if not rows:
        raise ValueError(f"splits={splits} route no rows: there is no GEMM to time")
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    x = randn(rows, hidden)
    gate_up = randn(num_experts, 2 * intermediate, hidden, scale=hidden ** -0.5)
    down = randn(num_experts, hidden, intermediate, scale=intermediate ** -0.5)
    balanced = skewed_splits(rows, num_experts, 1, 0.0)
    paths = {}  # variant -> what grouped_mm ran

    def expert_gemms(name, row_splits):
        offsets = torch.cumsum(torch.tensor(row_splits), 0).to(device, torch.int32)

        def run():
            h, paths[name] = grouped_mm(x, gate_up, offsets)
            return grouped_mm(swiglu(h), down, offsets)[0]
        return run

    with torch.no_grad():
        times = timing.time_fns({"skewed": expert_gemms("skewed", splits),
                                 "balanced": expert_gemms("balanced", balanced)},
                                warmup=warmup, iters=iters, device=device)
    flops = timing.expert_mlp_flops(rows, 1, hidden, intermediate, backward=False)
    skewed_ms, balanced_ms = times["skewed"].median_ms, times["balanced"].median_ms
    return {"path": paths["skewed"], "rows": rows, "skewed_ms": skewed_ms, "balanced_ms": balanced_ms,
            "skewed_tflops": timing.tflops(flops, skewed_ms),
            "balanced_tflops": timing.tflops(flops, balanced_ms),
            "efficiency": balanced_ms / skewed_ms, "dtype": str(dtype).removeprefix("torch."),
            "timer": times["skewed"].timer}
