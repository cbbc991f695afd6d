"""Model configuration and the course's presets.

`MoEConfig` describes a MoE causal language model: Mixtral by default, and with its architecture
fields the other transformers families the model reproduces exactly (Qwen3-MoE, OLMoE,
Qwen2-MoE, DeepSeek-V3's MoE block: `families.py`; `MoEConfig.from_hf_config` reads one). It is
validated when it is built, so a bad value fails here, with the field's name, and not deep
inside a matmul:

    >>> cfg = preset("small")
    >>> cfg.with_overrides(num_experts=16).num_experts
    16
    >>> MoEConfig(top_k=3, num_experts=2)          # doctest: +SKIP
    ValueError: MoEConfig.top_k=3 is larger than num_experts=2 ...
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

import torch

from . import families

# The size of the protein vocabulary the course's models embed by default: train/data.py holds
# the vocabulary with the data it tokenizes (tests/train/test_data.py checks the two agree).
PROTEIN_VOCAB_SIZE = 24

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# MoEConfig's real-valued fields and what each is (for the message that refuses a bad one).
REAL_FIELDS = {"rope_theta": "RoPE base frequency", "norm_eps": "RMSNorm epsilon",
               "aux_loss_coef": "load-balancing loss weight, 0 to switch it off",
               "init_std": "standard deviation of the initial weights",
               "routed_scaling_factor": "factor on the routing weights, 1 for none",
               "router_bias_update_rate": "step of the aux-loss-free bias update, 0 to switch "
                                          "it off"}
ZERO_ALLOWED = ("aux_loss_coef", "router_bias_update_rate")
QK_NORMS = ("none", "per_head", "across_heads")
ROUTERS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """Architecture of a MoE causal LM (field names follow the papers' terms;
    `to_hf_config_kwargs()` maps them to the transformers config of `family`).

    The fields after `dtype` choose the architecture variant; their defaults are Mixtral's."""

    vocab_size: int = PROTEIN_VOCAB_SIZE
    hidden_size: int = 128
    intermediate_size: int = 256  # per expert
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2  # grouped-query attention: num_heads must be a multiple of it
    num_experts: int = 8
    top_k: int = 2
    max_seq_len: int = 256
    rope_theta: float = 1e6
    norm_eps: float = 1e-5
    aux_loss_coef: float = 0.02  # weight of the load-balancing loss in the training loss
    init_std: float = 0.02
    dtype: str = "float32"  # parameter dtype: float32 | bfloat16 | float16
    # The transformers family whose config and parameter names this model converts to and from
    # (`families.FAMILIES`): mixtral | qwen3_moe | olmoe | qwen2_moe | deepseek_v3.
    family: str = "mixtral"
    # --- attention
    attention_head_dim: int | None = None  # None: hidden_size // num_heads (Qwen3-MoE sets it)
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2-MoE; Qwen3/OLMoE's
    o_proj_bias: bool = False  # attention_bias sets both)
    # RMSNorm on q and k before RoPE, keeping attention logits in range: "per_head" over each
    # head's dimensions (Qwen3-MoE), "across_heads" over the whole projection (OLMoE).
    qk_norm: str = "none"
    clip_qkv: float | None = None  # clamp q, k, v to [-clip_qkv, clip_qkv] (OLMoE's option)
    # --- routing (model.Router; the sigmoid rule in routing.py)
    router: str = "softmax"  # softmax over experts (Mixtral, Qwen, OLMoE) | sigmoid (DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalise the top_k routing weights to sum to 1
    routed_scaling_factor: float = 1.0  # factor on the routing weights (DeepSeek-V3: 2.5)
    n_group: int = 1  # group-limited routing (sigmoid router): experts in n_group equal groups,
    topk_group: int = 1  # each token chooses its experts within its topk_group best groups
    # Aux-loss-free load balancing (sigmoid router): after each step every expert's routing
    # bias moves by this much towards balance (`MoEForCausalLM.update_router_biases`).
    router_bias_update_rate: float = 0.0
    # --- shared expert: a dense SwiGLU MLP every token passes through beside the routed experts
    shared_expert_intermediate_size: int = 0  # 0: none
    shared_expert_gate: bool = False  # scale it by sigmoid(linear(x)) (Qwen2-MoE)
    # --- embedding: the token whose row starts at zero and gets no gradient, as HF's
    # nn.Embedding(padding_idx=pad_token_id) has it (OLMoE: 1); None: none
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "num_experts", "top_k", "max_seq_len")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoEConfig.{name}={value!r} must be a positive integer (an "
                                 f"int such as {getattr(MoEConfig, name)}, not a float or bool)")
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoEConfig.top_k={self.top_k} is larger than num_experts={self.num_experts}: "
                "each token is sent to top_k distinct experts; lower top_k or add experts")
        self._check_head_dim()
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"MoEConfig.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}: grouped-query attention shares each key/value "
                "head among an equal number of query heads; choose num_kv_heads dividing num_heads")
        for name, meaning in REAL_FIELDS.items():
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ValueError(f"MoEConfig.{name}={value!r} is not a number: give the {meaning}"
                                 f" as a float, e.g. {getattr(MoEConfig, name)}")
            # inf passes a bare `> 0` and reaches the weights or the loss as inf / nan.
            zero_allowed = name in ZERO_ALLOWED
            if not (math.isfinite(value) and (value >= 0 if zero_allowed else value > 0)):
                raise ValueError(f"MoEConfig.{name}={value!r} must be a finite number "
                                 f"{'>= 0' if zero_allowed else '> 0'} (the {meaning}), "
                                 f"e.g. {getattr(MoEConfig, name)}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            name = str(self.dtype).removeprefix("torch.")
            hint = f"; write it as the string {name!r}" if name in DTYPES else ""
            raise ValueError(f"MoEConfig.dtype={self.dtype!r} is not one of {sorted(DTYPES)}{hint}")
        self._check_architecture()

    def _check_head_dim(self) -> None:
        explicit = self.attention_head_dim
        if explicit is not None and (not isinstance(explicit, int) or isinstance(explicit, bool)
                                     or explicit < 1):
            raise ValueError(f"MoEConfig.attention_head_dim={explicit!r} must be a positive "
                             f"integer, or None for hidden_size / num_heads")
        if explicit is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"MoEConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}: every head gets hidden_size / num_heads dimensions; "
                "make hidden_size a multiple of num_heads (or set attention_head_dim)")
        if self.head_dim % 2:
            source = "attention_head_dim" if explicit else "hidden_size / num_heads"
            raise ValueError(
                f"MoEConfig.{source} = {self.head_dim} is odd: rotary embeddings "
                "rotate pairs of dimensions, so the head dimension must be even")

    def _check_architecture(self) -> None:
        """The architecture-variant fields: each a value of its kind, and no combination the
        model does not define."""
        choices = {"family": tuple(families.FAMILIES), "qk_norm": QK_NORMS, "router": ROUTERS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"MoEConfig.{name}={getattr(self, name)!r} is not one of "
                                 f"{allowed}")
        for name in ("qkv_bias", "o_proj_bias", "norm_topk_prob", "shared_expert_gate"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MoEConfig.{name}={getattr(self, name)!r} must be True or False")
        for name in ("n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoEConfig.{name}={value!r} must be a positive integer "
                                 f"(1: no group-limited routing)")
        shared = self.shared_expert_intermediate_size
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ValueError(f"MoEConfig.shared_expert_intermediate_size={shared!r} must be an "
                             f"integer >= 0 (0: no shared expert)")
        clip = self.clip_qkv
        if clip is not None and (not isinstance(clip, (int, float)) or isinstance(clip, bool)
                                 or not (math.isfinite(clip) and clip > 0)):
            raise ValueError(f"MoEConfig.clip_qkv={clip!r} must be a finite number > 0, or None "
                             f"for no clipping")
        pad = self.pad_token_id
        if pad is not None and (not isinstance(pad, int) or isinstance(pad, bool)
                                or not 0 <= pad < self.vocab_size):
            raise ValueError(f"MoEConfig.pad_token_id={pad!r} must be a token id in [0, "
                             f"vocab_size={self.vocab_size}), or None for no padding token")
        if self.shared_expert_gate and not shared:
            raise ValueError("MoEConfig.shared_expert_gate=True gates a shared expert, but "
                             "shared_expert_intermediate_size=0 builds none: give its width")
        sigmoid_only = {"n_group": self.n_group != 1, "topk_group": self.topk_group != 1,
                        "router_bias_update_rate": self.router_bias_update_rate != 0}
        for name, used in sigmoid_only.items():
            if used and self.router != "sigmoid":
                raise ValueError(f"MoEConfig.{name}={getattr(self, name)!r} belongs to the "
                                 f"sigmoid router (DeepSeek-V3's); router={self.router!r}: set "
                                 f"router='sigmoid' or leave {name} at its default")
        if self.router == "sigmoid" and self.aux_loss_coef:
            raise ValueError(f"MoEConfig.aux_loss_coef={self.aux_loss_coef} with "
                             "router='sigmoid': the load-balancing loss is defined on softmax "
                             "probabilities; a sigmoid router balances with its bias "
                             "(router_bias_update_rate): set aux_loss_coef=0")
        self._check_groups()

    def _check_groups(self) -> None:
        groups, chosen, per_group = self.n_group, self.topk_group, self.num_experts // self.n_group
        if self.num_experts % groups:
            raise ValueError(f"MoEConfig.num_experts={self.num_experts} is not divisible by "
                             f"n_group={groups}: the experts form equal groups")
        if chosen > groups:
            raise ValueError(f"MoEConfig.topk_group={chosen} is larger than n_group={groups}: "
                             f"tokens choose among the groups there are")
        if groups > 1 and per_group < 2:
            raise ValueError(f"MoEConfig.n_group={groups} leaves {per_group} expert per group; "
                             f"a group is scored by its best two experts: use fewer groups")
        if chosen * per_group < self.top_k:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds the {chosen * per_group} "
                             f"experts of topk_group={chosen} groups: raise topk_group")

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def with_overrides(self, **overrides) -> MoEConfig:
        """A copy with some fields changed (validated again)."""
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"MoEConfig has no field(s) {sorted(unknown)}; "
                             f"fields: {[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **overrides)

    def parameter_counts(self) -> dict[str, int]:
        """The parameters of the model this config describes, split the way expert parallelism
        splits them: `expert` (every layer's experts: sharded over the ep group), `dense`
        (embeddings, attention, norms, routers, lm_head: a full copy on every rank) and `total`.
        `active_per_token`: those a token's forward pass multiplies with — the dense ones except
        the embedding (a lookup) and the norms (elementwise scales), and top_k of the
        num_experts experts; 6 x this x tokens is the usual training FLOP count."""
        h, layers = self.hidden_size, self.num_layers
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = (h * q_width * 2 + h * kv_width * 2  # q, o and k, v
                     + (q_width + 2 * kv_width) * self.qkv_bias + h * self.o_proj_bias)
        router = h * self.num_experts
        one_expert = 3 * h * self.intermediate_size  # gate, up and down projections
        shared = 3 * h * self.shared_expert_intermediate_size + h * self.shared_expert_gate
        qk_norms = {"none": 0, "per_head": 2 * self.head_dim,
                    "across_heads": q_width + kv_width}[self.qk_norm]
        norms = layers * (2 * h + qk_norms) + h  # two RMSNorms per layer (and q, k's), the last
        embedding = lm_head = self.vocab_size * h
        expert = layers * self.num_experts * one_expert
        dense = layers * (attention + router + shared) + norms + embedding + lm_head
        active = dense - embedding - norms + layers * self.top_k * one_expert
        return {"expert": expert, "dense": dense, "total": expert + dense,
                "active_per_token": active}

    def active_params_per_token(self) -> int:
        """`parameter_counts()["active_per_token"]`: what FLOP counts multiply by."""
        return self.parameter_counts()["active_per_token"]

    def to_hf_config_kwargs(self) -> dict:
        """Keyword arguments for the transformers config of `family` (`MixtralConfig`, ...)
        describing the same model; ValueError where that family cannot express this config."""
        return families.hf_config_kwargs(self)

    @classmethod
    def from_hf_config(cls, hf_config, *, dtype: str = "float32",
                       moe_block_only: bool = False) -> MoEConfig:
        """The config of the model a transformers config of a supported family describes
        (`families.read_hf_config`; `moe_block_only` for a MoE block alone, e.g. DeepSeek-V3's).
        A value this package does not compute is refused, named as HF spells it."""
        read = families.read_hf_config(hf_config, moe_block_only=moe_block_only)
        try:
            return cls(dtype=dtype, **{name: value for name, (_, value) in read.items()})
        except ValueError as exc:  # name the fields as the HF config spells them
            culprits = ", ".join(f"{hf_name}={value!r}" for name, (hf_name, value) in read.items()
                                 if re.search(rf"\b{name}\b", str(exc)))
            raise ValueError(f"the HF model's config ({culprits}) does not describe a model this "
                             f"package builds: {exc}") from None


