"""Reading the bands a block R^(ij) overlaps from a store, decoded in parallel.

A block of rows [r0, r1) and columns [c0, c1) overlaps bands r0 // t_major ... and in each
the tiles c0 // t_minor ...; a band's share of those tiles is one contiguous range of its
arrays (``ptr``). :func:`read_bands` decodes them on the thread pool (:mod:`.shards`)
into :class:`~cumf_dask.blocks.Bands`, in host memory or straight into the backend's
(``Backend.decode_target``: the GPU's, copied there from the decoding threads); the backend
then makes the CSR block where it computes (``Backend.block_from_bands``: on the host with
NumPy, on the GPU with CuPy: the host's memory bandwidth, not decoding, limits the host
placement).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..blocks import Bands, BandSlice
from .integrity import check_ptr, entry_requests, ptr_request
from .shards import HOST_BANDS, Target

if TYPE_CHECKING:
    from .store import Orientation, RatingsStore, Split


def read_bands(
    store: RatingsStore,
    orient: Orientation,
    rows: tuple[int, int],
    cols: tuple[int, int],
    split: Split = "train",
    threads: int = 1,
    target: Target = HOST_BANDS,
) -> Bands:
    """Start decoding every band range the block overlaps on `threads` threads into
    `target`'s arrays (NumPy by default), in band order, and return at once:
    ``Bands.slice(i)`` waits for band i only, so a consumer can work on the first bands
    while the later ones decode. Each band is checked to be the one asked for, its tile
    pointer to end at its band_nnz, its chunks against their recorded crc32c; the values
    are not checked yet."""
    from .store import band_group

    (r0, r1), (c0, c1) = rows, cols
    t_major, t_minor = store.tile_size(orient)
    n_major, n_minor = store.shape(orient)
    group = band_group(orient, split)
    bands = list(range(r0 // t_major, min(-(-r1 // t_major), math.ceil(n_major / t_major))))
    t0, t1 = c0 // t_minor, max(c0 // t_minor, -(-c1 // t_minor))
    checked = store.checked_bands(orient, split, bands, threads)
    ptrs = store.read([ptr_request(path, crcs) for path, _, crcs in checked], threads)
    n_tiles = math.ceil(n_minor / t_minor)
    requests, sizes = [], []
    for b, ptr, (path, nnz, crcs) in zip(bands, ptrs, checked, strict=True):
        check_ptr(store, path, ptr, n_tiles, nnz, f"{orient} band {b} ({split})")
        requests += entry_requests(path, int(ptr[t0]), int(ptr[t1]), nnz, crcs)
        sizes.append(int(ptr[t1] - ptr[t0]))
    reading = store.start(requests, threads, target)

    def decoded(i: int) -> BandSlice:
        b = bands[i]
        return BandSlice(b, b * t_major, *(reading.get(3 * i + k) for k in range(3)))

    return Bands(f"{store.url}/{group}", rows, cols, t_major, n_major, n_minor, sizes, decoded,
                 store.ensure_same_build)  # fmt: skip
