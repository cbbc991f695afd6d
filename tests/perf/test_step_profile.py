"""step_profile: the rule table on real kernel and op names, the time attribution, the profiled
training steps of the course's chapters on this CPU, the breakdown's data and its display."""

import json
from types import SimpleNamespace

import pytest
import torch

from moe_tutorial import display
from moe_tutorial.moe.config import preset
from moe_tutorial.perf import bench, step_parts, step_profile
from moe_tutorial.perf.step_parts import IDLE, PARTS, part_of
from moe_tutorial.perf.step_profile import StepBreakdown

TINY = preset("tiny")


# ---------------------------------------------------------------------------------------------
# The rules, on names seen in real profiles (GPU names from the H200 benchmark's profile table
# and TE 2.20.2's kernel symbols; CPU names from this machine's profile of the tiny model)

@pytest.mark.parametrize("names, part", [
    # GEMMs: cuBLAS, CUTLASS (torch._grouped_mm), the CPU matmul ops and what they contain
    (("nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT",), "GEMMs"),
    (("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1",), "GEMMs"),
    (("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<cutlass::gemm::"
      "kernel::GemmUniversal<cutlass::gemm::GroupProblemShape<cute::tuple<int, int, int> >>>>",),
     "GEMMs"),
    (("aten::t", "aten::linear", "MoEBlock"), "GEMMs"),
    (("aten::mm", "MmBackward0", "autograd::engine::evaluate_function: MmBackward0"), "GEMMs"),
    (("aten::_grouped_mm",), "GEMMs"),
    # attention: flash, cuDNN's SDPA (named after wgmma), the CPU flash op's backward node
    (("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits"
      "<128, 64, 128, 8, cutlass::bfloat16_t>>",), "attention"),
    (("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_3_64x64x128",),
     "attention"),
    (("aten::empty", "ScaledDotProductFlashAttentionForCpuBackward0"), "attention"),
    # quantization: TE's casts, scales and swizzles; the Hadamard cast is neither GEMM nor Adam
    (("cast_transpose_optimized_kernel(__nv_bfloat16 const*, float const*, unsigned char*)",),
     "quantization"),
    (("void transformer_engine::dispatch::mxfp8::quantize_kernel::quantize_mxfp8_kernel<false>",),
     "quantization"),
    (("transformer_engine::delayed_scaling_recipe::amax_and_scale_update_impl::kernel",),
     "quantization"),
    (("void multi_tensor_apply_kernel<TensorListMetadata<3, false>, transformer_engine::"
      "multi_tensor_compute_scale::ComputeScaleAndScaleInvFunctor, float, bool, float>",),
     "quantization"),
    (("void transformer_engine::rht_gemm_device<__nv_bfloat16>",), "quantization"),
    (("void transformer_engine::hadamard_transform_kernel<__nv_bfloat16, 16>",), "quantization"),
    (("void transformer_engine::swizzle_row_scaling_kernel<int, 32>",), "quantization"),
    # permutation: TE's CUDA and triton kernels, torch's index / sort / top-k, the course's own
    (("void moe_permute_kernel<__nv_bfloat16, __nv_bfloat16, 128, true>",), "permutation"),
    (("_permute_kernel",), "permutation"),
    (("_row_id_map_pass_1_kernel",), "permutation"),
    (("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel>",),
     "permutation"),
    (("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<Policy900, false, long>",),
     "permutation"),
    (("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>",), "permutation"),
    (("aten::index_select", "_Dispatch"), "permutation"),
    (("aten::mul", "_CombineBackward"), "permutation"),
    (("aten::nonzero", "aten::where"), "permutation"),
    # optimizer: fused kernels by name, anything inside Optimizer.step by scope
    (("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous"
      " namespace)::FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::"
      "FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>>",), "optimizer"),
    (("void multi_tensor_apply_kernel<TensorListMetadata<4, false>, transformer_engine::"
      "multi_tensor_adam::AdamFunctor<float, float, float, float, long>>",), "optimizer"),
    (("aten::lerp_", "Optimizer.step#AdamW.step"), "optimizer"),
    # communication: NCCL (all-to-all is SendRecv; AllGather is no permutation), gloo, the wait
    (("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",), "communication"),
    (("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",), "communication"),
    (("_c10d_functional::wait_tensor", "PythonSubclass", "aten::sum"), "communication"),
    (("c10d::alltoall_base_",), "communication"),
    # norms & elementwise, the loss (its gather of the targets is not token movement)
    (("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",),
     "norms & elementwise"),
    (("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>",),
     "norms & elementwise"),
    (("Memcpy DtoD (Device -> Device)",), "norms & elementwise"),
    (("aten::rsqrt", "aten::rms_norm"), "norms & elementwise"),
    (("aten::gather", "_CrossEntropyWithGradient"), "norms & elementwise"),
    # other: the embedding's lookup, views, unknown kernels
    (("aten::index_select", "aten::embedding"), "other"),
    (("aten::view",), "other"),
    (("my_custom_fused_kernel<float>",), "other"),
])
def test_rules_put_real_names_in_their_part(names, part):
    assert part_of(*names) == part


