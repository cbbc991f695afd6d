"""`python -m moe_tutorial analyze`: every shipped config analysed on a CPU, its numbers those of
the functions that own them (and, where a model is published, its published sizes), the three
ways to name a model, the refusals of bad input, and the recommendation's rule."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from moe_tutorial.cli import main
from moe_tutorial.moe import experts
from moe_tutorial.moe.config import PRESETS, MoEConfig, preset
from moe_tutorial.perf import analyze, decide, memory, model_numbers, recommend, skew
from moe_tutorial.precision import hardware

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
SECTIONS = ("1. Parameters", "2. Expert GEMMs", "3. Padding", "4. Fused grouped MLP",
            "5. Memory per GPU", "6. Recommendation")
PROTEIN = "protein-moe-small"


@pytest.fixture(scope="module")
def reports():
    """Each shipped config's and the protein preset's report, computed once (no sweep)."""
    return {name: analyze.analyze(name, sweep=False)
            for name in [*analyze.shipped_configs(), PROTEIN]}


def test_the_shipped_configs_are_the_three_published_models():
    assert analyze.shipped_configs() == ["deepseek-v3", "olmoe-1b-7b", "qwen3-moe-30b-a3b"]
    for name in analyze.shipped_configs():
        fields = json.loads((analyze.CONFIGS_DIR / f"{name}.json").read_text())
        assert "config.json of the Hugging Face model repository" in fields[analyze.SOURCE_KEY]


@pytest.mark.parametrize("name", [*analyze.shipped_configs(), PROTEIN])
def test_the_command_analyses_each_shipped_model_on_a_cpu(name, tmp_path, capsys):
    out = tmp_path / "report.json"
    start = time.perf_counter()
    assert main(["analyze", name, "--no-sweep", "--json", str(out)]) == 0
    assert time.perf_counter() - start < 30
    printed = capsys.readouterr().out
    assert all(section in printed for section in SECTIONS), printed
    report = json.loads(out.read_text())
    assert set(report) >= {"model", "scope", "parameters", "expert_gemms", "padding",
                           "fused_grouped_mlp", "memory", "recommendation"}
    for items in report["recommendation"]["machines"].values():
        assert [i["item"] for i in items] == ["backend", "recipe", "alignment", "layout"]
        assert all(i["reason"] for i in items)


def test_numbers_are_those_of_parameter_counts_and_memory_predict(reports):
    report = reports["qwen3-moe-30b-a3b"]
    config = analyze.load_model("qwen3-moe-30b-a3b").config
    counts = config.parameter_counts()
    p = report["parameters"]
    assert (p["total"], p["experts"], p["active_per_token"]) == (
        counts["total"], counts["expert"], counts["active_per_token"])
    s = report["settings"]
    for row in report["memory"]["rows"]:
        predicted = memory.predict(
            config, batch=s["batch"], seq_len=s["seq_len"], dp=row["dp"], ep=row["ep"],
            engine=row["engine"], backend=memory.TABLE_BACKEND,
            state_dtype=recommend.FSDP2_STATE_DTYPE if row["engine"] == "fsdp2" else None)
        assert row["peak_bytes"] == predicted.peak
        assert row["fits"] == memory.fits(predicted, s["gpu_gib"] * 2**30)
    assert [(r["engine"], r["dp"], r["ep"]) for r in report["memory"]["rows"]] == [
        (e, dp, ep) for e in ("replicated", "fsdp2") for dp, ep in [(1, 8), (2, 4), (4, 2), (8, 1)]]
    gemm = report["expert_gemms"][1]  # 4096 tokens, top-8 of 128 experts: 256 rows each
    assert gemm["rows_per_expert"] == 4096 * 8 // 128
    assert gemm["gate_up"] == [[256, 2048], [2048, 2 * 768]] and gemm["down"] == [[256, 768],
                                                                                 [768, 2048]]


def test_published_sizes(reports):
    """Qwen3-30B-A3B: 30.5 B parameters, 3.3 B active; OLMoE-1B-7B: 6.9 B and 1.3 B (both
    published counts include the embedding lookup, which parameter_counts leaves out of the
    active ones). DeepSeek-V3 (671 B, 37 B active): its 58 MoE layers' routed experts are most
    of it, and its active routed experts part of the 37 B."""
    for name, total, active in (("qwen3-moe-30b-a3b", 30.5e9, 3.3e9),
                                ("olmoe-1b-7b", 6.9e9, 1.3e9)):
        p, config = reports[name]["parameters"], analyze.load_model(name).config
        embedding = config.vocab_size * config.hidden_size
        assert p["total"] == pytest.approx(total, rel=0.01)
        assert p["active_per_token"] + embedding == pytest.approx(active, rel=0.03)
    deepseek = reports["deepseek-v3"]
    assert deepseek["model"]["moe_block_only"] and deepseek["model"]["config"]["num_layers"] == 58
    assert 0.95 * 671e9 < deepseek["parameters"]["experts"] < 671e9
    assert deepseek["parameters"]["experts_active_per_token"] < 37e9
    assert "total" not in deepseek["parameters"]


def test_deepseek_v3_names_what_it_leaves_out(reports):
    scope = " ".join(reports["deepseek-v3"]["scope"]["out_of_scope"])
    assert "multi-head latent attention" in scope and "first_k_dense_replace=3" in scope
    assert "58 MoE layers of 61" in scope and "no whole-model" in scope
    assert reports["deepseek-v3"]["memory"]["experts_only"]
    assert "out of scope" in analyze.format_report(reports["deepseek-v3"])


def test_the_protein_preset_is_fine_grained_and_cpu_sized():
    config = preset(PROTEIN)
    assert config.num_experts >= 16 and config.top_k >= 4
    assert config.vocab_size == preset("small").vocab_size
    assert config.parameter_counts()["total"] < 3 * preset("small").parameter_counts()["total"]


def test_an_hf_config_json_written_by_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    tiny = preset("tiny")
    transformers.MixtralConfig(**tiny.to_hf_config_kwargs()).save_pretrained(tmp_path)
    for spec in (tmp_path, tmp_path / "config.json"):
        model = analyze.load_model(str(spec))
        assert model.config == tiny.with_overrides(dtype=analyze.COMPUTE_DTYPE)
        assert not model.moe_block_only and model.source.endswith("config.json")


def test_a_json_of_moe_config_fields(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"hidden_size": 256, "intermediate_size": 128, "num_experts": 32,
                                "top_k": 4, "num_layers": 3}))
    report = analyze.analyze(str(path), sweep=False)
    config = MoEConfig(hidden_size=256, intermediate_size=128, num_experts=32, top_k=4,
                       num_layers=3, dtype=analyze.COMPUTE_DTYPE)
    assert report["model"]["config"]["num_experts"] == 32
    assert report["parameters"]["total"] == config.parameter_counts()["total"]


@NO_GPU
def test_on_a_cpu_the_recommendation_says_no_sweep_ran(reports, capsys):
    report = reports["qwen3-moe-30b-a3b"]
    sweep = report["recommendation"]["sweep"]
    assert not sweep["ran"] and "no CUDA GPU" in sweep["why_not"]
    assert "no sweep ran" in analyze.format_report(report)
    assert set(report["recommendation"]["machines"]) == set(memory.ARCHS)


def test_recommendation_sentences_come_from_the_data(reports):
    """On Blackwell every fused-MLP condition holds for Qwen3-30B-A3B's shapes: te_ops, MXFP8,
    its rows per expert, with the padding that costs; the layout is one that fits."""
    report = reports["qwen3-moe-30b-a3b"]
    items = {i["item"]: i for i in report["recommendation"]["machines"]["blackwell"]}
    config = analyze.load_model("qwen3-moe-30b-a3b").config
    align = experts.FUSED_MLP_ROWS_PER_EXPERT
    assert (items["backend"]["choice"], items["recipe"]["choice"], items["alignment"]["choice"]) \
        == ("te_ops", model_numbers.FUSED_RECIPE, align)
    tokens = report["settings"]["batch"] * report["settings"]["seq_len"]
    skewed = model_numbers.padding_fractions(model_numbers.skewed_routing_splits(config, tokens))
    assert f"{skewed[align]:.1%}" in items["alignment"]["reason"]
    fitting = [r["layout"] for r in report["memory"]["rows"] if r["fits"]]
    assert items["layout"]["choice"] in fitting


def _sweep_rows(fp8_speedup: float) -> list[dict]:
    """Sweep rows as `decide.run_sweep` returns them, for one shape of 8 experts."""
    shape = dict(shape="t4096", status="ok", experts=8, hidden=128, tokens_per_expert=1024)
    return [dict(shape, variant="loop"),
            dict(shape, variant="grouped", speedup_vs_loop=2.0),
            dict(shape, variant="te_ops", speedup_vs_bf16_grouped=1.0),
            dict(shape, variant="fp8", speedup_vs_bf16_grouped=fp8_speedup)]


@pytest.mark.parametrize("fp8_speedup, recipe, align, backend", [
    (1.5, "DelayedScaling", 16, "te_grouped_linear"),
    # bf16 on a Hopper: the course's default for experts this small (experts.default_backend)
    (0.7, "bf16", 1, "te_permute_grouped_mm")])
def test_the_sweep_map_decides_the_recipe_where_nothing_fuses(fp8_speedup, recipe, align, backend):
    model = analyze.load_model("tiny")
    verdicts = decide.decision_map(_sweep_rows(fp8_speedup))
    items = {i["item"]: i for i in recommend.recommend(
        model, model_numbers.arch_capabilities("hopper"), arch="hopper", verdicts=verdicts,
        source="a sweep", batch=1, seq_len=64, gpus=8, gpu_bytes=140 * 2**30)}
    assert items["backend"]["choice"] == backend
    assert (items["recipe"]["choice"], items["alignment"]["choice"]) == (recipe, align)
    assert f"{fp8_speedup:.2f}×" in items["recipe"]["reason"]
    # What the sweep picked among TE's layers stays in the reason
    assert "te_grouped_linear" in items["backend"]["reason"]


@pytest.mark.parametrize("arch, hidden, intermediate, backend", [
    ("hopper", 4096, 14336, "te_grouped_linear"),  # Mixtral-wide experts: TE's grouped layers
    ("blackwell", 32, 64, "te_grouped_linear"),  # unfused there; the H200 rule is not applied
])
def test_the_bf16_default_path_only_where_it_was_measured(arch, hidden, intermediate, backend):
    tiny = analyze.load_model("tiny")
    wide = dataclasses.replace(tiny, config=dataclasses.replace(
        tiny.config, hidden_size=hidden, intermediate_size=intermediate))
    items = {i["item"]: i for i in recommend.recommend(
        wide, model_numbers.arch_capabilities(arch), arch=arch, verdicts=decide.decision_map(_sweep_rows(0.7)),
        source="a sweep", batch=1, seq_len=64, gpus=8, gpu_bytes=140 * 2**30)}
    assert (items["backend"]["choice"], items["recipe"]["choice"]) == (backend, "bf16")


def test_on_a_gpu_the_sweep_decides_for_that_gpu(monkeypatch):
    """The GPU branch, without a GPU: a Hopper's capabilities and a stand-in sweep."""
    model = analyze.load_model("tiny")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hardware, "capabilities", lambda: model_numbers.arch_capabilities("hopper"))
    monkeypatch.setattr(recommend, "run_sweep", lambda config, caps: _sweep_rows(1.5))
    result = recommend.recommendation(model, sweep=None, batch=1, seq_len=64, gpus=8,
                                    gpu_bytes=140 * 2**30)
    assert result["sweep"]["ran"] and "On NVIDIA H200" in result["sweep"]["rule"]
    (machine, items), = result["machines"].items()
    assert machine == "NVIDIA H200" and "this sweep on NVIDIA H200" in items[1]["reason"]


