"""router_and_expert_loop.svg (notebook 01): the router and HF's eager experts loop
(`moe_tutorial.moe.model.Router`, `experts.NaiveExperts`): logits → softmax in fp32 → top-2 →
renormalise; then, for every expert that received tokens, gather its tokens, run its MLP, scale by
the routing weights and index_add the result into the output.

    python notebooks/figures/router_and_expert_loop.py
"""

from __future__ import annotations

from routing_example import NUM_EXPERTS, ROUTING, TOKENS, TOP_K, weight_text
from svg import (
    EXPERTS,
    GREY,
    MUTED,
    TEAL,
    WHITE,
    Figure,
    arrow,
    box,
    fit_width,
    line,
    lines,
    save,
    text,
)

TITLE = "A MoE layer, the naive way: router, then a loop over the experts"
DESC = ("Six tokens go through the router (logits, softmax, top-2, renormalised weights), which "
        "picks two of four experts per token. A loop then visits each expert that got tokens: it "
        "gathers that expert's tokens, runs its MLP, scales the outputs by the routing weights and "
        "adds them into each token's output; expert 2 got no token and is skipped.")

ROW_Y0, ROW_H = 74, 34  # first token row, row pitch
TOKEN_X, TOKEN_W = 16, 40
ROUTER_X, ROUTER_W = 76, 146
TABLE_X, CHIP_W = 248, 52
LOOP_X, LOOP_W = 384, 490
OUT_X, OUT_W = 904, 114
LANE_H, LANE_GAP = 32, 13


def token_rows() -> list[str]:
    parts = [text(TOKEN_X, ROW_Y0 - 12, "tokens x", weight="bold"),
             text(TABLE_X, ROW_Y0 - 12, "top-2 choices", weight="bold"),
             text(OUT_X, ROW_Y0 - 12, "out", weight="bold")]
    for t, (name, choices) in enumerate(zip(TOKENS, ROUTING)):
        y = ROW_Y0 + t * ROW_H
        parts.append(box(TOKEN_X, y, TOKEN_W, 24, name, WHITE))
        for j, (expert, weight) in enumerate(choices):
            parts.append(box(TABLE_X + j * (CHIP_W + 6), y, CHIP_W, 24,
                             f"E{expert} {weight_text(weight)}", EXPERTS[expert]))
        terms = " + ".join(f"{weight_text(w)}·E{e}" for e, w in choices)
        parts.append(box(OUT_X, y, OUT_W, 24, f"{terms}", WHITE, size=10.5))
    return parts


def router() -> list[str]:
    top = ROW_Y0 + 1.5 * ROW_H - 12
    height = 2 * ROW_H + 24 + 12
    mid = top + height / 2
    return [
        arrow(TOKEN_X + TOKEN_W + 4, mid, ROUTER_X - 3, mid),
        box(ROUTER_X, top, ROUTER_W, height,
            ["router (gate)", f"logits = x·Wᵀ [6 × {NUM_EXPERTS}]", "softmax (fp32)",
             f"top-{TOP_K}, renormalise"], TEAL),
        arrow(ROUTER_X + ROUTER_W + 4, mid, TABLE_X - 6, mid),
    ]


def loop() -> list[str]:
    parts = [text(LOOP_X, ROW_Y0 - 12, "for each expert that got tokens:", weight="bold")]
    y = ROW_Y0
    for expert in range(NUM_EXPERTS):
        mine = [(t, w) for t, choices in enumerate(ROUTING) for e, w in choices if e == expert]
        colour = EXPERTS[expert]
        if not mine:
            parts.append(box(LOOP_X, y, LOOP_W, LANE_H, f"E{expert}: no tokens, skipped "
                             "(no kernel runs for it)", GREY, dash="4 3"))
            y += LANE_H + LANE_GAP
            continue
        names = " ".join(TOKENS[t] for t, _ in mine)
        steps = _fit([f"gather {names}", f"MLP E{expert}",
                      "× " + " ".join(weight_text(w) for _, w in mine), "index_add → out"])
        x = LOOP_X
        for i, (label, width) in enumerate(steps):
            if i:
                parts.append(arrow(x - 14, y + LANE_H / 2, x - 3, y + LANE_H / 2))
            parts.append(box(x, y, width, LANE_H, label, colour, size=10.5))
            x += width + 14
        y += LANE_H + LANE_GAP
    return parts


def _fit(labels: list[str]) -> list[tuple[str, float]]:
    """A lane's boxes, each as wide as its label needs, stretched so every lane is LOOP_W wide."""
    widths = [fit_width(label, 10.5, pad=6) for label in labels]
    spare = (LOOP_W - 14 * (len(labels) - 1) - sum(widths)) / len(labels)
    return [(label, width + spare) for label, width in zip(labels, widths)]


def svg() -> str:
    width, height = 1034, 330
    bottom = ROW_Y0 + 6 * ROW_H + 8
    fig = Figure(width, height, TITLE, DESC)
    fig.heading("One MoE layer, naive: route each token to 2 of 4 experts, then loop over the experts")
    fig.add(*token_rows(), *router(), *loop(),
            arrow(TABLE_X + 2 * CHIP_W + 10, ROW_Y0 + 2.8 * ROW_H, LOOP_X - 4, ROW_Y0 + 2.8 * ROW_H),
            arrow(LOOP_X + LOOP_W + 4, ROW_Y0 + 2.8 * ROW_H, OUT_X - 4, ROW_Y0 + 2.8 * ROW_H),
            line(14, bottom, width - 14, bottom, colour="#d0d7de"),
            lines(16, bottom + 20, [
                "Each expert costs its own gather, two small GEMMs (gate-up, down), a scale and a "
                "scatter, launched one after another: HF transformers' \u201ceager\u201d experts.",
                "The output of a token is the weighted sum of its two experts' outputs; the "
                "weights of a token sum to 1."], fill=MUTED))
    return fig.render()


def main(out_dir=None):
    return save(__file__, svg(), out_dir)


if __name__ == "__main__":
    print(f"wrote {main()}")
