"""Timestamps for instrumenting kernels: ``globaltimer()`` and ``smid()``.

``globaltimer()`` reads ``%globaltimer``, a nanosecond clock common to every
multiprocessor (so thread blocks' timelines can be laid side by side, which
``clock64`` cannot: each SM counts its own cycles); ``smid()`` reads
``%smid``, the multiprocessor a thread block runs on. Both are for developers'
timelines (reduce_mask's `PASS_TRACE`), never for results.

In the CUDA simulator ``globaltimer()`` is the host's ``perf_counter_ns`` and
``smid()`` is 0.
"""

from ..runtime.backend import SIMULATOR

if SIMULATOR:
    import time

    import numpy as np

    def globaltimer():
        return np.uint64(time.perf_counter_ns())

    def smid():
        return np.uint32(0)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def _special_register(name, bits):
        # side_effect: two reads must stay two reads, in program order
        @intrinsic
        def read(typingctx):
            def codegen(context, builder, sig, args):
                asm = ir.InlineAsm(ir.FunctionType(ir.IntType(bits), []), f"mov.u{bits} $0, %{name};",
                                   "=l" if bits == 64 else "=r", side_effect=True)
                return builder.call(asm, [])

            return (types.uint64 if bits == 64 else types.uint32)(), codegen

        return read

    globaltimer = _special_register("globaltimer", 64)
    smid = _special_register("smid", 32)
