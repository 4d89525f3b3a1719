"""`attention`: validation, the block tables on the device, the three kernels' launches."""

from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
from numba import cuda

from ..layout import BlockLayout
from ..runtime.arrays import Array, checked_operands, launch_stream
from ..runtime.compile import cached
from ..runtime.devices import active, on_arrays_device
from ..runtime.launch import launch, multiprocessors
from .simple import make_scores, make_softmax, make_weighted

DTYPES = ("float16", "bfloat16", "float32", "float64")
THREADS = 128
_tables: dict = {}


def _acc(dtype):
    from numba import float32, float64

    return float64 if dtype == "float64" else float32


def _layouts(layout, heads, seq):
    """The layouts of every head, checked against the sequence: square grids of seq / bs blocks."""
    layouts = list(layout) if isinstance(layout, (list, tuple)) else [layout] * heads
    if len(layouts) != heads:
        raise ValueError(f"layout: expected one BlockLayout or {heads} (one a head), got {len(layouts)}")
    for h, one in enumerate(layouts):
        if not isinstance(one, BlockLayout):
            raise TypeError(f"layout[{h}]: expected a BlockLayout, got {type(one).__name__}")
        bs = one.block_size
        if seq % bs or one.mask.shape != (seq // bs, seq // bs):
            raise ValueError(f"layout[{h}]: expected a ({seq // bs}, {seq // bs}) grid of blocks of {bs} for "
                             f"sequences of {seq} (a multiple of the block size), got {one.mask.shape} of {bs}")
        if bs != layouts[0].block_size:
            raise ValueError(f"layout[{h}]: expected every head's block size {layouts[0].block_size}, got {bs}")
    return layouts


def _device_tables(layouts, stream):
    """(blk_head, blk_row, blk_col, row_ptr) on the device, cached per layouts and device."""
    key = (tuple(hash(one) for one in layouts), tuple(layouts), active())
    tables = _tables.get(key)
    if tables is None:
        rows = layouts[0].mask.shape[0]
        heads, row_ptr, offset = [], [0], 0
        for h, one in enumerate(layouts):
            heads.append(np.full(one.n_blocks, h, np.int32))
            row_ptr.extend(int(offset + p) for p in np.asarray(one.row_ptr)[1:])
            offset += one.n_blocks
        coords = np.concatenate([np.asarray(one.coords, np.int32).reshape(-1, 2) for one in layouts])
        host = (np.concatenate(heads), coords[:, 0].copy(), coords[:, 1].copy(), np.array(row_ptr, np.int32))
        assert len(host[3]) == len(layouts) * rows + 1
        tables = _tables[key] = tuple(cuda.to_device(a if a.size else np.zeros(1, np.int32), stream=stream)
                                      for a in host) + (int(offset),)
    return tables


def _launch(kernel, stream, n, args):
    if n:
        launch(kernel, max(1, min(-(-n // THREADS), 16 * multiprocessors())), THREADS, stream, args)


@on_arrays_device
def attention(q: Array, k: Array, v: Array, layout: Union[BlockLayout, Sequence[BlockLayout]], *,
              causal: bool = False, scale: Optional[float] = None,
              return_lse: bool = False) -> Union[Array, Tuple[Array, Any]]:
    """Attention of ``q`` over ``k`` and ``v`` ((batch, heads, seq, head_dim) each, one dtype)
    where ``layout`` (one `BlockLayout` over the (query block, key block) grid, or one a head)
    has blocks, and with ``causal`` only keys up to the query; ``scale`` 1/sqrt(head_dim) by
    default. A query that sees no key gets zeros. ``return_lse``: also each query's log-sum-exp of
    its scaled scores (fp32; -inf where it sees nothing), (batch, heads, seq).

    The three-kernel version (`simple.py`: scores, softmax, weighted sum), which stores the present
    blocks' scores."""
    ops = checked_operands([("q", q), ("k", k), ("v", v)], DTYPES)
    if len(ops[0].shape) != 4:
        raise ValueError(f"q: expected (batch, heads, seq, head_dim), got shape {ops[0].shape}")
    for op in ops[1:]:
        if op.shape != ops[0].shape:
            raise ValueError(f"{op.name}: expected q's shape {ops[0].shape}, got {op.shape}")
    B, H, S, D = ops[0].shape
    layouts = _layouts(layout, H, S)
    bs = layouts[0].block_size
    scale = 1 / float(np.sqrt(D)) if scale is None else float(scale)
    stream = launch_stream(ops)
    blk_head, blk_row, blk_col, row_ptr, G = _device_tables(layouts, stream)
    dtype = ops[0].dtype
    acc = _acc(dtype)
    native, out = ops[0].empty((B, H, S, D), stream)
    lse_native, lse = ops[0].empty((B, H, S), stream, dtype="float64" if dtype == "float64" else "float32")
    s = ops[0].scratch((max(1, B * G * bs * bs),), "float64" if dtype == "float64" else "float32", stream)
    qd, kd, vd = (op.device(stream).reshape(-1) for op in ops)
    _launch(cached(make_scores, dtype, acc), stream, B * G * bs * bs,
            (s, qd, kd, blk_head, blk_row, blk_col, B, H, S, D, bs, scale, bool(causal)))
    _launch(cached(make_softmax, acc), stream, B * H * S, (s, lse.reshape(-1), row_ptr, B, H, S, bs))
    _launch(cached(make_weighted, dtype, acc), stream, B * H * S * D,
            (out.reshape(-1), s, vd, row_ptr, blk_col, B, H, S, D, bs))
    result = ops[0].result(native, out, stream)
    if return_lse:
        return result, ops[0].result(lse_native, lse, stream)
    return result
