"""benchmarks/optimizer_pass.py on a CPU at the tiny preset: its JSON, its rows, its byte count,
the equality of what it times, and its refusal of an existing --out."""

import json

import pytest
import torch

from benchmarks import optimizer_pass as op
from moe_tutorial.moe.config import preset
from moe_tutorial.moe.model import MoEForCausalLM
from moe_tutorial.perf import speed_of_light
from moe_tutorial.train.loop import TrainSettings, _adamw_groups

TORCH = [v.name for v in op.VARIANTS if not v.te]
TE = [v.name for v in op.VARIANTS if v.te]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("optimizer_pass") / "out.json"
    assert op.main(["--out", str(out), "--preset", "tiny", "--device", "cpu", "--warmup", "0",
                    "--iters", "1", "--copy-bytes", str(2**20)]) == 0
    return json.loads(out.read_text())


def test_json_has_the_environment_and_a_row_per_variant(report):
    assert {"torch", "python"} <= set(report["environment"])
    assert [row["variant"] for row in report["rows"]] == [v.name for v in op.VARIANTS]
    assert report["hbm_gb_per_s"] > 0 and "measured now" in report["hbm_source"]
    for row in report["rows"]:
        if row["variant"] in TE:  # on a CPU: a row with its one-line reason, never dropped
            assert row["status"] == "unavailable" and "CUDA" in row["reason"]
        else:
            assert row["status"] == "ok", row
            assert row["median_ms"] > 0 and row["floor_ms"] > 0
            assert row["fraction_of_floor"] == pytest.approx(row["floor_ms"] / row["median_ms"])
            assert row["state_gib"] > 0


def test_every_torch_variant_computes_a_plain_fp32_adamw_step(report):
    # The driver's own check (compiled AdamW included) against `reference_step`...
    for row in report["rows"]:
        if row["variant"] in TORCH:
            assert row["matches_fp32_adamw"], row
            assert row["max_abs_diff_vs_fp32_adamw"] < 1e-6
    # ...and `reference_step` and the eager variants against one plain AdamW over the course's
    # groups, whole model at once
    torch.manual_seed(0)
    source = MoEForCausalLM(preset("tiny"))
    grads = op.seeded_gradients(source)
    s = TrainSettings(lr=1e-3, steps=2, warmup_steps=0)
    plain = op.variant_copy(op.BY_NAME["torch_adamw_foreach"], source, grads)
    torch.optim.AdamW(_adamw_groups(plain, s), lr=s.lr, betas=s.betas, foreach=False).step()
    expected = dict(plain.named_parameters())
    for name in grads:
        torch.testing.assert_close(op.reference_step(source, grads, s, name), expected[name].detach())
    for name in ("torch_adamw_foreach", "torch_adamw_fused", "torch_adamw_fused_fp32_params"):
        v = op.BY_NAME[name]
        model = op.variant_copy(v, source, grads)
        v.make(model, s, None).step()
        for pname, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), expected[pname].detach(), msg=f"{name} {pname}")


def test_byte_count_matches_a_hand_count():
    # A tiny parameter set: a [3, 4] matrix and a [5] vector, 17 parameters.
    numel = 3 * 4 + 5
    bf16, fp32 = torch.bfloat16, torch.float32
    hand = {  # grad + 2 x (weights + m + v) (+ working copy written, with a master)
        (bf16, None, None, None, False): 2 + 2 * (2 + 2 + 2),          # 14: the course's AdamW
        (fp32, None, None, None, False): 4 + 2 * (4 + 4 + 4),          # 28
        (bf16, fp32, fp32, fp32, False): 2 + 2 * (4 + 4 + 4) + 2,      # 28
        (bf16, fp32, bf16, bf16, False): 2 + 2 * (4 + 2 + 2) + 2,      # 20
        (bf16, fp32, fp32, fp32, True): 2 + 2 * (2 + 2 + 4 + 4),       # 26: bf16 + int16 remainder
        (bf16, None, fp32, fp32, False): 2 + 2 * (2 + 4 + 4),          # 22: TE's default moments
    }
    for key, per_param in hand.items():
        assert op.bytes_per_parameter(*key)[0] * numel == per_param * numel, key
    # the two cases the step's floor counts are its function's numbers
    assert op.bytes_per_parameter(bf16)[0] == speed_of_light.adamw_bytes_per_parameter("adamw", 2)
    assert op.bytes_per_parameter(bf16, fp32, fp32, fp32)[0] == \
        speed_of_light.adamw_bytes_per_parameter("adamw_fp32", 2)
    # every variant's row in bf16
    rows = {v.name: v.bytes_per_parameter(bf16)[0] for v in op.VARIANTS}
    assert rows["torch_adamw_fused"] == rows["te_fused_adam_course"] == 14
    assert rows["torch_adamw_fused_fp32_params"] == rows["te_fused_adam_fp32_params"] == 28
    assert rows["te_fused_adam_fp32_master"] == 28
    assert rows["te_fused_adam_fp32_master_remainders"] == 26
    assert rows["te_fused_adam_fp32_master_bf16_moments"] == 20


def test_rows_count_bytes_as_the_step_floor_does(report):
    # tiny is fp32: the course's AdamW moves 28 bytes per parameter, as the floor counts them
    assert report["speed_of_light_optimizer_bytes"] == report["parameters"] * 28
    for row in report["rows"]:
        assert row["bytes_per_step"] == row["parameters"] * row["bytes_per_parameter"]
    fused = next(r for r in report["rows"] if r["variant"] == "torch_adamw_fused")
    assert fused["bytes_per_step"] == report["speed_of_light_optimizer_bytes"]


def test_an_existing_out_is_refused(tmp_path, capsys):
    out = tmp_path / "earlier.json"
    out.write_text("an earlier result\n")
    with pytest.raises(SystemExit) as exit_:
        op.main(["--out", str(out), "--preset", "tiny", "--device", "cpu"])
    assert exit_.value.code == 2
    assert "already exists" in capsys.readouterr().err
    assert out.read_text() == "an earlier result\n"


def test_loss_curves_give_the_course_optimizer_a_curve_and_te_a_reason():
    config = preset("tiny")
    rows = op.loss_curves(config, [v for v in op.VARIANTS if v.curve], steps=2, batch=2,
                          seq_len=32, lr=1e-3, device="cpu", te=None, backend="grouped_torch",
                          max_sequences=20)
    assert rows[0]["optimizer"] == "torch_adamw_fused" and rows[0]["status"] == "ok"
    assert len(rows[0]["losses"]) == 2
    assert all(r["status"] == "unavailable" and r["reason"] for r in rows[1:])


def test_the_reference_step_is_the_same_in_chunks(monkeypatch):
    torch.manual_seed(0)
    source = MoEForCausalLM(preset("tiny"))
    grads = op.seeded_gradients(source)
    s = TrainSettings(lr=1e-3, steps=2, warmup_steps=0)
    whole = {name: op.reference_step(source, grads, s, name) for name in grads}
    monkeypatch.setattr(op, "CHUNK", 7)  # mixtral-2l's tensors are compared in chunks
    for name in grads:
        assert torch.equal(op.reference_step(source, grads, s, name), whole[name])
