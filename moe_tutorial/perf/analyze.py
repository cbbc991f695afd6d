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
from pathlib import Path
from types import SimpleNamespace

from ..arguments import check_count
from ..display import Table
from ..locations import package_data
from ..moe import experts, families
from ..moe.config import PRESETS, MoEConfig, preset
from . import memory, timing
from .model_numbers import (
    COMPUTE_DTYPE,
    TOKENS_PER_GPU,
    Model,
    expert_gemms,
    fused_conditions,
    padding,
    parameters,
)
from .recommend import GPU_GIB, memory_rows, recommendation

CONFIGS_DIR = package_data("configs")
SOURCE_KEY = "_source"  # a shipped config's note on where its fields come from (not an HF field)
DEFAULT_SEQ_LEN = 4096


# ---------------------------------------------------------------------------------------------
# The model named

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

