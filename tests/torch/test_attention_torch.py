"""`block_sparse_attention` and `BlockSparseAttention` (sparseblocks/torch/attention.py): the
module against nn.MultiheadAttention under the layout's mask, gradients by gradcheck in float64
(torch's CPU ops) and the kernels' against them (in the simulator), opcheck, torch.compile."""

import pytest
import torch

from sparseblocks.layout import BlockLayout
from sparseblocks.reference import attention as reference
from sparseblocks.torch import BlockSparseAttention, block_sparse_attention
from sparseblocks.torch import attention as attention_ops

LAYOUTS = [BlockLayout.strided(3, 2, causal=True, block_size=8), BlockLayout.global_window(3, 1, 0, block_size=8)]


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_module_is_multihead_attention_under_the_mask(path):
    torch.manual_seed(0)
    module = BlockSparseAttention(16, 2, LAYOUTS, causal=True, device=device())
    mha = torch.nn.MultiheadAttention(16, 2, batch_first=True, device=device())
    with torch.no_grad():
        mha.in_proj_weight.copy_(module.in_proj.weight)
        mha.in_proj_bias.copy_(module.in_proj.bias)
        mha.out_proj.weight.copy_(module.out_proj.weight)
        mha.out_proj.bias.copy_(module.out_proj.bias)
    x = torch.randn(2, 24, 16, device=device())
    mask = torch.as_tensor(reference.mask(LAYOUTS, 2, 24, causal=True), device=device())
    want = mha(x, x, x, attn_mask=~mask.repeat(2, 1, 1), need_weights=False)[0]
    torch.testing.assert_close(module(x), want, rtol=1e-4, atol=1e-5)


def test_gradients(path):
    """gradcheck in float64 on torch's ops; the kernels' gradients against those."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 24, 4, device=device(), dtype=torch.float64, requires_grad=True) for _ in range(3))
    if not path:
        assert torch.autograd.gradcheck(lambda q, k, v: block_sparse_attention(q, k, v, LAYOUTS, causal=True),
                                        (q, k, v), eps=1e-6, atol=1e-6)
        return
    out = block_sparse_attention(q, k, v, LAYOUTS, causal=True)
    weights = torch.randn_like(out)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    want_out, lse = reference.forward(*(t.detach().cpu().numpy() for t in (q, k, v)), LAYOUTS, True)
    want = reference.backward(*(t.detach().cpu().numpy() for t in (q, k, v)), want_out, lse,
                              weights.cpu().numpy(), LAYOUTS, True)
    torch.testing.assert_close(out.detach().cpu(), torch.as_tensor(want_out), rtol=1e-10, atol=1e-12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), torch.as_tensor(w), rtol=1e-9, atol=1e-11)


def test_dropout_gradients(path):
    """Dropout under a given seed: gradcheck in float64 on torch's ops; the kernels' output and
    gradients against the twin with the same seed (the same bits on either path)."""
    torch.manual_seed(4)
    q, k, v = (torch.randn(1, 2, 24, 4, device=device(), dtype=torch.float64, requires_grad=True) for _ in range(3))

    def call(q, k, v):
        return block_sparse_attention(q, k, v, LAYOUTS, causal=True, dropout_p=0.3, seed=2**40 + 5)

    if not path:
        assert torch.autograd.gradcheck(call, (q, k, v), eps=1e-6, atol=1e-6)
    out = call(q, k, v)
    weights = torch.randn_like(out)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    arrays = [t.detach().cpu().numpy() for t in (q, k, v)]
    drop = {"dropout_p": 0.3, "seed": 2**40 + 5}
    want_out, lse = reference.forward(*arrays, LAYOUTS, True, **drop)
    want = reference.backward(*arrays, want_out, lse, weights.cpu().numpy(), LAYOUTS, True, **drop)
    torch.testing.assert_close(out.detach().cpu(), torch.as_tensor(want_out), rtol=1e-10, atol=1e-12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), torch.as_tensor(w), rtol=1e-9, atol=1e-11)


def test_module_dropout_while_training_only():
    """``dropout`` drops attention probabilities in training (a seed from torch's generator, so
    `torch.manual_seed` repeats a call), and not in eval mode."""
    torch.manual_seed(5)
    module = BlockSparseAttention(8, 2, LAYOUTS[0], device=device(), dropout=0.5)
    x = torch.randn(2, 24, 8, device=device())
    module.eval()
    plain = module(x)
    module.dropout = 0.0
    torch.testing.assert_close(module.train()(x), plain)
    module.dropout = 0.5
    torch.manual_seed(6)
    first = module(x)
    torch.manual_seed(6)
    torch.testing.assert_close(module(x), first)
    assert not torch.allclose(first, plain) and not torch.allclose(module(x), first)
    with pytest.raises(ValueError, match="dropout: expected a probability"):
        BlockSparseAttention(8, 2, LAYOUTS[0], dropout=1.0)


def test_opcheck_and_compile(path):
    torch.manual_seed(2)
    q, k, v = (torch.randn(1, 2, 24, 4, device=device()) for _ in range(3))
    key = attention_ops._key(LAYOUTS)
    checks = {"test_utils": ("test_schema", "test_faketensor")}
    torch.library.opcheck(attention_ops.attention_forward, (q, k, v, key, True, 0.5, 0.0, 0), **checks)
    torch.library.opcheck(attention_ops.attention_forward, (q, k, v, key, True, 0.5, 0.25, 7), **checks)
    module = BlockSparseAttention(8, 2, LAYOUTS[0], device=device())
    x = torch.randn(2, 24, 8, device=device())
    assert torch._dynamo.explain(module)(x).graph_break_count == 0
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    xs = x.clone().requires_grad_(True)
    compiled(xs).square().sum().backward()
    xe = x.clone().requires_grad_(True)
    module(xe).square().sum().backward()
    torch.testing.assert_close(xs.grad, xe.grad, rtol=1e-4, atol=1e-5)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        BlockSparseAttention(10, 3, LAYOUTS[0])
    with pytest.raises(ValueError, match="one a head"):
        BlockSparseAttention(8, 2, [LAYOUTS[0]] * 3)
    with pytest.raises(ValueError, match="batch, seq, 8"):
        BlockSparseAttention(8, 2, LAYOUTS[0])(torch.randn(2, 24, 4))
    with pytest.raises(ValueError, match="batch, heads, seq"):
        block_sparse_attention(torch.randn(2, 24, 4), torch.randn(2, 24, 4), torch.randn(2, 24, 4), LAYOUTS[0])
