"""permute_m_splits.svg (notebook 02): `moe_tutorial.moe.routing.permute` on the example of
routing_example.py — the 12 token copies sorted by expert (stable) into one buffer, each expert's
block padded with zero rows to a multiple of the alignment; tokens_per_expert, m_splits, offsets.

    python notebooks/figures/permute_m_splits.py
"""

from __future__ import annotations

import routing_example as ex
from svg import (
    EXPERTS,
    GREY,
    MONO,
    MUTED,
    Figure,
    box,
    bracket,
    curve,
    legend,
    line,
    lines,
    save,
    text,
)

TITLE = "Permute: token copies sorted by expert into one padded buffer"
DESC = ("Twelve token copies (6 tokens, top-2) are sorted by expert into one buffer, each token "
        "keeping its order within an expert, and each expert's block of rows is padded with zero "
        "rows up to a multiple of the alignment, 4 here: 3, 5, 0 and 4 real rows become m_splits "
        "4, 8, 0 and 4, with row offsets 4, 12, 12 and 16.")

LABEL_X, CELLS_X = 16, 168
COPY_Y, COPY_W, CELL_H = 66, 50, 26
BUF_Y, BUF_W = 176, 46


def _list(values) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def svg() -> str:
    copies, buffer = ex.copies(), ex.buffer()
    tokens, splits, ends = ex.tokens_per_expert(), ex.m_splits(), ex.offsets()
    fig = Figure(930, 424, TITLE, DESC)
    fig.heading(f"Permute: sort the {len(copies)} token copies by expert, pad each expert's rows "
                f"to a multiple of {ex.ALIGN}")
    fig.add(lines(LABEL_X, COPY_Y + 11, ["token copies", "(routing order)"]),
            lines(LABEL_X, BUF_Y + 11, ["permuted buffer", f"({sum(splits)} rows)"]))

    # where each copy lands: its row in the buffer
    row_of, row = {}, 0
    for expert, block in enumerate(buffer):
        for entry in block:
            if entry is not None:
                row_of[entry] = row
            row += 1
    for i, (t, j, expert) in enumerate(copies):
        x0 = CELLS_X + i * COPY_W + COPY_W / 2
        x1 = CELLS_X + row_of[(t, j)] * BUF_W + BUF_W / 2
        fig.add(curve(x0, COPY_Y + CELL_H, x1, BUF_Y, colour=EXPERTS[expert].stroke))
    for i, (t, j, expert) in enumerate(copies):
        fig.add(box(CELLS_X + i * COPY_W + 2, COPY_Y, COPY_W - 4, CELL_H,
                    f"{ex.TOKENS[t]}→E{expert}", EXPERTS[expert], size=10))
    fig.add(text(CELLS_X + len(copies) * COPY_W + 10, COPY_Y + 17, "stable sort by expert",
                 fill=MUTED, italic=True))

    row = 0
    for expert, block in enumerate(buffer):
        start = CELLS_X + row * BUF_W
        for entry in block:
            x = CELLS_X + row * BUF_W
            if entry is None:
                fig.add(box(x + 1, BUF_Y, BUF_W - 2, CELL_H, "pad 0", GREY, size=10, dash="3 2"))
            else:
                fig.add(box(x + 1, BUF_Y, BUF_W - 2, CELL_H, ex.TOKENS[entry[0]],
                            EXPERTS[expert], size=10))
            row += 1
        end = CELLS_X + row * BUF_W
        if block:
            pad = splits[expert] - tokens[expert]
            fig.add(bracket(start + 2, end - 2, BUF_Y + CELL_H + 10,
                            [f"E{expert}: {tokens[expert]} rows", f"+ {pad} pad = {splits[expert]}"]))
        else:  # an expert without tokens: an empty block, 0 rows
            fig.add(line(start, BUF_Y - 8, start, BUF_Y + CELL_H + 8,
                         colour=EXPERTS[expert].stroke, width=2),
                    text(start, BUF_Y - 13, f"E{expert}: 0 rows", anchor="middle", size=10))

    y = BUF_Y + CELL_H + 62
    fig.add(lines(LABEL_X, y, [
        f"tokens_per_expert = {_list(tokens)}",
        f"m_splits = {_list(splits)}",
        f"offsets = cumsum(m_splits) = {_list(ends)}"], leading=19, size=12, family=MONO),
        lines(LABEL_X + 362, y, [
            "real rows per expert (zeros included)",
            f"rows per expert, padded to a multiple of align = {ex.ALIGN} "
            "(te.GroupedLinear's m_splits)",
            "where each expert's rows end (torch._grouped_mm's offs)"], leading=19, fill=MUTED))
    fig.add(lines(LABEL_X, y + 72, [
        "Padding rows are zero and carry routing weight 0. Unpermute is the inverse: each token "
        "gathers its 2 rows (never a pad row),",
        "weights them and sums them. TE's alignment (get_align_size_for_quantization): 16 rows for "
        "FP8, 32 for MXFP8, 128 for NVFP4; 4 here."]))
    key, _ = legend(LABEL_X, 408, [(EXPERTS[e], f"expert E{e}") for e in range(ex.NUM_EXPERTS)]
                    + [(GREY, "padding row")])
    fig.add(key)
    return fig.render()


def main(out_dir=None):
    return save(__file__, svg(), out_dir)


if __name__ == "__main__":
    print(f"wrote {main()}")
