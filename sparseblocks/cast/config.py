"""The cast's knobs: one frozen `CastConfig`, passed as ``config=``."""

from ..runtime.tuning import config_checker, tuning


@tuning
class CastConfig:
    threads: int = 256  # threads a thread block; each strides over the elements (grid-stride loop)
    waves: int = 16  # at most this many thread blocks a multiprocessor
    # groups of 4 values a thread an iteration of the rounding-to-nearest vector path, a grid's
    # stride apart (2: a 16-bit source's 16 bytes in flight, as the element-wise ops' unary path)
    groups: int = 2

    def check(self):
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads: expected a multiple of 32 from 32 to 1024, got {self.threads}")
        if not 1 <= self.waves <= 1024:
            raise ValueError(f"waves: expected 1 to 1024, got {self.waves}")
        if self.groups not in (1, 2):
            raise ValueError(f"groups: expected 1 or 2, got {self.groups}")


DEFAULT = CastConfig()
as_config = config_checker(CastConfig)
