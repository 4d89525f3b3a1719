"""The normalizations' knobs: one frozen `NormsConfig`, passed as ``config=``."""

from ..runtime.tuning import config_checker, tuning


@tuning
class NormsConfig:
    row_threads: int = 256  # feature axis 1 (N, C): threads a row; a row is one thread block
    column_threads: int = 128  # feature axis 0 (C, N): threads a thread block, a thread a column of C features
    grad_rows: int = 64  # axis 1's dg and db: rows a thread block sums for each feature, before the ordered sum

    def check(self):
        for name in ("row_threads", "column_threads"):
            value = getattr(self, name)
            if value % 32 or not 32 <= value <= 1024:
                raise ValueError(f"{name}: expected a multiple of 32 from 32 to 1024, got {value}")
        if not 1 <= self.grad_rows <= 4096:
            raise ValueError(f"grad_rows: expected 1 to 4096, got {self.grad_rows}")


DEFAULT = NormsConfig()
as_config = config_checker(NormsConfig)
