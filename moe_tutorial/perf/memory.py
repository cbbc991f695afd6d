"""What one GPU holds during a training step, predicted from the config alone.

A step's memory has two kinds of parts:

* the training state, there from step to step: the parameters and AdamW's two moments, plus the
  gradients from the backward pass until `optimizer.zero_grad(set_to_none=True)`;
* what the step makes and frees again: the tensors every layer's forward pass saves for its
  backward pass (activations, and Transformer Engine's FP8 copies of the weights, which TE saves
  the same way), the logits, the all-reduce buffer of the gradients, and under FSDP2 the layers
  whose full weights are gathered while they run.

They do not all peak together, so `predict` adds them up at the three moments that can be the
worst, and reports the largest:

    forward    at the loss: state without gradients, every layer's saved tensors, the logits
    backward   the sweep from the last layer to the first frees each layer's saved tensors and
               makes its gradients, so the worst is at one end: every layer's saved tensors and
               the last layer's gradients, or every gradient and the first layer's saved tensors
    step       after the backward pass: state with gradients, plus the all-reduce buffer

`saved_activations` lists, tensor by tensor, what this package's model saves for the backward pass
(tests/perf/test_memory.py measures it on the real model with `torch.autograd.graph.saved_tensors_hooks`).
Engines: "single" (one process, no gradient averaging: what `bench` measures), "replicated"
(every rank a full copy, experts sharded over `ep`, `distributed.average_gradients`' flat
buffer), "fsdp2" (`distributed.fully_shard_layout`). Expert backends: "grouped_torch" (measured on
a CPU), "te_grouped_linear" and "te_ops" (what TE 2.20.2 saves, read from its source and cited
where used). All sizes are bytes; `gib()` converts.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import asdict, dataclass

from ..moe.config import DTYPES, MoEConfig
from ..moe.experts import TE_BACKENDS
from ..moe.loss import cross_entropy
from ..parallel import distributed
from ..precision import hardware, recipes
from .fp8_storage import fp8_activation_bytes, fp8_weight_copy_bytes

ENGINES = ("single", "replicated", "fsdp2")
BACKENDS = ("grouped_torch", "te_grouped_linear", "te_ops")
ARCHS = ("hopper", "blackwell")  # hardware.fake_environment's names for an H200 and a B200
DEVICES = ("cuda", "cpu")  # where the model runs: a CPU's rms_norm saves more (see `_norm`)

FP32, INT64, INT32 = 4, 8, 4  # bytes per value of the tensors the model keeps in these dtypes
# The rows the loss turns into fp32 log-probabilities at a time (`loss.cross_entropy`'s default).
CE_CHUNK = inspect.signature(cross_entropy).parameters["chunk"].default
# The Mixtral table's expert backend: what the course's matrix trains with on the H200
# (benchmarks/results/h200x2.json, h200x2_matrix_mixtral-8l.json: te_ops).
TABLE_BACKEND = "te_ops"


def gib(nbytes: float) -> float:
    return nbytes / 2**30


# ---------------------------------------------------------------------------------------------
# Parameters: what a rank keeps between steps.

def parameters_per_rank(config: MoEConfig, dp: int, ep: int, engine: str = "replicated") -> dict:
    """Parameters one rank of a (dp, ep) layout keeps between steps: `expert`, `dense`, `total`.

    Replicated (and single): the dense parameters on every rank, the experts divided by ep.
    FSDP2: every rank keeps 1/(dp·ep) of each dense parameter and 1/dp of its ep shard of the
    experts, rounded up (FSDP2 pads each tensor's first dimension to a multiple of the group
    size; those few padding elements are left out)."""
    _check_engine(engine)
    distributed.check_layout(dp * ep, dp, ep, config.num_experts)
    counts = config.parameter_counts()
    expert, dense = counts["expert"] // ep, counts["dense"]
    if engine == "fsdp2":
        expert, dense = -(-expert // dp), -(-dense // (dp * ep))
    return {"expert": expert, "dense": dense, "total": expert + dense}


def training_state(config: MoEConfig, dp: int, ep: int, engine: str = "replicated",
                   state_dtype: str | None = None) -> dict:
    """Bytes of what one rank keeps from step to step: its parameters, their gradients (from the
    backward pass to `zero_grad`) and AdamW's two moments, all in the state dtype (torch's
    AdamW keeps the moments in the parameters' dtype): 4 × 2 bytes per parameter in bf16,
    4 × 4 in fp32. `state_dtype`: see `predict`."""
    local = parameters_per_rank(config, dp, ep, engine)["total"]
    itemsize = _state_itemsize(config, engine, state_dtype)
    parts = {"parameters": local * itemsize, "gradients": local * itemsize,
             "optimizer_state": 2 * local * itemsize}
    return {**parts, "total": sum(parts.values())}


def layer_parameters(config: MoEConfig, ep: int = 1) -> dict:
    """Parameters of the model's parts as FSDP2 groups them: `root` (embedding, lm_head, final
    norm), and per decoder layer `layer_dense` (attention, router, two norms), `attention`
    (the four projections, TE's FP8 modules under FP8) and `layer_experts` (this rank's ep shard
    of the layer's experts). Derived from `MoEConfig.parameter_counts`."""
    counts = config.parameter_counts()
    hidden = config.hidden_size
    root = 2 * config.vocab_size * hidden + hidden
    layer_dense = (counts["dense"] - root) // config.num_layers
    attention = layer_dense - hidden * config.num_experts - 2 * hidden  # less router, norms
    return {"root": root, "layer_dense": layer_dense, "attention": attention,
            "layer_experts": counts["expert"] // config.num_layers // ep}


# ---------------------------------------------------------------------------------------------
# Activations: what the forward pass saves for the backward pass.

def _norm(tokens: int, hidden: int, itemsize: int, device: str) -> dict:
    """`model.RMSNorm`, `weight * F.rms_norm(x)`: rms_norm saves its input and the fp32
    reciprocal rms per token; the weight's product saves the normalised x. On a CPU torch's
    rms_norm is composite and saves the input upcast to fp32 (measured); on a GPU the fused
    kernel (`_fused_rms_norm`) saves the input as it is."""
    saved_input = FP32 if device == "cpu" else itemsize
    return {"norm input": tokens * hidden * saved_input, "norm rstd (fp32)": tokens * FP32,
            "normalised x": tokens * hidden * itemsize}


def _attention(config: MoEConfig, tokens: int, itemsize: int, fp8: float | None,
               device: str) -> dict:
    """One layer's attention block: input norm, q/k/v projections, RoPE, SDPA, o_proj.

    bf16 (nn.Linear): the projections save their input (the norm's output); SDPA saves q, k, v
    (k and v at the grouped-query width), its output and the fp32 log-sum-exp per head and
    token; o_proj's input is SDPA's output itself (same storage).
    FP8 (`fp8`: bytes per saved FP8 value): q, k, v come from one te.Linear, which saves its
    input as an FP8 columnwise copy, and v is a view of that fused output, so SDPA keeps all of
    it; o_proj (te.Linear) saves an FP8 copy of its input next to SDPA's bf16 output."""
    h, d = config.hidden_size, config.head_dim
    q_width, kv_width = config.num_heads * d, config.num_kv_heads * d
    parts = {f"input {k}": v for k, v in _norm(tokens, h, itemsize, device).items()}
    parts.update({"q (after RoPE)": tokens * q_width * itemsize,
                  "k (after RoPE)": tokens * kv_width * itemsize,
                  "SDPA output": tokens * q_width * itemsize,
                  "SDPA log-sum-exp (fp32)": tokens * config.num_heads * FP32})
    if fp8 is None:
        parts["q/k/v projections' input"] = tokens * h * itemsize
        parts["v"] = tokens * kv_width * itemsize
    else:
        parts["qkv_proj input (FP8)"] = tokens * h * fp8
        parts["fused qkv output (v is a view)"] = tokens * (q_width + 2 * kv_width) * itemsize
        parts["o_proj input (FP8)"] = tokens * h * fp8
    return parts


def _router(config: MoEConfig, tokens: int, itemsize: int, device: str) -> dict:
    """Post-attention norm and `model.Router`: the router's input, the fp32 softmax, top-k's
    indices, and the renormalisation's divisor and dividend."""
    k = config.top_k
    parts = {f"post-attention {k_}": v
             for k_, v in _norm(tokens, config.hidden_size, itemsize, device).items()}
    parts.update({"router input": tokens * config.hidden_size * itemsize,
                  "router softmax (fp32)": tokens * config.num_experts * FP32,
                  "top-k indices (int64)": tokens * k * INT64,
                  "top-k sum (fp32)": tokens * FP32,
                  "top-k weights (fp32)": tokens * k * FP32})
    return parts


def _expert_mlp(config: MoEConfig, tokens: int, copies: int, experts: int, rows: int,
                itemsize: int, backend: str, fp8: float | None) -> dict:
    """The experts of one layer on `rows` permuted rows (`tokens` × `copies` routed copies,
    padded), `experts` of them local.

    grouped_torch (`experts.GroupedTorchExperts`): the first grouped GEMM saves the permuted
    rows, SwiGLU (`silu(gate) * up`) the gate-up output and silu(gate), the second GEMM the
    SwiGLU output, and `routing.unpermute` the expert outputs (to differentiate the routing
    weights), each copy's buffer row and the fp32 routing weights.
    te_grouped_linear (TE's permute, two te.GroupedLinear, SwiGLU in torch): TE 2.20.2's
    `moe_permute_and_pad_with_probs` saves its int32 row_id_map [tokens, 2E+1]
    (permutation.py, `_moe_permute_mask_map_setup_context`; triton/permutation.py,
    `make_row_id_map`), `moe_unpermute` with merging probs the expert outputs and the fp32
    probs [tokens, E] (`_moe_unpermute_mask_map_setup_context`); each GroupedLinear its input.
    te_ops: ScaledSwiGLU saves its input and the routing weights cast to the compute dtype
    (ops/basic/swiglu.py, `_ScaledGLU.fuser_forward`) and recomputes silu; the unpermute
    without probs saves only the row_id_map.
    Under FP8 the GroupedLinear inputs are saved as FP8 columnwise copies (`fp8` bytes each)."""
    h, i = config.hidden_size, config.intermediate_size
    gemm_input = itemsize if fp8 is None else fp8
    parts = {"permuted rows (first GEMM's input)": rows * h * gemm_input,
             "gate-up output": rows * 2 * i * itemsize,
             "SwiGLU output (second GEMM's input)": rows * i * gemm_input}
    if backend == "grouped_torch":
        parts.update({"silu(gate)": rows * i * itemsize,
                      "expert outputs (for the weights' gradient)": rows * h * itemsize,
                      "group row ends (int32, shared by both GEMMs)": experts * INT32,
                      "buffer row of each copy (int64)": tokens * copies * INT64,
                      "routing weights (fp32)": tokens * copies * FP32})
        return parts
    parts.update({"TE row_id_map (int32)": tokens * (2 * experts + 1) * INT32,
                  "routing indices (int64, the probs' scatter)": tokens * copies * INT64})
    if backend == "te_grouped_linear":
        parts.update({"silu(gate)": rows * i * itemsize,
                      "expert outputs (for the probs' gradient)": rows * h * itemsize,
                      "merging probs (fp32)": tokens * experts * FP32})
    else:
        parts["ScaledSwiGLU scales"] = rows * itemsize
    return parts


def _experts(config: MoEConfig, tokens: int, ep: int, itemsize: int, backend: str,
             recipe: str | None, fp8: float | None, expert_load: float) -> dict:
    """The experts of one layer, with their dispatcher. ep = 1 (`model.LocalDispatcher`): the
    T×k copies go straight to the experts. ep > 1 (`distributed.AllToAllDispatcher`): the rows
    this rank receives (T×k × `expert_load`, 1 when routing is balanced) enter the local experts
    as tokens with one copy each; around them the dispatcher saves the gather index of the
    routing weights and, for merging the k outputs back, each copy's row (int64 each). The
    exchanged buffers themselves are not saved (`all_to_all_single_autograd` keeps none)."""
    copies = tokens * config.top_k
    align = recipes.alignment(recipe) if backend in TE_BACKENDS else 1
    if ep == 1:
        experts = config.num_experts
        rows = copies + experts * (align - 1)  # padding: at most align - 1 rows per expert
        return _expert_mlp(config, tokens, config.top_k, experts, rows, itemsize, backend, fp8)
    experts = config.num_experts // ep
    received = math.ceil(copies * expert_load)
    rows = received + experts * (align - 1)
    parts = _expert_mlp(config, received, 1, experts, rows, itemsize, backend, fp8)
    parts.update({"dispatch: weights' gather index (int64)": copies * INT64,
                  "combine: row of each copy (int64)": copies * INT64})
    return parts


def _head(config: MoEConfig, batch: int, seq_len: int, itemsize: int, device: str) -> dict:
    """Outside the decoder layers: the embedding's token ids, the final norm, lm_head's input,
    the loss's saved gradient (`loss._CrossEntropyWithGradient` computes softmax − one-hot in
    the forward pass and keeps it, [tokens, vocab] in the logits' dtype), the load-balancing
    loss over all layers (fp32 softmax, top-k indices, expert shares) and the RoPE tables, one
    set shared by every layer (a CPU: cos and sin in the compute dtype; a GPU: TE's fused RoPE
    keeps the fp32 angles)."""
    tokens = batch * seq_len
    h, e, layers = config.hidden_size, config.num_experts, config.num_layers
    rope = 2 * seq_len * config.head_dim * itemsize if device == "cpu" else \
        seq_len * config.head_dim * FP32
    parts = {"token ids (int64)": tokens * INT64}
    parts.update({f"final {k}": v for k, v in _norm(tokens, h, itemsize, device).items()})
    parts.update({"lm_head input": tokens * h * itemsize,
                  "loss gradient [tokens, vocab]": tokens * config.vocab_size * itemsize,
                  "aux loss softmax (fp32, all layers)": layers * tokens * e * FP32,
                  "aux loss top-k indices (int64)": layers * tokens * config.top_k * INT64,
                  "aux loss expert shares (fp32)": e * FP32,
                  "RoPE tables": rope})
    return parts


def saved_activations(config: MoEConfig, *, batch: int, seq_len: int, ep: int = 1,
                      backend: str = "grouped_torch", precision: str = "bf16",
                      arch: str = "hopper", device: str = "cuda",
                      expert_load: float = 1.0) -> dict:
    """Bytes the model's forward pass saves for its backward pass, tensor by tensor, on one rank
    with `batch` sequences of `seq_len` tokens: {"attention", "router", "experts"} (each per
    decoder layer) and "head" (once), each a dict {what: bytes}. Tensors that share storage
    count once; parameters are not counted (they are the state). See `_attention`, `_router`,
    `_experts`, `_head` for what each part is and where it comes from."""
    _check_batch(config, batch, seq_len)
    distributed.check_layout(ep, 1, ep, config.num_experts)
    if not isinstance(expert_load, (int, float)) or not 0 < expert_load <= ep:
        raise ValueError(f"expert_load={expert_load!r} must be a number in (0, ep={ep}]: the rows "
                         f"this rank's experts get relative to balanced routing (1.0)")
    recipe = _recipe(precision, arch)
    _check_backend(backend, recipe, device)
    itemsize = config.torch_dtype.itemsize
    tokens = batch * seq_len
    fp8 = fp8_activation_bytes(recipe, arch) if recipe else None
    return {"attention": _attention(config, tokens, itemsize, fp8, device),
            "router": _router(config, tokens, itemsize, device),
            "experts": _experts(config, tokens, ep, itemsize, backend, recipe, fp8, expert_load),
            "head": _head(config, batch, seq_len, itemsize, device)}


LAYER_PARTS = ("attention", "router", "experts")  # saved once per decoder layer


def layer_activation_bytes(saved: dict) -> int:
    """What one decoder layer saves, from `saved_activations`."""
    return round(sum(sum(saved[part].values()) for part in LAYER_PARTS))


def saved_activation_bytes(saved: dict, num_layers: int) -> int:
    """Everything the forward pass saves: `num_layers` decoder layers and the head."""
    return num_layers * layer_activation_bytes(saved) + round(sum(saved["head"].values()))


# ---------------------------------------------------------------------------------------------
# The prediction.

@dataclass(frozen=True)
class MemoryPrediction:
    """What one GPU holds at the three moments of a step that can be its peak (see the module
    doc): `phases[moment][component]` in bytes. `sizes` are the pieces they are built from
    (per-layer saved activations, FP8 copies, FSDP2's unsharded layer, ...), `settings` what
    was predicted. JSON-able through `to_dict()`."""

    settings: dict
    phases: dict
    sizes: dict

    @property
    def totals(self) -> dict:
        return {moment: sum(parts.values()) for moment, parts in self.phases.items()}

    @property
    def peak_phase(self) -> str:
        return max(self.totals, key=self.totals.get)

    @property
    def peak(self) -> int:
        return self.totals[self.peak_phase]

    @property
    def components(self) -> dict:
        """Each component at its largest over the step (they need not coincide: the peak is
        `peak`, not the sum of these)."""
        names = dict.fromkeys(name for parts in self.phases.values() for name in parts)
        return {name: max(parts.get(name, 0) for parts in self.phases.values())
                for name in names}

    def to_dict(self) -> dict:
        return {**asdict(self), "totals": self.totals, "peak": self.peak,
                "peak_phase": self.peak_phase, "components": self.components}

    def describe(self) -> str:
        """The peak moment's components, largest first, in GiB."""
        parts = sorted(self.phases[self.peak_phase].items(), key=lambda kv: -kv[1])
        listed = ", ".join(f"{name} {gib(value):.1f}" for name, value in parts if value)
        return f"peak {gib(self.peak):.1f} GiB at the {self.peak_phase} moment: {listed}"


def predict(config: MoEConfig, *, batch: int, seq_len: int, dp: int = 1, ep: int = 1,
            engine: str = "replicated", precision: str = "bf16",
            backend: str = "grouped_torch", state_dtype: str | None = None,
            activation_checkpointing: bool = False, arch: str = "hopper", device: str = "cuda",
            expert_load: float = 1.0) -> MemoryPrediction:
    """The memory one GPU of a (dp, ep) layout holds during a training step with `batch`
    sequences of `seq_len` tokens per GPU.

    engine: "single", "replicated" or "fsdp2" (module doc). precision: "bf16" (the config's
    dtype, no FP8), "fp8" / "closest_to_mxfp8" (the recipe `recipes.resolve` picks on `arch`)
    or a TE recipe name; FP8 needs a TE `backend`. state_dtype: the dtype of the parameters,
    gradients and AdamW moments between steps; FSDP2 only may differ from the config's dtype
    (a `MixedPrecisionPolicy(param_dtype=<config dtype>)`: fp32 shards, bf16 compute).
    activation_checkpointing: every decoder layer under `torch.utils.checkpoint` (under FP8,
    TE's `transformer_engine.pytorch.distributed.checkpoint`, which recomputes under the
    forward pass's recipe), so the forward pass keeps only each layer's input and the backward
    pass recomputes one layer at a time. expert_load: rows this rank's experts get relative to balanced routing (ep > 1).
    device "cpu" is for checking the prediction on a CPU (bf16's norms save more there)."""
    _check_engine(engine)
    distributed.check_layout(dp * ep, dp, ep, config.num_experts)
    if engine == "single" and dp * ep != 1:
        raise ValueError(f"engine 'single' is one process; dp={dp} × ep={ep} is {dp * ep}: use "
                         f"engine='replicated' or 'fsdp2' for several GPUs")
    state = _state_itemsize(config, engine, state_dtype)
    saved = saved_activations(config, batch=batch, seq_len=seq_len, ep=ep, backend=backend,
                              precision=precision, arch=arch, device=device,
                              expert_load=expert_load)
    recipe = _recipe(precision, arch)
    # what `distributed.fully_shard_layout` leaves out of FSDP2 (`experts_outside_fsdp`)
    experts_outside = engine == "fsdp2" and distributed.experts_outside_fsdp(
        dp, casts=(state_dtype or config.dtype) != config.dtype)
    sizes = _sizes(config, saved, batch * seq_len, dp, ep, engine, state, backend, recipe, arch,
                   activation_checkpointing, experts_outside)
    kept = training_state(config, dp, ep, engine, state_dtype)
    held = {part: kept[part] for part in ("parameters", "optimizer_state")}
    phases = {"forward": {**held, **_forward(sizes, config.num_layers, engine)},
              "backward": {**held, **_backward(sizes, config.num_layers, engine)},
              "step": {**held, "gradients": kept["gradients"], **_step(sizes, engine)}}
    settings = {"model": _dims(config), "batch": batch, "seq_len": seq_len, "dp": dp, "ep": ep,
                "engine": engine, "precision": precision, "recipe": recipe, "backend": backend,
                "compute_dtype": config.dtype, "state_dtype": state_dtype or config.dtype,
                "activation_checkpointing": activation_checkpointing, "arch": arch,
                "device": device, "expert_load": expert_load}
    return MemoryPrediction(settings, phases, sizes)


def _sizes(config, saved, tokens, dp, ep, engine, state, backend, recipe, arch, checkpointing,
           experts_outside: bool):
    """The pieces the phases add up, in bytes."""
    compute = config.torch_dtype.itemsize
    params = layer_parameters(config, ep)
    layer_saved = layer_activation_bytes(saved)
    loss_gradient = saved["head"]["loss gradient [tokens, vocab]"]
    fp8_layer = _fp8_copies_per_layer(params, recipe, arch, backend, engine)
    layer = params["layer_dense"] + params["layer_experts"]
    # FSDP2 gathers (and reduce-scatters) what it wraps; with dp = 1 and no cast the experts
    # stay outside it (`distributed.experts_outside_fsdp`), so a layer's gathered weights and
    # gradient buffers are its dense part only. Their gradient hook divides by the world into
    # a new tensor: one expert stack's gate-up gradient (2/3 of the layer's experts) at a time.
    gathered = params["layer_dense"] if experts_outside else layer
    divided = params["layer_experts"] * 2 // 3 * compute if experts_outside and ep > 1 else 0
    if engine == "fsdp2":  # the layer's shard of gradients, as FSDP2 keeps them
        world = dp * ep
        layer_gradients = (-(-params["layer_dense"] // world)
                           + -(-params["layer_experts"] // dp)) * state
    else:
        layer_gradients = layer * compute
    return {
        "layer_saved": layer_saved, "fp8_layer": fp8_layer,
        # What a layer keeps from its forward pass to its backward pass: everything it saves,
        # or under checkpointing its input only (FP8 copies are made again in the recompute).
        "layer_kept": tokens * config.hidden_size * compute if checkpointing else layer_saved,
        "fp8_kept": 0 if checkpointing else fp8_layer,
        "head_saved": round(sum(saved["head"].values())) - loss_gradient,
        # The logits [tokens, vocab] while the loss runs (freed before the backward pass, whose
        # gradient of them is the same size), the loss's saved gradient, one chunk of fp32
        # log-probabilities, and every layer's router logits kept for the aux loss.
        "logits": (2 * tokens * config.vocab_size * compute
                   + min(CE_CHUNK, tokens) * config.vocab_size * FP32
                   + config.num_layers * tokens * config.num_experts * compute),
        "layer_gradients": layer_gradients,
        # lm_head's and the final norm's gradients exist from the start of the backward pass.
        "head_gradients": (config.vocab_size + 1) * config.hidden_size * compute,
        "root_unsharded": params["root"] * compute,
        "layer_unsharded": gathered * compute,
        "largest_group_unsharded": (params["layer_dense"] if experts_outside else
                                    max(params["layer_dense"], params["layer_experts"])) * compute,
        "divided_gradient": divided,
        "allreduce_buffer": (0 if engine != "replicated" else
                             parameters_per_rank(config, dp, ep, engine)["total"] * compute),
    }


def _fp8_copies_per_layer(params, recipe, arch, backend, engine) -> float:
    """Bytes of the FP8 weight copies one decoder layer saves for its backward pass: the
    experts' (te.GroupedLinear or te.ops, `fp8_weight_copy_bytes`) and the attention
    projections' (te.Linear). Under FSDP2 te.Linear saves none: module/linear.py
    `_linear_forward_impl`, `if is_fsdp2 and weightmat is not weight: wt_save = None` (it
    quantizes the gathered weight again in the backward pass); the grouped modules have no such
    branch, so every layer's FP8 expert copies live until its backward pass, FSDP2 or not."""
    if recipe is None:
        return 0
    module = "ops" if backend == "te_ops" else "grouped_linear"
    copies = params["layer_experts"] * fp8_weight_copy_bytes(recipe, arch, module)
    if engine != "fsdp2":
        copies += params["attention"] * fp8_weight_copy_bytes(recipe, arch, "linear")
    return copies


def _forward(sizes: dict, layers: int, engine: str) -> dict:
    """At the loss: every layer's kept tensors, the head's, the logits. FSDP2: the root's
    gathered weights (all forward), the running layer and the next one's prefetch, and the flat
    all-gather buffer of the last group, which FSDP2 frees only after the next group's copy-out
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, `FSDPParamGroup.wait_for_unshard`)."""
    parts = {"activations": layers * sizes["layer_kept"] + sizes["head_saved"],
             "fp8_weight_copies": layers * sizes["fp8_kept"], "logits": sizes["logits"]}
    if engine == "fsdp2":
        parts["gathered_parameters"] = (sizes["root_unsharded"] + 2 * sizes["layer_unsharded"]
                                        + sizes["largest_group_unsharded"])
    return parts


def _backward(sizes: dict, layers: int, engine: str) -> dict:
    """The sweep's worse end: the last layer differentiated while every other keeps its
    tensors, or the first layer with every gradient made. Replicated: a layer's gradients are
    its full weights' gradients. FSDP2: its shard's, plus the running layer's unsharded weights
    and the prefetched next one, the running layer's unsharded gradients, the reduce-scatter
    input of the previous group (FSDP2 keeps one in flight: `reduce_scatter_max_input_buffers`
    = 1), and lm_head's unsharded gradient until the root's reduce-scatter at the end."""
    head = {} if engine == "fsdp2" else {"gradients": sizes["head_gradients"]}
    last = {"activations": (layers - 1) * sizes["layer_kept"] + sizes["layer_saved"],
            "fp8_weight_copies": (layers - 1) * sizes["fp8_kept"] + sizes["fp8_layer"],
            "gradients": head.get("gradients", 0) + sizes["layer_gradients"]}
    first = {"activations": sizes["layer_saved"], "fp8_weight_copies": sizes["fp8_layer"],
             "gradients": head.get("gradients", 0) + layers * sizes["layer_gradients"]}
    parts = max(last, first, key=lambda p: sum(p.values()))
    if engine == "fsdp2":
        parts = {**parts,
                 "gathered_parameters": sizes["root_unsharded"] + 2 * sizes["layer_unsharded"],
                 "gradient_buffers": (sizes["layer_unsharded"] + sizes["largest_group_unsharded"]
                                      + sizes["head_gradients"] + sizes["divided_gradient"])}
    return parts


def _step(sizes: dict, engine: str) -> dict:
    """After the backward pass. Replicated: `distributed.average_gradients` concatenates the
    gradients into one flat buffer per group (dense, expert); the second is made while the first
    is still referenced, so both coexist: a copy of every gradient. FSDP2: the root's reduce-
    scatter at the end of the backward pass, its unsharded gradients and their flat copy."""
    if engine == "fsdp2":
        return {"gathered_parameters": sizes["root_unsharded"],
                "gradient_buffers": 2 * sizes["root_unsharded"]}
    return {"gradient_buffers": sizes["allreduce_buffer"]}


# A GPU's capacity is not all torch's to allocate: the CUDA context, NCCL's buffers and the
# caching allocator's fragmentation take their share. 10% is an allowance, not a measurement.
RESERVE_FRACTION = 0.1


def fits(prediction: MemoryPrediction, gpu_bytes: float,
         reserve_fraction: float = RESERVE_FRACTION) -> bool:
    """Whether the predicted peak fits in `gpu_bytes` less a reserve for what torch's
    allocation count does not see."""
    if not 0 <= reserve_fraction < 1:
        raise ValueError(f"reserve_fraction={reserve_fraction} must be in [0, 1): the share of "
                         f"the GPU kept back for the CUDA context, NCCL and fragmentation")
    return prediction.peak <= gpu_bytes * (1 - reserve_fraction)


STATE = ("parameters", "gradients", "optimizer_state")  # what the layout must hold at least


# ---------------------------------------------------------------------------------------------
# Checks of the inputs: each names what is wrong and how to fix it.

def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; choose one of {ENGINES} ('single': one "
                         f"process, 'replicated': a full copy per rank, 'fsdp2': fully_shard)")


def _check_batch(config: MoEConfig, batch: int, seq_len: int) -> None:
    for name, value in (("batch", batch), ("seq_len", seq_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive whole number (sequences per "
                             f"GPU, tokens per sequence)")
    if seq_len > config.max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the config's max_seq_len="
                         f"{config.max_seq_len}, which the model refuses: use a shorter "
                         f"sequence or config.with_overrides(max_seq_len={seq_len})")


def _recipe(precision: str, arch: str) -> str | None:
    """The TE recipe `precision` (a name of `recipes.PRECISION_NAMES`) means on `arch` (None for
    bf16), by the course's own rules (`recipes.resolve` on `hardware.fake_environment(arch)`)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS} (H100/H200 or B200/B300)")
    chosen = recipes.resolve(precision, hardware.evaluate(hardware.fake_environment(arch)))
    return None if chosen.recipe is None else chosen.name


def _check_backend(backend: str, recipe: str | None, device: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown expert backend {backend!r} for the memory model; choose one "
                         f"of {BACKENDS}")
    if recipe is not None and backend not in TE_BACKENDS:
        raise ValueError(f"precision {recipe} runs the experts through TE: pass backend="
                         f"'te_ops' or 'te_grouped_linear', not {backend!r}")
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {DEVICES}")
    if device == "cpu" and (backend != "grouped_torch" or recipe is not None):
        raise ValueError("device='cpu' models the CPU run of the grouped_torch backend in bf16 "
                         "or fp32 (TE runs only on a GPU): use device='cuda' for TE backends")


def _state_itemsize(config: MoEConfig, engine: str, state_dtype: str | None) -> int:
    if state_dtype is None:
        return config.torch_dtype.itemsize
    if state_dtype not in DTYPES:
        raise ValueError(f"unknown state_dtype {state_dtype!r}; choose one of {sorted(DTYPES)}")
    if engine != "fsdp2" and state_dtype != config.dtype:
        raise ValueError(f"engine {engine!r} keeps one copy of each parameter, in the model's "
                         f"dtype ({config.dtype}), so its state cannot be {state_dtype}: use "
                         f"engine='fsdp2' (sharded {state_dtype} state, {config.dtype} compute) "
                         f"or config.with_overrides(dtype={state_dtype!r})")
    return DTYPES[state_dtype].itemsize


def _dims(config: MoEConfig) -> dict:
    return {name: getattr(config, name) for name in (
        "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
        "num_kv_heads", "num_experts", "top_k", "dtype")}
