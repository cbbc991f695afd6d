"""Batches are drawn only from packed windows of token ids, and the tokenizer decodes only ids of
its vocabulary: anything else is refused on one line saying what it got."""

from __future__ import annotations

import pytest
import torch
from refused_on_one_line import refused

from moe_tutorial.train import data


@pytest.mark.parametrize("packed, words", [
    ([[1, 2, 3]], ["a tensor"]),
    (torch.arange(10), ["1 dimension"]),
    (torch.rand(8, 5), ["torch.float32", "token ids"]),
    (torch.zeros(8, 1, dtype=torch.long), ["seq_len + 1"]),
])
def test_batches_of_something_not_packed_windows_are_refused(packed, words):
    refused(lambda: next(data.iterate_batches(packed, 2)), ValueError, "packed", *words)


def test_a_token_id_outside_the_vocabulary_is_named():
    refused(lambda: data.ProteinTokenizer().decode([999]), ValueError, "999", "vocabulary")
