"""Exercise 06's check: that the speedup prediction is a usable number (the notebook grades it
against its measurement)."""

from __future__ import annotations

import math
import numbers

import torch

from .harness import Case, Failure, run_check

# The exercise's reference (`checks.reference.predict_speedup`): the course has no reference model

def no_prediction(*args, **kwargs):
    """no prediction: the course has no reference model, so a missing one shows as NaN"""
    return math.nan


def _prediction_cases() -> list[Case]:
    shapes = [(2, 2048, 2, 128, 256, 10.0, 50.0), (64, 2048, 2, 128, 256, 10.0, 50.0),
              (8, 16384, 2, 1024, 2816, 5.0, 500_000.0), (32, 8, 2, 64, 128, 10.0, 50.0),
              (8, 2048, 2, 128, 256, 0.0, 50.0)]
    names = ["2 experts, 2048 tokens", "64 experts, 2048 tokens", "a GPU-sized layer",
             "fewer token copies (16) than experts (32)", "no launch overhead (launch_us=0)"]
    return [Case(name, args) for name, args in zip(names, shapes)]


def _verify_prediction(case: Case, call) -> None:
    got = call(*case.args)
    if got is None:
        raise Failure("your function returned None: return the predicted speedup (loop time / "
                      "grouped time) as a number")
    if isinstance(got, torch.Tensor):  # the table formats it with :.2f, which needs 0 dimensions
        if got.dim() != 0:
            raise Failure(f"your prediction is a tensor of shape {list(got.shape)}; return one "
                          "number (float(...) or .item())")
        got = got.item()
    if not isinstance(got, numbers.Real) or isinstance(got, bool):
        raise Failure(f"return the predicted speedup as a number, not {type(got).__name__}")
    if not math.isfinite(got) or got <= 0:
        raise Failure(f"your prediction is {got}: a speedup is a ratio of two times, a finite "
                      "number > 0")
    case.info["prediction"] = got


def check_predict_speedup(learner_fn) -> bool:
    """`predict_speedup(num_experts, tokens, top_k, hidden, intermediate, launch_us, gflops)
    -> float`: only that it answers with a positive finite number for every case. Whether the
    prediction is right is for the measurement to say: the notebook grades it there."""
    cases = _prediction_cases()
    ok = run_check("check_predict_speedup", learner_fn, cases, _verify_prediction,
                   passed="a positive finite prediction for every case (the measurement in "
                          "section 2 grades it)")
    if ok:
        print("  " + "; ".join(f"{c.name}: {c.info['prediction']:.3g}×" for c in cases))
    return ok
