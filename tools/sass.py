"""The instruction mix of version 5's product loops, read off the SASS without a GPU (a
developer's tool).

    pip install nvidia-cuda-nvdisasm        # nvdisasm; ptxas comes with the CUDA toolkit
    python tools/sass.py [--block-sizes 16,32,64] [--dtypes float16,float32]
    python tools/sass.py --reduce-mask
    python tools/sass.py --attention
    python tools/sass.py --conv
    python tools/sass.py --quant
    python tools/sass.py --wgrad

For each block size and storage it compiles the forward (W) and input_grad (Wt) products
with feature_axis 1 and 16-byte loads (the cp.async ring) for sm_90, disassembles them, and
prints, for each loop that holds the mma (the mma steps of a stage, then the stage loop
around them; one loop where the steps are unrolled), its length and its count of mma, shared loads and stores, global loads,
cp.async copies, byte permutes (16-bit pairs built in registers), integer multiply-adds and
fp32 arithmetic, and the instructions a stage issues. A count of issued instructions, not a timing: where two kernels differ, the
GPU decides (tools/sweep.py). With --reduce-mask: the loops around the first pooling
of mask values in reduce_mask's one-pass kernel instead (a column's rows, then its columns). With
--attention: the walk loops of attention's fused kernels (mma.sync, sm_90) and wgmma kernels
(sm_90a), bf16 at head_dim 64 and 128, the config's defaults; a loop's length counts both of its
branches (the causal mask's, the rescaling's), not what a tile issues. With --conv: the stage
loop of the implicit convolution's forward, then of its wgmma forward (sm_90a) with and without
bias code, and of the wgmma filter gradient with the patch or dy as A. With --quant: the chunk and
stage loops of the dense W1A1 product, register-staged and through the cp.async ring, and of
block-sparse W1A1 (blocks of 64), plain and with its activation rows held. With --wgrad: the stage
loops around version 7's paired weight gradient's wgmmas, on the barrier ring and warp-specialized.
"""

import os

# The real compiler, not the simulator (`import sparseblocks` picks the simulator where no GPU is
# present, unless told otherwise).
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "0")

import argparse
import itertools
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numba.cuda.dispatcher  # noqa: E402,F401 (`cuda.dispatcher` below)
from numba import cuda, types  # noqa: E402

from sparseblocks import bsmm  # noqa: E402

CC = (9, 0)


class _Device:  # device functions compiled apart (`runtime.compile.inlined`) ask the current
    compute_capability = CC  # device for its compute capability, and there is none here


cuda.dispatcher.get_current_device = _Device
COUNTS = {"mma": r"\bHMMA", "LDS": r"\bLDS", "STS": r"\bSTS", "LDG": r"\bLDG\.", "cp.async": r"\bLDGSTS",
          "PRMT": r"\bPRMT", "IMAD/IADD": r"\b(IMAD|IADD)", "ISETP/SEL": r"\b(ISETP|SEL)\b", "fp32": r"\bF(ADD|MUL|FMA)\b"}


def nvdisasm():
    """nvdisasm on the PATH, or where pip's wheel puts it (site-packages/nvidia/cu*/bin)."""
    import site

    found = shutil.which("nvdisasm")
    for root in site.getsitepackages():
        found = found or next(iter(glob.glob(os.path.join(root, "nvidia", "cu*", "bin", "nvdisasm"))), None)
    return found


def sass(function, signature, tool, cc=CC, launch_bounds=None):
    ptx, _ = cuda.compile_ptx(function, signature, cc=cc, launch_bounds=launch_bounds)
    # Standalone ptxas refuses more than 48 KB of static shared memory (the driver takes it):
    # shrink the declarations, which changes no instruction (addresses are the symbols' plus offsets).
    ptx = re.sub(r"(\.shared \.align \d+ \.b8 _cudapy_smem_\d+)\[(\d+)\]",
                 lambda m: f"{m.group(1)}[{min(int(m.group(2)), 16384)}]", ptx)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        Path(path).write_text(ptx)
        arch = f"sm_{cc[0]}{cc[1]}{cc[2] if len(cc) > 2 else ''}"
        subprocess.run(["ptxas", f"-arch={arch}", path, "-o", path + ".cubin"], check=True)
        return subprocess.run([tool, "-c", path + ".cubin"], capture_output=True, text=True, check=True).stdout