@pytest.mark.parametrize("kind, threshold, size, expected", [
    ("always", None, 1, True), ("never", None, 1, False), ("even", None, 1, False),
    ("from", 8, 16, True), ("from", 8, 4, False), ("up_to", 8, 4, True), ("mixed", None, 1, None)])
def test_paid_at_reads_a_verdict_at_a_size(kind, threshold, size, expected):
    verdict = decide.Verdict(decide.TECHNIQUES[1], kind, threshold)
    assert recommend.paid_at(verdict, size) is expected


# ---------------------------------------------------------------------------------------------
# Bad input: one line `error: ...`, exit status 2, before any work

class WorkStarted(Exception):
    """The command got past its checks."""


@pytest.fixture
def refused(monkeypatch, capsys):
    """Run `analyze` with arguments that must be refused: exit status 2, one line `error: ...`
    naming every one of `words`, and no analysis started."""
    def work(*args, **kwargs):
        raise WorkStarted

    monkeypatch.setattr(analyze, "analyze", work)

    def check(argv: list[str], *words: str) -> str:
        code = main(["analyze", *argv])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
        assert all(word in lines[0] for word in words), lines[0]
        return lines[0]
    return check


def test_a_missing_file_is_refused(refused, tmp_path):
    refused([str(tmp_path / "nowhere" / "config.json")], "does not exist", "qwen3-moe-30b-a3b",
            "path of an HF config.json")


