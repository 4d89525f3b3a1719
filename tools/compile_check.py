"""Compile every SBNet kernel (or, with --bsmm, bsmm's version 4 to 7 kernels; --quant, --attention,
--norms, those ops' kernels) to PTX for sm_90
without a GPU, to catch typing errors early and read ptxas's registers.

The CUDA simulator runs kernels as plain Python and accepts code the real
compiler rejects (a computed shared-array shape, say). This compiles each
kernel variant through NVVM instead. Needs libnvvm and NVRTC (for example
CUDA_HOME=/usr/local/cuda-13.0 and `pip install nvidia-cuda-nvrtc`); it is a
developer's check, not part of the test suite.

    CUDA_HOME=/usr/local/cuda-13.0 python tools/compile_check.py [--bsmm | --quant | --fused [TILE ...]]

With --bsmm it prints, for each version 4 product and weight gradient
(block 16/32/64, fp32/fp16, both feature axes, scalar or vector loads), the
registers and how many global loads are vector loads, and the same for each
version 5 (tensor-core) product, fp32/fp16/bf16, with its mma count, every version 6
(tensor-core tiles) product and weight gradient with its stack frame (local memory), and every
version 7 (Hopper wgmma, compiled for sm_90a) kernel with ptxas's warnings (a serialized wgmma).
"""

import os

# The real compiler, not the simulator (`import sparseblocks` picks the simulator where no GPU is
# present, unless told otherwise).
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

import itertools
from dataclasses import replace
import os
import re
import shutil
import subprocess
import sys
import tempfile

from numba import cuda, types
import numba.cuda.dispatcher  # noqa: F401 (`cuda.dispatcher` below)

from sparseblocks import bsmm, sbnet
from sparseblocks import fused as gather_matmul

B, S = bsmm.DEFAULT, sbnet.DEFAULT  # the configs the kernels are made with
POOL, SCAN, WRITE_SUMMED, WRITE_SCANNED = sbnet.reduce_pool.make_reduce_kernels(S)

i64 = types.int64
CC = (9, 0)


class _Device:  # device functions compiled apart (`runtime.compile.inlined`) ask the current
    compute_capability = CC  # device for its compute capability, and there is none here


cuda.dispatcher.get_current_device = _Device


PTXAS = shutil.which("ptxas") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "ptxas")


def resources(ptx, registers=None, arch=None):
    """ptxas's report (registers, stack frame, spills) where ptxas is installed, else ''
    (`registers`: the kernel's cap, which Numba hands ptxas at link time, not in the PTX)."""
    if not os.path.exists(PTXAS):
        return ""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cap = [] if registers is None else [f"-maxrregcount={registers}"]
        arch = arch or f"sm_{CC[0]}{CC[1]}"
        report = subprocess.run([PTXAS, f"-arch={arch}", "-v", *cap, path, "-o", path + ".cubin"],
                                capture_output=True, text=True).stderr
    for line in report.splitlines():  # errors, and warnings such as a serialized wgmma, or ptxas
        # waiting on wgmmas in flight because their accumulators are touched (C7519)
        if "error" in line or "Performance" in line or "C7519" in line:
            print(line[:200])
    if "Unresolved extern function" in report and "half" in report:
        return "  [calls Numba's fp16 operators, linked at launch: no ptxas report alone]"
    used = re.search(r"Used (\d+) registers", report)
    stack = re.search(r"(\d+) bytes stack frame", report)
    return f"  [{used.group(1) if used else '?'} registers, {stack.group(1) if stack else 0} B stack]"


ONLY = []  # --only: the words a check's name must hold, else it is skipped


def check(name, function, signature, registers=None, detail=lambda ptx: "", cc=CC, launch_bounds=None):
    """Compile ``function`` for ``signature``; ``registers``: the kernel's cap, for ptxas's report;
    ``detail(ptx)``: more to print after it; ``cc``: (9, 0, "a") for sm_90a; ``launch_bounds``: the
    kernel's (version 7's warp-specialized kernels are built with them, for setmaxnreg)."""
    if not all(word in name for word in ONLY):
        return True
    try:
        ptx, _ = cuda.compile_ptx(function, signature, cc=cc, launch_bounds=launch_bounds)
        arch = f"sm_{cc[0]}{cc[1]}{cc[2] if len(cc) > 2 else ''}"
        divisions = len(re.findall(r"\b(?:div|rem)\.[su]64\b", ptx))  # (calls of some 60 instructions each)
        # fp64 arithmetic where Numba promoted (an fp32 value divided by an int, a float literal, a
        # comparison of a signed with an unsigned integer: both converted to fp64 and compared)
        doubles = len(re.findall(r"\b(?:add|sub|mul|fma|div|setp\.\w+)(?:\.rn|\.rnd)?\.f64\b", ptx))
        print(f"ok    {name}{resources(ptx, registers, arch)}{detail(ptx)}"
              + (f"  {divisions} 64-bit divisions" if divisions else "") + (f"  {doubles} fp64 ops" if doubles else ""))
        return True
    except Exception as error:  # report every failure, not just the first
        print(f"FAIL  {name}: {type(error).__name__}: {str(error).splitlines()[0]}")
        return False


