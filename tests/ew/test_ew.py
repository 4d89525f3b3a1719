"""The element-wise ops (sparseblocks/ew) against their NumPy twins: every op and gradient, every
dtype, broadcasting, edge values (0, negatives, overflow) and errors before any launch."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseblocks import ew
from sparseblocks.ew import EwConfig
from sparseblocks.reference import ew as reference
from sparseblocks.runtime.backend import SIMULATOR
from strategies import numpy_dtype

SMALL = EwConfig(threads=32, waves=2) if SIMULATOR else EwConfig()
UNIT = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53}
DTYPES = ["float32", "float16", "bfloat16", "float64"]


def close(got, want, dtype, name, terms=1, scale=None):
    """Within a few roundings of the storage (the result's) and of the sums (fp32; fp64)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    acc = UNIT["float64" if dtype == "float64" else "float32"]
    scale = np.abs(want) if scale is None else scale
    bound = 4 * UNIT[dtype] * np.abs(want) + 8 * terms * acc * scale + 1e-300
    bad = ~same & ~(np.abs(got - want) <= bound)
    assert not bad.any(), f"{name}: {got[bad][:4]} against {want[bad][:4]}"


def values(rng, shape, dtype, positive=False):
    a = rng.uniform(0.25, 3.0, shape) * (1 if positive else rng.choice([-1.0, 1.0], shape))
    return np.asarray(a).astype(numpy_dtype(dtype))


@settings(max_examples=25 if SIMULATOR else 100, deadline=None)
@given(op=st.sampled_from(ew.UNARY), dtype=st.sampled_from(DTYPES), n=st.integers(0, 40), seed=st.integers(0, 99),
       alpha=st.sampled_from([1.0, 0.3]))
def test_unary_ops_and_gradients_match_the_twin(op, dtype, n, seed, alpha):
    rng = np.random.default_rng(seed)
    x = values(rng, (n,), dtype, positive=op in ("sqrt", "log"))
    y = ew.unary(op, x, alpha, config=SMALL)
    assert y.dtype == x.dtype
    close(y, reference.unary(op, x, alpha), dtype, op)
    dy = values(rng, (n,), dtype)
    dx = ew.unary_grad(op, dy, x, y, alpha, config=SMALL)
    # The gradient takes y as stored (tanh's 1 - y² would magnify its rounding): the twin's formula
    # on the same y.
    with np.errstate(all="ignore"):
        want = reference.UNARY[op][1](np.asarray(dy, np.float64), np.asarray(x, np.float64),
                                      np.asarray(y, np.float64), alpha)
    close(dx, want, dtype, f"{op} grad", terms=4)


@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-6), ("float16", 1e-3)])
def test_unary_edge_values_are_the_gpus(dtype, rtol):
    """Zeros, large values, infinities and NaN (fp16: the approximate curves' path)."""
    x = np.array([0.0, -1.0, 100.0, -100.0, np.inf, -np.inf, np.nan, 0.01, -0.01, 12.0, -12.0], dtype)
    with np.errstate(all="ignore"):
        for op in ew.UNARY:
            got = ew.unary(op, x, config=SMALL)
            want = reference.unary(op, x)
            np.testing.assert_allclose(np.asarray(got, np.float64), want.astype(dtype).astype(np.float64),
                                       rtol=rtol, atol=1e-7, err_msg=op)


SHAPES = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 5), (3, 1)), ((1,), (2, 3, 2, 2)), ((2, 3), ()),
          ((0, 3), (3,))]


@pytest.mark.parametrize("a_shape, b_shape", SHAPES)
@pytest.mark.parametrize("op", ew.BINARY)
def test_binary_ops_broadcast_and_their_gradients_sum_back(op, a_shape, b_shape):
    rng = np.random.default_rng(len(a_shape) * 7 + len(b_shape))
    dtype = "float32"
    a, b = values(rng, a_shape, dtype), values(rng, b_shape, dtype)
    if op in ("maximum", "minimum") and a.size and b.size:
        b.flat[0] = a.flat[0]  # a tie: the gradient splits evenly
    out = ew.binary(op, a, b, config=SMALL)
    close(out, reference.binary(op, a, b), dtype, op)
    dy = values(rng, out.shape, dtype)
    da, db = ew.binary_grad(op, dy, a, b, config=SMALL)
    want_a, want_b = reference.binary_grad(op, dy, a, b)
    terms = max(1, out.size)
    close(da, want_a, dtype, f"{op} da", terms, scale=np.abs(dy).sum() * 10 + np.abs(want_a))
    close(db, want_b, dtype, f"{op} db", terms, scale=np.abs(dy).sum() * 10 + np.abs(want_b))
    assert da.shape == a.shape and db.shape == b.shape


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_vector_paths_take_two_groups_a_grid_stride_apart(dtype):
    """The flat vector loops' pairs of groups of 4, a grid's stride apart, a last group alone and
    a tail of single values: 407 values (101 groups and 3) over one thread block of 32 threads."""
    rng = np.random.default_rng(9)
    cfg = EwConfig(threads=32, waves=1) if SIMULATOR else SMALL
    n = 407 if SIMULATOR else 4 * (2 * 132 * 16 * 256) + 4 * 77 + 3
    x, z = values(rng, (n,), dtype), values(rng, (n,), dtype)
    close(ew.unary("sigmoid", x, config=cfg), reference.unary("sigmoid", x), dtype, "sigmoid")
    close(ew.binary("multiply", x, z, config=cfg), reference.binary("multiply", x, z), dtype, "multiply")


