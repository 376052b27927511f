"""Declared sizes, and whether a shape can be built on this machine, checked before writing.

However few its ratings, a store costs memory per row, per column and per band:

* its rating counts per row and column (``row_nnz``, ``col_nnz``, int64), which ``info``,
  ``train`` and the report after ``ingest``/``generate`` read whole: 8 bytes each;
* a little bookkeeping per band (its task and its summary) while it is built;
* for ``generate``, each band in the making: its rows' degrees, ranks and pair keys, about
  100 bytes a row (planted factors only for the rows rated: :meth:`.PlantedModel.ratings`).

A declared m of 1e14 needs 800 TB for its counts alone: :func:`check_fits` refuses such a
shape at once, where the build would grow until the system kills it. Large sparse shapes
that fit are built: a Facebook-shaped store (1e9 x 4.8e7) needs about 8.4 GB of them.
Likewise :func:`check_disk` refuses a local store that cannot fit on its disk (generate's
estimate: :data:`NOISY_RATING_BYTES`), and :func:`check_seed` a seed the hashes would take
for another.
"""

from __future__ import annotations

import shutil
from numbers import Integral
from pathlib import Path
from typing import Any

from ..errors import ConfigError, PlanError

COUNT_BYTES = 8  # an int64 rating count per row and per column
BAND_BYTES = 2048  # a band's task and summary while the store is built (generously)
BAND_ROW_BYTES = 96  # per row of the band being generated: degrees, ranks, pair keys
#: The least disk a generated rating of varied float values takes (both orientations and
#: the test set; blosc-lz4 with shuffle cannot shrink random float32 values much). Measured
#: on generated stores (10% held out): 4.7-13.6 bytes per rating unrounded (the values alone
#: 3.8-6.4), 1.4-8.6 rounded, 0.15 for a full matrix of one rounded value. So only ratings
#: neither rounded nor clipped to one bound (PlantedModel.varied_values) get this estimate,
#: a few times below what they took: no store that fits is refused.
NOISY_RATING_BYTES = 1.0


def check_dimension(name: str, value: Any) -> None:
    """A declared m or n: None (ids mapped) or an integer >= 1."""
    if value is None:
        return
    noun = "users" if name == "m" else "items"
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ConfigError(f"{name} must be an int (the number of {noun}); got "
                          f"{type(value).__name__} {value!r}: declare the largest id + 1 as an "
                          f"int, or leave {name} out to map the ids")  # fmt: skip
    if value < 1:
        raise ConfigError(f"{name} must be >= 1 (the number of {noun}); got {value!r}: declare "
                          f"the largest id + 1, or leave {name} out to map the ids")  # fmt: skip


def available_memory() -> int:
    """Bytes of memory this machine can give now (psutil's 'available')."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_fits(m: int | None, n: int | None, bands: int, fix: str, band_rows: int = 0) -> None:
    """Raise PlanError when a store of the declared sizes (None: not known yet) with `bands`
    bands, generated `band_rows` rows at a time (0: not generated), needs more memory than
    is available. The message names the largest need and its fix (`fix` for the counts)."""
    needs = [
        (COUNT_BYTES * ((m or 0) + (n or 0)), "8-byte rating counts per row and column, "
         "which info and train read whole", fix),
        (BAND_BYTES * bands, f"the bookkeeping of {bands:,} bands",
         "raise tile_rows and tile_cols (fewer bands)"),
        (BAND_ROW_BYTES * band_rows, f"generating bands of {band_rows:,} rows",
         "lower tile_rows (fewer rows per band)"),
    ]  # fmt: skip
    total, have = sum(b for b, _, _ in needs), available_memory()
    if total <= have:
        return
    sizes = ", ".join(f"{k}={v:,}" for k, v in (("m", m), ("n", n)) if v is not None)
    parts = "; ".join(f"{b / 1e9:,.1f} GB for {what}" for b, what, _ in needs if b >= total / 100)
    raise PlanError(
        f"a store of {sizes} cannot be built on this machine: it needs about {total / 1e9:,.1f} "
        f"GB of memory ({parts}) and {have / 1e9:,.1f} GB is available; "
        + max(needs, key=lambda need: need[0])[2]
    )


def check_disk(url: str, need: float, what: str, fix: str) -> None:
    """Raise PlanError when `what`, about `need` bytes at least, cannot fit in the free space
    of the folder a local `url` is written in (its nearest existing parent)."""
    folder = Path(url).absolute().parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if need > free:
        raise PlanError(
            f"{what} needs at least {need / 1e9:,.1f} GB on disk and {folder} has "
            f"{free / 1e9:,.1f} GB free; {fix}"
        )


#: bits of a split seed the train/test split's hash keeps (hashing.split_mask); the
#: generator's seed keeps 64
SPLIT_SEED_BITS = 63


def check_seed(name: str, value: Any, bits: int = 64) -> None:
    """A seed in [0, 2**bits): the hashes keep its low `bits` bits, so any other integer would
    silently give the data of the seed it equals there (-1 that of 2**64 - 1)."""
    if isinstance(value, bool) or not isinstance(value, Integral) or not 0 <= value < 1 << bits:
        raise ConfigError(
            f"'{name}' must be an integer in [0, 2**{bits}), got {value!r}: the hashes keep "
            f"{bits} bits of a seed, so any other would silently repeat one in that range"
        )
