"""Layer norm (sparseblocks/norms) against its NumPy twin: both feature axes, ReLU, every dtype,
the backward, large means, and errors before any launch."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseblocks import norms
from sparseblocks.norms import NormsConfig
from sparseblocks.reference import norms as reference
from sparseblocks.runtime.backend import SIMULATOR
from strategies import numpy_dtype

# One warp a row in the simulator (each thread is a Python thread there), a few rows a dg chunk.
# (axis 0 by the column kernels unless a test asks for strips)
SMALL = NormsConfig(row_threads=32, column_warps=2, column_rows=3, grad_rows=3, column_strip_bytes=0) if SIMULATOR \
    else NormsConfig(column_strip_bytes=0)
UNIT = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24, "float64": 2.0 ** -53}


def _close(got, want, dtype, scale, name):
    """``got`` within a few roundings of ``want``: the sums' (fp32, fp64 for fp64) over ``scale``
    (what the error of a sum of C terms grows with), and the output's own."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
    accumulate = UNIT["float64" if dtype == "float64" else "float32"]
    bound = 8 * accumulate * scale + 2 * UNIT[dtype] * np.abs(want) + 1e-30
    worst = np.argmax(np.abs(got - want) - bound) if got.size else None
    assert not got.size or np.abs(got - want).flat[worst] <= np.broadcast_to(bound, got.shape).flat[worst], (
        f"{name}: error {np.abs(got - want).flat[worst]:.3g} > {np.broadcast_to(bound, got.shape).flat[worst]:.3g}")


def _problem(draw, dtype, axis):
    N = draw(st.one_of(st.integers(0, 5), st.sampled_from([8, 24])), label="N")  # (8, 24: whole 16-byte rows)
    C = draw(st.integers(1, 70), label="C")
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1), label="seed"))
    offset = draw(st.sampled_from([0.0, 3.0, -50.0]), label="mean")
    spread = draw(st.sampled_from([1.0, 1e-2, 30.0]), label="spread")
    x = (offset + spread * rng.standard_normal((N, C))).astype(numpy_dtype(dtype))
    g = rng.standard_normal(C).astype(numpy_dtype(dtype))
    b = rng.standard_normal(C).astype(numpy_dtype(dtype))
    dy = rng.standard_normal((N, C)).astype(numpy_dtype(dtype))
    t = (lambda a: a) if axis == 1 else (lambda a: np.ascontiguousarray(a.T))
    return t(x), g, b, t(dy), N, C


@settings(max_examples=6 if SIMULATOR else 60, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(["float32", "float16", "bfloat16", "float64"]),
       axis=st.sampled_from([1, 0]), relu=st.booleans(),
       strips=st.sampled_from([0, 8192, NormsConfig().column_strip_bytes]))
def test_layer_norm_and_its_gradients_match_the_twin(data, dtype, axis, relu, strips):
    """Forward and backward against the twin over dtypes, both axes and the ReLU; axis 0 by the
    column kernels or, where they fit, in one pass over strips (``column_strip_bytes``)."""
    x, g, b, dy, N, C = _problem(data.draw, dtype, axis)
    config = dataclasses.replace(SMALL, column_strip_bytes=strips)
    rows = (lambda a: np.asarray(a, np.float64)) if axis == 1 else (lambda a: np.asarray(a, np.float64).T)
    acc = "float64" if dtype == "float64" else "float32"
    y, mean, rstd = norms.layer_norm(x, g, b, axis=axis, relu=relu, stats=True, config=config)
    want, want_mean, want_rstd = reference.layer_norm(x, g, b, axis, relu=relu)
    assert mean.dtype == rstd.dtype == np.dtype(acc)
    # A row's mean is off by about its sum's rounding over C terms of |x| (`size`), xhat by that
    # times rstd (`drift`); y by drift·|g|, and rstd relative to its size by drift as well.
    size = np.abs(rows(x)).max(axis=1, initial=0)
    drift = C * size * want_rstd
    g64, b64 = np.abs(np.asarray(g, np.float64)), np.abs(np.asarray(b, np.float64))
    _close(rows(y), rows(want), dtype, drift[:, None] * g64 + b64, "y")
    _close(mean, want_mean, acc, C * size, "mean")
    _close(rstd, want_rstd, acc, drift * want_rstd, "rstd")

    dx, dg, db = norms.layer_norm_grad(dy, x, g, b, mean, rstd, axis=axis, relu=relu, config=config)
    want_dx, want_dg, want_db = reference.layer_norm_grad(dy, x, g, b, axis, relu=relu)
    assert dx.dtype == x.dtype and dg.dtype == db.dtype == g.dtype
    # dx sums C terms of |dy·g|·(1 + |xhat|), each off by the drift; dg and db sum N rows.
    dyg = (np.abs(rows(dy)) * g64).max(axis=1, initial=0)
    xhat = (size + np.abs(want_mean)) * want_rstd
    _close(rows(dx), rows(want_dx), dtype, (C * want_rstd * dyg * (1 + xhat) * (1 + drift))[:, None], "dx")
    dy_size = np.abs(np.asarray(dy, np.float64)).max(initial=0)
    _close(dg, want_dg, dtype, max(N, 1) * dy_size * (1 + xhat.max(initial=0)) * (1 + drift.max(initial=0)), "dg")
    _close(db, want_db, dtype, max(N, 1) * dy_size, "db")


