"""`python -m moe_tutorial analyze <model>`: the course's analysis of the learner's own MoE.

A model is named by a preset (`config.PRESETS`), by a config shipped in `moe_tutorial/configs/`
(the published config.json of a MoE, no weights), or by a path: an HF `config.json` (or the
directory holding one) or a JSON file of `MoEConfig` fields. Nothing is downloaded.

    report = analyze.analyze("qwen3-moe-30b-a3b")        # a JSON-able dict (what --json writes)
    print(analyze.format_report(report))

Every number comes from the module that owns its rule:

    1 parameters       MoEConfig.parameter_counts: total, active per token, the experts' share
    2 expert GEMMs     one MoE layer's gate-up and down GEMMs at 1k, 4k and 16k tokens per GPU,
                       balanced routing (decide.tokens_per_expert, bench.ExpertShape.flops)
    3 padding          what each alignment adds (recipes.alignment, the fused MLP's rows per
                       expert; skew.padding_waste) at balanced routing and at the course's
                       skewed benchmark routing, its token copies per expert counted here
                       (`skewed_routing_splits`)
    4 fused MLP        experts.why_unfused / why_fused_raises for a Hopper and a Blackwell GPU as
                       hardware.fake_environment describes them
    5 memory           memory.predict per engine and (dp, ep) layout (distributed.layouts); memory.fits
    6 recommendation   backend, recipe, alignment, layout, each with its reason in one computed
                       sentence: on a GPU after a short sweep of the expert layer (decide.run_sweep,
                       decide.decision_map); on a CPU no sweep runs, and the arithmetic above
                       decides with the course's committed H200 map (decide.committed_map)

A config this package cannot build whole but whose MoE block it can (DeepSeek-V3: MLA attention,
dense first layers) is analysed as that block over its MoE layers
(`MoEConfig.from_hf_config(..., moe_block_only=True)`); the report lists what it leaves out.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from ..locations import package_data
from ..moe import experts, families
from ..moe.config import PRESETS, MoEConfig, preset
from ..parallel import distributed
from ..precision import hardware, recipes
from ..train.data import check_count
from . import decide, memory, results, skew, timing
from .bench import ExpertShape, make_routing
from .widgets import Table, format_value

CONFIGS_DIR = package_data("configs")
SOURCE_KEY = "_source"  # a shipped config's note on where its fields come from (not an HF field)
COMPUTE_DTYPE = "bfloat16"  # what the course trains in on a GPU
TOKENS_PER_GPU = (1024, 4096, 16384)
DEFAULT_SEQ_LEN = 4096
GPU_GIB = 140.0  # an H200's memory, the GPU size of docs/benchmarks.md's memory table
ENGINES = ("replicated", "fsdp2")  # memory.ENGINES of several GPUs
# FSDP2's shards in fp32 with bf16 compute, as the memory table of docs/benchmarks.md
FSDP2_STATE_DTYPE = "float32"
FUSED_RECIPE = "MXFP8BlockScaling"  # the fused grouped MLP's recipe on a Blackwell GPU
MAX_GPUS = 4096  # how far `fewest_gpus` looks


# ---------------------------------------------------------------------------------------------
# The model

@dataclass(frozen=True)
class Model:
    """The config under analysis, where it came from, and what the analysis leaves out.

    `moe_block_only`: the config describes one MoE block over `config.num_layers` MoE layers
    (its attention is a placeholder), so only the experts' parts are analysed."""

    name: str
    source: str
    config: MoEConfig
    moe_block_only: bool = False
    out_of_scope: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # how the input was read where it was not taken as it is


