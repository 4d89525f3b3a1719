"""Normalizations (OpenAI blocksparse's ``layer_norm``), each a kernel beside its NumPy twin
(`sparseblocks.reference.norms`).

* `layer_norm(x, g, b, axis=1, epsilon=1e-6, relu=False)`: over the features of (N, C) rows
  (``axis`` 1) or of (C, N) columns (``axis`` 0), the two activation layouts of `bsmm`; with
  ``stats=True`` also the mean and rstd that `layer_norm_grad` takes.
* `layer_norm_grad(dy, x, g, b, mean, rstd, axis=1, relu=False)`: (dx, dg, db).
* `batch_norm(x, g, b, epsilon)`, `batch_norm_inference(x, g, b, mean, var, epsilon)` and
  `batch_norm_grad(dy, x, g, mean, var, epsilon)`, for NCHW.

Files: ``layer.py`` and ``batch.py`` (the kernels), ``api.py``, ``config.py``. The torch op, with autograd, is
`sparseblocks.torch.layer_norm`.
"""

from .api import DTYPES, batch_norm, batch_norm_grad, batch_norm_inference, layer_norm, layer_norm_grad
from .config import DEFAULT, NormsConfig

__all__ = ["layer_norm", "layer_norm_grad", "batch_norm", "batch_norm_inference", "batch_norm_grad", "NormsConfig", "DEFAULT", "DTYPES"]
