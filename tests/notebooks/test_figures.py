"""The course's figures (notebooks/figures): each SVG is what its script draws, byte for byte; each
is an accessible picture on its own light card; and the facts they show agree with the package."""

from __future__ import annotations

import importlib
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from moe_tutorial.moe import families, routing
from moe_tutorial.parallel import distributed
from moe_tutorial.perf import analyze
from moe_tutorial.precision import quant, recipes

FIGURES = Path(__file__).resolve().parents[2] / "notebooks" / "figures"
NS = {"svg": "http://www.w3.org/2000/svg"}
# The figures the notebooks show, by chapter (tests/notebook_conventions.py checks the links).
NAMED = {"router_and_expert_loop", "permute_m_splits", "grouped_gemm", "fp8_number_line",
         "mxfp8_block", "fused_grouped_mlp", "training_step_anatomy", "dp_fsdp_ep", "all_to_all",
         "moe_families"}


def _module(name: str):
    if str(FIGURES) not in sys.path:
        sys.path.insert(0, str(FIGURES))
    return importlib.import_module(name)


def _svgs() -> list[Path]:
    return sorted(FIGURES.glob("*.svg"))


def test_every_svg_is_what_its_script_draws(tmp_path):
    draw_all = _module("draw_all")
    written = draw_all.main(tmp_path)
    assert sorted(p.name for p in written) == [p.name for p in _svgs()], \
        "one script per SVG: redraw with `python notebooks/figures/draw_all.py`"
    for path in written:
        committed = FIGURES / path.name
        assert path.read_bytes() == committed.read_bytes(), \
            f"{path.name} differs from what {path.stem}.py draws: run draw_all.py"
    # drawing is deterministic within one process too (no state carried between calls)
    assert all(_module(p.stem).svg() == p.read_text(encoding="utf-8") for p in written)


def test_at_least_eight_figures_with_the_names_the_notebooks_use():
    names = {p.stem for p in _svgs()}
    assert len(names) >= 8 and NAMED <= names


@pytest.mark.parametrize("path", _svgs(), ids=lambda p: p.stem)
def test_each_figure_is_accessible_on_its_own_card(path):
    root = ET.fromstring(path.read_text(encoding="utf-8"))
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    view = [float(v) for v in root.get("viewBox").split()]
    assert view[:2] == [0, 0] and view[2:] == [float(root.get("width")), float(root.get("height"))]
    assert "sans-serif" in root.get("font-family")
    title, desc = root.find("svg:title", NS), root.find("svg:desc", NS)
    assert title is not None and title.text.strip()
    assert desc is not None and len(desc.text.split()) >= 15, "alt text: one or two sentences"
    assert root.get("aria-labelledby") == "title desc" and root.get("role") == "img"
    card = root.find("svg:rect", NS)  # the first rect: drawn before everything else
    assert card is not None and card.get("class") == "background"
    assert float(card.get("width")) >= view[2] - 1 and float(card.get("height")) >= view[3] - 1
    assert float(card.get("rx")) > 0 and card.get("stroke") and card.get("fill") == "#ffffff"
    assert root.get("fill") == "#1f2328", "dark text on the light card, in both themes"


# --- the facts the figures show, checked against the package ----------------------------------

def test_routing_example_is_what_routing_permute_computes():
    ex = _module("routing_example")
    indices = torch.tensor([[e for e, _ in choices] for choices in ex.ROUTING])
    weights = torch.tensor([[w for _, w in choices] for choices in ex.ROUTING])
    assert torch.allclose(weights.sum(1), torch.ones(len(ex.TOKENS)))
    assert all(a[1] >= b[1] for a, b in ex.ROUTING), "most probable first, as topk returns them"
    hidden = torch.arange(len(ex.TOKENS), dtype=torch.float32).unsqueeze(1)
    rows, _, perm = routing.permute(hidden, indices, weights, ex.NUM_EXPERTS, align=ex.ALIGN)
    assert perm.tokens_per_expert.tolist() == ex.tokens_per_expert()
    assert perm.m_splits.tolist() == ex.m_splits()
    assert perm.offsets.tolist() == ex.offsets()
    drawn = [-1 if entry is None else entry[0] for block in ex.buffer() for entry in block]
    real = torch.zeros(perm.num_rows, dtype=torch.bool)
    real[perm.row_index] = True
    assert [int(v) if r else -1 for v, r in zip(rows[:, 0].tolist(), real)] == drawn


def test_alignments_named_in_the_figures_are_tes():
    assert (recipes.alignment("DelayedScaling"), recipes.alignment("MXFP8BlockScaling"),
            recipes.alignment("NVFP4BlockScaling")) == (16, 32, 128)
    text = (FIGURES / "permute_m_splits.svg").read_text(encoding="utf-8")
    assert "16 rows for FP8, 32 for MXFP8, 128 for NVFP4" in text


