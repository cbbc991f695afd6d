"""The README's headline chart, a generated document of its own: the training-step ladder on one
H200 (docs/train-step-ladder.svg), drawn from h200.json.
"""

from __future__ import annotations

from xml.sax.saxutils import escape

from tools.benchmarks_page import _train_config, _train_label, _train_rows
from tools.doc_results import (
    load_result,
)

CHART = "docs/train-step-ladder.svg"

# ---------------------------------------------------------------------------------------------
# The README's headline chart: the training-step ladder on one H200 (docs/train-step-ladder.svg)

_SVG_FONT = "font-family=\"Helvetica, Arial, sans-serif\""


def train_step_chart() -> str:
    """An SVG bar chart of every training-step variant in `h200.json`, slowest first: ms per
    step, the speedup over HF eager, and each step's speed-of-light floor (its precision's)."""
    from moe_tutorial.perf.bench import VARIANTS, row_precision, step_floor_ms

    report = load_result("h200.json")
    env = report["environment"]
    sol_env = load_result("h200_speed_of_light.json")["environment"]  # the rates' own part of the run
    rows = sorted((r for r in _train_rows(report).values() if r.get("status") == "ok"),
                  key=lambda r: -r["median_ms"])
    eager = _train_rows(report)["hf_eager"]["median_ms"]
    best = report["summary"]["train_step_best_variant"]
    label_w, bar_w, row_h, top, left = 400, 330, 26, 80, 12
    width, height = left + label_w + bar_w + 120, top + row_h * len(rows) + 80
    scale = bar_w / max(r["median_ms"] for r in rows)
    config, first = _train_config(report)
    dates = sorted({part["date"][:10] for part in report.get("parts") or [env]})
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" {_SVG_FONT} font-size="13">',
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
           f'<text x="{left}" y="24" font-size="16" font-weight="bold">'
           + escape(f"One training step of mixtral-2l ({config.num_layers} layers at Mixtral-8x7B "
                    f"widths, batch {first['batch']} × {first['seq_len']}): ms per step, shorter "
                    f"is faster") + "</text>",
           f'<text x="{left}" y="44" fill="#444444">'
           + escape(f"One {env['gpu']}, CUDA {env['cuda']}, torch {env['torch']}, Transformer "
                    f"Engine {env['transformer_engine']}, transformers {env['transformers']}")
           + "</text>",
           f'<text x="{left}" y="62" fill="#444444">'
           + escape(f"Medians of the timed steps, run on {' and '.join(dates)}: "
                    "benchmarks/results/h200.json") + "</text>"]
    for i, r in enumerate(rows):
        y = top + i * row_h
        variant = VARIANTS.get(r["variant"])
        hf = variant is not None and variant.hf
        fp8 = row_precision(r) == "fp8"
        color = "#9e9e9e" if hf else ("#3f7d00" if fp8 else "#76b900")
        weight = ' font-weight="bold"' if r["variant"] == best else ""
        label = _train_label(r["variant"]).replace("`", "") + (", FP8" if fp8 else ", bf16")
        length = r["median_ms"] * scale
        out.append(f'<text x="{left + label_w - 8}" y="{y + 17}" text-anchor="end"{weight}>'
                   f"{escape(label)}</text>")
        out.append(f'<rect x="{left + label_w}" y="{y + 4}" width="{length:.1f}" '
                   f'height="{row_h - 8}" fill="{color}"/>')
        floor_ms = step_floor_ms(r, report["speed_of_light"])
        if floor_ms is not None:
            x = left + label_w + floor_ms * scale
            out.append(f'<line x1="{x:.1f}" y1="{y + 1}" x2="{x:.1f}" y2="{y + row_h - 1}" '
                       f'stroke="#000000" stroke-width="2" stroke-dasharray="3,2"/>')
        out.append(f'<text x="{left + label_w + length + 6:.1f}" y="{y + 17}"{weight}>'
                   f"{r['median_ms']:.1f} ms ({eager / r['median_ms']:.2f}×)</text>")
    y = top + row_h * len(rows) + 22
    legend = [("#9e9e9e", "HF transformers"), ("#76b900", "the course's model, bf16"),
              ("#3f7d00", "the course's model, FP8")]
    x = left
    for color, text in legend:
        out.append(f'<rect x="{x}" y="{y - 11}" width="12" height="12" fill="{color}"/>')
        out.append(f'<text x="{x + 18}" y="{y}">{escape(text)}</text>')
        x += 18 + 7 * len(text) + 24
    y += 22
    out.append(f'<line x1="{left + 6}" y1="{y - 12}" x2="{left + 6}" y2="{y + 2}" '
               f'stroke="#000000" stroke-width="2" stroke-dasharray="3,2"/>')
    out.append(f'<text x="{left + 18}" y="{y}">'
               + escape(f"speed-of-light floor: the step's work in its precision, at the rates "
                        f"measured in h200_speed_of_light.json ({sol_env['date'][:10]})")
               + "</text>")
    out.append(f'<text x="{left}" y="{y + 22}" fill="#444444">'
               + escape("(×): speedup over HF eager; bold: the course's fastest step") + "</text>")
    return "\n".join(out + ["</svg>"]) + "\n"
