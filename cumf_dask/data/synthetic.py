"""Synthetic rating stores from the planted model (``cumf-dask generate``), built in parallel.

The model and its sampling are in :mod:`.planted`: every rating is a pure function of the
settings, so the store does not depend on the number of workers, their scheduling or even
the tile sizes (tiles only order the output). One task per row band writes its band
(training and test), then one task per column band transposes
(:func:`~.bands.transpose_band`), then :func:`~.bands.finish_store` marks the store
complete, last. A local store is built beside the target and moved into place only when
complete, so an interrupted run never replaces a good store.

GPU: with ``use_gpu`` each row band's pairs, rating values and split are computed with CuPy
and only the stored arrays are copied to the host, to be compressed and written there; the
transposition copies each tile it reads to the GPU and orders the band there. The degrees
and the split are identical to the CPU's; a row's columns are too but for rare
floating-point ties, and values match to float32 rounding (the GPU note of :mod:`.planted`
says why).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from functools import partial
from typing import Any, Literal

from ..checks import check_choice, check_fraction, check_positive_int
from ..devices import has_cuda
from ..errors import ConfigError, out_of_memory_as, warn
from ..paths import is_url, normalize_url
from .bands import band_module, finish_store, init_store, transpose_band, write_band
from .hashing import split_mask
from .limits import NOISY_RATING_BYTES, SPLIT_SEED_BITS, check_disk, check_fits, check_seed
from .parallel import Progress, run_tasks
from .planted import PlantedModel
from .sampling import Array
from .store import RatingsStore, check_tiles, default_tile
from .target import (
    check_target,
    claim,
    discard,
    naming_target,
    publish,
    resolve_target,
    work_url,
    writing,
)


def generate(
    url: str | os.PathLike[str],
    model: PlantedModel,
    *,
    test_fraction: float = 0.1,
    split_seed: int = 0,
    tile_rows: int | None = None,
    tile_cols: int | None = None,
    client: Any = None,
    overwrite: bool = False,
    progress: Progress | None = None,
    use_gpu: bool | Literal["auto"] = "auto",
) -> RatingsStore:
    """Generate a planted-model store at `url`: one task per row band, then per column band.

    `model` comes from :meth:`PlantedModel.create` (which validates the generator settings).
    `client` is a ``distributed.Client`` (tasks run on its workers; a local path must be
    shared by them) or None: a thread pool of dask's ``num_workers`` (default: one per core).
    `progress(stage, done, total)` is called as bands finish, stage "generate" then
    "transpose". `use_gpu`: True computes pairs, values and split with CuPy (and sorts the
    transposition there), "auto" where a worker sees a GPU, False never. On any error the
    partial store is removed (a local `url`) and is never marked complete. A shape whose
    bookkeeping exceeds this machine's memory is a PlanError before anything is written
    (:func:`~.limits.check_fits`), and so is a local store that cannot fit on its disk
    (:func:`~.limits.check_disk`); running out of memory while building, a DeviceMemoryError.

    `test_fraction` of the ratings beyond the ``max(m, n)`` that `nonempty` forces is held
    out (the forced ones stay in training), with a CumfWarning when that is far less than
    `test_fraction` of all of them, and a ConfigError when every rating is held out.
    `split_seed` is an integer in [0, 2**63).
    """
    check_fraction("test_fraction", test_fraction)
    check_seed("split_seed", split_seed, SPLIT_SEED_BITS)
    check_positive_int("tile_rows", tile_rows, optional=True)
    check_positive_int("tile_cols", tile_cols, optional=True)
    check_choice("use_gpu", use_gpu, (True, False, "auto"))
    if use_gpu is True and client is None and not has_cuda():
        raise ConfigError("use_gpu=True but no CUDA GPU with cupy is visible; use 'auto' or False")
    if client is None and use_gpu == "auto":
        use_gpu = has_cuda()  # the tasks run in this process
    m, n, nnz = model.m, model.n, model.nnz
    tile_rows = tile_rows or default_tile(m, n, nnz)
    tile_cols = tile_cols or default_tile(n, m, nnz)
    check_tiles(m, n, nnz, tile_rows, tile_cols)
    bands = 2 * math.ceil(m / tile_rows) + math.ceil(n / tile_cols)  # row, test, column
    # a band never holds more than m rows, however tall its tiles
    check_fits(m, n, bands, "lower m and n (or the preset's scale)", min(tile_rows, m))
    url = normalize_url(url)
    lock = claim(url)  # one writer per target; a killed run's work folder is removed
    try:
        check_target(url, overwrite)  # the old store stays until the new one is complete
        if not is_url(url) and model.varied_values:
            check_disk(resolve_target(url), NOISY_RATING_BYTES * nnz,
                       f"a store of {nnz:,} unrounded ratings (typically 5-14 bytes each, at "
                       f"least {NOISY_RATING_BYTES:g})",
                       "free space there, write the store elsewhere, or lower nnz (or the "
                       "preset's scale)")  # fmt: skip
        with (
            writing(url),
            out_of_memory_as(
                f"generating a {m:,} x {n:,} store",
                "lower m and n, tile_rows (rows per band), or rank",
            ),
        ):
            write = partial(_write, model=model, test_fraction=test_fraction,
                            split_seed=split_seed, tile_rows=tile_rows, tile_cols=tile_cols,
                            client=client, progress=progress, use_gpu=use_gpu)  # fmt: skip
            store = _build(url, model, tile_rows, tile_cols, write)
    finally:
        lock.release()
    _warn_few_held_out(model, test_fraction, store.nnz_test)
    return store


def _build(
    url: str, model: PlantedModel, tile_rows: int, tile_cols: int, write: Callable[[str], None]
) -> RatingsStore:
    """Write the store beside `url` (`write` fills the folder it is given), then publish it
    (see generate); a failed build is removed, and its errors name `url`, not the hidden
    work folder."""
    work = work_url(url)
    try:
        with naming_target(work, url):
            init_store(work, model.m, model.n, tile_rows, tile_cols, overwrite=True)
            write(work)
        return publish(work, url)
    except BaseException:
        discard(work)
        raise


def _write(
    work: str,
    model: PlantedModel,
    test_fraction: float,
    split_seed: int,
    tile_rows: int,
    tile_cols: int,
    client: Any,
    progress: Progress | None,
    use_gpu: bool | Literal["auto"],
) -> None:
    """Write every row band, then every column band, of the store at `work`, and mark it
    complete."""
    m, n = model.m, model.n
    bands = [
        (work, model, a, tile_rows, tile_cols, test_fraction, split_seed, use_gpu)
        for a in range(math.ceil(m / tile_rows))
    ]
    compile_once = use_gpu is True  # a thread pool here: its kernels compile in band 0
    rows = run_tasks(client, _row_band, bands, "generate", progress, compile_once)
    if not any(r[0]["nnz"] for r in rows):
        raise ConfigError(
            f"generate: every rating was held out for testing (test_fraction={test_fraction} "
            f"of nnz={model.nnz:,}), none is left to train on; lower test_fraction or raise nnz"
        )
    gpu = (use_gpu,) if use_gpu else ()  # transpose_band sorts on the CPU by default
    cols = run_tasks(client, transpose_band,
                     [(work, b, *gpu) for b in range(math.ceil(n / tile_cols))], "transpose",
                     progress, compile_once)  # fmt: skip
    n_test = sum(r[1]["nnz"] for r in rows) if test_fraction > 0 else 0
    source = {
        "kind": "synthetic",
        "preset": model.preset,
        "scale": model.scale,
        **model.settings,
        "mean": model.mean,
        "signal_std": model.signal_std,
        "test_fraction": test_fraction,
        "split_seed": split_seed,
        # what a perfect rank-`rank` learner scores on the test set (sigma, up to
        # sampling, unless ratings are clipped or rounded)
        "planted_test_rmse": math.sqrt(sum(r[2] for r in rows) / n_test) if n_test else None,
    }
    finish_store(
        work, [r[0] for r in rows], cols, [r[1] for r in rows] if test_fraction > 0 else None,
        source=source,
    )  # fmt: skip


def _warn_few_held_out(model: PlantedModel, test_fraction: float, n_test: int) -> None:
    """A CumfWarning when far fewer ratings than `test_fraction` asks (under half) are held
    out: nonempty's forced ratings stay in training, and few ratings leave few to draw."""
    asked = test_fraction * model.nnz
    if n_test >= asked / 2:
        return
    forced = (f"the {model.n_forced:,} ratings that give every row and column one (nonempty) "
              "stay in training; raise nnz, or allow empty rows and columns (nonempty: false, "
              "--allow-empty)") if model.n_forced else "raise nnz"  # fmt: skip
    warn(f"held out {n_test:,} of {model.nnz:,} ratings ({n_test / model.nnz:.1%}), far less "
         f"than test_fraction={test_fraction} asks: {forced}")


