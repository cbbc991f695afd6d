"""Bad and unusual inputs to the expert layer, the quantizer and routing, as a learner makes them.

Each case gets either the right result or one ValueError, on one line, that names the bad value
and says how to fix it: `refused(call, value, fix)` checks the message against both patterns.
Expert splits that do not match the rows (which once gave uninitialised memory) are
`test_mismatched_expert_splits_are_refused`; the rest of the expert layer, the quantizer and
routing are `test_bad_input_is_refused` and `test_unusual_input_gets_the_right_result`.
"""

import re

import pytest
import torch

from moe_tutorial.moe import model, routing
from moe_tutorial.moe.dispatch import run_experts
from moe_tutorial.moe.experts import (
    StandInGroupedLinear,
    TEGroupedLinearExperts,
    TEOpsExperts,
    create,
    grouped_mm,
    torch_ops,
)
from moe_tutorial.precision import quant

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOKENS, TOP_K = 4, 16, 8, 5, 2
g = torch.Generator().manual_seed(0)
hidden = torch.randn(TOKENS, HIDDEN, generator=g)
indices = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 2]])
weights = torch.rand(TOKENS, TOP_K, generator=g)
logits = torch.randn(TOKENS, NUM_EXPERTS, generator=g)
rows = torch.randn(6, HIDDEN, generator=g)  # 6 rows for 3 experts, 16 features: _grouped_mm runs
expert_weights = torch.randn(3, HIDDEN, HIDDEN, generator=g)
odd_rows = torch.randn(6, 3, generator=g)  # rows of 12 bytes: the per-expert loop runs
odd_weights = torch.randn(3, 5, 3, generator=g)


def ends(*values):
    return torch.tensor(values, dtype=torch.int32)


def layer(module):
    """The expert layer as a model runs it: the dispatcher around `module`."""
    return lambda hidden, indices, weights: run_experts(module, hidden, indices, weights)[0]


def experts(backend):
    module = create(backend, NUM_EXPERTS, HIDDEN, INTERMEDIATE)
    torch.nn.init.normal_(module.gate_up_proj, generator=g)
    torch.nn.init.normal_(module.down_proj, generator=g)
    return layer(module)


def linear(bias=False):
    return StandInGroupedLinear(3, HIDDEN, INTERMEDIATE, bias=bias)


def te_experts(cls):
    return layer(cls(NUM_EXPERTS, HIDDEN, INTERMEDIATE))