def test_every_rule_names_a_part():
    assert {part for part, _ in step_parts.RULES} <= set(PARTS)
    assert set(step_parts.COLORS) == set(PARTS)


@pytest.mark.parametrize("names", [(), (3,), ("aten::mm", None)])
def test_part_of_refuses_what_is_not_names(names):
    with pytest.raises(ValueError, match="event names"):
        part_of(*names)


# ---------------------------------------------------------------------------------------------
# Attribution: innermost wins, overlaps share, gaps are idle

Unit = step_parts.Unit


def test_attribute_nested_ops_overlapping_kernels_and_gaps():
    units = [Unit(0, 10, 0, "GEMMs"),  # an op ...
             Unit(2, 4, 1, "permutation"),  # ... with an op inside it: 2 µs are permutation
             Unit(12, 16, 0, "attention"),  # two streams overlap on [14, 16]: 1 µs each
             Unit(14, 18, 0, "communication"),
             Unit(25, 40, 0, "optimizer")]  # runs past the region's end: clipped at 30
    parts = step_parts.attribute(units, 0, 30)
    assert parts["GEMMs"] == 8 and parts["permutation"] == 2
    assert parts["attention"] == 3 and parts["communication"] == 3
    assert parts["optimizer"] == 5
    assert parts[IDLE] == 9  # [10, 12] and [18, 25]
    assert sum(parts.values()) == 30


def test_attribute_refuses_an_empty_region():
    with pytest.raises(ValueError, match="empty"):
        step_parts.attribute([], 5, 5)


def _event(name, start, end, *, device, id=0, parent=None, thread=1):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                           device_type=device, id=id, cpu_parent=parent, thread=thread)


def test_kernels_take_the_part_of_the_op_that_launched_them():
    from torch.autograd import DeviceType

    step = _event("Optimizer.step#AdamW.step", 0, 50, device=DeviceType.CPU, id=1)
    add = _event("aten::add_", 1, 2, device=DeviceType.CPU, id=7, parent=step)
    kernels = [
        step_parts.Kernel("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>",
                             10, 12, launched_by=7),  # inside Optimizer.step
        step_parts.Kernel("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_mul<float>>",
                             20, 21, launched_by=0)]  # launched by no op
    units = step_parts.kernel_units([step, add], kernels)
    assert [u.part for u in units] == ["optimizer", "norms & elementwise"]
    assert [(u.start, u.end) for u in units] == [(10, 12), (20, 21)]


# ---------------------------------------------------------------------------------------------
# Profiled training steps of the course's chapters on this CPU (tiny model, small batch)

@pytest.fixture(scope="module")
def chapters():
    return step_profile.chapter_breakdowns(TINY, upto="fp8", device="cpu", batch=2, seq_len=32,
                                           steps=1, warmup=1)


def test_chapters_profile_each_step_variant_and_say_what_they_skipped(chapters):
    assert list(chapters.breakdowns) == ["naive loop", "grouped GEMM",
                                         "te.ops grouped MLP (PyTorch counterpart)"]
    for breakdown in chapters.breakdowns.values():
        assert breakdown.source == "cpu ops" and breakdown.device == "cpu"
        assert sum(breakdown.part_ms.values()) == pytest.approx(breakdown.total_ms)
        assert breakdown.part_ms[IDLE] >= 0
        # every training step multiplies, moves tokens, attends and updates the weights
        for part in ("GEMMs", "permutation", "attention", "optimizer", "norms & elementwise"):
            assert breakdown.part_ms[part] > 0, part
        assert breakdown.part_ms["communication"] == 0  # one process
    assert chapters.breakdowns["naive loop"].path.startswith(
        "routing.permute (by slot) → naive loop over")
    assert "counterpart" in chapters.breakdowns["te.ops grouped MLP (PyTorch counterpart)"].path
    # FP8 needs TE on a GPU: skipped, with the reason, not replaced by something else
    assert list(chapters.skipped) == ["FP8 te.ops"]
    assert "Transformer Engine" in chapters.skipped["FP8 te.ops"]


