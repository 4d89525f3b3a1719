"""The normalizations' knobs: one frozen `NormsConfig`, passed as ``config=``."""

from ..runtime.tuning import config_checker, tuning


@tuning
class NormsConfig:
    row_threads: int = 256  # feature axis 1 (N, C): most threads a row; a row is one thread block
    row_groups: int = 8  # feature axis 1: most groups of 4 values a thread holds in registers (longer rows stream)
    row_block: int = 0  # feature axis 1: threads a thread block, rows sharing it where a row takes fewer (0: a row)
    # feature axis 1: thread blocks a multiprocessor its kernels are compiled for (launch bounds: the
    # registers capped at what that leaves a thread, 42 at 6 of 256 threads; 0: no cap)
    row_blocks: int = 6
    grad_row_blocks: int = 6  # ... the same for axis 1's backward row kernel (dx), which holds more a value
    column_warps: int = 8  # feature axis 0 (C, N): warps a thread block, each 128 columns of x, a row at a time
    column_rows: int = 128  # feature axis 0: rows of x (features) a thread block sums or normalizes
    column_unroll: int = 1  # feature axis 0: rows a warp loads (of each array) before the first is used
    column_blocks: int = 4  # feature axis 0: thread blocks a multiprocessor its sums and apply are bound to (0: none)
    column_reverse: bool = True  # feature axis 0: the apply kernels take the sums' thread blocks last first (L2)
    # feature axis 0: one pass over strips of columns held in shared memory: the widest strip of every
    # feature within this many bytes of each array it holds (x; x and dy) (0: off) ...
    column_strip_bytes: int = 32768
    column_strip_row_bytes: int = 32  # ... of at least this many bytes of each row (narrower: the column kernels) ...
    column_strip_max_bytes: int = 65536  # ... or, where none fits, the narrowest strip within this many bytes ...
    column_strip_grad_columns: int = 16  # ... and in the backward, at least this many columns
    grad_rows: int = 32  # axis 1's dg and db: rows a thread block sums for each feature, before the ordered sum
    grad_finish_warps: int = 8  # dg and db's ordered sum of the row chunks: warps sharing 32 features' chunks

    def check(self):
        if self.row_threads % 32 or not 32 <= self.row_threads <= 1024:
            raise ValueError(f"row_threads: expected a multiple of 32 from 32 to 1024, got {self.row_threads}")
        if self.row_block % 32 or not 0 <= self.row_block <= 1024:
            raise ValueError(f"row_block: expected 0 or a multiple of 32 up to 1024, got {self.row_block}")
        if not 0 <= self.row_blocks <= 32:
            raise ValueError(f"row_blocks: expected 0 to 32 thread blocks a multiprocessor, got {self.row_blocks}")
        if not 0 <= self.grad_row_blocks <= 32:
            raise ValueError(f"grad_row_blocks: expected 0 to 32 thread blocks a multiprocessor, "
                             f"got {self.grad_row_blocks}")
        if not 0 <= self.row_groups <= 16:
            raise ValueError(f"row_groups: expected 0 to 16, got {self.row_groups}")
        if not 1 <= self.column_warps <= 32:
            raise ValueError(f"column_warps: expected 1 to 32, got {self.column_warps}")
        if not 1 <= self.column_rows <= 65536:
            raise ValueError(f"column_rows: expected 1 to 65536, got {self.column_rows}")
        if not 0 <= self.column_blocks <= 32:
            raise ValueError(f"column_blocks: expected 0 to 32 thread blocks a multiprocessor, "
                             f"got {self.column_blocks}")
        if not 0 <= self.column_strip_bytes <= 227 * 1024:
            raise ValueError(f"column_strip_bytes: expected 0 to 232448 bytes of shared memory, "
                             f"got {self.column_strip_bytes}")
        if not 0 <= self.column_strip_max_bytes <= 227 * 1024:
            raise ValueError(f"column_strip_max_bytes: expected 0 to 232448 bytes of shared memory, "
                             f"got {self.column_strip_max_bytes}")
        grad_columns = self.column_strip_grad_columns
        if not 1 <= grad_columns <= 128 or grad_columns & (grad_columns - 1):
            raise ValueError(f"column_strip_grad_columns: expected a power of two from 1 to 128 columns, "
                             f"got {grad_columns}")
        row_bytes = self.column_strip_row_bytes
        if not 16 <= row_bytes <= 1024 or row_bytes & (row_bytes - 1):
            raise ValueError(f"column_strip_row_bytes: expected a power of two from 16 to 1024 bytes, "
                             f"got {self.column_strip_row_bytes}")
        if not 1 <= self.column_unroll <= 8:
            raise ValueError(f"column_unroll: expected 1 to 8 rows in flight, got {self.column_unroll}")
        if not 1 <= self.grad_finish_warps <= 32:
            raise ValueError(f"grad_finish_warps: expected 1 to 32, got {self.grad_finish_warps}")
        if not 1 <= self.grad_rows <= 4096:
            raise ValueError(f"grad_rows: expected 1 to 4096, got {self.grad_rows}")


DEFAULT = NormsConfig()
as_config = config_checker(NormsConfig)
