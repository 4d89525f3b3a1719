"""Attention's knobs: one frozen `AttentionConfig`, passed as ``config=``."""

from ..runtime.tuning import config_checker, default_field, tuning


@tuning
class AttentionConfig:
    # The fused kernels (`fused.py`: fp16 and bf16, head_dim a multiple of 16 up to 128, blocks a
    # multiple of 64); False: the three kernels (`simple.py`) for every call
    fused: bool = True
    stages: int = 2  # key/value tiles in the fused forward's ring (stages - 1 in flight ahead)
    # query rows a warp of the fused forward takes (16 or 32: two m16 tiles, each fragment of k and
    # v read from shared memory feeding twice the products), where the block size is a multiple of
    # four times it (`fused.forward_rows`)
    warp_rows: int = 32
    forward_keys: int = 32  # keys of a stage the forward scores at a time (32 or 64; 32: fewer registers)
    backward_stages: int = 2  # the same, for the fused backward's query (or key) tiles
    # The kernels on Hopper's wgmma (`hopper.py`) on sm_90, where they fit (head_dim 64 or 128):
    # the backward's (1.70x the mma.sync ones, causal at 16384), the forward's (1.46x), warpgroups
    # of 64 queries (keys) a thread block (1 where the block size takes no more), the backward's
    # ring, and the forward's (3 or 4: it keeps a tile while it reads the next)
    hopper: bool = True
    hopper_forward: bool = True
    hopper_groups: int = 2
    hopper_stages: int = 2
    hopper_forward_stages: int = 3
    # keys a tile of the wgmma forward, by head_dim (64 or 128; 128 where the blocks take it), or
    # one int for every head_dim: causal 16384, 128 keys are 1.08x 64 at head_dim 128 and 0.91x at 64
    hopper_forward_keys: dict | int = default_field({64: 64, 128: 128})

    def check(self):
        if self.forward_keys not in (32, 64):
            raise ValueError(f"forward_keys: expected 32 or 64, got {self.forward_keys}")
        if self.warp_rows not in (16, 32):
            raise ValueError(f"warp_rows: expected 16 or 32, got {self.warp_rows}")
        if self.hopper_groups not in (1, 2):
            raise ValueError(f"hopper_groups: expected 1 or 2, got {self.hopper_groups}")
        table = self.hopper_forward_keys
        if not isinstance(table, (dict, int)) or isinstance(table, bool):
            raise TypeError(f"hopper_forward_keys: expected {{head_dim: keys}} or an int, got {table!r}")
        for D, keys in (table.items() if isinstance(table, dict) else [("*", table)]):
            if keys not in (64, 128):
                raise ValueError(f"hopper_forward_keys[{D}]: expected 64 or 128, got {keys!r}")
        if self.hopper_forward_stages not in (3, 4):
            raise ValueError(f"hopper_forward_stages: expected 3 or 4, got {self.hopper_forward_stages}")
        for name in ("stages", "backward_stages", "hopper_stages"):
            if not 2 <= getattr(self, name) <= 4:
                raise ValueError(f"{name}: expected 2 to 4, got {getattr(self, name)}")

    def wgmma_keys(self, head_dim):
        """The wgmma forward's keys a tile at ``head_dim`` (64 where the table names none)."""
        table = self.hopper_forward_keys
        return table if isinstance(table, int) else table.get(head_dim, 64)


DEFAULT = AttentionConfig()
as_config = config_checker(AttentionConfig)
