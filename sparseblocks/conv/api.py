"""`BlocksparseConv` and `BlocksparseDeconv`: validation, the channel lookup tables on the device,
launches of the direct kernels (`simple.py`)."""

from typing import Any, List, Optional, Sequence

import numpy as np
from numba import cuda

from ..runtime.arrays import Array, Operand, checked_operands, launch_stream
from ..runtime.compile import cached
from ..runtime.devices import active, on_arrays_device
from ..bsmm.dispatch import words
from ..ptx.vector import aligned
from ..runtime.launch import (compute_capability, data_pointer, fullest_waves, launch, multiprocessors,
                              resident_blocks)
from .config import ConvConfig, as_config
from .geometry import edge_map, geometry
from .simple import make_edge_bias_grad, make_filter_grad, make_forward, make_input_grad, make_l2_normalize
from . import hopper, implicit
from .tensorcore import POSITIONS, THREADS, grouped, make_filter_grad_tc, make_forward_tc

DTYPES = ("float16", "bfloat16", "float32", "float64")


def _acc(dtype):
    from numba import float32, float64

    return float64 if dtype == "float64" else float32


def _channels(values, what, b):
    """A block's channel list (``what``: "input" or "output"): distinct non-negative ints, at least one."""
    try:
        out = [int(v) for v in values]
    except (TypeError, ValueError):
        raise TypeError(f"BCK[{b}]: expected a list of {what} channel indices, got {values!r}") from None
    if not out or min(out) < 0 or len(set(out)) != len(out):
        raise ValueError(f"BCK[{b}]: expected distinct non-negative {what} channel indices, at least one, got {out}")
    return out


def _csr(lists, count):
    """For each channel 0..count-1 the (block, position in it) pairs that name it, as a CSR."""
    pairs = [[] for _ in range(count)]
    for b, channels in enumerate(lists):
        for pos, ch in enumerate(channels):
            pairs[ch].append((b, pos))
    ptr = np.zeros(count + 1, np.int32)
    ptr[1:] = np.cumsum([len(p) for p in pairs])
    flat = [pair for p in pairs for pair in p] or [(0, 0)]
    blk, pos = (np.array(v, np.int32) for v in zip(*flat))
    return ptr, blk, pos


def _last(shape):
    """An activation shape (N, C, *spatial) as channels-last (N, *spatial, C)."""
    return [shape[0]] + list(shape[2:]) + [shape[1]]


def _moved(a, source, dest):
    """A contiguous copy of ``a`` with axis ``source`` moved to ``dest``, of a's kind: the
    channels-last calls that no implicit kernel takes run channels-first."""
    if hasattr(a, "movedim"):  # torch
        return a.movedim(source, dest).contiguous()
    if type(a).__module__.startswith("cupy"):
        import cupy

        return cupy.ascontiguousarray(cupy.moveaxis(a, source, dest))
    if hasattr(a, "copy_to_host"):  # a Numba device array
        return cuda.to_device(np.ascontiguousarray(np.moveaxis(a.copy_to_host(), source, dest)))
    return np.ascontiguousarray(np.moveaxis(np.asarray(a), source, dest))


def _offsets(lists):
    return np.concatenate([[0], np.cumsum([len(v) for v in lists])]).astype(np.int32), \
        np.array([ch for v in lists for ch in v], np.int32)


