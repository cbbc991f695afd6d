"""Draws fused_grouped_mlp.svg (notebook 04): the te.ops grouped MLP's ops, unfused and as TE
2.20's fuser replaces them (`GroupedMLP_CuTeGEMMGLU`, transformer_engine/pytorch/ops/fused/
grouped_mlp.py). Regenerate with

    python notebooks/figures/fused_grouped_mlp.py

The output is a function of this file alone (no fonts measured, no dates), so re-running it
rewrites the same bytes.
"""

from __future__ import annotations

from html import escape
from pathlib import Path

OUT = Path(__file__).with_suffix(".svg")

GEMM, ELEMENTWISE, FUSED = "#dbe7fb", "#fde6cf", "#d5f2e3"  # fills: grouped GEMM, elementwise, fused kernel
STROKE = {GEMM: "#3a64b0", ELEMENTWISE: "#c26a12", FUSED: "#1f8a53"}
CHAR_W, PAD, GAP, BOX_H = 6.3, 10, 22, 34  # px per character at font-size 11, box padding, arrow gap
LEFT = 190  # where the first box of a lane starts

# (lane title, [(label, fill), ...]): one box per kernel launch the figure counts
LANES = [
    ("unfused — forward", [("FC1 grouped GEMM", GEMM), ("ScaledSwiGLU (× routing weight)", ELEMENTWISE),
                           ("FC2 grouped GEMM", GEMM)]),
    ("unfused — backward", [("FC2 dgrad", GEMM), ("FC2 wgrad", GEMM),
                            ("ScaledSwiGLU backward (dSwiGLU, d routing weight)", ELEMENTWISE),
                            ("FC1 dgrad", GEMM), ("FC1 wgrad", GEMM)]),
    ("fused — forward", [("ONE kernel: FC1 grouped GEMM + SwiGLU + × routing weight + MXFP8 quantize", FUSED),
                         ("FC2 grouped GEMM (separate)", GEMM)]),
    ("fused — backward", [("ONE kernel: FC2 dgrad + dSwiGLU + d routing weight", FUSED),
                          ("FC2 wgrad", GEMM), ("FC1 dgrad", GEMM), ("FC1 wgrad", GEMM)]),
]
LANE_Y = [46, 96, 176, 226]


def box(x: float, y: float, label: str, fill: str) -> tuple[str, float]:
    width = len(label) * CHAR_W + 2 * PAD
    return (f'<rect x="{x:.0f}" y="{y}" width="{width:.0f}" height="{BOX_H}" rx="5" fill="{fill}" '
            f'stroke="{STROKE[fill]}" stroke-width="{2 if fill == FUSED else 1}"/>'
            f'<text x="{x + width / 2:.0f}" y="{y + BOX_H / 2 + 4}" text-anchor="middle">{escape(label)}</text>',
            width)


def arrow(x0: float, x1: float, y: float) -> str:
    return (f'<line x1="{x0:.0f}" y1="{y}" x2="{x1 - 3:.0f}" y2="{y}" stroke="#555" stroke-width="1.2" '
            f'marker-end="url(#head)"/>')


def svg() -> str:
    parts, right = [], 0.0
    for (title, boxes), y in zip(LANES, LANE_Y):
        parts.append(f'<text x="12" y="{y + BOX_H / 2 + 4}" font-weight="bold">{escape(title)}</text>')
        x = LEFT
        for i, (label, fill) in enumerate(boxes):
            if i:
                parts.append(arrow(x - GAP, x, y + BOX_H / 2))
            shape, width = box(x, y, label, fill)
            parts.append(shape)
            x += width + GAP
        right = max(right, x - GAP)
    width, height = right + 14, 300
    legend_y = 280
    legend = []
    for i, (fill, text) in enumerate(((GEMM, "grouped GEMM"), (ELEMENTWISE, "elementwise op"),
                                      (FUSED, "fused CuTe-DSL kernel (TE 2.20, compute capability 10.x)"))):
        lx = 12 + i * 170
        legend.append(f'<rect x="{lx}" y="{legend_y - 10}" width="14" height="12" fill="{fill}" '
                      f'stroke="{STROKE[fill]}"/><text x="{lx + 20}" y="{legend_y}">{escape(text)}</text>')
    divider = f'<line x1="12" y1="152" x2="{width - 12:.0f}" y2="152" stroke="#bbb" stroke-dasharray="4 3"/>'
    heading = ('<text x="12" y="22" font-size="13" font-weight="bold">te.ops.Sequential(GroupedLinear, '
               'ScaledSwiGLU, GroupedLinear): what runs, unfused and fused</text>')
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height}" '
        f'viewBox="0 0 {width:.0f} {height}" role="img" aria-labelledby="title desc" '
        f'font-family="DejaVu Sans, Arial, sans-serif" font-size="11" fill="#222">\n'
        '<title id="title">The te.ops grouped MLP, unfused and fused by TE 2.20</title>\n'
        '<desc id="desc">Unfused, the forward pass runs the FC1 grouped GEMM, ScaledSwiGLU and the FC2 '
        'grouped GEMM, and the backward pass FC2 dgrad, FC2 wgrad, the ScaledSwiGLU backward, FC1 dgrad '
        'and FC1 wgrad. Fused, the forward pass runs one kernel for FC1 (grouped GEMM, SwiGLU, routing-'
        'weight scale and MXFP8 quantization of its output) followed by a separate FC2 grouped GEMM, and '
        'the backward pass one kernel for FC2 dgrad with dSwiGLU and the routing-weight gradient, then '
        'separate FC2 wgrad, FC1 dgrad and FC1 wgrad GEMMs.</desc>\n'
        '<defs><marker id="head" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="7" markerHeight="7" '
        'orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#555"/></marker></defs>\n'
        f'<rect width="100%" height="100%" fill="white"/>\n{heading}\n{divider}\n'
        + "\n".join(parts) + "\n" + "\n".join(legend) + "\n</svg>\n")


if __name__ == "__main__":
    OUT.write_text(svg())
    print(f"wrote {OUT}")
