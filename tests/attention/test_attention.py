"""Block-sparse attention (sparseblocks/attention) against its twin (reference/attention.py):
random layouts shared by the heads or one a head, causal diagonal blocks, queries that see no key
(zeros, no NaN), every dtype, the three kernels and the fused ones; and the errors bad input gets
before any launch."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseblocks.attention import AttentionConfig, attention, attention_grad
from sparseblocks.layout import BlockLayout
from sparseblocks.runtime.backend import SIMULATOR
from sparseblocks.reference import attention as reference
from strategies import assert_close, values

from sparseblocks.attention.hopper import make_forward as MAKE_FORWARD
from sparseblocks.attention.hopper import make_key_grads as MAKE_KEY_GRADS
from sparseblocks.attention.hopper import make_query_grads as MAKE_QUERY_GRADS


@settings(max_examples=10, deadline=None)
@given(dtype=st.sampled_from(["float32", "float16", "bfloat16", "float64"]), causal=st.booleans(),
       per_head=st.booleans(), seed=st.integers(0, 2**16))
def test_three_kernels_match_the_twin(dtype, causal, per_head, seed):
    check_against_twin(dtype, causal, per_head, seed, (1, 2, 8, 3, 4))


def check_against_twin(dtype, causal, per_head, seed, shape, config=None, empty_row=True, grads=True):
    """Forward (output and lse) and gradients (``grads``) of random layouts of (B, H, bs, blocks, D)
    against the twin."""
    rng = np.random.default_rng(seed)
    B, H, bs, blocks, D = shape
    S = bs * blocks
    masks = [rng.random((blocks, blocks)) < 0.5 for _ in range(H if per_head else 1)]
    masks[0][-1, -1] = True
    if empty_row:
        masks[0][0] = False  # a query block that sees nothing
    layouts = [BlockLayout(m, bs) for m in masks]
    layout = layouts if per_head else layouts[0]
    q, k, v = (values(rng, (B, H, S, D), dtype) for _ in range(3))
    out, lse = attention(q, k, v, layout, causal=causal, return_lse=True, config=config)
    want, want_lse = reference.forward(q, k, v, layout, causal)
    assert np.isfinite(np.asarray(out, np.float64)).all()
    assert_close(out, want, dtype, "out", terms=S)
    seen = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse), seen)
    np.testing.assert_allclose(np.asarray(lse)[seen], want_lse[seen], rtol=1e-5, atol=1e-5)
    if not grads:
        return
    dout = values(rng, (B, H, S, D), dtype)
    grads = attention_grad(q, k, v, out, lse, dout, layout, causal=causal, config=config)
    wants = reference.backward(q, k, v, np.asarray(out, np.float64), want_lse, dout, layout, causal)
    for name, got, want_g in zip(("dq", "dk", "dv"), grads, wants):
        assert np.isfinite(np.asarray(got, np.float64)).all(), name
        assert_close(got, want_g, dtype, name, terms=S)


def test_fused_kernels_match_the_twin_on_one_tile():
    """The fused kernels (fp16, one 64-row tile: the causal mask inside it) in the simulator."""
    check_against_twin("float16", True, False, 5, (1, 1, 64, 1, 16), empty_row=False)


def test_fused_kernels_refill_their_rings():
    """Three 64-row tiles, causal, rings of two stages: query tiles walk up to three key tiles and
    key tiles up to three query tiles, so every kernel's ring refills its buffers."""
    config = AttentionConfig(stages=2, backward_stages=2)
    check_against_twin("float16", True, False, 7, (1, 1, 64, 3, 16), config, empty_row=False)


@pytest.mark.parametrize("bs, blocks, groups, causal, grads, keys", [
    (64, 3, 1, True, True, 64), (128, 1, 2, False, True, 64), (64, 2, 1, True, True, 64),
    (128, 3, 1, True, False, 128), (64, 8, 1, True, False, 64)])
