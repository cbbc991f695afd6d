"""Expert parallelism (EP) with torch.distributed: experts sharded over GPUs, tokens sent to them.

A MoE layer's experts hold most of its parameters; one GPU soon cannot hold them all. With
expert parallelism over `ep` ranks, each rank keeps `E / ep` experts, and every token copy travels
to the rank that owns its expert and back:

    route locally → sort copies by expert (once) → all-to-all (copies + routing weights) →
    regroup the arrivals by local expert → local experts (any backend: grouped bf16, FP8,
    te.ops) → all-to-all back → merge the k outputs

Each rank first tells every other rank how many rows it will send to each of its experts (a small
all-to-all of counts, `exchange_counts`), so the big exchange knows its split sizes. The steps'
arithmetic is in small functions of their own (`dispatch_order`, `rows_per_rank`,
`exchange_counts`, `received_experts`: exercise 07 has you write them). Both exchanges use
`all_to_all_single_autograd` (torch.distributed's functional collectives), which is
differentiable: the backward pass sends the gradients back along the same routes.

The world of `dp × ep` ranks is a 2-D device mesh (`dp`, `ep`). Ranks in one `ep` group share
their tokens' experts; ranks in one `dp` group hold the same experts for different data.

The data-parallel engine is PyTorch's FSDP2 (`fully_shard_layout`): every weight is sharded
instead of replicated — the dense ones over all ranks, each ep shard of the experts over its dp
group — gathered layer by layer for the forward and backward passes, and the gradients
reduce-scattered so that each rank keeps (and updates) only its slice. The gradient arithmetic
is the one `average_gradients` writes out for replicated weights, which the course keeps as the
explanation (notebook 07 shows it) and as the baseline the benchmark compares with: dense
gradients summed over all ranks, expert gradients over their dp group only (every rank of an ep
group already accumulated its experts' gradients from all the tokens that visited them), both
divided by the world size. Works with NCCL on GPUs and gloo on CPUs.

The token exchange here is torch.distributed's all-to-all, written out so that every step can be
read. Transformer Engine 2.20.2 also ships an expert-parallel dispatch of its own,
`transformer_engine.pytorch.ep` (`ep_bootstrap`, `ep_dispatch`, `ep_combine`: `ep.py:102`,
`:1010`, `:1080` of the 2.20.2 wheel), built on NCCL's EP kernels: it needs NCCL >= 2.30.4
(`ep.py:48-49`), an `ep_group` of at least two ranks (`ep.py:139-140`) and bfloat16 tokens
(MXFP8 applied inside, `ep.py:884-891`). It would take the place of steps 1–3 and 5 of
`AllToAllDispatcher.forward`; the course keeps the plain all-to-all, which runs on any NCCL
and on gloo. The `te.ops` fusible ops themselves communicate by all-gather, reduce-scatter and
all-reduce only (`transformer_engine/pytorch/ops/basic/`); 2.20.2 has no `MoeDispatch` /
`MoeCombine` op.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

# The differentiable all-to-all (torch.distributed.nn.functional's is deprecated in its favour).
from torch.distributed._functional_collectives import all_to_all_single_autograd

from ..moe.experts import convert_experts, create
from ..moe.model import CausalLMOutput, is_expert_parameter
from ..moe.routing import (
    Permutation,
    permute,
    permute_rows,
    sort_by_expert,
    sorted_permutation,
    unpermute,
)
from ..precision import recipes

# NVLink multicast stays off in every process of this course (it can take a shared host's GPUs
# out of service); set before any process group exists.
SAFE_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


def apply_safe_env() -> None:
    for key, value in SAFE_NCCL_ENV.items():
        os.environ.setdefault(key, value)


@dataclass(frozen=True)
class Layout:
    """This rank's place in the (dp, ep) mesh."""

    dp: int
    ep: int
    dp_rank: int
    ep_rank: int
    dp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup

    @property
    def world(self) -> int:
        return self.dp * self.ep


