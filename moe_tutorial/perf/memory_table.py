"""Full Mixtral-8x7B on 8 GPUs: which (dp, ep) layouts fit, per GPU, at the moment of each one's
peak (`memory.predict`, computed, not measured). docs/benchmarks.md quotes it.
"""

from __future__ import annotations

from ..moe.config import preset
from .memory import RESERVE_FRACTION, STATE, TABLE_BACKEND, MemoryPrediction, fits, gib, predict

TABLE_LAYOUTS = (("replicated", 8, 1), ("replicated", 1, 8), ("fsdp2", 8, 1), ("fsdp2", 4, 2),
                 ("fsdp2", 1, 8))
TABLE_COMPONENTS = ("parameters", "gradients", "optimizer_state", "fp8_weight_copies",
                    "gathered_parameters", "gradient_buffers", "activations", "logits")


def mixtral_8x7b_table(gpu_bytes: float, *, batch: int = 1, seq_len: int = 4096,
                       precision: str = "bf16", backend: str = TABLE_BACKEND,
                       state_dtype: str = "float32", activation_checkpointing: bool = False,
                       arch: str = "hopper",
                       reserve_fraction: float = RESERVE_FRACTION) -> tuple[list[dict], str]:
    """Per-GPU memory of full Mixtral-8x7B (`preset("mixtral-8x7b")`) on 8 GPUs of `gpu_bytes`
    each, for replicated dp8 and ep8 and FSDP2 over dp8, dp4 × ep2 and dp1 × ep8; FSDP2 keeps
    its state in `state_dtype` (the replicated layout has one bf16 copy). The default micro
    batch is BioNeMo's like-for-like Mixtral comparison: FSDP2 over 8 GPUs, 1 × 4096 tokens per
    GPU (benchmarks/results/published_recipe.json, "hf_like_for_like").

    Returns (rows, text): a dict per layout with the components at its peak moment (they add up
    to the peak), whether it fits and why; and the rows as a text table."""
    config = preset("mixtral-8x7b")
    rows = []
    for engine, dp, ep in TABLE_LAYOUTS:
        p = predict(config, batch=batch, seq_len=seq_len, dp=dp, ep=ep, engine=engine,
                    precision=precision, backend=backend, arch=arch,
                    state_dtype=state_dtype if engine == "fsdp2" else None,
                    activation_checkpointing=activation_checkpointing)
        rows.append(_table_row(p, gpu_bytes, reserve_fraction))
    return rows, _table_text(rows, gpu_bytes, reserve_fraction, rows[0]["settings"])





def _table_row(p: MemoryPrediction, gpu_bytes: float, reserve_fraction: float) -> dict:
    """One layout's row: the components at its peak moment, whether it fits, and what breaks
    it: the training state when that alone is too much, else the largest part the step adds on
    top of the state (what a different precision, batch or checkpointing would change)."""
    usable = gpu_bytes * (1 - reserve_fraction)
    at_peak = p.phases[p.peak_phase]
    state = sum(at_peak.get(name, 0) for name in STATE)
    added = {name: value for name, value in at_peak.items() if name not in STATE}
    ok = fits(p, gpu_bytes, reserve_fraction)
    breaks_on, why = None, f"{gib(usable - p.peak):.0f} GiB to spare ({p.peak_phase} moment)"
    if not ok and state > usable:
        breaks_on = max(STATE, key=lambda name: at_peak.get(name, 0))
        why = (f"the training state alone is {gib(state):.0f} GiB "
               f"({_label(breaks_on)} {gib(at_peak[breaks_on]):.0f})")
    elif not ok:
        breaks_on = max(added, key=added.get)
        why = (f"{gib(p.peak - usable):.0f} GiB over at the {p.peak_phase} moment: state "
               f"{gib(state):.0f} + {_label(breaks_on)} {gib(added[breaks_on]):.0f} GiB + rest")
    s = p.settings
    return {"layout": f"{s['engine']} dp{s['dp']}×ep{s['ep']}", "engine": s["engine"],
            "dp": s["dp"], "ep": s["ep"], "state_dtype": s["state_dtype"],
            "peak_bytes": p.peak, "peak_phase": p.peak_phase, "fits": ok,
            "breaks_on": breaks_on, "why": why,
            **{name: at_peak.get(name, 0) for name in TABLE_COMPONENTS}, "settings": s}


def _label(component: str) -> str:
    return {"optimizer_state": "AdamW moments",
            "fp8_weight_copies": "FP8 weight copies"}.get(component, component.replace("_", " "))


def table_layout_name(row: dict) -> str:
    """A row's layout as the text table names it: FSDP2, or "no FSDP" for the replicated
    engine, where each GPU keeps whole copies of what it holds. That is every weight at dp8 ×
    ep1, but only the dense weights and its share of the experts at dp1 × ep8: there the
    experts are split, not replicated."""
    return f"dp{row['dp']}×ep{row['ep']} " + ("FSDP2" if row["engine"] == "fsdp2" else "no FSDP")


def _table_text(rows: list[dict], gpu_bytes: float, reserve_fraction: float,
                settings: dict) -> str:
    short = {"parameters": "params", "gradients": "grads", "optimizer_state": "AdamW",
             "fp8_weight_copies": "FP8 w", "gathered_parameters": "gathered",
             "gradient_buffers": "grad buf", "activations": "activ.", "logits": "logits"}
    header = (f"{'layout':<22} {'state':>8} " + " ".join(f"{short[c]:>8}" for c in TABLE_COMPONENTS)
              + f" {'peak':>8}  moment    fits  why")
    lines = [f"Mixtral-8x7B on 8 GPUs of {gib(gpu_bytes):.1f} GiB ({gib(gpu_bytes) * (1 - reserve_fraction):.1f} "
             f"usable), GiB per GPU at the peak moment; {settings['batch']} × {settings['seq_len']} "
             f"tokens per GPU, {settings['precision']}"
             + (f" ({settings['recipe']})" if settings['recipe'] else "")
             + f", {settings['backend']} experts"
             + (", activation checkpointing" if settings["activation_checkpointing"] else ""),
             header, "-" * len(header)]
    for r in rows:
        state = r["state_dtype"].replace("bfloat16", "bf16").replace("float32", "fp32")
        lines.append(f"{table_layout_name(r):<22} {state:>8} "
                     + " ".join(f"{gib(r[c]):8.1f}" for c in TABLE_COMPONENTS)
                     + f" {gib(r['peak_bytes']):8.1f}  {r['peak_phase']:<8}  "
                     + f"{'yes' if r['fits'] else 'NO':<4}  {r['why']}")
    return "\n".join(lines)