def test_the_naive_loop_dispatches_more_ops_than_the_grouped_gemm(chapters):
    naive, grouped = chapters.breakdowns["naive loop"], chapters.breakdowns["grouped GEMM"]
    assert naive.launches_per_step > grouped.launches_per_step


def test_chapter_bars_round_trip_through_json(chapters):
    again = step_profile.ChapterBars.from_dict(json.loads(json.dumps(chapters.to_dict())))
    assert again == chapters


def test_profile_train_step_takes_a_list_of_batches():
    v = bench.Variant("grouped", "grouped_torch")
    model, _ = v.build(TINY, "cpu")
    batches = [bench.random_batch(TINY, 1, 16, "cpu")] * 2
    breakdown = step_profile.profile_train_step(model, v.optimizer(model, 1e-5), batches,
                                                device="cpu", steps=1, warmup=0)
    assert breakdown.steps == 1 and breakdown.path == "routing.permute → torch._grouped_mm"


@pytest.mark.parametrize("kwargs, match", [
    (dict(steps=0), "steps=0"),
    (dict(warmup=-1), "warmup=-1"),
    (dict(device="tpu"), "not a torch device"),
    (dict(device="meta"), "'cpu' or 'cuda'"),
])
def test_profile_step_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        step_profile.profile_step(lambda: None, **{"device": "cpu", **kwargs})


def test_profile_step_refuses_a_step_that_is_not_a_function():
    with pytest.raises(ValueError, match="step must be a function"):
        step_profile.profile_step("train", device="cpu")


def test_profile_train_step_refuses_batches_that_are_not_batches():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="batches must be"):
        step_profile.profile_train_step(model, None, [torch.zeros(2)], device="cpu")


@pytest.mark.parametrize("kwargs, match", [
    (dict(upto="02"), "not a chapter"),
    (dict(upto="expert_parallel"), "launch=train_dist.launch"),
    (dict(upto="naive", seq_len=1000), "max_seq_len"),
    (dict(upto="naive", batch=0), "batch=0"),
])
def test_chapter_breakdowns_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        step_profile.chapter_breakdowns(TINY, **{"device": "cpu", **kwargs})


# ---------------------------------------------------------------------------------------------
# The breakdown as data

def _breakdown(**parts) -> StepBreakdown:
    part_ms = {p: float(parts.get(p, 0.0)) for p in PARTS}
    return StepBreakdown(part_ms=part_ms, total_ms=sum(part_ms.values()), launches_per_step=10,
                         source="cuda kernels", device="cuda:0", steps=3, path="te_ops")


NAIVE = _breakdown(**{IDLE: 48, "GEMMs": 30, "permutation": 22})
GROUPED = _breakdown(**{IDLE: 20, "GEMMs": 61, "permutation": 19})


def test_a_breakdown_round_trips_through_json_and_names_its_largest_part():
    assert StepBreakdown.from_dict(json.loads(json.dumps(NAIVE.to_dict()))) == NAIVE
    assert NAIVE.dominant_part() == IDLE and GROUPED.dominant_part() == "GEMMs"
    assert NAIVE.share(IDLE) == pytest.approx(0.48)


@pytest.mark.parametrize("change, match", [
    (dict(total_ms=90.0), "sum to"),
    (dict(source="guess"), "source"),
    (dict(part_ms={"GEMMs": 100.0}), "needs exactly the parts"),
    (dict(part_ms={**NAIVE.part_ms, "GEMMs": -30.0, IDLE: 108.0}), ">= 0"),
    (dict(steps=0), "steps=0"),
    (dict(flops=1), "keys"),
])
def test_from_dict_refuses_what_is_not_a_breakdown(change, match):
    with pytest.raises(ValueError, match=match):
        StepBreakdown.from_dict({**NAIVE.to_dict(), **change})


def test_share_refuses_an_unknown_part():
    with pytest.raises(ValueError, match="unknown part"):
        NAIVE.share("GEMM")


# ---------------------------------------------------------------------------------------------
# Presentation

BARS = {"naive loop": NAIVE, "grouped GEMM": GROUPED}


def test_the_figure_has_one_trace_per_part_in_its_colour():
    fig = step_profile.breakdown_figure(BARS, title="chapter 2")
    assert [t.name for t in fig.data] == list(PARTS)
    assert [t.marker.color for t in fig.data] == [step_parts.COLORS[p] for p in PARTS]
    gemms = fig.data[PARTS.index("GEMMs")]
    assert list(gemms.y) == list(BARS) and list(gemms.x) == [30.0, 61.0]
    assert list(gemms.customdata) == pytest.approx([30.0, 61.0])  # % of 100 ms
    assert "ms" in gemms.hovertemplate and "%" in gemms.hovertemplate
    assert fig.layout.barmode == "stack"


