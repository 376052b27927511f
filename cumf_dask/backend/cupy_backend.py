"""CuPy backend: MO-ALS (cuMF section 3) as CUDA kernels on one GPU.

The kernels live in ``kernels/mo_als.cu`` and are compiled lazily with ``cupy.RawModule``,
instantiated per padded size ``F = round_up(f + 1, 8)`` and element type of the fixed
factor: one module per kernel, compiled in parallel threads, cached for the process (and on
disk by CuPy). Every rating extends its fixed-factor row with the rating itself, so one
register-tiled Gram build gives A (leading f x f block) and B (row f), and the Cholesky
factor of that extended matrix carries the forward solve (see the .cu header). The checks
of loaded bands and solved factors are one-pass kernels of their own (``kernels/checks.cu``).

* ``hermitian``: one thread block per row segment; each thread owns one 8 x 8 tile of
  the lower triangle in registers; fixed-factor rows staged through shared memory in
  bins (``cp.async`` one bin ahead of the arithmetic). Rows longer than ``long_row``
  ratings are cut into segments whose partial tiles are summed with atomics, so a heavy
  item never serializes on one block. Only rows without ratings and split rows are zeroed
  first: the others are stored whole. ``packed_hermitian`` (p > 1): the same kernels write
  packed lower triangles and add them to the worker's running sums.
* the Gram on the tensor cores (``kernels/tensor_gram.cuh``, f <= 111, float32 factors,
  explicit ratings, compute capability 8.0+): ``hermitian``'s segments (and so the long rows
  of ``update``) split each fixed row into two float16 rows, x = hi + lo 2^-11, and sum
  hi^T hi + (hi^T lo + lo^T hi) 2^-11 with mma.sync, the float32 sums flushed every 256
  ratings: 1.1e-6 from float64 (the FP32 units: 3e-6), 1.5x faster on 4,096-rating
  segments at f = 100 on an H100 (benchmarks/bench_tc_gram.py). A segment with a value
  float16 cannot hold goes to the FP32 kernel, chosen on the GPU.
* ``solve``: own batched Cholesky, one block per system (several small systems per block
  for f <= 40), the matrix held as register tiles (right-looking tiled factorization,
  panels through shared memory). It beat cuSOLVER ``potrfBatched``/``potrsBatched`` and
  ``cupy.linalg.solve`` on f = 10..256, 2.5x to 13x (benchmarks/gpu_notes.md). For
  f > 256 the solve falls back to cuSOLVER batched.
* ``update`` (the p == 1 hot path): one fused kernel per row, Gram -> lambda -> Cholesky
  -> both triangular solves -> x_u, so A never touches device memory. Long rows (and all
  rows for f > 256) go through ``hermitian`` + ``solve`` in row batches.
* small f (<= 16: SparkALS' f = 10, Factorbird's 5): one block per row would leave most of
  its warp idle (f = 10: 3 tiles for 32 threads), so the fused update and the Gram of rows
  that are not split take one thread per row (``row_update_kernel``,
  ``row_hermitian_kernel``: A's packed triangle in that thread's registers). On an H100,
  SparkALS-shaped blocks updated 11-16x faster on the X side (5 ratings a row), 1.8-2.4x on
  the Theta side (benchmarks/bench_small_f.py).
* implicit feedback (:mod:`.objective`): the same kernels instantiated with ``IMPLICIT``:
  each gathered row is scaled by its rating's s as its bin is staged, the appended value is
  t, and the fused update starts its tiles from G0 = Y^T Y (one cuBLAS GEMM per half-step,
  ``gram``); explicit kernels are compiled without either, so their code is unchanged.
* ``solver="cg"``: the fused update (and ``cg_solve_kernel`` for A in memory) runs
  ``cg_steps`` CG steps on the register tiles from the previous factors instead of the
  Cholesky (the kernel comment in mo_als.cu); above f = 256 the generic batched CG of
  :mod:`.objective` runs on CuPy arrays (a loop over the steps, not the rows).
* ``precision="bfloat16"``: ``prepare_fixed`` stores the fixed factor as bfloat16 bits
  (uint16, rows padded to 16 bytes, ``bfloat16_rows``) and ``hermitian``/``update`` gather
  those (half the bytes per row), widening to float32 in shared memory: products and sums
  stay float32. Both accept float32 (or float64) factors too: the kernels are instantiated
  per element type of the factor they are given.
"""

from __future__ import annotations

import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import cache, partial
from pathlib import Path
from typing import Any

import numpy as np

from ..blocks import Bands, Block, block_on_host, check_columns
from ..compat import import_cupy
from ..data.sampling import bin_counts
from ..errors import HostMemoryError, is_out_of_memory, out_of_memory_as
from ..threads import run as run_threads
from .base import MAX_F, MAX_TENSOR_CORE_F, TILE, Backend, padded_size, round_bfloat16
from .objective import UpdateSpec, as_spec, batched_cg, gram_weights, regularization, symmetric

cp = import_cupy()

MAX_FUSED_F = 256  # f up to this: fused update and own solve (one register tile per thread)
MAX_THREADS = 576  # one tile per thread up to F = 264 (33 x 34 / 2 = 561 tiles)
BATCH_BYTES = 1 << 30  # A of a row batch when rows go through hermitian + solve
THREADS_PER_SM = 480  # kernels' register cap: this many resident threads per SM
LONG_ROW = 4096  # rows with more ratings are split over several blocks (hermitian + solve)
SMALL_F = 16  # f up to this: the fused update runs one thread per row (row_update_kernel)
ROW_UNROLL = 4  # ratings row_update_kernel reads at a time (1, 2, 4: within 5% on an H100)
DUAL_SIZES = (24, 40, 56, 72)  # dual_update_kernel's sizes: rows with fewer ratings than one,
# by the push-through identity (an n x n system), where it is below F (benchmarks/gpu_notes.md)
MAX_DUAL = 96  # the largest dual size (its tiles fill three warps)
REHEARSAL_ROWS = (0, 5, 20, 36, 52, 68, 150)  # ratings per row of prepare's rehearsal block
STATIC_SMEM = 48 * 1024  # shared memory a kernel may use without opting in
STAGING_BYTES = 8 << 20  # page-locked buffer of a decoding thread (a 1M-entry int64 chunk)
HOST_COPY_THREADS = 8  # threads copying one large array to host memory (to_host)
LOAD_AHEAD_BYTES = 1 << 29  # decoded band arrays on the GPU before the CSR build takes them
_SOURCE = Path(__file__).parent / "kernels" / "mo_als.cu"
_ERROR_SOURCE = Path(__file__).parent / "kernels" / "error.cu"
_CHECKS_SOURCE = Path(__file__).parent / "kernels" / "checks.cu"
CHECK_GRID = (1024, 256)  # blocks (at most) and threads of the one-pass checks
_INCLUDE = re.compile(r'^#include "(\w+\.cuh)".*$', re.M)  # spliced in (CuPy's cache key is
# the text it compiles)
_SMALLER = "plan smaller batches (a larger plan.q) so that a block fits the GPU"
_PINNED_FIX = ("keep the blocks and factors off host memory (plan.blocks: device or store, "
               "plan.factors: device) or lower cluster.memory_limit; a container may also cap "
               "locked memory (ulimit -l)")  # fmt: skip
_ELEMENT = {np.dtype(np.float32): "float", np.dtype(np.uint16): "bf16"}  # kernels' T by dtype