def vector_loads(ptx):
    return f"  {ptx.count('ld.global.v')} of {ptx.count('ld.global.')} global loads vector"


def check_v5(bs, storage, vector):
    """Version 5 products of one block size and storage: registers, mma count, vector loads."""
    index = types.int32[::1]
    out = types.int16 if storage == "bfloat16" else getattr(types, storage)
    # The launcher passes int32 word views for vector loads and for fp32, else 16-bit patterns.
    bits = types.int32 if vector or storage == "float32" else types.int16
    acc = bsmm.device.acc_type(storage)
    for transpose_w, feature_axis in itertools.product((False, True), (1, 0)):
        kernel = bsmm.tensorcore.make_product_v5(B, bs, storage, acc, transpose_w, feature_axis, vector)
        signature = (out[:, ::1], types.float32[:, :, ::1], bits[:, ::1], bits[:, :, ::1]) + (index,) * 6 + (i64,)
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=CC)
        print(f"product v5 bs {bs} {storage} {'Wt' if transpose_w else 'W '} axis {feature_axis} "
              f"{'vector' if vector else 'scalar'}{resources(ptx)}  {ptx.count('mma.sync')} mma"
              f"{vector_loads(ptx)}")
    kernel = bsmm.tensorcore.make_transpose_blocks(B, bs, storage, acc)
    signature = (types.int32[:, :, ::1], types.int32[:, :, ::1], index)
    ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=CC)
    print(f"transpose_blocks bs {bs} {storage}{resources(ptx)}")
    dw = types.int16 if storage == "bfloat16" else getattr(types, storage)
    group = B.v5_wgrad_group.get(bs, 1) if bs <= B.v5_warp_tile else 1
    for feature_axis in (1, 0):
        kernel = bsmm.weight_grad_tensorcore.make_weight_grad_v5(B, bs, storage, acc, feature_axis, vector, group)
        signature = (dw[:, :, ::1], types.float32[:, :, ::1], bits[:, ::1], bits[:, ::1],
                     types.int32[:, ::1], index, index, i64, i64, types.float64)
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=CC)
        print(f"weight_grad v5 bs {bs} {storage} axis {feature_axis} {'vector' if vector else 'scalar'} group {group}"
              f"{resources(ptx)}  {ptx.count('mma.sync')} mma{vector_loads(ptx)}")


def bounds(version, bs, weight_grad, cfg=B):
    """The launch bounds version 7 builds a kernel with (`hopper_shapes.jit_for`), else None."""
    if version != 7:
        return None
    shapes = bsmm.hopper_shapes
    return shapes.launch_bounds(cfg, bs, shapes.v7_shape(cfg, bs, weight_grad)[2], weight_grad)


def warp_specialized(cfg, kind):
    """Whether a paired or stacked weight gradient is warp-specialized."""
    return bsmm.hopper_shapes.producing(cfg, kind, 0)


def wgrad_cases(version):
    """(block size, config, the maker's extra args) of each weight gradient ``check_tiles`` builds:
    version 6's at its weight gradients' block sizes; version 7's at 64 and 128, and its stacked tiles at 32 (4 blocks
    on one warpgroup, 8 on two; 4 warp-specialized), and its paired tiles at 64 (on the ring; warp-specialized
    with bulk copies, also built for two thread blocks a multiprocessor, and with cp.async; four blocks a tile on
    the ring and warp-specialized)."""
    if version == 6:
        return [(bs, B, ()) for bs in sorted(B.v6_wgrad_warps)]
    shapes = bsmm.hopper_shapes
    stacked = [(32, replace(B, v7_wgrad_stacks={32: n}, v7_wgrad_groups={32: g}, v7_wgrad_stack_producer=p),
                (shapes.STACKED,)) for n, g, p in ((4, 1, False), (8, 2, False), (4, 1, True))]
    paired = [(64, replace(B, v7_wgrad_pair_producer=p, v7_wgrad_pair_width={64: w}, v7_tma=tma,
                           v7_wgrad_pair_blocks=blocks), (shapes.PAIRED,))
              for p, w, tma, blocks in ((False, 2, True, {}), (True, 2, True, {}), (True, 2, True, {64: 2}),
                                        (True, 2, False, {}), (False, 4, True, {}), (True, 4, True, {}))]
    # (block 128's with the bias gradient's column sums in the copying warpgroup: kind True, column_sums)
    summing = [(128, B, (True, True))]
    return [(bs, B, ()) for bs in shapes.V7_WGRAD_BLOCKS] + stacked + paired + summing


