"""Exercise checks: run a learner's function on random and edge-case inputs against the package's
own implementation, and say in one sentence what is wrong.

    ok = checks.check_route(route)        # prints a pass, "not implemented yet" or a diagnosis
    route = checks.pick(route, checks.reference.route, ok)   # later cells go on either way

Every `check_<name>(learner_fn)`:

* builds its inputs from fixed seeds (the same cases on every run): random inputs plus the edge
  cases where MoE code breaks - ties in top-k, an expert that receives no tokens, sizes that are
  not multiples of 32, bf16 inputs, all-zero MXFP8 blocks;
* compares the learner's results with the package (`model.route`, `routing.permute`,
  `experts.NaiveExperts`, `quant.mxfp8_quantize(rule="te")`, `quant.per_tensor_quantize`,
  `distributed.exchange_counts`, ...), never with a copy of the solution;
* checks the contract the later cells rely on, not only the values: dtypes (int64 expert ids,
  float32 routing weights), shapes, Python types (an int64 tensor of split sizes), contiguity
  where a GEMM or a collective needs it, the device argument (on "meta"), inputs left unchanged
  (the learner gets copies; one changed in place fails) - so a function that passes is one the
  notebook can use;
* runs a function that takes a process group on real ones: gloo groups of fresh processes
  (`moe_tutorial.parallel.ranks`), where the learner's function arrives as its source;
* prints one line and returns True / False. It never raises into the notebook: a stub's
  NotImplementedError prints "not implemented yet", an exception inside the learner's function
  is reported with the case that caused it, and a failure of the check itself says so.

`pick` hands the later cells the learner's function only when `passed` is True and that very
function passed its check (one redefined since is untested), else `reference`, which holds the
package's implementation of every exercise with the exercise's signature. `torch_ops` holds
the three `te.ops` the grouped MLP is built from, in plain PyTorch (`experts.torch_ops`, for
machines without Transformer Engine), `grade_speedup` is exercise 06's measurement grading the
learner's speedup model in one sentence, and `summary()` prints what every check in this Python
process reported.

`harness` runs the checks; every exercise has a module of its own, named after its notebook
(`router_and_loop` for exercises/01_router_and_loop.ipynb, ...), with its cases, verifiers and
reference adapters. This module is the API the notebooks use.
"""

from types import SimpleNamespace

from ...moe import model, routing
from ...moe.experts import torch_ops
from ...parallel import distributed
from .expert_parallel_dispatch import check_exchange_counts, check_received_experts
from .fp8_linear import check_fp8_linear, reference_fp8_linear
from .harness import (
    CHECK_ERROR,
    FAILED,
    NOT_IMPLEMENTED,
    PASSED,
    RESULTS,
    Case,
    Failure,
    pick,
    summary,
)
from .mxfp8_blocks import check_quantize, reference_quantize
from .permute_and_grouped_gemm import (
    check_grouped_mlp,
    check_permute,
    reference_grouped_mlp,
    reference_permute,
)
from .router_and_loop import (
    check_expert_loop,
    check_load_balancing_loss,
    check_route,
    reference_expert_loop,
)
from .step_speedup import check_predict_speedup, grade_speedup, no_prediction
from .te_ops_grouped_mlp import (
    check_build_grouped_mlp,
    check_te_ops_expert_layer,
    reference_build_grouped_mlp,
    reference_te_ops_expert_layer,
)
from .your_model import check_route_sigmoid, check_update_correction_bias

reference = SimpleNamespace(
    route=model.route,
    load_balancing_loss=routing.load_balancing_loss,
    expert_loop=reference_expert_loop,
    permute=reference_permute,
    grouped_mlp=reference_grouped_mlp,
    quantize=reference_quantize,
    build_grouped_mlp=reference_build_grouped_mlp,
    te_ops_expert_layer=reference_te_ops_expert_layer,
    fp8_linear=reference_fp8_linear,
    predict_speedup=no_prediction,
    exchange_counts=distributed.exchange_counts,
    received_experts=distributed.received_experts,
    route_sigmoid=routing.route_sigmoid,
    update_correction_bias=routing.update_correction_bias,
)

__all__ = [
    "CHECK_ERROR", "FAILED", "NOT_IMPLEMENTED", "PASSED", "RESULTS", "Case", "Failure",
    "check_build_grouped_mlp", "check_exchange_counts", "check_expert_loop", "check_fp8_linear",
    "check_grouped_mlp", "check_load_balancing_loss", "check_permute", "check_predict_speedup",
    "check_quantize", "check_received_experts", "check_route", "check_route_sigmoid",
    "check_te_ops_expert_layer", "check_update_correction_bias", "grade_speedup", "pick",
    "reference", "summary", "torch_ops",
]