def shipped_configs() -> list[str]:
    """The names of the configs shipped in `moe_tutorial/configs/`."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def load_model(spec: str) -> Model:
    """The model `spec` names: a preset, a shipped config, or the path of an HF config.json (or
    its directory) or of a JSON of MoEConfig fields. A ValueError says what is wrong with it and
    what to give instead."""
    if spec in PRESETS:
        return _from_preset(spec)
    shipped = CONFIGS_DIR / f"{spec}.json"
    path = shipped if shipped.is_file() else Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"{spec!r} is no preset, shipped config or file ({path} does not exist): "
                         f"give a preset ({', '.join(sorted(PRESETS))}), a shipped config "
                         f"({', '.join(shipped_configs())}), or the path of an HF config.json "
                         f"(or its directory) or of a JSON file of MoEConfig fields")
    fields = _read_json(path)
    source = str(path)
    if "model_type" in fields:
        return _from_hf_fields(spec, source, fields)
    return _from_moe_config_fields(spec, source, fields)


def _from_preset(name: str) -> Model:
    config = preset(name)
    notes = () if config.dtype == COMPUTE_DTYPE else (
        f"the preset's dtype {config.dtype} is analysed as {COMPUTE_DTYPE}, what the course "
        f"trains in on a GPU",)
    return Model(name, f"config.PRESETS[{name!r}]", config.with_overrides(dtype=COMPUTE_DTYPE),
                 notes=notes)


def _read_json(path: Path) -> dict:
    try:
        fields = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}, column "
                         f"{exc.colno}): fix it, or give an HF config.json or a JSON file of "
                         f"MoEConfig fields") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} cannot be read ({exc}): give a readable JSON file") from None
    if not isinstance(fields, dict):
        raise ValueError(f"{path} holds a JSON {type(fields).__name__}, not an object: give an HF "
                         f"config.json or a JSON object of MoEConfig fields")
    return fields


def _from_moe_config_fields(spec: str, source: str, fields: dict) -> Model:
    known = {f.name for f in dataclasses.fields(MoEConfig)}
    unknown = sorted(set(fields) - known - {SOURCE_KEY})
    if unknown:
        raise ValueError(f"{source} has field(s) {unknown} that MoEConfig does not (its fields: "
                         f"{sorted(known)}); an HF config.json is recognised by its model_type")
    given = {name: value for name, value in fields.items() if name in known}
    return Model(spec, source, MoEConfig(**{"dtype": COMPUTE_DTYPE, **given}))


def _from_hf_fields(spec: str, source: str, fields: dict) -> Model:
    """An HF config.json read through its transformers config class. The whole model where this
    package builds it; else its MoE block over its MoE layers, with what is left out."""
    model_type = fields["model_type"]
    try:
        families.family_of(SimpleNamespace(model_type=model_type))
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    hf = _hf_config(source, model_type, fields)
    architectures = fields.get("architectures")
    name = architectures[0] if isinstance(architectures, list) and architectures else model_type
    try:
        config = MoEConfig.from_hf_config(hf, dtype=COMPUTE_DTYPE)
        return Model(f"{spec} ({name})", source, config)
    except ValueError as whole:
        refusal = whole
    try:
        block = MoEConfig.from_hf_config(hf, dtype=COMPUTE_DTYPE, moe_block_only=True)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    in_block = families.unsupported_hf_options(hf, moe_block_only=True)
    left_out = [o for o in families.unsupported_hf_options(hf) if o not in in_block]
    layers = moe_layer_count(hf)
    out_of_scope = [f"not built here: {reason}" for reason in left_out or [str(refusal)]] + [
        f"analysed: the routed experts of the MoE block in the {layers} MoE layers of "
        f"{hf.num_hidden_layers}; not analysed: the attention, the embeddings, any dense MLP "
        f"layers and any shared expert (a dense MLP beside the routed experts, outside their "
        f"grouped GEMMs), so there is no whole-model parameter total, active count or memory"]
    return Model(f"{spec} ({name}, MoE block)", source, block.with_overrides(num_layers=layers),
                 moe_block_only=True, out_of_scope=tuple(out_of_scope))


def _hf_config(source: str, model_type: str, fields: dict):
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{source} is an HF config.json: reading it needs transformers "
                         f"(pip install 'moe_tutorial[hf]')") from None
    kwargs = {k: v for k, v in fields.items() if k not in ("model_type", SOURCE_KEY)}
    try:
        return transformers.AutoConfig.for_model(model_type, **kwargs)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ValueError(f"{source}: transformers cannot build a {model_type} config from it "
                         f"({exc}); check the fields against the model's published "
                         f"config.json") from None


def moe_layer_count(hf) -> int:
    """How many layers of an HF model hold a MoE block, by its family's modeling code:
    DeepSeek-V3's first `first_k_dense_replace` layers have a dense MLP; Qwen's layers in
    `mlp_only_layers` or off the `decoder_sparse_step` grid do; every other family's layers are
    all MoE layers."""
    layers = range(hf.num_hidden_layers)
    if hf.model_type == "deepseek_v3":
        return sum(i >= hf.first_k_dense_replace for i in layers)
    if hf.model_type in ("qwen3_moe", "qwen2_moe"):
        return sum(i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0
                   for i in layers)
    return hf.num_hidden_layers


# ---------------------------------------------------------------------------------------------
# 1-4: parameters, the expert GEMMs, padding, the fused grouped MLP's conditions

def parameters(model: Model) -> dict:
    """The parameter counts of `MoEConfig.parameter_counts`, and the routed experts' share. The
    active experts are top_k of num_experts in every MoE layer. A MoE block alone has no
    whole-model counts (its attention is a placeholder)."""
    config = model.config
    counts = config.parameter_counts()
    active_experts = counts["expert"] * config.top_k // config.num_experts
    out = {"experts": counts["expert"], "experts_active_per_token": active_experts}
    if not model.moe_block_only:
        out.update(total=counts["total"], dense=counts["dense"],
                   active_per_token=counts["active_per_token"],
                   experts_share_of_total=counts["expert"] / counts["total"],
                   experts_share_of_active=active_experts / counts["active_per_token"])
    return out


def expert_shape(config: MoEConfig, tokens: int) -> ExpertShape:
    """One MoE layer's expert problem at `tokens` tokens per GPU (all experts local)."""
    return ExpertShape(f"t{tokens}", tokens, config.hidden_size, config.intermediate_size,
                       config.num_experts, config.top_k)


def expert_gemms(config: MoEConfig, tokens_per_gpu=TOKENS_PER_GPU) -> list[dict]:
    """Per token count: the rows each expert gets at balanced routing and the two grouped GEMMs
    each expert runs, gate-up [rows, H] x [H, 2I] and down [rows, I] x [I, H], with one layer's
    expert FLOPs (forward + backward)."""
    h, i = config.hidden_size, config.intermediate_size
    out = []
    for tokens in tokens_per_gpu:
        shape = expert_shape(config, tokens)
        rows = decide.tokens_per_expert(shape)
        out.append({"tokens_per_gpu": tokens, "rows_per_expert": rows,
                    "gate_up": [[rows, h], [h, 2 * i]], "down": [[rows, i], [i, h]],
                    "flops_per_layer": shape.flops()})
    return out


def alignments() -> dict[int, str]:
    """The rows-per-expert multiples the course's paths pad to, and who asks for each
    (TE's rule, `recipes.alignment`, and the fused grouped MLP's kernel)."""
    return {recipes.alignment("DelayedScaling"): "FP8 recipes (TE's rule)",
            recipes.alignment(FUSED_RECIPE): "MXFP8 (TE's rule)",
            recipes.alignment("NVFP4BlockScaling"): "NVFP4 (TE's rule)",
            experts.FUSED_MLP_ROWS_PER_EXPERT: "fused grouped MLP (cuDNN kernel)"}


def skewed_routing_splits(config: MoEConfig, tokens: int) -> list[int]:
    """Token copies per expert (the `m_splits` before padding) of the course's skewed benchmark
    routing (`bench.make_routing(shape, "skewed")`: router logits with a Zipf-like bias) on this
    model's experts and top-k, counted. Counted, not summarised by one hot expert: with top-8 of
    128 experts nearly every token picks the hottest one, while the tail decides the padding."""
    _, indices = make_routing(expert_shape(config, tokens), "skewed")
    return torch.bincount(indices.flatten(), minlength=config.num_experts).tolist()


