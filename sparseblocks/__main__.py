"""``python -m sparseblocks demo | info``."""

import argparse
import sys

from ._probe import use_simulator_without_gpu


def info():
    from ._backend import backend_name, versions

    print(f"backend: {backend_name()}")
    for package, version in versions().items():
        print(f"{package}: {version or 'not installed'}")
    return 0


def demo():
    """Block-sparse matmul (all three products) on a random layout, checked against NumPy."""
    import numpy as np

    from ._backend import SIMULATOR, backend_name
    from .kernels import bsmm
    from .layout import BlockLayout
    from .reference import bsmm as reference

    # The simulator runs one Python thread per CUDA thread: keep it tiny there.
    grid, block_size, n_rows = ((4, 3), 8, 12) if SIMULATOR else ((32, 32), 32, 1024)
    layout = BlockLayout.random(grid, density=0.4, seed=0, block_size=block_size)
    rng = np.random.default_rng(0)
    C, K = layout.dense_shape
    x = rng.standard_normal((n_rows, C)).astype(np.float32)
    dy = rng.standard_normal((n_rows, K)).astype(np.float32)
    w = rng.standard_normal(layout.w_shape).astype(np.float32)

    print(f"backend: {backend_name()}")
    print(f"layout: {layout}; x {x.shape}, w {w.shape}, float32")
    products = [
        ("forward      y = x·W  ", bsmm.forward(x, w, layout), reference.forward(x, w, layout)),
        ("input_grad  dx = dy·Wᵀ", bsmm.input_grad(dy, w, layout), reference.input_grad(dy, w, layout)),
        ("weight_grad dW = xᵀ·dy", bsmm.weight_grad(x, dy, layout), reference.weight_grad(x, dy, layout)),
    ]
    failed = False
    for name, got, want in products:
        error = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
        ok = error < 1e-5
        failed |= not ok
        print(f"{name}  shape {str(got.shape):>14}  relative error {error:.2e}  {'ok' if ok else 'FAILED'}")
    print("demo failed: kernel and reference disagree" if failed else "demo passed: kernels match the NumPy reference")
    return 1 if failed else 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m sparseblocks", description=__doc__)
    parser.add_argument("command", choices=["demo", "info"])
    args = parser.parse_args(argv)
    if use_simulator_without_gpu():
        print("no CUDA GPU in use: kernels run in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    return demo() if args.command == "demo" else info()


if __name__ == "__main__":
    sys.exit(main())
