"""Package helpers written for notebooks 03-06, at CPU size."""

import math

import pytest
import torch

from moe_tutorial.moe.config import preset
from moe_tutorial.perf import bench


def test_loss_curves_of_equivalent_variants_agree():
    cfg = preset("tiny")
    windows = torch.randint(0, cfg.vocab_size, (5, 40), generator=torch.Generator().manual_seed(1))
    seen = []
    rows = bench.train_loss_curves(
        cfg, ["ours_grouped_torch_bf16", bench.Variant("te_ops (reference)", "te_ops"), "hf_grouped_mm"],
        steps=4, batch=2, seq_len=32, device="cpu", lr=1e-2, windows=windows, timing_warmup=1,
        on_step=lambda label, record: seen.append((label, record["step"])))
    assert [r["variant"] for r in rows] == ["ours_grouped_torch_bf16", "te_ops (reference)",
                                            "hf_grouped_mm"]
    for r in rows:
        assert r["status"] == "ok", r
        assert len(r["losses"]) == 4 and all(math.isfinite(v) for v in r["losses"])
        assert r["ms_per_step"] > 0
        assert r["tokens_per_s"] == pytest.approx(64 / (r["ms_per_step"] / 1e3))
        assert r["peak_memory_gb"] is None  # CUDA only
    ours, te_ops, hf = (r["losses"] for r in rows)
    # same weights, same batches, same optimizer: the same curve up to float32 summation order
    for other in (te_ops, hf):
        assert max(abs(a - b) for a, b in zip(ours, other)) < 1e-3
    assert ours[-1] < ours[0]  # lr 1e-2 on 4 repeated-ish batches: it learns
    assert "pure-PyTorch" in rows[1]["path"]
    assert seen[:4] == [("ours_grouped_torch_bf16", s) for s in (1, 2, 3, 4)] and len(seen) == 12


def test_loss_curves_say_why_a_variant_cannot_run():
    # on a CPU (where this runs even on the GPU machine): FP8 needs TE on a GPU
    rows = bench.train_loss_curves(preset("tiny"), [bench.Variant("fp8", "te_ops", "fp8"),
                                                    bench.Variant("nope", "nope")],
                                   steps=2, batch=1, seq_len=16, device="cpu")
    assert rows[0]["status"] == "unavailable" and "needs Transformer Engine" in rows[0]["error"]
    assert rows[0]["losses"] == []
    assert rows[1]["status"] == "unavailable" and "unknown expert backend" in rows[1]["error"]


def test_loss_curves_validate_their_arguments():
    with pytest.raises(ValueError, match="steps"):
        bench.train_loss_curves(preset("tiny"), ["hf_eager"], steps=0, device="cpu")
    with pytest.raises(ValueError, match="shorter"):
        bench.train_loss_curves(preset("tiny"), ["hf_eager"], steps=1, seq_len=32, device="cpu",
                                windows=torch.zeros(2, 8, dtype=torch.long))
