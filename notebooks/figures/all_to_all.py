"""all_to_all.svg (notebook 07): expert parallelism's dispatch and combine between 2 ranks, as
`moe_tutorial.parallel.distributed.AllToAllDispatcher` runs them — each rank sorts its token copies by
expert (experts are sharded contiguously, so that sorts them by destination rank too), the ranks
exchange their counts, then the rows (with their routing weights) in one all-to-all; each rank
regroups what it received by local expert (from the counts alone: `regroup_by_expert`), runs its
local experts as one grouped GEMM and puts the outputs back in arrival order; the outputs travel
back along the same routes, and each token sums its k outputs. 3 tokens per rank, 4 experts, top-2.

    python notebooks/figures/all_to_all.py
"""

from __future__ import annotations

from svg import EXPERTS, MUTED, WHITE, Figure, arrow, box, fit_width, legend, lines, save, text

TITLE = "Expert parallelism on 2 ranks: all-to-all dispatch and combine"
DESC = ("Two ranks each hold 2 of 4 experts and 3 tokens routed top-2. Each rank sorts its 6 token "
        "copies by expert, which groups them by the rank that owns the expert; after exchanging "
        "counts, one all-to-all sends every group to its rank; each rank regroups the rows it "
        "received by expert, runs its local experts on them as one grouped GEMM and puts the "
        "outputs back in arrival order; a second all-to-all sends the outputs back along the same "
        "routes, and each token sums its two outputs.")

NUM_EXPERTS, TOP_K, RANKS = 4, 2, 2
PER_RANK = NUM_EXPERTS // RANKS
# rank -> its tokens' top-2 experts (the routing weights travel with the rows, not drawn)
ROUTING = {0: {"a0": (1, 2), "a1": (0, 3), "a2": (1, 3)},
           1: {"b0": (0, 1), "b1": (1, 0), "b2": (0, 2)}}

CELL, GROUP_GAP = 30, 12
HALF_X = (184, 590)  # where each rank's column starts
STEP_X = 16


def sorted_copies(rank: int) -> list[tuple[str, int]]:
    """The rank's (token, expert) copies sorted by expert, stable (routing.permute's order)."""
    copies = [(token, e) for token, experts in ROUTING[rank].items() for e in experts]
    return sorted(copies, key=lambda copy: copy[1])  # sorted() is stable


def tokens_per_expert(rank: int) -> list[int]:
    counts = [0] * NUM_EXPERTS
    for _, e in sorted_copies(rank):
        counts[e] += 1
    return counts