def check_tiles(version):
    """Version 6 (tensor-core tiles, sm_90) or 7 (Hopper wgmma tiles, sm_90a): every product and
    weight gradient, fp16 and bf16, both feature axes, at the config's block sizes: registers,
    stack, the mma (or wgmma) count, and ptxas's warnings (a serialized wgmma)."""
    if version == 6:
        module, blocks, cc, instruction = bsmm.tiles, B.v6_tiles, CC, "mma.sync"
    else:
        module, blocks, cc, instruction = bsmm.hopper, B.v7_groups, (9, 0, "a"), "wgmma.mma_async"
    product = getattr(module, f"make_product_v{version}")
    weight_grad = bsmm.hopper_wgrad.make_weight_grad_v7 if version == 7 else module.make_weight_grad_v6
    storages = getattr(module, f"V{version}_STORAGE")
    count = lambda ptx: f"  {ptx.count(instruction)} {instruction.split('.')[0]}"  # noqa: E731
    maps = (types.uint8[::1],) * 2 if version == 7 else ()  # (the tensor maps of the bulk copies)
    index = types.int32[::1]
    results = []
    for bs, storage in itertools.product(sorted(blocks), storages):
        element = types.int16 if storage == "bfloat16" else types.float16
        # (version 7's forward also with an fp32 bias its epilogue adds, and with the ReLU after it)
        biases = (None, "float32", "relu") if version == 7 else (None,)
        for transpose_w, feature_axis, bias in itertools.product((False, True), (1, 0), biases):
            if transpose_w and bias:
                continue
            epilogue = {None: (), "float32": ("float32",), "relu": ("float32", True)}[bias]
            kernel = product(B, bs, storage, types.float32, transpose_w, feature_axis, *epilogue)
            operands = (element[:, ::1], element[:, :, ::1]) + ((types.float32[::1],) if version == 7 else ())
            signature = (element[:, ::1], types.float32[:, :, ::1]) + operands + (index,) * 6 + (i64,) + maps
            name = (f"product v{version} bs {bs} {storage} {'Wt' if transpose_w else 'W '} axis {feature_axis}"
                    f"{' bias' if bias else ''}{' relu' if bias == 'relu' else ''}")
            results.append(check(name, kernel.py_func, signature, cc=cc, detail=count,
                                 launch_bounds=bounds(version, bs, False)))
    for (bs, cfg, extra), storage in itertools.product(wgrad_cases(version), storages):
        element = types.int16 if storage == "bfloat16" else types.float16
        kind = extra[0] if extra else True
        for feature_axis, out in itertools.product((1, 0), (storage, "float32")):  # (dW in x's dtype or fp32)
            if extra[1:] and feature_axis == 0:
                continue  # (the column sums take feature_axis 1's MN-major dy only)
            kernel = weight_grad(cfg, bs, storage, types.float32, feature_axis, out, *extra)
            dw = types.float32 if out == "float32" else element
            sums = (types.float32[:, ::1], types.int32[::1]) if version == 7 else ()  # (the bias gradient's)
            signature = (dw[:, :, ::1], types.float32[:, :, ::1], element[:, ::1], element[:, ::1],
                         types.int32[:, ::1], i64, i64, types.float64) + sums + maps
            tile = ""
            if extra and extra[0] is not True:
                tile = (f" stacks {cfg.v7_wgrad_stacks[bs]}" if extra[0] == "stacks"
                        else f" pairs of {cfg.v7_wgrad_pair_width[bs]}")
            tile += " column sums" if extra[1:] else ""
            split = extra and extra[0] is not True and warp_specialized(cfg, extra[0])
            stack = tile + (f" split {'bulk' if cfg.v7_tma and extra[0] == 'pairs' else 'cp.async'}" if split else "")
            stack += f" {cfg.v7_wgrad_pair_blocks[bs]} blocks" if split and bs in cfg.v7_wgrad_pair_blocks else ""
            results.append(check(f"weight_grad v{version} bs {bs}{stack} {storage} axis {feature_axis} dW {out}",
                                 kernel.py_func, signature, cc=cc, detail=count,
                                 launch_bounds=bounds(version, bs, kind, cfg)))
    return results


def check_bsmm():
    """ptxas's report for bsmm's version 4, 5, 6 and 7 kernels with the module's current settings."""
    check_tiles(7)
    check_tiles(6)
    index = types.int32[::1]
    for bs, storage, vector in itertools.product(sorted(B.v4_rows), ("float32", "float16"), (False, True)):
        element = getattr(types, storage)
        acc = bsmm.device.acc_type(storage)
        for transpose_w, feature_axis in itertools.product((False, True), (1, 0)):
            kernel = bsmm.simt.make_product_v4(B, bs, storage, acc, transpose_w, feature_axis, vector)
            signature = (element[:, ::1], types.float32[:, :, ::1], element[:, ::1], element[:, :, ::1]) \
                + (index,) * 6 + (i64,)
            ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=CC)
            print(f"product bs {bs} {storage} {'Wt' if transpose_w else 'W '} axis {feature_axis} "
                  f"{'vector' if vector else 'scalar'}{resources(ptx)}{vector_loads(ptx)}")
        for v5_storage in (("float32", "bfloat16") if storage == "float32" else (storage,)):
            check_v5(bs, v5_storage, vector)
        kernel = bsmm.weight_grad_simt.make_weight_grad_v4(B, bs, storage, acc, 1, vector)
        signature = (element[:, :, ::1], types.float32[:, :, ::1], element[:, ::1], element[:, ::1],
                     types.int32[:, ::1], i64, i64, types.float64)
        ptx, _ = cuda.compile_ptx(kernel.py_func, signature, cc=CC)
        print(f"weight_grad bs {bs} {storage} {'vector' if vector else 'scalar'}{resources(ptx)}{vector_loads(ptx)}")
    for vector in (False, True):  # (block 128: fp32's version 5; fp16 and bf16 take the tiles)
        check_v5(128, "float32", vector)
    return 0


