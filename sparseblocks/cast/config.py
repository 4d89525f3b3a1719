"""The cast's knobs: one frozen `CastConfig`, passed as ``config=``."""

from ..runtime.tuning import config_checker, tuning


@tuning
class CastConfig:
    threads: int = 256  # threads a thread block; each strides over the elements (grid-stride loop)
    waves: int = 16  # at most this many thread blocks a multiprocessor

    def check(self):
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads: expected a multiple of 32 from 32 to 1024, got {self.threads}")
        if not 1 <= self.waves <= 1024:
            raise ValueError(f"waves: expected 1 to 1024, got {self.waves}")


DEFAULT = CastConfig()
as_config = config_checker(CastConfig)
