"""dp_fsdp_ep.svg (notebook 07): where the weights live on 2 GPUs under data parallelism
(replicas), FSDP2 (`fully_shard`: every parameter split over the GPUs, a layer gathered while it
runs) and expert parallelism (dense weights replicated, experts split contiguously: rank r holds
experts r·E/ep … (r+1)·E/ep − 1), with what each exchanges per step — as
`moe_tutorial.parallel.distributed` (`AllToAllDispatcher`, `fully_shard_layout`, `average_gradients`) and
`moe_tutorial.perf.memory` (`training_state`) describe them.

    python notebooks/figures/dp_fsdp_ep.py
"""

from __future__ import annotations

from svg import EXPERTS, MUTED, TEAL, Figure, box, lines, rect, save, text

TITLE = "Data parallel, FSDP2 and expert parallel: which weights each GPU holds"
DESC = ("Two GPUs, the model's dense weights and 4 experts. Data parallel: each GPU holds "
        "everything and all gradients are all-reduced. FSDP2: each GPU holds half of every "
        "parameter and gathers a layer's weights while it runs. Expert parallel: each GPU holds "
        "the dense weights and 2 of the 4 experts, and tokens travel to their experts by "
        "all-to-all.")

NUM_EXPERTS, GPUS = 4, 2
DENSE = TEAL
PANEL_W, GPU_W, BAR_H = 304, 132, 20


def _bar(x: float, y: float, w: float, label: str, colour, part: tuple[int, int] | None) -> list[str]:
    """A parameter as a bar; `part` = (i, n): this GPU holds the i-th of n equal slices."""
    if part is None:
        return [box(x, y, w, BAR_H, label, colour, size=10, rx=3)]
    i, n = part
    return [rect(x, y, w, BAR_H, fill="#ffffff", stroke=colour.stroke, dash="3 2", rx=3),
            rect(x + i * w / n, y, w / n, BAR_H, colour, rx=3),
            text(x + w / 2, y + BAR_H / 2 + 4, label, size=10, anchor="middle")]


def gpu(x: float, y: float, rank: int, layout: str) -> list[str]:
    parts = [rect(x, y, GPU_W, 190, fill="#f6f8fa", stroke="#57606a", rx=6),
             text(x + GPU_W / 2, y + 17, f"GPU {rank}", anchor="middle", weight="bold")]
    inner_x, inner_w, row_y = x + 10, GPU_W - 20, y + 28
    shard = (rank, GPUS) if layout == "fsdp" else None
    parts += _bar(inner_x, row_y, inner_w, "dense" + (" ½" if shard else ""), DENSE, shard)
    row_y += BAR_H + 12
    per_rank = NUM_EXPERTS // GPUS
    for e in range(NUM_EXPERTS):
        held = layout != "ep" or e // per_rank == rank
        label = f"expert {e}" + (" ½" if shard else "")
        if held:
            parts += _bar(inner_x, row_y, inner_w, label, EXPERTS[e], shard)
        else:
            parts.append(rect(inner_x, row_y, inner_w, BAR_H, fill="none", stroke="#d0d7de",
                              dash="2 3", rx=3))
            parts.append(text(inner_x + inner_w / 2, row_y + BAR_H / 2 + 4, f"(expert {e}: on "
                              f"GPU {e // per_rank})", size=9.5, anchor="middle", fill=MUTED))
        row_y += BAR_H + 8
    return parts


PANELS = [
    ("dp", "Data parallel (replicas)",
     ["each GPU: all weights, their gradients", "and AdamW state"],
     ["per step: all-reduce every gradient"]),
    ("fsdp", "FSDP2 (fully_shard)",
     ["each GPU: ½ of every parameter, its", "gradient and AdamW state"],
     ["per layer: all-gather its weights", "(forward and backward), free them;",
      "reduce-scatter the gradients"]),
    ("ep", "Expert parallel (ep = 2)",
     ["each GPU: the dense weights and", "2 of the 4 experts (0–1, 2–3)"],
     ["per MoE layer: all-to-all the token", "copies there and back (forward and",
      "backward); all-reduce dense gradients"]),
]


def svg() -> str:
    fig = Figure(16 + 3 * PANEL_W + 8, 432, TITLE, DESC)
    fig.heading("Where the weights live on 2 GPUs: the dense weights and 4 experts")
    for i, (layout, name, holds, traffic) in enumerate(PANELS):
        x = 16 + i * PANEL_W
        fig.add(rect(x, 44, PANEL_W - 12, 334, fill="none", stroke="#d0d7de", rx=8),
                text(x + 12, 66, name, size=12.5, weight="bold"))
        for rank in range(GPUS):
            fig.add(*gpu(x + 10 + rank * (GPU_W + 8), 80, rank, layout))
        fig.add(lines(x + 12, 292, holds, size=10.5),
                lines(x + 12, 330, traffic, size=10.5, fill=MUTED))
    fig.add(lines(16, 400, [
        "In all three every GPU trains on its own tokens. dense = attention, router, norms, "
        "embeddings, lm_head. With dp × ep GPUs (EP), dense gradients are all-reduced",
        "over all GPUs and each expert's over the GPUs holding the same experts (its dp group)."],
        size=10.5, fill=MUTED))
    return fig.render()


def main(out_dir=None):
    return save(__file__, svg(), out_dir)


if __name__ == "__main__":
    print(f"wrote {main()}")
