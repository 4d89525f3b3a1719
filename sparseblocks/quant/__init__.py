"""Learned low-bit quantization (LQ-Nets) and bit-plane products on 1-bit tensor cores.

    from sparseblocks import quant
    a = quant.quantize(x, basis=[0.3, 0.6], signed=False)        # activations, 2 bits, one basis
    w = quant.quantize(weight, basis=w_basis, signed=True)        # weights (O, C), a basis (O, K)
    y = quant.matmul(a, w, bias=b, relu=True)                     # (N, O) = â · ŵᵀ + b, ReLU
    img = quant.quantize_image(x4, basis=[0.3, 0.6])             # images (N, C, H, W), 0/1 codes
    f = quant.quantize_filters(filters, basis=f_basis)           # filters (O, C, R, S), ±1 codes
    y = quant.conv2d(img, f, stride=1, padding=1)                # (N, P, Q, O), channels last

Files: `api` (validate, launch, `QuantArray`), `conv` (the same for images and convolutions,
`QuantImage`), `config` (the knobs), `pack` (quantize-and-pack by warp ballot, and unpack),
`simple` (the teaching kernels: SIMT popc) and `tensorcore` (b1 ``mma.sync`` and.popc, products
and implicit-GEMM convolutions). The NumPy twin is `sparseblocks.reference.quant`.
"""

from .api import OUT_DTYPES, VERSIONS, QuantArray, dequantize, levels, matmul, packed_words, quantize
from .config import DEFAULT, QuantConfig
from .conv import QuantImage, conv2d, output_shape, quantize_filters, quantize_image

__all__ = ["QuantArray", "quantize", "dequantize", "matmul", "levels", "packed_words", "QuantConfig", "DEFAULT",
           "VERSIONS", "OUT_DTYPES", "QuantImage", "quantize_image", "quantize_filters", "conv2d", "output_shape"]