def check_gather_matmul(shapes=(gather_matmul.DEFAULT.gather_tile,)):
    """The fused gather and 1x1 product, each storage, with and without ReLU, in the given tile
    shapes (an NCHW image's in its own), and the fused product and scatter: ptxas's registers and
    the mma count."""
    results = []
    for storage, (relu, scatter, nchw), vector_out, shape in itertools.product(
            gather_matmul.kernel.DTYPES, ((False, False, False), (True, False, False), (True, False, True),
                                   (False, True, False), (False, True, True)), (True, False), shapes):
        element = getattr(types, storage)
        if scatter and nchw and vector_out != (storage == "float16"):
            continue  # (an NCHW image's scatter: fp16 staged, fp32 from the fragments)
        out = types.int32 if vector_out and storage == "float16" else element  # (fp16 words)
        gather_nchw = nchw and not scatter
        signature = ((out[::1] if scatter and nchw else out[:, ::1], types.int32[::1] if gather_nchw else element[::1],
                      element[:, ::1], types.int32[:, ::1], types.int32[::1]) + (i64,) * 14)
        if scatter:
            shape = (gather_matmul.DEFAULT.nchw_scatter_tiles if nchw else gather_matmul.DEFAULT.scatter_tiles)[storage]
        elif gather_nchw:
            shape = gather_matmul.DEFAULT.nchw_gather_tile
        kernel = gather_matmul.kernel.make_kernel(storage, relu, vector_out, *shape, scatter=scatter, nchw=nchw)
        name = (f"{'matmul_scatter' if scatter else 'gather_matmul'}{' NCHW' if nchw else ''} {storage} relu={relu} "
                f"vector_out={vector_out} tile {shape}")
        results.append(check(name, kernel.py_func, signature, shape[5],
                             lambda ptx: f"  {ptx.count('mma.sync')} mma, {ptx.count('cp.async.cg')} cp.async"))
    return results


def check_quant():
    """The tensor-core bit-plane products (dense and blocks of 32 and 64, W1A1 to W4A4, fp16 out;
    dense W1A1 through the cp.async ring, and its rows' bit counts), the convolutions (3x3 over 64
    and 256 channels) and quantize-and-pack: ptxas's registers and the mma count."""
    from sparseblocks import quant
    from sparseblocks.quant.pack import make_pack, make_pack_image, make_pack_words
    from sparseblocks.quant.ring import make_ring_product, make_row_counts
    from sparseblocks.quant.tensorcore import block_warps, make_tensorcore_product

    Q = quant.DEFAULT
    planes = types.uint32[:, :, ::1]
    signature = (types.float16[::1], types.uint32[::1], types.uint32[::1], types.float32[::1], types.float32[:, ::1],
                 types.float32[::1], types.int32[::1], types.int32[::1], i64, i64, i64, i64)
    results = []
    for (a_bits, w_bits), signed_a, (block_words, group_cols) in itertools.product(
            ((1, 1), (2, 2), (4, 4)), (False, True), ((128, Q.dense_cols), (1, 32), (2, 64))):
        warps = block_warps(Q, a_bits, 4096, group_cols)
        kernel = make_tensorcore_product(Q, a_bits, w_bits, signed_a, True, False, False, block_words, group_cols,
                                         *warps, True)
        name = f"product W{w_bits}A{a_bits} signed_a={signed_a} block_words {block_words} warps {warps}"
        results.append(check(name, kernel.py_func, signature, detail=lambda ptx: f"  {ptx.count('mma.sync')} mma"))
        if w_bits > 1 and not signed_a:  # every weight plane in one pass (`fused_acc`), where it fits
            fused = replace(Q, fused_acc=128)
            kernel = make_tensorcore_product(fused, a_bits, w_bits, signed_a, True, False, False, block_words,
                                             group_cols, *warps, True)
            results.append(check(f"{name} fused_acc 128", kernel.py_func, signature,
                                 detail=lambda ptx: f"  {ptx.count('mma.sync')} mma"))
    counts = types.int32[::1]
    ring_signature = signature[:6] + (counts, counts, counts, counts, i64, i64, i64, i64)
    for bits, stages, signed_a in itertools.product((1, 2), (2, 3), (False, True)):  # (the cp.async ring)
        warps = block_warps(Q, bits, 4096, Q.dense_cols)
        kernel = make_ring_product(replace(Q, ring_stages=stages), bits, bits, signed_a, True, False, False,
                                   Q.dense_cols, *warps, True)
        results.append(check(f"product W{bits}A{bits} ring of {stages} stages signed_a={signed_a} warps {warps}",
                             kernel.py_func, ring_signature, detail=lambda ptx: f"  {ptx.count('mma.sync')} mma"))
    for bits in (1, 2):  # (a bias and a ReLU in the epilogue: the bias read once a column pair)
        warps = block_warps(Q, bits, 4096, Q.dense_cols)
        kernel = make_ring_product(Q, bits, bits, True, True, True, True, Q.dense_cols, *warps, True)
        results.append(check(f"product W{bits}A{bits} ring with bias and ReLU", kernel.py_func, ring_signature,
                             detail=lambda ptx: f"  {ptx.count('mma.sync')} mma"))
        kernel = make_tensorcore_product(Q, bits, bits, True, True, True, True, 2, 64, *block_warps(Q, bits, 4096, 64),
                                         True)
        results.append(check(f"product W{bits}A{bits} block_words 2 with bias and ReLU", kernel.py_func, signature,
                             detail=lambda ptx: f"  {ptx.count('mma.sync')} mma"))
    list_signature = signature[:6] + (counts, counts, counts, counts, i64, i64, i64, i64)
    for bits, (block_words, group_cols), signed_a in itertools.product((1, 2), ((2, 64), (1, 32)), (False, True)):
        warps = block_warps(Q, bits, 4096, group_cols)  # (the ring over a layout's word lists)
        kernel = make_ring_product(replace(Q, ring_lists=True), bits, bits, signed_a, True, False, False, group_cols,
                                   *warps, True, block_words)
        results.append(check(f"product W{bits}A{bits} ring over lists of {block_words}-word blocks "
                             f"signed_a={signed_a} warps {warps}", kernel.py_func, list_signature,
                             detail=lambda ptx: f"  {ptx.count('mma.sync')} mma"))
    results.append(check("row bit counts", make_row_counts().py_func, (counts, types.uint32[::1], i64, i64)))
    for (a_bits, w_bits), channels in itertools.product(((1, 1), (2, 2)), (64, 256)):
        words = channels // 32
        warps = block_warps(Q, a_bits, 4096, Q.dense_cols)
        kernel = make_tensorcore_product(Q, a_bits, w_bits, False, True, False, False, 9 * words, Q.dense_cols,
                                         *warps, True, (56, 56, 56, 56, 3, 3, 1, 1, 1, 1, 1, 1, words))
        results.append(check(f"conv 3x3 W{w_bits}A{a_bits} over {channels} channels", kernel.py_func, signature,
                             detail=lambda ptx: f"  {ptx.count('mma.sync')} mma"))
    for bits in (1, 2, 4):
        results.append(check(f"pack {bits} bits", make_pack(Q, bits, False).py_func,
                             (planes, types.float16[:, ::1], types.float32[:, ::1], types.int32[:, ::1], i64)))
        for half, x in ((True, types.uint32[:, ::1]), (False, types.float32[:, ::1])):
            results.append(check(f"pack a word a thread {bits} bits {'fp16' if half else 'fp32'}",
                                 make_pack_words(Q, bits, False, half).py_func,
                                 (planes, x, types.float32[:, ::1], types.int32[:, ::1], i64)))
        results.append(check(f"pack images {bits} bits", make_pack_image(Q, bits, False).py_func,
                             (planes, types.float16[::1], types.float32[:, ::1], types.int32[:, ::1], i64, i64, i64,
                              i64, i64)))
    return 0 if all(results) else 1


