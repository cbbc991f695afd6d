"""idle_gaps: each idle gap of a profiled GPU step charged to what the GPU waited for. The
attribution is tested on hand-made kernels and host events (a CPU has no kernel timeline); the
committed H200 run is read back and checked against its own numbers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moe_tutorial.cli import main
from moe_tutorial.perf import idle_gaps
from moe_tutorial.perf.idle_gaps import AFTER_SYNC, HOST_BEHIND, SHORT, IdleGaps
from moe_tutorial.perf.step_parts import Kernel

TE_BACKWARD = ("/usr/lib/python3/site-packages/transformer_engine/pytorch/ops/basic/"
               "grouped_linear.py(1540): fuser_backward")


def _event(name, start, end, *, id=0, parent=None):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), id=id,
                           cpu_parent=parent)


def _called_from(*frames):
    """The Python-frame events a profile with Python stacks puts around an op, outermost first;
    returns the innermost."""
    parent = None
    for frame in frames:
        parent = _event(frame, 0, 1000, parent=parent)
    return parent


def _step():
    """One step, µs: kernel a [0, 100]; the host waits for it inside TE's backward (`.tolist()`,
    under torch's own frames), so b starts at 180 after an 80 µs gap; c and d run back to back
    (a 5 µs gap); e starts at 400, 100 µs after d, launched by a Python line of the model with
    no wait; the profiler's final wait returns after e."""
    tolist = _event("aten::to", 60, 120, id=1, parent=_called_from(
        TE_BACKWARD, "<built-in method tolist of Tensor object at 0x7f>"))
    wait = _event("cudaStreamSynchronize", 65, 105, id=2, parent=tolist)
    launch = _event("aten::mm", 390, 395, id=3, parent=_called_from(
        "/home/me/course/moe_tutorial/moe/model.py(10): forward",
        "torch/nn/modules/module.py(1782): _call_impl"))
    final = _event("cudaDeviceSynchronize", 396, 560, id=4)
    kernels = [Kernel("a", 0, 100, 0), Kernel("b", 180, 250, 0), Kernel("c", 250, 290, 0),
               Kernel("d", 295, 300, 0), Kernel("e", 400, 500, 3)]
    return kernels, [tolist, wait, launch, final]


def test_each_gap_is_charged_to_what_the_gpu_waited_for():
    kernels, host = _step()
    gaps = idle_gaps.attribute(kernels, host, steps=1, min_gap_us=20)
    rows = {(r["cause"], r["where"]): (r["ms"], r["gaps"]) for r in gaps.rows}
    assert rows == {
        (AFTER_SYNC, "transformer_engine/pytorch/ops/basic/grouped_linear.py(1540): "
                     "fuser_backward"): (pytest.approx(0.080), 1),
        (HOST_BEHIND, "moe_tutorial/moe/model.py(10): forward"): (pytest.approx(0.100), 1),
        (SHORT, "gaps under 20 µs"): (pytest.approx(0.005), 1)}
    assert gaps.idle_ms == pytest.approx(0.185) and gaps.busy_ms == pytest.approx(0.315)
    assert gaps.syncs_per_step == 1  # the final wait, after the last kernel, is not the step's
    assert gaps.ms_by_cause()[AFTER_SYNC] == pytest.approx(0.080)
    assert "1 waits per step" in gaps.sentence() and "fuser_backward" in gaps.sentence()


def test_results_are_per_step_and_overlapping_kernels_are_busy_once():
    kernels = [Kernel("a", 0, 100, 0), Kernel("b", 50, 150, 0),  # two streams overlap
               Kernel("c", 250, 300, 0)]
    gaps = idle_gaps.attribute(kernels, [], steps=2, min_gap_us=20)
    assert gaps.busy_ms == pytest.approx(0.200 / 2) and gaps.idle_ms == pytest.approx(0.100 / 2)
    assert gaps.rows[0]["cause"] == HOST_BEHIND and gaps.rows[0]["gaps"] == 0.5
    assert gaps.rows[0]["where"] == "(no host event launched the next kernel)"


def test_without_stacks_the_ops_name_the_place():
    outer = _event("_OperationFuserAutogradFunctionBackward", 0, 50)
    item = _event("aten::item", 1, 10, parent=outer)
    wait = _event("cudaStreamSynchronize", 2, 9, parent=item)
    assert idle_gaps.where(wait) == "aten::item in _OperationFuserAutogradFunctionBackward"
    assert idle_gaps.where(_event("cudaStreamSynchronize", 0, 1)) == "cudaStreamSynchronize"


