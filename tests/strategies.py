"""Shared hypothesis strategies and the one tolerance table.

Shapes are drawn first, values second. Values come from a drawn seed through
NumPy (hypothesis shrinks the seed and the shapes, and large arrays stay cheap
to draw); they are bounded, free of subnormals, and never all zero.
"""

import numpy as np
from hypothesis import strategies as st

from sparseblocks.layout import BLOCK_SIZES, BlockLayout

# Relative error ‖got − ref‖ / ‖ref‖ allowed against a float64 reference, by storage dtype.
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

LAYOUT_KINDS = ("random", "empty", "full", "single", "skewed")


def assert_close(got, want, dtype, name="result"):
    """Norm-wise relative error against a float64 reference, within TOLERANCE[dtype]; no NaN."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
    assert np.isfinite(got).all(), f"{name}: {np.count_nonzero(~np.isfinite(got))} non-finite elements"
    dtype = str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype
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