def layouts(gpus: int, num_experts: int) -> list[tuple[int, int]]:
    """Every (dp, ep) with dp × ep = gpus and ep dividing num_experts, most expert-parallel
    first (8 GPUs, 8 experts: (1, 8), (2, 4), (4, 2), (8, 1))."""
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    # ep divides num_experts: walking its divisors stays short whatever the GPU count
    return [(gpus // ep, ep) for ep in range(min(gpus, num_experts), 0, -1)
            if gpus % ep == 0 and num_experts % ep == 0]


def check_layout(world_size: int, dp: int, ep: int, num_experts: int) -> None:
    """Clear errors for layouts that cannot work (before any process group is touched)."""
    if dp < 1 or ep < 1:
        raise ValueError(f"dp={dp} and ep={ep} must both be >= 1")
    if dp * ep != world_size:
        raise ValueError(f"the world size {world_size} does not factor as dp × ep = {dp} × {ep} "
                         f"= {dp * ep}; launch dp × ep processes (torchrun --nproc_per_node)")
    if num_experts % ep:
        raise ValueError(f"num_experts={num_experts} is not divisible by ep={ep}: every EP rank "
                         f"must hold the same number of experts")


def init_layout(dp: int, ep: int, num_experts: int) -> Layout:
    """The (dp, ep) device mesh of the already-initialised default process group."""
    from torch.distributed.device_mesh import init_device_mesh

    check_layout(dist.get_world_size(), dp, ep, num_experts)
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (dp, ep), mesh_dim_names=("dp", "ep"))
    return Layout(dp, ep, mesh.get_local_rank("dp"), mesh.get_local_rank("ep"),
                  mesh.get_group("dp"), mesh.get_group("ep"))


def rows_per_rank(tokens_per_expert: torch.Tensor, ep: int) -> torch.Tensor:
    """[ep]: how many of this rank's token copies go to each rank of its ep group. Experts are
    sharded contiguously (rank r holds experts r·E/ep … (r+1)·E/ep − 1), so these are the sums
    of `tokens_per_expert` [E] over every rank's block of experts."""
    return tokens_per_expert.view(ep, -1).sum(1)


