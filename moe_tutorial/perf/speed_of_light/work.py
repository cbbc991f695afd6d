"""The work of one training step: each part's minimum matmul FLOPs (forward + backward) and the
bytes it must move through memory at least (`step_work`), from the model's shapes, as the
package's docstring counts them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ...arguments import check_count
from ...moe.config import MoEConfig
from .. import timing
from ..step_parts import OTHER

# The work model counts each GEMM's operands in the config's dtype or in FP8 (one byte): which
# recipe scales the FP8 operands does not change the minimum work.
GEMM_OPERAND_FORMATS = ("bf16", "fp8")
FP8_BYTES = 1
# Each FP8-quantized tensor is written twice: FP8 GEMMs on Hopper take only the "TN" layout, and
# MXFP8 on Blackwell scales along rows for one GEMM and along columns for another, so the
# backward GEMMs need a transposed (column-wise) copy next to the forward's row-wise one. TE's
# cast_transpose kernels write both from one read.
FP8_COPIES = 2
ROUTER_LOGIT_BYTES = 4  # the router's softmax runs in fp32 (model.Router)

PARTS = ("expert GEMMs", "attention projections", "router", "lm_head", "attention", "loss",
         "quantization", "permutation", "norms & elementwise", "embedding", "optimizer")
PROFILER_PART = {"expert GEMMs": "GEMMs", "attention projections": "GEMMs", "router": "GEMMs",
                 "lm_head": "GEMMs", "attention": "attention", "loss": "norms & elementwise",
                 "quantization": "quantization", "permutation": "permutation",
                 "norms & elementwise": "norms & elementwise", "embedding": OTHER,
                 "optimizer": "optimizer"}
OPTIMIZERS = ("adamw", "adamw_fp32")


@dataclass(frozen=True)
class PartWork:
    """One part's minimum work per step: matmul FLOPs (forward + backward), the bytes it must
    move through memory, the `Rates` field its FLOPs run at (None: memory-bound), and the part
    of `step_profile.PARTS` it is measured in."""

    flops: int
    bytes: int
    rate: str | None
    profiler_part: str


@dataclass(frozen=True)
class StepWork:
    """`step_work`'s result: the work per part of one training step of `config`."""

    batch: int
    seq_len: int
    precision: str
    optimizer: str
    parts: dict[str, PartWork]

    def to_dict(self) -> dict:
        return asdict(self)


def _linear_elements(rows: int, inputs: int, outputs: int, weight_copies: int = 1) -> int:
    """Elements of the three tensors of a trained linear layer y = x·Wᵀ: x [rows, inputs],
    W [outputs, inputs] (`weight_copies` of them: one per expert), y and dy [rows, outputs]."""
    return rows * inputs + weight_copies * outputs * inputs + rows * outputs


def _linear_bytes(rows: int, inputs: int, outputs: int, *, operand_bytes: int,
                  output_bytes: int, weight_copies: int = 1) -> int:
    """Bytes a trained linear layer's three GEMMs move at least: forward y = x·Wᵀ, backward
    dx = dy·W and dW = dyᵀ·x. Each GEMM reads two operands and writes one output, so x, W and dy
    are each read twice (as operands, `operand_bytes` per element: 1 in FP8) and y, dx, dW each
    written once (`output_bytes`: TE's FP8 GEMMs write bf16), and y, dx, dW have the sizes of
    dy, x, W: bytes = elements × (2·operand_bytes + output_bytes)."""
    return (_linear_elements(rows, inputs, outputs, weight_copies)
            * (2 * operand_bytes + output_bytes))


def _linear_flops(rows: int, inputs: int, outputs: int) -> int:
    """A trained linear layer's three GEMMs: forward 2·rows·inputs·outputs, backward twice that."""
    return 3 * 2 * rows * inputs * outputs


def _check_shape_arguments(config, batch, seq_len) -> None:
    if not isinstance(config, MoEConfig):
        raise ValueError(f"config must be a MoEConfig (e.g. config.preset('mixtral-2l')), got "
                         f"{type(config).__name__}")
    check_count("batch", batch)
    check_count("seq_len", seq_len)
    if seq_len > config.max_seq_len:
        raise ValueError(f"seq_len={seq_len} is longer than the model's max_seq_len="
                         f"{config.max_seq_len}; choose seq_len <= {config.max_seq_len}")


