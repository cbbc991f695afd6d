"""The training step's speed of light: the time each part of the step cannot go below on a
device, from the model's shapes and the device's measured rates, next to what the profiler
measured (`step_profile.StepBreakdown`).

    rates = speed_of_light.Rates.from_committed()              # or measure_rates(device, ...)
    work = speed_of_light.step_work(cfg, batch=2, seq_len=4096, precision="fp8")
    floor = speed_of_light.floor(work, rates)                  # ms per part, and the total
    print(speed_of_light.format_table(floor, speed_of_light.compare(floor, breakdown)))

What a part must do (`step_work`): its tensor-core FLOPs (forward + backward) and the bytes it
must move through HBM at least — every tensor it reads read once, every tensor it writes written
once, nothing re-read that an ideal kernel would keep on chip. Its floor (`floor`):

    compute-bound parts (the GEMMs, attention)  max(FLOPs / FLOP rate, bytes / bandwidth)
    memory-bound parts (everything else)        bytes / bandwidth

A GEMM's floor is the larger of the two because its kernel must do both and at best overlaps
them; the elementwise parts' FLOPs run on CUDA cores at a few FLOPs per byte, far below the rate
that would bind, so only their bytes count. The step's floor is the sum of its parts' floors
(parts do not overlap in this single-stream step).

Parts (`PARTS`) and the profiler part each is compared with (`PROFILER_PART`): the profiler
classes every matmul kernel as "GEMMs", so the expert GEMMs, the attention projections, the
router and the lm_head are summed for that row; the loss (log-softmax and its gradient over the
logits) is "norms & elementwise" in the profiler's rules, and the token embedding's lookup is
"other". Nothing in a one-GPU step is communication, and no floor is spent waiting for launches.

Rates (`Rates`): dense GEMM rates in bf16 and FP8, the expert GEMMs' rate at the step's own
shapes (optional: the dense rate stands in, with a note), achievable HBM bandwidth, and causal
attention's rate (optional: the dense bf16 rate stands in, with a note). A rate nobody measured
is never guessed: the parts that need it are "not computable", and the step's floor is then a
partial sum, marked as a lower bound.

Read in this order, the floor's arithmetic first:

    work.py        the work of one step, per part (`step_work`, `PARTS`)
    rates.py       what a device achieves (`Rates`), measured now or read from a report
    floors.py      the floor at those rates (`floor`, `step_floors`)
    comparison.py  a measured step against its floor (`compare`, `format_table`, `section`),
                   the notebooks' bars, and the command line's `run`
"""

from .comparison import (
    Comparison,
    Row,
    chapter_comparisons,
    committed_section,
    compare,
    floor_bars,
    for_course_bars,
    format_table,
    run,
    section,
    show_against_floor,
)
from .floors import Floor, PartFloor, floor, step_floors
from .rates import RATE_FIELDS, STAND_INS, Rates, expert_gemm_shapes, measure_rates
from .work import (
    FP8_BYTES,
    FP8_COPIES,
    GEMM_OPERAND_FORMATS,
    OPTIMIZERS,
    PARTS,
    PROFILER_PART,
    ROUTER_LOGIT_BYTES,
    PartWork,
    StepWork,
    adamw_bytes_per_parameter,
    step_work,
)

__all__ = [
    "FP8_BYTES", "FP8_COPIES", "GEMM_OPERAND_FORMATS", "OPTIMIZERS", "PARTS", "PROFILER_PART",
    "RATE_FIELDS", "ROUTER_LOGIT_BYTES", "STAND_INS", "Comparison", "Floor", "PartFloor",
    "PartWork", "Rates", "Row", "StepWork", "adamw_bytes_per_parameter", "chapter_comparisons",
    "committed_section", "compare", "expert_gemm_shapes", "floor", "floor_bars",
    "for_course_bars", "format_table", "measure_rates", "run", "section", "show_against_floor",
    "step_floors", "step_work",
]