def check_attention():
    """Attention's fused kernels at head_dim 64 and 128 (mma.sync), and the wgmma kernels (sm_90a),
    each without and with dropout: ptxas's registers and stack."""
    from sparseblocks.attention import DEFAULT as A
    from sparseblocks.attention import fused, hopper

    results = []
    rule = (i64, i64, i64, i64, types.float64)  # dropout's threshold, seed words, offset, 1 / keep
    for storage, D, drop in itertools.product(("float16", "bfloat16"), (64, 128), (False, True)):
        bits = types.int16 if storage == "bfloat16" else types.float16
        index = types.int32[::1]
        forward = (bits[::1], types.float32[::1], bits[::1], bits[::1], bits[::1], index, index, i64, i64, i64,
                   types.float64, types.boolean) + rule
        tag = f"{storage} D {D}{' dropout' if drop else ''}"
        results.append(check(f"attention forward {tag}", fused.make_forward(
            storage, D, A.stages, fused.forward_rows(128, A.warp_rows), A.forward_keys, drop).py_func, forward))
        dq = (bits[::1],) * 5 + (types.float32[::1],) * 2 + (index, index, i64, i64, i64, types.float64,
                                                             types.float64, types.boolean) + rule
        dkdv = (bits[::1],) + dq[:9] + dq[8:]
        results.append(check(f"attention dq {tag}", fused.make_query_grads(storage, D, A.backward_stages, drop).py_func,
                             dq))
        results.append(check(f"attention dk dv {tag}",
                             fused.make_key_grads(storage, D, A.backward_stages, drop).py_func, dkdv))
        for groups in (1, 2):
            for name, maker, signature in (("forward", hopper.make_forward, forward),
                                           ("forward 128 keys", hopper.make_forward, forward),
                                           ("dq", hopper.make_query_grads, dq),
                                           ("dk dv", hopper.make_key_grads, dkdv)):
                stages = A.hopper_forward_stages if name.startswith("forward") else A.hopper_stages
                keys = (128 if "128" in name else 64,) if name.startswith("forward") else ()
                kernel = maker(storage, D, stages, groups, *keys, drop)
                results.append(check(f"attention wgmma {name} {tag} groups {groups}", kernel.py_func,
                                     signature, cc=(9, 0, "a"),
                                     detail=lambda ptx: f"  {ptx.count('wgmma.mma_async')} wgmma"))
    return 0 if all(results) else 1


