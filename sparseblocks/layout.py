"""`BlockLayout`: the one description of block-sparse structure in sparseblocks.

Convention (OpenAI blocksparse): a weight matrix ``W`` of shape ``(C, K)``
maps ``C`` input features to ``K`` output features and is cut into square
blocks of ``block_size``. ``mask[c, k] = 1`` means the block that maps input
features ``c*bs:(c+1)*bs`` to output features ``k*bs:(k+1)*bs`` is present.
Present blocks are stored densely as ``w[n_blocks, bs, bs]`` with
``w[b] = W[c*bs:(c+1)*bs, k*bs:(k+1)*bs]`` for block ``b = (c, k)``.

Block numbering is row-major over ``(c, k)``: block ``b`` is the ``b``-th
nonzero of ``mask`` in C order (the order of ``np.nonzero(mask)``). It depends
on the mask alone and never changes for a given mask.

Derived once, as int32 arrays (read-only):

* ``coords[b] = (c, k)``, the coordinate list;
* ``row_ptr[c]:row_ptr[c+1]`` are the blocks of block-row ``c`` (CSR over c);
  their block ids are consecutive, and ``col_idx[b]`` is the ``k`` of block b;
* ``col_ptr[k]:col_ptr[k+1]`` index the blocks of block-column ``k`` (CSC over
  k), ascending in ``c``: ``row_idx[j]`` is the ``c`` and ``col_block[j]``
  the block id (pointing into the same ``w``, no transposed copy).
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Tuple

import numpy as np

BLOCK_SIZES = (8, 16, 32, 64, 128)
INT32_MAX = np.iinfo(np.int32).max


def _readonly(array):
    array.setflags(write=False)
    return array


class BlockLayout:
    """Immutable block-sparse structure: a block mask and a block size."""

    __slots__ = (
        "mask", "block_size", "coords", "row_ptr", "col_idx",
        "col_ptr", "row_idx", "col_block", "_hash", "_schedules",
    )
    mask: np.ndarray  # (Cb, Kb) bool
    block_size: int
    coords: np.ndarray  # (n_blocks, 2) int32: each block's (c, k), in row order
    row_ptr: np.ndarray  # CSR over block-rows
    col_idx: np.ndarray
    col_ptr: np.ndarray  # CSC over block-columns
    row_idx: np.ndarray
    col_block: np.ndarray  # the blocks in column order, as indices into coords
    _hash: int
    _schedules: dict

    def __init__(self, mask: np.ndarray, block_size: int = 32) -> None:
        mask = np.asarray(mask)
        if mask.ndim != 2:
            raise ValueError(f"mask: expected a 2-D array of 0/1 blocks, got {mask.ndim} dimensions")
        if 0 in mask.shape:
            raise ValueError(f"mask: expected a non-empty shape, got {mask.shape}")
        if mask.dtype != np.bool_:
            if not (np.issubdtype(mask.dtype, np.number) and np.isin(mask, (0, 1)).all()):
                raise ValueError("mask: expected only 0 and 1 (or booleans)")
        block_size = check_block_size(block_size)
        mask = mask.astype(bool)
        dense = max(mask.shape) * block_size
        if dense > INT32_MAX:
            raise ValueError(
                f"mask: {mask.shape} blocks of {block_size} overflow int32 indices (features must stay below 2**31)"
            )

        set_ = object.__setattr__
        set_(self, "mask", _readonly(np.ascontiguousarray(mask)))
        set_(self, "block_size", block_size)
        rows, cols = np.nonzero(mask)
        set_(self, "coords", _readonly(np.stack([rows, cols], axis=1).astype(np.int32)))
        row_ptr = np.zeros(mask.shape[0] + 1, np.int32)
        np.cumsum(mask.sum(axis=1), out=row_ptr[1:])
        set_(self, "row_ptr", _readonly(row_ptr))
        set_(self, "col_idx", _readonly(cols.astype(np.int32)))
        # Stable sort by column keeps each column's blocks ascending in c.
        by_col = np.argsort(cols, kind="stable")
        col_ptr = np.zeros(mask.shape[1] + 1, np.int32)
        np.cumsum(mask.sum(axis=0), out=col_ptr[1:])
        set_(self, "col_ptr", _readonly(col_ptr))
        set_(self, "row_idx", _readonly(rows[by_col].astype(np.int32)))
        set_(self, "col_block", _readonly(by_col.astype(np.int32)))
        set_(self, "_hash", hash((block_size, mask.shape, mask.tobytes())))
        set_(self, "_schedules", {})

    def __setattr__(self, name, value):
        raise AttributeError("BlockLayout is immutable")

    # -- constructors ---------------------------------------------------

    @classmethod
    def random(cls, shape: Sequence[int], density: Optional[float] = None, seed: int = 0, block_size: int = 32, *,
               n_blocks: Optional[int] = None) -> BlockLayout:
        """Exactly ``round(density * Cb * Kb)`` blocks (or exactly ``n_blocks``) of a ``(Cb, Kb)``
        grid, drawn uniformly; give one of the two."""
        shape = _block_grid_shape(shape)
        total = shape[0] * shape[1]
        if (density is None) == (n_blocks is None):
            raise ValueError("random: expected one of density and n_blocks")
        if density is not None:
            if not 0.0 <= float(density) <= 1.0:
                raise ValueError(f"density: expected a number in [0, 1], got {density}")
            n_blocks = int(round(density * total))
        elif isinstance(n_blocks, bool) or not isinstance(n_blocks, (int, np.integer)) or not 0 <= n_blocks <= total:
            raise ValueError(f"n_blocks: expected an int from 0 to {total} (the grid's blocks), got {n_blocks!r}")
        chosen = np.random.default_rng(seed).permutation(total)[:int(n_blocks)]
        mask = np.zeros(total, bool)
        mask[chosen] = True
        return cls(mask.reshape(shape), block_size)

    @classmethod
    def banded(cls, shape: Sequence[int], lower: int, upper: Optional[int] = None, block_size: int = 32) -> BlockLayout:
        """The band ``-lower <= k - c <= upper`` of a ``(Cb, Kb)`` grid (``upper`` defaults to
        ``lower``): a local window, each block-row connected to its neighbours."""
        shape = _block_grid_shape(shape)
        upper = lower if upper is None else upper
        for name, value in (("lower", lower), ("upper", upper)):
            _check_count(name, value)
        c, k = np.indices(shape)
        return cls((k - c >= -lower) & (k - c <= upper), block_size)

    @classmethod
    def causal(cls, n: int, block_size: int = 32) -> BlockLayout:
        """An ``(n, n)`` grid of (query block, key block), each query seeing itself and the keys
        before it (the lower triangle, diagonal included)."""
        _check_count("n", n, least=1)
        return cls(np.tril(np.ones((n, n), bool)), block_size)

    @classmethod
    def strided(cls, n: int, stride: int, causal: bool = True, block_size: int = 32) -> BlockLayout:
        """The Sparse Transformer's strided pattern on an ``(n, n)`` grid of (query, key) blocks:
        query i sees the ``stride`` blocks up to itself and every ``stride``-th block before
        (``(i - j) % stride == 0``); with ``causal`` nothing after i, else both directions."""
        _check_count("n", n, least=1)
        _check_count("stride", stride, least=1)
        i, j = np.indices((n, n))
        distance = i - j if causal else np.abs(i - j)
        return cls((distance >= 0) & ((distance < stride) | (distance % stride == 0)), block_size)

    @classmethod
    def fixed(cls, n: int, stride: int, summary: int = 1, causal: bool = True, block_size: int = 32) -> BlockLayout:
        """The Sparse Transformer's fixed pattern on an ``(n, n)`` grid: query i sees its own
        window of ``stride`` blocks and the last ``summary`` blocks of every window (which carry
        a window's summary onward); with ``causal`` nothing after i."""
        _check_count("n", n, least=1)
        _check_count("stride", stride, least=1)
        _check_count("summary", summary, least=1)
        if summary > stride:
            raise ValueError(f"summary: expected at most stride ({stride}) blocks, got {summary}")
        i, j = np.indices((n, n))
        mask = (i // stride == j // stride) | (j % stride >= stride - summary)
        return cls(mask & (j <= i) if causal else mask, block_size)

    @classmethod
    def global_window(cls, n: int, global_blocks: int, window: int, causal: bool = False,
                      block_size: int = 32) -> BlockLayout:
        """BigBird's and Longformer's pattern on an ``(n, n)`` grid of (query, key) blocks: the
        first ``global_blocks`` blocks see and are seen by every block, and every query sees the
        keys within ``window`` blocks of it; with ``causal`` nothing after the query."""
        _check_count("n", n, least=1)
        _check_count("global_blocks", global_blocks)
        _check_count("window", window)
        i, j = np.indices((n, n))
        mask = (np.abs(i - j) <= window) | (i < global_blocks) | (j < global_blocks)
        return cls(mask & (j <= i) if causal else mask, block_size)

    @classmethod
    def documents(cls, lengths: Iterable[int], causal: bool = False, block_size: int = 32) -> BlockLayout:
        """Packed documents: a block-diagonal ``(n, n)`` grid, each document (``lengths``: its
        blocks, in order) seeing itself only; with ``causal`` each query only the keys before it."""
        lengths = list(lengths)
        for k, length in enumerate(lengths):
            _check_count(f"lengths[{k}]", length, least=1)
        if not lengths:
            raise ValueError("lengths: expected at least one document")
        document = np.repeat(np.arange(len(lengths)), lengths)
        i, j = np.indices((len(document), len(document)))
        mask = document[:, None] == document[None, :]
        return cls(mask & (j <= i) if causal else mask, block_size)

    @classmethod
    def from_weights(cls, W: np.ndarray, block_size: int = 32, density: Optional[float] = None, *,
                     n_blocks: Optional[int] = None, criterion: str = "l2") -> BlockLayout:
        """The blocks of a dense ``(C, K)`` matrix with the largest norms (``criterion``: "l2",
        "l1" or "max", as `bsmm.block_norms`): ``round(density · Cb · Kb)`` of them, or
        ``n_blocks``; ties go to the first in row-major order."""
        W = np.asarray(W, np.float64)
        block_size = check_block_size(block_size)
        if W.ndim != 2 or W.shape[0] % block_size or W.shape[1] % block_size or 0 in W.shape:
            raise ValueError(f"W: expected a 2-D (C, K) matrix with sides multiples of block_size {block_size}, "
                             f"got shape {W.shape}")
        shape = (W.shape[0] // block_size, W.shape[1] // block_size)
        tiles = np.abs(W.reshape(shape[0], block_size, shape[1], block_size))
        norms = {"l2": lambda t: np.sqrt((t * t).sum(axis=(1, 3))), "l1": lambda t: t.sum(axis=(1, 3)),
                 "max": lambda t: t.max(axis=(1, 3))}
        if criterion not in norms:
            raise ValueError(f"criterion: expected one of {tuple(norms)}, got {criterion!r}")
        keep = cls.random(shape, density, 0, block_size, n_blocks=n_blocks).n_blocks  # (the same checks)
        order = np.argsort(-norms[criterion](tiles).ravel(), kind="stable")[:keep]
        mask = np.zeros(shape[0] * shape[1], bool)
        mask[order] = True
        return cls(mask.reshape(shape), block_size)

    @classmethod
    def dense(cls, shape: Sequence[int], block_size: int = 32) -> BlockLayout:
        """Every block of a ``(Cb, Kb)`` grid present."""
        return cls(np.ones(_block_grid_shape(shape), bool), block_size)

    @classmethod
    def from_mask(cls, element_mask: np.ndarray, block_size: int = 32) -> BlockLayout:
        """Blocks of a ``(C, K)`` element mask that hold at least one nonzero element."""
        element_mask = np.asarray(element_mask)
        if element_mask.ndim != 2:
            raise ValueError(f"element_mask: expected 2-D (C, K), got {element_mask.ndim} dimensions")
        block_size = check_block_size(block_size)
        C, K = element_mask.shape
        if C % block_size or K % block_size:
            raise ValueError(
                f"element_mask: shape {element_mask.shape} is not a multiple of block_size {block_size}"
            )
        blocks = element_mask.reshape(C // block_size, block_size, K // block_size, block_size)
        return cls((blocks != 0).any(axis=(1, 3)), block_size)

    # -- shape ----------------------------------------------------------

    @property
    def shape(self) -> Tuple[int, int]:
        """Block grid ``(Cb, Kb)``."""
        return self.mask.shape

    @property
    def dense_shape(self) -> Tuple[int, int]:
        """Dense weight shape ``(C, K)``."""
        return (self.mask.shape[0] * self.block_size, self.mask.shape[1] * self.block_size)

    @property
    def n_blocks(self) -> int:
        return int(self.coords.shape[0])

    @property
    def w_shape(self) -> Tuple[int, int, int]:
        """Shape of the block storage ``(n_blocks, bs, bs)``; a ValueError where it would hold 2**31
        elements or more (the weights' kernels index them in int32). Every op that stores or reads
        weights on a layout asks for it; attention, which stores none, takes larger layouts."""
        if self.n_blocks * self.block_size ** 2 > INT32_MAX:
            raise ValueError(
                f"layout: {self.mask.shape} blocks of {self.block_size} with {self.n_blocks} present overflow int32 "
                "indices (stored weight elements must stay below 2**31)"
            )
        return (self.n_blocks, self.block_size, self.block_size)

    @property
    def density(self) -> float:
        """Fraction of blocks present."""
        return self.n_blocks / self.mask.size

    def block_coord(self, block: int) -> Tuple[int, int]:
        """``(c, k)`` of block number ``block``."""
        if not -self.n_blocks <= block < self.n_blocks:
            raise IndexError(f"block: expected an index below n_blocks={self.n_blocks}, got {block}")
        c, k = self.coords[block]
        return int(c), int(k)

    # -- work schedules ---------------------------------------------------

    def line_segments(self, axis: str, max_blocks: int) -> dict:
        """Split the layout's lines into segments of at most `max_blocks` blocks (cached).

        ``axis="col"`` takes the block-columns k (CSC: what the forward product
        sums over), ``axis="row"`` the block-rows c (CSR: the input gradient).
        Lines longer than `max_blocks` are cut so no thread block gets far more
        work than the rest; every line, even an empty one, gets a segment so
        its output is written. Returns a dict of int32 arrays:

        * ``seg_line``, ``seg_begin``, ``seg_end``: segment s covers index
          entries ``seg_begin[s]:seg_end[s]`` (into ``col_ptr``/``row_ptr``
          order) of line ``seg_line[s]``;
        * ``seg_slot``: -1 for the only segment of a line, else the row of a
          partial-sum workspace the segment writes;
        * ``split_line``, ``split_begin``, ``split_end``: the workspace rows
          ``split_begin[i]:split_end[i]`` that sum, in order, to line
          ``split_line[i]``; and ``n_slots``, the workspace rows needed.
        """
        if axis not in ("row", "col"):
            raise ValueError(f"axis: expected 'row' or 'col', got {axis!r}")
        max_blocks = max(1, int(max_blocks))
        key = (axis, max_blocks)
        if key not in self._schedules:
            self._schedules[key] = _segments(self.row_ptr if axis == "row" else self.col_ptr, max_blocks)
        return self._schedules[key]

    # -- conversion -----------------------------------------------------

    def to_dense(self, w: np.ndarray) -> np.ndarray:
        """Dense ``(C, K)`` matrix from block storage ``w[n_blocks, bs, bs]``; absent blocks are 0."""
        w = np.asarray(w)
        if w.shape != self.w_shape:
            raise ValueError(f"w: expected shape {self.w_shape}, got {w.shape}")
        bs = self.block_size
        dense = np.zeros(self.dense_shape, w.dtype)
        tiles = dense.reshape(self.shape[0], bs, self.shape[1], bs).transpose(0, 2, 1, 3)
        tiles[self.coords[:, 0], self.coords[:, 1]] = w
        return dense

    def from_dense(self, W: np.ndarray) -> np.ndarray:
        """Block storage ``(n_blocks, bs, bs)`` of the layout's blocks of a dense ``(C, K)`` matrix."""
        W = np.asarray(W)
        if W.shape != self.dense_shape:
            raise ValueError(f"W: expected shape {self.dense_shape}, got {W.shape}")
        bs = self.block_size
        tiles = W.reshape(self.shape[0], bs, self.shape[1], bs).transpose(0, 2, 1, 3)
        return np.ascontiguousarray(tiles[self.coords[:, 0], self.coords[:, 1]])

    def element_mask(self) -> np.ndarray:
        """Boolean ``(C, K)`` mask of the elements covered by present blocks."""
        bs = self.block_size
        return np.kron(self.mask, np.ones((bs, bs), bool)).astype(bool)

    # -- pictures ---------------------------------------------------------

    def plot(self, path, w: Optional[np.ndarray] = None, title: Optional[str] = None):
        """Write a PNG of the block mask to ``path`` and, given the blocks ``w[n_blocks, bs, bs]``,
        beside it each present block's l2 norm. Needs matplotlib (the ``bench`` or ``demo``
        extra). Returns ``path``."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("BlockLayout.plot needs matplotlib: pip install 'sparseblocks[bench]'") from None
        panels = 1 if w is None else 2
        figure, axes = plt.subplots(1, panels, figsize=(4.5 * panels, 4.2), squeeze=False)
        axes[0, 0].imshow(self.mask, cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
        axes[0, 0].set_title(title or f"{self.shape[0]} x {self.shape[1]} blocks of {self.block_size}, "
                             f"{self.density:.0%}", fontsize=9)
        if w is not None:
            w = np.asarray(w, np.float64)
            if w.shape != self.w_shape:
                raise ValueError(f"w: expected shape {self.w_shape}, got {w.shape}")
            norms = np.full(self.shape, np.nan)
            norms[self.coords[:, 0], self.coords[:, 1]] = np.sqrt((w * w).sum(axis=(1, 2)))
            image = axes[0, 1].imshow(norms, cmap="viridis", interpolation="nearest")
            axes[0, 1].set_title("block l2 norms", fontsize=9)
            figure.colorbar(image, ax=axes[0, 1], fraction=0.046)
        for axis in axes[0]:
            axis.set_xlabel("k (output block)")
            axis.set_ylabel("c (input block)")
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)
        return path

    # -- identity -------------------------------------------------------

    def __eq__(self, other):
        if not isinstance(other, BlockLayout):
            return NotImplemented
        return self.block_size == other.block_size and np.array_equal(self.mask, other.mask)

    def __hash__(self):
        return self._hash

    def __repr__(self):
        return (
            f"BlockLayout(shape={self.shape}, block_size={self.block_size}, "
            f"n_blocks={self.n_blocks}, density={self.density:.3g})"
        )

    def __reduce__(self):
        return (BlockLayout, (np.array(self.mask), self.block_size))


def _check_count(name, value, least=0):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ValueError(f"{name}: expected an int of at least {least}, got {value!r}")


def _block_grid_shape(shape):
    shape = tuple(int(s) for s in shape)
    if len(shape) != 2 or min(shape) < 1:
        raise ValueError(f"shape: expected two positive block counts (Cb, Kb), got {shape}")
    return shape


def check_layout(layout, name="layout"):
    """``layout`` itself, where it is a `BlockLayout` (else a TypeError naming ``name``)."""
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"{name}: expected a BlockLayout, got {type(layout).__name__}")
    return layout


def check_block_size(block_size):
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)):
        raise TypeError(f"block_size: expected an int in {BLOCK_SIZES}, got {block_size!r}")
    if int(block_size) not in BLOCK_SIZES:
        raise ValueError(f"block_size: expected one of {BLOCK_SIZES}, got {block_size}")
    return int(block_size)


def _segments(ptr, max_blocks):
    seg_line, seg_begin, seg_end, seg_slot = [], [], [], []
    split_line, split_begin, split_end = [], [], []
    n_slots = 0
    for line in range(len(ptr) - 1):
        begin, end = int(ptr[line]), int(ptr[line + 1])
        starts = list(range(begin, end, max_blocks)) or [begin]
        split = len(starts) > 1
        if split:
            split_line.append(line)
            split_begin.append(n_slots)
        for start in starts:
            seg_line.append(line)
            seg_begin.append(start)
            seg_end.append(min(start + max_blocks, end))
            seg_slot.append(n_slots if split else -1)
            n_slots += split
        if split:
            split_end.append(n_slots)
    as_int32 = lambda values: _readonly(np.array(values, np.int32))  # noqa: E731
    return {
        "seg_line": as_int32(seg_line), "seg_begin": as_int32(seg_begin), "seg_end": as_int32(seg_end),
        "seg_slot": as_int32(seg_slot), "split_line": as_int32(split_line),
        "split_begin": as_int32(split_begin), "split_end": as_int32(split_end), "n_slots": n_slots,
    }
