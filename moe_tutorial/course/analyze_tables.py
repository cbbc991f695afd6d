"""`analyze`'s reports, shown: the recommendation per GPU architecture, the shipped published
configs side by side, and the families the conversion reads. Chapter 08 calls these; each
returns the numbers it showed."""

from __future__ import annotations

import re

from .. import display
from ..moe import families


def count_text(n: float) -> str:
    """A parameter count as text: 30.53 B, 919.67 M."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def layout_text(layout: str | None) -> str:
    """A recommended layout as the chapters name it: `analyze` calls the engine without FSDP
    "replicated" ("replicated dp1×ep8"), but at ep > 1 the experts are split, not replicated, so
    it reads "dp1×ep8, no FSDP" (every GPU keeps whole copies of what it holds); "fsdp2 dp4×ep2"
    reads "dp4×ep2, FSDP2". None (no layout fits) stays "None"."""
    found = re.fullmatch(r"(replicated|fsdp2) (dp\d+×ep\d+)", layout or "")
    if not found:
        return str(layout)
    return f"{found[2]}, {'FSDP2' if found[1] == 'fsdp2' else 'no FSDP'}"


def show_recommendation(report: dict) -> dict:
    """A report's four recommended items (backend, recipe, alignment, layout) per machine, side by
    side. On a CPU the machines are the GPU architectures the course describes; on a GPU, that
    GPU. A layout of None means none was chosen. Returns {machine: {item: choice}}."""
    machines = report["recommendation"]["machines"]
    items = [item["item"] for item in next(iter(machines.values()))]
    display.show_table(display.Table(
        ["", *machines], [[item, *((layout_text if item == "layout" else str)(machines[m][i]["choice"]) for m in machines)]
                          for i, item in enumerate(items)],
        title=f"{report['model']['name']}: recommended at {report['recommendation']['judged_at']}"))
    return {m: {item["item"]: item["choice"] for item in chosen} for m, chosen in machines.items()}


def _router_text(c: dict) -> str:
    text = (f"sigmoid, top-{c['top_k']} in the best {c['topk_group']} of {c['n_group']} groups" if c["router"] == "sigmoid"
            else f"softmax, top-{c['top_k']}")
    text += ", renormalised" if c["norm_topk_prob"] else ", not renormalised"
    return text + (f", × {c['routed_scaling_factor']:g}" if c["routed_scaling_factor"] != 1 else "")


def _shared_text(c: dict) -> str:
    width = c["shared_expert_intermediate_size"]
    return f"{width} wide, {'gated' if c['shared_expert_gate'] else 'ungated'}" if width else "none"


def _at_tokens(rows: list[dict], tokens: int) -> dict:
    return next(row for row in rows if row["tokens_per_gpu"] == tokens)


def show_shipped(shipped: dict, pad_tokens: int, pad_align: int) -> dict:
    """The shipped configs' reports side by side: shape, router, shared expert, parameters, rows
    per expert and the padding share at `pad_tokens` per GPU and alignment `pad_align` (balanced
    routing), and how many layouts fit. The note names the configs of which only the MoE block
    is analysed (`analyze.format_report` says why, field by field). Returns {name: padding
    share}."""
    padding, rows, blocks = {}, [], []
    for name, r in shipped.items():
        c, p = r["model"]["config"], r["parameters"]
        gemm = _at_tokens(r["expert_gemms"], pad_tokens)
        padding[name] = next(a["balanced"] for a in _at_tokens(r["padding"], pad_tokens)["alignments"]
                             if a["align"] == pad_align)
        whole = "total" in p
        rows.append([name, c["num_layers"], c["hidden_size"], f"{c['num_experts']} × {c['intermediate_size']}",
                     _router_text(c), _shared_text(c), count_text(p["total"]) if whole else "– (MoE block)",
                     count_text(p["active_per_token"]) if whole else f"experts: {count_text(p['experts_active_per_token'])}",
                     f"{gemm['rows_per_expert']:g}", f"{padding[name]:.0%}",
                     f"{sum(row['fits'] for row in r['memory']['rows'])} of {len(r['memory']['rows'])}"])
        blocks += [] if whole else [name]
    settings = next(iter(shipped.values()))["settings"]
    display.show_table(display.Table(
        ["config", "MoE layers", "hidden", "experts × width", "router", "shared expert", "parameters", "active per token",
         f"rows per expert at {pad_tokens:,} tokens", f"padding at align {pad_align}",
         f"layouts of {settings['gpus']} GPUs that fit"], rows,
        title="Published MoEs, analysed from their config.json alone (moe_tutorial/configs)",
        note=f"balanced routing; memory at {settings['batch']} × {settings['seq_len']} tokens per GPU, bf16"
             + "".join(f"; {name}: its routed experts only" for name in blocks)))
    return padding


def show_families() -> None:
    """families.FAMILIES, the table the conversion reads: per family the transformers class, which
    HF field holds each MoEConfig field, and what the family's modeling code fixes."""
    rows = [[key, f.causal_lm, f.fields["num_experts"], f.fields["intermediate_size"],
             f.fields.get("norm_topk_prob", "– (always)"), ", ".join(f"{k}={v!r}" for k, v in f.fixed.items()) or "–"]
            for key, f in families.FAMILIES.items()]
    display.show_table(display.Table(
        ["model_type", "transformers class", "experts from", "expert width from", "renormalise from", "fixed by the family"],
        rows, title="families.FAMILIES: how each family's config maps onto MoEConfig",
        note=f"moe.hf.from_hf converts: {families.supported_classes()}"))

