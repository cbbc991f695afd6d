"""The measuring primitives every benchmark uses: clocks, FLOP counts."""

import time

import pytest

from moe_tutorial.moe.config import preset
from moe_tutorial.perf import timing


def test_time_fn_reports_the_median():
    calls = []
    t = timing.time_fn(lambda: calls.append(1), warmup=2, iters=5)
    assert len(calls) == 7 and t.iters == 5 and t.timer == "perf_counter"
    assert t.min_ms <= t.median_ms <= t.max_ms
    with pytest.raises(ValueError, match="iters"):
        timing.time_fn(lambda: None, iters=0)


def test_time_fns_interleaves_the_variants():
    order = []
    timings = timing.time_fns({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                             warmup=1, iters=3)
    assert order == ["a", "b"] * 4  # one warm-up round, then three timed rounds, a and b alternating
    assert set(timings) == {"a", "b"} and all(t.iters == 3 for t in timings.values())


def test_time_fns_spreads_a_slow_spell_over_all_variants():
    # The machine is slow for the first three calls: timed one after the other, variant "first"
    # would absorb all of it; interleaved, each variant gets at most two slow calls of three.
    calls = []

    def work():
        calls.append(1)
        time.sleep(0.02 if len(calls) <= 3 else 0.0)

    timings = timing.time_fns({"first": work, "second": work}, warmup=0, iters=5)
    assert timings["first"].median_ms < 10 and timings["second"].median_ms < 10


def test_flop_counts():
    # 18·T·k·H·I for forward + backward of the expert MLP
    assert timing.expert_mlp_flops(8192, 2, 4096, 14336) == 18 * 8192 * 2 * 4096 * 14336
    assert timing.expert_mlp_flops(10, 1, 2, 3, backward=False) == 6 * 10 * 2 * 3
    assert timing.tflops(2e12, 1000.0) == pytest.approx(2.0)
    cfg = preset("mixtral-2l")
    assert timing.model_flops_per_token(cfg, 4096) == 6 * cfg.active_params_per_token() + 12 * 2 * 4096 * 4096
