"""`float_cast`: validation, the fp8 views, the launch."""

from typing import Optional

import numpy as np

from ..philox import check_word
from ..ptx.vector import fours_fit
from ..runtime.arrays import Array, Operand, _dtype_name, launch_stream
from ..runtime.compile import cached
from ..runtime.devices import on_arrays_device
from ..runtime.launch import launch, multiprocessors
from .config import CastConfig, as_config
from .formats import FORMATS, FP8, numpy_dtype
from .kernels import make_cast, make_fast_cast

DTYPES = tuple(FORMATS)


def _bits(x, name):
    """``x`` as the kernel reads it: fp8 as its uint8 bytes, fp16 as int16 bits (bf16's Operand
    makes them), fp32 as it is."""
    if name not in FP8 and name != "float16":
        return x
    if type(x).__module__.split(".")[0] == "torch":
        import torch

        return x.view(torch.uint8 if name in FP8 else torch.int16)
    return x.view(np.uint8 if name in FP8 else np.int16)


def _written(out, dtype):
    """The output as the kernel writes it: fp16 as int16 bits (bf16's already are)."""
    if dtype != "float16":
        return out
    if type(out).__module__.split(".")[0] == "torch":
        import torch

        return out.view(torch.int16)
    return out.view(np.int16)


@on_arrays_device
def float_cast(x: Array, dtype: str, stochastic: bool = False, saturate: bool = False, seed: int = 0, offset: int = 0,
               config: Optional[CastConfig] = None) -> Array:
    """``x`` converted to ``dtype``: "float32", "float16", "bfloat16", "float8_e4m3fn" or
    "float8_e5m2", from any of those (OpenAI's custom precision, with OCP's fp8 formats).

    Rounds to nearest even, or with ``stochastic`` up with probability (what is dropped) / (a unit
    of the last place), from Philox bits of (element, ``offset``) under ``seed``: deterministic for a
    seed and offset. Past the largest finite value the result is inf (NaN for E4M3FN, which has no
    inf), or with ``saturate`` that largest value; NaN stays NaN. NumPy fp8 arrays are ml_dtypes',
    torch's are ``torch.float8_*``. Returns an array of ``dtype`` in x's kind."""
    cfg = as_config(config)
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {DTYPES}, got {dtype!r}")
    check_word("seed", seed)
    check_word("offset", offset)
    src = _dtype_name(x) if hasattr(x, "dtype") else None
    if src not in DTYPES:
        raise TypeError(f"x: expected dtype in {list(DTYPES)}, got {src}")
    x_op = Operand(_bits(x, src), "x")
    x_op.require_contiguous()
    stream = launch_stream((x_op,))
    store = "uint8" if dtype in FP8 else dtype
    native, out = x_op.empty(x_op.shape, stream, dtype=store)
    n = int(np.prod(x_op.shape))
    if n:
        flat_out, flat_x = _written(out, dtype).reshape(-1), x_op.device(stream).reshape(-1)
        if stochastic and dtype != "float32":
            kernel = cached(make_cast, src, dtype, True, bool(saturate))
        else:
            vector = fours_fit(flat_out, flat_x)
            kernel = cached(make_fast_cast, src, dtype, bool(saturate), vector, cfg.groups if vector else 1)
        grid = max(1, min(-(-n // cfg.threads), cfg.waves * multiprocessors()))
        seed, offset = int(seed), int(offset)
        launch(kernel, grid, cfg.threads, stream, (flat_out, flat_x, seed & 0xFFFFFFFF, seed >> 32, offset))
    result = x_op.result(native, out, stream)
    if dtype == "bfloat16" and x_op.kind == "numpy" and result.dtype == np.int16:
        return result.view(numpy_dtype(dtype))
    if dtype == "bfloat16" and x_op.kind == "torch" and str(result.dtype) == "torch.int16":  # (the simulator's copy)
        import torch

        return result.view(torch.bfloat16)
    if dtype in FP8:
        if x_op.kind == "torch":
            import torch

            return result.view(getattr(torch, dtype))
        if x_op.kind == "numpy":
            return result.view(numpy_dtype(dtype))
    return result
