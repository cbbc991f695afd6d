"""The sync-free expert path and the whole-step CUDA graph: the same numbers as the reference
loop, and no host read anywhere in the step (on a CPU: the meta device and patched entry
points; on a GPU, `-m gpu`: torch's sync debug mode around the graphed step)."""

import pytest
import torch

from moe_tutorial.moe.batch import next_token_targets
from moe_tutorial.moe.config import preset
from moe_tutorial.moe.dispatch import run_experts
from moe_tutorial.moe.experts import convert_experts, create, sync_free
from moe_tutorial.moe.experts.sync_free import FP8_ROW_ALIGNMENT, quantize_rowwise
from moe_tutorial.moe.model import MoEForCausalLM, route
from moe_tutorial.moe.routing import permute, permute_static, static_rows, unpermute
from moe_tutorial.perf import host_syncs
from moe_tutorial.perf.host_syncs import HostSync, host_sync_entry_points
from moe_tutorial.train import graphed
from moe_tutorial.train.graphed import train_step_body


def _relerr(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _routing(tokens, experts, top_k, skew=False, device="cpu"):
    logits = torch.randn(tokens, experts)
    if skew:
        logits[:, -2:] -= 100.0  # the last two experts receive no tokens
    weights, indices = route(logits, top_k)
    return weights.to(device), indices.to(device)


@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("skew", [False, True])
def test_static_permutation_holds_the_reference_rows(align, skew):
    """Each expert's rows are the reference permutation's rows at the same starts; the buffer
    has the shapes-only size, its unused rows are zero and belong to the last expert."""
    tokens, experts, top_k, hidden = 40, 8, 2, 16
    weights, indices = _routing(tokens, experts, top_k, skew)
    x = torch.randn(tokens, hidden)
    rows, perm = permute_static(x, indices, experts, align)
    ref_rows, _, ref = permute(x, indices, None, experts, align)
    assert rows.shape == (static_rows(tokens, top_k, experts, align), hidden)
    assert perm.offsets[-1].item() == rows.shape[0]
    starts = (torch.cumsum(ref.m_splits, 0) - ref.m_splits).tolist()
    for e, (start, real) in enumerate(zip(starts, ref.tokens_per_expert.tolist())):
        torch.testing.assert_close(rows[start:start + real], ref_rows[start:start + real])
        assert perm.m_splits[e].item() % align == 0
    used = ref.num_rows
    assert torch.count_nonzero(rows[used:]) == 0
    torch.testing.assert_close(unpermute(rows, perm, weights), unpermute(ref_rows, ref, weights))


def test_static_rows_bound_every_routing():
    """The most padding: every expert one row past a multiple of the alignment."""
    experts, align = 8, 16
    indices = torch.arange(experts).repeat_interleave(17).view(-1, 1)  # 17 rows each
    needed = int(((torch.full((experts,), 17) + align - 1) // align * align).sum())
    assert static_rows(indices.shape[0], 1, experts, align) >= needed
    rows, perm = permute_static(torch.randn(indices.shape[0], 4), indices, experts, align)
    assert rows.shape[0] == static_rows(indices.shape[0], 1, experts, align)


def _experts_problem(experts=8, hidden=32, inter=64, tokens=48, top_k=2, skew=False):
    ref = create("naive", experts, hidden, inter)
    torch.nn.init.normal_(ref.gate_up_proj, std=0.1)
    torch.nn.init.normal_(ref.down_proj, std=0.1)
    weights, indices = _routing(tokens, experts, top_k, skew)
    return ref, torch.randn(tokens, hidden), weights, indices


def _outputs_and_grads(module, x, indices, weights):
    x = x.detach().clone().requires_grad_()
    w = weights.detach().clone().requires_grad_()
    out, _ = run_experts(module, x, indices, w)
    out.square().sum().backward()
    grads = module.hf_gradients()
    return out, x.grad, w.grad, *grads


def _compare_with_the_loop(ref, x, weights, indices, backend, tolerance):
    """`backend`'s output and every gradient against the loop `ref`, each finite and within
    `tolerance` (relative); returns the backend's experts."""
    expected = _outputs_and_grads(ref, x, indices, weights)
    ours = convert_experts(ref, backend)
    for p in ours.parameters():
        p.grad = None
    got = _outputs_and_grads(ours, x, indices, weights)
    for name, a, b in zip(("out", "d_x", "d_weights", "d_gate_up", "d_down"), got, expected):
        assert torch.isfinite(a).all(), f"{backend} {name} not finite"
        assert _relerr(a, b) < tolerance, f"{backend} {name}: {_relerr(a, b):.2e}"
    return ours


@pytest.mark.parametrize("backend, tolerance", [("sync_free", 1e-5), ("sync_free_fp8", 0.15),
                                                ("sync_free_fp8_wgrad", 0.15)])
@pytest.mark.parametrize("skew", [False, True])
def test_sync_free_experts_match_the_loop(backend, tolerance, skew):
    """Output and every gradient (input, routing weights, both projections) against the naive
    loop: fp32 arithmetic exactly up to summation order, FP8 (emulated here: the same quantized
    operands) within the benchmark's FP8 tolerance (`bench.TOLERANCE`: E4M3's rounding of both
    operands, ~5% a GEMM, more where an expert's few rows are the sum's only terms)."""
    ours = _compare_with_the_loop(*_experts_problem(skew=skew), backend, tolerance)
    assert ("emulated" in ours.last_path) == backend.startswith("sync_free_fp8")


def test_fp8_rows_are_quantized_per_row():
    """One scale per row: a row 1000x larger than another keeps the small row's precision."""
    t = torch.randn(4, 64)
    t[0] *= 1000
    q, scale = quantize_rowwise(t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (4,)
    back = q.float() * scale[:, None]
    for row in range(4):
        assert _relerr(back[row], t[row]) < 0.05
    assert q.float().abs().amax(dim=1).eq(448).all()
    zero_q, _ = quantize_rowwise(torch.zeros(2, 8))
    assert zero_q.float().eq(0).all()


@pytest.mark.parametrize("backend", ["sync_free", "sync_free_fp8"])
def test_rows_the_grouped_gemm_cannot_take_are_refused_in_one_line(backend):
    """Rows of 5 fp32 features (20 bytes) are not 16-byte aligned: a clear refusal, not a loop
    that would read the offsets on the host."""
    bad = create(backend, 8, 5, 16)
    weights, indices = _routing(4, 8, 2)
    with pytest.raises(ValueError, match="torch._grouped_mm.*16 bytes"):
        run_experts(bad, torch.randn(4, 5), indices, weights)


def _meta_step(backend):
    config = preset("mixtral-2l")  # the benchmark's model: shapes only, no memory on meta
    model = MoEForCausalLM(config, device="meta").set_expert_backend(backend)
    ids = torch.zeros(2, 4096, dtype=torch.long, device="meta")
    # (AdamW keeps its step count on the host here; on a GPU the graphed step's capturable
    # AdamW keeps it on the device: the GPU tests check that)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = [p for p in model.parameters() if p.requires_grad]
    return lambda: train_step_body(model, (ids, next_token_targets(ids)), params, optimizer, 1.0)


@pytest.mark.parametrize("backend", ["sync_free", "sync_free_fp8", "sync_free_fp8_wgrad"])
def test_the_sync_free_step_reads_nothing_on_the_host(backend):
    """The whole step (forward, backward, clipping, AdamW) of the benchmark's model with the
    sync-free experts on the meta device with every host-read entry point refused: a host read
    added anywhere in the step fails here."""
    step = _meta_step(backend)
    with host_sync_entry_points():
        loss = step()
    assert loss.shape == ()


@pytest.mark.parametrize("backend", ["sync_free_fp8", "sync_free_fp8_wgrad"])
def test_fp8_operands_meet_the_scaled_grouped_gemm_contract(monkeypatch, backend):
    """The FP8 step with the real `torch._scaled_grouped_mm` on the meta device: its meta kernel
    makes the CUDA kernel's checks (E4M3 operands, row-major a, column-major b, 16-byte strides,
    fp32 scales of the right shapes and contiguity), so the layouts the GPU gets are checked
    here too."""
    monkeypatch.setattr(sync_free, "scaled_gemm_path", lambda device: "torch._scaled_grouped_mm")
    step = _meta_step(backend)
    with host_sync_entry_points():
        assert step().shape == ()


def test_the_detector_catches_the_reference_permutation():
    """The detector is not blind: the step with `routing.permute` (which sizes its buffer from
    the routing) fails."""
    step = _meta_step("grouped_torch")
    with host_sync_entry_points(), pytest.raises(HostSync, match="__int__"):
        step()


def test_the_gpu_counter_counts_only_sync_warnings(monkeypatch):
    """`count_host_syncs` records torch's sync warnings and nothing else: the one-time notice
    that `set_sync_debug_mode` gives ("a prototype feature") made a committed run count 5 syncs
    for HF's step where there were 4. Torch's CUDA calls are stood in for on a CPU."""
    import warnings

    mode = {"now": 0}

    def set_mode(value):
        if value == "warn":
            warnings.warn("Synchronization debug mode is a prototype feature and does not yet "
                          "detect all synchronizing operations")
        mode["now"] = value

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode["now"])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)

    def step():
        for _ in range(4):
            warnings.warn(host_syncs.SYNC_WARNING)
        warnings.warn("some other warning of the step", DeprecationWarning)

    count, places = host_syncs.count_host_syncs(step)
    assert count == 4 and len(places) == 4 and all("step" in place for place in places)
    assert mode["now"] == 0  # the mode it found is back


def test_the_detector_refuses_each_entry_point_and_restores_it():
    """Reads of device (here: meta) tensors raise, reads of host tensors pass, and every entry
    point is itself again afterwards."""
    t = torch.ones(3, device="meta")
    host = torch.ones(3)
    with host_sync_entry_points():
        assert host.sum().item() == 3 and host[host > 0].shape == (3,)
        for read in (lambda: t.sum().item(), lambda: t.tolist(), lambda: bool(t[0]),
                     lambda: torch.nonzero(t), lambda: t[t > 0], lambda: torch.equal(t, t),
                     lambda: torch.bincount(t.long()), lambda: t.repeat_interleave(2),
                     lambda: torch.cuda.synchronize()):
            with pytest.raises(HostSync):
                read()
        t.repeat_interleave(torch.ones(3, dtype=torch.long, device="meta"), output_size=3)
        assert t[1:].shape == (2,)  # sized by the caller / by the shapes: fine
    assert not any(name in torch.Tensor.__dict__ for name in ("item", "__bool__", "__getitem__"))
    assert host.sum().item() == 3


def test_weight_gradient_scales_are_per_expert_and_column():
    """Expert 1's rows 100x larger than expert 0's: each expert's columns get their own scale,
    and dequantizing gives back every row within E4M3's rounding."""
    offsets = torch.tensor([16, 48, 48, 64], dtype=torch.int32)  # expert 2 has no rows
    t = torch.randn(64, 8)
    t[16:48] *= 100
    q, scale = sync_free.quantize_columns_per_expert(t, offsets)
    assert q.shape == (8, 64) and scale.shape == (4 * 8,)
    expert = torch.tensor([0] * 16 + [1] * 32 + [3] * 16)
    back = q.float().t() * scale.view(4, 8)[expert]
    for lo, hi in ((0, 16), (16, 48), (48, 64)):
        assert _relerr(back[lo:hi], t[lo:hi]) < 0.05


def test_fp8_alignment_is_what_the_kernel_needs():
    assert FP8_ROW_ALIGNMENT == 16
    assert static_rows(10, 2, 4, 16) % 16 == 0


# ---------------------------------------------------------------------------------------------
# On a GPU

def _gpu_problem(E=8, H=256, I=512, T=1024, k=2, skew=False):
    torch.manual_seed(0)
    ref = create("naive", E, H, I, dtype=torch.bfloat16, device="cuda")
    torch.nn.init.normal_(ref.gate_up_proj, std=0.05)
    torch.nn.init.normal_(ref.down_proj, std=0.05)
    w, idx = _routing(T, E, k, skew, "cuda")
    return ref, torch.randn(T, H, dtype=torch.bfloat16, device="cuda"), w, idx


@pytest.mark.gpu
@pytest.mark.parametrize("backend, tolerance", [("sync_free", 2e-2), ("sync_free_fp8", 0.15),
                                                ("sync_free_fp8_wgrad", 0.15)])
@pytest.mark.parametrize("skew", [False, True])
def test_gpu_sync_free_experts_match_the_loop(backend, tolerance, skew):
    """bf16 and FP8 (torch._scaled_grouped_mm on Hopper) against the loop: the benchmark's
    tolerances (bench.TOLERANCE) for output and every gradient."""
    ours = _compare_with_the_loop(*_gpu_problem(skew=skew), backend, tolerance)
    if backend != "sync_free" and torch.cuda.get_device_capability()[0] == 9:
        assert "torch._scaled_grouped_mm" in ours.last_path


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sync_free", "sync_free_fp8", "sync_free_fp8_wgrad"])
def test_gpu_graphed_step_has_no_host_sync_and_trains_like_eager(backend):
    """The graphed step of a small model: replays under sync debug mode "error" pass, and its
    losses follow the eager steps' on the same batches from the same weights."""
    config = preset("tiny").with_overrides(dtype="bfloat16")
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (2, 64), generator=gen).cuda()
               for _ in range(6)]
    losses = {}
    for is_graphed in (False, True):
        torch.manual_seed(0)
        model = MoEForCausalLM(config, device="cuda").set_expert_backend(backend)
        optimizer = graphed.capturable_adamw(model, 1e-3)
        params = [p for p in model.parameters() if p.requires_grad]
        step = (graphed.GraphedTrainStep(model, optimizer, warmup=2) if is_graphed else
                lambda b: (optimizer.zero_grad(set_to_none=True),
                           train_step_body(model, b, params, optimizer, 1.0))[1])
        run = []
        for i, ids in enumerate(batches):
            batch = (ids, next_token_targets(ids))
            if is_graphed and i >= 3:  # captured at call 3: the rest replay
                torch.cuda.set_sync_debug_mode("error")
                try:
                    run.append(step(batch).clone())
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            else:
                run.append(step(batch).clone())
        losses[is_graphed] = torch.stack(run).float().cpu()
    tolerance = 0.02 if backend == "sync_free" else 0.05
    assert (losses[True] - losses[False]).abs().max() < tolerance, losses
    count, places = host_syncs.count_host_syncs(lambda: step(batch))
    assert count == 0, places