def dispatch_order(indices: torch.Tensor, num_experts: int,
                   ep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1 of the EP layer: sort this rank's T·k token copies by destination.

    Sorting by expert sorts by rank too, experts being sharded contiguously, so rank r's rows
    are one block, already grouped by expert. Returns (order [T·k]: the copy numbers t·k + j in
    sorted order, stable; tokens_per_expert [E], zeros included: what the count exchange sends;
    rows_per_rank [ep]: the exchange's send splits). `routing.permute`, which the layer runs,
    sorts in this order."""
    order, tokens_per_expert = sort_by_expert(indices, num_experts)
    return order, tokens_per_expert, rows_per_rank(tokens_per_expert, ep)


def exchange_counts(tokens_per_expert: torch.Tensor, group=None) -> torch.Tensor:
    """Step 2: every rank of `group` tells every other how many rows it sends to each of its
    experts. One all-to-all of the int64 counts [E]: block j (experts j·E/ep …) goes to rank j,
    so rank r receives block r of every rank's counts. Returns recv_counts [ep, E/ep]: row s =
    the rows rank s sends to each of this rank's local experts."""
    recv_counts = torch.empty_like(tokens_per_expert)
    dist.all_to_all_single(recv_counts, tokens_per_expert, group=group)
    return recv_counts.view(dist.get_world_size(group), -1)


def received_experts(recv_counts: torch.Tensor) -> torch.Tensor:
    """Step 4's routing: the local expert of every received row, in arrival order [R] int64.
    Rows arrive grouped by source rank (rank 0's first), each source's rows grouped by local
    expert: `recv_counts` [ep, E/ep] read row by row gives the lengths of those runs."""
    ep, per_rank = recv_counts.shape
    experts = torch.arange(per_rank, device=recv_counts.device).repeat(ep)
    return torch.repeat_interleave(experts, recv_counts.flatten())


def regroup_by_expert(recv_counts: torch.Tensor, align: int = 1) -> Permutation:
    """Step 4: the received rows, grouped by source rank, put into local-expert order (each
    expert's rows from rank 0, then rank 1, ...), each expert's block padded to a multiple of
    `align`. No sort: the order follows from the exchanged counts alone, `recv_counts`
    [ep, E/ep]. Every received row is a "token" with one expert (k = 1); `routing.unpermute`
    with this permutation puts the experts' output rows back in arrival order."""
    ep, per_rank = recv_counts.shape
    counts = recv_counts.flatten()
    run_starts = torch.cumsum(counts, 0) - counts  # where each (source, expert) run arrived
    by_expert = recv_counts.t().flatten()  # the runs in expert-major order
    starts = run_starts.view(ep, per_rank).t().flatten()
    rank_in_run = (torch.arange(int(counts.sum()), device=counts.device)
                   - torch.repeat_interleave(torch.cumsum(by_expert, 0) - by_expert, by_expert))
    order = torch.repeat_interleave(starts, by_expert) + rank_in_run
    tokens_per_expert = recv_counts.sum(0)
    sorted_experts = torch.repeat_interleave(
        torch.arange(per_rank, device=counts.device), tokens_per_expert)
    return sorted_permutation(order, sorted_experts, tokens_per_expert, order.numel(), 1, align)


class AllToAllDispatcher(nn.Module):
    """The token dispatcher of expert parallelism: the layer's `num_experts` experts are sharded
    over an `ep` group, and the `experts` module this rank's layer holds is its shard, experts
    [first, first + E/ep) of any backend. Every token copy travels to the rank of the group that
    holds its expert and its output comes back. Same interface as `model.LocalDispatcher`; its
    `last_path` reads "EP <ep rank>/<ep> (experts <first>..<last>): <what the shard ran>"."""

    def __init__(self, num_experts: int, layout: Layout):
        super().__init__()
        self.num_experts = num_experts
        self.layout = layout
        self.last_path: str | None = None

    @property
    def first_expert(self) -> int:
        return self.layout.ep_rank * (self.num_experts // self.layout.ep)

    def forward(self, hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                experts: nn.Module) -> torch.Tensor:
        ep, group = self.layout.ep, self.layout.ep_group
        per_rank = self.num_experts // ep
        # 1. sort this rank's token copies by (global) expert, in dispatch_order's order: blocks
        #    for rank 0, 1, ...: the layer's one sort
        rows, row_weights, perm = permute(hidden, indices, weights, self.num_experts)
        # 2. counts first: recv_counts[src, e] = rows rank `src` sends to my local expert e;
        #    then the exchange's split sizes, on the host
        recv_counts = exchange_counts(perm.tokens_per_expert, group)
        send_splits = rows_per_rank(perm.tokens_per_expert, ep).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        # 3. the token copies and their routing weights travel (differentiably)
        recv_rows = all_to_all_single_autograd(rows, recv_splits, send_splits, group)
        recv_weights = all_to_all_single_autograd(row_weights.to(weights.dtype), recv_splits,
                                                  send_splits, group)
        # 4. the arrivals regrouped by local expert (from the counts, no sort), padded to what
        #    the backend needs; each output row weighted by its routing weight here, before it
        #    travels back, unless the backend applied the weights itself
        local = regroup_by_expert(recv_counts, experts.rows_alignment(recipes.active_recipe()))
        applies = experts.applies_routing_weights
        grouped, grouped_weights = permute_rows(recv_rows, recv_weights if applies else None, local)
        out = experts(grouped, local.m_splits, grouped_weights)
        out = unpermute(out, local, None if applies else recv_weights.unsqueeze(1))
        # 5. back along the same routes, then each token sums its k (already weighted) outputs
        back = all_to_all_single_autograd(out, send_splits, recv_splits, group)
        self.last_path = (f"EP {self.layout.ep_rank}/{ep} (experts {self.first_expert}.."
                          f"{self.first_expert + per_rank - 1}): routing.permute → all-to-all → "
                          f"regroup by expert (align {local.align}) → {experts.last_path}")
        return unpermute(back, perm, None)

    @torch.no_grad()
    def full_hf_weights(self, experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """All `num_experts` experts in HF layout, all-gathered from the shards of the ep group
        (in ep-rank order, which is expert order): a collective every rank of the group calls."""
        full = []
        for shard in experts.hf_weights():
            shards = [torch.empty_like(shard) for _ in range(self.layout.ep)]
            dist.all_gather(shards, shard, group=self.layout.ep_group)
            full.append(torch.cat(shards))
        return full[0], full[1]

    def extra_repr(self) -> str:
        last = self.first_expert + self.num_experts // self.layout.ep - 1
        return (f"ep_rank={self.layout.ep_rank}/{self.layout.ep}, "
                f"experts={self.first_expert}..{last} of {self.num_experts}")


def shard_experts(model: nn.Module, layout: Layout, **options) -> nn.Module:
    """Give every layer this rank's shard of its experts (`mlp.experts`: E/ep experts with the
    full model's weights, running the model's current expert backend; `options` go to it, as in
    `set_expert_backend`) and an `AllToAllDispatcher` (`mlp.dispatcher`) that sends the token
    copies to the shards. Call it after `set_expert_backend` and `set_precision`, with identical
    full weights on all ranks (same seed, or `broadcast_parameters` first); both still work on
    the sharded model, on this rank's shard. With ep = 1 nothing is sharded: the experts are
    replicated like every other weight."""
    num_experts = model.config.num_experts
    check_layout(layout.world, layout.dp, layout.ep, num_experts)
    if any(isinstance(layer.mlp.dispatcher, AllToAllDispatcher) for layer in model.model.layers):
        raise ValueError("this model's experts are already sharded (shard_experts ran on it): "
                         "shard a model once, from its full weights")
    if layout.ep == 1:
        return model
    backend = model.expert_backend
    per_rank = num_experts // layout.ep
    first = layout.ep_rank * per_rank
    for layer in model.model.layers:
        full = layer.mlp.experts
        gate_up, down = full.hf_weights()
        local = create("grouped_torch", per_rank, full.hidden_size, full.intermediate_size,
                       dtype=gate_up.dtype, device=gate_up.device)
        local.load_hf_weights(gate_up[first:first + per_rank], down[first:first + per_rank])
        if backend != local.backend or options:
            local = convert_experts(local, backend, **options)
        layer.mlp.experts = local
        layer.mlp.dispatcher = AllToAllDispatcher(num_experts, layout)
    return model


@torch.no_grad()
def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Give every rank rank `src`'s weights (before sharding)."""
    for p in model.parameters():
        dist.broadcast(p.data, src)


@torch.no_grad()
def average_gradients(model: nn.Module, layout: Layout) -> None:
    """Make every rank's gradients those of the mean loss over all ranks: dense parameters are
    summed over the world, expert parameters over their dp group (their ep group's tokens are
    already in them), both divided by the world size. One flat buffer per group and dtype.

    The arithmetic written out, for replicated weights (`train_dist --engine replicated`, the
    benchmark's baseline): the engine is FSDP2 (`fully_shard_layout`), which does the same
    reduction as a reduce-scatter into each rank's shard."""
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            buckets.setdefault((is_expert_parameter(name), p.grad.dtype), []).append(p.grad)
    for (expert, _), grads in buckets.items():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=layout.dp_group if expert else None)
        flat /= layout.world
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


@torch.no_grad()
def clip_grad_norm(model: nn.Module, layout: Layout, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for a model whose gradients are spread over the ranks:
    the norm of the whole model's gradient, not of this rank's part, and every rank scales its
    part by the same factor.

    - FSDP2 (`fully_shard_layout`): each element of every gradient lives on exactly one rank (a
      dense DTensor slice on one rank of the world, an expert slice on one rank of its dp
      group, and each ep rank has other experts; with dp = 1 the expert gradients are plain
      tensors, each ep shard's on its one rank), so the squared norm is the sum of the local
      slices' squares over the world.
    - Replicated (`average_gradients`): dense gradients are the same on every rank and each
      expert shard's are on its ep rank only, so it is the dense part plus the expert parts
      summed over the ep group."""
    from torch.distributed.tensor import DTensor

    def local(grad):
        return grad.to_local() if isinstance(grad, DTensor) else grad

    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    device = next(model.parameters()).device
    sharded = any(isinstance(g, DTensor) for g in grads.values())
    squares = {True: [], False: []}
    for name, grad in grads.items():
        squares[is_expert_parameter(name) and not sharded].append(
            local(grad).detach().float().pow(2).sum())
    replicated = (torch.stack(squares[False]).sum() if squares[False]
                  else torch.zeros((), device=device))
    expert = torch.stack(squares[True]).sum() if squares[True] else torch.zeros((), device=device)
    if sharded:
        dist.all_reduce(replicated)  # here: every local slice, summed over the world
    elif layout.ep > 1:
        dist.all_reduce(expert, group=layout.ep_group)
    total = (replicated + expert).sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)  # torch's rule: shrink, never grow
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for grad in grads.values():
        by_dtype.setdefault(grad.dtype, []).append(local(grad))
    for dtype, tensors in by_dtype.items():
        torch._foreach_mul_(tensors, scale.to(dtype))
    return total


# ---------------------------------------------------------------------------------------------
# What a (dp, ep) layout sends, computed from the config alone (no process group, no weights): the
# bytes its collectives move per step (what it holds: `memory.predict`).

def communication_per_step(config, tokens_per_rank: int, dp: int, ep: int, *,
                           activation_bytes: int | None = None,
                           gradient_bytes: int | None = None) -> dict[str, float]:
    """Bytes one rank's collectives move in a training step (forward + backward) of a (dp, ep)
    layout with `tokens_per_rank` tokens, as `AllToAllDispatcher` and `average_gradients`
    move them. Sizes default to the config's dtype.

    all-to-all (ep > 1), every MoE layer: the tokens × top_k copies (hidden vectors) go out to
    their experts' ranks and their outputs come back — 2 exchanges — and the backward pass
    sends the gradients of both along the same routes — 2 more; the fp32 routing weights travel
    with the copies (forward) and their gradients back (backward); and the int64 counts
    (num_experts per layer) go first. `all_to_all_bytes` is the volume through the exchange;
    the copies routed to this rank's own experts stay local, so with balanced routing
    (ep - 1) / ep of it crosses to other ranks (`all_to_all_remote_bytes`).

    all-reduce (world > 1): dense gradients over all ranks, expert gradients over the dp group
    (dp > 1; the shard's size). `allreduce_sent_bytes`: what a ring all-reduce sends per rank,
    2 (n - 1) / n of each buffer reduced over n ranks."""
    check_layout(dp * ep, dp, ep, config.num_experts)
    act = activation_bytes or config.torch_dtype.itemsize
    grad = gradient_bytes or config.torch_dtype.itemsize
    copies = tokens_per_rank * config.top_k
    all_to_all = 0
    if ep > 1:
        hidden = copies * config.hidden_size * act * 2 * 2  # dispatch + combine, fwd + bwd
        weights = copies * 4 * 2  # fp32 routing weights: forward, and their gradients
        counts = config.num_experts * 8  # int64 rows per expert (forward only)
        all_to_all = config.num_layers * (hidden + weights + counts)
    params = config.parameter_counts()
    world = dp * ep
    dense = params["dense"] * grad if world > 1 else 0
    expert = params["expert"] // ep * grad if dp > 1 else 0

    def ring(n):
        return 2 * (n - 1) / n

    return {"all_to_all_bytes": all_to_all,
            "all_to_all_remote_bytes": all_to_all * (ep - 1) / ep,
            "dense_allreduce_bytes": dense, "expert_allreduce_bytes": expert,
            "allreduce_bytes": dense + expert,
            "allreduce_sent_bytes": dense * ring(world) + expert * ring(dp)}


# ---------------------------------------------------------------------------------------------
# FSDP2 on the (dp, ep) layout: the same arithmetic as `average_gradients`, with every weight
# sharded instead of replicated.

# The model's output is made a pytree node, so code that walks a module's outputs finds the
# tensors inside. FSDP2 hooks the root's unshard-before-backward onto them: torch 2.11's FSDP2
# walks outputs with tree_flatten, which treats an unregistered dataclass as one opaque leaf, so
# the root's resharded weights (embedding, lm_head) were read as empty storage in the backward
# pass ("setStorage: ... out of bounds for storage of size 0"; torch 2.13 walks dataclasses
# itself).
torch.utils._pytree.register_dataclass(CausalLMOutput)


def _mesh(group):
    """A DeviceMesh over an existing process group (NCCL's are CUDA meshes, gloo's CPU ones)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, "cuda" if dist.get_backend() == "nccl" else "cpu")


def fully_shard_layout(model: nn.Module, layout: Layout, *, reshard_after_forward: bool = True,
                       mp_policy=None) -> nn.Module:
    """FSDP2 (`torch.distributed.fsdp.fully_shard`) on a model whose experts `shard_experts`
    already sharded over ep: each layer's expert shard (`mlp.experts`) is sharded again over the
    rank's dp group, every decoder layer and the root (embeddings, final norm, lm_head) over all
    dp × ep ranks. Returns the model (its parameters are now DTensors; create the optimizer
    after this). `mp_policy`: an `fsdp.MixedPrecisionPolicy`, passed to every `fully_shard`.

    The gradients are those of `average_gradients`, the mean loss over all ranks:
    - dense parameters are reduce-scattered over the world and divided by its size (FSDP2's
      default: each rank ran a different batch, so the world mean is the global batch's mean);
    - an expert shard is reduce-scattered over its dp group, the ranks that hold the same
      experts. Each ep rank's experts already summed the gradients from the tokens of its whole
      ep group (the all-to-all's backward brought them), so the mean over all ranks divides
      that dp sum by the world size, not by dp as FSDP2 would by default: the expert modules
      get `set_gradient_divide_factor(world)`.
    FSDP2 divides by a custom factor with NCCL's PREMUL_SUM reduce-scatter, which gloo lacks
    ("Cannot use ReduceOp.PREMUL_SUM with Gloo"), so on CPU the expert shards reduce with SUM and
    divide afterwards (`set_force_sum_reduction_for_comms`); gloo has AVG, the dense default.

    With dp = 1 and no mixed-precision cast, the experts stay outside FSDP2 (`ignored_params`,
    `experts_outside_fsdp`): each ep shard lives on one rank only, so there is nothing to shard
    and nothing to reduce, and FSDP2 would only copy them (into a gathered buffer before each
    forward and backward pass, the gradient out of one after it), and they are most of the
    model's parameters. Their gradients get the same 1/world factor from a gradient hook."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    check_layout(dist.get_world_size(), layout.dp, layout.ep, model.config.num_experts)
    if isinstance(model, FSDPModule):
        raise ValueError("this model is already sharded by FSDP (fully_shard_layout ran on it): "
                         "apply it once, to a model fresh from shard_experts")
    if layout.ep > 1 and not all(isinstance(layer.mlp.dispatcher, AllToAllDispatcher)
                                 for layer in model.model.layers):
        raise ValueError(f"ep={layout.ep} but this model's experts are not sharded over ep: "
                         f"call distributed.shard_experts(model, layout) first")
    options = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    if experts_outside_fsdp(layout.dp, casts=mp_policy is not None):
        unsharded = set()
        for layer in model.model.layers:
            unsharded |= _divide_gradients(layer.mlp.experts, layout.world)
        return fully_shard_decoder(model, model.model.layers, ignored_params=unsharded,
                                   **options)
    dp_mesh = _mesh(layout.dp_group)
    # Innermost first: a module sharded already is skipped by its parent's fully_shard, so the
    # experts keep their dp mesh and each layer then takes only its dense parameters.
    for layer in model.model.layers:
        experts = fully_shard(layer.mlp.experts, mesh=dp_mesh, **options)
        experts.set_gradient_divide_factor(float(layout.world))
        # Not with dp = 1, where no collective runs: torch 2.13's foreach_reduce, on a 1-rank
        # group, divides by the custom factor as it copies the gradient and again as the forced
        # SUM's post-division (the expert gradients came out divided by world twice).
        experts.set_force_sum_reduction_for_comms(dist.get_backend() == "gloo" and layout.dp > 1)
    return fully_shard_decoder(model, model.model.layers, **options)


def experts_outside_fsdp(dp: int, *, casts: bool) -> bool:
    """Whether `fully_shard_layout` leaves the experts out of FSDP2 (and `memory.predict`
    gathers none of them): when each ep shard has a dp group of one rank (nothing to shard or
    reduce) and no mixed-precision policy `casts` the weights (FSDP2's policy is what turns
    state-dtype weights into compute-dtype ones)."""
    return dp == 1 and not casts


def _divide_gradients(experts: nn.Module, world: int) -> set[nn.Parameter]:
    """The parameters of `experts`, each with a gradient hook dividing by `world` (what FSDP2's
    `set_gradient_divide_factor(world)` does for sharded experts: the mean over all ranks of a
    gradient that the all-to-all's backward already summed over the ep group). The hook scales
    each incoming gradient before it is accumulated, so gradient accumulation stays right."""
    params = set(experts.parameters())
    if world > 1:
        for p in params:
            p.register_hook(lambda grad: grad / world)
    return params


def mixed_precision(compute_dtype: torch.dtype, state_dtype: torch.dtype):
    """FSDP2's `MixedPrecisionPolicy` for weights kept (with their gradients and AdamW's moments)
    in `state_dtype` and gathered for the forward and backward passes in `compute_dtype`, the
    gradients reduced in `state_dtype` (a bf16 sum over many ranks loses the small ones). None
    when the two are the same: nothing to cast.

    The modules' inputs are left as they come (`cast_forward_inputs=False`): the embedding's
    gathered weight already makes the hidden states `compute_dtype`, and the router's fp32
    routing weights must reach the experts in fp32, as in the unsharded model (FSDP2's default
    casts them to bf16, and the softmax's backward amplifies that rounding: the router's
    gradient came out ~10% off).

    Under FP8 (`set_precision`, TE's autocast) the gathered weights stay in `compute_dtype` and
    TE quantizes them in each forward pass, as it does without FSDP; TE 2.20.2's FP8 primary
    weights (`quantized_model_init`, all-gathered in FP8) are not used by the course."""
    if compute_dtype == state_dtype:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=state_dtype,
                                cast_forward_inputs=False)


def checkpoint_activations(model: nn.Module) -> nn.Module:
    """Activation checkpointing of every decoder layer (`model.model.layers`: ours, or HF's
    Mixtral): its forward keeps only its input for the
    backward pass, which runs the layer's forward again (about a third more compute) to rebuild
    the rest. The recomputation repeats the layer's all-to-alls, in the same order on every
    rank. Apply before `fully_shard_layout` (PyTorch's composable `checkpoint`, which FSDP2
    composes with)."""
    from torch.distributed._composable import checkpoint

    for layer in model.model.layers:
        checkpoint(layer)
    return model


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """name → this rank's gradient of each parameter as an ordinary tensor, gathered from FSDP2's
    shards (a collective every rank calls): a dense parameter's whole gradient, an expert
    parameter's for the experts of this rank's ep shard. Plain tensors pass through."""
    from torch.distributed.tensor import DTensor

    return {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for name, p in model.named_parameters() if p.grad is not None}


def fully_shard_decoder(model: nn.Module, layers, *, mp_policy=None,
                        reshard_after_forward: bool = True,
                        ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
    """FSDP2 over all ranks for every decoder layer in `layers`, then the root: the whole of
    the HF baseline (no expert parallelism), and the dense part of `fully_shard_layout`'s model
    (whose experts it sharded first, or left out as `ignored_params`). Its gradients are the
    mean over all ranks (FSDP2's default), as `average_gradients` makes them."""
    from torch.distributed.fsdp import fully_shard

    world_mesh = _mesh(dist.group.WORLD)
    options = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    if ignored_params:  # every fully_shard must skip them: the root would take them otherwise
        options["ignored_params"] = ignored_params
    for layer in layers:
        fully_shard(layer, mesh=world_mesh, **options)
    return fully_shard(model, mesh=world_mesh, **options)