def _tiles(padded: int) -> int:
    return (padded // TILE) * (padded // TILE + 1) // 2


def launch_shape(padded: int) -> tuple[int, int]:
    """(threads per block, tile groups per row): one lower-triangle tile per thread."""
    tiles = _tiles(padded)
    threads = -(-tiles // 32) * 32 if tiles <= MAX_THREADS else 512
    return threads, -(-tiles // threads)


def dual_smem_bytes(size: int, f: int) -> int:
    """Dynamic shared memory of dual_update_kernel<size>: G^T (f rows of size + 4 floats),
    the Cholesky's CholSmem<size> and y."""
    chol = 4 * ((size // TILE) * (TILE * TILE + 4) + TILE * TILE + 2 * size + TILE)
    return 4 * f * (size + 4) + -(-chol // 16) * 16 + 4 * size


def tensor_core_shape(padded: int) -> tuple[int, int]:
    """(threads, dynamic shared memory bytes) of tc_hermitian_kernel<padded> (Tc<F> in
    kernels/tensor_gram.cuh): a warp per two row blocks of 16; three bins of 32 split rows
    in two planes, each row an odd number of 16-byte units; 16 bytes; their ratings; the
    flushed sums, 128 floats per 16 x 8 tile."""
    units, row_blocks = padded // TILE, -(-padded // 16)
    tiles = sum(min(2 * i + 2, units) for i in range(row_blocks))
    bins = 3 * 2 * 32 * 16 * (units | 1) + 16 + 3 * 32 * 4
    return 32 * ((row_blocks + 1) // 2), bins + tiles * 128 * 4


def systems_per_block(padded: int) -> int:
    """Systems one solve_kernel block solves: as many as fit one warp (kernels' SYS)."""
    tiles = _tiles(padded)
    return 32 // tiles if tiles < 32 else 1


def kernels(
    padded: int,
    device: int,
    threads_per_sm: int = THREADS_PER_SM,
    element: str = "float",
    implicit: bool = False,
    cg: bool = False,
    small_f: int = 0,
    dual: tuple[int, ...] = (),
    tensor_cores: bool = False,
) -> dict[str, Any]:
    """The compiled kernels for a padded size F on a device (compiled once per process).

    The kernels' register cap asks for ``threads_per_sm`` resident threads per SM.
    ``element``: the fixed factor's element type in the Gram kernels, "float" or "bf16".
    ``implicit``: Gram kernels that scale rows (and the update that starts from G0);
    ``cg``: the update runs CG instead of the Cholesky (and ``cg_solve`` is compiled).
    ``small_f``: f, to compile the one-thread-per-row kernels for it: ``row_hermitian``, and
    ``row_update`` instead of the tiled ``update`` (without ``cg``); 0: the tiled ones.
    ``dual``: the sizes of ``dual_update_kernel`` to compile (``dual24`` ...: short rows).
    ``tensor_cores``: also ``split`` and ``tc_hermitian`` (the Gram on the tensor cores).
    Each kernel is its own module (its own entry in CuPy's disk cache), and the missing ones
    compile in parallel threads: NVRTC runs without the GIL, so a fresh machine waits for
    the slowest kernel, not for their sum. A thread that asks while another compiles waits
    for it (the engine compiles them in the background while the blocks load).
    """
    names = kernel_names(padded, threads_per_sm, element, implicit, cg, small_f, dual,
                         tensor_cores)  # fmt: skip
    with _COMPILING:
        missing = [name for name in names.values() if (name, device) not in _FUNCTIONS]
        if missing:
            with ThreadPoolExecutor(len(missing)) as pool:
                compiled = list(pool.map(lambda name: _compile(name, device), missing))
            for name, function in zip(missing, compiled, strict=True):
                if name.startswith("tc_hermitian"):  # above the 48 KB a kernel has unasked
                    function.max_dynamic_shared_size_bytes = tensor_core_shape(padded)[1]
                _FUNCTIONS[name, device] = function
        return {key: _FUNCTIONS[name, device] for key, name in names.items()}


_COMPILING = threading.Lock()
_FUNCTIONS: dict[tuple[str, int], Any] = {}  # (kernel's name expression, device) -> function


def kernel_names(
    padded: int,
    threads_per_sm: int,
    element: str,
    implicit: bool,
    cg: bool,
    small_f: int,
    dual: tuple[int, ...],
    tensor_cores: bool,
) -> dict[str, str]:
    """The kernels ``kernels`` compiles, by key: their template instances (name expressions)."""
    threads, _ = launch_shape(padded)
    min_blocks = max(1, threads_per_sm // threads)
    shape = f"{padded}, {threads}, {min_blocks}"
    imp, use_cg = str(implicit).lower(), str(cg).lower()
    names = {"hermitian": f"hermitian_kernel<{shape}, {element}, {imp}>"}
    if small_f:
        row = f"{small_f}, {ROW_UNROLL}, {element}, {imp}"
        names["row_hermitian"] = f"row_hermitian_kernel<{row}>"
    if small_f and not cg:
        names["row_update"] = f"row_update_kernel<{row}>"
    elif padded <= padded_size(MAX_FUSED_F):
        names["update"] = f"update_kernel<{shape}, {element}, {imp}, {use_cg}>"
    for size in dual:
        t = launch_shape(size)[0]
        dual_shape = f"{size}, {t}, {max(1, threads_per_sm // t)}"
        names[f"dual{size}"] = f"dual_update_kernel<{dual_shape}>"
    if tensor_cores:
        names["split"] = "split_kernel"
        names["tc_hermitian"] = f"tc_hermitian_kernel<{padded}>"
    if padded <= padded_size(MAX_FUSED_F):
        names["solve"] = f"solve_kernel<{shape}>"
        if cg:
            names["cg_solve"] = f"cg_solve_kernel<{shape}>"
    return names


def _compile(name: str, device: int) -> Any:
    """One kernel of mo_als.cu, compiled (or loaded from CuPy's disk cache) on `device`."""
    with cp.cuda.Device(device):
        module = cp.RawModule(
            code=kernel_source(), options=("-std=c++17",), name_expressions=[name]
        )
        return module.get_function(name)


_CHECKS = {  # the one-pass checks of kernels/checks.cu by key: their template instances
    **{f"band {np.dtype(t)}": f"band_check_kernel<{c}>"
       for t, c in ((np.int32, "int"), (np.int64, "long long"))},
    **{f"finite {np.dtype(t)}": f"nonfinite_kernel<{c}>"
       for t, c in ((np.float32, "float"), (np.float64, "double"))},
}  # fmt: skip


@cache
def _small_module(source: Path, names: tuple[str, ...], device: int) -> dict[str, Any]:
    """Kernels `names` of a small .cu file (one module), compiled once per device and
    process."""
    module = cp.RawModule(code=source.read_text(), options=("-std=c++17",),
                          name_expressions=list(names))  # fmt: skip
    return {name: module.get_function(name) for name in names}


def _error_kernel(device: int) -> Any:
    """The squared-error kernel (kernels/error.cu)."""
    return _small_module(_ERROR_SOURCE, ("squared_error_kernel",), device)["squared_error_kernel"]


def _check_launch(kernel_key: str, n: int, args: tuple) -> None:
    """Launch a one-pass check over n entries (grid-stride: CHECK_GRID bounds the grid)."""
    blocks, threads = CHECK_GRID
    name = _CHECKS[kernel_key]
    kernel = _small_module(_CHECKS_SOURCE, tuple(_CHECKS.values()), cp.cuda.Device().id)[name]
    kernel((max(1, min(blocks, -(-n // threads))),), (threads,), args)


def kernel_source() -> str:
    """mo_als.cu with the .cuh files beside it (the CG solver, the tensor-core Gram) spliced
    in where it includes them."""
    return _INCLUDE.sub(lambda m: (_SOURCE.parent / m[1]).read_text(), _SOURCE.read_text())


def bfloat16_rows(fixed: Any) -> Any:
    """fixed as the bfloat16 kernels gather it: bfloat16 bits in uint16, shape (n, f), each
    row starting on 16 bytes (a view of an (n, round_up(f, 8)) array).

    float inputs are rounded to the nearest bfloat16 (as ``round_bfloat16``); uint16 inputs
    are taken as bfloat16 bits, copied only when their rows are not laid out so.
    """
    fixed = cp.asarray(fixed)
    n, f = fixed.shape
    stride = -(-f // 8) * 8
    if fixed.dtype == cp.uint16 and fixed.strides == (2 * stride, 2) and fixed.data.ptr % 16 == 0:
        return fixed
    if fixed.dtype != cp.uint16:
        fixed = (round_bfloat16(cp, fixed).view(cp.uint32) >> 16).astype(cp.uint16)
    rows = cp.zeros((n, stride), cp.uint16)
    rows[:, :f] = fixed
    return rows[:, :f]


def _segments(lo: Any, hi: Any, split: int) -> tuple[Any, Any, Any]:
    """(owner, seg_lo, seg_hi): rating ranges [lo, hi) cut into segments of at most `split`
    ratings; owner indexes the ranges."""
    nseg = (hi - lo + split - 1) // split
    ends = cp.cumsum(nseg)
    seg = cp.arange(int(ends[-1]), dtype=cp.int64)
    owner = cp.searchsorted(ends, seg, side="right")
    seg_lo = lo[owner] + (seg - (ends[owner] - nseg[owner])) * split
    return owner.astype(cp.int32), seg_lo, cp.minimum(seg_lo + split, hi[owner])


@dataclass(frozen=True)
class _GramLaunches:
    """How the Gram kernels cover a set of rows (:meth:`CupyBackend._gram_launches`)."""

    row: tuple[Any, Any, Any] | None  # (out, lo, hi) for row_hermitian, longest first
    zero: Any  # out of the split rows (zeroed before their segments add up), or None
    tiled: list[tuple[Any, Any, Any, np.int32]]  # (out, lo, hi, atomic) per tiled launch


@dataclass(frozen=True)
class _UpdateRows:
    """Which rows of a block the update solves how (:meth:`CupyBackend._update_rows`)."""

    fused: Any  # int32 rows for the fused update, longest first
    dual: list[tuple[int, Any]]  # (size, int32 rows with fewer ratings) per dual_update_kernel
    batches: list[tuple[Any, _GramLaunches]]  # long rows in batches: (rows, their Gram)


class _PinnedBlocks:
    """Page-locked host memory kept for reuse, by exact size.

    For arrays made again every half-step (the batches of a factor in host memory), which
    would pay for page-locking each time (about a second per GB). Not CuPy's pinned pool: it
    rounds every request up to a power of two (a factor's 1.1 GB batch took 2 GB) and shares
    those sizes with its own transfer buffers. A block is reused once every view of the
    array it backed is gone, and only by the fit it was made for: one that outlives a
    :meth:`release` (a model's factor pieces) goes back to the system when it goes."""

    def __init__(self) -> None:
        self._free: dict[int, list[Any]] = {}
        self.generation = 0  # raised by each release: memory of an older one is not kept
        self._lock = threading.RLock()  # a finalizer may run inside take() (a collection)

    def take(self, nbytes: int) -> Any:
        with self._lock:
            free = self._free.get(nbytes)
            memory = free.pop() if free else None
        if memory is None:
            try:
                memory = cp.cuda.PinnedMemory(nbytes)
            except cp.cuda.runtime.CUDARuntimeError as exc:
                if not is_out_of_memory(exc):  # (CuPy names no constant for its status)
                    raise
                self.clear()  # the blocks kept for other sizes may be what is missing
                memory = cp.cuda.PinnedMemory(nbytes)
        return memory

    def give_back(self, nbytes: int, memory: Any, generation: int) -> None:
        with self._lock:
            if generation == self.generation:
                self._free.setdefault(nbytes, []).append(memory)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()

    def release(self) -> None:
        """Let go of what is kept, and of what is in use now once it is let go."""
        with self._lock:
            self._free.clear()
            self.generation += 1


_PINNED = _PinnedBlocks()


def pinned_empty(shape: tuple[int, ...], dtype: Any, pooled: bool = False) -> np.ndarray:
    """An uninitialized NumPy array in page-locked host memory.

    By default its memory goes back to the system when the array is dropped (kept, a fit's
    host-tier blocks stayed in the worker's resident memory after it). `pooled`: kept for
    the next array of the same size (:class:`_PinnedBlocks`); ``release_memory`` gives
    what is kept back."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    with out_of_memory_as(f"locking {nbytes:,} bytes of page-locked host memory", _PINNED_FIX,
                          HostMemoryError):  # fmt: skip
        memory = _PINNED.take(nbytes) if pooled else cp.cuda.PinnedMemory(nbytes)
    array = np.ndarray(shape, dtype, cp.cuda.PinnedMemoryPointer(memory, 0))
    if pooled:
        weakref.finalize(array, _PINNED.give_back, nbytes, memory, _PINNED.generation)
    return array


def pinned_copy(array: np.ndarray) -> np.ndarray:
    """A NumPy array in page-locked host memory with the contents of `array`."""
    out = pinned_empty(array.shape, array.dtype)
    out[...] = array
    return out


class _DeviceTarget:
    """Decoded band arrays in GPU memory (:class:`~cumf_dask.data.shards.Target`): each
    decoding thread decodes a chunk into its own page-locked buffer and copies it to the
    GPU on its own stream, beside the other threads' decoding. A pageable copy of each band
    by the thread that builds the CSR ran at about 8 GB/s, half of a Netflix block's load;
    these run at the bus's rate, and no decoded chunk is allocated. The lookahead bounds
    the GPU memory of arrays decoded before the CSR build has taken them."""

    lookahead = LOAD_AHEAD_BYTES

    def __init__(self) -> None:
        self.device = cp.cuda.Device().id
        self._allocated: dict[int, Any] = {}  # an output's pointer: its allocation's event

    def empty(self, size: int, dtype: np.dtype) -> Any:
        """The pool may hand over memory that kernels queued earlier on this thread's
        stream still read (a task returns once its kernels are queued, and frees its
        temporaries then): :meth:`put`'s copies, on streams of their own, wait on the GPU
        for the work queued before this allocation (an event recorded now)."""
        with cp.cuda.Device(self.device):
            out = cp.empty(size, dtype)
            self._allocated[out.data.ptr] = cp.cuda.get_current_stream().record()
            return out

    def chunk(self, out: Any, start: int, size: int, dtype: np.dtype) -> np.ndarray:
        nbytes = size * dtype.itemsize
        return _staging(self.device, nbytes)[0][:nbytes].view(dtype)

    def put(self, out: Any, start: int, chunk: np.ndarray) -> None:
        with cp.cuda.Device(self.device):
            stream = _staging(self.device, chunk.nbytes)[1]
            stream.wait_event(self._allocated[out.data.ptr])
            out[start : start + chunk.size].set(chunk, stream=stream)
            stream.synchronize()


_STAGING = threading.local()


def _staging(device: int, nbytes: int) -> tuple[np.ndarray, Any]:
    """This thread's page-locked buffer (at least `nbytes`) and stream for copies to
    `device`, kept for the thread's life: the decoding pool's threads load every block."""
    found = _STAGING.__dict__.setdefault("by_device", {})
    if device not in found or found[device][0].nbytes < nbytes:
        with cp.cuda.Device(device):
            found[device] = (
                pinned_empty((max(nbytes, STAGING_BYTES),), np.uint8),
                cp.cuda.Stream(non_blocking=True),
            )
    return found[device]


def _copy_out(source: Any, into: np.ndarray, start: int, end: int, after: Any) -> None:
    """Bytes start..end of a device array into host memory, through this thread's
    page-locked buffer on its own stream, once the work `after` marks is done."""
    device = source.device.id
    with cp.cuda.Device(device):
        staging, stream = _staging(device, STAGING_BYTES)
        stream.wait_event(after)
        for lo in range(start, end, staging.nbytes):
            part = source[lo : min(lo + staging.nbytes, end)]
            part.get(stream=stream, out=staging[: part.size])  # waits for the copy
            into[lo : lo + part.size] = staging[: part.size]


def _check_sums(into: tuple[Any, Any], n_rows: int, f: int) -> None:
    """The kernels add to `into` (packed A, B) through raw pointers: it must be two
    C-contiguous float32 device arrays of the block's rows (else the sums land in the
    wrong places, silently)."""
    shapes = ((n_rows, f * (f + 1) // 2), (n_rows, f))
    for name, arr, shape in zip(("A", "B"), into, shapes, strict=True):
        if isinstance(arr, cp.ndarray) and arr.dtype == cp.float32 and arr.shape == shape:
            if arr.flags.c_contiguous:
                continue
            got = "an array that is not C-contiguous (cupy.ascontiguousarray makes one)"
        else:
            got = f"{type(arr).__name__} {getattr(arr, 'dtype', '')} {getattr(arr, 'shape', '')}"
        raise ValueError(f"packed_hermitian(into=...): {name} must be a C-contiguous float32 "
                         f"CuPy array of shape {shape}; got {got}")  # fmt: skip


class CupyBackend(Backend):
    """GPU backend (current CuPy device).

    ``long_row``: rows with more ratings than this are cut into segments of at most that
    many, on several thread blocks, summed with atomics; in ``update`` they take the
    hermitian + solve path, so no single heavy row outlasts the rest.
    ``threads_per_sm``: resident threads per SM that the kernels' register cap aims at
    (more threads: fewer registers, some spilled). The defaults were the fastest measured
    at f = 100 (benchmarks/gpu_notes.md).
    ``dual_sizes``: explicit Cholesky updates of float32 factors solve rows with fewer
    ratings than one of these sizes (and than f) as an n x n system
    (``dual_update_kernel``); () turns that off.
    ``tensor_cores``: ``hermitian`` (and the long rows of ``update``) build the Gram on the
    tensor cores where it applies: float32 factors, explicit ratings, f <= 111, a GPU of
    compute capability 8.0 or later (kernels/tensor_gram.cuh); False: always on the FP32
    units.
    """

    name = "cupy"
    xp = cp

    def __init__(
        self,
        long_row: int = LONG_ROW,
        threads_per_sm: int = THREADS_PER_SM,
        precision: str = "float32",
        dual_sizes: Sequence[int] = DUAL_SIZES,
        tensor_cores: bool = True,
    ):
        super().__init__(precision)
        if long_row < 1:
            raise ValueError(f"long_row must be at least 1, got {long_row}")
        if any(size % TILE or not TILE < size <= MAX_DUAL for size in dual_sizes):
            raise ValueError(f"dual_sizes must be multiples of {TILE} from 16 to {MAX_DUAL}, "
                             f"got {tuple(dual_sizes)}")  # fmt: skip
        self.long_row = int(long_row)
        self.threads_per_sm = threads_per_sm
        self.dual_sizes = tuple(sorted(dual_sizes))
        self.tensor_cores = tensor_cores
        # id(block): {key: (counts, found)}, see _once
        self._found: dict[int, dict[tuple, tuple[Any, Any]]] = {}
        self._copies: Any = None  # the side stream of staged_copy, made at its first use
        self._retired: list[tuple[Any, Block]] = []  # (event, block) kept until the event
        self._lock = threading.Lock()  # for both

    def queued(self) -> Any:
        """An event recorded behind the work queued so far on this thread's stream."""
        return cp.cuda.get_current_stream().record()

    def to_host(self, x: Any, after: Any = None) -> np.ndarray:
        """`x` in host memory, copied through this thread's page-locked buffer on a stream
        of its own, behind the work `after` marks (:meth:`queued`; None: all queued so far).
        A copy on the default stream held up every kernel queued after it (the next
        iteration's, while a checkpoint is saved) until it ended; this one runs beside
        them. A piece copied in parts waits once (`after`), not behind each part the work
        queued meanwhile."""
        if isinstance(x, np.ndarray):
            return x
        if not x.flags.c_contiguous:  # copied on this thread's stream: wait for that too
            x, after = cp.ascontiguousarray(x), None
        out = np.empty(x.shape, x.dtype)
        source, into = x.reshape(-1).view(cp.uint8), out.reshape(-1).view(np.uint8)
        with cp.cuda.Device(x.device.id):
            after = after if after is not None else self.queued()
        # a large array (a factor's piece, not a checkpoint's chunk: those are written on
        # threads already) in ranges on several threads: writing fresh host memory is bound
        # by its page faults (one thread: 3.4-4.0 GB/s for 6.3 GB, memory already touched 13.9)
        threads = HOST_COPY_THREADS if into.size >= HOST_COPY_THREADS * STAGING_BYTES else 1
        step = max(1, -(-into.size // threads))
        jobs = [partial(_copy_out, source, into, start, min(start + step, into.size), after)
                for start in range(0, into.size, step)]  # fmt: skip
        run_threads(jobs, threads, use="host")
        return out

    def host_copy(self, x: Any) -> np.ndarray:
        """`x` copied into (pooled) pinned host memory (from the device: waits for its
        kernels)."""
        out = pinned_empty(x.shape, x.dtype, pooled=True)
        if isinstance(x, np.ndarray):
            out[...] = x
        else:
            cp.ascontiguousarray(x).get(out=out)
        return out

    def release_memory(self) -> None:
        """Give the memory kept for reuse back when a fit ends: the blocks retired whose
        kernels have ended (a fit's last ones are not followed by more), the page-locked
        host memory, and the device memory CuPy's pool keeps cached (every stream's), so
        neither a next fit nor another user of the GPU finds it taken."""
        self._drop_retired()
        _PINNED.release()
        cp.get_default_pinned_memory_pool().free_all_blocks()
        cp.get_default_memory_pool().free_all_blocks()

    def concatenate(self, parts: Sequence[Any], on_device: bool = False) -> Any:
        """Row pieces joined on the device, or in pinned host memory when they are there
        (`on_device`: on the device, each piece in host memory copied straight into its
        rows: no joined copy in host memory first)."""
        if not on_device and isinstance(parts[0], np.ndarray):
            shape = (sum(len(p) for p in parts), *parts[0].shape[1:])
            out = pinned_empty(shape, parts[0].dtype, pooled=True)
            np.concatenate(parts, axis=0, out=out)
            return out
        out = cp.empty((sum(len(p) for p in parts), *parts[0].shape[1:]), parts[0].dtype)
        start = 0
        for part in parts:
            rows = out[start : start + len(part)]
            if isinstance(part, np.ndarray):
                rows.set(np.ascontiguousarray(part))
            else:
                rows[...] = part
            start += len(part)
        return out

    def staged_copy(self, block: Block) -> Block:
        """The block's arrays copied from host memory on a side stream that does not wait for
        the kernels queued on the default stream, so the next block arrives while the
        current one is computed (a host-tier task took its copy plus its kernels). Returns
        once the copy is done.

        Its device memory comes from the side stream's share of CuPy's pool, which knows
        nothing of the default stream: a block's memory could go to the next copy while
        kernels still read it. So its users :meth:`retire` it, and it is kept until they end.
        """
        self._drop_retired()
        with self._lock:  # two loading threads may come first at once
            if self._copies is None:
                self._copies = cp.cuda.Stream(non_blocking=True)
        with self._copies as stream:
            copied = self.block_to_device(block)
            stream.synchronize()
        return replace(copied, source=block)

    def retire(self, block: Block) -> None:
        """Keep `block` (its device memory) until the kernels queued so far have ended."""
        done = cp.cuda.get_current_stream().record()
        with self._lock:
            self._retired.append((done, block))
        self._drop_retired()

    def _drop_retired(self) -> None:
        with self._lock:
            self._retired = [(done, block) for done, block in self._retired if not done.done]

    def memory_capacity(self) -> int | None:
        """The default memory pool's limit when one is set, else the GPU's total memory."""
        limit = cp.get_default_memory_pool().get_limit()
        return int(limit) if limit else int(cp.cuda.Device().mem_info[1])

    def prepare(self, f: int, spec: UpdateSpec | None = None) -> None:
        """Compile (or load from CuPy's disk cache) the kernels for f factors (and spec),
        then rehearse an update and its squared error on a tiny block with rows of every
        path (empty, short, fused, split): with an empty kernel cache, the CuPy kernels of
        the update's bookkeeping then compile while the blocks load instead of after."""
        self._kernels(f, self._element, spec)
        rng = np.random.default_rng(0)
        degrees = np.array([*REHEARSAL_ROWS, self.long_row + 1])
        nnz, n_cols = int(degrees.sum()), 2 * f
        block = Block(
            cp.asarray(np.concatenate([[0], np.cumsum(degrees)])),
            cp.asarray(rng.integers(0, n_cols, nnz, dtype=np.int32)),
            cp.asarray(rng.uniform(1, 5, nnz).astype(np.float32)),
            0, 0, degrees.size, n_cols,
        )  # fmt: skip
        fixed = self.prepare_fixed(cp.asarray(rng.uniform(0, 1, (n_cols, f)), cp.float32))
        X = self.update(block, fixed, cp.asarray(degrees), spec if spec is not None else 0.1)
        self.block_squared_error(block, X, fixed)

    def finite(self, pieces: Sequence[Any]) -> np.ndarray:
        """Whether each array holds only finite values, read back without a blocking CUDA
        call: the flags are copied to pinned memory behind the kernels queued so far, and
        an event is polled until they arrive. A blocking sync here (the check waits for a
        whole half-step) held up the kernel launches of the task computing beside it:
        update Theta's launches took as long as update X's kernels ran (Netflix, H100)."""
        if not pieces:
            return np.zeros(0, bool)
        bad = cp.zeros(len(pieces), cp.int32)  # set by the checks (no CUB all() to compile)
        for k, piece in enumerate(pieces):
            if piece.dtype.kind == "f":
                x = cp.ascontiguousarray(piece, dtype=np.result_type(piece.dtype, np.float32))
                _check_launch(f"finite {x.dtype}", x.size, (x, np.int64(x.size), bad[k:]))
        host = np.frombuffer(cp.cuda.alloc_pinned_memory(bad.nbytes), np.int32, bad.size)
        stream = cp.cuda.get_current_stream()
        cp.cuda.runtime.memcpyAsync(host.ctypes.data, bad.data.ptr, bad.nbytes,
                                    cp.cuda.runtime.memcpyDeviceToHost, stream.ptr)  # fmt: skip
        done = stream.record()
        while not done.done:
            time.sleep(2e-4)
        return host == 0

    @property
    def _element(self) -> str:
        """The Gram kernels' element type of this backend's fixed factors."""
        return "bf16" if self.precision == "bfloat16" else "float"

    def prepare_fixed(self, fixed: Any) -> Any:
        """float32: as given; bfloat16: stored as bfloat16 bits (``bfloat16_rows``)."""
        return fixed if self.precision == "float32" else bfloat16_rows(fixed)

    # ------------------------------------------------------------------ helpers
    def _kernels(
        self, f: int, element: str = "float", spec: UpdateSpec | None = None
    ) -> dict[str, Any]:
        if f > MAX_F:
            raise ValueError(f"the GPU backend supports f up to {MAX_F} factors, got {f}")
        implicit, cg = (spec.implicit, spec.cg) if spec is not None else (False, False)
        small = f if f <= SMALL_F else 0
        dual = self._dual(f, spec, element)
        device = cp.cuda.Device()
        tensor_cores = (self.tensor_cores and element == "float" and not implicit
                        and f <= MAX_TENSOR_CORE_F
                        and int(device.compute_capability) >= 80)  # fmt: skip
        return kernels(
            padded_size(f), device.id, self.threads_per_sm, element, implicit, cg, small, dual,
            tensor_cores,
        )

    def _dual(self, f: int, spec: UpdateSpec | None, element: str) -> tuple[int, ...]:
        """The sizes of dual_update_kernel that an update of f factors uses: explicit
        Cholesky updates of float32 factors on the tiled kernels, sizes below F whose G^T
        fits the shared memory."""
        if element != "float" or (spec is not None and (spec.implicit or spec.cg)):
            return ()
        if not SMALL_F < f <= MAX_FUSED_F:
            return ()
        fits = [dual_smem_bytes(size, f) <= STATIC_SMEM for size in self.dual_sizes]
        return tuple(size for size, fit in zip(self.dual_sizes, fits, strict=True)
                     if fit and size < padded_size(f))  # fmt: skip

    def _row_kernel(self, fixed: Any, spec: UpdateSpec | None) -> bool:
        """Whether the Gram of unsplit rows runs one thread per row (small f)."""
        return "row_hermitian" in self._kernels(fixed.shape[1], _ELEMENT[fixed.dtype], spec)

    @staticmethod
    def _optional(x: Any) -> Any:
        """A contiguous float32 device array, or None (a null pointer for the kernels)."""
        return None if x is None else cp.ascontiguousarray(cp.asarray(x), dtype=cp.float32)

    def _csr(self, block: Block) -> tuple[Any, Any, Any]:
        return (
            cp.ascontiguousarray(cp.asarray(block.indptr), dtype=cp.int64),
            cp.ascontiguousarray(cp.asarray(block.indices), dtype=cp.int32),
            cp.ascontiguousarray(cp.asarray(block.values), dtype=cp.float32),
        )

    @staticmethod
    def _counts(counts: Any) -> Any:
        return cp.ascontiguousarray(cp.asarray(counts), dtype=cp.int64)

    @staticmethod
    def _factor(fixed: Any) -> tuple[Any, np.int32]:
        """The factor as the Gram kernels read it (uint16 = bfloat16 bits as laid out by
        ``bfloat16_rows``, any other dtype as contiguous float32) and the kernels' vec flag:
        f % 4 == 0 on 16-byte aligned data (16-byte float32 row loads, 16-byte stores of A).
        """
        fixed = cp.asarray(fixed)
        if fixed.dtype == cp.uint16:
            fixed = bfloat16_rows(fixed)
        else:
            fixed = cp.ascontiguousarray(fixed, dtype=cp.float32)
        vec = fixed.shape[1] % 4 == 0 and fixed.data.ptr % 16 == 0
        return fixed, np.int32(vec)

    def _gram(
        self,
        csr: tuple,
        fixed: Any,
        vec: np.int32,
        launches: _GramLaunches,
        A: Any,
        B: Any,
        scale: Any = None,
        spec: UpdateSpec | None = None,
        sum_into: bool = False,
        split: tuple[Any, Any] | None = None,
    ):
        """A[out], B[out] of the rows that `launches` cover (:meth:`_gram_launches`): the
        Gram of their fixed rows, scaled by `scale` (implicit; csr's values are then the t
        of each rating). `sum_into`: A holds packed lower triangles, and both are added to.

        With `split` (:meth:`_split`), each tiled launch is two: ``tc_hermitian`` takes the
        segments whose values fit float16 and records which, then ``hermitian`` does the
        others (none, unless some factor value or rating is 16384 or more): the choice is
        made on the GPU, with no wait for the factor being checked."""
        indices, values = csr[1], csr[2]
        f = fixed.shape[1]
        threads, groups = launch_shape(padded_size(f))
        found = self._kernels(f, _ELEMENT[fixed.dtype], spec)
        if launches.row is not None:
            row_out, row_lo, row_hi = launches.row
            args = (indices, values, scale, fixed, row_out, row_lo, row_hi,
                    np.int32(row_out.size), A, B, np.int32(sum_into))  # fmt: skip
            found["row_hermitian"]((-(-row_out.size // 128),), (128,), args)
        if launches.zero is not None and not sum_into:
            A[launches.zero] = 0
            B[launches.zero] = 0
        for seg_out, seg_lo, seg_hi, atomic in launches.tiled:
            out = (seg_out, seg_lo, seg_hi, atomic, A, B, np.int32(sum_into))
            taken = None
            if split is not None:
                halves, fits = split
                taken = cp.empty(seg_out.size, cp.int32)
                tc_threads, smem = tensor_core_shape(padded_size(f))
                found["tc_hermitian"]((seg_out.size,), (tc_threads,),
                                      (indices, values, halves, np.int32(f), fits, taken, *out),
                                      shared_mem=smem)  # fmt: skip
            args = (indices, values, scale, fixed, np.int32(f), vec, taken, *out)
            found["hermitian"]((seg_out.size, groups), (threads,), args)

    def _split(self, fixed: Any, spec: UpdateSpec | None) -> tuple[Any, Any] | None:
        """(halves, fits) for ``tc_hermitian``, made once per call of hermitian or update:
        each row of the float32 factor as two float16 rows, hi then lo (x = hi + lo 2^-11,
        padded to F); fits (one int32) is 0 when a value is outside float16's safe range
        (then ``hermitian`` does all the work). None where the tensor cores do not apply."""
        found = self._kernels(fixed.shape[1], _ELEMENT[fixed.dtype], spec)
        if "tc_hermitian" not in found:
            return None
        kernel = found["split"]
        n, f = fixed.shape
        padded = padded_size(f)
        halves = cp.empty((n, padded), cp.uint32)  # 2 F halves per row
        fits = cp.ones(1, cp.int32)
        blocks = max(1, min(4096, -(-n * padded // 2 // 256)))
        kernel((blocks,), (256,), (fixed, np.int32(f), np.int32(padded), np.int64(n), halves, fits))
        return halves, fits

    def _gram_launches(self, indptr: Any, rows: Any, out: Any, row_kernel: bool) -> _GramLaunches:
        """How :meth:`_gram` covers `rows`: rows of up to long_row ratings are stored whole
        (with `row_kernel`, small f, a thread each, longest first); longer ones are zeroed,
        then cut into segments on several blocks whose partial tiles are added with atomics.
        Finding this synchronizes with the GPU (the sets' sizes)."""
        lo, hi = indptr[rows], indptr[rows + 1]
        split = hi - lo > self.long_row
        short, long = cp.flatnonzero(~split), cp.flatnonzero(split)
        row, zero, tiled = None, None, []
        if row_kernel and short.size:
            short = short[cp.argsort(lo[short] - hi[short])]
            row = (out[short], lo[short], hi[short])
        elif short.size:
            tiled.append((out[short], lo[short], hi[short], np.int32(0)))
        if long.size:
            zero = out[long]
            owner, seg_lo, seg_hi = _segments(lo[long], hi[long], self.long_row)
            tiled.append((zero[owner], seg_lo, seg_hi, np.int32(1)))
        return _GramLaunches(row, zero, tiled)

    def _once(self, block: Block, key: tuple, counts: Any, find: Callable[[], Any]) -> Any:
        """What `find` finds from `block` (how the kernels cover its rows), found once per
        block, `key` and `counts` object: finding it synchronizes with the GPU, and a
        resident block's task otherwise returns as soon as its kernels are queued, so the
        next tasks (a gather, the next part, the other half-step) are queued while they
        run. Forgotten with the block (a staged copy's are its source's)."""
        block = block.source or block  # a staged copy: its rows are its source's
        kept = self._found.get(id(block))
        if kept is None:
            kept = self._found[id(block)] = {}
            weakref.finalize(block, self._found.pop, id(block), None)
        hit = kept.get(key)
        if hit is not None and hit[0] is counts:
            return hit[1]
        found = find()
        kept[key] = (counts, found)
        return found

    def _update_rows(
        self,
        block: Block,
        indptr: Any,
        counts: Any,
        f: int,
        row_kernel: bool,
        dual: tuple[int, ...] = (),
    ) -> _UpdateRows:
        """Which rows of `block` :meth:`update` solves how (:meth:`_once`). `dual`: the
        sizes of dual_update_kernel that take the fused rows with fewer ratings."""

        def find() -> _UpdateRows:
            degree = cp.diff(indptr)
            active = (degree > 0) & (self._counts(counts) > 0)
            fused = cp.zeros(0, cp.int32)
            if f <= MAX_FUSED_F:
                short = cp.flatnonzero(active & (degree <= self.long_row))
                # longest first: they start early instead of forming the tail, and a warp's
                # rows have about as many ratings
                fused = short[cp.argsort(-degree[short])].astype(cp.int32)
                active &= degree > self.long_row
            fused, shorter = self._dual_rows(fused, degree, dual)
            rest = cp.flatnonzero(active).astype(cp.int32)
            step = max(1, BATCH_BYTES // (f * f * 4))
            batches = []
            for lo in range(0, rest.size, step):
                rows = rest[lo : lo + step]
                local = cp.arange(rows.size, dtype=cp.int32)
                batches.append((rows, self._gram_launches(indptr, rows, local, row_kernel)))
            return _UpdateRows(fused, shorter, batches)

        key = ("update", f <= MAX_FUSED_F, row_kernel, self.long_row, dual)
        return self._once(block, key, counts, find)

    @staticmethod
    def _dual_rows(
        fused: Any, degree: Any, sizes: tuple[int, ...]
    ) -> tuple[Any, list[tuple[int, Any]]]:
        """The fused rows (longest first) cut into those left to the fused kernel and, per
        dual size (ascending), those with fewer ratings than it and no fewer than the size
        before it."""
        if not sizes or not fused.size:
            return fused, []
        fewer = -degree[fused]  # ascending
        cuts = cp.searchsorted(fewer, cp.asarray([1 - size for size in sizes]), side="left")
        cuts = [int(c) for c in cuts.tolist()]
        shorter = [(size, fused[cuts[k] : cuts[k - 1] if k else fused.size])
                   for k, size in enumerate(sizes)]  # fmt: skip
        return fused[: cuts[len(sizes) - 1]], [(size, rows) for size, rows in shorter if rows.size]

    def _fused(
        self,
        csr: tuple,
        scale: Any,
        fixed: Any,
        vec: np.int32,
        counts: Any,
        spec: UpdateSpec,
        gram0: Any,
        x0: Any,
        rows: Any,
        X: Any,
    ) -> None:
        """X[rows] by the fused kernel (`rows` int32, longest first); for small f the
        one-thread-per-row kernel."""
        f = fixed.shape[1]
        found = self._kernels(f, _ELEMENT[fixed.dtype], spec)
        lam, weighted = np.float32(spec.lam), np.int32(spec.weighted)
        if "row_update" in found:
            args = (*csr, scale, fixed, counts, lam, weighted, gram0, rows, np.int32(rows.size), X)
            found["row_update"]((-(-rows.size // 128),), (128,), args)
            return
        threads, _ = launch_shape(padded_size(f))
        args = (*csr, scale, fixed, np.int32(f), vec, counts, lam, weighted, gram0, x0,
                np.int32(spec.cg_steps), rows, X)  # fmt: skip
        found["update"]((rows.size,), (threads,), args)

    def _short(
        self, csr: tuple, fixed: Any, counts: Any, spec: UpdateSpec, size: int, rows: Any, X: Any
    ) -> None:
        """X[rows] of rows with fewer than `size` ratings by dual_update_kernel<size>."""
        f = fixed.shape[1]
        kernel = self._kernels(f, _ELEMENT[fixed.dtype], spec)[f"dual{size}"]
        args = (*csr, fixed, np.int32(f), counts, np.float32(spec.lam), np.int32(spec.weighted),
                rows, X)  # fmt: skip
        kernel((rows.size,), (launch_shape(size)[0],), args, shared_mem=dual_smem_bytes(size, f))

    def _solve_all(
        self,
        A: Any,
        B: Any,
        counts: Any,
        spec: UpdateSpec,
        X: Any,
        gram0: Any = None,
        x0: Any = None,
        packed: bool = False,
    ) -> None:
        """X = (G0 + A + reg I)^-1 B row by row (A's lower triangle; `packed`: A holds only
        the lower triangles, as :meth:`pack` lays them out), 0 where counts == 0; CG from x0
        with spec.solver "cg".

        counts: int64. Own kernels up to MAX_FUSED_F; above, cuSOLVER batched Cholesky or the
        generic batched CG on CuPy arrays (packed A unpacked a batch at a time).
        """
        n, f = B.shape
        lam, weighted = np.float32(spec.lam), np.int32(spec.weighted)
        if f <= MAX_FUSED_F:
            threads, _ = launch_shape(padded_size(f))
            found = self._kernels(f, self._element, spec)  # (the fit's: no others compiled)
            if spec.cg:
                args = (A, np.int32(packed), B, np.int32(f), counts, lam, weighted, gram0, x0,
                        np.int32(spec.cg_steps), X)  # fmt: skip
                found["cg_solve"]((n,), (threads,), args)
                return
            blocks = -(-n // systems_per_block(padded_size(f)))
            args = (A, np.int32(packed), B, np.int32(f), np.int64(n), counts, lam, weighted,
                    gram0, X)  # fmt: skip
            found["solve"]((blocks,), (threads,), args)
            return
        import cupyx.lapack

        X[...] = 0
        rows = cp.flatnonzero(counts > 0)
        diag = cp.arange(f)
        reg = regularization(cp, counts, spec).astype(cp.float32)
        step = max(1, BATCH_BYTES // (f * f * 4))
        for lo in range(0, rows.size, step):
            sel = rows[lo : lo + step]
            M = self.unpack(A[sel], f) if packed else A[sel]
            if spec.cg:
                M = symmetric(cp, M)
            if gram0 is not None:
                M += gram0 if spec.cg else cp.tril(gram0)
            M[:, diag, diag] += reg[sel][:, None]
            if spec.cg:
                start = cp.zeros((sel.size, f), cp.float32) if x0 is None else x0[sel]
                X[sel] = batched_cg(cp, M, B[sel], start, spec.cg_steps)
            else:
                # C-order A^T read as column-major lower = A's lower triangle.
                X[sel] = cupyx.lapack.posv(M.transpose(0, 2, 1), B[sel])

    def _weighted(self, block: Block, spec: UpdateSpec | None) -> tuple[tuple, Any]:
        """The block's CSR with each value replaced by its t, and the scales s (None for
        explicit ratings: csr as it is)."""
        indptr, indices, values = self._csr(block)
        scale, value = gram_weights(cp, values, spec)
        if scale is None:
            return (indptr, indices, values), None
        return (indptr, indices, cp.ascontiguousarray(value)), cp.ascontiguousarray(scale)

    def gram(self, fixed: Any) -> Any:
        """fixed^T fixed in float32 (cuBLAS); bfloat16 bits are widened first."""
        fixed = cp.asarray(fixed)
        if fixed.dtype == cp.uint16:
            fixed = (fixed.astype(cp.uint32) << 16).view(cp.float32)
        fixed = fixed.astype(cp.float32, copy=False)
        return fixed.T @ fixed

    def decode_target(self) -> _DeviceTarget:
        """Bands decoded straight into GPU memory (:class:`_DeviceTarget`)."""
        return _DeviceTarget()

    def block_from_bands(self, bands: Bands, threads: int = 1) -> Block:
        """The CSR block built on the GPU, one band at a time as each finishes decoding (the
        host decodes the later bands meanwhile): the band's arrays (on the GPU when decoded
        into :meth:`decode_target`, else copied over) are checked, cut to the block, and
        ordered by one sort of a (row, column) key (int32 when it fits)."""
        (r0, r1), (c0, c1) = bands.rows, bands.cols
        check_columns(c1 - c0)  # so the local columns fit the int32 indices below
        counts = cp.zeros(r1 - r0, cp.int64)
        indices, values = [], []
        with out_of_memory_as(f"building a block of {r1 - r0:,} rows", _SMALLER):
            for i in range(bands.count):
                s = bands.slice(i)
                if not s.val.size:
                    continue
                a, z = bands.rows_of(s)
                major, minor, val = cp.asarray(s.major), cp.asarray(s.minor), cp.asarray(s.val)
                rows_here = min(bands.band_rows, bands.n_major - s.first)
                flags = cp.zeros(2, cp.int32)
                _check_launch(f"band {minor.dtype}", val.size, (
                    major, minor, val, np.int64(val.size), np.int32(rows_here),
                    np.int64(bands.n_minor), np.int32(a - s.first), np.int32(z - s.first),
                    np.int64(c0), np.int64(c1), flags))  # fmt: skip
                damaged, outside = flags.get()
                if damaged:
                    raise bands.damaged(s)
                row = major.astype(cp.int64) - (a - s.first)  # rows of the band within [a, z)
                if outside:
                    keep = (row >= 0) & (row < z - a) & (minor >= c0) & (minor < c1)
                    row, minor, val = row[keep], minor[keep], val[keep]
                key = cp.int32 if (z - a) * (c1 - c0) < 2**31 else cp.int64
                col = minor.astype(key) - c0
                order = cp.argsort(row.astype(key) * (c1 - c0) + col)
                indices.append(col[order].astype(cp.int32))
                values.append(val[order])
                counts[a - r0 : z - r0] += bin_counts(cp, row, z - a)  # rows checked above
            indptr = cp.zeros(r1 - r0 + 1, cp.int64)
            cp.cumsum(counts, out=indptr[1:])
            empty = [cp.zeros(0, cp.int32)], [cp.zeros(0, cp.float32)]
            return Block(
                indptr, cp.concatenate(indices or empty[0]), cp.concatenate(values or empty[1]),
                r0, c0, r1 - r0, c1 - c0,
            )  # fmt: skip

    def host_block(self, bands: Bands, threads: int = 1) -> Block:
        """The CSR block built on the host into pinned memory, which the kernels' inputs
        are copied from at the bus's full rate (pageable memory: about a fifth of it)."""
        block = block_on_host(bands, threads)
        return replace(
            block,
            indptr=pinned_copy(block.indptr),
            indices=pinned_copy(block.indices),
            values=pinned_copy(block.values),
        )

    def block_squared_error(self, block: Block, X: Any, fixed: Any) -> float:
        """One kernel over the block's CSR (kernels/error.cu), float64 sums."""
        if block.nnz == 0:
            return 0.0
        indptr, indices, values = self._csr(block)
        X = cp.ascontiguousarray(cp.asarray(X), dtype=cp.float32)
        fixed = cp.ascontiguousarray(cp.asarray(fixed), dtype=cp.float32)
        f = X.shape[1]
        out = cp.zeros(1, cp.float64)
        kernel = _error_kernel(cp.cuda.Device().id)
        args = (indptr, indices, values, X, fixed, np.int32(f), out)
        kernel((block.n_rows,), (128,), args, shared_mem=4 * f)
        return float(out[0])

    # ------------------------------------------------------------------ ALS kernels
    def hermitian(
        self, block: Block, fixed: Any, spec: UpdateSpec | None = None
    ) -> tuple[Any, Any]:
        with out_of_memory_as(f"building A, B for a block of {block.n_rows} rows", _SMALLER):
            fixed, vec = self._factor(fixed)
            f = fixed.shape[1]
            csr, scale = self._weighted(block, spec)
            # Rows with ratings are stored by _gram; only the others need zeros.
            A = cp.empty((block.n_rows, f, f), cp.float32)
            B = cp.empty((block.n_rows, f), cp.float32)
            empty, launches = self._rated_rows(block, csr[0], self._row_kernel(fixed, spec))
            if empty is not None:
                A[empty] = 0
                B[empty] = 0
            self._gram_rated(launches, csr, scale, fixed, vec, A, B, spec, sum_into=False)
            return A, B

    def packed_hermitian(
        self, block: Block, fixed: Any, spec: UpdateSpec | None = None, into: Any = None
    ) -> tuple[Any, Any]:
        """The Gram kernels write the packed layout and add to `into` (or to zeros)
        themselves: no f x f A, no pack, no separate sum (update Theta of the Facebook
        shape spent as long on those as on the Gram)."""
        with out_of_memory_as(f"building A, B for a block of {block.n_rows} rows", _SMALLER):
            fixed, vec = self._factor(fixed)
            f = fixed.shape[1]
            csr, scale = self._weighted(block, spec)
            if into is None:
                into = (cp.zeros((block.n_rows, f * (f + 1) // 2), cp.float32),
                        cp.zeros((block.n_rows, f), cp.float32))  # fmt: skip
            else:
                _check_sums(into, block.n_rows, f)
            _, launches = self._rated_rows(block, csr[0], self._row_kernel(fixed, spec))
            self._gram_rated(launches, csr, scale, fixed, vec, *into, spec, sum_into=True)
            return into

    def _rated_rows(
        self, block: Block, indptr: Any, row_kernel: bool
    ) -> tuple[Any, _GramLaunches | None]:
        """(rows without ratings or None, how the Gram kernels cover the others or None) of
        `block`, for :meth:`hermitian` and :meth:`packed_hermitian` (:meth:`_once`: a
        resident block's partial Hermitian is queued without waiting for the GPU)."""

        def find() -> tuple[Any, _GramLaunches | None]:
            degree = cp.diff(indptr)
            empty = cp.flatnonzero(degree == 0)
            rows = cp.flatnonzero(degree > 0).astype(cp.int32)
            launches = self._gram_launches(indptr, rows, rows, row_kernel) if rows.size else None
            return (empty if empty.size else None), launches

        return self._once(block, ("rated", row_kernel, self.long_row), None, find)

    def _gram_rated(
        self, launches: _GramLaunches | None, csr: tuple, scale: Any, fixed: Any,
        vec: np.int32, A: Any, B: Any, spec: UpdateSpec | None, sum_into: bool,
    ) -> None:  # fmt: skip
        """:meth:`_gram` of the rows that have ratings, as `launches` cover them (None:
        there are none)."""
        if launches is not None:
            split = self._split(fixed, spec) if launches.tiled else None
            self._gram(csr, fixed, vec, launches, A, B, scale, spec, sum_into, split)

    def solve(
        self,
        A: Any,
        B: Any,
        counts: Any,
        lam: float | UpdateSpec,
        *,
        gram0: Any = None,
        x0: Any = None,
        packed: bool = False,
    ) -> Any:
        spec = as_spec(lam)
        if spec.implicit and gram0 is None:
            raise ValueError("the implicit model's solve needs gram0 (the fixed factor's Gram)")
        with out_of_memory_as(f"solving {B.shape[0]} systems", _SMALLER):
            A = cp.ascontiguousarray(cp.asarray(A), dtype=cp.float32)
            B = cp.ascontiguousarray(cp.asarray(B), dtype=cp.float32)
            X = cp.empty(B.shape, cp.float32)
            if B.shape[0]:
                self._solve_all(A, B, self._counts(counts), spec, X, self._optional(gram0),
                                self._optional(x0) if spec.cg else None, packed)  # fmt: skip
            return X

    def update(
        self,
        block: Block,
        fixed: Any,
        counts: Any,
        lam: float | UpdateSpec,
        *,
        gram0: Any = None,
        x0: Any = None,
    ) -> Any:
        """Fused hermitian + solve per row; long rows through split hermitian + solve; short
        rows (fewer ratings than f) as n x n systems (``dual_update_kernel``)."""
        spec = as_spec(lam)
        with out_of_memory_as(f"updating a block of {block.n_rows} rows", _SMALLER):
            if spec.implicit and gram0 is None:
                gram0 = self.gram(fixed)
            gram0 = self._optional(gram0) if spec.implicit else None
            x0 = self._optional(x0) if spec.cg else None
            fixed, vec = self._factor(fixed)
            f = fixed.shape[1]
            csr, scale = self._weighted(block, spec)
            X = cp.zeros((block.n_rows, f), cp.float32)
            plan = self._update_rows(block, csr[0], counts, f, self._row_kernel(fixed, spec),
                                     self._dual(f, spec, _ELEMENT[fixed.dtype]))  # fmt: skip
            counts = self._counts(counts)
            if plan.fused.size:
                self._fused(csr, scale, fixed, vec, counts, spec, gram0, x0, plan.fused, X)
            for size, rows in plan.dual:
                self._short(csr, fixed, counts, spec, size, rows, X)
            split = self._split(fixed, spec) if plan.batches else None
            for rows, launches in plan.batches:
                A = cp.empty((rows.size, f, f), cp.float32)
                B = cp.empty((rows.size, f), cp.float32)
                self._gram(csr, fixed, vec, launches, A, B, scale, spec, split=split)
                Xb = cp.empty((rows.size, f), cp.float32)
                start = None if x0 is None else cp.ascontiguousarray(x0[rows])
                self._solve_all(A, B, counts[rows], spec, Xb, gram0, start)
                X[rows] = Xb
            return X
