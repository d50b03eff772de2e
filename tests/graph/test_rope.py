"""Rotary frequencies and scalings against transformers' own rope initialisation."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from poot_core import Reason, Unsupported
from poot_core import rope as ops

SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
     "mscale": 1.0, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048, "mscale": 0.707,
     "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: f"{s['rope_type']}-{s['factor']}")
def test_frequencies_and_attention_factor_match_transformers(scaling):
    config = LlamaConfig(hidden_size=1024, num_attention_heads=8, max_position_embeddings=131072,
                         rope_parameters={**scaling, "rope_theta": 500000.0})
    inv_ref, factor_ref = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
    ours = ops.inverse_frequencies(500000.0, 128, tuple(sorted(scaling.items())))
    torch.testing.assert_close(ours, inv_ref.float(), rtol=1e-6, atol=0)
    assert ops.rope_attention_factor(scaling) == pytest.approx(factor_ref)


def test_unknown_scaling_is_unsupported():
    with pytest.raises(Unsupported) as err:
        ops.inverse_frequencies(10000.0, 64, (("rope_type", "longrope"),))
    assert err.value.reason is Reason.OPERATION and "longrope" in str(err.value)


@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("dim", [64, 32])  # full and partial rotary
def test_step_table_rotation_equals_the_plain_one(style, dim):
    from poot_core.cpu import ops as cpu_ops

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 3, 64, generator=g)
    positions = torch.arange(10).reshape(2, 5)
    cos, sin = cpu_ops.rope_tables(positions, 10000.0, dim, {})
    plain = cpu_ops.rope(x, cos, sin, style)
    fast = cpu_ops.rope_with(x, cpu_ops.rope_step_table(cos, sin, style), style)
    torch.testing.assert_close(fast, plain, rtol=1e-6, atol=1e-6)