def _row_band(
    url: str,
    model: PlantedModel,
    band: int,
    tile_rows: int,
    tile_cols: int,
    test_fraction: float,
    split_seed: int,
    use_gpu: bool | Literal["auto"],
) -> tuple[dict[str, float], dict[str, float], float]:
    """Generate and write row band `band` (training and test): (row summary, test summary,
    squared error of the test ratings against the planted model)."""
    r0 = band * tile_rows
    row, col, val, test, sq_err = _band_ratings(
        model, r0, min(r0 + tile_rows, model.m), tile_cols, test_fraction, split_seed,
        band_module(use_gpu),
    )  # fmt: skip
    train = ~test
    summary = write_band(url, "row", band, row[train], col[train], val[train])
    if test_fraction <= 0:
        return summary, {}, 0.0
    test_summary = write_band(url, "test", band, row[test], col[test], val[test])
    return summary, test_summary, sq_err


def _band_ratings(
    model: PlantedModel,
    r0: int,
    r1: int,
    tile_cols: int,
    test_fraction: float,
    split_seed: int,
    xp: Any,
) -> tuple[Array, Array, Array, Array, float]:
    """(row, col, val, test, squared error of the test ratings) of rows [r0, r1), computed
    with `xp` and returned as its arrays (the GPU's temporaries are freed on return)."""
    row, col, forced = model.band_pairs(r0, r1, tile_cols, xp)
    val, clean = model.ratings(row, col, xp)
    test = split_mask(row, col, test_fraction, split_seed) & ~forced
    err = val[test].astype(xp.float64) - clean[test]
    return row, col, val, test, float(err @ err)