def balanced_splits(config: MoEConfig, tokens: int) -> list[int]:
    """Token copies per expert at balanced routing (`skew.skewed_splits` at skew 0)."""
    return skew.skewed_splits(tokens, config.num_experts, config.top_k, 0.0)


def load_imbalance(splits: list[int]) -> float:
    """The hottest expert's token copies over the mean (1.0: balanced)."""
    return max(splits) * len(splits) / sum(splits)


def padding_fractions(splits: list[int]) -> dict[int, float]:
    """Per alignment of `alignments()`: the share of the grouped GEMMs' rows that are padding
    (`skew.padding_waste`) with these token copies per expert."""
    return {align: waste["fraction"]
            for align, waste in skew.padding_waste(splits, tuple(alignments())).items()}


def padding_at(config: MoEConfig, tokens: int) -> tuple[dict[int, float], dict[int, float], float]:
    """At `tokens` tokens per GPU: the padding shares per alignment at balanced and at the
    course's skewed routing, and that skewed routing's load imbalance (hottest over mean)."""
    skewed_splits = skewed_routing_splits(config, tokens)
    return (padding_fractions(balanced_splits(config, tokens)), padding_fractions(skewed_splits),
            load_imbalance(skewed_splits))


def padding(config: MoEConfig, tokens_per_gpu=TOKENS_PER_GPU) -> list[dict]:
    """Per token count: the skewed routing's load imbalance (hottest expert over the mean), and
    per alignment the padding share at balanced and at skewed routing."""
    rows = []
    for tokens in tokens_per_gpu:
        balanced, skewed, imbalance = padding_at(config, tokens)
        rows.append({"tokens_per_gpu": tokens, "skewed_max_over_mean": imbalance,
                     "alignments": [{"align": a, "for": who, "balanced": balanced[a],
                                     "skewed": skewed[a]} for a, who in alignments().items()]})
    return rows


def arch_capabilities(arch: str) -> hardware.Capabilities:
    """The course's capability table of a GPU of `arch` ("hopper": H200, "blackwell": B200 with
    TE and the fused MLP enabled), as `hardware.fake_environment` describes it."""
    return hardware.evaluate(hardware.fake_environment(arch))


def fused_conditions(config: MoEConfig, tokens_per_gpu=TOKENS_PER_GPU) -> dict:
    """Which of the fused grouped MLP's conditions this model meets: the shape conditions
    (`experts.why_unfused` on a Blackwell GPU under MXFP8, where only they can fail), per arch
    everything that keeps TE's fuser from fusing with the recipe `recipes.resolve("fp8")` picks there,
    and per token count whether MXFP8's own padding of balanced rows already satisfies the fused
    kernel's row rules (`experts.why_fused_raises`; if not, te_ops pads to
    `experts.FUSED_MLP_ROWS_PER_EXPERT`, section 3's last column)."""
    h, i = config.hidden_size, config.intermediate_size
    interleave = experts.FUSED_MLP_GLU_INTERLEAVE
    shape_reasons = experts.why_unfused(arch_capabilities("blackwell"), FUSED_RECIPE, interleave,
                                        h, i)
    archs = {}
    for arch in memory.ARCHS:
        caps = arch_capabilities(arch)
        recipe = recipes.resolve("fp8", caps).name
        reasons = experts.why_unfused(caps, recipe, interleave, h, i)
        archs[arch] = {"gpu": caps.env.gpu_name, "recipe": recipe, "fuses": not reasons,
                       "why_not": [r for r in reasons if r not in shape_reasons]}
    align = recipes.alignment(FUSED_RECIPE)
    rows = [{"tokens_per_gpu": tokens, "align": align,
             "why_fused_raises": experts.why_fused_raises(skew.padded_splits(
                 skew.skewed_splits(tokens, config.num_experts, config.top_k, 0.0), align))}
            for tokens in tokens_per_gpu]
    return {"glu_interleave_size": interleave, "shape_reasons": shape_reasons, "archs": archs,
            "rows": rows}


# ---------------------------------------------------------------------------------------------
# 5: memory per GPU

def layouts(config: MoEConfig, gpus: int) -> list[tuple[str, int, int]]:
    """(engine, dp, ep) of every layout of `gpus` GPUs the course trains with: replicated and
    FSDP2, every (dp, ep) whose ep divides the experts (`distributed.layouts`)."""
    return [(engine, dp, ep) for engine in ENGINES
            for dp, ep in distributed.layouts(gpus, config.num_experts)]


def experts_only_prediction(config: MoEConfig, *, batch: int, seq_len: int, dp: int, ep: int,
                            engine: str) -> memory.MemoryPrediction:
    """What one GPU holds of the experts alone (bf16), for a config of a MoE block whose other
    parts are out of scope: the experts' share of the training state (`memory.training_state`,
    in the proportion of `memory.parameters_per_rank`) and every MoE layer's saved expert
    tensors (`memory.saved_activations`' "experts"), at the forward moment (state without
    gradients, every layer's saved tensors) and the step moment (state with gradients)."""
    state_dtype = FSDP2_STATE_DTYPE if engine == "fsdp2" else None
    per_rank = memory.parameters_per_rank(config, dp, ep, engine)
    state = memory.training_state(config, dp, ep, engine, state_dtype)
    share = per_rank["expert"] / per_rank["total"]
    held = {part: round(state[part] * share) for part in ("parameters", "optimizer_state")}
    saved = memory.saved_activations(config, batch=batch, seq_len=seq_len, ep=ep,
                                     backend=memory.TABLE_BACKEND)
    activations = config.num_layers * round(sum(saved["experts"].values()))
    settings = {"batch": batch, "seq_len": seq_len, "dp": dp, "ep": ep, "engine": engine,
                "precision": "bf16", "recipe": None, "backend": memory.TABLE_BACKEND,
                "state_dtype": state_dtype or config.dtype, "experts_only": True}
    return memory.MemoryPrediction(settings, {
        "forward": {**held, "activations": activations},
        "step": {**held, "gradients": round(state["gradients"] * share)}}, {})


