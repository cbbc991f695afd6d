"""Model configuration and the course's presets.

`MoEConfig` describes a Mixtral-style MoE causal language model. It is validated when it is
built, so a bad value fails here, with the field's name, and not deep inside a matmul:

    >>> cfg = preset("small")
    >>> cfg.with_overrides(num_experts=16).num_experts
    16
    >>> MoEConfig(top_k=3, num_experts=2)          # doctest: +SKIP
    ValueError: MoEConfig.top_k=3 is larger than num_experts=2 ...

The course runs in one of two modes: `small` (CPU-sized, minutes on 2 cores) or `full`
(GPU-sized). `course_mode()` resolves it from an explicit value, the `MOE_TUTORIAL_MODE`
environment variable, or the hardware (full on a GPU, small otherwise).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from .data import VOCAB_SIZE as PROTEIN_VOCAB_SIZE

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# MoEConfig's real-valued fields and what each is (for the message that refuses a bad one).
REAL_FIELDS = {"rope_theta": "RoPE base frequency", "norm_eps": "RMSNorm epsilon",
               "aux_loss_coef": "load-balancing loss weight, 0 to switch it off",
               "init_std": "standard deviation of the initial weights"}


@dataclass(frozen=True)
class MoEConfig:
    """Architecture of a Mixtral-compatible MoE causal LM (field names follow the paper's terms;
    `to_hf_config_kwargs()` maps them to transformers' `MixtralConfig`)."""

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
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"MoEConfig.hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}: every head gets hidden_size / num_heads dimensions; "
                "make hidden_size a multiple of num_heads")
        if self.head_dim % 2:
            raise ValueError(
                f"MoEConfig.hidden_size / num_heads = {self.head_dim} is odd: rotary embeddings "
                "rotate pairs of dimensions, so the head dimension must be even")
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
            zero_allowed = name == "aux_loss_coef"
            if not (math.isfinite(value) and (value >= 0 if zero_allowed else value > 0)):
                raise ValueError(f"MoEConfig.{name}={value!r} must be a finite number "
                                 f"{'>= 0' if zero_allowed else '> 0'} (the {meaning}), "
                                 f"e.g. {getattr(MoEConfig, name)}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            name = str(self.dtype).removeprefix("torch.")
            hint = f"; write it as the string {name!r}" if name in DTYPES else ""
            raise ValueError(f"MoEConfig.dtype={self.dtype!r} is not one of {sorted(DTYPES)}{hint}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

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
        h, d, layers = self.hidden_size, self.head_dim, self.num_layers
        attention = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2  # q, o and k, v
        router = h * self.num_experts
        one_expert = 3 * h * self.intermediate_size  # gate, up and down projections
        norms = layers * 2 * h + h  # two RMSNorms per layer, the final one
        embedding = lm_head = self.vocab_size * h
        expert = layers * self.num_experts * one_expert
        dense = layers * (attention + router) + norms + embedding + lm_head
        active = dense - embedding - norms + layers * self.top_k * one_expert
        return {"expert": expert, "dense": dense, "total": expert + dense,
                "active_per_token": active}

    def active_params_per_token(self) -> int:
        """`parameter_counts()["active_per_token"]`: what FLOP counts multiply by."""
        return self.parameter_counts()["active_per_token"]

    def to_hf_config_kwargs(self) -> dict:
        """Keyword arguments for transformers' `MixtralConfig` describing the same model."""
        return dict(
            {hf_name: getattr(self, name) for name, hf_name in MIXTRAL_FIELDS.items()},
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            tie_word_embeddings=False, sliding_window=None, attention_dropout=0.0,
            router_jitter_noise=0.0,
        )


# MoEConfig's fields under their names in transformers' `MixtralConfig` (rope_theta lives in
# its `rope_parameters`, dtype in the model's weights).
MIXTRAL_FIELDS = {
    "vocab_size": "vocab_size", "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size", "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
    "num_experts": "num_local_experts", "top_k": "num_experts_per_tok",
    "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps",
    "aux_loss_coef": "router_aux_loss_coef", "init_std": "initializer_range",
}


PRESETS: dict[str, MoEConfig] = {
    # Unit tests: a forward + backward pass takes milliseconds.
    "tiny": MoEConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, num_experts=4, top_k=2, max_seq_len=64),
    # The CPU course mode: trains on the protein data in a few minutes on 2 cores.
    "small": MoEConfig(hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                       num_kv_heads=2, num_experts=8, top_k=2, max_seq_len=256),
    # Mixtral-8x7B's width with 2 layers: the single-GPU benchmark model.
    "mixtral-2l": MoEConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                            num_layers=2, num_heads=32, num_kv_heads=8, num_experts=8, top_k=2,
                            max_seq_len=4096, rope_theta=1e6, norm_eps=1e-5,
                            aux_loss_coef=0.02, dtype="bfloat16"),
    # Mixtral-8x7B's width with 7 layers: the deepest that trains on 8 H200s in every (dp, ep)
    # layout and precision, dp8 × ep1 in FP8 included, where every GPU holds all experts. Per
    # layer 1.451 B parameters (experts 8 × 3 × 4096 × 14336 = 1.409 B, attention 0.042 B),
    # plus 0.262 B of embeddings and lm_head: 10.42 B. Per GPU at dp8 × ep1
    # (matrix.predicted_state_gib):
    #   weights + gradients + AdamW's 2 moments, bf16 (distributed.training_state_per_rank)  8 B/param
    #   + the flat gradient copy that average_gradients all-reduces                         2 B/param
    #   + in FP8, TE's quantized copies of the expert weights: 1 B per expert parameter
    #     (matrix.FP8_WEIGHT_COPY_BYTES)
    #   = 97.1 GiB in bf16, 106.2 GiB in FP8, within 85% of the H200's 140 GiB (119 GiB); the
    #   rest is for activations, the CUDA/NCCL context and fragmentation. 8 layers would need
    #   110.6 GiB in bf16 and 121 GiB in FP8; the 8-layer matrix on 2 × H200
    #   (benchmarks/results/h200x2_matrix_mixtral-8l.json) did not finish its dp2 × ep1 FP8 step.
    #   At dp1 × ep8 a GPU holds 1.5 B parameters.
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


def preset(name: str, **overrides) -> MoEConfig:
    """One of `PRESETS`, optionally with fields overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].with_overrides(**overrides) if overrides else PRESETS[name]


COURSE_MODES = ("small", "full")
MODE_ENV = "MOE_TUTORIAL_MODE"


def course_mode(mode: str | None = None) -> str:
    """Resolve the course mode: the argument, else $MOE_TUTORIAL_MODE, else `full` when a CUDA
    GPU is present and `small` otherwise."""
    chosen = mode or os.environ.get(MODE_ENV) or ("full" if torch.cuda.is_available() else "small")
    if chosen not in COURSE_MODES:
        source = "argument" if mode else f"${MODE_ENV}"
        raise ValueError(f"course mode {chosen!r} (from the {source}) is not one of {COURSE_MODES}")
    return chosen