def test_an_unknown_preset_is_refused(refused):
    line = refused(["mixtral-9x9b"], "'mixtral-9x9b' is no preset")
    assert all(name in line for name in PRESETS)


def test_a_config_of_an_unsupported_family_is_refused(refused, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    refused([str(tmp_path)], "model_type='llama'", "supported", "MixtralForCausalLM")


def test_malformed_json_is_refused(refused, tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "mixtral", "hidden_size": 64,')
    refused([str(path)], "not valid JSON", "line 1")


@pytest.mark.parametrize("fields, words", [
    ({"hidden": 64}, ["['hidden']", "MoEConfig does not"]),
    ({"top_k": 9, "num_experts": 8}, ["MoEConfig.top_k=9", "num_experts=8"]),
    ([1, 2], ["not an object"]),
])
def test_bad_moe_config_fields_are_refused(refused, tmp_path, fields, words):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(fields))
    refused([str(path)], *words)


@pytest.mark.parametrize("argv, words", [
    (["tiny", "--seq-len", "100000"], ["--seq-len=100000", "max_seq_len=64"]),
    (["tiny", "--gpu-gib", "0"], ["--gpu-gib"]),
    (["tiny", "--gpus", "0"], ["--gpus"]),
])
def test_bad_settings_are_refused(refused, argv, words):
    refused(argv, *words)


def test_the_sweep_times_this_models_expert_layer(capsys):
    """The GPU's sweep, run on a CPU with the tiny preset: the course's decision sweep on the
    model's own shape, one row per variant, which the map reads."""
    config = preset("tiny")
    rows = recommend.run_sweep(config, hardware.capabilities(), device="cpu", tokens_per_gpu=(64,))
    assert [(r["shape"], r["variant"]) for r in rows] == [
        ("t64", v) for v in ("loop", "grouped", "te_ops", "fp8")]
    timed = [r for r in rows if r["status"] == "ok"]
    assert {r["variant"] for r in timed} >= {"loop", "grouped"}
    assert all(r["experts"] == config.num_experts and r["hidden"] == config.hidden_size
               for r in timed)
    assert decide.decision_map(rows)["grouped_gemm"].speedups
    assert "expert-layer sweep" in capsys.readouterr().err


def test_skewed_padding_counts_the_benchmark_routing():
    """The skewed padding column comes from the skewed benchmark routing's own copies per expert.
    With top-8 of 128 experts nearly every token picks the hottest expert, so a one-number skew
    read off that expert saturates at 'every token at one expert' (1.00 for every shipped config,
    an earlier version's bug) and its padding describes that extreme, not the routing's tail."""
    config = analyze.load_model("qwen3-moe-30b-a3b").config
    tokens = 4096
    splits = model_numbers.skewed_routing_splits(config, tokens)
    assert sum(splits) == tokens * config.top_k and len(splits) == config.num_experts
    row = next(r for r in analyze.padding(config, (tokens,)))
    counted = skew.padding_waste(splits, tuple(model_numbers.alignments()))
    extreme = skew.padding_waste(skew.skewed_splits(tokens, config.num_experts, config.top_k, 1.0),
                                 tuple(model_numbers.alignments()))
    for a in row["alignments"]:
        assert a["skewed"] == counted[a["align"]]["fraction"]
    assert any(counted[a]["fraction"] != extreme[a]["fraction"] for a in counted)
    assert 1.0 < row["skewed_max_over_mean"] <= config.num_experts / config.top_k