@pytest.mark.parametrize("dtype", DTYPES)
def test_binary_ops_in_every_dtype_and_nan(dtype):
    rng = np.random.default_rng(3)
    a, b = values(rng, (2, 5), dtype), values(rng, (5,), dtype)
    for op in ew.BINARY:
        close(getattr(ew, op)(a, b, config=SMALL), reference.binary(op, a, b), dtype, op)
    a[0, 0] = np.nan
    assert np.isnan(ew.maximum(a, b, config=SMALL)[0, 0]) and np.isnan(ew.minimum(b, a, config=SMALL)[0, 0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 8])
def test_add_n_sums_in_one_pass(dtype, n):
    rng = np.random.default_rng(n)
    xs = [values(rng, (3, 7), dtype) for _ in range(n)]
    close(ew.add_n(xs, config=SMALL), reference.add_n(xs), dtype, "add_n", terms=n,
          scale=sum(np.abs(np.asarray(x, np.float64)) for x in xs))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("with_a, with_b", [(True, True), (True, False), (False, True)])
def test_cwise_linear_and_its_gradient(dtype, with_a, with_b):
    rng = np.random.default_rng(4)
    x = values(rng, (2, 3, 4, 5), dtype)
    a = values(rng, (3,), dtype) if with_a else None
    b = values(rng, (3,), dtype) if with_b else None
    y = ew.cwise_linear(x, a, b, config=SMALL)
    close(y, reference.cwise_linear(x, a, b), dtype, "cwise_linear", terms=2,
          scale=np.abs(reference.cwise_linear(np.abs(x), None if a is None else np.abs(a), None if b is None else np.abs(b))))
    dy = values(rng, x.shape, dtype)
    dx, da, db = ew.cwise_linear_grad(dy, x, a, config=SMALL)
    want = reference.cwise_linear_grad(dy, x, a)
    for name, got, w, terms in (("dx", dx, want[0], 1), ("da", da, want[1], 40), ("db", db, want[2], 40)):
        close(got, w, dtype, name, terms, scale=np.abs(w) + 9 * terms)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("N, H, quads", [(3, 6, 1), (3, 12, 1), (3, 16, 1), (9, 48, 2)])
def test_fused_lstm_gates_and_their_gradients(dtype, merged, N, H, quads):
    """H 6: one column a thread; 12 and 16: groups of 4; 9 x 48 with ``lstm_quads16=2`` (16-bit
    gates): pairs of groups a grid's stride apart (crossing rows: a gate's place found for each),
    then single groups, 108 groups over two thread blocks of 32 threads."""
    rng = np.random.default_rng(5)
    cfg = dataclasses.replace(SMALL, lstm_quads16=quads)
    c = values(rng, (N, H), dtype)
    gates = [values(rng, (N, 4 * H), dtype)] if merged else [values(rng, (N, H), dtype) for _ in range(4)]
    c_next, h = ew.fused_lstm_gates(c, *gates, config=cfg)
    want = reference.fused_lstm_gates(c, *gates)
    close(c_next, want[0], dtype, "c_next", terms=4, scale=4 + np.abs(want[0]))
    close(h, want[1], dtype, "h", terms=8, scale=4 + np.abs(want[1]))
    dc_next, dh = values(rng, (N, H), dtype), values(rng, (N, H), dtype)
    grads = ew.fused_lstm_gates_grad(c, *gates, dc_next=dc_next, dh=dh, config=cfg)
    wants = reference.fused_lstm_gates_grad(c, *gates, dc_next=dc_next, dh=dh)
    assert len(grads) == len(wants) == (2 if merged else 5)
    for k, (got, w) in enumerate(zip(grads, wants)):
        close(got, w, dtype, f"gradient {k}", terms=16, scale=8 + np.abs(w))


@pytest.mark.parametrize("dtype", ["float16", "float64"])
def test_split4_and_concat4_invert_each_other(dtype):
    x = values(np.random.default_rng(6), (2, 3, 8), dtype)
    parts = ew.split4(x, config=SMALL)
    for got, want in zip(parts, reference.split4(x)):
        np.testing.assert_array_equal(np.asarray(got, np.float64), want)
    np.testing.assert_array_equal(ew.concat4(*parts, config=SMALL), x)


A = np.ones((2, 4), np.float32)


