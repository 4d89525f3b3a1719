"""Block-sparse attention for torch: `block_sparse_attention` and the module `BlockSparseAttention`.

The op is a custom op with autograd (``torch.ops.sparseblocks.attention_forward``, returning the
output and the log-sum-exp the backward reads, and ``attention_backward``), so a compiled model
runs it with no graph break. The layouts cross the op boundary as a string key (their masks'
digest), which a compiled graph holds as a constant. On CPU tensors it computes with torch's
operations (dense scores under the layout's mask), the same sums as the kernels. Dropout draws
the kernels' counter-based bits from a seed taken from torch's generator each call (kept for the
backward); on CPU tensors the same bits, so a seed gives one mask on either device.
"""

import hashlib
import math
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..attention import attention as _attention
from ..attention import attention_grad as _attention_grad
from ..layout import BlockLayout
from . import cpu

_layouts = {}


def _key(layouts):
    digest = hashlib.sha1()
    for one in layouts:
        digest.update(np.packbits(np.asarray(one.mask, bool)).tobytes())
        digest.update(repr((one.mask.shape, one.block_size)).encode())
    key = digest.hexdigest()[:20]
    _layouts.setdefault(key, tuple(layouts))
    return key


def _mask(layouts, seq, causal, device):
    """The (heads, seq, seq) boolean mask of the layouts (and the causal triangle)."""
    parts = []
    for one in layouts:
        bs = one.block_size
        m = torch.as_tensor(np.array(one.mask, bool), device=device)
        parts.append(m.repeat_interleave(bs, 0).repeat_interleave(bs, 1)[:seq, :seq])
    mask = torch.stack(parts)
    if causal:
        mask = mask & torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    return mask


def _cpu_keep(shape, dropout_p, seed, device):
    """keep / (1 - dropout_p) as a (batch, heads, seq, seq) float64 tensor: the kernels' bits."""
    from ..attention.dropout import keep_host

    B, H, S = shape[:3]
    keep = keep_host(B, H, S, dropout_p, seed, 0)
    return torch.as_tensor(keep, device=device).double() / (1.0 - dropout_p)


def _cpu_forward(q, k, v, layouts, causal, scale, dropout_p=0.0, seed=0):
    mask = _mask(layouts, q.shape[2], causal, q.device)
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, -1)
    seen = torch.isfinite(lse)
    p = torch.exp(scores - torch.where(seen, lse, torch.zeros_like(lse))[..., None]).masked_fill(~mask, 0)
    if dropout_p:
        p = p * _cpu_keep(q.shape, dropout_p, seed, q.device)
    out = (p @ v.double()).to(q.dtype)
    return out, lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)


def _cpu_backward(q, k, v, out, lse, dout, layouts, causal, scale, dropout_p=0.0, seed=0):
    mask = _mask(layouts, q.shape[2], causal, q.device)
    q64, k64, v64, o64, do64, lse64 = (t.double() for t in (q, k, v, out, dout, lse))
    seen = torch.isfinite(lse64)[..., None]
    scores = (q64 @ k64.transpose(-1, -2)) * scale
    p = torch.exp(scores - torch.where(seen, lse64[..., None], torch.zeros_like(lse64[..., None])))
    p = p.masked_fill(~(mask & seen), 0)
    z = _cpu_keep(q.shape, dropout_p, seed, q.device) if dropout_p else 1.0
    dv = (p * z).transpose(-1, -2) @ do64
    ds = p * ((do64 @ v64.transpose(-1, -2)) * z - (do64 * o64).sum(-1, keepdim=True))
    return tuple(t.to(q.dtype) for t in ((ds @ k64) * scale, (ds.transpose(-1, -2) @ q64) * scale, dv))


