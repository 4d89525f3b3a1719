"""Learned low-bit quantization (LQ-Nets) and bit-plane products on 1-bit tensor cores.

    from sparseblocks import quant
    a = quant.quantize(x, basis=[0.3, 0.6], signed=False)        # activations, 2 bits, one basis
    w = quant.quantize(weight, basis=w_basis, signed=True)        # weights (O, C), a basis (O, K)
    y = quant.matmul(a, w, bias=b, relu=True)                     # (N, O) = â · ŵᵀ + b, ReLU

Files: `api` (validate, launch, `QuantArray`), `config` (the knobs), `pack` (quantize-and-pack
by warp ballot, and unpack), `simple` (the teaching product: SIMT popc) and `tensorcore` (b1
``mma.sync`` and.popc). The NumPy twin is `sparseblocks.reference.quant`.
"""

from .api import OUT_DTYPES, VERSIONS, QuantArray, dequantize, levels, matmul, packed_words, quantize
from .config import DEFAULT, QuantConfig

__all__ = ["QuantArray", "quantize", "dequantize", "matmul", "levels", "packed_words", "QuantConfig", "DEFAULT",
           "VERSIONS", "OUT_DTYPES"]
