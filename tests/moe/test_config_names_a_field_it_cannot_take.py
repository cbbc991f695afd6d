"""A model config names the field it cannot take: a padding token outside the vocabulary, or a
field spelled as HF spells it, with the course's own name for it."""

from __future__ import annotations

import pytest
from refused_on_one_line import refused

from moe_tutorial.moe.config import preset


@pytest.mark.parametrize("pad", [-1, 10**6, True, 1.0])
def test_a_padding_token_outside_the_vocabulary_is_named(pad):
    with pytest.raises(ValueError, match=r"pad_token_id=.* must be a token id in \[0, "):
        preset("tiny", pad_token_id=pad)


def test_a_config_field_spelled_as_hf_spells_it_is_named():
    refused(lambda: preset("tiny").with_overrides(num_experts_per_tok=2), ValueError,
            "num_experts_per_tok", "top_k")
