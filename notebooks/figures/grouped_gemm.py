"""grouped_gemm.svg (notebook 02): one grouped GEMM over the permuted buffer of
permute_m_splits.svg — every expert's block of rows times its own weight matrix, Y_e = X_e W_eᵀ,
in one launch (`torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)`, as
`moe_tutorial.moe.experts.grouped_mm` calls it; TE's `GroupedLinear(num_gemms, in, out)(x, m_splits)`).

    python notebooks/figures/grouped_gemm.py
"""

from __future__ import annotations

import routing_example as ex
from svg import (
    EXPERTS,
    GREY,
    MONO,
    MUTED,
    Figure,
    arrow,
    box,
    line,
    lines,
    rect,
    save,
    text,
    vbracket,
)

TITLE = "A grouped GEMM: every expert's rows times its own weights, in one launch"
DESC = ("The permuted buffer X holds each expert's rows as one block (4, 8, 0 and 4 rows, padding "
        "included); one grouped GEMM multiplies each block by its own expert's weight matrix and "
        "writes the matching block of Y, all experts in a single kernel launch, where the loop "
        "launched one GEMM per expert.")

ROW_H = 15
TOP = 74
X_X, X_W = 96, 100  # the input buffer
W_X, W_SIZE = 392, 48  # the weight matrices
Y_X, Y_W = 660, 84  # the output buffer


def _list(values) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def _matrix(x: float, width: float, buffer, name: str) -> list[str]:
    """A buffer of rows, each expert's block in its colour, padding rows grey."""
    parts, row = [], 0
    for expert, block in enumerate(buffer):
        for entry in block:
            colour = GREY if entry is None else EXPERTS[expert]
            parts.append(rect(x, TOP + row * ROW_H, width, ROW_H, colour, rx=0))
            if entry is None:
                parts.append(text(x + width / 2, TOP + row * ROW_H + 10, "pad", size=9,
                                  anchor="middle", fill=MUTED))
            row += 1
    parts.append(rect(x, TOP, width, row * ROW_H, stroke="#1f2328", rx=0))
    parts.append(text(x + width / 2, TOP - 10, name, anchor="middle", weight="bold"))
    return parts


def svg() -> str:
    buffer, splits, ends = ex.buffer(), ex.m_splits(), ex.offsets()
    rows = sum(splits)
    fig = Figure(900, 456, TITLE, DESC)
    fig.heading("Grouped GEMM: each expert's block of rows times its own weights, one launch")
    fig.add(*_matrix(X_X, X_W, buffer, f"X [{rows}, K]"), *_matrix(Y_X, Y_W, buffer, f"Y [{rows}, N]"))

    starts = [end - size for end, size in zip(ends, splits)]
    slots = len(buffer)
    w_pitch = (rows * ROW_H) / slots
    for expert, (start, size) in enumerate(zip(starts, splits)):
        colour = EXPERTS[expert]
        wy = TOP + expert * w_pitch + (w_pitch - W_SIZE) / 2
        fig.add(box(W_X, wy, W_SIZE, W_SIZE, [f"W{expert}ᵀ", "[K, N]"], colour))
        if size:
            y0, y1 = TOP + start * ROW_H, TOP + (start + size) * ROW_H
            fig.add(vbracket(X_X - 6, y0 + 1, y1 - 1, [f"E{expert}", f"{size} rows"], right=False))
            mid_x, mid_w = (y0 + y1) / 2, wy + W_SIZE / 2
            fig.add(arrow(X_X + X_W + 4, mid_x, W_X - 4, mid_w, colour=colour.stroke),
                    arrow(W_X + W_SIZE + 4, mid_w, Y_X - 4, mid_x, colour=colour.stroke),
                    text(Y_X + Y_W + 10, mid_x + 4, f"Y{expert} = X{expert}·W{expert}ᵀ"))
        else:
            y = TOP + start * ROW_H
            fig.add(line(X_X - 3, y, X_X + X_W + 3, y, colour=colour.stroke, width=2),
                    text(X_X - 12, y + 4, f"E{expert}: 0 rows", anchor="end", size=10),
                    text(W_X + W_SIZE + 8, wy + W_SIZE / 2 + 4, "no rows: idle", size=10,
                         fill=MUTED))
    fig.add(text(W_X + W_SIZE / 2, TOP - 10, "Wᵀ [E, K, N]", anchor="middle", weight="bold"))

    y = TOP + rows * ROW_H + 36
    fig.add(text(16, y, "one launch, all experts:", weight="bold"),
            lines(16, y + 22, [
                f"torch._grouped_mm(X, W.transpose(-2, -1), offs={_list(ends)})",
                f"te.GroupedLinear({len(splits)}, K, N)(X, m_splits={_list(splits)})"],
                leading=20, size=12, family=MONO),
            lines(16, y + 74, [
                "The loop of notebook 01 launched one small GEMM per expert that got tokens (and a "
                "gather and a scatter around each); the grouped GEMM",
                "reads the row blocks from the offsets instead. Padding rows are zero, so their "
                "outputs are zero and unpermute never reads them."], fill=MUTED))
    return fig.render()


def main(out_dir=None):
    return save(__file__, svg(), out_dir)


if __name__ == "__main__":
    print(f"wrote {main()}")
