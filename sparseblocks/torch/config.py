"""`SparseResBlock`'s knobs: one frozen `ResBlockConfig`, passed as ``config=``.

Which fused kernels a call without gradients takes, and where an NCHW stack's
output comes out NHWC. Timings behind the defaults: docs/performance.md.
"""

from ..runtime.tuning import config_checker, default_field, tuning


@tuning
class ResBlockConfig:
    nchw_input_nhwc_out: bool = True  # an fp16 NCHW input's stack writes its output NHWC (one product over all pixels)
    nchw_input_nhwc_out_fused: bool = True  # ... any NCHW input's, where the fused product and scatter add it
    fused_gather: bool = True  # calls without gradients gather straight into the first 1x1 product and its ReLU
    fused_gather_min_pixels: int = 32768  # ... from this many stack pixels (fewer leave multiprocessors idle)
    fused_gather_max_out: int = 64  # ... for at most this many output channels (wider: cuBLAS's product wins)
    fused_gather_layouts: frozenset = frozenset(  # ... for these (image layout, transpose)
        {("NHWC", False), ("NCHW", False), ("NCHW", True), ("NHWC", True)})
    fused_scatter: bool = True  # in-place calls without gradients add the last 1x1 product straight into the image
    fused_scatter_nchw: bool = True  # ... into an NCHW image too
    fused_scatter_max_in: int = 64  # ... for at most this many input channels
    fused_scatter_min_pixels: dict = default_field({("NHWC", "float16"): 49152})  # ... from this many pixels (others: any)
    fused_when_host_bound: bool = True  # eager calls, bound by the host's time, take the fused kernels at any size


DEFAULT = ResBlockConfig()
as_config = config_checker(ResBlockConfig)
