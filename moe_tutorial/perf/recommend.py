"""What `analyze` reports last: 5 the memory one GPU holds per engine and (dp, ep) layout, and
6 the recommendation (backend, recipe, alignment, layout), each with its reason in one computed
sentence: on a GPU after a short sweep of the expert layer, on a CPU from the arithmetic of
`model_numbers` and the course's committed H200 map.
"""

from __future__ import annotations

import torch

from ..display import format_value
from ..moe import experts
from ..moe.config import MoEConfig
from ..parallel import distributed
from ..precision import hardware, recipes
from . import decide, memory, results
from .model_numbers import (
    FUSED_RECIPE,
    TOKENS_PER_GPU,
    Model,
    arch_capabilities,
    expert_shape,
    padding_at,
)

GPU_GIB = 140.0  # an H200's memory, the GPU size of docs/benchmarks.md's memory table
ENGINES = ("replicated", "fsdp2")  # memory.ENGINES of several GPUs
# FSDP2's shards in fp32 with bf16 compute, as the memory table of docs/benchmarks.md
FSDP2_STATE_DTYPE = "float32"
MAX_GPUS = 4096  # how far `fewest_gpus` looks


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


