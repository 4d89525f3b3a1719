"""A load that sees other thread blocks' writes: ``load_relaxed(array, (i, ...))``.

Thread blocks that wait on each other (reduce_mask's look-back in `sbnet.py`) must
read a word from L2 every time, never a value an SM cached earlier. Numba offers
atomics for that (``cuda.atomic.add(array, i, 0)``), but an atomic is a
read-modify-write: a thousand thread blocks reading one word that way queue up at
its L2 slice one after another. ``ld.relaxed.gpu`` is a plain load with the memory
model's guarantee (it observes the latest write at GPU scope), and many readers of
one word are served at once. Integer arrays of 4 or 8 bytes.

In the CUDA simulator it is a plain read.
"""

from ..runtime.backend import SIMULATOR

if SIMULATOR:
    import numpy as np

    def load_relaxed(array, index):
        return np.asarray(array)[index]

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from .vector import element_pointer, indexes

    @intrinsic
    def load_relaxed(typingctx, array, index):
        if not (indexes(array, index) and isinstance(array.dtype, types.Integer)
                and array.dtype.bitwidth in (32, 64)):
            return None
        bits = array.dtype.bitwidth

        def codegen(context, builder, sig, args):
            pointer = element_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            address = builder.ptrtoint(pointer, ir.IntType(64))
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(bits), [ir.IntType(64)]),
                               f"ld.relaxed.gpu.global.b{bits} $0, [$1];", f"={'l' if bits == 64 else 'r'},l,~{{memory}}",
                               side_effect=True)
            return builder.call(asm, [address])

        return array.dtype(array, index), codegen
