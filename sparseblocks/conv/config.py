"""The convolution's knobs: one frozen `ConvConfig`, passed as ``config=``."""

from ..runtime.tuning import config_checker, tuning


@tuning
class ConvConfig:
    threads: int = 128  # threads a thread block of the direct (teaching) kernels, a thread an output value
    # The three products of fp16 and bf16 layers of aligned channel groups on the tensor cores
    # (`tensorcore.py`); False: the direct kernels for every call
    tensor_cores: bool = True
    # On the tensor cores, the implicit GEMM over a shared input patch (`implicit.py`) where the
    # patch fits; False: the gathering kernels (`tensorcore.py`) for every call
    implicit: bool = True
    # fp32 products of the layers the implicit GEMM takes (input gradients of stride 1), on the tensor
    # cores in 3xTF32 (three tf32 products a step: about fp32's accuracy); False: the direct kernels
    fp32_tensor_cores: bool = True
    # Taps a pass of fp32's implicit filter gradient at G = 32 (1-9; 9: a 3 x 3 filter in one pass over
    # the patch, at 255 registers with some of the patch copies' places spilled; 5: in two passes)
    fp32_filter_taps: int = 9
    # Bytes of a position's channels in a forward (and input-gradient) stage of the implicit GEMM:
    # 32 (16 fp16 channels, 8 fp32) or 64 (twice: half the stages and barriers, a larger ring) where
    # the channel groups are whole slices of it and the ring fits; else 32
    stage_bytes: int = 32
    # On sm_90, fp16 and bf16 forwards and stride-1 input gradients of stride 1 on wgmma (`hopper.py`:
    # the patch in wgmma's no-swizzle layout, a tap a descriptor) where their ring fits
    hopper: bool = True
    hopper_groups: int = 2  # ... warpgroups a tile of 8 output rows, each 8 columns (1 or 2)
    # ... a group's filter blocks kept in shared memory over many tiles: "auto" where they fit and let
    # as many thread blocks share a multiprocessor as the ring without them (`hopper.keep_pays`),
    # "always" wherever they fit, "never"
    hopper_keep: str = "auto"
    # ... the ring's stages (2-4; fewer where a layer's output groups hold fewer blocks, `hopper.forward_stages`)
    hopper_stages: int = 3
    # ... thread blocks a multiprocessor its registers are capped for, or as many as their rings
    # let share a multiprocessor's shared memory where fewer (`hopper.forward_blocks`; 0: no cap; 2-8)
    hopper_blocks: int = 3
    # ... 8 x 8 tiles a warpgroup stacks down the output rows (1 or 2): a stage's copies and filter
    # block serve twice the positions, at twice the accumulators
    hopper_rows: int = 1
    # On sm_90, fp16 and bf16 filter gradients of stride 1 on wgmma (`hopper.make_filter_grad`: 64 / G
    # blocks of an output group as wgmma's m, a tap a descriptor into their patch) where their ring fits
    hopper_filter_grad: bool = True
    hopper_filter_taps: int = 0  # ... taps a warpgroup (1-12; 0: half the taps, up to 96 accumulators a thread)
    hopper_filter_overlap: bool = True  # ... a stage's wgmmas waited for after the next's are issued (4 stages)
    # ... units of 64 / G blocks of one input group, their dy A (m: output channels), read into registers
    # once a k16 step for every tap, the patch B: a tap's wgmma reads G x 16 values of shared memory, not (64 + G) x 16
    hopper_filter_dy_a: bool = True

    def check(self):
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"threads: expected a multiple of 32 from 32 to 1024, got {self.threads}")
        if self.hopper_keep not in ("auto", "always", "never"):
            raise ValueError(f"hopper_keep: expected 'auto', 'always' or 'never', got {self.hopper_keep!r}")
        if self.hopper_groups not in (1, 2):
            raise ValueError(f"hopper_groups: expected 1 or 2, got {self.hopper_groups}")
        if not 1 <= self.fp32_filter_taps <= 9:
            raise ValueError(f"fp32_filter_taps: expected 1 to 9 taps a pass, got {self.fp32_filter_taps}")
        if not 2 <= self.hopper_stages <= 4:
            raise ValueError(f"hopper_stages: expected 2 to 4, got {self.hopper_stages}")
        if self.hopper_rows not in (1, 2):
            raise ValueError(f"hopper_rows: expected 1 or 2 tiles a warpgroup, got {self.hopper_rows}")
        if self.hopper_blocks != 0 and not 2 <= self.hopper_blocks <= 8:
            raise ValueError(f"hopper_blocks: expected 0 (no cap) or 2 to 8 thread blocks, got {self.hopper_blocks}")
        if not 0 <= self.hopper_filter_taps <= 12:
            raise ValueError(f"hopper_filter_taps: expected 0 to 12 taps a warpgroup, got {self.hopper_filter_taps}")
        if self.stage_bytes not in (32, 64):
            raise ValueError(f"stage_bytes: expected 32 or 64, got {self.stage_bytes}")


DEFAULT = ConvConfig()
as_config = config_checker(ConvConfig)
