"""The convolution's geometry, as three spatial dims (a 1-D or 2-D layer is a 3-D one with leading
sizes of 1): output sizes, padding, and the edge-bias groups. Shared by the op and its twin."""

import numpy as np


def expand_dims(values, name="dims"):
    """1-3 sizes (or one int) as three, padded in front with 1s: (S,) -> (1, 1, S)."""
    values = [values] if np.isscalar(values) else list(values)
    if not 1 <= len(values) <= 3:
        raise ValueError(f"{name}: expected 1 to 3 values, got {len(values)}")
    return (1,) * (3 - len(values)) + tuple(int(v) for v in values)


def out_dim(S, X, pad, stride, dilate):
    """Outputs along a dim: positions of a filter of S taps ``dilate`` apart, every ``stride``."""
    return (X + 2 * pad - dilate * (S - 1) - 1) // stride + 1


def in_dim(S, X, pad, stride, dilate):
    """The input size whose convolution has X outputs (a transposed convolution's output size,
    the smallest where stride > 1 leaves a choice)."""
    return (X - 1) * stride + dilate * (S - 1) + 1 - 2 * pad


def padding_of(padding, TRS, dilates, dims):
    """Padding as three dims: "SAME" (half the dilated filter, floor), "VALID" (none), or ints."""
    if isinstance(padding, str):
        if padding.upper() == "SAME":
            return tuple((d * (S - 1)) // 2 for S, d in zip(TRS, dilates))
        if padding.upper() == "VALID":
            return (0, 0, 0)
        raise ValueError(f"padding: expected 'SAME', 'VALID' or ints, got {padding!r}")
    pads = [padding] if np.isscalar(padding) else list(padding)
    if len(pads) != dims and len(pads) != 1:
        raise ValueError(f"padding: expected {dims} values (one a spatial dim), got {len(pads)}")
    pads = [int(v) for v in (pads * dims if len(pads) == 1 else pads)]
    if min(pads) < 0:
        raise ValueError(f"padding: expected non-negative ints, got {pads}")
    return (0,) * (3 - dims) + tuple(pads)  # (no padding along the leading dims of size 1)


def given(values):
    """Sizes as the caller gave them, for messages: an int, or a list."""
    return int(values) if np.isscalar(values) else [int(v) for v in values]


def geometry(TRS, DHW, MPQ=None, strides=1, dilates=1, padding="SAME", deconv=False):
    """Every size as three dims: dict(TRS, DHW, MPQ, strides, dilates, padding, dims). DHW is the
    convolution's input, MPQ its output (where given, the size DHW gives); for a deconvolution
    (``deconv``) DHW is the given input and MPQ its output: where None, the size `in_dim` gives,
    else any size whose convolution gives DHW (up to stride - 1 more)."""
    dims = 1 if np.isscalar(TRS) else len(TRS)
    TRS, DHW = expand_dims(TRS, "TRS"), expand_dims(DHW, "DHW")
    as3 = lambda v, name: expand_dims([v] * dims if np.isscalar(v) else v, name)  # noqa: E731
    strides, dilates = as3(strides, "strides"), as3(dilates, "dilates")
    pad = padding_of(padding, TRS, dilates, dims)
    if deconv:  # the convolution runs from the (larger) output back to this input
        small = DHW
        least = tuple(in_dim(*a) for a in zip(TRS, small, pad, strides, dilates))
        big = least if MPQ is None else expand_dims(MPQ, "MPQ")
        if any(out_dim(*a) != X for a, X in zip(zip(TRS, big, pad, strides, dilates), small)):
            choices = [f"{lo}..{lo + st - 1}" if st > 1 else str(lo) for lo, st in zip(least, strides)][3 - dims:]
            raise ValueError(f"MPQ: expected output sizes whose convolution gives the input's {list(small[3 - dims:])} "
                             f"({', '.join(choices)}), got {given(MPQ)}")
        return dict(TRS=TRS, DHW=big, MPQ=small, strides=strides, dilates=dilates, padding=pad, dims=dims)
    sizes = tuple(out_dim(*a) for a in zip(TRS, DHW, pad, strides, dilates))
    if MPQ is not None and expand_dims(MPQ, "MPQ") != sizes:
        raise ValueError(f"MPQ: expected the output size {list(sizes[3 - dims:])} of DHW under TRS, strides, "
                         f"dilates and padding, got {given(MPQ)}")
    return dict(TRS=TRS, DHW=DHW, MPQ=sizes, strides=strides, dilates=dilates, padding=pad, dims=dims)


def edge_map(g):
    """The output positions (flat m·P·Q + p·Q + q) whose filter reaches the padding, grouped by
    which taps do: a list of position lists, ordered by their first position (OpenAI's edge
    bias groups)."""
    groups = {}
    for m, p, q in np.ndindex(*g["MPQ"]):
        off = []
        for t, r, s in np.ndindex(*g["TRS"]):
            at = [o * u - pd + k * a for o, u, pd, k, a in
                  zip((m, p, q), g["strides"], g["padding"], (t, r, s), g["dilates"])]
            if any(not 0 <= x < X for x, X in zip(at, g["DHW"])):
                off.append((t, r, s))
        if off:
            groups.setdefault(tuple(off), []).append((m * g["MPQ"][1] + p) * g["MPQ"][2] + q)
    return sorted(groups.values(), key=lambda positions: positions[0])