@torch.library.custom_op("sparseblocks::attention_forward", mutates_args=())
def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: str, causal: bool,
                      scale: float, dropout_p: float, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of `sparseblocks.attention.attention` over the layouts registered as ``key``."""
    layouts = _layouts[key]
    if cpu.takes(q):
        return _cpu_forward(q, k, v, layouts, causal, scale, dropout_p, seed)
    out, lse = _attention(q.contiguous(), k.contiguous(), v.contiguous(), list(layouts), causal=causal, scale=scale,
                          dropout_p=dropout_p, seed=seed, return_lse=True)
    return out, lse


@torch.library.custom_op("sparseblocks::attention_backward", mutates_args=())
def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                       dout: torch.Tensor, key: str, causal: bool, scale: float, dropout_p: float,
                       seed: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layouts = _layouts[key]
    if cpu.takes(q):
        return _cpu_backward(q, k, v, out, lse, dout, layouts, causal, scale, dropout_p, seed)
    dq, dk, dv = _attention_grad(*(t.contiguous() for t in (q, k, v, out)), lse.contiguous(), dout.contiguous(),
                                 list(layouts), causal=causal, scale=scale, dropout_p=dropout_p, seed=seed)
    return dq, dk, dv


@attention_forward.register_fake
def _(q, k, v, key, causal, scale, dropout_p, seed):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float64 if q.dtype == torch.float64
                                            else torch.float32)


@attention_backward.register_fake
def _(q, k, v, out, lse, dout, key, causal, scale, dropout_p, seed):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, ctx.key, ctx.causal, ctx.scale, ctx.dropout_p, ctx.seed = inputs
    ctx.save_for_backward(q, k, v, *output)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_backward(q, k, v, out, lse, dout.contiguous(), ctx.key, ctx.causal, ctx.scale,
                                    ctx.dropout_p, ctx.seed)
    return dq, dk, dv, None, None, None, None, None


attention_forward.register_autograd(_backward, setup_context=_setup)


def _checked_layouts(layout, heads):
    layouts = list(layout) if isinstance(layout, (list, tuple)) else [layout] * heads
    if len(layouts) != heads or not all(isinstance(one, BlockLayout) for one in layouts):
        raise ValueError(f"layout: expected one BlockLayout or {heads} (one a head)")
    return layouts


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           layout: Union[BlockLayout, Sequence[BlockLayout]], causal: bool = False,
                           scale: Optional[float] = None, key: Optional[str] = None, dropout_p: float = 0.0,
                           seed: Optional[int] = None) -> torch.Tensor:
    """Differentiable `sparseblocks.attention.attention` on (batch, heads, seq, head_dim) tensors.
    ``key``: the layouts' registered key (`layout_key`), which a function compiled with
    torch.compile passes (working it out hashes the masks, which the compiler does not trace;
    `BlockSparseAttention` keeps its own). ``dropout_p``: the probabilities' dropout, its bits
    under ``seed`` (by default one drawn from torch's generator, so `torch.manual_seed` repeats
    it), the same on the backward."""
    if q.dim() != 4:
        raise ValueError(f"q: expected (batch, heads, seq, head_dim), got shape {tuple(q.shape)}")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if key is None:
        key = _key(_checked_layouts(layout, q.shape[1]))
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {dropout_p}")
    if seed is None:
        seed = int(torch.randint(0, 2 ** 62, ()).item()) if dropout_p else 0
    return attention_forward(q, k, v, key, bool(causal), scale, dropout_p, int(seed))[0]


def layout_key(layout: Union[BlockLayout, Sequence[BlockLayout]], heads: int) -> str:
    """The key under which the op finds these layouts (one, or one a head)."""
    return _key(_checked_layouts(layout, heads))


class BlockSparseAttention(torch.nn.Module):
    """Multi-head self-attention over a block layout: ``x`` (batch, seq, embed_dim) -> the same,
    as ``nn.MultiheadAttention(embed_dim, num_heads, batch_first=True)(x, x, x)[0]`` with the
    layout's mask (a query sees the keys of its layout's blocks; with ``causal`` only those up
    to it). ``layout``: one `BlockLayout` over the (query block, key block) grid of the sequence,
    or one a head. ``dropout``: the attention probabilities' dropout while training, as
    ``nn.MultiheadAttention``'s."""

    def __init__(self, embed_dim: int, num_heads: int, layout: Any, causal: bool = False, bias: bool = True,
                 device: Any = None, dtype: Any = None, dropout: float = 0.0) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim: expected a multiple of num_heads ({num_heads}), got {embed_dim}")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout: expected a probability in [0, 1), got {dropout}")
        self.embed_dim, self.num_heads, self.causal, self.dropout = embed_dim, num_heads, bool(causal), float(dropout)
        self.layouts: List[BlockLayout] = _checked_layouts(layout, num_heads)
        self.key = _key(self.layouts)
        self.in_proj = torch.nn.Linear(embed_dim, 3 * embed_dim, bias=bias, device=device, dtype=dtype)
        self.out_proj = torch.nn.Linear(embed_dim, embed_dim, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.embed_dim:
            raise ValueError(f"x: expected (batch, seq, {self.embed_dim}), got shape {tuple(x.shape)}")
        B, S, E = x.shape
        heads = self.num_heads
        q, k, v = self.in_proj(x).view(B, S, 3, heads, E // heads).permute(2, 0, 3, 1, 4).unbind(0)
        out = block_sparse_attention(q.contiguous(), k.contiguous(), v.contiguous(), self.layouts, self.causal,
                                     key=self.key, dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(out.transpose(1, 2).reshape(B, S, E))
