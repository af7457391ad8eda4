"""Whole-program compiles on a real GPU that CPU CI cannot see (``@pytest.mark.gpu``, skipped
without an sm_90 GPU): XLA GPU (jax 0.11.2) fails to compile the decode step at batch 1 with a
traced ``active`` mask when the masks are written as ``int(active) > 0``, which broke
``jaxdecode.generate`` for one prompt on GPUs only (model.py ``_forward`` builds the decode masks
from the boolean ``active``; until session 7 a one-row loop also carried an idle second row)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdecode as jd
from test_decode_attention import gpu_only

pytestmark = gpu_only


@pytest.fixture(scope="module")
def tiny():
    return jd.init_params(jd.Config.from_preset("tiny"), jax.random.key(3), "float32")


@pytest.mark.parametrize("rows", [1, 2])
def test_decode_step_with_active_mask(tiny, rows):
    """A traced ``active`` mask at batch 1 (how generate steps): compiles, the active row gets the
    logits of the same step without a mask, an inactive row is left untouched."""
    prompt = np.random.default_rng(rows).integers(0, 1000, (rows, 5))
    tokens = jnp.array([7, 9][:rows])
    results = []
    for active in (jnp.array([True, False][:rows]), None):
        state = jd.init_state(tiny.config, rows, 64)
        _, state = jd.prefill(tiny, state, prompt, np.full(rows, 5))
        logits, state = jd.decode_step(tiny, state, tokens, active)
        results.append((np.asarray(logits), np.asarray(state.lengths)))
    (masked, masked_len), (plain, plain_len) = results
    np.testing.assert_allclose(masked[0], plain[0], rtol=1e-5, atol=1e-5 * np.abs(plain).max())
    assert masked_len[0] == 6 and plain_len[0] == 6
    if rows == 2:
        assert masked_len[1] == 5 and not masked[1].any()


@pytest.mark.parametrize("rows", [1, 3])
def test_generate(tiny, rows):
    prompts = np.random.default_rng(10 + rows).integers(0, 1000, (rows, 4)).tolist()
    out = jd.generate(tiny, prompts, 12, eos_token_ids=(), chunk_size=4)
    assert np.asarray(out.tokens).shape[0] == rows
    assert (np.asarray(out.num_generated) == 12).all()
    streamed = np.concatenate([c.tokens for c in jd.generate_stream(
        tiny, prompts, 12, eos_token_ids=(), chunk_size=4)], axis=1)
    np.testing.assert_array_equal(streamed[:, :12], np.asarray(out.tokens)[:, :12])
