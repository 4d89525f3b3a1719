"""Vector loads and stores of global memory: ``load2``, ``load4``, ``store2``, ``store4``, ``load4_words``;
``fours_fit(*arrays)``: whether arrays may be moved 4 elements a load.

``load4(array, (i, ..., j))`` returns the tuple ``array[i, ..., j:j + 4]`` read
by one instruction (``ld.global.v4``); ``store4(array, (i, ..., j), values)``
writes the 4-tuple ``values`` there by one (``st.global.v4``). Numba itself only ever emits scalar
global loads: it knows nothing of a device array's alignment, so LLVM may not
merge neighbouring loads. The caller promises that the first element's
address is a multiple of the vector's size (``width * itemsize`` bytes) and
that the elements are contiguous; launchers check the pointers and strides on
the host and compile a scalar variant where they do not hold.

``load4_words(array, (i, ..., j))`` reads the same 4 elements as ``load4`` but returns
their bits as uint32 words (4 * itemsize / 4 of them: two for fp16), so that fp16
values stay in the registers they were loaded into until they are used
(`_half2.floats_of_half2` widens a word's pair).

In the CUDA simulator the same names are plain Python that checks that
promise (an unaligned address raises), so a launcher that picks the vector
path wrongly fails the simulator tests instead of reading garbage on a GPU.
"""

from ..runtime.backend import SIMULATOR
from ..runtime.launch import data_pointer

WIDTHS = (2, 4)


def fours_fit(*arrays):
    """Whether every array (device arrays or tensors) starts at a multiple of 4 elements, so that
    `load4` and `store4` may move their groups of 4 (the flat kernels' vector variants)."""
    return all(aligned(data_pointer(a), a.dtype.itemsize, 4) for a in arrays)


def aligned(pointer, itemsize, width):
    """Whether a vector of ``width`` elements of ``itemsize`` bytes may be read at ``pointer``."""
    return pointer % (itemsize * width) == 0


if SIMULATOR:
    import numpy as np

    def checked_row(array, index, size, what):
        """(the last-axis row of ``array`` at ``index``, its position j), after checking that
        ``size`` bytes from ``array[index]`` are contiguous and aligned to ``size``."""
        *outer, j = index
        row = np.asarray(array)[tuple(outer)] if outer else np.asarray(array)
        if row.strides[-1] != row.itemsize:
            raise ValueError(f"{what}: the last axis is not contiguous")
        j = int(j)  # (a NumPy int32 index would make the address an int32, and overflow)
        address = row.ctypes.data + j * row.itemsize
        if not aligned(address, size, 1):
            raise ValueError(f"{what}: address {address:#x} is not aligned to {size} bytes")
        return row, j

    def _simulated(width):
        def load(array, index):
            row, j = checked_row(array, index, np.asarray(array).itemsize * width, f"vector load of {width}")
            return tuple(row[j + k] for k in range(width))

        return load

    load2, load4 = _simulated(2), _simulated(4)

    def load4_words(array, index):
        row, j = checked_row(array, index, np.asarray(array).itemsize * 4, "vector load of 4")
        return tuple(row[j:j + 4].view(np.uint32))

    def _simulated_store(width):
        def store(array, index, values):
            row, j = checked_row(array, index, np.asarray(array).itemsize * width, f"vector store of {width}")
            for k in range(width):
                row[j + k] = values[k]

        return store

    store2, store4 = _simulated_store(2), _simulated_store(4)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def indexes(array, index):
        """Whether ``index`` types a full integer index tuple of ``array`` (intrinsics' typing)."""
        return (isinstance(array, types.Array) and isinstance(index, types.BaseTuple)
                and len(index) == array.ndim and all(isinstance(t, types.Integer) for t in index))

    def element_pointer(context, builder, array_type, array, index_type, index):
        """LLVM pointer to ``array[index]`` (no negative-index wrap, no bounds check)."""
        view = context.make_array(array_type)(context, builder, value=array)
        indices = [context.cast(builder, value, t, types.intp)
                   for t, value in zip(index_type, cgutils.unpack_tuple(builder, index))]
        return cgutils.get_item_pointer(context, builder, array_type, view, indices, wraparound=False)

    def _compiled(width):
        @intrinsic
        def load(typingctx, array, index):
            if not indexes(array, index):
                return None
            signature = types.UniTuple(array.dtype, width)(array, index)

            def codegen(context, builder, sig, args):
                array_type, index_type = sig.args
                pointer = element_pointer(context, builder, array_type, args[0], index_type, args[1])
                element = context.get_value_type(array_type.dtype)
                vector_type = ir.VectorType(element, width)
                size = context.get_abi_sizeof(element) * width
                vector = builder.load(builder.bitcast(pointer, vector_type.as_pointer()), align=size)
                items = [builder.extract_element(vector, ir.Constant(ir.IntType(32), k)) for k in range(width)]
                return context.make_tuple(builder, sig.return_type, items)

            return signature, codegen

        return load

    load2, load4 = _compiled(2), _compiled(4)

    @intrinsic
    def load4_words(typingctx, array, index):
        if not (indexes(array, index) and array.dtype.bitwidth in (16, 32)):
            return None
        words = array.dtype.bitwidth // 8  # 4 elements of 2 or 4 bytes: 2 or 4 words
        signature = types.UniTuple(types.uint32, words)(array, index)

        def codegen(context, builder, sig, args):
            array_type, index_type = sig.args
            pointer = element_pointer(context, builder, array_type, args[0], index_type, args[1])
            vector_type = ir.VectorType(ir.IntType(32), words)
            vector = builder.load(builder.bitcast(pointer, vector_type.as_pointer()), align=4 * words)
            items = [builder.extract_element(vector, ir.Constant(ir.IntType(32), k)) for k in range(words)]
            return context.make_tuple(builder, sig.return_type, items)

        return signature, codegen

    def _compiled_store(width):
        @intrinsic
        def store(typingctx, array, index, values):
            if not (indexes(array, index) and isinstance(values, types.BaseTuple) and len(values) == width):
                return None
            signature = types.none(array, index, values)

            def codegen(context, builder, sig, args):
                array_type, index_type, values_type = sig.args
                pointer = element_pointer(context, builder, array_type, args[0], index_type, args[1])
                element = context.get_value_type(array_type.dtype)
                vector_type = ir.VectorType(element, width)
                vector = ir.Constant(vector_type, ir.Undefined)
                items = cgutils.unpack_tuple(builder, args[2])
                for k, (item, item_type) in enumerate(zip(items, values_type)):
                    value = context.cast(builder, item, item_type, array_type.dtype)
                    vector = builder.insert_element(vector, value, ir.Constant(ir.IntType(32), k))
                size = context.get_abi_sizeof(element) * width
                builder.store(vector, builder.bitcast(pointer, vector_type.as_pointer()), align=size)
                return context.get_dummy_value()

            return signature, codegen

        return store

    store2, store4 = _compiled_store(2), _compiled_store(4)
