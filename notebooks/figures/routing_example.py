"""The routing example of the figures of notebooks 01 and 02 (not a figure itself): 6 tokens,
4 experts, top-2, alignment 4, and what `moe_tutorial.moe.routing.permute` makes of it, computed
here in plain Python (tests/notebooks/test_figures.py checks it against routing.permute).

Expert 2 gets no token (the loop skips it, its m_split is 0) and the other experts' blocks
need 1, 3 and 0 padding rows: every case of the padding rule shows.
"""

from __future__ import annotations

NUM_EXPERTS, TOP_K, ALIGN = 4, 2, 4
TOKENS = tuple(f"t{t}" for t in range(6))
# token -> its top-2 (expert, routing weight), most probable first; each pair sums to 1, as the
# router's renormalised top-k weights do
ROUTING = (((1, 0.70), (0, 0.30)), ((3, 0.60), (1, 0.40)), ((0, 0.55), (3, 0.45)),
           ((1, 0.80), (3, 0.20)), ((1, 0.65), (0, 0.35)), ((3, 0.75), (1, 0.25)))


def weight_text(weight: float) -> str:
    """A routing weight as the figures print it: .70"""
    return f"{weight:.2f}".lstrip("0")


def copies() -> list[tuple[int, int, int]]:
    """The T·k token copies in routing order, copy t·k + j = (token t, slot j, expert)."""
    return [(t, j, expert) for t, choices in enumerate(ROUTING)
            for j, (expert, _) in enumerate(choices)]


def tokens_per_expert() -> list[int]:
    counts = [0] * NUM_EXPERTS
    for _, _, expert in copies():
        counts[expert] += 1
    return counts


def m_splits(align: int = ALIGN) -> list[int]:
    """Rows per expert after padding each expert's block to a multiple of `align`."""
    return [-(-n // align) * align for n in tokens_per_expert()]


def offsets(align: int = ALIGN) -> list[int]:
    """Cumulative row ends (torch._grouped_mm's `offs`)."""
    ends, total = [], 0
    for rows in m_splits(align):
        total += rows
        ends.append(total)
    return ends


def buffer(align: int = ALIGN) -> list[list[tuple[int, int] | None]]:
    """Per expert, its rows of the permuted buffer: (token, slot) of each copy, in token order
    (the sort is stable), then None for each padding row."""
    rows = [[(t, j) for t, j, e in copies() if e == expert] for expert in range(NUM_EXPERTS)]
    return [block + [None] * (size - len(block)) for block, size in zip(rows, m_splits(align))]
