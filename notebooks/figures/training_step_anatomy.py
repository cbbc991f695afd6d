"""training_step_anatomy.svg (notebook 06): one training step of the course's MoE model
(`moe_tutorial.moe.model.MoEForCausalLM.forward`, `train.train_step`) with an FP8 precision: the
decoder layers run under `te.autocast` — the attention projections become `te.Linear` (q, k, v
fused into `qkv_proj`), the experts a TE backend (GroupedLinear), so those GEMMs run in FP8 —
while the embedding, norms, attention core (SDPA), router, lm_head and loss stay in bf16/fp32;
then the backward pass (the FP8 modules' dgrad and wgrad GEMMs in FP8 too), gradient clipping
and AdamW.

    python notebooks/figures/training_step_anatomy.py
"""

from __future__ import annotations

from svg import (
    BLUE,
    GREEN,
    MUTED,
    ORANGE,
    RED,
    TEAL,
    WHITE,
    Figure,
    arrow,
    box,
    fit_width,
    legend,
    lines,
    path_arrow,
    rect,
    save,
    text,
)

FP8, BF16, MOVE, FP32, OPTIM = RED, BLUE, ORANGE, TEAL, GREEN
TITLE = "One training step of the MoE model, and which parts run in FP8"
DESC = ("One training step: embedding, then each decoder layer under te.autocast (RMSNorm, "
        "attention with FP8 q/k/v and output projections, RMSNorm, router, permute, the grouped "
        "MLP with FP8 FC1 and FC2 GEMMs, unpermute), then the final norm, lm_head and loss outside "
        "it; the backward pass runs the FP8 layers' gradient GEMMs in FP8 too, then gradient "
        "clipping and the AdamW step. Everything but those GEMMs stays in bf16 or fp32.")

H, GAP = 38, 16  # box height, arrow length
FRAME_X = 142

LAYER_ROWS = [
    [("RMSNorm", BF16), (["qkv_proj", "te.Linear"], FP8), (["attention", "SDPA"], BF16),
     (["o_proj", "te.Linear"], FP8), ("+ residual", WHITE)],
    [("RMSNorm", BF16), (["router: top-2", "softmax in fp32"], BF16),
     (["permute", "+ pad rows"], MOVE), (["FC1", "GroupedLinear"], FP8), ("SwiGLU", BF16),
     (["FC2", "GroupedLinear"], FP8), (["unpermute", "Σ weighted"], MOVE), ("+ residual", WHITE)],
]
HEAD_ROW = [("RMSNorm", BF16), (["lm_head", "bf16"], BF16),
            (["loss: cross-entropy (fp32)", "+ 0.02 × load balancing"], FP32)]
BACKWARD_ROW = [("loss.backward()", WHITE),
                (["every op's backward, in reverse;", "FP8 layers: dgrad + wgrad in FP8"], FP8),
                (["several GPUs:", "reduce-scatter (FSDP2)"], WHITE), ("clip_grad_norm_(1.0)", WHITE),
                (["AdamW step", "+ zero_grad"], OPTIM)]


def row(x: float, y: float, items, *,
        size: float = 10.5) -> tuple[list[str], list[tuple[float, float]]]:
    """Boxes left to right joined by arrows; returns (svg parts, [(left, right)] of each box)."""
    parts, spans = [], []
    for i, (label, colour) in enumerate(items):
        width = fit_width(label, size, pad=8)
        if i:
            parts.append(arrow(x - GAP, y + H / 2, x - 3, y + H / 2))
        dashed = "4 3" if isinstance(label, list) and label[0] == "several GPUs:" else None
        parts.append(box(x, y, width, H, label, colour, size=size, dash=dashed,
                         stroke_width=1.6 if colour is FP8 else 1))
        spans.append((x, x + width))
        x += width + GAP
    return parts, spans


def svg() -> str:
    fig = Figure(980, 452, TITLE, DESC)
    fig.heading("One training step of the MoE model: what runs in FP8 (precision \"fp8\", "
                "TE on a GPU)")
    y1, y2 = 78, 144
    fig.add(text(16, 58, "forward", weight="bold"))
    # the te.autocast frame around the decoder layers
    parts1, spans1 = row(FRAME_X + 14, y1, LAYER_ROWS[0])
    parts2, spans2 = row(FRAME_X + 14, y2, LAYER_ROWS[1])
    frame_right = max(spans1[-1][1], spans2[-1][1]) + 14
    fig.add(rect(FRAME_X, 60, frame_right - FRAME_X, y2 + H + 16 - 60, fill="#fff7f7",
                 stroke=RED.stroke, dash="6 3", rx=8),
            text(FRAME_X + 10, 73, "decoder layer × N, under te.autocast(recipe=…)", size=10,
                 weight="bold", fill=RED.stroke))
    fig.add(box(16, y1, 104, H, ["embedding", "bf16"], BF16, size=10.5),
            arrow(120 + 3, y1 + H / 2, FRAME_X + 14 - 3, y1 + H / 2), *parts1, *parts2)
    # row 1's output feeds row 2 (the MoE half of the layer)
    right1, left2 = spans1[-1][1], spans2[0][0]
    turn = y1 + H + (y2 - y1 - H) / 2
    fig.add(path_arrow(f"M{right1 + 0:.0f},{y1 + H / 2:.0f} h8 V{turn:.0f} H{left2 - 8:.0f} "
                       f"V{y2 + H / 2:.0f} h5"))

    y3 = 222
    parts3, spans3 = row(FRAME_X + 14, y3, HEAD_ROW)
    right2 = spans2[-1][1]
    fig.add(path_arrow(f"M{right2:.0f},{y2 + H / 2:.0f} h8 V{y3 - 14:.0f} H{FRAME_X:.0f} "
                       f"V{y3 + H / 2:.0f} h11"), *parts3,
            text(spans3[-1][1] + 12, y3 + 16, "outside te.autocast: lm_head and the loss stay", size=10,
                 fill=MUTED),
            text(spans3[-1][1] + 12, y3 + 30, "in higher precision", size=10, fill=MUTED))

    y4 = 316
    fig.add(text(16, y4 - 12, "backward and update", weight="bold"))
    parts4, spans4 = row(16, y4, BACKWARD_ROW)
    fig.add(path_arrow(f"M{spans3[-1][0] + 40:.0f},{y3 + H:.0f} V{y4 - 22:.0f} H{spans4[0][0] + 40:.0f} "
                       f"V{y4 - 3:.0f}"), *parts4)
    fig.add(lines(16, y4 + H + 26, [
        "FP8 runs only the big GEMMs: the attention projections and the experts' FC1 and FC2, forward "
        "and backward. E4M3 forward; gradients in E4M3 (MXFP8, FP8",
        "block scaling) or E5M2 (the per-tensor recipes: HYBRID format), as this course sets them. "
        "Norms, SDPA, router, permute, SwiGLU, lm_head and loss: bf16/fp32."],
        size=10.5, fill=MUTED))
    key, _ = legend(16, 432, [(FP8, "FP8 GEMM (TE, under te.autocast)"), (BF16, "bf16"),
                              (MOVE, "moves rows (no math)"), (FP32, "fp32"), (OPTIM, "optimizer")])
    fig.add(key)
    return fig.render()


def main(out_dir=None):
    return save(__file__, svg(), out_dir)


if __name__ == "__main__":
    print(f"wrote {main()}")
