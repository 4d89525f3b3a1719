"""Inline-PTX intrinsics for Numba kernels, each with a NumPy twin for the CUDA simulator.

`mma` (tensor-core ``mma.sync`` in f16, bf16, tf32, 3xTF32 and b1 and.popc), `cp_async` (global to shared
copies), `vector` (8- and 16-byte loads and stores), `half2` (paired fp16 adds, fp16 atomics),
`relaxed` (``ld.relaxed.gpu``), `nanmax` (``max.NaN.f32``), `fp8` (``cvt`` to fp8 pairs), `clock`
(``%globaltimer``, ``%smid``).
With `runtime`, the only compiler-specific code in the library.
"""
