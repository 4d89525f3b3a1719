"""`float_cast` for torch: ``torch.ops.sparseblocks.float_cast``, differentiable (the gradient is
the output gradient cast back to ``dx_dtype``, x's dtype by default, to nearest even).

On a GPU it runs the kernel (`sparseblocks.cast`); on CPU tensors the same encoding, on fp32's
bits with torch's integer operations, and the same Philox words (drawn on the host), so both give
the same bits.
"""

import torch

from .. import cast as kernels
from ..cast.formats import FORMATS, FP8, max_bits, nan_bits
from . import cpu

MAX_SEED = 2 ** 63  # (a custom op's int is a signed 64-bit one)


def _encode(v, dst, stochastic, saturate, seed, offset):
    """The target's bits (int64) of fp32 values ``v``, as `cast.kernels.make_encode` makes them."""
    E, M, BIAS, kind = FORMATS[dst]
    u = v.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign = torch.where(((u >> 31) & 1) == 1, 1 << (E + M), 0)
    magnitude = u & 0x7FFFFFFF
    exp32, man32 = magnitude >> 23, magnitude & 0x7FFFFF
    full = torch.where(exp32 == 0, man32, man32 | 0x800000)
    field = torch.where(exp32 == 0, -126, exp32 - 127) + BIAS
    normal = (field >= 1) & (exp32 != 0)
    shift = torch.clamp(torch.where(normal, 23 - M, 23 - M + 1 - field), max=40)
    one = torch.ones_like(shift)
    m = full >> shift
    rest = full - (m << shift)
    if stochastic:
        from ..philox import words_host

        n = v.numel()
        words = torch.from_numpy(words_host(torch.arange(n).numpy(), seed, offset)[0].astype("int64")).reshape(v.shape)
        draw = (words & ((one << torch.clamp(shift, max=32)) - 1)) * (one << torch.clamp(shift - 32, min=0))
        m = m + (rest + draw >= (one << shift)).to(torch.int64)
    else:
        half = one << (shift - 1)
        m = m + ((rest > half) | ((rest == half) & ((m & 1) == 1))).to(torch.int64)
    carry = normal & (m == (1 << (M + 1)))
    m = torch.where(carry, m >> 1, m)
    field = torch.where(carry, field + 1, field)
    bits_exp = torch.where(normal, field, torch.where(m == (1 << M), 1, 0))
    bits_man = torch.where(normal, m - (1 << M), torch.where(m == (1 << M), 0, m))
    top = (1 << E) - 1
    if kind == "fn":
        over = (bits_exp > top) | ((bits_exp == top) & (bits_man == (1 << M) - 1))
        over_bits = nan_bits(dst)
    else:
        over = bits_exp >= top
        over_bits = top << M
    over_bits = max_bits(dst) if saturate else over_bits
    bits = torch.where(over | (magnitude == 0x7F800000), sign | over_bits, sign | (bits_exp << M) | bits_man)
    return torch.where(magnitude > 0x7F800000, sign | nan_bits(dst), bits)


def _cpu_cast(x, dtype, stochastic, saturate, seed, offset):
    v = x.float()
    if dtype == "float32":
        return v.clone() if v is x else v
    bits = _encode(v, dtype, stochastic, saturate, seed, offset)
    if dtype in FP8:
        return bits.to(torch.uint8).view(getattr(torch, dtype))
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(getattr(torch, dtype))


def _check(x, dtype, seed, offset):
    if dtype not in kernels.DTYPES:
        raise ValueError(f"dtype: expected one of {kernels.DTYPES}, got {dtype!r}")
    source = str(x.dtype).replace("torch.", "")
    if source not in kernels.DTYPES:
        raise TypeError(f"x: expected dtype in {list(kernels.DTYPES)}, got {source}")
    for name, value in (("seed", seed), ("offset", offset)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < MAX_SEED:
            raise ValueError(f"{name}: expected an int from 0 to 2**63 - 1 (torch's op), got {value!r}")


@torch.library.custom_op("sparseblocks::float_cast", mutates_args=())
def float_cast_op(x: torch.Tensor, dtype: str, stochastic: bool, saturate: bool, seed: int,
                  offset: int) -> torch.Tensor:
    _check(x, dtype, seed, offset)
    if cpu.takes(x):
        return _cpu_cast(x, dtype, stochastic, saturate, seed, offset)
    return kernels.float_cast(x, dtype, stochastic, saturate, seed, offset)


@float_cast_op.register_fake
def _(x, dtype, stochastic, saturate, seed, offset):
    return x.new_empty(x.shape, dtype=getattr(torch, dtype))


def _setup(ctx, inputs, output):
    ctx.dx_dtype = str(inputs[0].dtype).replace("torch.", "")


def _backward(ctx, dy):
    return float_cast_op(dy.contiguous(), ctx.dx_dtype, False, False, 0, 0), None, None, None, None, None


float_cast_op.register_autograd(_backward, setup_context=_setup)


class _WithGradDtype(torch.autograd.Function):
    """The cast, its gradient cast to a dtype of its own (OpenAI's ``dx_dtype``)."""

    @staticmethod
    def forward(ctx, x, dtype, stochastic, saturate, seed, offset, dx_dtype):
        ctx.dx_dtype = dx_dtype
        return float_cast_op(x, dtype, stochastic, saturate, seed, offset)

    @staticmethod
    def backward(ctx, dy):
        return float_cast_op(dy.contiguous(), ctx.dx_dtype, False, False, 0, 0), None, None, None, None, None, None


def float_cast(x, dtype, dx_dtype=None, stochastic=False, saturate=False, seed=0, offset=0):
    """OpenAI's ``float_cast`` on a torch tensor: x in ``dtype`` ("float32", "float16", "bfloat16",
    "float8_e4m3fn", "float8_e5m2"; see `sparseblocks.cast.float_cast`), with the gradient cast to
    ``dx_dtype`` (x's dtype by default) to nearest even."""
    x = x.contiguous()
    _check(x, dtype, seed, offset)  # (before the op: its ints are signed 64-bit)
    if dx_dtype is None or dx_dtype == str(x.dtype).replace("torch.", ""):
        return float_cast_op(x, dtype, bool(stochastic), bool(saturate), int(seed), int(offset))
    if dx_dtype not in kernels.DTYPES:
        raise ValueError(f"dx_dtype: expected one of {kernels.DTYPES}, got {dx_dtype!r}")
    return _WithGradDtype.apply(x, dtype, bool(stochastic), bool(saturate), int(seed), int(offset), dx_dtype)