def loops_around(text, anchor="HMMA", counts=COUNTS, every=False):
    """[(length, counts)] of the loops (backward branches) around the first instruction that
    contains `anchor` (by default the first mma), innermost first; with ``every``, the loops
    around any such instruction."""
    instructions, labels = [], {}
    for line in text.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        op = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(.*?);", line)
        if op:
            instructions.append(op.group(1))
    anchors = [i for i, op in enumerate(instructions) if anchor in op]
    anchors = anchors if every else anchors[:1]
    loops = []
    for end, op in enumerate(instructions):
        target = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", op)
        begin = labels.get(target.group(1)) if target else None
        if begin is not None and any(begin <= a <= end for a in anchors):
            body = instructions[begin:end + 1]
            loops.append((len(body), {k: sum(bool(re.search(p, op)) for op in body) for k, p in counts.items()}))
    return sorted(loops, key=lambda loop: loop[0])


def reduce_mask(tool):
    """The loops around the first pooling (max) of reduce_mask's one-pass kernel (max pooling of
    a float32 mask, scalar and vector loads): the column's rows, ``pass_loads`` at a time, and the
    columns around them."""
    from sparseblocks import sbnet

    i64 = types.int64
    signature = (types.int32[:, ::1], types.int32[::1], types.int64[::1], types.float32[::1]) \
        + (i64,) * 11 + (types.float64,) + (i64,) * 7
    print("| loads | loop | length | " + " | ".join(COUNTS) + " |")
    print("|---" * (3 + len(COUNTS)) + "|")
    for vector in (1, sbnet.DEFAULT.pass_vector):
        kernel = sbnet.reduce_pass.make_pass_kernel(sbnet.DEFAULT, False, False, vector, "warp", 1, nan_max_ptx=True)
        for length, counts in loops_around(sass(kernel.py_func, signature, tool), "FMNMX"):  # (the first max)
            print(f"| {vector} a load | | {length} | " + " | ".join(str(counts[k]) for k in COUNTS) + " |")


ATTENTION_COUNTS = {"wgmma": r"\bHGMMA", "mma": r"\bHMMA", "MUFU": r"\bMUFU", "cp.async": r"\bLDGSTS",
                    "IMAD/IADD": r"\b(IMAD|IADD)", "ISETP/SEL": r"\b(ISETP|SEL|FSEL)\b",
                    "fp32": r"\bF(ADD|MUL|FMA|MNMX)\b", "F2FP": r"\bF2FP"}


def attention(tool):
    """The walk loops (those around a tensor-core instruction) of attention's six kernels."""
    from sparseblocks.attention import DEFAULT as A
    from sparseblocks.attention import fused, hopper

    i64, bits, index = types.int64, types.int16, types.int32[::1]
    forward = (bits[::1], types.float32[::1], bits[::1], bits[::1], bits[::1], index, index, i64, i64, i64,
               types.float64, types.boolean)
    dq = (bits[::1],) * 5 + (types.float32[::1],) * 2 + (index, index, i64, i64, i64, types.float64, types.float64,
                                                         types.boolean)
    dkdv = (bits[::1],) + dq[:9] + dq[8:]
    print("| kernel | head_dim | loop | length | " + " | ".join(ATTENTION_COUNTS) + " |")
    print("|---" * (4 + len(ATTENTION_COUNTS)) + "|")
    for D in (64, 128):
        kernels = [
            ("mma.sync forward", fused.make_forward("bfloat16", D, A.stages, fused.forward_rows(128, A.warp_rows),
                                                    A.forward_keys), forward, CC, "HMMA"),
            ("mma.sync dq", fused.make_query_grads("bfloat16", D, A.backward_stages), dq, CC, "HMMA"),
            ("mma.sync dk dv", fused.make_key_grads("bfloat16", D, A.backward_stages), dkdv, CC, "HMMA"),
            ("wgmma forward", hopper.make_forward("bfloat16", D, A.hopper_forward_stages, A.hopper_groups), forward,
             (9, 0, "a"), "HGMMA"),
            ("wgmma dq", hopper.make_query_grads("bfloat16", D, A.hopper_stages, A.hopper_groups), dq, (9, 0, "a"),
             "HGMMA"),
            ("wgmma dk dv", hopper.make_key_grads("bfloat16", D, A.hopper_stages, A.hopper_groups), dkdv,
             (9, 0, "a"), "HGMMA")]
        for name, kernel, signature, cc, anchor in kernels:
            text = sass(kernel.py_func, signature, tool, cc)
            for length, counts in loops_around(text, anchor, ATTENTION_COUNTS, every=True):
                print(f"| {name} | {D} | walk | {length} | " + " | ".join(str(counts[k]) for k in ATTENTION_COUNTS)
                      + " |")


