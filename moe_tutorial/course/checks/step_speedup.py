"""Exercise 06's check: that the speedup model behaves like the machine it models - a positive
number that grows with the number of experts (the loop pays its fixed costs once per expert, the
grouped path once) and tends to 1 as the per-launch cost goes to 0 (then both paths are the same
FLOPs at the same throughput). How close its numbers come is for the notebook's measurement."""

from __future__ import annotations

import math
import numbers

import torch

from .harness import Case, Failure, run_check

# The exercise's reference (`checks.reference.predict_speedup`): the course has no reference model

def no_prediction(*args, **kwargs):
    """no prediction: the course has no reference model, so a missing one shows as NaN"""
    return math.nan


# (tokens, top_k, hidden, intermediate, gflops) of the two sweeps: 8,192 token copies, so that
# every expert of the largest count gets tokens
_SWEEP_LAYER = (4096, 2, 512, 1024, 50_000.0)
_EXPERT_COUNTS = (2, 4, 8, 16, 32, 64, 128)
_SWEEP_LAUNCH_US = 10.0
_LAUNCH_COSTS = (10.0, 1.0, 0.1, 0.01, 0.001, 0.0)
_LAUNCH_EXPERTS = 32


def _prediction_cases() -> list[Case]:
    shapes = [(2, 2048, 2, 128, 256, 10.0, 50.0), (64, 2048, 2, 128, 256, 10.0, 50.0),
              (8, 16384, 2, 1024, 2816, 5.0, 500_000.0), (32, 8, 2, 64, 128, 10.0, 50.0),
              (8, 2048, 2, 128, 256, 0.0, 50.0)]
    names = ["2 experts, 2048 tokens", "64 experts, 2048 tokens", "a GPU-sized layer",
             "fewer token copies (16) than experts (32)", "no launch overhead (launch_us=0)"]
    cases = [Case(name, args) for name, args in zip(names, shapes)]
    tokens, top_k, hidden, intermediate, gflops = _SWEEP_LAYER
    cases.append(Case(f"more experts for the same tokens and FLOPs ({_EXPERT_COUNTS[0]} to "
                      f"{_EXPERT_COUNTS[-1]} experts: {tokens} tokens, top-{top_k}, "
                      f"{_SWEEP_LAUNCH_US:g} µs per launch)", (), {"sweep": "experts"}))
    cases.append(Case(f"the launch cost going to 0 (launch_us from {_LAUNCH_COSTS[0]:g} down to "
                      f"0: {_LAUNCH_EXPERTS} experts, {tokens} tokens, top-{top_k})", (),
                      {"sweep": "launch"}))
    return cases


def _as_number(got) -> float:
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
    return float(got)


def _verify_experts_sweep(case: Case, call) -> None:
    tokens, top_k, hidden, intermediate, gflops = _SWEEP_LAYER
    values = [_as_number(call(e, tokens, top_k, hidden, intermediate, _SWEEP_LAUNCH_US, gflops))
              for e in _EXPERT_COUNTS]
    case.info["values"] = values
    steps = list(zip(_EXPERT_COUNTS, values, _EXPERT_COUNTS[1:], values[1:]))
    if all(b > a for _, a, _, b in steps):
        return
    first, last = f"{values[0]:.3g}× at {_EXPERT_COUNTS[0]}", f"{values[-1]:.3g}× at {_EXPERT_COUNTS[-1]}"
    if all(math.isclose(v, values[0], rel_tol=1e-9) for v in values):
        raise Failure(f"your prediction is {first} experts and {last}: it must grow with the "
                      "number of experts - the loop pays its fixed costs once per expert that "
                      "gets tokens, the grouped path once for all of them")
    if all(b < a for _, a, _, b in steps):
        raise Failure(f"your prediction falls as the experts grow ({first}, {last}): the speedup "
                      "is loop time / grouped time, and the loop's time grows with the experts - "
                      "did you divide the grouped time by the loop's?")
    e_a, a, e_b, b = next(step for step in steps if not step[3] > step[1])
    raise Failure(f"your prediction does not grow from {e_a} to {e_b} experts ({a:.3g}× → "
                  f"{b:.3g}×): at fixed tokens and FLOPs, every expert more adds fixed costs to "
                  "the loop only")


