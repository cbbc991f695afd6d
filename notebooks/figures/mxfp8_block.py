"""mxfp8_block.svg (notebook 03): one MXFP8 block — 32 consecutive values sharing one E8M0
power-of-two scale, TE's scale rule, on the worked example of `moe_tutorial.precision.quant` (a block
holding 480, -3.3 and 0.01) — then the rowwise (1 × 32) and columnwise (32 × 1) blocks of a
64 × 64 matrix (TE's MXFP8Quantizer: `get_scale_shape`, scales [64, 2] and [2, 64]) and why an
expert's rows are padded to 32 (TE's `get_align_size_for_quantization`).

    python notebooks/figures/mxfp8_block.py
"""

from __future__ import annotations

import math

from fp8_number_line import E4M3, sup
from svg import (
    BLUE,
    GREEN,
    GREY,
    MUTED,
    ORANGE,
    PURPLE,
    Figure,
    arrow,
    box,
    line,
    lines,
    rect,
    save,
    text,
)

TITLE = "MXFP8: 32 values share one power-of-two scale, kept rowwise and columnwise"
DESC = ("One MXFP8 block is 32 consecutive values that share one E8M0 byte, a power-of-two scale "
        "chosen so the block's largest value fits E4M3 (480 gets scale 2^1), and 32 E4M3 elements. "
        "A matrix is quantized twice, in 1 by 32 blocks along its rows and in 32 by 1 blocks down "
        "its columns; those 32-row blocks are why each expert's rows are padded to a multiple of 32.")

BLOCK = 32
EXAMPLE = {4: 480.0, 13: -3.3, 25: 0.01}  # position in the block -> value (29 others in [-3, 3])


def te_scale_exponent(amax: float) -> int:
    """TE's rule: the smallest E with amax / 2^E <= 448 (no element saturates)."""
    return math.ceil(math.log2(amax / E4M3.max))


def e4m3_round(x: float) -> tuple[int, float]:
    """(code, value) of x in E4M3, round to nearest, ties to even (x within range)."""
    values = [0.0] + E4M3.values()  # index = code of the positive value
    code = min(range(len(values)), key=lambda c: (abs(values[c] - abs(x)), c % 2))
    return (0x80 if x < 0 else 0) | code, math.copysign(values[code], x)


def block_panel(y: float) -> list[str]:
    x0, cell = 150, 22
    amax = max(abs(v) for v in EXAMPLE.values())
    e = te_scale_exponent(amax)
    parts = [lines(16, y + 10, ["one block:", f"{BLOCK} values", "along K"], leading=14)]
    for i in range(BLOCK):
        value = EXAMPLE.get(i)
        colour = ORANGE if value is not None else BLUE
        parts.append(rect(x0 + i * cell, y, cell, 22, colour, rx=0))
        if value is not None:
            parts.append(text(x0 + i * cell + cell / 2, y - 6, f"{value:g}".replace("-", "−"),
                              anchor="middle", size=10, weight="bold"))
    right = x0 + BLOCK * cell
    parts.append(text(right, y + 36, f"the other {BLOCK - len(EXAMPLE)} values lie in [−3, 3]",
                      size=10, fill=MUTED, anchor="end"))

    # the scale byte and the 32 elements, with the worked numbers
    sy = y + 48
    parts += [
        arrow(x0 + 16, y + 26, x0 + 16, sy - 3),
        box(x0 - 20, sy, 150, 40, ["1 scale byte (E8M0)", f"{sup(e)}: byte 127 + {e} = {127 + e}"],
            PURPLE, size=10.5),
        arrow(x0 + 250, y + 26, x0 + 250, sy - 3),
        box(x0 + 150, sy, right - x0 - 150, 40,
            [f"{BLOCK} E4M3 elements (1 byte each): x / {sup(e)}, rounded"], BLUE, size=10.5),
    ]
    rows = []
    for value in EXAMPLE.values():
        code, stored = e4m3_round(value / 2 ** e)
        subnormal = abs(stored) < E4M3.min_normal  # written as a multiple of the smallest step
        step = round(math.log2(E4M3.min_subnormal))
        stored_text = (f"{round(stored / E4M3.min_subnormal)}×{sup(step)}" if subnormal
                       else f"{stored:g}")
        rows.append(f"{value:g} → {value / 2 ** e:g} → {stored_text} (0x{code:02X}) → "
                    f"× {2 ** e:g} = {stored * 2 ** e:.10g}".replace("-", "−"))
    parts.append(lines(x0, sy + 60, [
        f"TE's scale: the smallest 2^E with amax / 2^E ≤ {E4M3.max:g}: amax {amax:g} → E = {e}, "
        "so no element saturates"] + rows, leading=15, size=10.5))
    parts.append(text(x0, sy + 60 + 4 * 15 + 4, f"storage: {BLOCK} + 1 bytes per {BLOCK} values = "
                      f"{1 + 1 / BLOCK:g} bytes per value (bf16: 2)", size=10.5, weight="bold"))
    return parts