def test_a_large_mean_costs_no_accuracy():
    """Axis 1 sums the variance from x - mean, axis 0 from x - (each column's first value), so a mean
    10⁴ times the spread leaves y accurate (E[x²] - E[x]² would cancel to noise in fp32)."""
    rng = np.random.default_rng(0)
    x = (1e4 + rng.standard_normal((4, 64))).astype(np.float32)
    g, b = np.ones(64, np.float32), np.zeros(64, np.float32)
    for axis, a in ((1, x), (0, np.ascontiguousarray(x.T))):
        y = norms.layer_norm(a, g, b, axis=axis, config=SMALL)
        want = reference.layer_norm(a, g, b, axis)[0]
        assert np.abs(y - want).max() < 1e-2, axis


@pytest.mark.parametrize("groups", [8, 0])
def test_rows_held_or_streamed_match_the_twin(groups):
    """Axis 1's statistics, the mean and then the squares about it, over a row held in registers
    or streamed: threads holding several groups, the last
    partly past the row's end or wholly (C = 298 over 32 threads of 3 groups in the simulator), a
    mean 5000 times the spread."""
    rng = np.random.default_rng(5)
    C = 298 if SIMULATOR else 4094
    x = (50 + 1e-2 * rng.standard_normal((3, C))).astype(np.float32)
    g, b = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    cfg = dataclasses.replace(SMALL, row_groups=groups)
    y, mean, rstd = norms.layer_norm(x, g, b, stats=True, config=cfg)
    want, want_mean, want_rstd = reference.layer_norm(x, g, b, 1)
    size = np.abs(x.astype(np.float64)).max(axis=1)
    drift = C * size * want_rstd
    _close(mean, want_mean, "float32", C * size, "mean")
    _close(rstd, want_rstd, "float32", drift * want_rstd, "rstd")
    _close(y, want, "float32", drift[:, None] * np.abs(g.astype(np.float64)) + np.abs(b.astype(np.float64)), "y")


def test_results_repeat_bitwise():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 50)).astype(np.float32)
    g, b = rng.standard_normal(50).astype(np.float32), rng.standard_normal(50).astype(np.float32)
    first = norms.layer_norm(x, g, b, stats=True, config=SMALL)
    again = norms.layer_norm(x, g, b, stats=True, config=SMALL)
    for one, two in zip(first, again):
        np.testing.assert_array_equal(one, two)
    grads = [norms.layer_norm_grad(x, x, g, b, *first[1:], config=SMALL) for _ in range(2)]
    for one, two in zip(*grads):
        np.testing.assert_array_equal(one, two)


X, G = np.zeros((3, 8), np.float32), np.ones(8, np.float32)