def refused(call, value, fix):
    with pytest.raises(ValueError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message, message
    assert re.search(value, message), f"the message does not name the bad value: {message}"
    assert re.search(fix, message), f"the message does not say how to fix it: {message}"


CUMSUM_FIX = r"torch\.cumsum\(m_splits"
SPLIT_CASES = [
    pytest.param(lambda: grouped_mm(rows, expert_weights, ends(2, 4, 5)), r"row 5.*6 rows",
                 CUMSUM_FIX, id="grouped_mm-offsets-end-short-of-the-rows"),
    pytest.param(lambda: grouped_mm(rows, expert_weights, ends(2, 4, 8)), r"row 8.*6 rows",
                 CUMSUM_FIX, id="grouped_mm-offsets-end-past-the-rows"),
    pytest.param(lambda: grouped_mm(rows, expert_weights, ends(4, 2, 6)), r"offsets\[1\]=2",
                 CUMSUM_FIX, id="grouped_mm-decreasing-offsets"),
    pytest.param(lambda: grouped_mm(rows, expert_weights, ends(-1, 2, 6)), r"offsets\[0\]=-1",
                 CUMSUM_FIX, id="grouped_mm-negative-offset"),
    pytest.param(lambda: grouped_mm(rows, expert_weights, ends(2, 6)), r"E=3.*\(2,\)",
                 CUMSUM_FIX, id="grouped_mm-one-offset-short"),
    pytest.param(lambda: grouped_mm(rows, expert_weights, ends(2, 4, 6).long()), "int64",
                 r"to\(torch\.int32\)", id="grouped_mm-int64-offsets"),
    pytest.param(lambda: grouped_mm(odd_rows, odd_weights, ends(2, 4, 5)), r"row 5.*6 rows",
                 CUMSUM_FIX, id="grouped_mm-loop-offsets-end-short"),
    pytest.param(lambda: grouped_mm(odd_rows, odd_weights, ends(4, 2, 6)), r"offsets\[1\]=2",
                 CUMSUM_FIX, id="grouped_mm-loop-decreasing-offsets"),
    pytest.param(lambda: linear()(rows, [2, 2, 1]), r"\[2, 2, 1\] sum to 5.*has 6",
                 "must add up", id="GroupedLinear-splits-sum-short"),
    pytest.param(lambda: linear()(rows, [2, 2, 3]), r"sum to 7.*has 6", "must add up",
                 id="GroupedLinear-splits-sum-long"),
    pytest.param(lambda: linear()(rows, [-1, 4, 3]), r"\[-1, 4, 3\].*negative", ">= 0",
                 id="GroupedLinear-negative-split"),
    pytest.param(lambda: linear()(rows, [2, 4]), r"expected 3 split sizes.*got 2",
                 "zeros included", id="GroupedLinear-one-split-short"),
    pytest.param(lambda: linear()(rows, torch.tensor([2, 2, 1])), "sum to 5", "must add up",
                 id="GroupedLinear-split-tensor-sum-short"),
    pytest.param(lambda: linear(bias=True)(rows, [2, 2, 1]), "sum to 5", "must add up",
                 id="GroupedLinear-with-bias-splits-sum-short"),
    pytest.param(lambda: torch_ops.Sequential(linear())(rows, [3, 3, 1]), "sum to 7",
                 "must add up", id="torch_ops-Sequential-splits-sum-long"),
]


@pytest.mark.parametrize("call, value, fix", SPLIT_CASES)
def test_mismatched_expert_splits_are_refused(call, value, fix):
    refused(call, value, fix)


BAD_CASES = [
    # grouped GEMM and the GroupedLinear stand-in: operands that do not fit
    pytest.param(lambda: grouped_mm(rows[:, :8], expert_weights, ends(2, 4, 6)), r"\(6, 8\)",
                 "same K", id="grouped_mm-rows-of-another-width"),
    pytest.param(lambda: linear()(rows[:, :8], [2, 2, 2]), r"\(6, 8\)", r"\[rows, 16\]",
                 id="GroupedLinear-rows-of-another-width"),
    # the experts' forward pass, every backend
    *[pytest.param(lambda b=b: experts(b)(hidden[:, :12], indices, weights), r"\(5, 12\)",
                   r"\[T, 16\]", id=f"{b}-hidden-of-another-width")
      for b in ("naive", "grouped_torch")],
    *[pytest.param(lambda b=b: experts(b)(hidden[0], indices[:1], weights[:1]), r"\(16,\)",
                   r"reshape\(-1, H\)", id=f"{b}-1d-hidden") for b in ("naive", "grouped_torch")],
    pytest.param(lambda: experts("naive")(hidden[None], indices, weights), r"\(1, 5, 16\)",
                 r"reshape\(-1, H\)", id="naive-3d-hidden"),
    *[pytest.param(lambda b=b: experts(b)(hidden, indices.float(), weights), "float32",
                   r"indices\.long\(\)", id=f"{b}-float-indices")
      for b in ("naive", "grouped_torch")],
    *[pytest.param(lambda b=b: experts(b)(hidden, indices + 1, weights), "expert 4",
                   "from 0 to 3", id=f"{b}-index-equal-to-num-experts")
      for b in ("naive", "grouped_torch")],
    *[pytest.param(lambda b=b: experts(b)(hidden, indices - 1, weights), "expert -1",
                   "from 0 to 3", id=f"{b}-negative-index") for b in ("naive", "grouped_torch")],
    *[pytest.param(lambda b=b: experts(b)(hidden, indices, weights[:, :1]), r"\(5, 1\)",
                   r"\[T, k\]", id=f"{b}-weights-of-another-shape")
      for b in ("naive", "grouped_torch")],
    pytest.param(lambda: experts("naive")(hidden, indices, weights[:, 0]), r"\(5,\)", r"\[T, k\]",
                 id="naive-1d-weights"),
    pytest.param(lambda: experts("grouped_torch")(hidden, indices, torch.ones_like(indices)),
                 "int64", "floating-point weight", id="grouped_torch-integer-weights"),
    pytest.param(lambda: experts("grouped_torch")(hidden, indices[:, 0], weights[:, 0]),
                 r"\(5,\)", r"unsqueeze\(1\)", id="grouped_torch-1d-indices"),
    pytest.param(lambda: experts("naive")(hidden[:4], indices, weights), "4 rows.*has 5",
                 "one row of indices per token", id="naive-fewer-hidden-rows-than-indices"),
    pytest.param(lambda: experts("grouped_torch")(hidden.long(), indices, weights), "int64",
                 "floating-point", id="grouped_torch-integer-hidden"),
    *[pytest.param(lambda c=c: te_experts(c)(hidden[:, :12], indices, weights), r"\(5, 12\)",
                   r"\[T, 16\]", id=f"{c.__name__}-hidden-of-another-width")
      for c in (TEGroupedLinearExperts, TEOpsExperts)],
    *[pytest.param(lambda c=c: te_experts(c)(hidden, indices + 1, weights), "expert 4",
                   "from 0 to 3", id=f"{c.__name__}-index-out-of-range")
      for c in (TEGroupedLinearExperts, TEOpsExperts)],
    pytest.param(lambda: te_experts(TEOpsExperts)(hidden, indices, weights[:, :1]), r"\(5, 1\)",
                 r"\[T, k\]", id="TEOpsExperts-weights-of-another-shape"),
    pytest.param(lambda: te_experts(TEGroupedLinearExperts)(hidden, indices.float(), weights),
                 "float32", r"indices\.long\(\)", id="TEGroupedLinearExperts-float-indices"),
    # routing
    pytest.param(lambda: model.route(logits, 5), "top_k=5", r"from 1 to .*\(4\)",
                 id="route-top_k-above-num-experts"),
    pytest.param(lambda: model.route(logits, 0), "top_k=0", r"from 1 to", id="route-top_k-0"),
    pytest.param(lambda: model.route(logits, 2.0), r"top_k=2\.0", "whole number",
                 id="route-float-top_k"),
    pytest.param(lambda: model.route(torch.tensor(1.0), 1), "0-d", "one score per expert",
                 id="route-0d-logits"),
    pytest.param(lambda: model.Router(HIDDEN, NUM_EXPERTS, 5), "top_k=5", r"from 1 to .*\(4\)",
                 id="Router-top_k-above-num-experts"),
    pytest.param(lambda: model.Router(HIDDEN, NUM_EXPERTS, 0), "top_k=0", "from 1 to",
                 id="Router-top_k-0"),
    pytest.param(lambda: model.Router(HIDDEN, NUM_EXPERTS, 2)(hidden[:, :12]), r"\(5, 12\)",
                 r"\[\.\.\., 16\]", id="Router-hidden-of-another-width"),
    pytest.param(lambda: routing.load_balancing_loss([], 2), "no layers", r"\[logits\]",
                 id="load_balancing_loss-empty-list"),
    pytest.param(lambda: routing.load_balancing_loss(logits, 2), "got a tensor", r"\[logits\]",
                 id="load_balancing_loss-tensor-not-list"),
    pytest.param(lambda: routing.load_balancing_loss([logits], 5), "top_k=5", "from 1 to",
                 id="load_balancing_loss-top_k-above-num-experts"),
    pytest.param(lambda: routing.load_balancing_loss([logits, logits[:, :3]], 2),
                 r"layer 1.*\(5, 3\)", r"\[T, 4\]", id="load_balancing_loss-layers-disagree-on-E"),
    pytest.param(lambda: routing.permute(hidden, indices + 1, None, NUM_EXPERTS), "expert 4",
                 "from 0 to 3", id="permute-index-equal-to-num-experts"),
    pytest.param(lambda: routing.permute(hidden, indices - 1, None, NUM_EXPERTS), "expert -1",
                 "from 0 to 3", id="permute-negative-index"),
    pytest.param(lambda: routing.permute(hidden, indices, None, NUM_EXPERTS, 0), "align=0",
                 "positive.*number of rows", id="permute-align-0"),
    pytest.param(lambda: routing.permute(hidden, indices, None, NUM_EXPERTS, 1.5), r"align=1\.5",
                 "positive whole number", id="permute-fractional-align"),
    pytest.param(lambda: routing.permute(hidden, indices.float(), None, NUM_EXPERTS), "float32",
                 r"indices\.long\(\)", id="permute-float-indices"),
    pytest.param(lambda: routing.permute(hidden, indices, weights[:, :1], NUM_EXPERTS),
                 r"\(5, 1\)", r"\[T, k\]", id="permute-weights-of-another-shape"),
    pytest.param(lambda: routing.unpermute(
        routing.permute(hidden, indices, None, NUM_EXPERTS)[0],
        routing.permute(hidden, indices, None, NUM_EXPERTS)[2], weights[:, :1]),
        r"\(5, 1\)", "routed with these indices", id="unpermute-weights-of-another-shape"),
    pytest.param(lambda: routing.sort_by_expert(indices - 1, NUM_EXPERTS), "expert -1",
                 "from 0 to 3", id="sort_by_expert-negative-index"),
    # the quantizer
    pytest.param(lambda: quant.mxfp8_quantize(torch.tensor(3.0)), r"shape \(\)", "reshape",
                 id="mxfp8_quantize-0d"),
    pytest.param(lambda: quant.mxfp8_quantize(torch.arange(64)), "int64", r"x\.float\(\)",
                 id="mxfp8_quantize-integer-tensor"),
    pytest.param(lambda: quant.mxfp8_quantize(torch.ones(2, 64), dim=5), "dim=5",
                 "from -2 to 1", id="mxfp8_quantize-dim-out-of-range"),
    pytest.param(lambda: quant.mxfp8_dequantize(torch.tensor(1, dtype=torch.uint8),
                                                torch.tensor(127, dtype=torch.uint8)),
                 r"shape \(\)", "at least one dimension", id="mxfp8_dequantize-0d"),
    pytest.param(lambda: quant.mxfp8_dequantize(*quant.mxfp8_quantize(torch.ones(2, 64))[:1],
                                                torch.ones(2, 2)), "float32",
                 "scales mxfp8_quantize returned", id="mxfp8_dequantize-float-scales"),
    pytest.param(lambda: quant.mxfp8_dequantize(torch.ones(2, 64),
                                                torch.full((2, 2), 127, dtype=torch.uint8)),
                 "float32", "codes fp8_encode", id="mxfp8_dequantize-values-not-codes"),
    pytest.param(lambda: quant.fp8_decode(torch.ones(4)), "float32", "codes fp8_encode",
                 id="fp8_decode-float32-values"),
    pytest.param(lambda: quant.fp8_decode(torch.arange(4)), "int64", "codes fp8_encode",
                 id="fp8_decode-int64"),
    pytest.param(lambda: quant.fp8_decode(quant.fp8_cast(torch.ones(4), "e5m2"), "e4m3"),
                 "float8_e5m2", "fmt matching", id="fp8_decode-e5m2-tensor-read-as-e4m3"),
    pytest.param(lambda: quant.fp8_encode(torch.arange(8)), "int64", r"x\.float\(\)",
                 id="fp8_encode-integer-tensor"),
    pytest.param(lambda: quant.fp8_cast(torch.ones(8, dtype=torch.bool)), "bool", r"x\.float\(\)",
                 id="fp8_cast-bool-tensor"),
    pytest.param(lambda: quant.per_tensor_quantize(torch.arange(8)), "int64", r"x\.float\(\)",
                 id="per_tensor_quantize-integer-tensor"),
    pytest.param(lambda: quant.tile_fake_quantize(torch.ones(128)), r"\(128,\)", "reshape",
                 id="tile_fake_quantize-1d"),
    pytest.param(lambda: quant.tile_fake_quantize(torch.ones(4, 4, dtype=torch.int64)), "int64",
                 r"x\.float\(\)", id="tile_fake_quantize-integer-tensor"),
    pytest.param(lambda: quant.fake_quantize(torch.tensor(1.0), "mxfp8_te"), r"shape \(\)",
                 "reshape", id="fake_quantize-0d-blocks"),
    pytest.param(lambda: quant.fake_quantize(torch.arange(64), "fp8_current"), "int64",
                 r"x\.float\(\)", id="fake_quantize-integer-tensor"),
    pytest.param(lambda: quant.quantization_error(torch.arange(64), "mxfp8_te"), "int64",
                 r"x\.float\(\)", id="quantization_error-integer-tensor"),
    pytest.param(lambda: quant.dynamic_range_histogram(torch.tensor(3.0)), r"shape \(\)",
                 "reshape", id="dynamic_range_histogram-0d"),
]


@pytest.mark.parametrize("call, value, fix", BAD_CASES)
def test_bad_input_is_refused(call, value, fix):
    refused(call, value, fix)


def same_output_for_int32_indices(backend):
    module = experts(backend)
    assert torch.equal(module(hidden, indices.int(), weights), module(hidden, indices, weights))


def same_output_for_integral_float_splits():
    module = linear()
    assert torch.equal(module(rows, [2.0, 1.0, 3.0]), module(rows, [2, 1, 3]))


def no_tokens_give_an_empty_output(backend):
    out = experts(backend)(hidden[:0], indices[:0], weights[:0])
    assert out.shape == (0, HIDDEN)


def ragged_last_dim_is_zero_padded():
    x = torch.randn(2, 40, generator=g)
    data, scales = quant.mxfp8_quantize(x)
    padded_data, padded_scales = quant.mxfp8_quantize(torch.nn.functional.pad(x, (0, 24)))
    assert torch.equal(data.view(torch.uint8), padded_data.view(torch.uint8)[:, :40])
    assert torch.equal(scales, padded_scales)
    assert quant.mxfp8_dequantize(data, scales).shape == x.shape


def empty_last_dim_gives_empty_blocks():
    data, scales = quant.mxfp8_quantize(torch.ones(2, 0))
    assert data.shape == (2, 0) and scales.shape == (2, 0)


def a_scalar_is_quantized_per_tensor():
    data, scale_inv = quant.per_tensor_quantize(torch.tensor(3.0))
    assert data.float().item() == 448.0 and scale_inv.item() == pytest.approx(3.0 / 448.0)


def one_token_of_logits_routes_like_a_batch_of_one():
    one_weights, one_indices = model.route(logits[0], TOP_K)
    batch_weights, batch_indices = model.route(logits[:1], TOP_K)
    assert torch.equal(one_indices, batch_indices[0])
    assert torch.equal(one_weights, batch_weights[0])


def a_tuple_of_layers_is_a_list_of_layers():  # HF passes the router logits as a tuple
    assert torch.equal(routing.load_balancing_loss((logits, logits), TOP_K),
                       routing.load_balancing_loss([logits, logits], TOP_K))


GOOD_CASES = [
    pytest.param(lambda: same_output_for_int32_indices("naive"), id="naive-int32-indices"),
    pytest.param(lambda: same_output_for_int32_indices("grouped_torch"),
                 id="grouped_torch-int32-indices"),
    pytest.param(same_output_for_integral_float_splits, id="GroupedLinear-integral-float-splits"),
    pytest.param(lambda: no_tokens_give_an_empty_output("naive"), id="naive-no-tokens"),
    pytest.param(lambda: no_tokens_give_an_empty_output("grouped_torch"),
                 id="grouped_torch-no-tokens"),
    pytest.param(ragged_last_dim_is_zero_padded, id="mxfp8_quantize-last-dim-not-a-multiple-of-32"),
    pytest.param(empty_last_dim_gives_empty_blocks, id="mxfp8_quantize-empty-last-dim"),
    pytest.param(a_scalar_is_quantized_per_tensor, id="per_tensor_quantize-0d"),
    pytest.param(one_token_of_logits_routes_like_a_batch_of_one, id="route-1d-logits"),
    pytest.param(a_tuple_of_layers_is_a_list_of_layers, id="load_balancing_loss-tuple"),
]


@pytest.mark.parametrize("check", GOOD_CASES)
def test_unusual_input_gets_the_right_result(check):
    check()
