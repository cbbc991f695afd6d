"""moe_families.svg (notebook 08): the MoE block of each transformers family the course converts
(`moe_tutorial.moe.families.FAMILIES`), side by side, as `moe_tutorial.moe.model.MoEBlock`
and its `Router` compute it: Mixtral (softmax top-k, always renormalised), Qwen3-MoE and OLMoE
(the same, renormalised only with norm_topk_prob), Qwen2-MoE (plus one shared expert scaled by
sigmoid(shared_expert_gate(x))) and DeepSeek-V3 (`route_sigmoid`: sigmoid scores, a correction
bias used only to choose, group-limited top-k, unbiased weights times routed_scaling_factor,
ungated shared experts; balanced, in its technical report, by moving the bias between steps plus a
small sequence-wise loss, neither of which transformers' DeepseekV3 does). The published values it quotes (`PUBLISHED`) are the
shipped configs' (moe_tutorial/configs; tests/notebooks/test_figures.py checks them).

    python notebooks/figures/moe_families.py
"""

from __future__ import annotations

from svg import (
    GREY,
    MUTED,
    ORANGE,
    PURPLE,
    TEAL,
    WHITE,
    Figure,
    arrow,
    box,
    circle,
    lines,
    rect,
    save,
    text,
    text_width,
)

TITLE = "The MoE block of five transformers families, side by side"
DESC = ("Four panels. Mixtral: softmax over the experts, the top-k, their weights renormalised to "
        "sum to one, routed experts only. Qwen3-MoE and OLMoE: the same, renormalised only when "
        "norm_topk_prob is set. Qwen2-MoE: the same routed experts plus one shared expert that "
        "every token passes through, scaled by a sigmoid gate. DeepSeek-V3: sigmoid scores, a "
        "correction bias added only to choose the experts, the top-k within the best groups of "
        "experts, the unbiased scores as weights times a routed scaling factor, an ungated shared "
        "expert; the technical report balances it by moving the bias between steps and by a "
        "small sequence-wise loss, and transformers does neither.")

# Published values quoted in the panels: the shipped configs (moe_tutorial/configs), as the
# package reads them (MoEConfig.from_hf_config); tests/notebooks/test_figures.py compares.
PUBLISHED = {
    "qwen3-moe-30b-a3b": {"norm_topk_prob": True},
    "olmoe-1b-7b": {"norm_topk_prob": False},
    "deepseek-v3": {"top_k": 8, "num_experts": 256, "n_group": 8, "topk_group": 4,
                    "routed_scaling_factor": 2.5, "n_shared_experts": 1},
}
DS = PUBLISHED["deepseek-v3"]


def _flag(name: str) -> str:
    return str(PUBLISHED[name]["norm_topk_prob"]).lower()


PANEL_W, LEFT, TOP = 284, 14, 44
INNER = PANEL_W - 12 - 2 * 12  # a panel's content width
SIZE = 10  # text in the boxes
ARROW_GAP = 14
EXPERTS_Y, EXPERTS_H = 344, 40
PANEL_H = 448
ROUTED_W = 128

SOFTMAX_CHAIN = [
    ("router: logits = x · Wᵀ, one per expert", TEAL),
    ("softmax over the experts (fp32)", TEAL),
    ("top-k: the k most probable experts", TEAL),
]
# (family keys, title, the chain below x, the shared expert (None: none), footer lines)
PANELS = [
    (("mixtral",), "Mixtral",
     SOFTMAX_CHAIN + [("renormalise: the k weights sum to 1", PURPLE)],
     None,
     ["balancing: the load-balancing loss", "(router_aux_loss_coef)"]),
    (("qwen3_moe", "olmoe"), "Qwen3-MoE · OLMoE",
     SOFTMAX_CHAIN + [(["renormalise only if norm_topk_prob", "(else the k probabilities as they",
                        "are: they sum to less than 1)"], PURPLE)],
     None,
     ["published norm_topk_prob: Qwen3-30B-A3B",
      f"{_flag('qwen3-moe-30b-a3b')}, OLMoE-1B-7B {_flag('olmoe-1b-7b')}",
      "balancing: the load-balancing loss"]),
    (("qwen2_moe",), "Qwen2-MoE",
     SOFTMAX_CHAIN + [(["renormalise only if norm_topk_prob", "(else the k probabilities as they",
                        "are: they sum to less than 1)"], PURPLE)],
     ["shared expert ×", "sigmoid(gate(x))"],
     ["shared expert: a SwiGLU MLP every", "token passes through; gate: the linear",
      "shared_expert_gate (hidden → 1)", "balancing: the load-balancing loss"]),
    (("deepseek_v3",), "DeepSeek-V3 (its MoE block)",
     [("router: logits = x · Wᵀ in fp32", TEAL),
      ("sigmoid: a score in (0, 1) per expert", TEAL),
      (["choose on score + correction bias", "(e_score_correction_bias): top-k",
        "within the topk_group best of n_group", "groups (a group: its best 2 scores)"], TEAL),
      (["weights: the unbiased scores,", "renormalised (norm_topk_prob),",
        "× routed_scaling_factor"], PURPLE)],
     ["n_shared_experts", "MLPs (one n× as", "wide), ungated"],
     [f"published: top-{DS['top_k']} of {DS['num_experts']} experts in {DS['n_group']} groups,",
      (f"best {DS['topk_group']}; scaling {DS['routed_scaling_factor']:g}; "
       f"{DS['n_shared_experts']} shared expert"),
      "balancing (the report): the bias moved", "between steps + a sequence-wise loss",
      "(α = 1e-4); transformers does neither"]),
]
FOOTNOTE = [
    ("Every expert is a SwiGLU MLP, down(silu(gate(x)) · up(x)); the routed ones run in the "
     "course's expert backends whatever the router. The attention differs too (not drawn): "
     "RMSNorm on q and k"),
    ("per head (Qwen3-MoE) or over the whole projections (OLMoE), q/k/v biases (Qwen2-MoE); "
     "DeepSeek-V3's multi-head latent attention is not implemented here, so its MoE block "
     "converts alone."),
]
CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
           "olmoe": "OlmoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
           "deepseek_v3": "DeepseekV3ForCausalLM"}


