"""A MoE causal language model (Mixtral by default), small enough to hold in your head.

    tokens → embedding → N × [ RMSNorm → GQA attention (RoPE, causal) → + residual
                               RMSNorm → MoE block (router → top-k experts
                                                    [+ shared expert]) → + residual ]
           → RMSNorm → lm_head → logits

The config's architecture fields add what other transformers families do differently (q/k
RMSNorm, attention biases, clip_qkv, sigmoid and group-limited routing, a shared expert):
`families.py` says which family has which, and maps their configs. Module and parameter names
follow HF transformers 5's (`MixtralForCausalLM`, `Qwen3MoeForCausalLM`, ...), so a state dict
moves between the two (`hf.from_hf(hf_model)`, `hf.to_hf_state_dict(model)`).
The MoE block, here whole, is `Router` (its softmax rule `route`) → a token dispatcher
(`LocalDispatcher`: permute, experts, merge) → the experts (`experts/`, one backend per file,
`experts/naive.py` the reference loop); its `expert_backend` (naive loop, grouped GEMM, TE...)
can be switched on a live model, and its dispatcher swapped for expert parallelism
(`distributed.shard_experts`). What they build on stays beside them: DeepSeek-V3's sigmoid
rule, the load-balancing loss and the permutation in `routing.py`, the permutations the
experts ask for in `dispatch.py`.

The training loss is HF's: mean next-token cross-entropy (`loss.cross_entropy`) + aux_loss_coef
× the load-balancing loss pooled over all layers; `batch.check_batch` refuses a bad batch first.

Precision: `set_precision("bf16" | "fp8" | "closest_to_mxfp8" | <TE recipe name>)`, resolved once
into a `recipes.Precision`. Anything but bf16 runs the decoder layers under `te.autocast` with
the recipe this GPU supports: the attention projections become `te.Linear` (q, k and v fused
into one GEMM: `te_projections`) and the experts must be a TE backend, so every large GEMM runs
in FP8; the router and the lm_head stay in bf16 (the router's top-k decisions and the output
distribution are the precision-sensitive parts).
The model only enters `te.autocast`: the experts read the recipe from it at every forward pass
(as TE's own ops do) and pad each expert's rows to what it needs, so nothing is pushed onto them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..precision import hardware, recipes, te_projections
from . import dispatch, routing
from .batch import IGNORE_INDEX, check_batch
from .config import MoEConfig
from .experts import TE_BACKENDS, Experts, convert_experts, create, default_backend
from .loss import cross_entropy
from .norm import RMSNorm


def is_expert_parameter(name: str) -> bool:
    """Whether a parameter of `MoEForCausalLM.named_parameters()` belongs to the routed experts
    (which expert parallelism shards and the optimizer may treat apart)."""
    return ".mlp.experts." in name


class Rotary:
    """Rotary position embeddings (HF's 'default' RoPE) for one sequence length: `rotary(x)`
    rotates the pairs (x_i, x_{i+d/2}) of x [B, S, heads, d] by position-dependent angles.

    With Transformer Engine on a GPU it runs TE's fused RoPE kernel (one kernel forward and one
    backward, angles in fp32) instead of the five elementwise ops below.
    Otherwise HF's arithmetic: cos/sin tables computed in fp32 and rounded to x's dtype, then
    x * cos + rotate_half(x) * sin. `fused` says which ran."""

    def __init__(self, seq_len: int, head_dim: int, theta: float, device, dtype):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
        angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
        self.angles = torch.cat((angles, angles), dim=-1)  # [S, d] fp32
        te = hardware.transformer_engine() if torch.device(device).type == "cuda" else None
        self._te_rope = te.attention.rope.apply_rotary_pos_emb if te is not None else None
        self.fused = self._te_rope is not None
        if not self.fused:
            self.cos = self.angles.cos().to(dtype)[:, None, :]  # [S, 1, d]: broadcast over heads
            self.sin = self.angles.sin().to(dtype)[:, None, :]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self._te_rope(x, self.angles[:, None, None, :], tensor_format="bshd", fused=True)
        first, second = x.chunk(2, dim=-1)
        return x * self.cos + torch.cat((-second, first), dim=-1) * self.sin


# Attention kernels in order of preference: cuDNN's fused attention first (faster than
# FlashAttention-2, torch's default, for mixtral-2l's layers on the H200: see the step history
# in docs/benchmarks.md and benchmarks/results/h200_cudnn_attention_rope.json); torch falls
# through to the next backend where one cannot take the inputs (the CPU runs the math backend).
# A model chooses among others with `MoEForCausalLM.set_attention_backends`.
ATTENTION_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                      SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def check_attention_backends(backends) -> tuple[SDPBackend, ...]:
    backends = tuple(backends) if isinstance(backends, (list, tuple)) else ()
    if not backends or not all(isinstance(b, SDPBackend) for b in backends):
        raise ValueError("attention backends must be a non-empty sequence of "
                         "torch.nn.attention.SDPBackend, in order of preference, e.g. "
                         "model.ATTENTION_BACKENDS")
    return backends


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE, through F.scaled_dot_product_attention.

    In bf16 the projections are four `nn.Linear`, like HF's. Under FP8 (`te_projections`) they
    become Transformer Engine modules: q, k and v one `te.Linear` (`qkv_proj`) whose weight is
    split into the parameters `q_proj_weight`, `k_proj_weight`, `v_proj_weight` (one GEMM and
    one FP8 cast of the input instead of three), o_proj a `te.Linear`.

    The families' variants (config fields): biases on the projections; `q_norm`/`k_norm`, an
    RMSNorm on q and k before RoPE, over each head's dimensions (Qwen3-MoE) or over the whole
    projection (OLMoE), which keeps attention logits from growing without bound; `clip_qkv`.
    `backends`: the kernels it may run, in order of preference (`ATTENTION_BACKENDS`)."""

    def __init__(self, cfg: MoEConfig, *, dtype=None, device=None):
        super().__init__()
        self.backends = tuple(ATTENTION_BACKENDS)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qk_norm, self.clip_qkv = cfg.qk_norm, cfg.clip_qkv
        q_width, kv_width = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        kw = dict(dtype=dtype, device=device)
        self.q_proj = nn.Linear(cfg.hidden_size, q_width, bias=cfg.qkv_bias, **kw)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_width, bias=cfg.qkv_bias, **kw)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_width, bias=cfg.qkv_bias, **kw)
        self.o_proj = nn.Linear(q_width, cfg.hidden_size, bias=cfg.o_proj_bias, **kw)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm != "none":
            per_head = cfg.qk_norm == "per_head"
            self.q_norm = RMSNorm(cfg.head_dim if per_head else q_width, cfg.norm_eps, **kw)
            self.k_norm = RMSNorm(cfg.head_dim if per_head else kv_width, cfg.norm_eps, **kw)
        self.qkv_proj = None

    def forward(self, x: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        batch, seq, _ = x.shape
        sizes = (self.num_heads * self.head_dim,) + (self.num_kv_heads * self.head_dim,) * 2
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(batch, seq, self.num_heads, self.head_dim)
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim)
        v = v.view(batch, seq, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.qk_norm == "across_heads":
            q, k = self.q_norm(q.flatten(2)).view_as(q), self.k_norm(k.flatten(2)).view_as(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k, v = rotary(q).transpose(1, 2), rotary(k).transpose(1, 2), v.transpose(1, 2)
        with sdpa_kernel(list(self.backends), set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=self.num_kv_heads != self.num_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


def route(logits: torch.Tensor, top_k: int,
          normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32 → top-k → renormalise the k weights to sum to one (`normalize=False`:
    keep the k probabilities as they are, HF's norm_topk_prob=False). Returns (weights fp32,
    indices)."""
    routing.check_logits(logits, top_k, "route")
    probs = torch.softmax(logits.float(), dim=-1)
    weights, indices = torch.topk(probs, top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True) if normalize else weights), indices


# The routing rules, by the config's `router` field: each takes the router's logits and returns
# (weights fp32 [T, k], indices [T, k]). A model routes with another rule of the same arguments
# through `MoEForCausalLM.set_routing` (exercise 08 trains with the learner's sigmoid rule;
# perf/train_dist.starve_experts keeps experts off).
ROUTING_RULES = {"softmax": route, "sigmoid": routing.route_sigmoid}


@dataclass(frozen=True)
class RouterOutput:
    logits: torch.Tensor  # [T, E] raw scores, in the hidden states' dtype (sigmoid router: fp32)
    weights: torch.Tensor  # [T, k] fp32 routing weights of the chosen experts (sum to 1 when
    #                        normalised and unscaled)
    indices: torch.Tensor  # [T, k] int64 chosen experts, highest (biased) score first


class Router(nn.Module):
    """The gate of a MoE layer: one bias-free linear layer scoring tokens against experts (HF's
    `...TopKRouter`, reached as `mlp.gate`), then a routing rule: `route` (scoring="softmax",
    `normalize` = HF's norm_topk_prob) or `routing.route_sigmoid` (scoring="sigmoid").

    A sigmoid router keeps its weight in fp32 and scores in fp32 (as HF keeps DeepSeek-V3's
    `gate.weight`), and holds `e_score_correction_bias` (HF's name), a buffer moved by
    `update_correction_bias`, not by the optimizer. For that update it counts the tokens each
    expert received in forward passes in training mode since the last update
    (`tokens_since_bias_update`). `rule` (default `ROUTING_RULES[scoring]`) and `bias_update`
    (default `routing.update_correction_bias`) are what it calls: a notebook passes its own
    through `MoEForCausalLM.set_routing` (exercise 08 does)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, *,
                 scoring: str = "softmax", normalize: bool = True, n_group: int = 1,
                 topk_group: int = 1, scaling_factor: float = 1.0, rule: Callable | None = None,
                 bias_update: Callable | None = None, dtype=None, device=None):
        super().__init__()
        routing.check_top_k(top_k, num_experts)
        if scoring not in ROUTING_RULES:
            raise ValueError(f"scoring={scoring!r} is not one of {sorted(ROUTING_RULES)}")
        self.top_k, self.scoring, self.normalize = top_k, scoring, normalize
        self.rule = rule or ROUTING_RULES[scoring]
        self.bias_update = bias_update or routing.update_correction_bias
        self.n_group, self.topk_group, self.scaling_factor = n_group, topk_group, scaling_factor
        sigmoid = scoring == "sigmoid"
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, device=device,
                                               dtype=torch.float32 if sigmoid else dtype))
        # None buffers for a softmax router: not in its state dict.
        self.register_buffer("e_score_correction_bias", torch.zeros(
            num_experts, dtype=torch.float32, device=device) if sigmoid else None)
        self.register_buffer("tokens_since_bias_update", torch.zeros(
            num_experts, dtype=torch.int64, device=device) if sigmoid else None, persistent=False)

    def forward(self, hidden: torch.Tensor) -> RouterOutput:
        if hidden.dim() == 0 or hidden.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"the router takes hidden states [..., {self.weight.shape[1]}], got "
                             f"shape {tuple(hidden.shape)}: pass the layer's hidden states")
        if self.scoring == "softmax":
            routing.check_compute_dtype("the router", hidden, self.weight.dtype)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.scoring == "softmax":
            logits = F.linear(flat, self.weight)
            weights, indices = self.rule(logits, self.top_k, self.normalize)
            return RouterOutput(logits, weights, indices)
        logits = F.linear(flat.float(), self.weight)
        weights, indices = self.rule(logits, self.top_k, self.e_score_correction_bias,
                                     self.n_group, self.topk_group, self.normalize,
                                     self.scaling_factor)
        if self.training:  # index_add, unlike bincount, needs no host sync
            chosen = indices.reshape(-1)
            self.tokens_since_bias_update.index_add_(0, chosen, torch.ones_like(chosen))
        return RouterOutput(logits, weights, indices)

    @torch.no_grad()
    def update_correction_bias(self, rate: float) -> None:
        """Move `e_score_correction_bias` by `rate` towards balancing the tokens counted since
        the last update (`routing.update_correction_bias`), then start counting afresh."""
        if self.e_score_correction_bias is None:
            raise ValueError("only a sigmoid router (scoring='sigmoid') has a correction bias")
        self.bias_update(self.e_score_correction_bias, self.tokens_since_bias_update, rate)
        self.tokens_since_bias_update.zero_()


class LocalDispatcher(nn.Module):
    """The token dispatcher of a process that holds all the experts: the token copies need not
    travel, only be sorted by expert (`dispatch.run_experts`).

    A dispatcher takes every token's k copies to their experts and brings the weighted outputs
    back: `dispatcher(hidden [T, H], indices [T, k], weights [T, k], experts) -> [T, H]`. It
    holds no weights (the experts module does) and reports `last_path`, what the last forward
    pass ran, experts included; `full_hf_weights(experts)` returns all the layer's experts in
    HF layout, wherever they live. `distributed.AllToAllDispatcher` is the expert-parallel one."""

    def __init__(self):
        super().__init__()
        self.last_path: str | None = None

    def forward(self, hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                experts: Experts) -> torch.Tensor:
        out, self.last_path = dispatch.run_experts(experts, hidden, indices, weights)
        return out

    def full_hf_weights(self, experts: Experts) -> tuple[torch.Tensor, torch.Tensor]:
        return experts.hf_weights()


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP every token passes through beside its routed experts (Qwen2-MoE's
    `shared_expert`; DeepSeek-V3's `shared_experts`, n of them being one MLP n times as wide):
    what every token needs is learnt once here instead of by every routed expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEBlock(nn.Module):
    """Router (`gate`) → `dispatcher` → `experts`, plus, where the config has one, a
    `shared_expert` whose output is added (scaled by sigmoid(`shared_expert_gate`(x)) where the
    config gates it). The dispatcher is `LocalDispatcher` until `distributed.shard_experts`
    swaps in the all-to-all one and leaves `experts` holding this rank's shard. Returns the
    layer output and the router logits (for the aux loss)."""

    def __init__(self, cfg: MoEConfig, expert_backend: str, *, dtype=None, device=None):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.gate = Router(cfg.hidden_size, cfg.num_experts, cfg.top_k, scoring=cfg.router,
                           normalize=cfg.norm_topk_prob, n_group=cfg.n_group,
                           topk_group=cfg.topk_group, scaling_factor=cfg.routed_scaling_factor,
                           **kw)
        self.dispatcher = LocalDispatcher()
        self.experts = create(expert_backend, cfg.num_experts, cfg.hidden_size,
                              cfg.intermediate_size, **kw)
        self.shared_expert = self.shared_expert_gate = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(cfg.hidden_size,
                                              cfg.shared_expert_intermediate_size, **kw)
        if cfg.shared_expert_gate:
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routed = self.gate(x)
        flat = x.reshape(-1, x.shape[-1])
        out = self.dispatcher(flat, routed.indices, routed.weights, self.experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view_as(x), routed.logits


class DecoderLayer(nn.Module):
    def __init__(self, cfg: MoEConfig, expert_backend: str, *, dtype=None, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype=dtype, device=device)
        self.self_attn = Attention(cfg, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype=dtype, device=device)
        self.mlp = MoEBlock(cfg, expert_backend, dtype=dtype, device=device)

    def forward(self, x, rotary):
        x = x + self.self_attn(self.input_layernorm(x), rotary)
        moe_out, router_logits = self.mlp(self.post_attention_layernorm(x))
        return x + moe_out, router_logits


class Decoder(nn.Module):
    """The transformer body (HF's `MixtralModel`, reached as `.model`)."""

    def __init__(self, cfg: MoEConfig, expert_backend: str, *, dtype=None, device=None):
        super().__init__()
        # padding_idx as HF's families have it: that row gets no gradient
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id,
                                         dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, expert_backend, dtype=dtype, device=device) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dtype=dtype, device=device)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, S, vocab]
    loss: torch.Tensor | None = None  # lm_loss + aux_loss_coef * aux_loss (when targets given)
    lm_loss: torch.Tensor | None = None  # mean next-token cross-entropy, nats
    aux_loss: torch.Tensor | None = None  # load-balancing loss (top_k when perfectly balanced)
    router_logits: tuple[torch.Tensor, ...] = ()  # one [B*S, E] tensor per layer


class MoEForCausalLM(nn.Module):
    """MoE language model (Mixtral and the families of `families.py`).
    `model(input_ids, targets)` → `CausalLMOutput`."""

    def __init__(self, config: MoEConfig, expert_backend: str = "grouped_torch", *, device=None):
        super().__init__()
        if device is not None and torch.device(device).type == "cuda":  # else torch's own assert
            hardware.check_device(str(device), "device")
        self.config = config
        dtype = config.torch_dtype
        self.model = Decoder(config, "grouped_torch", dtype=dtype, device=device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False,
                                 dtype=dtype, device=device)
        self.reset_parameters()
        self.precision = recipes.BF16  # the config's dtype, no autocast (`set_precision`)
        self._recipe = None  # the TE recipe object used under te.autocast
        # The training loss and its gradient from torch.compile's kernels (`cross_entropy`'s
        # `compiled`); off by default, a candidate the benchmark measures (`*_compiled_loss`)
        self.compiled_loss = False
        self.set_expert_backend(expert_backend)

    @property
    def compiled_norms(self) -> bool:
        """Whether every RMSNorm of the model runs as torch.compile's kernels (`RMSNorm.compiled`);
        off by default, a candidate the benchmark measures (`*_compiled_norms`)."""
        return all(m.compiled for m in self.modules() if isinstance(m, RMSNorm))

    @compiled_norms.setter
    def compiled_norms(self, on: bool) -> None:
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.compiled = bool(on)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) weights, ones for norms, zeros for biases; the projections that
        write into the residual stream (o_proj, the experts' and shared expert's down_proj) are
        scaled by 1/sqrt(2 * layers) (GPT-2's rule) so the residual's variance does not grow with
        depth. (A sigmoid router's correction bias is a buffer: it starts at zero.)"""
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.num_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name.endswith(("o_proj.weight", "experts.down_proj",
                                "shared_expert.down_proj.weight")):
                p.normal_(0.0, residual_std)
            else:
                p.normal_(0.0, std)
        embedding = self.model.embed_tokens.weight
        # The padding row starts at zero, as HF's init (and nn.Embedding's) leaves it; a sharded
        # embedding's row is zeroed on the rank that holds it (`sharded_init.build_sharded`).
        if self.config.pad_token_id is not None and not hasattr(embedding, "device_mesh"):
            embedding[self.config.pad_token_id].zero_()

    @torch.no_grad()
    def materialize(self, device) -> MoEForCausalLM:
        """Give a model built on the meta device (`MoEForCausalLM(config, device="meta")`, then
        sharded: `sharded_init`) real storage on `device`, for the parameters this rank holds
        only. `to_empty` leaves every tensor uninitialised, so what construction set besides the
        parameters is set again here: the sigmoid routers' buffers (the correction bias and
        the token counts since its last update) start at zero. The RoPE tables need nothing:
        `Rotary` computes them in every forward pass. Then fill the parameters:
        `reset_parameters()` or a load (`sharded_init.load_hf_shards`)."""
        self.to_empty(device=device)
        for layer in self.model.layers:
            for buffer in layer.mlp.gate.buffers():
                buffer.zero_()
        return self

    # --- the expert backend of every MoE layer --------------------------------------------
    @property
    def expert_backend(self) -> str:
        return self.model.layers[0].mlp.experts.backend

    def set_expert_backend(self, name: str, **options) -> MoEForCausalLM:
        """Switch every layer's experts to backend `name` (see `experts.convert_experts`; the TE
        backends take `align` and `cutlass`, te_ops also `glu_interleave_size` and
        `require_fused`), or to the one the course
        picks for this model's expert width, precision and machine (`"auto"`:
        `experts.default_backend`). Create the optimizer after this: a TE backend has its own
        parameters."""
        if name == "auto":
            on_gpu = next(self.parameters()).is_cuda and hardware.transformer_engine() is not None
            name = default_backend(self.config.hidden_size, self.config.intermediate_size,
                                   fp8=self.precision.recipe is not None, te_on_gpu=on_gpu)
        if self.precision.recipe is not None:
            if name not in TE_BACKENDS:
                raise ValueError(f"precision {self.precision.name} runs the experts through TE; "
                                 f"{name!r} is not a TE backend (use set_precision('bf16') first)")
            recipes.check_backend_runs(name, self.precision, hardware.capabilities())
        for layer in self.model.layers:
            layer.mlp.experts = convert_experts(layer.mlp.experts, name, **options)
        return self

    # --- the routing rule of every router and the attention kernels of every layer ------------
    @property
    def routing_rule(self) -> Callable:
        return self.model.layers[0].mlp.gate.rule

    def set_routing(self, rule: Callable | None = None,
                    bias_update: Callable | None = None) -> MoEForCausalLM:
        """Route every layer with `rule`, called with the arguments of the config's rule in
        `ROUTING_RULES`, and update a sigmoid router's correction bias with `bias_update`
        (`routing.update_correction_bias`'s arguments); None: the package's own."""
        for name, fn in (("rule", rule), ("bias_update", bias_update)):
            if fn is not None and not callable(fn):
                raise ValueError(f"set_routing's {name} must be a function, got "
                                 f"{type(fn).__name__}")
        for layer in self.model.layers:
            layer.mlp.gate.rule = rule or ROUTING_RULES[layer.mlp.gate.scoring]
            layer.mlp.gate.bias_update = bias_update or routing.update_correction_bias
        return self

    @property
    def attention_backends(self) -> tuple[SDPBackend, ...]:
        return self.model.layers[0].self_attn.backends

    def set_attention_backends(self, backends=ATTENTION_BACKENDS) -> MoEForCausalLM:
        """The attention kernels every layer may run, in order of preference."""
        backends = check_attention_backends(backends)
        for layer in self.model.layers:
            layer.self_attn.backends = backends
        return self

    def expert_paths(self) -> list[str | None]:
        """What each layer's dispatcher and experts ran in the last forward pass."""
        return [layer.mlp.dispatcher.last_path for layer in self.model.layers]

    # --- precision ------------------------------------------------------------------------------
    def set_precision(self, precision: str | recipes.Precision = "bf16",
                      capabilities: hardware.Capabilities | None = None) -> MoEForCausalLM:
        """Train in `precision`: a `recipes.Precision`, or a name `recipes.resolve` turns into
        one on this machine ('bf16': no autocast; 'fp8': the fastest FP8 recipe this GPU runs;
        'closest_to_mxfp8'; a TE recipe name such as 'MXFP8BlockScaling'). FP8 needs TE on a
        GPU and TE experts; it turns the attention projections into TE modules."""
        chosen = recipes.resolve(precision, capabilities)
        if chosen.recipe is not None:
            self._check_can_train_in(chosen, capabilities or hardware.capabilities())
            for layer in self.model.layers:
                te_projections.fuse_attention_projections(layer.self_attn,
                                                          hardware.transformer_engine())
        self.precision, self._recipe = chosen, chosen.build()
        return self

    def _check_can_train_in(self, chosen: recipes.Precision, caps: hardware.Capabilities) -> None:
        device = next(self.parameters()).device
        if not chosen.native or hardware.transformer_engine() is None or device.type != "cuda":
            raise ValueError(
                f"precision {chosen.name!r} needs Transformer Engine FP8 on a GPU; here: "
                f"{chosen.label} ({chosen.reason}). Train in bf16 (or fp32 on a CPU); the FP8 and "
                f"MXFP8 numerics can be studied on any machine with moe_tutorial.precision.quant")
        if self.expert_backend not in TE_BACKENDS:
            raise ValueError(f"precision {chosen.name!r} runs the experts through TE; switch them "
                             f"first: model.set_expert_backend('te_grouped_linear' or 'te_ops')")
        if self.config.qkv_bias or self.config.o_proj_bias:
            raise ValueError(f"precision {chosen.name!r} fuses the attention projections into TE "
                             f"modules, which are built without biases here; this model has "
                             f"qkv_bias={self.config.qkv_bias}, o_proj_bias="
                             f"{self.config.o_proj_bias}: train it in bf16")
        recipes.check_backend_runs(self.expert_backend, chosen, caps)

    def _autocast(self):
        if self._recipe is None:
            return contextlib.nullcontext()
        return hardware.transformer_engine().autocast(enabled=True, recipe=self._recipe)

    # --- forward ----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None) -> CausalLMOutput:
        """input_ids [B, S]; targets [B, S] are the next tokens (targets[:, t] = the token after
        input_ids[:, t]; IGNORE_INDEX to skip a position). Loss only when targets are given.
        int64 or int32 ids and targets; a bad batch is refused first (`check_batch`)."""
        check_batch(self.config, input_ids, targets)
        device = self.model.embed_tokens.weight.device
        for name, tensor in (("input_ids", input_ids), ("targets", targets)):
            if tensor is not None and tensor.device != device:
                raise ValueError(f"{name} are on {tensor.device}, the model on {device}: move "
                                 f"them with {name}.to({str(device)!r})")
        seq_len = input_ids.shape[1]
        x = self.model.embed_tokens(input_ids)
        rotary = Rotary(seq_len, self.config.head_dim, self.config.rope_theta, x.device, x.dtype)
        router_logits = []
        with self._autocast():  # FP8 for the decoder layers' TE modules; lm_head stays outside
            for layer in self.model.layers:
                x, logits = layer(x, rotary)
                router_logits.append(logits)
        logits = self.lm_head(self.model.norm(x))
        out = CausalLMOutput(logits=logits, router_logits=tuple(router_logits))
        if targets is not None:
            # .long(): torch's cross_entropy (the evaluation path) takes no int32 targets.
            out.lm_loss = cross_entropy(logits.flatten(0, 1), targets.flatten().long(),
                                        IGNORE_INDEX, compiled=self.compiled_loss)
            out.aux_loss = routing.load_balancing_loss(router_logits, self.config.top_k)
            out.loss = out.lm_loss + self.config.aux_loss_coef * out.aux_loss
        return out

    # --- aux-loss-free load balancing -------------------------------------------------------
    def update_router_biases(self) -> None:
        """DeepSeek-V3's balancing step, to call after each optimizer step: every layer's
        sigmoid router moves its correction bias by `config.router_bias_update_rate` towards
        balancing the tokens its experts received since the last call
        (`Router.update_correction_bias`). In a process group (train_dist) every rank
        calls it at the same step and the counts are summed over all ranks first: each rank
        routed its own tokens, and one bias for all of them keeps the replicas' routers the
        same. Does nothing where the rate is 0."""
        rate = self.config.router_bias_update_rate
        if rate:
            for layer in self.model.layers:
                if dist.is_available() and dist.is_initialized():
                    dist.all_reduce(layer.mlp.gate.tokens_since_bias_update)
                layer.mlp.gate.update_correction_bias(rate)
