"""Shared hypothesis strategies and the one tolerance table.

Shapes are drawn first, values second. Values come from a drawn seed through
NumPy (hypothesis shrinks the seed and the shapes, and large arrays stay cheap
to draw); they are bounded, free of subnormals, and never all zero.
"""

import numpy as np
from hypothesis import strategies as st

from sparseblocks.layout import BLOCK_SIZES, BlockLayout

# The one tolerance table, by storage dtype. A kernel's result is a sum of k terms (a dot product,
# an add into y) rounded to the storage at the end. With ``magnitude`` (the same sum of the terms'
# absolute values: the reference run on |inputs|) an element may differ from the float64 reference
# by ``SUM[dtype] · k · magnitude + OUT[dtype] · |ref|``: the accumulation's rounding (fp32 for all
# but fp64, 3xTF32's dropped tail included) scaled by the size of what was summed, so cancellation
# cannot fail a correct kernel, plus the output's own rounding. Without it, the norm-wise relative
# error ‖got − ref‖ / ‖ref‖ must stay within TOLERANCE[dtype].
SUM = {"float64": 4e-16, "float32": 1e-6, "float16": 1e-6, "bfloat16": 1e-6}
OUT = {"float64": 2.3e-16, "float32": 1.2e-7, "float16": 9.8e-4, "bfloat16": 7.9e-3}
TOLERANCE = {"float64": 1e-12, "float32": 2e-6, "float16": 3e-3, "bfloat16": 2e-2}
# Absolute slack for outputs whose reference is (near) zero.
ABSOLUTE = {"float64": 1e-300, "float32": 1e-30, "float16": 1e-6, "bfloat16": 1e-6}
DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")