def predict(model: Model, engine: str, dp: int, ep: int, *, batch: int, seq_len: int,
            precision: str = "bf16", backend: str = memory.TABLE_BACKEND,
            arch: str = "hopper") -> memory.MemoryPrediction:
    """`memory.predict` of one layout (FSDP2 with fp32 state), or for a MoE block alone the
    experts' part (bf16)."""
    if model.moe_block_only:
        return experts_only_prediction(model.config, batch=batch, seq_len=seq_len, dp=dp, ep=ep,
                                       engine=engine)
    return memory.predict(model.config, batch=batch, seq_len=seq_len, dp=dp, ep=ep,
                          engine=engine, precision=precision, backend=backend, arch=arch,
                          state_dtype=FSDP2_STATE_DTYPE if engine == "fsdp2" else None)


def memory_rows(model: Model, *, batch: int, seq_len: int, gpus: int, gpu_bytes: float,
                **step) -> list[dict]:
    """One row per layout of `gpus` GPUs: the peak, its moment, the training state's part of it,
    and whether it fits `gpu_bytes` (`memory.fits`, with its reserve). `step`: precision,
    backend and arch for `predict` (default: bf16, te_ops experts)."""
    rows = []
    for engine, dp, ep in layouts(model.config, gpus):
        p = predict(model, engine, dp, ep, batch=batch, seq_len=seq_len, **step)
        at_peak = p.phases[p.peak_phase]
        rows.append({"engine": engine, "dp": dp, "ep": ep, "layout": f"{engine} dp{dp}×ep{ep}",
                     "state_dtype": p.settings["state_dtype"], "peak_bytes": p.peak,
                     "peak_phase": p.peak_phase,
                     "state_bytes": sum(at_peak.get(k, 0) for k in memory.STATE),
                     "fits": memory.fits(p, gpu_bytes),
                     "spare_bytes": gpu_bytes * (1 - memory.RESERVE_FRACTION) - p.peak})
    return rows


# ---------------------------------------------------------------------------------------------
# 6: the recommendation

def committed_verdicts() -> tuple[dict | None, str]:
    """The course's committed H200 decision map (`decide.committed_map`) and how to cite it, or
    (None, why not) where the result file is absent (an installed package has no benchmarks/)."""
    try:
        return decide.committed_map(), "the committed H200 sweep"
    except ValueError as exc:
        return None, f"no committed sweep to apply ({exc})"


def run_sweep(config: MoEConfig, caps: hardware.Capabilities, *, device: str = "cuda",
              tokens_per_gpu=TOKENS_PER_GPU) -> list[dict]:
    """The decision sweep (`decide.run_sweep`: the loop, the grouped layer, te_ops and FP8,
    forward + backward, each checked against the loop) on this model's expert layer at each
    token count, with a progress bar."""
    from tqdm.auto import tqdm

    shapes = [expert_shape(config, tokens) for tokens in tokens_per_gpu]
    bar = tqdm(total=len(shapes) * len(decide.sweep_variants(caps, device)),
               desc="expert-layer sweep", unit="run")

    def progress(done, total, row):
        bar.set_postfix_str(f"{row['shape']} {row['variant']}: {row['status']}")
        bar.update(1)

    try:
        return decide.run_sweep(shapes, device=device, caps=caps, progress=progress)
    finally:
        bar.close()


def paid_at(verdict: decide.Verdict, size: float) -> bool | None:
    """Whether a technique pays at `size` of its quantity by the map's verdict (None where the
    map cannot say: mixed, or not measurable). Beyond the measured sizes the verdict's side of
    its threshold holds."""
    if verdict.kind == "always":
        return True
    if verdict.kind in ("never", "even"):
        return False
    if verdict.kind == "from":
        return size >= verdict.threshold
    if verdict.kind == "up_to":
        return size <= verdict.threshold
    return None


def _speedups(values) -> str:
    low, high = min(values), max(values)
    return f"{low:.2f}×" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}–{high:.2f}×"


def evidence(verdict: decide.Verdict, size: float, source: str) -> str:
    """How a verdict of the map reads at this model's `size`, for a reason sentence."""
    t = verdict.technique
    here = f"this model has {decide.format_size(size, t.quantity)} {t.quantity}"
    if verdict.kind == "not measurable":
        return f"could not be measured in {source} ({verdict.reason})"
    every = _speedups(verdict.speedups.values())
    if verdict.kind in ("from", "up_to"):
        above = verdict.kind == "from"
        inside = [s for shape, s in verdict.speedups.items()
                  if (verdict.sizes[shape] >= verdict.threshold) == above]
        outside = [s for s in verdict.speedups.values() if s not in inside]
        return (f"paid in {source} only {'from' if above else 'up to'} "
                f"{decide.format_size(verdict.threshold, t.quantity)} {t.quantity} "
                f"({_speedups(inside)} vs {t.versus}"
                + (f"; {_speedups(outside)} {'below' if above else 'above'})" if outside else ")")
                + f", and {here}")
    described = {"always": f"paid on every shape of {source} ({every} vs {t.versus})",
                 "never": f"paid on no shape of {source} ({every} vs {t.versus})",
                 "even": f"was within {decide.LOSES:g}–{decide.PAYS:g}× of {t.versus} on every "
                         f"shape of {source} ({every})",
                 "mixed": f"paid on {len(verdict.pays)} of {len(verdict.speedups)} shapes of "
                          f"{source} with no single threshold ({every} vs {t.versus})"}
    return described[verdict.kind] + f"; {here}"