def test_hopper_kernels_match_the_twin(monkeypatch, bs, blocks, groups, causal, grads, keys):
    """The wgmma kernels (`hopper.py`; sm_90, here the simulator's twins of wgmma), head_dim 64:
    three tiles of one warpgroup each, causal, walking up to three key tiles through rings that
    refill (the mask on the diagonal tiles); a block of 128 queries on two warpgroups; with
    ``grads`` the backward's dq, dk and dv too; the forward scoring 128 keys a tile over three blocks."""
    from sparseblocks.attention import api, hopper

    monkeypatch.setattr(api, "_hopper", lambda: True)
    made = []
    monkeypatch.setattr(hopper, "make_forward", lambda *key: made.append(key) or MAKE_FORWARD(*key))
    monkeypatch.setattr(hopper, "make_query_grads", lambda *key: made.append(key) or MAKE_QUERY_GRADS(*key))
    monkeypatch.setattr(hopper, "make_key_grads", lambda *key: made.append(key) or MAKE_KEY_GRADS(*key))
    config = AttentionConfig(hopper_forward=True, hopper_stages=2, hopper_groups=groups, backward_stages=2,
                             hopper_forward_keys={64: keys})
    check_against_twin("float16", causal, False, 11, (1, 1, bs, blocks, 64), config, empty_row=False, grads=grads)
    assert made == [("float16", 64, 3, groups, keys)] + [("float16", 64, 2, groups)] * (2 * grads)


@pytest.mark.gpu
@pytest.mark.skipif(SIMULATOR, reason="sizes the simulator would take minutes over")
@pytest.mark.parametrize("dtype, D, stages", [("float16", 64, 2), ("float16", 128, 2), ("bfloat16", 64, 2),
                                              ("bfloat16", 128, 2), ("float16", 16, 3), ("bfloat16", 32, 4)])
@settings(max_examples=15, deadline=None)
@given(causal=st.booleans(), per_head=st.booleans(), bs=st.sampled_from([64, 128]), blocks=st.integers(1, 4),
       B=st.integers(1, 2), H=st.integers(1, 3), seed=st.integers(0, 2**16),
       hopper=st.sampled_from([(2, 2, 3, 64), (1, 3, 4, 64), (2, 2, 3, 128), None]))
def test_fused_kernels_match_the_twin(dtype, D, stages, causal, per_head, bs, blocks, B, H, seed, hopper):
    """On sm_90 the kernels at head_dim 64 and 128 run on wgmma (``hopper``: their warpgroups, the
    backward's and the forward's stages, the forward's keys a tile), or with None on mma.sync."""
    groups, hopper_stages, forward_stages, keys = hopper or (2, 2, 3, 64)
    config = AttentionConfig(stages=stages, backward_stages=stages, hopper=hopper is not None,
                             hopper_forward=hopper is not None, hopper_groups=groups, hopper_stages=hopper_stages,
                             hopper_forward_stages=forward_stages, hopper_forward_keys={D: keys})
    check_against_twin(dtype, causal, per_head, seed, (B, H, bs, blocks, D), config, empty_row=blocks > 1)


def test_config_checks_its_fields():
    with pytest.raises(ValueError, match="stages"):
        AttentionConfig(stages=1)
    with pytest.raises(ValueError, match="hopper_groups"):
        AttentionConfig(hopper_groups=3)
    with pytest.raises(ValueError, match="hopper_forward_stages"):
        AttentionConfig(hopper_forward_stages=2)
    with pytest.raises(ValueError, match=r"hopper_forward_keys\[128\]"):
        AttentionConfig(hopper_forward_keys={128: 32})
    with pytest.raises(TypeError, match="hopper_forward_keys: expected"):
        AttentionConfig(hopper_forward_keys="128")
    assert AttentionConfig(hopper_forward_keys=128).wgmma_keys(64) == 128
    assert AttentionConfig().wgmma_keys(64) == 64 and AttentionConfig().wgmma_keys(128) == 128
    with pytest.raises(TypeError, match="AttentionConfig"):
        attention(*(np.zeros((1, 1, 8, 4), np.float32),) * 3, BlockLayout.causal(1, block_size=8), config=3)


def test_bad_calls_raise():
    layout = BlockLayout.causal(2, block_size=8)
    q = np.zeros((1, 2, 16, 4), np.float32)
    with pytest.raises(ValueError, match="k: expected q's shape"):
        attention(q, q[:, :1], q, layout)
    with pytest.raises(ValueError, match="batch, heads, seq"):
        attention(q[0], q[0], q[0], layout)
    with pytest.raises(ValueError, match="\\(3, 3\\) grid"):
        attention(np.zeros((1, 2, 24, 4), np.float32), *(np.zeros((1, 2, 24, 4), np.float32),) * 2, layout)
    with pytest.raises(ValueError, match="one a head"):
        attention(q, q, q, [layout] * 3)
    with pytest.raises(TypeError, match="BlockLayout"):
        attention(q, q, q, np.ones((2, 2)))
    with pytest.raises(TypeError, match="dtype"):
        attention(q.astype(np.int32), q.astype(np.int32), q.astype(np.int32), layout)
