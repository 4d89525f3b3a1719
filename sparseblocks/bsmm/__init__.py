"""Block-sparse weight matmul: ``x · W``, ``dy · Wᵀ`` and ``xᵀ · dy`` over a `BlockLayout`.

    from sparseblocks import bsmm
    y = bsmm.forward(x, w, layout)            # (N, C) -> (N, K)
    dx = bsmm.input_grad(dy, w, layout)        # (N, K) -> (N, C)
    dw = bsmm.weight_grad(x, dy, layout)       # (n_blocks, bs, bs)

Files: `api` (validate, plan, launch), `config` (the knobs), `dispatch` (which
kernel family runs), `simple` (the teaching kernels), `simt` and `tensorcore`
(the fast products), `weight_grad_simt` and `weight_grad_tensorcore`, `block_norms`, `plans`
(kept launches for repeated torch calls), `openai` (`BlocksparseMatMul`).
"""

from .api import (block_norms, forward, identity_init, input_grad, ortho_init, l2_normalize, l2_normalize_grad,
                  transpose_blocks, weight_grad)
from .config import DEFAULT, BsmmConfig
from .dispatch import VERSIONS, default_version, segment_limit, wgrad_splits
from .openai import BlocksparseMatMul

__all__ = ["forward", "input_grad", "weight_grad", "transpose_blocks", "block_norms", "identity_init", "ortho_init",
           "l2_normalize", "l2_normalize_grad", "BsmmConfig", "DEFAULT",
           "BlocksparseMatMul", "VERSIONS", "default_version", "segment_limit", "wgrad_splits"]