def sent(src: int, dst: int) -> list[tuple[str, int]]:
    """The rows rank `src` sends to rank `dst`: its copies for dst's experts, in sorted order."""
    return [c for c in sorted_copies(src) if c[1] // PER_RANK == dst]


def recv_counts(rank: int) -> list[list[int]]:
    """[source rank][local expert]: rows each rank sends to this rank's experts."""
    first = rank * PER_RANK
    return [tokens_per_expert(src)[first:first + PER_RANK] for src in range(RANKS)]


def regrouped(rank: int) -> list[list[tuple[str, int]]]:
    """The rows the rank received, regrouped by its local experts: each expert's rows from rank 0,
    then rank 1, ... (`distributed.regroup_by_expert`'s order), one group per local expert."""
    arrived = [c for src in range(RANKS) for c in sent(src, rank)]
    first = rank * PER_RANK
    return [[c for c in arrived if c[1] == e] for e in range(first, first + PER_RANK)]


def _cells(x: float, y: float, groups: list[list[tuple[str, int]]]) -> tuple[list[str], list[float]]:
    """Groups of cells left to right; returns (svg, the x centre of each group)."""
    parts, centres = [], []
    for group in groups:
        for i, (token, expert) in enumerate(group):
            parts.append(box(x + i * CELL + 1, y, CELL - 2, 24, token, EXPERTS[expert], size=10,
                             rx=3))
        centres.append(x + len(group) * CELL / 2)
        x += len(group) * CELL + GROUP_GAP
    return parts, centres


def _list(values) -> str:
    return "[" + ", ".join(_list(v) if isinstance(v, list) else str(v) for v in values) + "]"


def svg() -> str:
    fig = Figure(1000, 634, TITLE, DESC)
    fig.heading(f"Expert parallelism on {RANKS} ranks: dispatch and combine by all-to-all "
                f"({NUM_EXPERTS} experts, top-{TOP_K})")
    y_route, y_sort, y_recv, y_group, y_ret, y_back, y_tok = 78, 118, 214, 306, 378, 472, 546
    steps = [
        (y_sort, ["① sort the copies", "by expert (= by", "destination rank)"]),
        ((y_sort + y_recv) / 2 + 10,
         ["② all-to-all: counts", "first, then the rows", "(+ routing weights)"]),
        (y_group - 16, ["③ regroup by expert", "(from the counts),", "one grouped GEMM,",
                        "outputs back in", "arrival order"]),
        ((y_ret + y_back) / 2 + 18, ["④ all-to-all back,", "same routes"]),
        (y_tok, ["⑤ unpermute: each", "token sums its", "2 outputs"]),
    ]
    for y, label in steps:
        fig.add(lines(STEP_X, y + 4, label, size=10.5, leading=14))

    sort_centres, recv_centres, ret_centres, back_centres = {}, {}, {}, {}
    for rank in range(RANKS):
        x = HALF_X[rank]
        first = rank * PER_RANK
        fig.add(text(x, 56, f"rank {rank} (experts {first}, {first + PER_RANK - 1})",
                     weight="bold", size=12))
        route = " · ".join(f"{t}: " + " ".join(f"E{e}" for e in es) for t, es in ROUTING[rank].items())
        fig.add(text(x, y_route - 4, route, size=10.5))
        fig.add(text(x, y_sort - 8, f"tokens_per_expert {_list(tokens_per_expert(rank))}, "
                     f"send splits {_list([len(sent(rank, d)) for d in range(RANKS)])}",
                     size=10, fill=MUTED))
        parts, sort_centres[rank] = _cells(x, y_sort, [sent(rank, d) for d in range(RANKS)])
        fig.add(*parts)
        received = [sent(src, rank) for src in range(RANKS)]
        parts, recv_centres[rank] = _cells(x, y_recv, received)
        fig.add(*parts, text(x, y_recv + 37, f"from rank 0 | rank 1: recv_counts "
                             f"{_list(recv_counts(rank))}", size=10, fill=MUTED))
        rows = sum(len(g) for g in received)
        label = f"grouped GEMM, experts {first}, {first + PER_RANK - 1}: {rows} rows"
        fig.add(box(x, y_group - 30, max(rows * CELL + GROUP_GAP, fit_width(label, 10)), 22, label,
                    WHITE, size=10))
        groups = regrouped(rank)
        parts, _ = _cells(x, y_group, groups)
        width = rows * CELL + len(groups) * GROUP_GAP
        fig.add(*parts, lines(x + width + 4, y_group + 9, ["by expert, from", "the counts"],
                              size=10, fill=MUTED, leading=13))
        parts, ret_centres[rank] = _cells(x, y_ret, received)
        width = rows * CELL + RANKS * GROUP_GAP
        fig.add(*parts, lines(x + width + 4, y_ret + 9, ["outputs, in", "arrival order"],
                              size=10, fill=MUTED, leading=13))
        parts, back_centres[rank] = _cells(x, y_back, [sent(rank, d) for d in range(RANKS)])
        width = sum(len(sent(rank, d)) for d in range(RANKS)) * CELL + RANKS * GROUP_GAP
        fig.add(*parts, lines(x + width + 4, y_back + 9, ["outputs back,", "in sorted order"],
                              size=10, fill=MUTED, leading=13))
        for i, token in enumerate(ROUTING[rank]):
            fig.add(box(x + i * 46, y_tok - 10, 40, 24, token, WHITE, size=10, rx=3))

    for src in range(RANKS):
        for dst in range(RANKS):
            colour = "#555555" if src == dst else "#b42318"
            fig.add(arrow(sort_centres[src][dst], y_sort + 27, recv_centres[dst][src], y_recv - 4,
                          colour=colour, width=1.4),
                    arrow(ret_centres[dst][src], y_ret + 27, back_centres[src][dst], y_back - 4,
                          colour=colour, width=1.4))
    for rank in range(RANKS):
        x = HALF_X[rank]
        fig.add(arrow(x + 90, y_back + 27, x + 66, y_tok - 13))
    key, _ = legend(HALF_X[0], 594, [(EXPERTS[e], f"expert {e}") for e in range(NUM_EXPERTS)])
    fig.add(key, lines(STEP_X, 618, [
        "red: rows that cross to the other rank; grey: rows that stay. Backward sends the "
        "gradients back along the same routes (all_to_all_single_autograd)."], size=10.5,
        fill=MUTED))
    return fig.render()


def main(out_dir=None):
    return save(__file__, svg(), out_dir)


if __name__ == "__main__":
    print(f"wrote {main()}")