@pytest.mark.parametrize("call, error, match", [
    (lambda: norms.layer_norm(X, G, G, axis=2), ValueError, "axis: expected 0"),
    (lambda: norms.layer_norm(X[0], G, G), ValueError, "x: expected a 2-D array"),
    (lambda: norms.layer_norm(X, G[:4], G), ValueError, r"g: expected shape \(8,\)"),
    (lambda: norms.layer_norm(X, G, G, axis=0), ValueError, r"g: expected shape \(3,\)"),
    (lambda: norms.layer_norm(X, G, G.astype(np.float64)), TypeError, "dtype mismatch: g float32, b float64"),
    (lambda: norms.layer_norm(X.astype(np.int32), G, G), TypeError, "x: expected dtype in"),
    (lambda: norms.layer_norm(X, G, G, epsilon="small"), TypeError, "epsilon: expected a number"),
    (lambda: norms.layer_norm(X, G, G, epsilon=-1), ValueError, "epsilon: expected a number >= 0"),
    (lambda: norms.layer_norm(np.zeros((3, 0), np.float32), G[:0], G[:0]), ValueError, "at least one feature"),
    (lambda: norms.layer_norm_grad(X[:2], X, G, G, np.zeros(3, np.float32), np.ones(3, np.float32)),
     ValueError, "dy: expected x's shape"),
    (lambda: norms.layer_norm_grad(X, X, G, G, np.zeros(3, np.float64), np.ones(3, np.float32)),
     ValueError, r"mean: expected \(3,\) float32"),
    (lambda: norms.layer_norm(X, G, G, config=NormsConfig(row_blocks=33)), ValueError, "row_blocks: expected 0 to 32"),
    (lambda: norms.layer_norm(X, G, G, config=NormsConfig(grad_row_blocks=-1)), ValueError,
     "grad_row_blocks: expected 0 to 32"),
    (lambda: norms.layer_norm(X, G, G, config=NormsConfig(grad_finish_warps=0)), ValueError,
     "grad_finish_warps: expected 1 to 32"),
    (lambda: norms.layer_norm(X.T, G[:3], G[:3], axis=0, config=NormsConfig(column_unroll=9)), ValueError,
     "column_unroll: expected 1 to 8"),
    (lambda: norms.layer_norm(X.T, G[:3], G[:3], axis=0, config=NormsConfig(column_blocks=33)), ValueError,
     "column_blocks: expected 0 to 32"),
    (lambda: norms.layer_norm(X.T, G[:3], G[:3], axis=0, config=NormsConfig(column_strip_row_bytes=24)), ValueError,
     "column_strip_row_bytes: expected a power of two from 16 to 1024"),
    (lambda: norms.layer_norm(X.T, G[:3], G[:3], axis=0, config=NormsConfig(column_strip_max_bytes=-1)), ValueError,
     "column_strip_max_bytes: expected 0 to 232448"),
    (lambda: norms.layer_norm(X.T, G[:3], G[:3], axis=0, config=NormsConfig(column_strip_grad_columns=12)),
     ValueError, "column_strip_grad_columns: expected a power of two from 1 to 128"),
])
def test_bad_input_is_refused_before_any_launch(call, error, match):
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("axis", [1, 0])
def test_arrays_off_a_4_element_boundary_take_the_scalar_path(axis):
    """Rows a view one element into its buffer: the kernels read a value at a time, same results."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal(1 + 8 * 12).astype(np.float32)[1:].reshape(8, 12)
    g, b = rng.standard_normal(13).astype(np.float32)[1:], rng.standard_normal(13).astype(np.float32)[1:]
    if axis == 0:
        g, b = g[:8], b[:8]
    y, mean, rstd = norms.layer_norm(x, g, b, axis=axis, stats=True, config=SMALL)
    want = reference.layer_norm(x, g, b, axis)
    np.testing.assert_allclose(y, want[0], rtol=1e-4, atol=1e-4)
    dx, dg, db = norms.layer_norm_grad(x, x, g, b, mean, rstd, axis=axis, config=SMALL)
    for got, w in zip((dx, dg, db), reference.layer_norm_grad(x, x, g, b, axis)):
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("C", [70, 72])
def test_rows_held_in_registers_and_streamed_agree(C):
    """Axis 1 holds a row's values in registers up to ``row_groups`` groups a thread, and streams
    longer rows (three reads): both sum in the same order, so the forward's outputs agree bit for
    bit. The backward's kernels are compiled under their own register cap, where ptxas may fuse a
    different multiply and add into an FMA: its outputs agree within a few roundings of their terms.
    (C = 72 takes vector loads: threads whose groups all lie in the row read them without bounds'
    branches, the others with them.)"""
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((3, C)).astype(np.float32), rng.standard_normal((3, C)).astype(np.float32)
    g, b = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    results = []
    for groups in (8, 0):
        cfg = dataclasses.replace(SMALL, row_groups=groups)
        y, mean, rstd = norms.layer_norm(x, g, b, relu=True, stats=True, config=cfg)
        results.append((y, mean, rstd, *norms.layer_norm_grad(dy, x, g, b, mean, rstd, relu=True, config=cfg)))
    for i, (held, streamed) in enumerate(zip(*results)):
        if i < 3:
            np.testing.assert_array_equal(held, streamed)
        else:  # (dx, dg, db: terms of order 1 to 10, a row of C)
            np.testing.assert_allclose(held, streamed, rtol=0, atol=C * 10 * np.finfo(np.float32).eps)


def test_rows_sharing_a_thread_block_agree_bitwise():
    """Axis 1 with ``row_block``: several rows a thread block (one warp a row: shuffles alone; two
    warps a row: the block's barriers), the last block's rows past N storing nothing. Each row
    sums in the same order as alone in its block, so the results agree bit for bit."""
    rng = np.random.default_rng(4)
    for C, threads in ((70, 32), (260, 64)):  # (260: 65 groups of 4, two warps a row)
        x, dy = rng.standard_normal((5, C)).astype(np.float32), rng.standard_normal((5, C)).astype(np.float32)
        g, b = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
        results = []
        for block in (0, 2 * threads):
            cfg = dataclasses.replace(SMALL, row_threads=threads, row_block=block)
            y, mean, rstd = norms.layer_norm(x, g, b, stats=True, config=cfg)
            results.append((y, mean, rstd, *norms.layer_norm_grad(dy, x, g, b, mean, rstd, config=cfg)))
        for alone, shared in zip(*results):
            np.testing.assert_array_equal(alone, shared)


@pytest.mark.parametrize("warps", [1, 2, 3, 8])
def test_parameter_gradients_over_many_row_chunks(warps):
    """Axis 1's dg and db: row chunks of ``grad_rows`` summed two rows at a time (and a
    remainder), the chunks' sums by ``grad_finish_warps`` warps, each every W-th chunk two at a
    time (and a remainder; a warp with none where W exceeds the chunks), then in warp order;
    against the twin, and 40 features (a second thread block's 8)."""
    rng = np.random.default_rng(5)
    N, C = 23, 40  # (chunks of 5 rows: 4 chunks and one of 3)
    x, dy = rng.standard_normal((N, C)).astype(np.float32), rng.standard_normal((N, C)).astype(np.float32)
    g, b = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    cfg = dataclasses.replace(SMALL, grad_rows=5, grad_finish_warps=warps)
    for relu in (False, True):
        _, mean, rstd = norms.layer_norm(x, g, b, relu=relu, stats=True, config=cfg)
        _, dg, db = norms.layer_norm_grad(dy, x, g, b, mean, rstd, relu=relu, config=cfg)
        _, want_dg, want_db = reference.layer_norm_grad(dy, x, g, b, 1, relu=relu)
        _close(dg, want_dg, "float32", np.abs(dy).sum(0) * 4, "dg")
        _close(db, want_db, "float32", np.abs(dy).sum(0), "db")


@pytest.mark.parametrize("unroll", [1, 3])
def test_axis_0_rows_in_flight_match_the_twin(unroll):
    """Axis 0's column kernels load ``column_unroll`` rows a warp before using any: chunks of 5
    features over 2 warps, so an iteration's later rows fall past the chunk's end (and the last
    chunk's, of 2 features, past C), and their loads re-read its last row and add nothing; with
    the ReLU, forward and backward, against the twin."""
    rng = np.random.default_rng(6)
    C, N = 12, 9  # (N = 9: the last lane's group partly past the columns' end)
    x, dy = rng.standard_normal((C, N)).astype(np.float32), rng.standard_normal((C, N)).astype(np.float32)
    g, b = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    cfg = dataclasses.replace(SMALL, column_warps=2, column_rows=5, column_unroll=unroll)
    for relu in (False, True):
        y, mean, rstd = norms.layer_norm(x, g, b, axis=0, relu=relu, stats=True, config=cfg)
        want, want_mean, want_rstd = reference.layer_norm(x, g, b, 0, relu=relu)
        _close(y, want, "float32", np.abs(g)[:, None] * 4 + np.abs(b)[:, None], "y")
        _close(mean, want_mean, "float32", np.abs(x).max(0) * C, "mean")
        dx, dg, db = norms.layer_norm_grad(dy, x, g, b, mean, rstd, axis=0, relu=relu, config=cfg)
        want_dx, want_dg, want_db = reference.layer_norm_grad(dy, x, g, b, 0, relu=relu)
        scale = (np.abs(dy) * np.abs(g)[:, None]).max(0) * rstd * C
        _close(dx, want_dx, "float32", np.broadcast_to(scale, (C, N)), "dx")
        _close(dg, want_dg, "float32", np.abs(dy).sum(1) * 4, "dg")
        _close(db, want_db, "float32", np.abs(dy).sum(1), "db")


def test_axis_0_apply_in_reverse_gives_the_same_bits():
    """``column_reverse``: axis 0's apply kernels take their thread blocks last first (three
    column blocks by three feature chunks here); each output and each column block's dg and db
    terms is one block's alone, so y, dx, dg and db keep their bits."""
    rng = np.random.default_rng(8)
    C, N = 7, 300  # (N = 300: three blocks of 128 columns, the last partial)
    x, dy = rng.standard_normal((C, N)).astype(np.float32), rng.standard_normal((C, N)).astype(np.float32)
    g, b = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    results = []
    for reverse in (False, True):
        cfg = dataclasses.replace(SMALL, column_rows=3, column_reverse=reverse)
        y, mean, rstd = norms.layer_norm(x, g, b, axis=0, relu=True, stats=True, config=cfg)
        results.append((y, *norms.layer_norm_grad(dy, x, g, b, mean, rstd, axis=0, relu=True, config=cfg)))
    for one, two in zip(*results):
        np.testing.assert_array_equal(one, two)


@pytest.mark.parametrize("dtype, N, taken", [("float16", 40, True), ("bfloat16", 40, True), ("float32", 44, True),
                                             ("float64", 42, True), ("float16", 44, False)])
@pytest.mark.parametrize("relu", [False, True])
def test_axis_0_in_one_pass_over_strips_of_columns(monkeypatch, dtype, N, taken, relu):
    """``column_strip_bytes``: axis 0 from one read of x (of x and dy backward), a thread block a
    strip of columns held in shared memory (7 features; 512 bytes of each array: strips of 32 16-bit
    columns, 16 fp32 or 8 fp64 ones, the last strip partial), against the twin and the column
    kernels; rows that are not whole 16-byte copies (fp16, N = 44) take the column kernels."""
    from sparseblocks.norms import strips
    made = []
    plain = strips.make_strip_forward
    monkeypatch.setattr(strips, "make_strip_forward", lambda *args: made.append(args) or plain(*args))
    backward = []
    plain_backward = strips.make_strip_backward
    monkeypatch.setattr(strips, "make_strip_backward", lambda *args: backward.append(args) or plain_backward(*args))
    rng = np.random.default_rng(12)
    C = 7
    x = (rng.standard_normal((C, N)) * 3 + 5).astype(numpy_dtype(dtype))
    g, b = rng.standard_normal(C).astype(np.float32), rng.standard_normal(C).astype(np.float32)
    cfg = dataclasses.replace(SMALL, column_strip_bytes=512, column_strip_max_bytes=0, column_strip_grad_columns=1)
    y, mean, rstd = norms.layer_norm(x, g, b, axis=0, relu=relu, stats=True, config=cfg)
    assert bool(made) == taken
    columns = norms.layer_norm(x, g, b, axis=0, relu=relu, stats=True, config=SMALL)
    want, want_mean, want_rstd = reference.layer_norm(x, g, b, 0, relu=relu)
    x64 = np.asarray(x, np.float64)
    size = np.abs(x64).max(axis=0)
    drift = C * size * want_rstd
    acc = "float64" if dtype == "float64" else "float32"
    _close(np.asarray(y, np.float64).T, np.asarray(want, np.float64).T, dtype,
           drift[:, None] * np.abs(g) + np.abs(b), "y")
    _close(mean, want_mean, acc, C * size, "mean")
    _close(rstd, want_rstd, acc, drift * want_rstd, "rstd")
    for got, other, name in zip((y, mean, rstd), columns, ("y", "mean", "rstd")):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(other, np.float64), rtol=1e-2, atol=1e-2,
                                   err_msg=name)
    # the backward: dx, and dg and db from each strip's sums, added in order by the finish
    made.clear()
    dy = rng.standard_normal((C, N)).astype(numpy_dtype(dtype))
    dx, dg, db = norms.layer_norm_grad(dy, x, g, b, mean, rstd, axis=0, relu=relu, config=cfg)
    assert bool(backward) == taken
    want_dx, want_dg, want_db = reference.layer_norm_grad(dy, x, g, b, 0, relu=relu)
    dy64 = np.abs(np.asarray(dy, np.float64))
    scale = (dy64 * np.abs(g)[:, None]).max(axis=0) * want_rstd * C * (1 + drift)
    _close(np.asarray(dx, np.float64).T, np.asarray(want_dx, np.float64).T, dtype, scale[:, None] * 4, "dx")
    _close(dg, want_dg, "float32", dy64.sum(1) * (4 + drift.max()), "dg")
    _close(db, want_db, "float32", dy64.sum(1), "db")
    apart = norms.layer_norm_grad(dy, x, g, b, mean, rstd, axis=0, relu=relu, config=SMALL)
    for got, other, name in zip((dx, dg, db), apart, ("dx", "dg", "db")):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(other, np.float64), rtol=2e-2, atol=2e-2,
                                   err_msg=name)