def _verify_launch_sweep(case: Case, call) -> None:
    tokens, top_k, hidden, intermediate, gflops = _SWEEP_LAYER
    values = [_as_number(call(_LAUNCH_EXPERTS, tokens, top_k, hidden, intermediate, cost, gflops))
              for cost in _LAUNCH_COSTS]
    case.info["values"] = values
    if abs(values[-1] - 1) <= 1e-3 and abs(values[-2] - 1) <= 1e-2:
        return
    seen = ", ".join(f"{v:.3g}× at {c:g} µs" for c, v in zip(_LAUNCH_COSTS, values)
                     if c in (_LAUNCH_COSTS[0], 0.01, 0.0))
    raise Failure(f"as launch_us goes to 0 your prediction goes {seen}, not to 1: without launch "
                  "costs both paths are the same FLOPs at the same throughput - count the compute "
                  "time (FLOPs / throughput) once on each side, for all experts together")


def _verify_prediction(case: Case, call) -> None:
    sweep = case.info.get("sweep")
    if sweep == "experts":
        _verify_experts_sweep(case, call)
    elif sweep == "launch":
        _verify_launch_sweep(case, call)
    else:
        case.info["prediction"] = _as_number(call(*case.args))


def check_predict_speedup(learner_fn) -> bool:
    """`predict_speedup(num_experts, tokens, top_k, hidden, intermediate, launch_us, gflops)
    -> float`: a positive finite number for every case, growing with the number of experts and
    tending to 1 as launch_us goes to 0. Whether its numbers are right is for the measurement to
    say: the notebook grades them there."""
    cases = _prediction_cases()
    ok = run_check("check_predict_speedup", learner_fn, cases, _verify_prediction,
                   passed="your model grows with the number of experts and tends to 1 as the "
                          "launch cost goes to 0 (the measurement in section 2 grades its numbers)")
    if ok:
        experts, launch = (next(c.info["values"] for c in cases if c.info.get("sweep") == s)
                           for s in ("experts", "launch"))
        print(f"  {experts[0]:.3g}× at {_EXPERT_COUNTS[0]} experts → {experts[-1]:.3g}× at "
              f"{_EXPERT_COUNTS[-1]}; {launch[0]:.3g}× at {_LAUNCH_COSTS[0]:g} µs per launch → "
              f"{launch[-1]:.3g}× at 0; "
              + "; ".join(f"{c.name}: {c.info['prediction']:.3g}×" for c in cases
                          if "prediction" in c.info))
    return ok


def grade_speedup(num_experts: int, predicted: float, measured: float, loop_ms: float,
                  grouped_ms: float) -> str:
    """Exercise 06's measurement grading the learner's `predict_speedup`, in one sentence: right
    within a factor of 1.5, else how far off and in which direction (NaN: no prediction yet)."""
    seen = (f"the measurement says {measured:.2f}× (loop {loop_ms:.2f} ms, grouped "
            f"{grouped_ms:.2f} ms)")
    if math.isnan(predicted):
        return (f"– {num_experts} experts: no prediction to grade (predict_speedup is not done "
                f"yet); {seen}.")
    off = predicted / measured
    if 1 / 1.5 <= off <= 1.5:
        return (f"✓ {num_experts} experts: you predicted {predicted:.2f}×, {seen}: within a "
                "factor of 1.5.")
    why = ("too high: your model charges the loop more per expert, or the grouped path less, "
           "than this machine does" if off > 1 else
           "too low: on this machine the loop costs more per expert than your model charges "
           "(Python, allocations, more than one launch per op), or the grouped path less")
    return (f"✗ {num_experts} experts: you predicted {predicted:.2f}×, {seen}: "
            f"{max(off, 1 / off):.1f}× {why}.")