def _judge(verdicts: dict | None, key: str, size: float, source: str) -> tuple[bool | None, str]:
    """(does technique `key` pay at `size`, the evidence) from the map, or (None, why not)."""
    if verdicts is None:
        return None, source
    return paid_at(verdicts[key], size), evidence(verdicts[key], size, source)


def _backend(config, caps, verdicts, source, width) -> tuple[str, str]:
    """The expert backend by the map: the loop where grouping did not pay; else te_ops where it
    paid over GroupedLinear at this width, GroupedLinear otherwise (TE's, where TE runs)."""
    grouping, grouping_evidence = _judge(verdicts, "grouped_gemm", config.num_experts, source)
    not_fused = f"the fused grouped MLP does not run on {caps.env.gpu_name or 'a CPU'} (section 4)"
    if grouping is False:
        return "naive", f"naive: grouping {grouping_evidence}; {not_fused}"
    if not caps.is_native("te_grouped_linear"):
        return "grouped_torch", (f"grouped_torch: grouping {grouping_evidence}; TE's backends do "
                                 f"not run here ({caps['te_grouped_linear'].reason}); {not_fused}")
    te_ops, te_ops_evidence = _judge(verdicts, "te_ops", width, source)
    choice = "te_ops" if te_ops else "te_grouped_linear"
    return choice, (f"{choice}: grouping {grouping_evidence}; te.ops over GroupedLinear "
                    f"{te_ops_evidence}; {not_fused}")


def bf16_default_path(hidden_size: int, intermediate_size: int, backend: str) -> str | None:
    """The course's default path (`experts.default_backend`) that replaces TE grouped layer
    `backend` for bf16 experts of this size on a GPU with TE, or None where it keeps `backend`
    (a larger expert, or a backend that is not one of TE's)."""
    if backend not in experts.TE_BACKENDS:
        return None
    pick = experts.default_backend(hidden_size, intermediate_size, fp8=False, te_on_gpu=True)
    return None if pick in experts.TE_BACKENDS else pick


def _bf16_backend(config, caps, backend, reason) -> tuple[str, str]:
    """Where the experts train in bf16 on a Hopper with TE, the course's default path for their
    size (`bf16_default_path`): TE's permutation around `torch._grouped_mm` for small experts.
    That rule comes from the H200 run and the sweep does not time it, so it is applied on Hopper
    only and the reason says where the evidence lies."""
    hopper = (caps.env.compute_capability or (0, 0))[0] == 9
    pick = bf16_default_path(config.hidden_size, config.intermediate_size, backend)
    if pick is None or not hopper:
        return backend, reason
    elements = config.hidden_size * config.intermediate_size
    return pick, (f"{pick}: in bf16, experts of {config.hidden_size} × "
                  f"{config.intermediate_size} = {elements:,} weights per projection (at most "
                  f"experts.SMALL_EXPERT_ELEMENTS = {experts.SMALL_EXPERT_ELEMENTS:,}) ran "
                  f"fastest with TE's permutation around torch._grouped_mm in the course's H200 "
                  f"run (experts.default_backend; benchmarks/results/h200.json), which the sweep "
                  f"does not time; among TE's grouped layers the map picked {reason}")


def _recipe(caps, verdicts, source, width, backend) -> tuple[str | None, str]:
    """The recipe by the map: the one `recipes.resolve("fp8", caps)` picks where FP8 paid
    at this width and TE runs it natively under a TE backend; else bf16 (None)."""
    choice = recipes.resolve("fp8", caps)
    if not choice.native or backend not in experts.TE_BACKENDS:
        why = choice.reason if not choice.native else f"the {backend} backend runs no TE recipe"
        return None, f"bf16 (no recipe): {why}"
    fp8, fp8_evidence = _judge(verdicts, "fp8", width, source)
    if fp8:
        return choice.name, f"{choice.name}: FP8 {fp8_evidence}; the fastest FP8 recipe here"
    return None, f"bf16 (no recipe): FP8 {fp8_evidence}"


def _alignment(config, recipe, fused, tokens) -> tuple[int, str]:
    """The rows per expert the chosen path pads to, and what that padding costs."""
    if fused:
        align, rule = experts.FUSED_MLP_ROWS_PER_EXPERT, "the fused kernel's rows per expert"
    else:
        align, rule = recipes.alignment(recipe), f"TE's rule for {recipe}"
    if align == 1:
        return 1, "1 (no padding): bf16 grouped GEMMs take any number of rows per expert"
    balanced, skewed, imbalance = padding_at(config, tokens)
    return align, (f"{align} rows per expert ({rule}): the padding is {balanced[align]:.1%} of "
                   f"the grouped GEMMs' rows at balanced routing and {skewed[align]:.1%} at the "
                   f"course's skewed routing (hottest expert {imbalance:.1f}× the mean load), "
                   f"with {tokens:,} tokens per GPU")


def fewest_gpus(model: Model, *, batch: int, seq_len: int, gpu_bytes: float, start: int,
                **step) -> dict | None:
    """The smallest power-of-two multiple of `start` GPUs with a layout that fits (`step` as in
    `memory_rows`), and that layout (the one with the lowest peak), or None up to `MAX_GPUS`."""
    gpus = start * 2
    while gpus <= MAX_GPUS:
        fitting = [r for r in memory_rows(model, batch=batch, seq_len=seq_len, gpus=gpus,
                                          gpu_bytes=gpu_bytes, **step) if r["fits"]]
        if fitting:
            return {"gpus": gpus, **min(fitting, key=lambda r: r["peak_bytes"])}
        gpus *= 2
    return None


def bytes_sent(config: MoEConfig, tokens: int, dp: int, ep: int) -> dict:
    """What one GPU's collectives send in a step (`distributed.communication_per_step`): the
    all-to-all that leaves the GPU and the ring all-reduce of the gradients."""
    c = distributed.communication_per_step(config, tokens, dp, ep)
    sent = {"all_to_all": c["all_to_all_remote_bytes"], "allreduce": c["allreduce_sent_bytes"]}
    return {**sent, "total": sum(sent.values())}


