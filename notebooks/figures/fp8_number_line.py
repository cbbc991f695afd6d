"""fp8_number_line.svg (notebook 03): every positive finite E4M3 and E5M2 value on a log2 number
line — range (smallest subnormal, smallest normal, largest value) and spacing (8 values per
binade with 3 mantissa bits, 4 with 2). The values come from the formats' definition (OCP FP8,
as `moe_tutorial.precision.quant.decode_table` decodes them; tests/notebooks/test_figures.py compares the two).

    python notebooks/figures/fp8_number_line.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from svg import BLUE, MUTED, ORANGE, Figure, circle, line, lines, rect, save, text

TITLE = "E4M3 and E5M2: every positive value on a log scale"
DESC = ("Every positive finite value of the two FP8 formats on a log2 number line: E4M3 reaches "
        "from 2^-9 (smallest subnormal) to 448 with 8 values per binade, E5M2 from 2^-16 to 57344 "
        "with 4 values per binade; an inset shows their values between 1 and 2.")


@dataclass(frozen=True)
class Format:
    name: str
    exponent_bits: int
    mantissa_bits: int
    has_inf: bool  # E5M2 keeps IEEE's infinities; E4M3 ("fn") spends that exponent on numbers

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    def values(self) -> list[float]:
        """The positive finite values, ascending: codes 0x01 up to the largest finite code."""
        m, top = self.mantissa_bits, 2 ** self.exponent_bits - 1
        out = []
        for code in range(1, 128):
            exponent, mantissa = code >> m, code & (2 ** m - 1)
            if exponent == top and (self.has_inf or mantissa == 2 ** m - 1):
                continue  # inf / NaN
            if exponent == 0:  # subnormal
                out.append(mantissa * 2.0 ** (1 - self.bias - m))
            else:
                out.append((2 ** m + mantissa) * 2.0 ** (exponent - self.bias - m))
        return out

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def max(self) -> float:
        return self.values()[-1]


E4M3 = Format("E4M3", 4, 3, has_inf=False)
E5M2 = Format("E5M2", 5, 2, has_inf=True)
FORMATS = (E4M3, E5M2)

LOW, HIGH = -17, 17  # the axis, in log2
X0, X1 = 150, 920


def sup(k: int) -> str:
    """2 to the power k, written with superscript digits: 2⁻⁹."""
    return "2" + str(k).translate(str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹"))


def x_of(value: float) -> float:
    return X0 + (math.log2(value) - LOW) / (HIGH - LOW) * (X1 - X0)


def lane(fmt: Format, y: float, colour) -> list[str]:
    """One format: its normal range shaded, its subnormals lighter, one tick per value."""
    top, h = y, 30
    parts = [
        rect(x_of(fmt.min_subnormal), top, x_of(fmt.min_normal) - x_of(fmt.min_subnormal), h,
             fill="#f6f8fa", stroke=colour.stroke, dash="3 2", rx=2),
        rect(x_of(fmt.min_normal), top, x_of(fmt.max) - x_of(fmt.min_normal), h, colour, rx=2),
    ]
    for value in fmt.values():
        x = x_of(value)
        parts.append(line(x, top + 4, x, top + h - 4, colour=colour.stroke, width=0.8))
    binades = math.log2(fmt.max / fmt.min_subnormal)
    exp_min_sub = round(math.log2(fmt.min_subnormal))
    exp_min_norm = round(math.log2(fmt.min_normal))
    parts += [
        lines(16, top + 12, [fmt.name, f"{fmt.exponent_bits} exponent bits,",
                             f"{fmt.mantissa_bits} mantissa bits"], leading=13, size=11),
        text(x_of(fmt.min_subnormal), top - 6, f"{sup(exp_min_sub)} smallest subnormal", size=10,
             anchor="end"),
        text(x_of(fmt.min_normal), top + h + 14, f"{sup(exp_min_norm)} smallest normal", size=10,
             anchor="middle"),
        text(x_of(fmt.max), top - 6, f"largest {fmt.max:g}", size=10, anchor="middle"),
        text(x_of(fmt.max), top + h + 14,
             f"{len(fmt.values())} values over {binades:.1f} binades · "
             f"{2 ** fmt.mantissa_bits} per binade", size=10, anchor="end", fill=MUTED),
    ]
    return parts


def axis(y: float) -> list[str]:
    parts = [line(X0, y, X1, y, colour="#1f2328")]
    for k in range(LOW + 1, HIGH):
        x = x_of(2.0 ** k)
        major = k % 4 == 0
        parts.append(line(x, y, x, y + (6 if major else 3), colour="#1f2328"))
        if major:
            parts.append(text(x, y + 19, "1" if k == 0 else sup(k), anchor="middle"))
    parts.append(text(16, y + 4, "|value|, log scale", size=10, fill=MUTED))
    return parts


def inset(y: float) -> list[str]:
    """The values in [1, 2) on a linear scale: the spacing inside one power of two."""
    left, right = X0, X0 + 480
    parts = [text(16, y + 4, "between 1 and 2", weight="bold"),
             text(16, y + 18, "(linear scale)", size=10, fill=MUTED),
             line(left, y, right, y, colour="#1f2328")]
    for value in (1.0, 1.25, 1.5, 1.75, 2.0):
        x = left + (value - 1) * (right - left)
        parts += [line(x, y, x, y + 5, colour="#1f2328"),
                  text(x, y + 17, f"{value:g}", anchor="middle", size=10)]
    for fmt, colour, dy in ((E4M3, BLUE, -22), (E5M2, ORANGE, -10)):
        in_range = [v for v in fmt.values() if 1 <= v < 2]
        for value in in_range:
            x = left + (value - 1) * (right - left)
            parts.append(circle(x, y + dy, 3.2, colour))
        step = in_range[1] - in_range[0]
        parts.append(circle(right + 24, y + dy, 3.2, colour))
        parts.append(text(right + 34, y + dy + 4, f"{fmt.name}: {len(in_range)} values, "
                          f"{step:g} apart", size=10))
    return parts


def svg() -> str:
    fig = Figure(940, 330, TITLE, DESC)
    fig.heading("FP8: range and spacing of E4M3 and E5M2 (every positive finite value is a tick)")
    fig.add(*lane(E4M3, 64, BLUE), *lane(E5M2, 138, ORANGE), *axis(206), *inset(282))
    fig.add(text(X1, 312, "dashed: subnormals (fewer mantissa bits); E4M3 has no inf, E5M2 has "
                          "±inf", size=10, anchor="end", fill=MUTED))
    return fig.render()


def main(out_dir=None):
    return save(__file__, svg(), out_dir)


if __name__ == "__main__":
    print(f"wrote {main()}")
