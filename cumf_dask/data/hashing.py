"""splitmix64 hashing: counter-based randomness that any task recomputes alone.

One implementation of the splitmix64 finalizer serves both users: the planted model
(:mod:`.planted`, :mod:`.sampling`) hashes indices into keys, uniforms and normals, and
:func:`split_mask` hashes (row, column, seed) into the train/test split of every builder, and
:func:`user_split_mask` into the split by user (a share of each row held out, never all).
Array functions take the array module `xp` (NumPy or CuPy), so the generator can compute
its pairs, values and split on a GPU with the same hashes; :func:`split_mask`, which every
builder calls with its arrays alone, computes where they live (:func:`array_module`).
"""

from __future__ import annotations

import math
import sys
from typing import Any, Literal, get_args

import numpy as np

GOLDEN = 0x9E3779B97F4A7C15  # the splitmix64 increment (2^64 / golden ratio)
_M64 = (1 << 64) - 1
_SPLIT_OFFSET = 0x632BE59BD9B4E019  # keeps the split's hash apart from the model's streams
SplitKind = Literal["pairs", "users"]  # the held-out share: of all pairs, or of each row's
SPLITS: tuple[str, ...] = get_args(SplitKind)


def splitmix(x: int) -> int:
    """splitmix64 of a Python int (used for keys)."""
    z = (x + GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def stream_key(seed: int, stream: int) -> int:
    """The key of one independent hash stream of a seed."""
    return splitmix(splitmix(seed & _M64) ^ stream)


def array_module(x: Any) -> Any:
    """CuPy for a CuPy array, else NumPy: the module that computes where `x` lives. Never
    imports CuPy (an array of it means it is imported already)."""
    cupy = sys.modules.get("cupy")
    return np if cupy is None else cupy.get_array_module(x)


def mix(xp: Any, z: Any) -> Any:
    """The splitmix64 finalizer on a uint64 array (a bijection of 64-bit words)."""
    z = z ^ (z >> xp.uint64(30))
    z *= xp.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> xp.uint64(27)
    z *= xp.uint64(0x94D049BB133111EB)
    z ^= z >> xp.uint64(31)
    return z


def hash64(xp: Any, key: Any, a: Any) -> Any:
    """64-bit hash of the words `a` under `key` (a scalar or a broadcastable uint64 array)."""
    return mix(xp, xp.asarray(a).astype(xp.uint64) * xp.uint64(GOLDEN) + key)


def unit(xp: Any, z: Any) -> Any:
    """Uniform floats in (0, 1) from 64-bit hashes."""
    return ((z >> xp.uint64(11)).astype(xp.float64) + 0.5) * 2.0**-53


def normal_pairs(xp: Any, z: Any) -> tuple[Any, Any]:
    """Two standard normals per 64-bit hash (Box-Muller on its two 32-bit halves)."""
    u1 = ((z >> xp.uint64(32)).astype(xp.float64) + 0.5) * 2.0**-32
    u2 = (z & xp.uint64(0xFFFFFFFF)).astype(xp.float64) * (2 * math.pi * 2.0**-32)
    r = xp.sqrt(-2.0 * xp.log(u1))
    return r * xp.cos(u2), r * xp.sin(u2)


def split_mask(row: Any, col: Any, fraction: float, seed: int) -> Any:
    """True for ratings held out for testing: a hash of (row, col, seed) below `fraction`.

    Depends only on the (dense) pair and the seed, not on chunking, so the same input splits
    the same way however it is read; repeated pairs fall on the same side. With mapped ids
    the dense indices follow the order ids first appear, so reordering the input can move
    pairs between sides. NumPy or CuPy arrays (integer arithmetic: the same mask on both).
    """
    xp = array_module(row)
    if fraction <= 0:
        return xp.zeros(row.shape, bool)
    with np.errstate(over="ignore"):
        z = row.astype(xp.uint64) * xp.uint64(GOLDEN)
        z ^= col.astype(xp.uint64) + xp.uint64(_SPLIT_OFFSET) + xp.uint64(seed & (2**63 - 1))
        z = mix(xp, z)
    return (z >> xp.uint64(11)).astype(xp.float64) * (1.0 / 2**53) < fraction


def user_split_mask(row: np.ndarray, col: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """True for ratings held out: for each row with n ratings, the round(fraction n) whose hash
    of (row, col, seed) is smallest, but never all n, so every row keeps a training rating.

    Needs all of a row's ratings at once (a builder applies it band by band); independent of
    their order. Repeated pairs share a hash, so give each pair once (resolve duplicates
    first) or they may fall on both sides.
    """
    row, col = np.asarray(row, np.int64), np.asarray(col, np.int64)
    test = np.zeros(row.shape, bool)
    if fraction <= 0 or row.size == 0:
        return test
    key = unit(np, hash64(np, stream_key(seed, 0x5EED), row * np.int64(1 << 32) + col))
    order = np.lexsort((col, key, row))
    sorted_rows = row[order]
    starts = np.flatnonzero(np.r_[True, sorted_rows[1:] != sorted_rows[:-1]])
    sizes = np.diff(np.r_[starts, row.size])
    held = np.minimum(np.floor(fraction * sizes + 0.5).astype(np.int64), sizes - 1)
    rank = np.arange(row.size) - np.repeat(starts, sizes)
    test[order] = rank < np.repeat(held, sizes)
    return test