def _gib(nbytes: float) -> str:
    return f"{format_value(memory.gib(nbytes))} GiB"


def _gb(nbytes: float) -> str:
    return f"{format_value(nbytes / 1e9)} GB"


def _layout(model, *, batch, seq_len, gpus, gpu_bytes, **step) -> tuple[str | None, str]:
    """The layout: of those that fit, the one whose collectives send the fewest bytes per GPU
    (replicated before FSDP2 at the same (dp, ep): FSDP2 adds the weights' all-gathers to the
    same gradient reduction). None where none fits (then how many GPUs would do), or for a MoE
    block alone, whose other parts decide."""
    rows = memory_rows(model, batch=batch, seq_len=seq_len, gpus=gpus, gpu_bytes=gpu_bytes,
                       **step)
    fitting = [r for r in rows if r["fits"]]
    usable = memory.gib(gpu_bytes * (1 - memory.RESERVE_FRACTION))
    where = f"{gpus} GPUs of {memory.gib(gpu_bytes):.0f} GiB ({usable:.0f} usable)"
    what = "the experts alone" if model.moe_block_only else "the step"
    if not fitting:
        lowest = min(rows, key=lambda r: r["peak_bytes"])
        more = fewest_gpus(model, batch=batch, seq_len=seq_len, gpu_bytes=gpu_bytes, start=gpus,
                           **step)
        fix = (f"{more['gpus']} GPUs would hold it ({more['layout']}: "
               f"{_gib(more['peak_bytes'])})" if more else
               f"no layout of up to {MAX_GPUS} GPUs holds it")
        return None, (f"none: no layout of {where} holds {what} (lowest peak "
                      f"{_gib(lowest['peak_bytes'])}, {lowest['layout']}); {fix}")
    if model.moe_block_only:
        return None, (f"not chosen: the experts alone fit {len(fitting)} of the {len(rows)} "
                      f"layouts of {where} (e.g. {fitting[0]['layout']}, "
                      f"{_gib(fitting[0]['peak_bytes'])}), but the parts out of scope decide")
    tokens = batch * seq_len
    sent = {(r["dp"], r["ep"]): bytes_sent(model.config, tokens, r["dp"], r["ep"])
            for r in fitting}
    best = min(fitting, key=lambda r: (sent[r["dp"], r["ep"]]["total"],
                                       r["engine"] != "replicated"))
    s = sent[best["dp"], best["ep"]]
    return best["layout"], (
        f"{best['layout']}: of the {len(fitting)} of {len(rows)} layouts of {where} that fit, it "
        f"sends the fewest bytes per GPU per step ({_gb(s['total'])}: all-to-all "
        f"{_gb(s['all_to_all'])}, gradient all-reduce {_gb(s['allreduce'])}; "
        f"distributed.communication_per_step) and peaks at {_gib(best['peak_bytes'])} "
        f"({best['peak_phase']} moment; with the recommended {step.get('backend', 'te_ops')} "
        f"experts in {step.get('precision', 'bf16')}, where section 5 assumes te_ops in bf16)")


def memory_arch(caps: hardware.Capabilities) -> str:
    """The arch whose FP8 storage rules `memory.predict` applies to this GPU."""
    return "blackwell" if (caps.env.compute_capability or (0, 0))[0] == 10 else "hopper"


def recommend(model: Model, caps: hardware.Capabilities, *, arch: str, verdicts: dict | None,
              source: str, batch: int, seq_len: int, gpus: int, gpu_bytes: float) -> list[dict]:
    """Backend, recipe, alignment and layout for a machine `caps` describes, each with its reason
    in one sentence. Where the fused grouped MLP's conditions all hold (section 4), its path:
    te_ops under MXFP8, padded to its rows per expert. Elsewhere the decision map `verdicts`
    (decide.decision_map, measured in `source`) judged at this model's sizes: its expert count,
    and the rows × hidden each expert gets at `batch` × `seq_len` tokens per GPU; where that
    leaves the experts in bf16 on TE's grouped layers on a Hopper, the course's default path for
    their size (`_bf16_backend`)."""
    config = model.config
    tokens = batch * seq_len
    width = decide.tokens_per_expert(expert_shape(config, tokens)) * config.hidden_size
    fused_missing = experts.why_unfused(caps, FUSED_RECIPE, experts.FUSED_MLP_GLU_INTERLEAVE,
                                        config.hidden_size, config.intermediate_size)
    if fused_missing:
        backend, backend_reason = _backend(config, caps, verdicts, source, width)
        recipe, recipe_reason = _recipe(caps, verdicts, source, width, backend)
        if recipe is None:
            backend, backend_reason = _bf16_backend(config, caps, backend, backend_reason)
    else:
        fp8 = (f"; FP8 without the fusion {_judge(verdicts, 'fp8', width, source)[1]}"
               if verdicts else "")
        backend, recipe = "te_ops", FUSED_RECIPE
        backend_reason = (f"te_ops, fused: on {caps.env.gpu_name} every condition of the fused "
                          f"CuTe-DSL grouped MLP holds for hidden {config.hidden_size} and "
                          f"intermediate {config.intermediate_size}, so FC1, SwiGLU and the "
                          f"routing-weight scale run as one kernel (not timed by this analysis)")
        recipe_reason = (f"{FUSED_RECIPE}: the recipe the fused kernel takes (E4M3 both ways), "
                         f"native on {caps.env.gpu_name}{fp8}")
    align, align_reason = _alignment(config, recipe, not fused_missing, tokens)
    layout, layout_reason = _layout(
        model, batch=batch, seq_len=seq_len, gpus=gpus, gpu_bytes=gpu_bytes,
        precision=recipe or "bf16", arch=arch,
        backend=backend if backend in memory.BACKENDS else "grouped_torch")
    return [{"item": "backend", "choice": backend, "reason": backend_reason},
            {"item": "recipe", "choice": recipe or "bf16", "reason": recipe_reason},
            {"item": "alignment", "choice": align, "reason": align_reason},
            {"item": "layout", "choice": layout, "reason": layout_reason}]


