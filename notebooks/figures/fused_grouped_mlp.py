"""fused_grouped_mlp.svg (notebook 05): the te.ops grouped MLP's kernels, unfused and as TE
2.20's fuser replaces them (`GroupedMLP_CuTeGEMMGLU`, transformer_engine/pytorch/ops/fused/
grouped_mlp.py): forward, one kernel for FC1 + SwiGLU + routing-weight scale + MXFP8 quantize,
then a separate FC2 grouped GEMM; backward, FC2 dgrad fused with dSwiGLU and the routing
weights' gradient, then separate FC2 wgrad, FC1 dgrad and FC1 wgrad.

    python notebooks/figures/fused_grouped_mlp.py
"""

from __future__ import annotations

from svg import (
    BLUE,
    GREEN,
    ORANGE,
    Figure,
    arrow,
    box,
    fit_width,
    legend,
    line,
    save,
    text,
)

GEMM, ELEMENTWISE, FUSED = BLUE, ORANGE, GREEN
BOX_H, GAP, LEFT = 34, 22, 190  # box height, arrow length, where a lane's first box starts

# (lane title, [(label, kind), ...]): one box per kernel launch
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

TITLE = "The te.ops grouped MLP, unfused and fused by TE 2.20"
DESC = ("Unfused, the forward pass runs the FC1 grouped GEMM, ScaledSwiGLU and the FC2 grouped GEMM, "
        "and the backward pass FC2 dgrad, FC2 wgrad, the ScaledSwiGLU backward, FC1 dgrad and FC1 "
        "wgrad. Fused, the forward pass runs one kernel for FC1 (grouped GEMM, SwiGLU, routing-weight "
        "scale and MXFP8 quantization of its output) followed by a separate FC2 grouped GEMM, and the "
        "backward pass one kernel for FC2 dgrad with dSwiGLU and the routing-weight gradient, then "
        "separate FC2 wgrad, FC1 dgrad and FC1 wgrad GEMMs.")


def svg() -> str:
    parts, right = [], 0.0
    for (title, boxes), y in zip(LANES, LANE_Y):
        parts.append(text(12, y + BOX_H / 2 + 4, title, weight="bold"))
        x = LEFT
        for i, (label, kind) in enumerate(boxes):
            if i:
                parts.append(arrow(x - GAP, y + BOX_H / 2, x - 3, y + BOX_H / 2))
            width = fit_width(label)
            parts.append(box(x, y, width, BOX_H, label, kind, stroke_width=2 if kind is FUSED else 1))
            x += width + GAP
        right = max(right, x - GAP)
    width = round(right + 14)
    key, _ = legend(12, 280, [(GEMM, "grouped GEMM"), (ELEMENTWISE, "elementwise op"),
                              (FUSED, "fused CuTe-DSL kernel (TE 2.20, compute capability 10.x)")])
    fig = Figure(width, 300, TITLE, DESC)
    fig.add(text(12, 22, "te.ops.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear): what runs, "
                         "unfused and fused", size=13, weight="bold"),
            line(12, 152, width - 12, 152, colour="#bbbbbb", dash="4 3"), *parts, key)
    return fig.render()


def main(out_dir=None):
    return save(__file__, svg(), out_dir)


if __name__ == "__main__":
    print(f"wrote {main()}")