CONV_COUNTS = {"mma": r"\bHMMA", "LDSM": r"\bLDSM", "cp.async": r"\bLDGSTS", "LDG": r"\bLDG\.", "STG": r"\bSTG",
               "IMAD/IADD": r"\b(IMAD|IADD)", "ISETP/SEL": r"\b(ISETP|SEL)\b", "CALL": r"\bCALL"}


def conv(tool):
    """The stage loop of the implicit convolution's forward (fp16, channel groups of 16, 32 and 64,
    3x3 taps, tiles of 64 columns; stages of 32 and 64 bytes a row): its length, which counts the
    tile's epilogue (with bias code, both its paths: with and without an edge bias), run once
    every few stages; the filter gradient's k-step and stage loops (G = 32: fp16, fp32 in passes of
    5 and 9 taps); then `hopper_conv`'s."""
    from sparseblocks.conv import implicit

    i64, index = types.int64, types.int32[::1]
    signature = (types.float16[::1],) * 3 + (index,) * 4 + (i64,) * 3 + (types.float16[:, ::1], index,
                                                                          types.boolean, i64, i64)
    print("| group | stage bytes | loop | length | " + " | ".join(CONV_COUNTS) + " |")
    print("|---" * (4 + len(CONV_COUNTS)) + "|")
    for G, row_bytes, biased in ((16, 32, True), (32, 32, True), (32, 32, False), (32, 64, True), (64, 32, True),
                                 (64, 32, False)):
        kernel = implicit.make_forward("float16", G, 64, 320, 9, False, row_bytes, biased)
        for length, counts in loops_around(sass(kernel.py_func, signature, tool), "HMMA", CONV_COUNTS):
            print(f"| {G} | {row_bytes}{'' if biased else ', no bias code'} | stage | {length} | "
                  + " | ".join(str(counts[k]) for k in CONV_COUNTS) + " |")
    counts = dict(CONV_COUNTS, LDS=r"\bLDS\b", fp32=r"\bF(ADD|MUL|FMA)\b")
    print("\n| filter gradient | taps a pass | loop | length | " + " | ".join(counts) + " |")
    print("|---" * (4 + len(counts)) + "|")
    for storage, taps in (("float16", 9), ("float32", 5), ("float32", 9)):
        value = getattr(types, storage)
        kernel = implicit.make_filter_grad(storage, 32, 64, 320, taps)
        signature = (types.float32[::1], value[::1], value[::1]) + (index,) * 3 + (i64,) * 6
        loops = loops_around(sass(kernel.py_func, signature, tool), "HMMA", counts)
        for (length, c), loop in zip(loops, ("step", "stage")):
            print(f"| {storage}, G = 32 | {taps} | {loop} | {length} | " + " | ".join(str(c[k]) for k in counts) + " |")
    hopper_conv(tool)


