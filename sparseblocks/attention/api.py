"""`attention` and `attention_grad`: validation, the block tables on the device, and the launches of
the fused kernels or the three."""

from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np
from numba import cuda

from ..layout import BlockLayout, check_layout
from ..philox import check_word, threshold
from ..runtime.arrays import Array, checked_operands, launch_stream
from ..runtime.compile import cached
from ..runtime.devices import active, on_arrays_device
from ..ptx.vector import aligned
from ..runtime.launch import compute_capability, data_pointer, launch, multiprocessors
from . import fused, hopper
from .config import AttentionConfig, as_config
from .simple import (make_column_weighted, make_deltas, make_dropped, make_probabilities, make_score_grads,
                     make_scores, make_softmax, make_weighted)

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
        check_layout(one, f"layout[{h}]")
        bs = one.block_size
        if seq % bs or one.mask.shape != (seq // bs, seq // bs):
            raise ValueError(f"layout[{h}]: expected a ({seq // bs}, {seq // bs}) grid of blocks of {bs} for "
                             f"sequences of {seq} (a multiple of the block size), got {one.mask.shape} of {bs}")
        if bs != layouts[0].block_size:
            raise ValueError(f"layout[{h}]: expected every head's block size {layouts[0].block_size}, got {bs}")
    return layouts


def _device_tables(layouts, stream):
    """(blk_head, blk_row, blk_col, row_ptr, col_ptr, col_block, blocks) on the device (the CSR over
    (head, query block) and the CSC over (head, key block) of every head's block ids), cached per
    layouts and device."""
    key = (tuple(hash(one) for one in layouts), tuple(layouts), active())
    tables = _tables.get(key)
    if tables is None:
        rows = layouts[0].mask.shape[0]
        heads, row_ptr, col_ptr, col_block, offset = [], [0], [0], [], 0
        for h, one in enumerate(layouts):
            heads.append(np.full(one.n_blocks, h, np.int32))
            row_ptr.extend(int(offset + p) for p in np.asarray(one.row_ptr)[1:])
            col_ptr.extend(int(len(col_block) + p) for p in np.asarray(one.col_ptr)[1:])
            col_block.extend(int(offset + g) for g in np.asarray(one.col_block))
            offset += one.n_blocks
        coords = np.concatenate([np.asarray(one.coords, np.int32).reshape(-1, 2) for one in layouts])
        host = (np.concatenate(heads), coords[:, 0].copy(), coords[:, 1].copy(), np.array(row_ptr, np.int32),
                np.array(col_ptr, np.int32), np.array(col_block, np.int32))
        assert len(host[3]) == len(host[4]) == len(layouts) * rows + 1
        tables = _tables[key] = tuple(cuda.to_device(a if a.size else np.zeros(1, np.int32), stream=stream)
                                      for a in host) + (int(offset),)
    return tables


def _checked(named):
    """The operands, checked: one kind and dtype, (batch, heads, seq, head_dim), all of q's shape."""
    ops = checked_operands(named, DTYPES)
    if len(ops[0].shape) != 4:
        raise ValueError(f"q: expected (batch, heads, seq, head_dim), got shape {ops[0].shape}")
    for op in ops[1:]:
        if op.shape != ops[0].shape:
            raise ValueError(f"{op.name}: expected q's shape {ops[0].shape}, got {op.shape}")
    return ops


def _fused(cfg, dtype, head_dim, bs, arrays):
    """Whether the fused kernels take the call: the config's choice, their dtypes, head dims and
    blocks (`fused.fits`), and 16-byte aligned operands (their copies are 16-byte cp.async)."""
    return cfg.fused and not fused.fits(dtype, head_dim, bs) and all(aligned(data_pointer(a), 16, 1) for a in arrays)


def _hopper():
    """Whether the GPU runs the wgmma forward (sm_90; not in the simulator unless a test asks)."""
    return compute_capability() == (9, 0)


def _hopper_groups(cfg, dtype, head_dim, bs, wanted):
    """The wgmma kernels' warpgroups a thread block for a call the fused kernels take, or 0 where
    they do not run (``wanted`` off: ``config.hopper_forward`` or ``config.hopper``; not sm_90; a
    head_dim they do not take)."""
    if not wanted or not _hopper():
        return 0
    for groups in dict.fromkeys((cfg.hopper_groups, 1)):
        if not hopper.fits(dtype, head_dim, bs, groups):
            return groups
    return 0


def _dropout_rule(dropout_p, seed, offset):
    """(threshold, seed's low and high words, offset, 1 / keep) of a call's dropout, checked;
    None without dropout."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float, np.floating, np.integer)):
        raise TypeError(f"dropout_p: expected a number, got {dropout_p!r}")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {dropout_p}")
    check_word("seed", seed)
    check_word("offset", offset, 63)
    if not dropout_p:
        return None
    keep = 1.0 - float(dropout_p)
    seed = int(seed)
    return threshold(keep, 16), seed & 0xFFFFFFFF, seed >> 32, int(offset), 1.0 / keep


_NO_DROPOUT = (2 ** 16, 0, 0, 0, 1.0)  # (the kernels' dropout arguments where there is none)


def _launch(kernel, stream, n, args):
    if n:
        launch(kernel, max(1, min(-(-n // THREADS), 16 * multiprocessors())), THREADS, stream, args)


@on_arrays_device
def attention(q: Array, k: Array, v: Array, layout: Union[BlockLayout, Sequence[BlockLayout]], *,
              causal: bool = False, scale: Optional[float] = None, dropout_p: float = 0.0, seed: int = 0,
              offset: int = 0, return_lse: bool = False,
              config: Optional[AttentionConfig] = None) -> Union[Array, Tuple[Array, Any]]:
    """Attention of ``q`` over ``k`` and ``v`` ((batch, heads, seq, head_dim) each, one dtype)
    where ``layout`` (one `BlockLayout` over the (query block, key block) grid, or one a head)
    has blocks, and with ``causal`` only keys up to the query; ``scale`` 1/sqrt(head_dim) by
    default. A query that sees no key gets zeros. ``return_lse``: also each query's log-sum-exp of
    its scaled scores (fp32; -inf where it sees nothing), (batch, heads, seq).

    ``dropout_p``: each probability dropped with that probability after the softmax (the others
    scaled by 1 / (1 - dropout_p)), by counter-based bits (Philox under ``seed`` and ``offset``, a
    counter eight (query, key) pairs, 16 bits each: `dropout.py`; the keep probability is rounded
    down to a multiple of 2⁻¹⁶), so that `attention_grad` with the same three regenerates the
    mask; lse is the undropped softmax's.

    fp16 and bf16 run fused (`fused.py`: flash-style, nothing of size seq x seq stored; on wgmma
    with ``config.hopper_forward``, `hopper.py`, on sm_90 at head_dim 64 and 128) where
    `fused.fits` the call and ``config.fused``; other calls take the three kernels (`simple.py`:
    scores, softmax, weighted sum), which store the present blocks' scores."""
    cfg = as_config(config)
    rule = _dropout_rule(dropout_p, seed, offset)
    ops = _checked([("q", q), ("k", k), ("v", v)])
    B, H, S, D = ops[0].shape
    layouts = _layouts(layout, H, S)
    bs = layouts[0].block_size
    scale = 1 / float(np.sqrt(D)) if scale is None else float(scale)
    stream = launch_stream(ops)
    blk_head, blk_row, blk_col, row_ptr, _, _, G = _device_tables(layouts, stream)
    dtype = ops[0].dtype
    native, out = ops[0].empty((B, H, S, D), stream)
    lse_native, lse = ops[0].empty((B, H, S), stream, dtype="float64" if dtype == "float64" else "float32")
    qd, kd, vd = (op.device(stream).reshape(-1) for op in ops)
    fused_call = _fused(cfg, dtype, D, bs, (qd, kd, vd))
    groups = _hopper_groups(cfg, dtype, D, bs, cfg.hopper_forward) if fused_call else 0
    if groups:
        keys = cfg.wgmma_keys(D)  # (64 where the blocks or shared memory take no more)
        keys = fused.TILE if hopper.fits(dtype, D, bs, groups, keys, cfg.hopper_forward_stages) else keys
        kernel = cached(hopper.make_forward, dtype, D, cfg.hopper_forward_stages, groups, keys, rule is not None)
        if B * H * S:
            launch(kernel, B * H * (S // (fused.TILE * groups)), 128 * groups, stream,
                   (out.reshape(-1), lse.reshape(-1), qd, kd, vd, row_ptr, blk_col, H, S, bs,
                    scale * fused.LOG2E, bool(causal)) + (rule or _NO_DROPOUT))
    elif fused_call:
        rows = fused.forward_rows(bs, cfg.warp_rows)
        kernel = cached(fused.make_forward, dtype, D, cfg.stages, rows, cfg.forward_keys, rule is not None)
        if B * H * S:
            launch(kernel, B * H * (S // (fused.WARPS * rows)), fused.THREADS, stream,
                   (out.reshape(-1), lse.reshape(-1), qd, kd, vd, row_ptr, blk_col, H, S, bs,
                    scale * fused.LOG2E, bool(causal)) + (rule or _NO_DROPOUT))
    else:
        _three_kernels(ops, out, lse, qd, kd, vd, stream, (blk_head, blk_row, blk_col, row_ptr, G), bs, scale,
                       causal, rule)
    result = ops[0].result(native, out, stream)
    if return_lse:
        return result, ops[0].result(lse_native, lse, stream)
    return result


def _three_kernels(ops, out, lse, qd, kd, vd, stream, tables, bs, scale, causal, rule):
    B, H, S, D = ops[0].shape
    blk_head, blk_row, blk_col, row_ptr, G = tables
    dtype = ops[0].dtype
    acc = _acc(dtype)
    s = ops[0].scratch((max(1, B * G * bs * bs),), "float64" if dtype == "float64" else "float32", stream)
    _launch(cached(make_scores, dtype, acc), stream, B * G * bs * bs,
            (s, qd, kd, blk_head, blk_row, blk_col, B, H, S, D, bs, scale, bool(causal)))
    _launch(cached(make_softmax, acc), stream, B * H * S, (s, lse.reshape(-1), row_ptr, B, H, S, bs))
    if rule is not None:
        _launch(cached(make_dropped, acc), stream, B * G * bs * bs, (s, blk_head, blk_row, blk_col, B, H, S, bs) + rule)
    _launch(cached(make_weighted, dtype, acc), stream, B * H * S * D,
            (out.reshape(-1), s, vd, row_ptr, blk_col, B, H, S, D, bs, 1.0))


@on_arrays_device
def attention_grad(q: Array, k: Array, v: Array, out: Array, lse: Array, dout: Array,
                   layout: Union[BlockLayout, Sequence[BlockLayout]], *, causal: bool = False,
                   scale: Optional[float] = None, dropout_p: float = 0.0, seed: int = 0, offset: int = 0,
                   config: Optional[AttentionConfig] = None) -> Tuple[Array, Array, Array]:
    """(dq, dk, dv) of `attention` from its output ``out``, its log-sum-exp ``lse`` (``return_lse``)
    and the output's gradient ``dout``; the probabilities are computed again from q, k and lse,
    and with ``dropout_p`` the forward's dropout mask from the same seed and offset. Fused
    (`fused.py`: dq a query tile, dk and dv a key tile, no atomics; on wgmma where the forward
    is, `hopper.py`) where `attention` is."""
    cfg = as_config(config)
    rule = _dropout_rule(dropout_p, seed, offset)
    ops = _checked([("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)])
    B, H, S, D = ops[0].shape
    (lse_op,) = checked_operands([("lse", lse)], ("float32", "float64"))
    if lse_op.shape != (B, H, S):
        raise ValueError(f"lse: expected {(B, H, S)}, got {lse_op.shape}")
    layouts = _layouts(layout, H, S)
    bs = layouts[0].block_size
    scale = 1 / float(np.sqrt(D)) if scale is None else float(scale)
    stream = launch_stream(ops + [lse_op])
    blk_head, blk_row, blk_col, row_ptr, col_ptr, col_block, G = _device_tables(layouts, stream)
    dtype = ops[0].dtype
    acc = _acc(dtype)
    wide = "float64" if dtype == "float64" else "float32"
    qd, kd, vd, od, dod = (op.device(stream).reshape(-1) for op in ops)
    lsed = lse_op.device(stream).reshape(-1)
    if lse_op.dtype != wide:
        raise TypeError(f"lse: expected {wide} (attention's return_lse for {dtype}), got {lse_op.dtype}")
    delta = ops[0].scratch((max(1, B * H * S),), wide, stream)
    _launch(cached(make_deltas, dtype, acc), stream, B * H * S, (delta, dod, od, B, H, S, D))
    outs = [ops[0].empty((B, H, S, D), stream) for _ in range(3)]
    dq, dk, dv = (grad.reshape(-1) for _, grad in outs)
    if _fused(cfg, dtype, D, bs, (qd, kd, vd, dod, lsed, delta)):
        grid = B * H * (S // fused.TILE)
        groups = _hopper_groups(cfg, dtype, D, bs, cfg.hopper)
        if grid:
            args = (H, S, bs, scale, scale * fused.LOG2E, bool(causal)) + (rule or _NO_DROPOUT)
            if groups:  # the wgmma kernels: groups of 64-row tiles a thread block
                family, key, blocks, threads = hopper, (cfg.hopper_stages, groups), grid // groups, 128 * groups
            else:
                family, key, blocks, threads = fused, (cfg.backward_stages,), grid, fused.THREADS
            key += (rule is not None,)
            for maker, kernel_args in ((family.make_query_grads, (dq, qd, kd, vd, dod, lsed, delta, row_ptr, blk_col)),
                                       (family.make_key_grads,
                                        (dk, dv, qd, kd, vd, dod, lsed, delta, col_ptr, col_block, blk_row))):
                launch(cached(maker, dtype, D, *key), blocks, threads, stream, kernel_args + args)
    else:
        n = max(1, B * G * bs * bs)
        p, ds = ops[0].scratch((n,), wide, stream), ops[0].scratch((n,), wide, stream)
        _launch(cached(make_probabilities, dtype, acc), stream, B * G * bs * bs,
                (p, qd, kd, lsed, blk_head, blk_row, blk_col, B, H, S, D, bs, scale, bool(causal)))
        _launch(cached(make_score_grads, dtype, acc, rule is not None), stream, B * G * bs * bs,
                (ds, p, dod, vd, delta, blk_head, blk_row, blk_col, B, H, S, D, bs) + (rule or _NO_DROPOUT))
        if rule is not None:  # (dv from the dropped probabilities, once ds has the undropped ones)
            _launch(cached(make_dropped, acc), stream, B * G * bs * bs,
                    (p, blk_head, blk_row, blk_col, B, H, S, bs) + rule)
        for out_, kernel, args in (
                (dq, make_weighted, (ds, kd, row_ptr, blk_col, B, H, S, D, bs, scale)),
                (dk, make_column_weighted, (ds, qd, col_ptr, col_block, blk_row, B, H, S, D, bs, scale)),
                (dv, make_column_weighted, (p, dod, col_ptr, col_block, blk_row, B, H, S, D, bs, 1.0))):
            _launch(cached(kernel, dtype, acc), stream, B * H * S * D, (out_,) + args)
    dq_, dk_, dv_ = (ops[0].result(native, grad, stream) for native, grad in outs)
    return dq_, dk_, dv_