def test_fp8_values_are_the_formats():
    line = _module("fp8_number_line")
    for drawn, fmt in ((line.E4M3, quant.E4M3), (line.E5M2, quant.E5M2)):
        table = quant.decode_table(fmt)[1:fmt.max_code + 1]
        assert drawn.values() == table.tolist()
        assert (drawn.max, drawn.min_normal, drawn.min_subnormal) == \
            (fmt.max_value, fmt.min_normal, fmt.min_subnormal)
    assert (line.E4M3.max, line.E5M2.max) == (448.0, 57344.0)


def test_mxfp8_worked_block_is_quants():
    fig = _module("mxfp8_block")
    block = torch.zeros(1, fig.BLOCK)
    for position, value in fig.EXAMPLE.items():
        block[0, position] = value
    data, scales = quant.mxfp8_quantize(block, rule="te")
    exponent = fig.te_scale_exponent(max(abs(v) for v in fig.EXAMPLE.values()))
    assert scales.tolist() == [[127 + exponent]]
    codes = data.view(torch.uint8)[0]
    back = quant.mxfp8_dequantize(data, scales)[0]
    for position, value in fig.EXAMPLE.items():
        code, stored = fig.e4m3_round(value / 2 ** exponent)
        assert int(codes[position]) == code and float(back[position]) == stored * 2 ** exponent
    assert quant.bytes_per_element("mxfp8") == 1 + 1 / fig.BLOCK == 1.03125


def test_all_to_all_counts_are_the_dispatchers():
    fig = _module("all_to_all")
    per_rank = []
    for rank in range(fig.RANKS):
        indices = torch.tensor(list(fig.ROUTING[rank].values()))
        order, tokens_per_expert, send = distributed.dispatch_order(indices, fig.NUM_EXPERTS,
                                                                    fig.RANKS)
        names = list(fig.ROUTING[rank])
        assert [(names[int(c) // fig.TOP_K], int(indices.flatten()[c])) for c in order] == \
            fig.sorted_copies(rank)
        assert tokens_per_expert.tolist() == fig.tokens_per_expert(rank)
        assert send.tolist() == [len(fig.sent(rank, dst)) for dst in range(fig.RANKS)]
        per_rank.append(tokens_per_expert)
    for rank in range(fig.RANKS):  # what exchange_counts receives: block `rank` of every rank's
        recv = torch.stack([c.view(fig.RANKS, -1)[rank] for c in per_rank])
        assert recv.tolist() == fig.recv_counts(rank)
        arrived = [e % fig.PER_RANK for src in range(fig.RANKS) for _, e in fig.sent(src, rank)]
        assert distributed.received_experts(recv).tolist() == arrived
        # step 3: the arrivals regrouped by local expert, in regroup_by_expert's order
        rows = [c for src in range(fig.RANKS) for c in fig.sent(src, rank)]
        regroup = distributed.regroup_by_expert(recv)
        assert [rows[int(i)] for i in regroup.token_index] == sum(fig.regrouped(rank), [])
        assert regroup.tokens_per_expert.tolist() == [len(g) for g in fig.regrouped(rank)]


def test_moe_families_are_the_packages():
    """The panels draw every family `families.FAMILIES` converts, under its transformers class,
    with the routing each family's config fixes, and quote the shipped configs' published values
    as the package reads them."""
    pytest.importorskip("transformers")  # the shipped configs are read through its config classes
    fig = _module("moe_families")
    assert sorted(k for keys, *_ in fig.PANELS for k in keys) == sorted(families.FAMILIES)
    assert fig.CLASSES == {k: family.causal_lm for k, family in families.FAMILIES.items()}
    # Mixtral always renormalises; Qwen3-MoE, OLMoE and Qwen2-MoE read norm_topk_prob
    assert families.ARCHITECTURE_DEFAULTS["norm_topk_prob"] is True
    assert "norm_topk_prob" not in families.FAMILIES["mixtral"].fields
    assert all("norm_topk_prob" in families.FAMILIES[k].fields
               for k in ("qwen3_moe", "olmoe", "qwen2_moe"))
    # Qwen2-MoE's shared expert is gated, DeepSeek-V3's is not; DeepSeek-V3 routes by sigmoid
    # with no balancing loss
    assert families.FAMILIES["qwen2_moe"].fixed == {"shared_expert_gate": True}
    assert families.ARCHITECTURE_DEFAULTS["shared_expert_gate"] is False
    assert families.FAMILIES["deepseek_v3"].fixed == {"router": "sigmoid", "aux_loss_coef": 0.0}
    for name, values in fig.PUBLISHED.items():
        config = analyze.load_model(name).config
        for field, value in values.items():
            if field == "n_shared_experts":  # read as one MLP n_shared_experts times as wide
                assert config.shared_expert_intermediate_size == value * config.intermediate_size
            else:
                assert getattr(config, field) == value, (name, field)