def matrix_panel(x: float, y: float, columnwise: bool) -> list[str]:
    """A 64 × 64 matrix (3 px per element) with its block boundaries and a few blocks shaded."""
    n, px = 64, 3
    side = n * px
    colour = GREEN if columnwise else ORANGE
    parts = [rect(x, y, side, side, fill="#f6f8fa", stroke="#1f2328", rx=0)]
    if columnwise:
        parts.append(line(x, y + BLOCK * px, x + side, y + BLOCK * px, colour="#1f2328", dash="4 2"))
        for col, row0 in ((0, 0), (3, 0), (6, 32), (21, 32), (40, 0), (63, 32)):
            parts.append(rect(x + col * px, y + row0 * px, px, BLOCK * px, colour, rx=0))
        name, shape = "columnwise: 32 × 1 blocks", "scales [2, 64]"
        use = ["for dW = dYᵀ·X (wgrad),", "which sums over the rows"]
    else:
        parts.append(line(x + BLOCK * px, y, x + BLOCK * px, y + side, colour="#1f2328", dash="4 2"))
        for row, col0 in ((0, 0), (3, 0), (6, 32), (21, 32), (40, 0), (63, 32)):
            parts.append(rect(x + col0 * px, y + row * px, BLOCK * px, px, colour, rx=0))
        name, shape = "rowwise: 1 × 32 blocks", "scales [64, 2]"
        use = ["for Y = X·Wᵀ (forward),", "which sums over K"]
    parts += [text(x, y - 24, name, weight="bold"),
              text(x, y - 9, f"64 × 64 matrix, {shape}", size=10, fill=MUTED),
              lines(x, y + side + 16, use, size=10.5, leading=14)]
    return parts


def alignment_panel(x: float, y: float) -> list[str]:
    """Two experts' rows (20 and 44) in 32-row columnwise blocks, without and with padding."""
    px, width = 2, 46
    parts = [text(x, y - 24, "why 32 rows per expert", weight="bold"),
             text(x, y - 9, "E0: 20 rows, E1: 44 rows", size=10, fill=MUTED)]
    for i, (label, blocks, ok) in enumerate((
            ("unpadded", [(20, 0), (44, 1)], False),
            ("padded to 32", [(20, 0), (12, None), (44, 1), (20, None)], True))):
        cx = x + 20 + i * 110
        row = 0
        for rows, expert in blocks:
            colour = GREY if expert is None else (BLUE, ORANGE)[expert]
            parts.append(rect(cx, y + row * px, width, rows * px, colour, rx=0))
            parts.append(text(cx + width / 2, y + (row + rows / 2) * px + 4,
                              "pad" if expert is None else f"E{expert}", size=9.5, anchor="middle"))
            row += rows
        for b in range(row // BLOCK + 1):
            parts.append(line(cx - 6, y + b * BLOCK * px, cx + width + 6, y + b * BLOCK * px,
                              colour="#1f2328", dash="4 2"))
        verdict = (["every block in", "one expert ✓"] if ok else
                   ["rows 0–31 mix", "E0 and E1 ✗"])
        parts.append(lines(cx + width / 2, 96 * px + y + 16, [label] + verdict, size=10,
                           anchor="middle", leading=13))
    return parts


def svg() -> str:
    fig = Figure(960, 580, TITLE, DESC)
    fig.heading("MXFP8: 32 values share one power-of-two scale; a matrix keeps two copies")
    fig.add(*block_panel(66))
    top = 330
    fig.add(line(14, top - 50, 946, top - 50, colour="#d0d7de"),
            *matrix_panel(16, top, columnwise=False), *matrix_panel(250, top, columnwise=True),
            *alignment_panel(500, top))
    fig.add(lines(716, top + 8, [
        "TE quantizes a tensor both ways in",
        f"one pass: 2 × {1 + 1 / BLOCK:g} bytes per value.",
        "Weights keep both copies (forward,",
        "dgrad); an activation saved for the",
        "wgrad keeps its columnwise copy.",
        "",
        "A columnwise block must not mix",
        "two experts' rows: TE's alignment",
        "for MXFP8 is 32 rows per expert",
        "(get_align_size_for_quantization)."], size=10.5, leading=15))
    return fig.render()


def main(out_dir=None):
    return save(__file__, svg(), out_dir)


if __name__ == "__main__":
    print(f"wrote {main()}")
