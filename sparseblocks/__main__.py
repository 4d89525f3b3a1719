"""``python -m sparseblocks demo | quant-demo | matmul-demo | sbnet-demo | show-layout | info | test``."""

import argparse
import sys

from .runtime.probe import use_simulator_without_gpu


def info():
    from .runtime.backend import backend_name, versions

    print(f"backend: {backend_name()}")
    for package, version in versions().items():
        print(f"{package}: {version or 'not installed'}")
    return 0


def demo():
    """A block-sparse MLP trained on scikit-learn's digits beside the same MLP dense."""
    try:
        import torch  # noqa: F401
    except ImportError:
        print("demo needs torch and scikit-learn: pip install 'sparseblocks[demo]'")
        return 1
    from .torch.demo import main

    return main()


def quant_demo():
    """An MLP on scikit-learn's digits in float, W2A2 and W1A1 (`LQLinear`)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        print("quant-demo needs torch and scikit-learn: pip install 'sparseblocks[demo]'")
        return 1
    from .torch.quant_demo import main

    return main()


def matmul_demo():
    """Block-sparse matmul (all three products) on a random layout, checked against NumPy."""
    import numpy as np

    from . import bsmm
    from .layout import BlockLayout
    from .reference import bsmm as reference
    from .runtime.backend import SIMULATOR, backend_name

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
    print("matmul-demo failed: kernel and reference disagree" if failed
          else "matmul-demo passed: kernels match the NumPy reference")
    return 1 if failed else 0


def sbnet_demo():
    """SBNet's sparse ResNet block on the edges of a real photograph, checked against the dense block."""
    try:
        import numpy as np
        import torch
        from skimage import data, filters
    except ImportError as error:
        print(f"sbnet-demo needs torch and scikit-image ({error.name} is missing): "
              "pip install 'sparseblocks[torch,demo]'")
        return 1
    import time

    from .reference import sbnet as reference
    from .runtime.backend import SIMULATOR, backend_name
    from .torch import SparseResBlock

    # The camera man photograph ships with scikit-image; its edges are where "something happens".
    image = data.camera().astype(np.float32) / 255
    channels, block_size, step = (8, 10, 16) if SIMULATOR else (64, 16, 1)  # the simulator is slow: shrink
    image = image[::step, ::step]
    mask = (filters.sobel(image) > 0.15).astype(np.float32)[None]
    device = "cpu" if SIMULATOR else "cuda"
    torch.manual_seed(0)
    block = SparseResBlock(channels, channels // 4, block_size).to(device).eval()
    x = torch.randn(1, channels, *image.shape, device=device).to(memory_format=torch.channels_last)
    indices, count = block.active_blocks(torch.as_tensor(mask, device=device))
    n_active = int(count[0])
    total = block.geometry(x.shape).bcount
    print(f"backend: {backend_name()}")
    print(f"image {image.shape}, {channels} channels, windows of {block_size}: "
          f"{n_active} of {total[0] * total[1]} active ({100 * n_active / (total[0] * total[1]):.0f} %)")
    # TF32 convolutions would differ from each other by ~1e-3 on the sparse and dense paths.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False

    def timed(fn):
        fn()  # warm-up: compilation and cuDNN's algorithm search stay out of the time
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return result, time.perf_counter() - start

    with torch.no_grad():
        y, sparse_s = timed(lambda: block(x, indices, count))
        dense, dense_s = timed(lambda: block.dense(x))
    # The pixels the block writes: its active windows' output windows, from the NumPy reference
    # (not from where y differs from x, which would take the block's word for it).
    p = block.geometry(x.shape)
    windows = indices[:n_active].cpu().numpy()
    ones = np.ones((n_active, *p.bsize_out, 1), np.float32)
    region = reference.sparse_scatter(ones, windows, np.zeros((1, *image.shape, 1), np.float32),
                                      p.bsize_out, p.bsize_out, 0)[0, :, :, 0] > 0
    region = torch.as_tensor(region, device=device).expand_as(y[0])[None]
    error = (y - dense)[region].abs().max().item() if region.any() else 0.0
    untouched = torch.equal(y[~region], x[~region])
    covered = bool(region[0, 0][torch.as_tensor(mask[0] > 0, device=device)].all())  # every edge pixel
    ok = error < 1e-4 and untouched and covered
    print(f"sparse block: {sparse_s * 1e3:.2f} ms, dense block: {dense_s * 1e3:.2f} ms (one warm call each); "
          f"max difference from the dense block on the active "
          f"region {error:.1e}; input kept elsewhere: {untouched}; every edge pixel computed: {covered}")
    if device == "cuda":
        sbnet_timings(torch, SparseResBlock)
    print("sbnet-demo passed" if ok else "sbnet-demo failed")
    return 0 if ok else 1


def sbnet_timings(torch, SparseResBlock, fractions=(0.05, 0.1), shape=(1, 256, 400, 700), device="cuda",
                  dtype_name="float16"):
    """Where the sparse block pays (a GPU): SBNet's 1 x 256 x 400 x 700 block (bottleneck 64, windows
    of 16) with 5 and 10 % of its windows active, its CUDA graphs replayed (``graphs=True``) in
    place, against the dense block (cuDNN), fp16, channels-last; CUDA events, medians of 20 calls."""
    import numpy as np

    from .torch.demo import step_ms

    torch.manual_seed(0)
    N, C, H, W = shape
    dtype = getattr(torch, dtype_name)
    block = SparseResBlock(C, C // 4, 16, graphs=True).to(device, dtype).to(memory_format=torch.channels_last)
    x = torch.randn(*shape, device=device, dtype=dtype).to(memory_format=torch.channels_last)
    p = block.geometry(x.shape)
    rng = np.random.default_rng(1)
    results = {}
    with torch.no_grad():
        dense = step_ms(lambda: block.dense(x), device, steps=20)
        print(f"the block at {N} x {C} x {H} x {W}, {dtype_name}: dense (cuDNN) {dense:.3f} ms")
        for fraction in fractions:
            chosen = np.argwhere(rng.random(p.bcount) < fraction)  # (a mask pixel at each chosen window's centre)
            mask = np.zeros((N, H, W), np.float32)
            mask[0, p.boffset[0] + chosen[:, 0] * p.bstride[0] + p.bsize[0] // 2,
                 p.boffset[1] + chosen[:, 1] * p.bstride[1] + p.bsize[1] // 2] = 1
            indices, count = block.active_blocks(torch.as_tensor(mask, device=device), tol=0.5)
            work = x.clone()
            sparse = step_ms(lambda: block(work, indices, count, inplace=True), device, steps=20)
            print(f"  {len(chosen) / (p.bcount[0] * p.bcount[1]):.1%} of the windows active: sparse {sparse:.3f} ms, "
                  f"{dense / sparse:.2f}x the dense block")
            results[fraction] = (dense, sparse)
    return results


LAYOUT_SPECS = """layouts: random:CbxKb:density, banded:CbxKb:width, causal:n, strided:n:stride,
fixed:n:stride, global:n:globals:window, or a .npy file of a 0/1 block mask"""


def layout_of_spec(spec, block_size=32):
    """The `BlockLayout` a ``show-layout`` spec names (see LAYOUT_SPECS)."""
    import numpy as np

    from .layout import BlockLayout

    if spec.endswith(".npy"):
        return BlockLayout(np.load(spec), block_size)
    kind, *fields = spec.split(":")
    try:
        if kind in ("random", "banded"):
            shape = tuple(int(v) for v in fields[0].lower().split("x"))
            if kind == "random":
                return BlockLayout.random(shape, float(fields[1]), block_size=block_size)
            return BlockLayout.banded(shape, int(fields[1]), block_size=block_size)
        builders = {"causal": BlockLayout.causal, "strided": BlockLayout.strided, "fixed": BlockLayout.fixed,
                    "global": BlockLayout.global_window}
        if kind in builders:
            return builders[kind](*(int(v) for v in fields), block_size=block_size)
    except (IndexError, ValueError, TypeError) as error:
        raise SystemExit(f"show-layout: bad spec {spec!r} ({error}); {LAYOUT_SPECS}") from None
    raise SystemExit(f"show-layout: unknown layout {kind!r}; {LAYOUT_SPECS}")


def show_layout(args):
    """``show-layout [SPEC] [OUT.png]``: a PNG of a layout's block mask (`BlockLayout.plot`)."""
    if any(a in ("-h", "--help") for a in args):
        print("python -m sparseblocks show-layout [SPEC] [OUT.png]  (default: strided:32:4 layout.png)\n" + LAYOUT_SPECS)
        return 0
    spec = args[0] if args else "strided:32:4"
    out = args[1] if len(args) > 1 else "layout.png"
    layout = layout_of_spec(spec)
    try:
        layout.plot(out, title=f"{spec}: {layout.n_blocks} blocks, {layout.density:.0%}")
    except ImportError as error:
        print(error)
        return 1
    print(f"wrote {out}: {layout}")
    return 0


# A CPU build of torch for machines without a GPU: this release, its CPU build (``+cpu``, which pip
# prefers) from torch's CPU index where that is reachable.
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
CPU_TORCH = "torch==2.13.0"


def _install_cpu_torch():
    import importlib.util
    import subprocess

    if importlib.util.find_spec("torch") is not None:
        return
    print("no GPU and no torch: installing a CPU build of torch for the torch layer's tests")
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--retries", "1", "--timeout", "15",
                           "--extra-index-url", CPU_TORCH_INDEX, CPU_TORCH])


def test(pytest_args):
    """The test suite: in the simulator (no GPU) with a worker per core and a CPU torch."""
    import subprocess

    simulator = use_simulator_without_gpu()
    if simulator:
        _install_cpu_torch()
    args = [sys.executable, "-m", "pytest", *pytest_args]
    if simulator and not any(a == "-n" or a.startswith("-n") for a in pytest_args):
        # the simulator runs on one core's GIL: a worker per core, idle ones taking queued tests
        args += ["-n", "auto", "--dist", "worksteal"]
    return subprocess.call(args)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m sparseblocks", description=__doc__)
    parser.add_argument("command", choices=["demo", "quant-demo", "matmul-demo", "sbnet-demo", "show-layout", "info",
                                            "test"])
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER,
                        help="test: arguments for pytest; show-layout: [SPEC] [OUT.png]")
    args = parser.parse_args(argv)
    if args.command == "test":
        return test(args.pytest_args)
    if args.command == "show-layout":
        return show_layout(args.pytest_args)
    if use_simulator_without_gpu():
        print("no CUDA GPU in use: kernels run in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    return {"demo": demo, "quant-demo": quant_demo, "matmul-demo": matmul_demo, "sbnet-demo": sbnet_demo, "info": info}[args.command]()


if __name__ == "__main__":
    sys.exit(main())
