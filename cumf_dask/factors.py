"""Initial factors, identical whatever the plan: drawn in fixed chunks of rows from the seed."""

from __future__ import annotations

import numpy as np

INIT_CHUNK = 65536  # rows per independently seeded chunk


def init_factor(
    n_rows: int,
    f: int,
    seed: int,
    start: int = 0,
    stop: int | None = None,
    stream: int = 1,
    scale: float | None = None,
) -> np.ndarray:
    """Rows [start, stop) of an (n_rows, f) float32 factor, uniform in [0, scale) (default
    scale 1/sqrt(f); the implicit model uses implicit's 0.01).

    Each chunk of INIT_CHUNK rows has its own generator keyed by (seed, stream, chunk), so
    any slice is the same as the slice of the whole, however the factor is partitioned.
    """
    stop = n_rows if stop is None else stop
    if not 0 <= start <= stop <= n_rows:
        raise ValueError(f"init_factor: rows [{start}, {stop}) are not within [0, {n_rows})")
    out = np.empty((stop - start, f), np.float32)
    scale = np.float32(1.0 / np.sqrt(f) if scale is None else scale)
    for chunk in range(start // INIT_CHUNK, -(-stop // INIT_CHUNK)):
        lo, hi = chunk * INIT_CHUNK, min((chunk + 1) * INIT_CHUNK, n_rows)
        rng = np.random.default_rng([seed, stream, chunk])
        values = rng.random((hi - lo, f), dtype=np.float32) * scale
        a, b = max(lo, start), min(hi, stop)
        out[a - start : b - start] = values[a - lo : b - lo]
    return out
