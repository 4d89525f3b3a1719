"""Custom precision (OpenAI blocksparse's ``float_cast``): `float_cast(x, dtype)` between fp32,
fp16, bf16 and OCP's fp8 formats (E4M3FN, E5M2), rounding to nearest even or stochastically,
saturating on request; its NumPy twin is `sparseblocks.reference.cast` (ml_dtypes, bit for bit).

Files: ``formats.py`` (the formats), ``kernels.py`` (decode and encode), ``api.py``, ``config.py``.
"""

from .api import DTYPES, float_cast
from .config import DEFAULT, CastConfig

__all__ = ["float_cast", "CastConfig", "DEFAULT", "DTYPES"]