PRESETS: dict[str, MoEConfig] = {
    # Unit tests: a forward + backward pass takes milliseconds.
    "tiny": MoEConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, num_experts=4, top_k=2, max_seq_len=64),
    # The CPU course mode: trains on the protein data in a few minutes on 2 cores.
    "small": MoEConfig(hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                       num_kv_heads=2, num_experts=8, top_k=2, max_seq_len=256),
    # The final chapter's own model: fine-grained experts (many narrow ones, several per token,
    # as in Qwen3-MoE and OLMoE) on the protein data, small enough to train a few steps on a
    # CPU in seconds; widths multiples of 64, as the fused grouped MLP needs.
    "protein-moe-small": MoEConfig(hidden_size=256, intermediate_size=128, num_layers=4,
                                   num_heads=4, num_kv_heads=2, num_experts=16, top_k=4,
                                   max_seq_len=256),
    # Mixtral-8x7B's width with 2 layers: the single-GPU benchmark model.
    "mixtral-2l": MoEConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                            num_layers=2, num_heads=32, num_kv_heads=8, num_experts=8, top_k=2,
                            max_seq_len=4096, rope_theta=1e6, norm_eps=1e-5,
                            aux_loss_coef=0.02, dtype="bfloat16"),
    # Mixtral-8x7B's width with 7 layers: the 8-GPU matrix's model, which every (dp, ep) layout
    # holds even with replicated weights (every GPU all experts at dp8 × ep1). Per layer 1.451 B
    # parameters (experts 8 × 3 × 4096 × 14336 = 1.409 B, attention 0.042 B), plus 0.262 B of
    # embeddings and lm_head: 10.42 B. At dp8 × ep1 replicated, 2 × 4096 tokens per GPU,
    # memory.predict's peak is the step after the backward pass: weights, gradients, AdamW's
    # 2 moments (8 B/param in bf16) and the flat gradient copy average_gradients all-reduces
    # (2 B/param), 97.1 GiB in bf16 and in FP8 alike (TE frees its FP8 weight copies layer by
    # layer in the backward pass). The preset was sized when FP8's copies were thought to add
    # to that peak; 8 layers would fit as well (110.6 GiB predicted, 110.8 measured at dp2 × ep1
    # in bf16, benchmarks/results/h200x2_matrix_mixtral-8l.json, whose FP8 row timed out).
    "mixtral-7l": MoEConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                            num_layers=7, num_heads=32, num_kv_heads=8, num_experts=8, top_k=2,
                            max_seq_len=4096, rope_theta=1e6, norm_eps=1e-5,
                            aux_loss_coef=0.02, dtype="bfloat16"),
    # The real thing (47B parameters; for FLOP and memory arithmetic, not for one GPU).
    "mixtral-8x7b": MoEConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8, num_experts=8,
                              top_k=2, max_seq_len=32768, rope_theta=1e6, norm_eps=1e-5,
                              aux_loss_coef=0.02, dtype="bfloat16"),
}


def preset(name: str, layers: int | None = None, **overrides) -> MoEConfig:
    """One of `PRESETS`, optionally with fields overridden; `layers`: at another depth (the
    commands' `--layers`, e.g. the deepest Mixtral-width model that fits one GPU)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    if layers is not None:
        overrides["num_layers"] = layers
    return PRESETS[name].with_overrides(**overrides) if overrides else PRESETS[name]