def adamw_bytes_per_parameter(optimizer: str, param_bytes: int) -> int:
    """Bytes AdamW moves per parameter and step. "adamw", torch's AdamW as the course runs it
    (`train.make_optimizer`), keeps its two moments in the parameters' dtype (p bytes): it reads
    the parameter, its gradient, exp_avg and exp_avg_sq (4p) and writes the parameter and both
    moments (3p): 7p, 14 bytes in bf16. "adamw_fp32", mixed precision with fp32 master weights:
    it reads the gradient (p) and the fp32 master weight and both fp32 moments (12), writes
    those three (12) and the working copy in the parameters' dtype (p): 24 + 2p, 28 in bf16."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {OPTIMIZERS}")
    return 7 * param_bytes if optimizer == "adamw" else 24 + 2 * param_bytes


def _elementwise_bytes_per_layer(config: MoEConfig, tokens: int, x_bytes: int) -> int:
    """Bytes one layer's norms and elementwise ops move at least in a training step of `tokens`
    tokens, forward and backward (`x_bytes`: one [tokens, hidden] activation)."""
    act = config.torch_dtype.itemsize
    heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
    copies = tokens * config.top_k
    # Norms and elementwise, per layer. RMSNorm (two per layer): forward reads x, writes y (2);
    # backward reads dy and x, writes dx (3): 5 activations. Residual add (two per layer):
    # forward reads both summands, writes the sum (3); backward the residual stream's gradient
    # is the sum of the skip path's and the branch's (3): 6. RoPE on q and k: forward and
    # backward each read and write them. SwiGLU on the gate-up output [copies, 2·inter]: forward
    # reads it, writes [copies, inter] (3·copies·inter); backward reads dA and the gate-up output
    # and writes its gradient (1 + 2 + 2). Router softmax over fp32 logits [tokens, experts]:
    # forward reads and writes (2), backward reads probs and their gradient, writes dlogits (3).
    # Norm weights, the load-balancing loss and the routing weights' scale: ≤ 1/hidden of these.
    return (2 * 5 * x_bytes + 2 * 6 * x_bytes
            + 4 * tokens * (heads + kv_heads) * d * act
            + 8 * copies * config.intermediate_size * act
            + 5 * tokens * config.num_experts * ROUTER_LOGIT_BYTES)


def step_work(config: MoEConfig, batch: int, seq_len: int, *, precision: str = "bf16",
              optimizer: str = "adamw") -> StepWork:
    """The minimum work of one training step (forward, backward, optimizer step) of `config`
    on batch × seq_len tokens, per part of `PARTS`. `precision`: "bf16" (every GEMM in the
    config's dtype) or "fp8" (the expert GEMMs and the attention projections in FP8, as
    `model.set_precision` runs them; the router and lm_head stay in the config's dtype).
    `optimizer`: see `adamw_bytes_per_parameter`. Routing is taken as balanced (every token
    copy does the same work wherever it goes) and alignment padding as none."""
    _check_shape_arguments(config, batch, seq_len)
    if precision not in GEMM_OPERAND_FORMATS:
        raise ValueError(f"precision={precision!r}: choose one of {GEMM_OPERAND_FORMATS}")
    act = config.torch_dtype.itemsize  # bytes of an activation, weight or gradient element
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_layers
    heads, kv_heads, d = config.num_heads, config.num_kv_heads, config.head_dim
    tokens = batch * seq_len
    copies = tokens * config.top_k  # token copies the experts process
    fp8 = precision == "fp8"
    low = FP8_BYTES if fp8 else act  # operand bytes of the GEMMs that run in FP8
    # (rows, inputs, outputs, weight copies) of each layer's linears; q, k and v as one GEMM
    # (what the model runs in FP8, and the least traffic: x read once, not three times).
    qkv = (tokens, h, (heads + 2 * kv_heads) * d, 1)
    out_proj = (tokens, heads * d, h, 1)
    gate_up = (copies, h, 2 * inter, config.num_experts)
    down = (copies, inter, h, config.num_experts)

    def linears_bytes(shapes, operand_bytes):
        return sum(_linear_bytes(*s[:3], weight_copies=s[3], operand_bytes=operand_bytes,
                                 output_bytes=act) for s in shapes)

    x_bytes = tokens * h * act  # one [tokens, hidden] activation
    per_layer_elementwise = _elementwise_bytes_per_layer(config, tokens, x_bytes)
    final_norm = 5 * x_bytes
    params = config.parameter_counts()
    parts = {  # name: (matmul FLOPs, bytes, the rate its FLOPs run at)
        # 18·T·k·H·I per layer (timing's count) at the expert GEMM rate of this precision.
        "expert GEMMs": (layers * timing.expert_mlp_flops(tokens, config.top_k, h, inter),
                         layers * linears_bytes((gate_up, down), low),
                         f"expert_{precision}_tflops"),
        # q/k/v and o: te.Linear in FP8, so the dense rate of this precision.
        "attention projections": (layers * sum(_linear_flops(*s[:3]) for s in (qkv, out_proj)),
                                  layers * linears_bytes((qkv, out_proj), low),
                                  f"dense_{precision}_tflops"),
        # The router and the lm_head stay in the config's dtype under FP8 (model.py).
        "router": (layers * _linear_flops(tokens, h, config.num_experts),
                   layers * linears_bytes([(tokens, h, config.num_experts, 1)], act),
                   "dense_bf16_tflops"),
        "lm_head": (_linear_flops(tokens, h, config.vocab_size),
                    linears_bytes([(tokens, h, config.vocab_size, 1)], act), "dense_bf16_tflops"),
        # Causal SDPA: 3 × 4·head_dim FLOPs per (query, key) pair and head (timing's count).
        # Bytes: forward reads q, k, v and writes o; backward reads q, k, v, o, do and writes
        # dq, dk, dv: q, o, do, dq have `heads` heads, k, v, dk, dv `kv_heads`: 6·(h + kv) in all.
        "attention": (layers * timing.attention_flops(batch, seq_len, heads, d),
                      layers * 6 * tokens * (heads + kv_heads) * d * act, "attention_tflops"),
        # The loss reads the logits once and writes their gradient once (the model computes it
        # in the forward pass: softmax - one_hot, scaled by 1 / targets).
        "loss": (0, 2 * tokens * config.vocab_size * act, None),
        # FP8: every operand of every FP8 GEMM — x, W and dy of each FP8 linear — is read once
        # in the activation dtype and written FP8_COPIES times in FP8, once per step (weights
        # change every step, so their FP8 copies are made again). Fusing the casts into the
        # kernels that produce those tensors would save the read; as the step runs, they are
        # separate kernels.
        "quantization": (0, fp8 * layers * (act + FP8_COPIES * FP8_BYTES) * sum(
            _linear_elements(*s) for s in (qkv, out_proj, gate_up, down)), None),
        # Dispatch: forward reads the tokens' rows and writes their copies grouped by expert;
        # combine: forward reads the experts' output copies and writes one row per token;
        # backward, each the other way round: 4 × (tokens + copies) rows of hidden. The row
        # maps and routing weights (integers and scalars per copy) are ≤ 1/hidden of that.
        "permutation": (0, layers * 4 * (tokens + copies) * h * act, None),
        "norms & elementwise": (0, layers * per_layer_elementwise + final_norm, None),
        # The lookup reads one row per token and writes it (2); backward reads dx and writes
        # the embedding's gradient, dense (every row: nn.Embedding's, which AdamW then reads).
        "embedding": (0, 3 * x_bytes + config.vocab_size * h * act, None),
        "optimizer": (0, params["total"] * adamw_bytes_per_parameter(optimizer, act), None),
    }
    parts = {name: PartWork(flops, nbytes, rate, PROFILER_PART[name])
             for name, (flops, nbytes, rate) in parts.items()}
    return StepWork(batch, seq_len, precision, optimizer, parts)