def recommendation(model: Model, *, sweep: bool | None, batch: int, seq_len: int, gpus: int,
                   gpu_bytes: float) -> dict:
    """On a GPU: the sweep of this model's expert layer (unless `sweep` is False), its decision
    map and the recommendation for this GPU. On a CPU no sweep runs: a recommendation per arch
    (Hopper, Blackwell) from the arithmetic, with the committed H200 map (`committed_verdicts`)
    where a measurement is needed; a GPU without a sweep uses that map too."""
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        caps = hardware.capabilities()
        machines = {caps.env.gpu_name: (caps, memory_arch(caps))}
    else:
        machines = {arch: (arch_capabilities(arch), arch) for arch in memory.ARCHS}
    if on_gpu and sweep is not False:
        rows = run_sweep(model.config, caps)
        verdicts, source = decide.decision_map(rows), f"this sweep on {caps.env.gpu_name}"
        summary = {"ran": True, "rows": rows,
                   "rule": decide.decision_rule(verdicts, caps.env.gpu_name, see_also="")}
    else:
        verdicts, source = committed_verdicts()
        why = ("the sweep was turned off (--no-sweep, or sweep=False)" if on_gpu else
               "this machine has no CUDA GPU (torch.cuda.is_available() is False), and the "
               "expert layer timed on a CPU says nothing about a GPU; run this command on the "
               "GPU to measure")
        cited = source if verdicts is None else f"{source} ({results.H200})"
        summary = {"ran": False, "why_not": why, "verdicts_from": cited}
    tokens = batch * seq_len
    return {"sweep": summary,
            "judged_at": f"{tokens:,} tokens per GPU ({batch} × {seq_len}), every expert on one "
                         f"GPU (ep 1: expert parallelism over ep GPUs gives each expert ep times "
                         f"the rows)",
            "machines": {name: recommend(model, caps, arch=arch, verdicts=verdicts, source=source,
                                         batch=batch, seq_len=seq_len, gpus=gpus,
                                         gpu_bytes=gpu_bytes)
                         for name, (caps, arch) in machines.items()}}


# ---------------------------------------------------------------------------------------------
# The report

# How the command line spells check_arguments' settings (the API names them as arguments).
FLAG_NAMES = {"batch": "--batch", "seq_len": "--seq-len", "gpus": "--gpus", "gpu_gib": "--gpu-gib"}


def check_arguments(spec: str, *, batch: int, seq_len: int | None, gpus: int,
                    gpu_gib: float, names: dict[str, str] | None = None) -> Model:
    """The model `spec` names, with the settings checked against it (what the command line runs
    before any work): a ValueError names what is wrong and how to fix it. `names`: how the
    caller spells each setting (`FLAG_NAMES` on the command line; default: the arguments')."""
    name = (names or {}).get
    check_count(name("batch", "batch"), batch)
    check_count(name("gpus", "gpus"), gpus)
    if seq_len is not None:
        check_count(name("seq_len", "seq_len"), seq_len)
    if isinstance(gpu_gib, bool) or not isinstance(gpu_gib, (int, float)) \
            or not (math.isfinite(gpu_gib) and gpu_gib > 0):
        raise ValueError(f"{name('gpu_gib', 'gpu_gib')}={gpu_gib!r} must be a number > 0: each "
                         f"GPU's memory in GiB (an H200 has {GPU_GIB:g})")
    model = load_model(spec)
    if seq_len is not None and seq_len > model.config.max_seq_len:
        raise ValueError(f"{name('seq_len', 'seq_len')}={seq_len} exceeds {model.name}'s max_seq_len="
                         f"{model.config.max_seq_len}: give at most that")
    return model


def analyze(spec: str, *, batch: int = 1, seq_len: int | None = None, gpus: int = 8,
            gpu_gib: float = GPU_GIB, sweep: bool | None = None) -> dict:
    """The whole analysis of the model `spec` names (module doc), as a JSON-able dict. `seq_len`
    defaults to the smaller of DEFAULT_SEQ_LEN and the model's max_seq_len; `sweep` None runs
    the sweep where there is a GPU."""
    model = check_arguments(spec, batch=batch, seq_len=seq_len, gpus=gpus, gpu_gib=gpu_gib)
    config = model.config
    seq_len = seq_len or min(DEFAULT_SEQ_LEN, config.max_seq_len)
    gpu_bytes = gpu_gib * 2**30
    settings = {"batch": batch, "seq_len": seq_len, "gpus": gpus, "gpu_gib": gpu_gib,
                "tokens_per_gpu": list(TOKENS_PER_GPU)}
    return {
        "model": {"name": model.name, "source": model.source, "config": dataclasses.asdict(config),
                  "moe_block_only": model.moe_block_only},
        "scope": {"out_of_scope": list(model.out_of_scope), "notes": list(model.notes)},
        "settings": settings, "environment": timing.environment(),
        "parameters": parameters(model),
        "expert_gemms": expert_gemms(config),
        "padding": padding(config),
        "fused_grouped_mlp": fused_conditions(config),
        "memory": {"precision": "bf16", "backend": memory.TABLE_BACKEND,
                   "reserve_fraction": memory.RESERVE_FRACTION,
                   "experts_only": model.moe_block_only,
                   "rows": memory_rows(model, batch=batch, seq_len=seq_len, gpus=gpus,
                                       gpu_bytes=gpu_bytes)},
        "recommendation": recommendation(model, sweep=sweep, batch=batch, seq_len=seq_len,
                                         gpus=gpus, gpu_bytes=gpu_bytes),
    }


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _parameters_text(report: dict) -> str:
    p = report["parameters"]
    rows = [["experts", _count(p["experts"]), "every MoE layer's routed experts"],
            ["experts active per token", _count(p["experts_active_per_token"]),
             "top_k of num_experts in each MoE layer"]]
    if "total" in p:
        rows = [["total", _count(p["total"]), "parameter_counts()['total']"],
                ["active per token", _count(p["active_per_token"]),
                 "what a token multiplies with (not the embedding lookup, not the norms)"],
                *rows,
                ["experts' share", f"{p['experts_share_of_total']:.1%}", "of the total"],
                ["experts' share active", f"{p['experts_share_of_active']:.1%}",
                 "of the active per token"]]
    return str(Table(["", "parameters", "what"], rows,
                     title="1. Parameters (MoEConfig.parameter_counts)"))


