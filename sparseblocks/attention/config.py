"""Attention's knobs: one frozen `AttentionConfig`, passed as ``config=``."""

from ..runtime.tuning import config_checker, tuning


@tuning
class AttentionConfig:
    # The fused kernels (`fused.py`: fp16 and bf16, head_dim a multiple of 16 up to 128, blocks a
    # multiple of 64); False: the three kernels (`simple.py`) for every call
    fused: bool = True
    stages: int = 2  # key/value tiles in the fused forward's ring (stages - 1 in flight ahead)
    backward_stages: int = 2  # the same, for the fused backward's query (or key) tiles

    def check(self):
        for name in ("stages", "backward_stages"):
            if not 2 <= getattr(self, name) <= 4:
                raise ValueError(f"{name}: expected 2 to 4, got {getattr(self, name)}")


DEFAULT = AttentionConfig()
as_config = config_checker(AttentionConfig)