@pytest.mark.parametrize("call, error, match", [
    (lambda: ew.unary("cube", A), ValueError, "op: expected one of"),
    (lambda: ew.binary("power", A, A), ValueError, "op: expected one of"),
    (lambda: ew.add(A, np.ones(3, np.float32)), ValueError, "do not broadcast"),
    (lambda: ew.add(A, A.astype(np.float64)), TypeError, "dtype mismatch"),
    (lambda: ew.add(np.ones((1, 1, 1, 1, 2), np.float32), A), ValueError, "at most 4 dimensions"),
    (lambda: ew.relu(A.astype(np.int32)), TypeError, "x: expected dtype in"),
    (lambda: ew.add_n([]), ValueError, "xs: expected 1 to 8 arrays"),
    (lambda: ew.add_n([A] * 9), ValueError, "xs: expected 1 to 8 arrays"),
    (lambda: ew.add_n([A, A[:1]]), ValueError, r"xs\[1\]: expected xs\[0\]'s shape"),
    (lambda: ew.cwise_linear(A, np.ones(3, np.float32)), ValueError, r"a: expected shape \(4,\)"),
    (lambda: ew.split4(np.ones((2, 6), np.float32)), ValueError, "multiple of 4"),
    (lambda: ew.fused_lstm_gates(A, A, A), ValueError, "gates: expected four gate arrays"),
    (lambda: ew.fused_lstm_gates(A, A), ValueError, r"gates: expected shape \(2, 16\)"),
    (lambda: ew.unary_grad("exp", A[:1], A, A), ValueError, "dy: expected x's shape"),
    (lambda: ew.binary_grad("add", A[:1], A, A), ValueError, "dy: expected the output's shape"),
])
def test_bad_input_is_refused_before_any_launch(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 31, 200])
def test_dropout_matches_its_twin_and_regenerates_its_mask(dtype, n):
    x = values(np.random.default_rng(n), (n,), dtype)
    y, mask = ew.dropout(x, 0.6, seed=11, offset=5, packed=True, config=SMALL)
    want, keep = reference.dropout(x, 0.6, 11, 5)
    close(y, want, dtype, "dropout")
    np.testing.assert_array_equal(mask, reference.pack_bits(keep))
    np.testing.assert_array_equal(ew.dropout(x, 0.6, seed=11, offset=5, config=SMALL), y)  # repeatable
    np.testing.assert_array_equal(ew.dropout(x, 0.6, mask=mask, config=SMALL), y)  # the packed mask instead
    np.testing.assert_array_equal(ew.dropout_grad(x, 0.6, seed=11, offset=5, config=SMALL), y)
    np.testing.assert_array_equal(ew.dropout_grad(x, 0.6, mask=mask, config=SMALL), y)


def test_dropout_keeps_its_probability_and_every_value_at_one():
    x = np.ones(4000 if SIMULATOR else 1_000_000, np.float32)
    y = ew.dropout(x, 0.3, seed=2, config=SMALL)
    kept = np.count_nonzero(y) / x.size
    assert abs(kept - 0.3) < 4 * np.sqrt(0.3 * 0.7 / x.size)
    assert np.allclose(y[y != 0], 1 / 0.3)
    assert not np.array_equal(y, ew.dropout(x, 0.3, seed=2, offset=x.size, config=SMALL))
    np.testing.assert_array_equal(ew.dropout(x, 1.0, seed=2, config=SMALL), x)


@pytest.mark.parametrize("call, error, match", [
    (lambda: ew.dropout(A, 0.0), ValueError, r"keep_prob: expected a probability in \(0, 1\]"),
    (lambda: ew.dropout(A, "half"), TypeError, "keep_prob: expected a number"),
    (lambda: ew.dropout(A, 0.5, seed=-2), ValueError, "seed: expected an int"),
    (lambda: ew.dropout(A, 0.5, mask=np.zeros(2, np.uint32)), ValueError, r"mask: expected \(1,\) uint32"),
    (lambda: ew.dropout(A, 0.5, mask=np.zeros(1, np.int32)), ValueError, r"mask: expected \(1,\) uint32"),
])
def test_dropout_refuses_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_arrays_off_a_4_element_boundary_take_the_scalar_path(dtype):
    """Views one element into their buffers cannot be read 4 values a load: the launchers pick the
    kernels' scalar variant (in the simulator a vector access there raises), with the same results."""
    rng = np.random.default_rng(8)
    a, b, c = (values(rng, (1 + 4 * 9,), dtype)[1:] for _ in range(3))
    close(ew.sigmoid(a, config=SMALL), reference.unary("sigmoid", a, 1.0), dtype, "sigmoid")
    close(ew.add(a, b, config=SMALL), reference.binary("add", a, b), dtype, "add")
    close(ew.add_n([a, b, c], config=SMALL), reference.add_n([a, b, c]), dtype, "add_n", terms=3,
          scale=np.abs(np.asarray(a, np.float64)) * 3 + 9)
    gates = [g.reshape(3, 12) for g in (a, b, c, a)]
    close(ew.fused_lstm_gates(c.reshape(3, 12), *gates, config=SMALL)[0],
          reference.fused_lstm_gates(c.reshape(3, 12), *gates)[0], dtype, "c_next", terms=4, scale=8)
    close(ew.dropout(a, 0.5, seed=3, config=SMALL), reference.dropout(a, 0.5, 3)[0], dtype, "dropout")
