"""The attention twin (reference/attention.py) against torch's scaled_dot_product_attention with
the same boolean mask (rows that see some key), and its backward against torch's autograd."""

import numpy as np
import torch

from sparseblocks.layout import BlockLayout
from sparseblocks.reference import attention as reference


def test_twin_matches_sdpa_and_its_gradients():
    rng = np.random.default_rng(0)
    B, H, S, D, bs = 2, 2, 32, 8, 8
    layouts = [BlockLayout.strided(S // bs, 2, causal=True, block_size=bs), BlockLayout.global_window(S // bs, 1, 1, block_size=bs)]
    q, k, v, dout = (rng.standard_normal((B, H, S, D)) for _ in range(4))
    out, lse = reference.forward(q, k, v, layouts, causal=True)
    m = torch.tensor(reference.mask(layouts, H, S, causal=True))
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    want = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=m)
    np.testing.assert_allclose(out, want.detach().numpy(), atol=1e-12)
    want.backward(torch.tensor(dout))
    for got, t in zip(reference.backward(q, k, v, out, lse, dout, layouts, causal=True), (tq, tk, tv)):
        np.testing.assert_allclose(got, t.grad.numpy(), atol=1e-10)


def test_a_query_that_sees_nothing_gets_zeros():
    mask = np.zeros((2, 2), bool)
    mask[1, :] = True
    layout = BlockLayout(mask, 8)
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 1, 16, 4)) for _ in range(3))
    out, lse = reference.forward(q, k, v, layout)
    assert np.all(out[0, 0, :8] == 0) and np.all(np.isneginf(lse[0, 0, :8])) and np.isfinite(out).all()
    grads = reference.backward(q, k, v, out, lse, np.ones_like(q), layout)
    assert all(np.isfinite(g).all() for g in grads) and np.all(grads[0][0, 0, :8] == 0)