def check_norms():
    """Layer norm's axis-1 forward and backward (fp16, bf16, fp32, rows of 4096 and 1024, vector
    loads) under the default config's register cap (`norms.layer.row_kernel`), axis 0's column
    kernels and its one-pass strips, and the parameter gradients' partial sums and finish:
    registers, stack."""
    from numba import float32

    from sparseblocks import norms
    from sparseblocks.norms import columns, layer, strips

    results = []
    for storage, C in itertools.product(("float16", "bfloat16", "float32"), (4096, 1024)):
        cfg = norms.DEFAULT
        shape = layer.row_shape(cfg, C)
        T, K, RB = shape
        element = types.int16 if storage == "bfloat16" else getattr(types, storage)
        rows, vec, stats = element[:, ::1], element[::1], float32[::1]
        for name, maker, signature in (
                ("forward", layer.make_forward, (rows, stats, stats, rows, vec, vec, types.float64)),
                ("backward", layer.make_backward, (rows, rows, rows, vec, vec, stats, stats))):
            blocks = layer.row_blocks(cfg, T * RB, float32, grad=name == "backward")
            kernel = maker(cfg, storage, storage, float32, False, True, shape)
            results.append(check(f"layer_norm {name} {storage} C={C} ({T} threads, {K} groups held)",
                                 kernel.py_func, signature, launch_bounds=(T * RB, blocks) if blocks else None))
        if C == 4096:
            work, means = float32[:, :, ::1], float32[:, ::1]
            sums, _, apply = columns.make_forward(cfg, storage, storage, float32, False, True)
            grad_sums, _, grad_apply = columns.make_backward(cfg, storage, storage, float32, False, True)
            for name, kernel, signature in (
                    ("forward sums", sums, (work, rows)),
                    ("forward apply", apply, (rows, rows, vec, vec, stats, stats)),
                    ("backward sums", grad_sums, (work, rows, rows, vec, vec, stats, stats)),
                    ("backward apply", grad_apply, (rows, work, rows, rows, vec, vec, stats, stats, means))):
                blocks = columns.column_blocks(cfg, float32)
                results.append(check(f"layer_norm axis 0 {name} {storage} ({cfg.column_unroll} rows in flight)",
                                     kernel.py_func, signature,
                                     launch_bounds=(32 * cfg.column_warps, blocks) if blocks else None))
        strip_cfg = cfg  # (axis 0 in one pass: a strip of columns; past the default's C, 64 KB strips of 16-byte rows)
        if not strips.strip_columns(cfg, C, storage, 227 * 1024, held=2):
            strip_cfg = replace(cfg, column_strip_bytes=64 * 1024, column_strip_row_bytes=16,
                                column_strip_grad_columns=1)
        S = strips.strip_columns(strip_cfg, C, storage, 227 * 1024)
        strip = strips.make_strip_forward(strip_cfg, storage, storage, float32, False, True, C, S)
        results.append(check(f"layer_norm axis 0 in strips {storage} C={C} ({S} columns)", strip.py_func,
                             (rows, stats, stats, rows, vec, vec, types.float64)))
        S = strips.strip_columns(strip_cfg, C, storage, 227 * 1024, held=2)
        strip = strips.make_strip_backward(strip_cfg, storage, storage, float32, False, True, C, S)
        results.append(check(f"layer_norm axis 0 backward in strips {storage} C={C} ({S} columns)", strip.py_func,
                             (rows, float32[:, :, ::1], rows, rows, vec, vec, stats, stats)))
        if C == 4096:
            partials, finish = layer.make_param_grads(cfg, storage, storage, float32, False, True)
            results.append(check(f"layer_norm dg/db partial sums {storage}", partials.py_func,
                                 (float32[:, :, ::1], rows, rows, vec, vec, stats, stats)))
            results.append(check(f"layer_norm dg/db finish {storage}", finish.py_func, (vec, vec, float32[:, :, ::1])))
    return 0 if all(results) else 1