def hopper_conv(tool):
    """The stage loop of the wgmma forward (sm_90a, fp16, 3x3, 56 x 56, two warpgroups, NCHW): with
    bias code (both epilogue paths counted) and without it (a call with no edge bias)."""
    from sparseblocks.conv import hopper

    i64, index, h = types.int64, types.int32[::1], types.float16
    counts = dict(CONV_COUNTS, mma=r"\bHGMMA", STS=r"\bSTS", BAR=r"\bBAR")
    hg = hopper.geometry([1, 56, 56, 1, 56, 56, 1, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2)
    print("\n| group | epilogue | loop | length | " + " | ".join(counts) + " |")
    print("|---" * (4 + len(counts)) + "|")
    for G, (name, biased) in itertools.product((16, 32, 64), (("bias code", True), ("no bias code", False))):
        kernel = hopper.make_forward("float16", G, 9, hopper.patch_positions(hg), False, 2, 0, biased)
        signature = (h[::1],) * 3 + (index,) * 4 + (i64,) * 2 + (h[:, ::1], index, types.boolean, i64, i64)
        text = sass(kernel.py_func, signature, tool, cc=(9, 0, "a"))
        for length, c in loops_around(text, "HGMMA", counts)[-1:]:
            print(f"| {G} | {name} | stage | {length} | " + " | ".join(str(c[k]) for k in counts) + " |")
    # The wgmma filter gradient's stage loop (5 taps a warpgroup, overlapped): the patch as A, or dy
    # as A from registers (`ConvConfig.hopper_filter_dy_a`: an ldmatrix a k16 step), from a channels-last copy
    # of dy or the caller's channels-first dy (`hopper.dy_first_fits`).
    counts = dict(counts, LDSM=r"\bLDSM")
    fg = hopper.filter_geometry([1, 56, 56, 1, 56, 56, 1, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    print("\n| group | filter gradient's A | loop | length | " + " | ".join(counts) + " |")
    print("|---" * (4 + len(counts)) + "|")
    for G, (dy_a, first) in itertools.product((16, 32, 64), ((False, False), (True, False), (True, True))):
        kernel = hopper.make_filter_grad("float16", G, 9, hopper.patch_positions(fg), hopper.filter_taps(9, G), True,
                                         dy_a, first)
        signature = (types.float32[::1], h[::1], h[::1], types.int32[:, ::1]) + (index,) * 3 + (i64,) * 5
        text = sass(kernel.py_func, signature, tool, cc=(9, 0, "a"))
        what = ("dy, registers (channels-first dy)" if first else "dy, registers") if dy_a else "patch"
        for length, c in loops_around(text, "HGMMA", counts)[-1:]:
            print(f"| {G} | {what} | stage | {length} | "
                  + " | ".join(str(c[k]) for k in counts) + " |")


WGRAD_COUNTS = {"wgmma": r"\bHGMMA", "cp.async": r"\bLDGSTS", "bulk": r"\bUTMALDG", "BAR": r"\bBAR",
                "mbarrier": r"\bSYNCS", "IMAD/IADD": r"\b(IMAD|IADD)", "ISETP/SEL": r"\b(ISETP|SEL)\b"}


def hopper_wgrad(tool):
    """The loops around version 7's wgmmas in the paired weight gradient (block 64, bf16, feature_axis
    1), innermost first: on the barrier ring (every thread copies), warp-specialized on bulk copies
    (the multiplying warpgroup's walk, unrolled over the ring's stages, then the loops around both
    warpgroups' code), and with a copying warpgroup's cp.async."""
    from dataclasses import replace

    from sparseblocks.bsmm import hopper_shapes as shapes
    from sparseblocks.bsmm.hopper_wgrad import make_weight_grad_v7

    i64, e = types.int64, types.int16
    signature = (e[:, :, ::1], types.float32[:, :, ::1], e[:, ::1], e[:, ::1], types.int32[:, ::1], i64, i64,
                 types.float64, types.float32[:, ::1], types.int32[::1], types.uint8[::1], types.uint8[::1])
    base = bsmm.DEFAULT
    cases = [("barrier ring", replace(base, v7_wgrad_pair_producer=False)), ("bulk copies", base),
             ("bulk, 2 a multiprocessor", replace(base, v7_wgrad_pair_producer=True, v7_wgrad_pair_blocks={64: 2})),
             ("cp.async warpgroup", replace(base, v7_wgrad_pair_producer=True, v7_tma=False))]
    print("| paired tile, block 64 | loop | length | " + " | ".join(WGRAD_COUNTS) + " |")
    print("|---" * (3 + len(WGRAD_COUNTS)) + "|")
    for name, cfg in cases:
        kernel = make_weight_grad_v7(cfg, 64, "bfloat16", types.float32, 1, "bfloat16", shapes.PAIRED)
        bounds = shapes.launch_bounds(cfg, 64, shapes.v7_shape(cfg, 64, shapes.PAIRED)[2], shapes.PAIRED)
        text = sass(kernel.py_func, signature, tool, cc=(9, 0, "a"), launch_bounds=bounds)
        for length, c in loops_around(text, "HGMMA", WGRAD_COUNTS, every=True):  # (innermost first)
            print(f"| {name} | | {length} | " + " | ".join(str(c[k]) for k in WGRAD_COUNTS) + " |")


QUANT_COUNTS = {"mma": r"\bBMMA", "ldmatrix": r"\bLDSM", "LDG": r"\bLDG\.", "STS": r"\bSTS", "cp.async": r"\bLDGSTS",
                "BAR": r"\bBAR", "IMAD/IADD": r"\b(IMAD|IADD)", "ISETP/SEL": r"\b(ISETP|SEL)\b"}


def quant(tool):
    """The chunk or stage loops of the dense W1A1 product (signed, the default tile): the
    register-staged kernel (`quant.tensorcore`) and the cp.async ring (`quant.ring`, 2 and 3
    stages); each loop's length and counts, b1 mmas included."""
    from dataclasses import replace

    from sparseblocks import quant as q
    from sparseblocks.quant.ring import make_ring_product
    from sparseblocks.quant.tensorcore import block_warps, make_tensorcore_product

    i64, counts, cfg = types.int64, types.int32[::1], q.DEFAULT
    head = (types.float16[::1], types.uint32[::1], types.uint32[::1], types.float32[::1], types.float32[:, ::1],
            types.float32[::1])
    warps = block_warps(cfg, 1, 4096, cfg.dense_cols)
    kernels = [("register-staged", make_tensorcore_product(cfg, 1, 1, True, True, False, False, 128, cfg.dense_cols,
                                                           *warps, True), head + (counts, counts) + (i64,) * 4)]
    for stages in (2, 3):
        kernels.append((f"ring of {stages}", make_ring_product(replace(cfg, ring_stages=stages), 1, 1, True, True,
                                                               False, False, cfg.dense_cols, *warps, True),
                        head + (counts,) * 4 + (i64,) * 4))
    sparse = block_warps(cfg, 1, 4096, 64)  # (block-sparse, blocks of 64: a block-column a thread block)
    kernels.append(("blocks of 64", make_tensorcore_product(cfg, 1, 1, True, True, False, False, 2, 64, *sparse, True),
                    head + (counts, counts) + (i64,) * 4))
    print("| kernel | loop length | " + " | ".join(QUANT_COUNTS) + " |")
    print("|---" * (2 + len(QUANT_COUNTS)) + "|")
    for name, kernel, signature in kernels:
        for length, found in loops_around(sass(kernel.py_func, signature, tool), "BMMA", QUANT_COUNTS):
            print(f"| {name} | {length} | " + " | ".join(str(found[k]) for k in QUANT_COUNTS) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-sizes", default="16,32,64")
    parser.add_argument("--dtypes", default="float16,float32")
    parser.add_argument("--reduce-mask", action="store_true",
                        help="instead: the loops around reduce_mask version 2's first pooling of mask values")
    parser.add_argument("--attention", action="store_true", help="instead: the walk loops of attention's kernels")
    parser.add_argument("--conv", action="store_true", help="instead: the implicit convolution forward's stage loop")
    parser.add_argument("--quant", action="store_true", help="instead: the dense W1A1 product's loops, staged and ring")
    parser.add_argument("--wgrad", action="store_true", help="instead: version 7's paired weight gradient's loops")
    args = parser.parse_args()
    tool = nvdisasm()
    if tool is None or shutil.which("ptxas") is None:
        sys.exit("needs ptxas (CUDA toolkit) and nvdisasm (pip install nvidia-cuda-nvdisasm)")
    if args.reduce_mask:
        return reduce_mask(tool)
    if args.attention:
        return attention(tool)
    if args.conv:
        return conv(tool)
    if args.quant:
        return quant(tool)
    if args.wgrad:
        return hopper_wgrad(tool)
    index = types.int32[::1]
    print("| block | storage | product | loop | length | " + " | ".join(COUNTS) + " | a stage |")
    print("|---" * (6 + len(COUNTS)) + "|")
    for bs in map(int, args.block_sizes.split(",")):
        for storage in args.dtypes.split(","):
            out = types.int16 if storage == "bfloat16" else getattr(types, storage)
            signature = (out[:, ::1], types.float32[:, :, ::1], types.int32[:, ::1], types.int32[:, :, ::1]) \
                + (index,) * 6 + (types.int64,)
            for transpose_w in (False, True):
                kernel = bsmm.tensorcore.make_product_v5(bsmm.DEFAULT, bs, storage, bsmm.device.acc_type(storage), transpose_w, 1,
                                                         True)
                loops = loops_around(sass(kernel.py_func, signature, tool))
                steps = bsmm.tensorcore.v5_shape(bsmm.DEFAULT, bs, storage, True)[3] // 8  # mma steps a stage
                # Issued a stage: the stage loop, its step loop (if not unrolled) run `steps` times.
                stage = loops[-1][0] + (steps - 1) * loops[0][0] if len(loops) > 1 else loops[0][0]
                for depth, (length, counts) in enumerate(loops):
                    print(f"| {bs} | {storage} | {'input_grad' if transpose_w else 'forward'} | "
                          f"{'steps' if depth < len(loops) - 1 else 'stages'} | {length} | "
                          + " | ".join(str(counts[k]) for k in COUNTS) + f" | {stage} |")


if __name__ == "__main__":
    main()