class BlocksparseConv:
    """OpenAI's block-sparse convolution: channel connectivity as blocks.

    ``BCK``: a list of blocks ``(cs, ks)``, each connecting the input channels ``cs`` to the output
    channels ``ks`` through a dense filter of shape ``f_shape(b)`` = ``(len(ks), len(cs), *TRS)``;
    channels may be in several blocks (their contributions add) or in none (zeros). ``TRS``,
    ``DHW`` (and ``MPQ``, the output size, computed where None): 1 to 3 spatial dims; ``strides``,
    ``dilates``: an int or one a dim; ``padding``: "SAME", "VALID" or ints. NCHW (NCDHW)
    activations of fp32, fp16, bf16 or fp64, with fp32 (fp64) sums. ``edge_bias``: the calls take a
    bias of `edge_bias_shape` added at the output positions whose taps reach the padding, one a
    group of positions that reach it alike and output channel (OpenAI's edge bias).

    ``op(F, I, edge_bias=None)`` is the forward (fprop); `input_grad` (bprop) and `filter_grad`
    (updat, the present blocks' filters only) its gradients. ``F``: a list of one array a block, or
    one flat array of all the blocks' values in order (`f_size` of them)."""

    deconv = False

    def __init__(self, BCK: Sequence[Any], TRS: Any, DHW: Any, MPQ: Any = None, strides: Any = 1,
                 dilates: Any = 1, padding: Any = "SAME", edge_bias: bool = False,
                 config: Optional[ConvConfig] = None) -> None:
        if isinstance(BCK, (str, bytes)) or not len(BCK):
            raise ValueError("BCK: expected a list of (input channels, output channels) blocks, at least one")
        blocks = []
        for b, block in enumerate(BCK):
            if len(block) != 2:
                raise ValueError(f"BCK[{b}]: expected (input channels, output channels), got {block!r}")
            blocks.append((_channels(block[0], "input", b), _channels(block[1], "output", b)))
        user_trs = [int(TRS)] if np.isscalar(TRS) else [int(v) for v in TRS]
        user_dhw = [int(DHW)] if np.isscalar(DHW) else [int(v) for v in DHW]
        if len(user_trs) != len(user_dhw):
            raise ValueError(f"TRS, DHW: expected as many spatial dims, got {len(user_trs)} and {len(user_dhw)}")
        for name, values in (("TRS", user_trs), ("DHW", user_dhw)) + ((("MPQ", list(np.atleast_1d(MPQ))),)
                                                                     if MPQ is not None else ()):
            if not 1 <= len(values) <= 3 or min(int(v) for v in values) < 1:
                raise ValueError(f"{name}: expected 1 to 3 positive sizes, got {values}")
        for name, value in (("strides", strides), ("dilates", dilates)):
            values = [value] if np.isscalar(value) else list(value)
            if len(values) not in (1, len(user_trs)) or min(int(v) for v in values) < 1:
                raise ValueError(f"{name}: expected a positive int or {len(user_trs)} of them, got {value!r}")
        g = geometry(user_trs, user_dhw, MPQ, strides, dilates, padding, deconv=self.deconv)
        if min(g["MPQ"]) < 1 or min(g["DHW"]) < 1:
            raise ValueError(f"TRS, DHW, padding: no output position (sizes {g['DHW']} -> {g['MPQ']})")
        if self.deconv:  # the convolution runs from this layer's output back to its input
            blocks = [(ks, cs) for cs, ks in blocks]
        # self.BCK as given; self._blocks the convolution's, which a deconvolution runs backwards
        self.BCK = [(list(cs), list(ks)) for cs, ks in (blocks if not self.deconv else [(k, c) for c, k in blocks])]
        self._blocks = blocks  # (the convolution's own: input channels, output channels)
        self._g = g
        self._dims = len(user_trs)
        self.TRS, self.strides, self.dilates, self.padding = user_trs, g["strides"], g["dilates"], g["padding"]
        self._C = 1 + max(max(cs) for cs, _ in blocks)
        self._K = 1 + max(max(ks) for _, ks in blocks)
        self.edge_bias = bool(edge_bias)
        self.config = as_config(config)
        trs = int(np.prod(g["TRS"]))
        sizes = [len(cs) * len(ks) * trs for cs, ks in blocks]
        self._f_off = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        self.f_size = int(self._f_off[-1])
        self._edges = edge_map(g)
        edge = np.full(int(np.prod(g["MPQ"])), -1, np.int32)
        for e, positions in enumerate(self._edges):
            edge[positions] = e
        cs_off, cs_flat = _offsets([cs for cs, _ in blocks])
        ks_off, ks_flat = _offsets([ks for _, ks in blocks])
        k_ptr, k_blk, k_pos = _csr([ks for _, ks in blocks], self._K)
        c_ptr, c_blk, c_pos = _csr([cs for cs, _ in blocks], self._C)
        self._resident_blocks: dict = {}  # (`_resident`'s counts, by kernel, block size and device)
        self._host = dict(f_off=self._f_off, cs=cs_flat, cs_off=cs_off, ks=ks_flat, ks_off=ks_off, k_ptr=k_ptr,
                          k_blk=k_blk, k_pos=k_pos, c_ptr=c_ptr, c_blk=c_blk, c_pos=c_pos, edge=edge,
                          geo=np.array(g["DHW"] + g["MPQ"] + g["TRS"] + g["strides"] + g["padding"] + g["dilates"],
                                       np.int32))
        rows = [(int(self._f_off[b]) + j * len(cs) * trs, len(cs) * trs) for b, (cs, ks) in enumerate(blocks)
                for j in range(len(ks))]
        self._host["row_start"] = np.array([r[0] for r in rows], np.int32)
        self._host["row_len"] = np.array([r[1] for r in rows], np.int32)
        self._host["grp_ptr"] = np.concatenate([[0], np.cumsum([len(p) for p in self._edges])]).astype(np.int32)
        self._host["grp_pos"] = np.array([q for p in self._edges for q in p] or [0], np.int32)
        self._group = grouped(blocks, self._C, self._K)  # (the tensor-core products' channel group, or 0)
        self._plans: dict = {}  # (product: (QT, patch capacity), for those `implicit.py` takes)
        self._wide_fits: dict = {}  # (product: whether a ring of `ConvConfig.stage_bytes` rows fits)
        self._fp32_filter_fits = False  # (fp32's filter-gradient ring, rows twice the bytes, fits too)
        if self._group:  # the blocks of each output group and of each input group, and their first channels
            G = self._group
            self._host["kgrp_ptr"], self._host["kgrp_blk"], _ = _csr([[ks[0] // G] for _, ks in blocks], self._K // G)
            self._host["cgrp_ptr"], self._host["cgrp_blk"], _ = _csr([[cs[0] // G] for cs, _ in blocks], self._C // G)
            self._host["blk_c0"] = np.array([cs[0] for cs, _ in blocks], np.int32)
            self._host["blk_k0"] = np.array([ks[0] for _, ks in blocks], np.int32)
            for kind in ("forward", "input_grad", "filter_grad"):
                geo = [int(v) for v in self._host["geo"]]
                if kind == "input_grad":
                    if max(g["strides"]) > 1:
                        continue  # (a strided input gradient gathers: `tensorcore.py`)
                    geo = implicit.transposed_geometry(geo)
                QT = implicit.tile_shape(geo[5])[0]
                ig = implicit.implicit_geometry(geo, QT)
                if implicit.plan(ig, G, kind == "filter_grad"):
                    self._plans[kind] = (QT, implicit.capacity(ig))
                    self._wide_fits[kind] = kind != "filter_grad" and implicit.plan(
                        ig, G, row_bytes=self.config.stage_bytes)
                    self._host["ig_" + kind] = np.array(ig, np.int32)
                    wgs = self.config.hopper_groups  # (`ConvConfig.hopper` on sm_90)
                    rows = self.config.hopper_rows
                    if kind != "filter_grad" and hopper.fits(geo, G, wgs, self.config.hopper_stages, rows):
                        self._host["hg_" + kind] = np.array(hopper.geometry(geo, wgs, rows), np.int32)
                    if kind == "filter_grad":
                        self._fp32_filter_fits = implicit.plan(ig, G, True, implicit.value_bytes("float32"))
                        dy_a = self.config.hopper_filter_dy_a  # (`hopper_filter_grad`)
                        if hopper.filter_fits(geo, G, self.config.hopper_filter_overlap, dy_a):
                            self._host["hg_filter_grad"] = np.array(hopper.filter_geometry(geo), np.int32)
                            self._host["units"] = hopper.filter_units([(cs[0], ks[0]) for cs, ks in blocks], G, dy_a)
        self._tables: dict = {}

    # -- sizes ------------------------------------------------------------------------------
    @property
    def C(self) -> int:
        """Input channels (the largest a block names, + 1)."""
        return self._K if self.deconv else self._C

    @property
    def K(self) -> int:
        """Output channels."""
        return self._C if self.deconv else self._K

    def _spatial(self, key):
        return list(self._g[key][3 - self._dims:])

    def i_shape(self, N: int) -> List[int]:
        return [int(N), self.C] + self._spatial("MPQ" if self.deconv else "DHW")

    def o_shape(self, N: int) -> List[int]:
        return [int(N), self.K] + self._spatial("DHW" if self.deconv else "MPQ")

    def f_shape(self, block: Optional[int] = None) -> List[int]:
        """Block ``block``'s filter shape; with None, (blocks, ...) where every block has one shape,
        else the flat size."""
        if block is None:
            shapes = {tuple(self.f_shape(b)) for b in range(len(self.BCK))}
            return [len(self.BCK), *shapes.pop()] if len(shapes) == 1 else [self.f_size]
        cs, ks = self._blocks[block]
        return [len(ks), len(cs)] + self.TRS

    def edge_bias_shape(self) -> List[int]:
        """The edge bias's (K, groups): a value an output channel and group of edge positions."""
        return [self.K, len(self._edges)]

    # -- launches -----------------------------------------------------------------------------
    def _table(self, stream):
        ordinal = active()
        if ordinal not in self._tables:
            self._tables[ordinal] = {name: cuda.to_device(a, stream=stream) for name, a in self._host.items()}
        return self._tables[ordinal]

    def _flat_filter(self, F):
        """F as one flat operand: a list of per-block arrays joined (in their kind), or a flat one."""
        if isinstance(F, (list, tuple)):
            if len(F) != len(self._blocks):
                raise ValueError(f"F: expected {len(self._blocks)} filters (one a block), got {len(F)}")
            ops = checked_operands([(f"F[{b}]", f) for b, f in enumerate(F)], DTYPES)
            for b, op in enumerate(ops):
                if list(op.shape) != self.f_shape(b):
                    raise ValueError(f"F[{b}]: expected shape {self.f_shape(b)}, got {list(op.shape)}")
            kind = ops[0].kind
            if kind == "numpy":
                return np.concatenate([np.asarray(f).reshape(-1) for f in F])
            if kind == "torch":
                import torch

                return torch.cat([f.reshape(-1) for f in F])
            if kind == "cupy":
                import cupy

                return cupy.concatenate([f.reshape(-1) for f in F])
            flat = cuda.device_array(self.f_size, F[0].dtype)
            for b, f in enumerate(F):
                flat[self._f_off[b]:self._f_off[b + 1]].copy_to_device(f.reshape(-1))
            return flat
        op = Operand(F, "F")
        if op.shape != (self.f_size,):
            raise ValueError(f"F: expected a list of {len(self._blocks)} filters or a flat array of {self.f_size}, "
                             f"got shape {op.shape}")
        return F

    def _launch(self, kernel, stream, n, args, grid_y=1):
        if n:
            threads = self.config.threads
            launch(kernel, (max(1, min(-(-n // threads), 16 * multiprocessors())), grid_y), threads, stream, args)

    def _tensor_cores(self, dtype):
        """Whether the three products run on the tensor cores (`tensorcore.py`)."""
        return bool(self._group) and self.config.tensor_cores and dtype in ("float16", "bfloat16")

    def _implicit(self, kind):
        """Whether product ``kind`` runs `implicit.py`'s kernels (the patch fits, stride 1 for the
        input gradient), given that it runs on the tensor cores."""
        return self.config.implicit and kind in self._plans

    def _implicit_for(self, kind, dtype):
        """Whether product ``kind`` of ``dtype`` runs `implicit.py`'s kernels: fp16 and bf16 on the
        tensor cores; fp32 in 3xTF32 (``fp32_tensor_cores``), where its filter gradient's wider
        rows fit too."""
        if dtype == "float32":
            return (bool(self._group) and self.config.tensor_cores and self.config.fp32_tensor_cores
                    and self._implicit(kind) and (kind != "filter_grad" or self._fp32_filter_fits))
        return self._tensor_cores(dtype) and self._implicit(kind)

    def _rows(self, op, rows, length, N, stream):
        """op's device array (N, rows, length) as a new (N, length, rows) one: 16-bit values of even
        rows and length in pairs (`implicit.make_to_rows_pairs`), else `implicit.make_to_rows`."""
        x = op.device(stream).reshape(-1)
        out = op.scratch((N * length * rows,), op.dtype, stream)
        if op.dtype != "float32" and rows % 2 == 0 and length % 2 == 0 and all(
                aligned(data_pointer(a), 4, 1) for a in (x, out)):
            launch(cached(implicit.make_to_rows_pairs), (-(-length // 64), -(-rows // 64), N), 256, stream,
                   (words(out), words(x), rows, length))
        else:
            launch(cached(implicit.make_to_rows, op.dtype), (-(-length // 32), -(-rows // 32), N), 256, stream,
                   (out, x, rows, length))
        return out

    def _row_bytes(self, kind, dtype):
        """A forward's or input gradient's stage rows: `ConvConfig.stage_bytes` where its ring fits
        and the channel groups are whole slices of it in ``dtype``, else 32."""
        wide = self.config.stage_bytes
        return wide if self._wide_fits[kind] and self._group % implicit.slice_channels(dtype, wide) == 0 else 32

    def _packed(self, op_f, transposed, stream, row_bytes):
        f = op_f.device(stream).reshape(-1)
        out = op_f.scratch((self.f_size,), op_f.dtype, stream)
        launch(cached(implicit.make_pack, op_f.dtype, self._group, transposed, row_bytes),
               (max(1, min(-(-self.f_size // 256), 2 * multiprocessors())),), 256, stream,
               (out, f, len(self._blocks), int(np.prod(self._g["TRS"]))))
        return out

    def _implicit_forward(self, kind, out, op_x, op_f, N, bias, has_bias, stream, last=False):
        """The forward (``kind`` "forward") or stride-1 input gradient ("input_grad") of
        `implicit.make_forward` into ``out``, from op_x (x, or the output gradient); ``last``:
        both channels-last (no copy of op_x first)."""
        QT, cap = self._plans[kind]
        t = self._table(stream)
        ig = self._host["ig_" + kind]
        G, TRS = self._group, int(np.prod(self._g["TRS"]))
        in_rows, out_rows = (self._C, self._K) if kind == "forward" else (self._K, self._C)
        rows = op_x.device(stream).reshape(-1) if last else self._rows(op_x, in_rows, int(ig[0] * ig[1] * ig[2]), N,
                                                                       stream)
        ptr, blk, first = ("kgrp_ptr", "kgrp_blk", "blk_c0") if kind == "forward" else ("cgrp_ptr", "cgrp_blk",
                                                                                         "blk_k0")
        if (self.config.hopper and "hg_" + kind in self._host and op_x.dtype in ("float16", "bfloat16")
                and compute_capability() == (9, 0)):
            hg = self._host["hg_" + kind]
            wgs = self.config.hopper_groups
            tiles = N * int(hg[3] * hg[21] * hg[22])
            keep = self._hopper_keep(kind, hg, G)
            stages = self.config.hopper_stages  # (a stage a block: no more than a tile's blocks in flight)
            stages = stages if keep else hopper.forward_stages(self._most(kind), stages)
            blocks = hopper.forward_blocks(hg, G, stages, self.config.hopper_blocks, keep)
            kernel = cached(hopper.make_forward, op_x.dtype, G, TRS, hopper.patch_positions(hg), last, wgs, keep,
                            bool(has_bias), stages, blocks, self.config.hopper_rows)
            args = [out.reshape(-1), rows, self._packed(op_f, kind != "forward", stream, 16), t[ptr], t[blk],
                    t[first], t["hg_" + kind], out_rows, in_rows, bias, t["edge"], has_bias, tiles, 1]
            # (kept filters: thread blocks each walking its share of the tiles, a wave where it pays)
            args[-1] = self._workers(kernel, hopper.WARPGROUP * wgs, args, tiles, out_rows // G) if keep else tiles
            launch(kernel, (args[-1], out_rows // G), hopper.WARPGROUP * wgs, stream, tuple(args))
            return
        row_bytes = self._row_bytes(kind, op_x.dtype)
        packed = self._packed(op_f, kind != "forward", stream, row_bytes)
        tiles = N * int(ig[3] * ig[21] * ig[22])
        # (thread blocks each walking its share of the tiles, a wave where it pays)
        kernel = cached(implicit.make_forward, op_x.dtype, G, QT, cap, TRS, last, row_bytes, bool(has_bias))
        args = [out.reshape(-1), rows, packed, t[ptr], t[blk], t[first], t["ig_" + kind], N, out_rows, in_rows,
                bias, t["edge"], has_bias, tiles, 1]
        args[-1] = self._workers(kernel, implicit.THREADS, args, tiles, out_rows // G)
        launch(kernel, (args[-1], out_rows // G), implicit.THREADS, stream, tuple(args))

    def _resident(self, kernel, threads, args):
        """Thread blocks of ``kernel`` a multiprocessor holds (`runtime.launch.resident_blocks`,
        asked once a kernel and device; ``args`` as launched, any counts among them, or a function
        that makes them, called only then)."""
        key = (kernel, threads, active())
        count = self._resident_blocks.get(key)
        if count is None:
            count = self._resident_blocks[key] = resident_blocks(kernel, threads, args() if callable(args) else args)
        return count

    def _workers(self, kernel, threads, args, tiles, groups):
        """Thread blocks a group of a kernel whose thread blocks walk shares of the ``tiles``: as many
        as fill the multiprocessors once, or where ``groups`` leave the wave's end ragged the count
        whose last wave is fullest (`runtime.launch.fullest_waves`), at most ``tiles``."""
        slots = self._resident(kernel, threads, args) * multiprocessors()
        return fullest_waves(groups, slots, min(tiles, max(1, slots // groups)), min(tiles, -(-slots // groups)))

    def _most(self, kind):
        """The most blocks any output group of ``kind``'s product holds."""
        ptr = self._host["kgrp_ptr" if kind == "forward" else "cgrp_ptr"]
        return int(np.max(np.diff(ptr))) if len(ptr) > 1 else 0

    def _hopper_keep(self, kind, hg, G):
        """The filter blocks the wgmma kernel keeps in shared memory (`hopper.make_forward`'s
        ``keep``): the most of any output group, where ``ConvConfig.hopper_keep`` and shared memory
        allow ("auto": where it costs no resident thread block, `hopper.keep_pays`); else 0 (a
        stage a block's patch and filter)."""
        most, stages, mode = self._most(kind), self.config.hopper_stages, self.config.hopper_keep
        if mode == "never" or most == 0 or not hopper.kept_fits(hg, G, most, stages):
            return 0
        return most if mode == "always" or hopper.keep_pays(hg, G, most, stages) else 0

    def _implicit_filter_grad(self, out, op_dy, op_x, N, stream, last=False):
        """`implicit.make_filter_grad`'s partial sums over shares of the positions (thread blocks for
        full waves, `implicit.filter_shares`), then their sum (`implicit.make_sum`) into ``out``: the
        flat filter gradient."""
        QT, cap = self._plans["filter_grad"]
        t = self._table(stream)
        ig = self._host["ig_filter_grad"]
        G, TRS = self._group, int(np.prod(self._g["TRS"]))
        DHW, MPQ = int(ig[0] * ig[1] * ig[2]), int(ig[3] * ig[4] * ig[5])
        x_rows = op_x.device(stream).reshape(-1) if last else self._rows(op_x, self._C, DHW, N, stream)
        wgmma = (self.config.hopper_filter_grad and "hg_filter_grad" in self._host
                 and op_x.dtype in ("float16", "bfloat16") and compute_capability() == (9, 0))
        # (dy as A reads a channels-first dy as it lies where its output rows are whole 16-byte runs)
        dy_first = (wgmma and not last and self.config.hopper_filter_dy_a
                    and hopper.dy_first_fits(self._host["hg_filter_grad"], data_pointer(op_dy.device(stream))))
        dy_rows = (op_dy.device(stream).reshape(-1) if last or dy_first
                   else self._rows(op_dy, self._K, MPQ, N, stream))
        if wgmma:
            self._hopper_filter_grad(out, dy_rows, x_rows, op_x, N, stream, dy_first)
            return
        taps = min(TRS, implicit.max_taps(op_x.dtype, G, self.config.fp32_filter_taps))
        groups = -(-TRS // taps)
        cc, ws = implicit.filter_split(G)
        slices = G // cc
        tiles = N * int(ig[3] * ig[21] * ig[22])
        kernel = cached(implicit.make_filter_grad, op_x.dtype, G, QT, cap, taps)
        args = [None, dy_rows, x_rows, t["blk_c0"], t["blk_k0"], t["ig_filter_grad"], N, self._K, self._C, tiles,
                1, self.f_size]
        self._filter_parts(out, kernel, implicit.THREADS, len(self._blocks) * slices, groups, ws, args, tiles, op_x,
                           stream)

    def _hopper_filter_grad(self, out, dy_rows, x_rows, op_x, N, stream, dy_first=False):
        """`hopper.make_filter_grad`'s partial sums over shares of the tiles (thread blocks for full
        waves on the multiprocessors, `implicit.filter_shares`), then their sum into ``out``; with
        ``dy_first``, ``dy_rows`` is the caller's channels-first dy."""
        t = self._table(stream)
        hg, units = self._host["hg_filter_grad"], self._host["units"]
        G, TRS = self._group, int(np.prod(self._g["TRS"]))
        TW = hopper.filter_taps(TRS, G, self.config.hopper_filter_taps)
        groups = -(-TRS // (2 * TW))
        tiles = N * int(hg[3] * hg[21] * hg[22])
        kernel = cached(hopper.make_filter_grad, op_x.dtype, G, TRS, hopper.patch_positions(hg), TW,
                        self.config.hopper_filter_overlap, self.config.hopper_filter_dy_a, dy_first)
        args = [None, dy_rows, x_rows, t["units"], t["blk_c0"], t["blk_k0"], t["hg_filter_grad"], self._C, self._K,
                tiles, 1, self.f_size]
        self._filter_parts(out, kernel, 2 * hopper.WARPGROUP, len(units), groups, 1, args, tiles, op_x, stream)

    def _filter_parts(self, out, kernel, threads, rows, groups, ws, args, tiles, op_x, stream):
        """A filter-gradient ``kernel``'s partial sums, ``ws`` a share, over shares of the ``tiles``
        (grid (shares, rows, groups); thread blocks for full waves, `implicit.filter_shares`), into
        ``part`` (``args[0]``; the share count ``args[-2]``), then their sum into ``out``."""
        resident = self._resident(kernel, threads,  # (a placeholder part, of part's type)
                                  lambda: [op_x.scratch((1,), np.float32, stream)] + args[1:])
        shares = implicit.filter_shares(tiles, rows * groups, resident * multiprocessors())
        part = args[0] = op_x.scratch((shares * ws * self.f_size,), np.float32, stream)
        args[-2] = shares
        launch(kernel, (shares, rows, groups), threads, stream, tuple(args))
        self._add_parts(out, part, shares * ws, op_x.dtype, stream)

    def _add_parts(self, out, part, parts, dtype, stream):
        """``out`` = the filter gradient's ``parts`` partial sums (`implicit.make_sum`), in order."""
        launch(cached(implicit.make_sum, dtype), (max(1, min(-(-self.f_size // 256), 2 * multiprocessors())),),
               256, stream, (out, part, parts, self.f_size))

    def _check(self, op, shape, N=None, last=False):
        if N is None:
            N = op.shape[0] if op.shape else 0
        want = _last(shape(N)) if last else shape(N)
        if list(op.shape) != want:
            raise ValueError(f"{op.name}: expected shape {want}, got {list(op.shape)}")
        return N

    def _conv_forward(self, F, x, bias, name_x, last=False):
        """The convolution's forward (the deconvolution's input gradient) into a new output; ``last``:
        x and the output channels-last."""
        ops = checked_operands([("F", self._flat_filter(F)), (name_x, x)]
                               + ([("edge_bias", bias)] if bias is not None else []), DTYPES)
        op_f, op_x = ops[0], ops[1]
        shape_in = self.o_shape if self.deconv else self.i_shape
        N = self._check(op_x, shape_in, last=last)
        if bias is not None and list(ops[2].shape) != self.edge_bias_shape():
            raise ValueError(f"edge_bias: expected shape {self.edge_bias_shape()}, got {list(ops[2].shape)}")
        if last and not (N and self._implicit_for("forward", op_x.dtype)):
            return _moved(self._conv_forward(F, _moved(x, -1, 1), bias, name_x), 1, -1)
        stream = launch_stream(ops)
        shape_out = self.i_shape(N) if self.deconv else self.o_shape(N)
        native, out = op_x.empty(tuple(_last(shape_out) if last else shape_out), stream)
        t = self._table(stream)
        dtype = op_x.dtype
        has = bias is not None
        b = ops[2].device(stream) if has else op_f.device(stream).reshape(1, -1)[:, :1]
        if N and self._implicit_for("forward", dtype):
            self._implicit_forward("forward", out, op_x, op_f, N, b, has, stream, last)
            return op_x.result(native, out, stream)
        if self._tensor_cores(dtype):
            MPQ = int(np.prod(self._g["MPQ"]))
            if N:
                launch(cached(make_forward_tc, dtype, self._group),
                       (-(-MPQ // POSITIONS), self._K // self._group, N), THREADS, stream,
                       (out.reshape(-1), op_x.device(stream).reshape(-1), op_f.device(stream).reshape(-1), t["f_off"],
                        t["kgrp_ptr"], t["kgrp_blk"], t["blk_c0"], t["geo"], N, self._K, self._C, b, t["edge"], has))
            return op_x.result(native, out, stream)
        kernel = cached(make_forward, dtype, _acc(dtype))
        self._launch(kernel, stream, int(np.prod(shape_out)), (
            out.reshape(-1), op_x.device(stream).reshape(-1), op_f.device(stream).reshape(-1), t["f_off"], t["k_ptr"],
            t["k_blk"], t["k_pos"], t["cs"], t["cs_off"], t["geo"], N, self._K, self._C, b, t["edge"], has))
        return op_x.result(native, out, stream)

    def _conv_input_grad(self, F, dy, name_dy, last=False):
        """The convolution's input gradient (the deconvolution's forward); ``last``: dy and the
        result channels-last."""
        ops = checked_operands([("F", self._flat_filter(F)), (name_dy, dy)], DTYPES)
        op_f, op_dy = ops
        shape_dy = self.i_shape if self.deconv else self.o_shape
        N = self._check(op_dy, shape_dy, last=last)
        if last and not (N and self._implicit_for("input_grad", op_dy.dtype)):
            return _moved(self._conv_input_grad(F, _moved(dy, -1, 1), name_dy), 1, -1)
        stream = launch_stream(ops)
        shape_out = self.o_shape(N) if self.deconv else self.i_shape(N)
        native, out = op_dy.empty(tuple(_last(shape_out) if last else shape_out), stream)
        t = self._table(stream)
        if N and self._implicit_for("input_grad", op_dy.dtype):
            self._implicit_forward("input_grad", out, op_dy, op_f, N, op_f.device(stream).reshape(1, -1)[:, :1],
                                   False, stream, last)
            return op_dy.result(native, out, stream)
        if self._tensor_cores(op_dy.dtype):
            DHW = int(np.prod(self._g["DHW"]))
            if N:
                launch(cached(make_forward_tc, op_dy.dtype, self._group, True),
                       (-(-DHW // POSITIONS), self._C // self._group, N), THREADS, stream,
                       (out.reshape(-1), op_dy.device(stream).reshape(-1), op_f.device(stream).reshape(-1),
                        t["f_off"], t["cgrp_ptr"], t["cgrp_blk"], t["blk_k0"], t["geo"], N, self._K, self._C,
                        op_f.device(stream).reshape(1, -1)[:, :1], t["edge"], False))
            return op_dy.result(native, out, stream)
        kernel = cached(make_input_grad, op_dy.dtype, _acc(op_dy.dtype))
        self._launch(kernel, stream, int(np.prod(shape_out)), (
            out.reshape(-1), op_dy.device(stream).reshape(-1), op_f.device(stream).reshape(-1), t["f_off"],
            t["c_ptr"], t["c_blk"], t["c_pos"], t["ks"], t["ks_off"], t["cs_off"], t["geo"], N, self._K, self._C))
        return op_dy.result(native, out, stream)

    def _conv_filter_grad(self, dy, x, name_dy, name_x, last=False):
        """Each block's filter gradient of the convolution from its output gradient and input
        (``last``: both channels-last)."""
        ops = checked_operands([(name_dy, dy), (name_x, x)], DTYPES)
        op_dy, op_x = ops
        N = self._check(op_x, self.o_shape if self.deconv else self.i_shape, last=last)
        self._check(op_dy, self.i_shape if self.deconv else self.o_shape, N, last=last)
        fast = N and self._implicit_for("filter_grad", op_x.dtype)
        if last and not fast:
            return self._conv_filter_grad(_moved(dy, -1, 1), _moved(x, -1, 1), name_dy, name_x)
        stream = launch_stream(ops)
        native, out = op_x.empty((self.f_size,), stream)
        t = self._table(stream)
        if fast:
            self._implicit_filter_grad(out, op_dy, op_x, N, stream, last)
        elif self._tensor_cores(op_x.dtype):  # (N = 0 too: its sums of nothing write zeros)
            launch(cached(make_filter_grad_tc, op_x.dtype, self._group),
                   (int(np.prod(self._g["TRS"])), len(self._blocks)), THREADS, stream,
                   (out, op_dy.device(stream).reshape(-1), op_x.device(stream).reshape(-1), t["f_off"],
                    t["blk_c0"], t["blk_k0"], t["geo"], N, self._K, self._C))
        else:
            kernel = cached(make_filter_grad, op_x.dtype, _acc(op_x.dtype))
            biggest = int(max(self._f_off[1:] - self._f_off[:-1]))
            self._launch(kernel, stream, biggest, (
                out, op_dy.device(stream).reshape(-1), op_x.device(stream).reshape(-1), t["f_off"], t["cs"],
                t["cs_off"], t["ks"], t["ks_off"], t["geo"], N, self._K, self._C), grid_y=len(self._blocks))
        flat = op_x.result(native, out, stream)
        return [flat[self._f_off[b]:self._f_off[b + 1]].reshape(self.f_shape(b)) for b in range(len(self._blocks))]

    # -- the op ----------------------------------------------------------------------------------
    @on_arrays_device
    def __call__(self, F: Any, I: Array, edge_bias: Optional[Array] = None, *, channels_last: bool = False) -> Array:
        """The forward: O of shape ``o_shape(N)`` from I of ``i_shape(N)``. ``channels_last``: I
        and O are (N, *spatial, channels) instead (torch's channels_last tensors, moved): the
        implicit kernels read and write them as they are; other calls move the channels first."""
        if edge_bias is not None and not self.edge_bias:
            raise ValueError("edge_bias: this layer was made without edge_bias=True")
        if self.edge_bias and edge_bias is None:
            raise ValueError(f"edge_bias: expected a bias of shape {self.edge_bias_shape()} (edge_bias=True)")
        if self.deconv:
            if edge_bias is not None:
                raise ValueError("edge_bias: a deconvolution takes none")
            return self._conv_input_grad(F, I, "I", channels_last)
        return self._conv_forward(F, I, edge_bias, "I", channels_last)

    @on_arrays_device
    def input_grad(self, F: Any, dO: Array, *, channels_last: bool = False) -> Array:
        """dI (``i_shape(N)``) from the output gradient dO (``o_shape(N)``); ``channels_last`` as
        for the forward."""
        if self.deconv:
            return self._conv_forward(F, dO, None, "dO", channels_last)
        return self._conv_input_grad(F, dO, "dO", channels_last)

    @on_arrays_device
    def filter_grad(self, dO: Array, I: Array, *, channels_last: bool = False) -> List[Array]:
        """Each block's filter gradient (``f_shape(b)``), from dO and the forward's input I (both
        channels-last with ``channels_last``)."""
        if self.deconv:
            return self._conv_filter_grad(I, dO, "I", "dO", channels_last)
        return self._conv_filter_grad(dO, I, "dO", "I", channels_last)

    def _l2(self, F, U, gain, epsilon, gradient):
        if self.deconv:
            raise NotImplementedError("l2_normalize: a deconvolution's filters are not normalized yet")
        named = [("F", self._flat_filter(F))] + ([("grad", self._flat_filter(U))] if gradient else []) \
            + ([("gain", gain)] if gain is not None else [])
        ops = checked_operands(named, DTYPES)
        rows = len(self._host["row_start"])
        if gain is not None and ops[-1].shape != (rows,):
            raise ValueError(f"gain: expected ({rows},) (one an output channel of a block), got {ops[-1].shape}")
        stream = launch_stream(ops)
        native, out = ops[0].empty((self.f_size,), stream)
        dgain_native, dgain = ops[0].empty((rows,), stream) if gain is not None and gradient else (None, None)
        t = self._table(stream)
        f = ops[0].device(stream).reshape(-1)
        u = ops[1].device(stream).reshape(-1) if gradient else f
        g = ops[-1].device(stream) if gain is not None else f
        kernel = cached(make_l2_normalize, ops[0].dtype, _acc(ops[0].dtype), gradient, gain is not None)
        self._launch(kernel, stream, rows, (out, f, u, g, dgain if dgain is not None else out, t["row_start"],
                                            t["row_len"], float(epsilon)))
        flat = ops[0].result(native, out, stream)
        filters = [flat[self._f_off[b]:self._f_off[b + 1]].reshape(self.f_shape(b)) for b in range(len(self._blocks))]
        if dgain is not None:
            return filters, ops[0].result(dgain_native, dgain, stream)
        return filters

    @on_arrays_device
    def l2_normalize(self, F: Any, gain: Optional[Array] = None, epsilon: float = 1e-12) -> List[Array]:
        """Each block's filter with every output channel's (C, T, R, S) to unit L2 norm (times
        ``gain``, one value a block's output channel, blocks in order), OpenAI's weight norm."""
        return self._l2(F, None, gain, epsilon, False)

    @on_arrays_device
    def l2_normalize_grad(self, F: Any, grad: Any, gain: Optional[Array] = None, epsilon: float = 1e-12) -> Any:
        """The filters' gradient through `l2_normalize` from the normalized filters' ``grad``;
        with a gain, (that, the gain's gradient)."""
        return self._l2(F, grad, gain, epsilon, True)

    @on_arrays_device
    def edge_bias_grad(self, dO: Array) -> Array:
        """The edge bias's gradient, `edge_bias_shape`: dO summed over the batch and each group's
        positions."""
        if self.deconv:
            raise ValueError("edge_bias_grad: a deconvolution has no edge bias")
        (op,) = checked_operands([("dO", dO)], DTYPES)
        N = self._check(op, self.o_shape)
        stream = launch_stream([op])
        native, out = op.empty(tuple(self.edge_bias_shape()), stream)
        t = self._table(stream)
        kernel = cached(make_edge_bias_grad, op.dtype, _acc(op.dtype))
        self._launch(kernel, stream, self.K * len(self._edges), (
            out.reshape(-1), op.device(stream).reshape(-1), t["grp_ptr"], t["grp_pos"], N, self.K,
            int(np.prod(self._g["MPQ"]))))
        return op.result(native, out, stream)


class BlocksparseDeconv(BlocksparseConv):
    """The transposed `BlocksparseConv` over the same blocks: ``BCK``'s ``(cs, ks)`` connect this
    layer's input channels cs to its output channels ks, and block b's filter has shape
    ``(len(cs), len(ks), *TRS)`` (the convolution's, from ks back to cs). ``DHW``: this layer's
    input size; ``MPQ``: its output size, which strides > 1 leave ambiguous (the smallest by
    default). Forward and input gradient are the convolution's input gradient and forward."""

    deconv = True