def check_conv():
    """The convolution's wgmma kernels for sm_90a (fp16 and bf16, channel groups of 16, 32 and 64,
    3x3 taps, 8 x 16 positions a tile, or 16 x 16 with two tiles a warpgroup): the forward (two
    warpgroups) and the filter gradient (also with dy as A from registers,
    `ConvConfig.hopper_filter_dy_a`, channels-last or as the caller's channels-first array)."""
    from sparseblocks.conv import hopper

    index, results = types.int32[::1], []
    for storage, G in itertools.product(("float16", "bfloat16"), (16, 32, 64)):
        value = types.int16 if storage == "bfloat16" else types.float16
        hg = hopper.filter_geometry([1, 56, 56, 1, 56, 56, 1, 3, 3, 1, 1, 1, 0, 1, 1, 1, 1, 1])
        positions = hopper.patch_positions(hg)
        for rows_out, biased, stages, blocks, rows in ((False, True, 3, 0, 1), (False, False, 3, 0, 1),
                                                       (True, False, 3, 0, 1), (False, False, 2, 3, 1),
                                                       (False, True, 3, 0, 2), (False, True, 2, 2, 2)):
            layer = hopper.geometry([1, 56, 56, 1, 56, 56, 1, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2, rows)
            forward = hopper.make_forward(storage, G, 9, hopper.patch_positions(layer) if rows > 1 else positions,
                                          rows_out, 2, 0, biased, stages, blocks, rows)
            name = (f"conv wgmma forward {storage} G={G} 3x3{' channels-last' if rows_out else ''}"
                    + (f" ({stages} stages, {blocks} blocks a multiprocessor)" if blocks else "")
                    + (f" ({rows} tiles a warpgroup)" if rows > 1 else ""))
            results.append(check(name + ("" if biased else " with no bias"), forward.py_func,
                                 (value[::1],) * 3 + (index,) * 4 + (i64,) * 2
                                 + (value[:, ::1], index, types.boolean, i64, i64), cc=(9, 0, "a"),
                                 launch_bounds=(256, blocks) if blocks else None))
        taps = hopper.filter_taps(9, G)
        for TW, overlap, dy_a, first in ((taps, False, False, False), (taps, True, False, False),
                                         (2, False, False, False), (taps, True, True, False), (taps, True, True, True)):
            grad = hopper.make_filter_grad(storage, G, 9, positions, TW, overlap, dy_a, first)
            results.append(check(f"conv wgmma filter gradient {storage} G={G} 3x3 ({TW} taps a warpgroup"
                                 f"{', overlapped' if overlap else ''}{', dy as A' if dy_a else ''}"
                                 f"{', channels-first' if first else ''})", grad.py_func,
                                 (types.float32[::1], value[::1], value[::1], types.int32[:, ::1]) + (index,) * 3
                                 + (i64,) * 5, cc=(9, 0, "a"),
                                 detail=lambda ptx: f"  {ptx.count('wgmma.mma_async')} wgmma"))
    return 0 if all(results) else 1


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bsmm", action="store_true", help="bsmm's version 4 to 7 kernels instead of SBNet's")
    parser.add_argument("--fused", nargs="*", metavar="ROWS,COLS,WORDS,STAGES,WARPS,REGISTERS",
                        help="the fused products' kernels, at these tiles (default: the config's)")
    parser.add_argument("--quant", action="store_true", help="the quantized products and packing instead")
    parser.add_argument("--attention", action="store_true", help="attention's fused and wgmma kernels instead")
    parser.add_argument("--norms", action="store_true", help="layer norm's axis-1 kernels instead")
    parser.add_argument("--conv", action="store_true", help="the convolution's wgmma kernels instead")
    parser.add_argument("--only", nargs="*", default=[], help="only the checks whose names hold all these words")
    args = parser.parse_args()
    ONLY[:] = args.only
    if args.quant:
        return check_quant()
    if args.attention:
        return check_attention()
    if args.norms:
        return check_norms()
    if args.conv:
        return check_conv()
    if args.bsmm:
        return check_bsmm()
    if args.fused is not None:
        shapes = [tuple(None if v == "None" else int(v) for v in s.split(",")) for s in args.fused]
        return 0 if all(check_gather_matmul(shapes or (gather_matmul.DEFAULT.gather_tile,))) else 1
    results = [
        check("pool_kernel", POOL.py_func,
              (types.int8[::1], types.int32[::1], types.float32[:, :, ::1]) + (i64,) * 11
              + (types.float64, types.boolean, i64)),
        check("scan_kernel", SCAN.py_func,
              (types.int32[::1], types.int32[::1], types.int32[::1], i64)),
    ] + [
        check(f"pass_kernel (avgpool={avgpool}, {mask}, vector {vector}, {look_back} look-back, stride {stride}, "
              f"{'max.NaN' if ptx else 'select'} max)",
              sbnet.reduce_pass.make_pass_kernel(S, avgpool, wide, vector, look_back, stride, ptx).py_func,
              (types.int32[:, ::1], types.int32[::1], types.int64[::1], getattr(types, mask)[::1])
              + (i64,) * 11 + (types.float64,) + (i64,) * 7)
        for avgpool, wide, mask, vector, look_back, stride in (
            (False, False, "float32", 1, "warp", 1), (False, False, "boolean", 1, "warp", 1),
            (True, True, "float16", 1, "warp", 1), (False, True, "float64", 1, "warp", 1),
            (False, False, "float32", 4, "warp", 1), (True, True, "float16", 4, "warp", 1),
            (False, False, "uint8", 4, "warp", 1), (True, True, "float32", 4, "warp", 1),
            (False, False, "float32", 2, "warp", 1), (False, False, "float32", 4, "block", 16),
            (True, True, "float16", 1, "block", 16))
        for ptx in ((True, False) if mask == "float32" and not avgpool else (True,))
    ] + [
        check(f"write_kernel ({name})", kernel.py_func,
              (types.int32[:, ::1], types.int32[::1], types.int8[::1], types.int32[::1], types.int32[::1],
               i64, i64, i64))
        for name, kernel in (("summed", WRITE_SUMMED), ("scanned", WRITE_SCANNED))
    ]
    for scatter, transpose, (add, atomic), dtype, channels_last in itertools.product(
            (False, True), (False, True), ((False, False), (True, False), (True, True)),
            ("float16", "float32", "float64"), (True, False)):
        if add and not scatter:
            continue
        element = getattr(types, dtype)
        kernel = sbnet.copy_element.make_copy_kernels(S, scatter, transpose, add, atomic, dtype, channels_last)
        array4 = element[:, :, :, ::1]
        signature = (array4, array4, types.int32[:, ::1], types.int32[::1]) + (i64,) * 6
        name = (f"{'scatter' if scatter else 'gather'} {'NHWC' if channels_last else 'NCHW'} "
                f"transpose={transpose} add={add} atomic={atomic} {dtype}")
        results.append(check(name, kernel.py_func, signature))
    # The channels-last fp16 adds through int32 words of two halves (add.rn.f16x2, and
    # red.global.add.noftz.f16x2 when atomic).
    words = types.int32[:, :, :, ::1]
    for atomic in (False, True):
        kernel = sbnet.copy_element.make_copy_kernels(S, True, False, True, atomic, "half2", True)
        results.append(check(f"scatter NHWC add half2 words atomic={atomic}", kernel.py_func,
                             (words, words, types.int32[:, ::1], types.int32[::1]) + (i64,) * 6))
    # The NCHW fp16 copies two (int32) or four (int64) halves a word (`sbnet.copy_pairs.make_pair_kernels`):
    # words flat, the image's halves beside them.
    # One window a thread block, or windows side by side in each warp (strip).
    for scatter, add, atomic, halves in ((False, False, False, 2), (True, False, False, 2), (True, True, False, 2),
                                         (True, True, True, 2), (False, False, False, 4), (True, False, False, 4),
                                         (True, True, False, 4)):
        for strip in (False, True):
            kernel = sbnet.copy_pairs.make_pair_kernels(S, scatter, add, atomic, halves, strip)
            words = (types.int64 if halves == 4 else types.int32)[::1]
            results.append(check(f"pairs {'scatter' if scatter else 'gather'} NCHW fp16 add={add} atomic={atomic} "
                                 f"halves={halves} strip={strip}", kernel.py_func,
                                 (words, words, types.int32[:, ::1], types.int32[::1], types.float16[::1])
                                 + (i64,) * 11))
    words = types.int32[::1]
    for atomic in (False, True):  # ... and the adding scatters of NHWC blocks (`sbnet.copy_pair_tiles.make_pair_tile_kernels`)
        results.append(check(f"pair tiles scatter NHWC blocks into NCHW fp16 atomic={atomic}",
                             sbnet.copy_pair_tiles.make_pair_tile_kernels(S, atomic).py_func,
                             (words, words, types.int32[:, ::1], types.int32[::1], types.float16[::1]) + (i64,) * 10,
                             S.pair_tile_max_registers))
    results.append(check("pair tiles gather NCHW fp16 into NHWC blocks", sbnet.copy_pair_tiles.make_pair_tile_gathers(S).py_func,
                         (words, words, types.int32[:, ::1], types.int32[::1]) + (i64,) * 11))
    # The row copies (channels-last, 16-byte vectors over flat views): every combination the
    # launcher picks (`sbnet.dispatch.row_path`).
    for scatter, transpose, add, (vector_dtype, half2), pixels in itertools.product(
            (False, True), (False, True), (False, True),
            (("float32", False), ("float64", False), ("int32", False), ("int32", True), ("float16", False)),
            (16, 32, 64)):
        if ((add and not scatter) or (transpose and vector_dtype not in ("float32", "float16"))
                or (vector_dtype == "float16" and not transpose) or (half2 and not add)
                or (pixels != 16 and not transpose)):
            continue
        element = getattr(types, vector_dtype)
        for block_width, window_major in itertools.product((4, 1) if transpose else (4,),
                                                           (False, True) if transpose else (False,)):
            kernel = sbnet.copy_rows.make_row_kernels(S, scatter, transpose, add, vector_dtype, half2, pixels, block_width,
                                             window_major)
            signature = (element[::1], element[::1], types.int32[:, ::1], types.int32[::1]) + (i64,) * 10
            name = (f"row {'scatter' if scatter else 'gather'} transpose={transpose} add={add} {vector_dtype}"
                    f"{' half2' if half2 else ''} pixels={pixels}{' block steps of 1' if block_width == 1 else ''}"
                    f"{' window by window' if window_major else ''}")
            results.append(check(name, kernel.py_func, signature))
    # The merging scatter (a copy of y and the windows over each pixel in one pass) and its map.
    results.append(check("fill int32", sbnet.merge.fill_int32.py_func, (types.int32[::1], i64)))
    results.append(check("link windows", sbnet.merge.link_windows.py_func,
                         (types.int32[::1], types.int32[::1], types.int32[:, ::1], types.int32[::1]) + (i64,) * 7))
    for add, (vector_dtype, half2) in itertools.product(
            (False, True), (("float32", False), ("float64", False), ("int32", True))):
        element = getattr(types, vector_dtype)
        kernel = sbnet.merge.make_merge_kernels(S, add, vector_dtype, half2)
        signature = (element[::1],) * 3 + (types.int32[::1],) * 2 + (i64,) * 13
        results.append(check(f"merge add={add} {vector_dtype}{' half2' if half2 else ''}", kernel.py_func,
                             signature))
    results += check_gather_matmul()
    print(f"{sum(results)} of {len(results)} kernels compiled")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