def test_rows_beyond_the_largest_are_summed_per_cause():
    kernels = [Kernel(str(i), 1000 * i, 1000 * i + 10, i + 1) for i in range(20)]
    launchers = [_event("aten::mm", 1000 * i - 5, 1000 * i - 1, id=i + 1,
                        parent=_called_from(f"/m/moe_tutorial/moe/model.py({i}): forward"))
                 for i in range(20)]
    gaps = idle_gaps.attribute(kernels, launchers, steps=1)
    assert len(gaps.rows) == idle_gaps.MAX_ROWS + 1
    assert gaps.rows[-1]["where"] == f"{19 - idle_gaps.MAX_ROWS} other places"
    assert sum(r["ms"] for r in gaps.rows) == pytest.approx(gaps.idle_ms)


def test_round_trip_and_refusals():
    kernels, host = _step()
    gaps = idle_gaps.attribute(kernels, host, steps=1)
    assert IdleGaps.from_dict(gaps.to_dict()) == gaps
    edited = gaps.to_dict()
    edited["rows"][0]["ms"] += 1
    with pytest.raises(ValueError, match="must split the idle time exactly"):
        IdleGaps.from_dict(edited)
    with pytest.raises(ValueError, match="keys"):
        IdleGaps.from_dict({"idle_ms": 1})
    with pytest.raises(ValueError, match="no kernel ran"):
        idle_gaps.attribute([], host, steps=1)
    with pytest.raises(ValueError, match="min_gap_us"):
        idle_gaps.attribute(kernels, host, steps=1, min_gap_us=-1)


def test_a_real_profile_names_the_course_function_that_ran_the_op():
    """torch.profiler with Python stacks on this CPU: the grouped GEMM's op is charged to the
    package function that called it, past torch's module plumbing."""
    from torch.profiler import ProfilerActivity, profile

    from moe_tutorial.moe import experts
    from moe_tutorial.moe.dispatch import run_experts

    layer = experts.create("grouped_torch", 4, 16, 32)
    x, indices = torch.randn(8, 16), torch.randint(0, 4, (8, 2))
    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        run_experts(layer, x, indices, torch.rand(8, 2))
    op = next(e for e in prof.events() if e.name == "aten::_grouped_mm")
    assert idle_gaps.where(op).startswith("moe_tutorial/moe/experts/grouped_torch.py(")
    assert idle_gaps.where(op).endswith("): grouped_mm")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_cpu_step_is_refused_with_what_to_use_instead(capsys):
    with pytest.raises(ValueError, match="step_profile's 'cpu ops'"):
        idle_gaps.profile(lambda: None, device="cpu")
    assert main(["idle-gaps", "--variants", "ours_te_ops_fp8_compiled"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
    assert main(["idle-gaps", "--variants", "nope"]) == 2
    assert "unknown training variant 'nope'" in capsys.readouterr().err


def test_the_committed_h200_run_reads_back():
    run = idle_gaps.committed()
    assert run["environment"]["gpu"].startswith("NVIDIA H200")
    for name, entry in run["variants"].items():
        gaps = entry["gaps"]
        # the profiled span (busy + idle) is a step: near the unprofiled median, never far above
        assert 0.8 * entry["median_ms"] < gaps.busy_ms + gaps.idle_ms < 1.2 * entry["median_ms"]
        assert sum(r["ms"] for r in gaps.rows) == pytest.approx(gaps.idle_ms)


@pytest.mark.gpu
def test_a_cuda_step_splits_its_idle_time():
    from moe_tutorial.moe.config import preset
    from moe_tutorial.perf import bench

    config = preset("tiny").with_overrides(dtype="bfloat16")
    v = bench.variant("ours_grouped_torch_bf16")
    model, forward = v.build(config, "cuda")
    step = bench.timed_step(model, forward, v.optimizer(model, 1e-5),
                             bench.random_batch(config, 2, 64, "cuda"))
    gaps = idle_gaps.profile(step, device="cuda", steps=2, warmup=1)
    assert gaps.busy_ms > 0 and gaps.steps == 2
    assert sum(r["ms"] for r in gaps.rows) == pytest.approx(gaps.idle_ms)


def test_the_busy_table_sets_busy_time_against_busy_time():
    run = idle_gaps.committed()
    table = idle_gaps.busy_table(run)
    rows = {r[0]: r for r in table.rows}
    base = run["variants"]["hf_grouped_mm_compiled"]["gaps"].busy_ms
    fp8 = run["variants"]["ours_te_ops_fp8_compiled"]["gaps"].busy_ms
    assert rows["hf_grouped_mm_compiled"][-1] == "1.00x"
    assert rows["ours_te_ops_fp8_compiled"][-1] == f"{base / fp8:.2f}x"
