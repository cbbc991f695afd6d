"""The benchmarks: the expert layer alone and the whole training step, every variant checked
against a reference before it is timed, with the run's environment and MFU peaks recorded —
what `python -m moe_tutorial bench` runs and `benchmarks/results/` holds. The clocks, FLOP
counts and peaks it measures with are in `timing`.

Read in this order:

    expert_layer.py   the expert layer alone: its shapes, routings and variants, each checked
                      against the naive loop, then timed (`bench_expert_layer`)
    variants.py       the training step's variants (`Variant`, the named sets `VARIANTS`) and
                      the candidate changes beside the ladder variant each changes
    train_step.py     the training step timed per variant (`bench_train_step`), and profiled
    loss_curves.py    do the variants train alike (`train_loss_curves`)
    summary.py        the headline ratios, the printed tables, the whole run (`run`) and one
                      report merged from a run's parts (`merge_reports`)

step_profile, idle_gaps and benchmarks/ build their own steps from its pieces: `timed_step`,
`random_batch`, `initial_loss`, `sync_record` and `classify_error`.
"""

from .expert_layer import (
    EXPERT_SHAPES,
    FAMILY_SHAPES,
    ROUTINGS,
    TOLERANCE,
    ExpertShape,
    bench_expert_layer,
    classify_error,
    expert_variants,
    make_routing,
    precision_kind,
)
from .loss_curves import train_loss_curves
from .summary import (
    EXPERT_HEADER,
    MFU_LEGEND,
    TRAIN_HEADER,
    best_step,
    check_run_arguments,
    default_preset,
    default_seq_len,
    format_expert_row,
    format_summary,
    format_train_row,
    merge_reports,
    run,
    step_floor_ms,
    summarize,
)
from .train_step import (
    bench_train_step,
    initial_loss,
    profile_train_step,
    random_batch,
    sync_record,
    timed_step,
)
from .variants import (
    BF16_AND_FP8,
    CANDIDATE_VARIANTS,
    COMPILED_ALONE,
    COMPILED_GROUPED_LINEAR,
    COMPILED_NORMS,
    COMPILED_STEPS,
    GPU_EXTRA_VARIANTS,
    LADDER,
    TRAIN_VARIANTS,
    VARIANTS,
    Variant,
    candidate_base,
    candidate_gains,
    committed_candidate_gains,
    committed_train_runs,
    hf_twin,
    row_precision,
    technique,
    variant,
)

__all__ = [
    "BF16_AND_FP8", "CANDIDATE_VARIANTS", "COMPILED_ALONE", "COMPILED_GROUPED_LINEAR", "COMPILED_NORMS", "COMPILED_STEPS",
    "EXPERT_HEADER", "EXPERT_SHAPES", "FAMILY_SHAPES", "GPU_EXTRA_VARIANTS", "LADDER", "MFU_LEGEND",
    "ROUTINGS", "TOLERANCE", "TRAIN_HEADER", "TRAIN_VARIANTS",
    "VARIANTS", "ExpertShape", "Variant", "bench_expert_layer", "bench_train_step", "best_step",
    "candidate_base", "candidate_gains", "check_run_arguments", "classify_error",
    "committed_candidate_gains",
    "committed_train_runs", "default_preset", "default_seq_len", "expert_variants",
    "format_expert_row", "format_summary", "format_train_row", "hf_twin",
    "initial_loss",
    "make_routing", "merge_reports", "precision_kind", "profile_train_step", "random_batch",
    "row_precision", "run", "step_floor_ms", "summarize", "sync_record", "technique",
    "timed_step", "train_loss_curves", "variant",
]