def _gemms_text(report: dict) -> str:
    rows = [[g["tokens_per_gpu"], g["rows_per_expert"],
             f"[{g['gate_up'][0][0]:g}, {g['gate_up'][0][1]}] x [{g['gate_up'][1][0]}, "
             f"{g['gate_up'][1][1]}]",
             f"[{g['down'][0][0]:g}, {g['down'][0][1]}] x [{g['down'][1][0]}, {g['down'][1][1]}]",
             g["flops_per_layer"] / 1e12] for g in report["expert_gemms"]]
    return str(Table(["tokens/GPU", "rows/expert", "gate-up per expert", "down per expert",
                      "TFLOP/layer fwd+bwd"], rows,
                     title="2. Expert GEMMs of one MoE layer, balanced routing (all experts on "
                           "one GPU)"))


def _padding_text(report: dict) -> str:
    first = report["padding"][0]["alignments"]
    rows = [[p["tokens_per_gpu"], f"{p['skewed_max_over_mean']:.1f}×"]
            + [f"{a['balanced']:.1%} / {a['skewed']:.1%}" for a in p["alignments"]]
            for p in report["padding"]]
    return str(Table(["tokens/GPU", "skewed max/mean"] + [f"align {a['align']}" for a in first],
                     rows,
                     title="3. Padding: share of the grouped GEMMs' rows that are padding, "
                           "balanced / skewed routing",
                     note="align: " + "; ".join(f"{a['align']} {a['for']}" for a in first)
                          + ". skewed: the course's skewed benchmark routing (bench.make_routing)"
                            " on this model's experts and top-k, its copies per expert counted "
                            "here; max/mean: its hottest expert's load over the mean"))


def _fused_text(report: dict) -> str:
    f = report["fused_grouped_mlp"]
    lines = ["4. Fused grouped MLP (te_ops, Blackwell CuTe-DSL kernel): its conditions",
             "   shapes: " + ("; ".join(f["shape_reasons"]) if f["shape_reasons"] else
                              f"met (hidden and intermediate multiples of "
                              f"{experts.FUSED_MLP_FEATURE_MULTIPLE}, glu_interleave_size "
                              f"{f['glu_interleave_size']} as the course builds it)")]
    for arch, a in f["archs"].items():
        verdict = ("fuses" if a["fuses"] else
                   "does not fuse: " + "; ".join(a["why_not"] or ["the shapes (above)"]))
        lines.append(f"   {arch} ({a['gpu']}, recipe {a['recipe']}): {verdict}")
    for r in f["rows"]:
        state = ("; ".join(r["why_fused_raises"]) if r["why_fused_raises"] else
                 "satisfy the kernel's row rules")
        lines.append(f"   rows at {r['tokens_per_gpu']:,} tokens/GPU, balanced, padded to "
                     f"{r['align']}: {state}")
    lines.append(f"   (te_ops pads every expert to {experts.FUSED_MLP_ROWS_PER_EXPERT} rows where "
                 f"it can fuse: section 3's align {experts.FUSED_MLP_ROWS_PER_EXPERT} column)")
    return "\n".join(lines)


def _memory_text(report: dict) -> str:
    m, s = report["memory"], report["settings"]
    gib = memory.gib
    rows = [[r["layout"], r["state_dtype"], gib(r["state_bytes"]), gib(r["peak_bytes"]),
             r["peak_phase"], "yes" if r["fits"] else "NO", gib(r["spare_bytes"])]
            for r in m["rows"]]
    what = "the experts alone (MoE block)" if m["experts_only"] else "the whole training step"
    return str(Table(
        ["layout", "state dtype", "state GiB", "peak GiB", "moment", "fits", "spare GiB"], rows,
        title=f"5. Memory per GPU: {what}, {s['gpus']} GPUs of {s['gpu_gib']:g} GiB, "
              f"{s['batch']} × {s['seq_len']} tokens per GPU, {m['precision']}, "
              f"{m['backend']} experts (memory.predict)",
        note=f"state: parameters, gradients and AdamW moments at the peak moment; "
             f"{m['reserve_fraction']:.0%} of each GPU kept back (memory.fits)"))


def _recommendation_text(report: dict) -> str:
    r = report["recommendation"]
    sweep = r["sweep"]
    lines = ["6. Recommendation"]
    if sweep["ran"]:
        lines.append(f"   sweep: {sweep['rule']}")
    else:
        lines.append(f"   no sweep ran: {sweep['why_not']}. The choices below come from the "
                     f"arithmetic above and {sweep['verdicts_from']}.")
    lines.append(f"   sizes judged at {r['judged_at']}")
    for machine, items in r["machines"].items():
        lines.append(f"   {machine}:")
        lines += [f"     {item['item']:<10} {item['reason']}" for item in items]
    return "\n".join(lines)


def format_report(report: dict) -> str:
    """The report as text: the model, what is out of scope, then the six sections."""
    m, scope = report["model"], report["scope"]
    head = [f"analyze: {m['name']}, from {m['source']}"]
    head += [f"  out of scope: {line}" for line in scope["out_of_scope"]]
    head += [f"  note: {line}" for line in scope["notes"]]
    return "\n\n".join(["\n".join(head), _parameters_text(report), _gemms_text(report),
                        _padding_text(report), _fused_text(report), _memory_text(report),
                        _recommendation_text(report)])
