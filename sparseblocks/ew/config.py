"""The element-wise ops' knobs: one frozen `EwConfig`, passed as ``config=``."""

from ..runtime.tuning import config_checker, tuning


@tuning
class EwConfig:
    threads: int = 256  # threads a thread block; each strides over the elements (grid-stride loops)
    waves: int = 16  # at most this many thread blocks a multiprocessor: past it, threads loop instead
    # groups of 4 columns a thread an iteration of the fp16/bf16 LSTM gates (2: two a grid's stride
    # apart, 16 bytes of each array in flight)
    lstm_quads16: int = 1

    def check(self):
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads: expected a multiple of 32 from 32 to 1024, got {self.threads}")
        if not 1 <= self.waves <= 1024:
            raise ValueError(f"waves: expected 1 to 1024, got {self.waves}")
        if self.lstm_quads16 not in (1, 2):
            raise ValueError(f"lstm_quads16: expected 1 or 2, got {self.lstm_quads16}")


DEFAULT = EwConfig()
as_config = config_checker(EwConfig)
