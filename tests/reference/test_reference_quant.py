"""The LQ-Nets twin's own properties: levels, encode, the popcount identities, QEM, the STE."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from sparseblocks.reference import quant


@given(seed=st.integers(0, 2**32 - 1), bits=st.integers(1, 4), signed=st.booleans())
def test_encode_gives_the_nearest_level(seed, bits, signed):
    rng = np.random.default_rng(seed)
    basis = rng.uniform(0.1, 1.0, bits) * 2.0 ** np.arange(bits)
    x = rng.standard_normal(50) * 2
    codes, values = quant.encode(x, basis, signed)
    lv, _ = quant.levels(basis, signed)
    np.testing.assert_allclose(np.abs(values - x), np.abs(lv[None, :] - x[:, None]).min(1))
    np.testing.assert_allclose(quant.decode(codes, basis, signed), values)
    assert len(lv) == 2 ** bits


@given(seed=st.integers(0, 2**32 - 1), columns=st.integers(1, 200))
def test_popcount_identities(seed, columns):
    """For ±1 codes a·b = C − 2·popc(a xor b), and popc(a xor b) = pa + pb − 2·popc(a and b);
    `plane_dot` gives every pairing of ±1 and 0/1 codes from popc(a and b), pa and pb."""
    rng = np.random.default_rng(seed)
    bits_a, bits_b = rng.integers(0, 2, (2, 1, columns))
    A, B = quant.pack(bits_a, 1)[0, 0], quant.pack(bits_b, 1)[0, 0]
    P, pa, pb = quant.popcount(A & B).sum(), quant.popcount(A).sum(), quant.popcount(B).sum()
    xor = quant.popcount(A ^ B).sum()
    assert xor == pa + pb - 2 * P
    ea, eb = 2 * bits_a[0] - 1, 2 * bits_b[0] - 1
    assert ea @ eb == columns - 2 * xor
    for signed_a in (False, True):
        for signed_b in (False, True):
            va = ea if signed_a else bits_a[0]
            vb = eb if signed_b else bits_b[0]
            assert va @ vb == quant.plane_dot(P, pa, pb, columns, signed_a, signed_b)


@given(seed=st.integers(0, 2**32 - 1), bits=st.integers(1, 3), signed=st.booleans())
def test_basis_update_is_the_least_squares_fit(seed, bits, signed):
    """QEM: with momentum 0 and no ridge the new basis is lstsq's fit of x by its codes; with the
    moving average it moves a tenth of the way."""
    rng = np.random.default_rng(seed)
    basis = rng.uniform(0.1, 1.0, bits) * 2.0 ** np.arange(bits)
    x = rng.standard_normal(300) * basis.sum() / 2
    codes, _ = quant.encode(x, basis, signed)
    B = (codes[:, None] >> np.arange(bits)) & 1
    B = 2 * B - 1 if signed else B
    if np.linalg.matrix_rank(B) < bits:
        return
    fit = np.linalg.lstsq(B, x, rcond=None)[0]
    np.testing.assert_allclose(quant.basis_update(x, codes, basis, signed, ridge=0.0, momentum=0.0), fit,
                               rtol=1e-9, atol=1e-9)
    blended = quant.basis_update(x, codes, basis, signed, ridge=0.0)
    np.testing.assert_allclose(blended, 0.9 * basis + 0.1 * fit, rtol=1e-9, atol=1e-9)


def test_weights_take_a_basis_a_row_with_a_ridge():
    rng = np.random.default_rng(1)
    basis = quant.initial_basis(2, True, fan_in=64, channels=3)
    assert basis.shape == (3, 2) and (basis[:, 1] == 2 * basis[:, 0]).all()
    w = rng.standard_normal((3, 64)) * np.sqrt(2 / 64)
    codes, _ = quant.encode(w, basis, True)
    new = quant.basis_update(w, codes, basis, True)
    for r in range(3):
        B = 2 * ((codes[r][:, None] >> np.arange(2)) & 1) - 1
        fit = np.linalg.solve(B.T @ B + quant.RIDGE * np.eye(2), B.T @ w[r])
        np.testing.assert_allclose(new[r], 0.9 * basis[r] + 0.1 * fit)


def test_straight_through_gradients():
    basis = quant.initial_basis(2, False)
    top = quant.levels(basis, False)[0][-1]
    x = np.array([-1.0, 0.2, top, top + 0.1])
    np.testing.assert_array_equal(quant.ste_grad(x, np.ones(4), basis, False), [1, 1, 1, 0])
    np.testing.assert_array_equal(quant.ste_grad(x, np.ones(4), basis, True), [1, 1, 1, 1])