def _height(label) -> float:
    n = 1 if isinstance(label, str) else len(label)
    return 10 + n * SIZE * 1.3


def _fits(label, width: float) -> None:
    for line in [label] if isinstance(label, str) else label:
        if text_width(line, SIZE) > width - 8:
            raise ValueError(f"{line!r} is wider than its box ({width} px)")


def panel(x0: float, keys, title: str, chain, shared, footer) -> list[str]:
    x = x0 + 12
    parts = [rect(x0, TOP, PANEL_W - 12, PANEL_H, fill="none", stroke="#d0d7de", rx=8),
             text(x, TOP + 22, title, size=12.5, weight="bold"),
             text(x, TOP + 38, ", ".join(CLASSES[k] for k in keys), size=9.5, fill=MUTED)]
    y = TOP + 50
    parts.append(box(x, y, INNER, 22, "x: a token's hidden state", WHITE, size=SIZE))
    y += 22
    for label, colour in chain:
        _fits(label, INNER)
        parts.append(arrow(x + ROUTED_W / 2, y + 1, x + ROUTED_W / 2, y + ARROW_GAP - 2))
        y += ARROW_GAP
        height = _height(label)
        parts.append(box(x, y, INNER, height, label, colour, size=SIZE))
        y += height
    if y > EXPERTS_Y - ARROW_GAP:
        raise ValueError(f"{title}: the routing chain ends at {y}, below the experts row")
    parts.append(arrow(x + ROUTED_W / 2, y + 1, x + ROUTED_W / 2, EXPERTS_Y - 2))
    routed = ["routed experts:", "Σ weight · expert(x)", "over the k chosen"]
    _fits(routed, ROUTED_W)
    parts.append(box(x, EXPERTS_Y, ROUTED_W, EXPERTS_H + 6, routed, ORANGE, size=SIZE))
    shared_x, shared_w = x + ROUTED_W + 8, INNER - ROUTED_W - 8
    if shared is None:
        parts.append(box(shared_x, EXPERTS_Y, shared_w, EXPERTS_H + 6, ["no shared", "expert"],
                         GREY, size=SIZE, dash="4 3"))
    else:
        _fits(shared, shared_w)
        parts.append(box(shared_x, EXPERTS_Y, shared_w, EXPERTS_H + 6, shared, ORANGE, size=SIZE))
    plus_y = EXPERTS_Y + EXPERTS_H + 6 + 22
    parts.append(arrow(x + ROUTED_W / 2, EXPERTS_Y + EXPERTS_H + 7, x + INNER / 2 - 10, plus_y - 6))
    if shared is not None:
        parts.append(arrow(shared_x + shared_w / 2, EXPERTS_Y + EXPERTS_H + 7,
                           x + INNER / 2 + 10, plus_y - 6))
    parts += [circle(x + INNER / 2, plus_y + 2, 8, WHITE),
              text(x + INNER / 2, plus_y + 6, "+", size=12, anchor="middle"),
              text(x + INNER / 2 + 14, plus_y + 6, "→ out", size=SIZE)]
    parts.append(lines(x, plus_y + 30, footer, size=SIZE, fill=MUTED))
    return parts


def svg() -> str:
    width = LEFT + 4 * PANEL_W + 2
    fig = Figure(width, TOP + PANEL_H + 56, TITLE, DESC)
    fig.heading("One MoE block, five families: how the router picks and weighs the experts")
    for i, (keys, title, chain, shared, footer) in enumerate(PANELS):
        fig.add(*panel(LEFT + i * PANEL_W, keys, title, chain, shared, footer))
    fig.add(lines(LEFT + 2, TOP + PANEL_H + 22, FOOTNOTE, size=10.5, fill=MUTED))
    return fig.render()


def main(out_dir=None):
    return save(__file__, svg(), out_dir)


if __name__ == "__main__":
    print(f"wrote {main()}")