@pytest.mark.parametrize("storage, C, held, want", [
    ("float16", 512, 1, 32), ("float16", 1024, 1, 16), ("float16", 1024, 2, 16), ("bfloat16", 512, 2, 32),
    ("float16", 2048, 1, 16), ("bfloat16", 2048, 2, 16), ("float16", 4096, 1, 0), ("float16", 4096, 2, 0),
    ("float32", 1024, 1, 8), ("float32", 2048, 1, 8), ("float32", 2048, 2, 0), ("float32", 1024, 2, 16),
    ("float64", 1024, 1, 4), ("float64", 1024, 2, 0), ("float16", 16, 1, 128)])
def test_the_default_strips_take_small_feature_counts_only(storage, C, held, want):
    """The default strips: rows of 32 bytes at least (backward: 16 columns at least), widened up
    to 128 columns while an array's strip fits 32 KB, or the narrowest where it fits 64 KB only;
    none past that (the column kernels ran faster there on the H200: strips of 16-byte rows, 8
    columns backward, or of 128 KB, 0.53-0.87x), and none where the arrays held overflow the
    device's shared memory."""
    from sparseblocks.norms import strips
    cfg = NormsConfig()
    assert strips.strip_columns(cfg, C, storage, 227 * 1024, held) == want
    assert strips.strip_columns(cfg, 1024, "float16", 40 * 1024, 2) == 0  # (2 x 32 KB and the static arrays)
    assert strips.strip_columns(dataclasses.replace(cfg, column_strip_bytes=0), 16, storage, 227 * 1024) == 0
    wide = dataclasses.replace(cfg, column_strip_max_bytes=0)  # (widest within 32 KB only)
    assert strips.strip_columns(wide, 2048, "float16", 227 * 1024) == 0
    assert strips.strip_columns(wide, 1024, "float16", 227 * 1024) == 16