def numpy_dtype(name):
    """The NumPy dtype of a name; bfloat16 through ml_dtypes."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)

def gpu_only_case(*values):
    """A parametrize case that runs on a GPU only: in the simulator (CI) a sibling case covers its
    kernel path, and this one would cost a minute of Python threads."""
    import pytest

    from sparseblocks.runtime.backend import SIMULATOR

    return pytest.param(*values, marks=pytest.mark.skipif(SIMULATOR, reason="a sibling case covers it in the "
                                                                            "simulator; runs on the GPU"))


LAYOUT_KINDS = ("random", "empty", "full", "single", "skewed")


def assert_close(got, want, dtype, name="result", magnitude=None, terms=1, stored=0):
    """``got`` against a float64 reference ``want``; no NaN. With ``magnitude`` (the sums of the
    terms' absolute values, ``terms`` of them an element) element by element within the bound
    SUM·terms·magnitude + OUT·(|want| + stored·magnitude) (see the table above; ``stored``:
    partial results rounded to the storage dtype before the last); else norm-wise within TOLERANCE."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
    assert np.isfinite(got).all(), f"{name}: {np.count_nonzero(~np.isfinite(got))} non-finite elements"
    dtype = str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype
    if magnitude is not None:
        magnitude = np.asarray(magnitude, np.float64)
        bound = SUM[dtype] * terms * magnitude + OUT[dtype] * (np.abs(want) + stored * magnitude) + ABSOLUTE[dtype]
        excess = np.abs(got - want) - bound
        worst = np.unravel_index(np.argmax(excess), excess.shape) if excess.size else None
        assert not excess.size or excess[worst] <= 0, (
            f"{name}: error {abs(got - want)[worst]:.3g} > bound {bound[worst]:.3g} at {worst} "
            f"(magnitude {magnitude[worst]:.3g}, {terms} terms)")
        return
    error = np.linalg.norm(got - want)
    bound = TOLERANCE[dtype] * np.linalg.norm(want) + ABSOLUTE[dtype]
    assert error <= bound, f"{name}: error {error:.3g} > {bound:.3g} (relative tol {TOLERANCE[dtype]})"


def mask_of_kind(kind, shape, rng):
    """A 0/1 block mask of a named kind: random, empty, full, single, skewed."""
    mask = np.zeros(shape, bool)
    if kind == "random":
        mask = rng.random(shape) < rng.uniform(0.2, 0.8)
    elif kind == "full":
        mask[:] = True
    elif kind == "single":
        mask[rng.integers(shape[0]), rng.integers(shape[1])] = True
    elif kind == "skewed":
        # One column full, the rest nearly empty.
        mask[:, rng.integers(shape[1])] = True
        mask[rng.integers(shape[0]), rng.integers(shape[1])] = True
    return mask


@st.composite
def layouts(draw, block_sizes=BLOCK_SIZES, max_blocks=3, kinds=LAYOUT_KINDS):
    """A BlockLayout: block size, grid shape, then a mask of a drawn kind."""
    block_size = draw(st.sampled_from(block_sizes))
    shape = (draw(st.integers(1, max_blocks)), draw(st.integers(1, max_blocks)))
    kind = draw(st.sampled_from(kinds))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return BlockLayout(mask_of_kind(kind, shape, rng), block_size)


VALUE_STYLES = ("normal", "uniform", "small_integers", "sparse")


def values(rng, shape, dtype, style="normal"):
    """Bounded, subnormal-free, never all-zero values of a shape and dtype."""
    if style == "normal":
        a = rng.standard_normal(shape)
    elif style == "uniform":
        a = rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
    elif style == "small_integers":  # exact in every float dtype: sums compare bitwise
        a = rng.integers(-3, 4, shape).astype(np.float64)
    else:  # mostly zeros, some ±1
        a = np.where(rng.random(shape) < 0.2, rng.choice([-1.0, 1.0], shape), 0.0)
    if a.size and not a.any():
        a.flat[rng.integers(a.size)] = 1
    return a.astype(numpy_dtype(dtype) if isinstance(dtype, str) else dtype)


@st.composite
def arrays(draw, shape, dtype, styles=VALUE_STYLES):
    """An array of `shape` and `dtype` from a drawn seed and value style."""
    style = draw(st.sampled_from(styles))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return values(rng, shape, dtype, style)


# -- SBNet: block geometry, images, block indices ------------------------------------


def geometries(max_size=5, max_stride=6, offsets=(-4, 3)):
    """bsize, bstride, boffset as (h, w) pairs."""
    return st.fixed_dictionaries({
        "bsize": st.tuples(st.integers(1, max_size), st.integers(1, max_size)),
        "bstride": st.tuples(st.integers(1, max_stride), st.integers(1, max_stride)),
        "boffset": st.tuples(st.integers(*offsets), st.integers(*offsets)),
    })


@st.composite
def images(draw, channels=True, max_side=9, max_channels=3, dtype="float64", styles=("normal", "sparse")):
    """(rng, image): NHW (or NHWC with `channels`) values, and the generator that drew them."""
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, max_side)), draw(st.integers(1, max_side)))
    if channels:
        shape += (draw(st.integers(1, max_channels)),)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng, values(rng, shape, dtype, draw(st.sampled_from(styles)))


def block_grid(shape, g):
    """Every block index (n, bh, bw) of an NHW(C) shape's grid, row-major, as int32 [n, 3]."""
    from sparseblocks.reference.sbnet import block_count

    count = block_count(shape[1:3], g["bstride"], g["boffset"])
    return np.array([(n, a, b) for n in range(shape[0]) for a in range(count[0]) for b in range(count[1])],
                    np.int32).reshape(-1, 3)


def block_indices(rng, shape, g, max_blocks=6, unique=False):
    """Up to `max_blocks` indices from the grid and some out of range ones, in random order
    (with repeats unless `unique`)."""
    outside = np.array([[shape[0], 0, 0], [0, -1, 0], [0, 0, 99]], np.int32)
    pool = np.concatenate([block_grid(shape, g), outside])
    chosen = rng.choice(len(pool), size=min(len(pool), rng.integers(0, max_blocks + 1)), replace=not unique)
    return pool[chosen].reshape(-1, 3)