def test_the_table_has_a_row_per_bar_and_each_part_percentage():
    table = step_profile.breakdown_table(BARS, skipped={"FP8": "no TE here"})
    assert [row[0] for row in table.rows] == list(BARS)
    gemms = table.headers.index("GEMMs %")
    assert [row[gemms] for row in table.rows] == ["30.0", "61.0"]
    assert "skipped FP8: no TE here" in table.note


def test_the_sentence_follows_the_largest_part():
    assert step_profile.bottleneck_sentence(BARS) == (
        "the naive loop spends 48% of its step in launch gaps / idle; the grouped GEMM moves "
        "the largest part to GEMMs (61%).")


def test_show_falls_back_to_the_table_without_plotly(monkeypatch, capsys):
    monkeypatch.setattr(display, "plotly_go", lambda: None)
    step_profile.show_breakdowns(BARS, title="chapter 2")
    out = capsys.readouterr().out
    assert "plotly is not installed" in out and "naive loop" in out and "61.0" in out


@pytest.mark.parametrize("bad", [{}, {"naive": 3.0}, [NAIVE]])
def test_presentation_refuses_what_is_not_breakdowns(bad):
    with pytest.raises(ValueError, match="breakdowns must be"):
        step_profile.breakdown_table(bad)


# ---------------------------------------------------------------------------------------------
# Expert parallelism: rank 0's breakdown from train_dist's processes

def test_expert_parallel_bar_comes_from_train_dist_bench(chapters):
    calls = []

    def launch(nproc, *args, echo):
        calls.append((nproc, args))
        rank0 = {**chapters.breakdowns["grouped GEMM"].to_dict(), "path": ""}
        return {"results": [{"step_breakdown": rank0, "path": "EP 0/2: torch._grouped_mm"}]}

    bars = step_profile.ChapterBars({}, {})
    step_profile._expert_parallel_bar(bars, TINY, torch.device("cpu"), launch, batch=2,
                                      seq_len=32, warmup=0, backend="grouped_torch")
    (nproc, args), = calls
    assert nproc == 2 and "--breakdown" in args
    assert args[args.index("--preset") + 1] == "tiny" and args[args.index("--mode") + 1] == "bench"
    assert bars.breakdowns["expert parallel (2 processes)"].path == "EP 0/2: torch._grouped_mm"


def test_expert_parallel_needs_a_preset():
    bars = step_profile.ChapterBars({}, {})
    step_profile._expert_parallel_bar(bars, TINY.with_overrides(num_layers=3), torch.device("cpu"),
                                      launch=None, batch=2, seq_len=32, warmup=0,
                                      backend="grouped_torch")
    assert "preset" in bars.skipped["expert parallel (2 processes)"]


@pytest.mark.slow
def test_expert_parallel_over_gloo_spends_time_communicating():
    from moe_tutorial.perf.train_dist import launch

    bars = step_profile.chapter_breakdowns(TINY, upto="expert_parallel", device="cpu", batch=2,
                                           seq_len=32, steps=1, warmup=0, launch=launch)
    ep = bars.breakdowns["expert parallel (2 processes)"]
    assert ep.part_ms["communication"] > 0
    assert sum(ep.part_ms.values()) == pytest.approx(ep.total_ms)


@pytest.mark.gpu
def test_cuda_steps_are_measured_by_kernels():
    bars = step_profile.chapter_breakdowns(TINY.with_overrides(dtype="bfloat16"), upto="te_ops",
                                           device="cuda", batch=4, seq_len=64)
    for breakdown in bars.breakdowns.values():
        assert breakdown.source == "cuda kernels" and breakdown.launches_per_step > 0
        assert breakdown.part_ms["GEMMs"] > 0 and breakdown.part_ms[IDLE] >= 0
        assert sum(breakdown.part_ms.values()) == pytest.approx(breakdown.total_ms)
    assert (bars.breakdowns["naive loop"].launches_per_step
            > bars.breakdowns["grouped GEMM"].launches_per_step)


def test_cpu_steps_are_profiled_on_one_thread_and_the_thread_count_restored():
    """On a CPU an op's time is wall time: with intra-op worker threads a matmul's includes
    waiting for them, so the profiled steps run on one thread, and the caller's count comes back."""
    before = torch.get_num_threads()
    seen = []
    step_profile.profile_step(lambda: seen.append(torch.get_num_threads()), device="cpu",
                              steps=2, warmup=1)
    assert seen == [1, 1, 1]
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError, match="boom"):
        step_profile.profile_step(lambda: (_ for _ in ()).throw(RuntimeError("boom")),
                                  device="cpu")
    assert torch.get_num_threads() == before
