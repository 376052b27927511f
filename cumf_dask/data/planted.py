"""The planted low-rank model behind ``cumf-dask generate``: presets, degrees, pairs, values.

The model: ``R = X* Theta*^T + noise`` on a sparse set of (row, column) pairs, where X* is
m x rank, Theta* is n x rank and the noise is Gaussian with a known sigma, so a perfect
learner of rank >= `rank` scores a test RMSE of sigma (when ratings are not clipped or rounded).

Everything is a pure function of the generator settings, computed by counter-based hashing
(splitmix64) rather than a stateful random stream:

* Row degrees: row i has popularity rank ``pi(i)`` (a keyed pseudo-random permutation); the
  degree of rank r follows the continuous Zipf mass of ``(x + 1)^-skew`` over [r, r + 1),
  capped at n (the heaviest rows become full rows) and telescoped (degree = D(r+1) - D(r)
  with D a rounded cumulative), so the degrees sum to `nnz` exactly (given the same
  floating point on every worker), and any task computes any row's degree alone.
* Columns of a row: draws j = 0, 1, 2... of row i pick a popularity rank from the same Zipf
  law and map it to a column with another keyed permutation (popular columns spread out);
  the row keeps its first `degree` distinct draws. Rows too dense for that (or where draws
  repeat too often) use the equivalent exponential race over all columns. Both are
  successive sampling without replacement in proportion to popularity.
* nonempty: ``max(m, n)`` forced pairs (k mod m, k mod n) through the permutations give every
  row and every column at least one rating; forced pairs always stay in the training set.
* X*[i], Theta*[v] and the noise of (i, v) are hashed Box-Muller normals keyed by the index
  (and pair), so any worker regenerates any of them: nothing is stored or shared.

GPU: the rating values (factors, dot products, noise) can be computed with CuPy; which pairs
exist is always computed on the CPU. The GPU's values match the CPU's to float32 rounding,
not bit for bit; each is deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from ..compat import import_cupy
from ..config import GenerateConfig
from ..errors import ConfigError

# ----------------------------------------------------------------------------- presets


@dataclass(frozen=True)
class Preset:
    """A data set's shape and the cuMF paper's ALS settings for it (f factors, lambda)."""

    name: str
    m: int
    n: int
    nnz: int
    f: int
    lam: float


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("netflix", 480_189, 17_770, 99_000_000, 100, 0.05),
        Preset("yahoomusic", 1_000_990, 624_961, 252_800_000, 100, 1.4),
        Preset("hugewiki", 50_082_603, 39_780, 3_100_000_000, 100, 0.05),
        Preset("sparkals", 660_000_000, 2_400_000, 3_500_000_000, 10, 0.05),
        Preset("factorbird", 229_000_000, 195_000_000, 38_500_000_000, 5, 0.05),
        Preset("facebook", 1_000_000_000, 48_000_000, 112_000_000_000, 16, 0.05),
    )
}


def resolve_shape(gen: GenerateConfig) -> tuple[int, int, int]:
    """(m, n, nnz): the preset's numbers times `scale`, overridden by explicit m, n, nnz.

    Raises ConfigError for an unknown preset, missing or non-positive sizes, more ratings
    than cells, or (with nonempty) fewer ratings than max(m, n).
    """
    base: dict[str, int | None] = {"m": None, "n": None, "nnz": None}
    preset = None
    if gen.preset is not None:
        preset = PRESETS.get(gen.preset.lower())
        if preset is None:
            raise ConfigError(
                f"generate.preset {gen.preset!r} is unknown; choose one of {', '.join(PRESETS)} "
                "or give m, n and nnz"
            )
        if not gen.scale > 0:
            raise ConfigError(f"generate.scale must be > 0, got {gen.scale}")
        base = {k: max(1, round(getattr(preset, k) * gen.scale)) for k in base}
    elif gen.scale != 1.0:
        raise ConfigError(
            f"generate.scale={gen.scale} multiplies a preset's sizes, but no preset is set; "
            "choose a preset or give m, n and nnz at the size you want"
        )
    for key in base:
        value = getattr(gen, key)
        if value is not None:
            base[key] = value
    missing = [k for k, v in base.items() if v is None]
    if missing:
        raise ConfigError(
            f"generate needs {', '.join(missing)}: give a preset ({', '.join(PRESETS)}) "
            "or m, n and nnz"
        )
    m, n, nnz = (int(base[k]) for k in ("m", "n", "nnz"))  # type: ignore[arg-type]
    for key, value in (("m", m), ("n", n), ("nnz", nnz)):
        if value <= 0:
            raise ConfigError(f"generate.{key} must be a positive integer, got {value}")
    if nnz > m * n:
        hint = "lower nnz or enlarge m, n"
        if preset is not None and (gen.m, gen.n, gen.nnz) == (None, None, None):
            density = preset.nnz / (preset.m * preset.n)
            hint = f"scale keeps nnz/m and nnz/n; use scale >= {density:.3g} for {preset.name}"
        raise ConfigError(
            f"generate: nnz={nnz} ratings do not fit in a {m} x {n} matrix ({m * n} cells); " + hint
        )
    if gen.nonempty and nnz < max(m, n):
        raise ConfigError(
            f"generate: nonempty needs at least max(m, n) = {max(m, n)} ratings, nnz is {nnz}; "
            "raise nnz or set nonempty: false"
        )
    return m, n, nnz


# ----------------------------------------------------------------------------- hashing

_GOLDEN = 0x9E3779B97F4A7C15
_M64 = (1 << 64) - 1
# Independent hash streams of one seed.
_ROW_RANK, _COL_RANK, _FORCED, _DRAW, _RACE, _X, _THETA, _NOISE = range(1, 9)


def _splitmix(x: int) -> int:
    """splitmix64 of a Python int (used for keys)."""
    z = (x + _GOLDEN) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _key(seed: int, stream: int) -> int:
    return _splitmix(_splitmix(seed & _M64) ^ stream)


def _mix(xp: Any, z: Any) -> Any:
    """The splitmix64 finalizer on a uint64 array (a bijection of 64-bit words)."""
    z = z ^ (z >> xp.uint64(30))
    z *= xp.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> xp.uint64(27)
    z *= xp.uint64(0x94D049BB133111EB)
    z ^= z >> xp.uint64(31)
    return z


def _hash(xp: Any, key: Any, a: Any) -> Any:
    """64-bit hash of the words `a` under `key` (a scalar or a broadcastable uint64 array)."""
    return _mix(xp, xp.asarray(a).astype(xp.uint64) * xp.uint64(_GOLDEN) + key)


def _unit(xp: Any, z: Any) -> Any:
    """Uniform floats in (0, 1) from 64-bit hashes."""
    return ((z >> xp.uint64(11)).astype(xp.float64) + 0.5) * 2.0**-53


def _normal_pairs(xp: Any, z: Any) -> tuple[Any, Any]:
    """Two standard normals per 64-bit hash (Box-Muller on its two 32-bit halves)."""
    u1 = ((z >> xp.uint64(32)).astype(xp.float64) + 0.5) * 2.0**-32
    u2 = (z & xp.uint64(0xFFFFFFFF)).astype(xp.float64) * (2 * math.pi * 2.0**-32)
    r = xp.sqrt(-2.0 * xp.log(u1))
    return r * xp.cos(u2), r * xp.sin(u2)


class _Permutation:
    """A keyed pseudo-random bijection of [0, size): multiply/xorshift rounds on the next
    power of two, cycle-walked into range; ``inverse`` undoes it."""

    def __init__(self, size: int, key: int):
        self.size = size
        bits = max(2, (size - 1).bit_length())
        self.mask = np.uint64((1 << bits) - 1)
        self.shift = np.uint64((bits + 1) // 2)  # one xorshift by >= bits/2 undoes itself
        words = [_splitmix(key + i) for i in range(4)]
        self.mul = [np.uint64(words[0] | 1), np.uint64(words[1] | 1)]
        self.add = [np.uint64(words[2]), np.uint64(words[3])]
        self.inv = [np.uint64(pow(int(a), -1, 1 << 64)) for a in self.mul]

    def _forward(self, x: np.ndarray) -> np.ndarray:
        for a, b in zip(self.mul, self.add, strict=True):
            x = (x * a + b) & self.mask
            x ^= x >> self.shift
        return x

    def _backward(self, x: np.ndarray) -> np.ndarray:
        for a, b in zip(self.inv[::-1], self.add[::-1], strict=True):
            x = x ^ (x >> self.shift)
            x = ((x - b) * a) & self.mask
        return x

    def _walk(self, step: Callable[[np.ndarray], np.ndarray], x: Any) -> np.ndarray:
        x = step(np.asarray(x, dtype=np.int64).astype(np.uint64))
        todo = np.flatnonzero(x >= self.size)
        while todo.size:
            y = step(x[todo])
            x[todo] = y
            todo = todo[y >= self.size]
        return x.astype(np.int64)

    def __call__(self, x: Any) -> np.ndarray:
        return self._walk(self._forward, x)

    def inverse(self, y: Any) -> np.ndarray:
        return self._walk(self._backward, y)


def _zipf_cdf(x: Any, skew: float) -> Any:
    """Phi(x) = integral of (t + 1)^-skew over [0, x]: the continuous Zipf mass below rank x."""
    if abs(1.0 - skew) < 1e-12:
        return np.log1p(x)
    return np.expm1((1.0 - skew) * np.log1p(x)) / (1.0 - skew)


def _zipf_cdf_inv(y: np.ndarray, skew: float) -> np.ndarray:
    if abs(1.0 - skew) < 1e-12:
        return np.expm1(y)
    return np.expm1(np.log1p((1.0 - skew) * y) / (1.0 - skew))


# ----------------------------------------------------------------------------- the model

#: rows whose degree is at least this share of the free columns use the exponential race
_DENSE_SHARE = 0.5
#: cells (rows x columns) of one batch of the exponential race
_RACE_CELLS = 1 << 22
#: ratings per chunk when computing values (bounds the rank-wide temporaries)
_VALUE_CHUNK = 1 << 20
#: Theta* is tabulated once per process when n * rank is at most this
_THETA_TABLE = 1 << 24


@dataclass(frozen=True)
class PlantedModel:
    """The planted model of a synthetic store: shape, degrees, factors and noise.

    Ratings have mean `mean` and signal std `signal_std` before noise: the midpoint-ish
    ``lo + 0.625 (hi - lo)`` and ``(hi - lo) / 4`` of a rating scale [lo, hi] (3.5 and 1 on
    1-5 stars), or 3.5 and 1 when no scale is set. X* and Theta* entries are normals with an
    offset so that ``X* Theta*^T`` has exactly rank `rank` and those moments.
    """

    m: int
    n: int
    nnz: int
    rank: int = 10
    noise: float = 0.1
    skew: float = 0.8
    rating_min: float | None = None
    rating_max: float | None = None
    round: bool = False
    nonempty: bool = True
    seed: int = 0

    @classmethod
    def from_config(cls, gen: GenerateConfig) -> PlantedModel:
        """Validate `gen` and resolve its shape (see :func:`resolve_shape`)."""
        m, n, nnz = resolve_shape(gen)
        checks = (
            (gen.rank >= 1, f"generate.rank must be >= 1, got {gen.rank}"),
            (gen.noise >= 0, f"generate.noise (sigma) must be >= 0, got {gen.noise}"),
            (gen.skew >= 0, f"generate.skew (Zipf exponent) must be >= 0, got {gen.skew}"),
            (
                gen.rating_min is None or gen.rating_max is None or gen.rating_min < gen.rating_max,
                f"generate.rating_min ({gen.rating_min}) must be below rating_max "
                f"({gen.rating_max})",
            ),
        )
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        return cls(
            m=m, n=n, nnz=nnz, rank=gen.rank, noise=float(gen.noise), skew=float(gen.skew),
            rating_min=gen.rating_min, rating_max=gen.rating_max, round=gen.round,
            nonempty=gen.nonempty, seed=gen.seed,
        )  # fmt: skip

    @classmethod
    def from_source(cls, source: dict[str, Any]) -> PlantedModel:
        """The model of a generated store, from its ``source`` attribute."""
        if source.get("kind") != "synthetic":
            raise ConfigError("this store was not generated: it has no planted model")
        return cls(**{f.name: source[f.name] for f in fields(cls)})

    # ------------------------------------------------------------------ rating moments
    @property
    def mean(self) -> float:
        lo, hi = self.rating_min, self.rating_max
        return lo + 0.625 * (hi - lo) if lo is not None and hi is not None else 3.5

    @property
    def signal_std(self) -> float:
        lo, hi = self.rating_min, self.rating_max
        return (hi - lo) / 4 if lo is not None and hi is not None else 1.0

    @cached_property
    def _factor_moments(self) -> tuple[float, float]:
        """(offset, std) of the factor entries: rank*a^2 = mean, rank(2a^2b^2 + b^4) = std^2."""
        a2 = abs(self.mean) / self.rank
        b2 = math.sqrt(a2 * a2 + self.signal_std**2 / self.rank) - a2
        return math.sqrt(a2), math.sqrt(b2)

    # ------------------------------------------------------------------ degrees
    @cached_property
    def _row_perm(self) -> _Permutation:
        return _Permutation(self.m, _key(self.seed, _ROW_RANK))

    @cached_property
    def _col_perm(self) -> _Permutation:
        return _Permutation(self.n, _key(self.seed, _COL_RANK))

    @cached_property
    def _forced_perm(self) -> _Permutation:
        return _Permutation(self.n, _key(self.seed, _FORCED))

    @property
    def n_forced(self) -> int:
        """Forced pairs (k mod m, k mod n), k < max(m, n): one per row and column at least."""
        return max(self.m, self.n) if self.nonempty else 0

    def _forced_count(self, rank: np.ndarray) -> np.ndarray:
        q, rem = divmod(self.n_forced, self.m)
        return q + (rank < rem).astype(np.int64)

    def _sum_capacity(self, h: int) -> int:
        """Free columns (n minus forced ones) summed over the ranks below h."""
        q, rem = divmod(self.n_forced, self.m)
        return h * self.n - (q * h + min(h, rem))

    @cached_property
    def _degree_plan(self) -> tuple[int, int, float, float]:
        """(h, R, Phi(h), Phi(m) - Phi(h)): ranks below h are full rows; the other ranks share
        the R remaining extra ratings by Zipf mass, each at most its capacity minus one before
        rounding (so at most its capacity after). h is the least rank where that holds; the
        condition is monotone in h, hence the bisection."""
        m, s = self.m, self.skew
        extras = self.nnz - self.n_forced
        q, rem = divmod(self.n_forced, m)

        def fits(h: int) -> bool:
            if h >= m:
                return True
            rest = extras - self._sum_capacity(h)
            phi = _zipf_cdf(np.array([h, h + 1, m], np.float64), s)
            cap = self.n - q - (1 if h < rem else 0)
            return rest * (phi[1] - phi[0]) <= (cap - 1) * (phi[2] - phi[0])

        lo, hi = 0, m
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        phi_h, phi_m = _zipf_cdf(np.array([lo, m], np.float64), s)
        return lo, extras - self._sum_capacity(lo), float(phi_h), float(phi_m - phi_h)

    def _extras(self, rank: np.ndarray) -> np.ndarray:
        """Unforced ratings of the rows with these ranks (telescoped: they sum to exactly
        nnz - n_forced over all ranks)."""
        h, rest, phi_h, width = self._degree_plan
        cap = self.n - self._forced_count(rank)
        if h >= self.m:
            return cap
        r = np.maximum(rank, h).astype(np.float64)

        def cum(x: np.ndarray) -> np.ndarray:
            return np.rint(rest * ((_zipf_cdf(x, self.skew) - phi_h) / width))

        mid = (cum(r + 1) - cum(r)).astype(np.int64)
        return np.where(rank < h, cap, np.clip(mid, 0, cap))

    def degrees(self, rows: np.ndarray) -> np.ndarray:
        """Ratings (training and test) of the given rows; they sum to nnz over all rows."""
        rank = self._row_perm(rows)
        return self._forced_count(rank) + self._extras(rank)

    # ------------------------------------------------------------------ pairs
    def band_pairs(
        self, r0: int, r1: int, tile_cols: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(row, col, forced) of rows [r0, r1), sorted by (column tile, row, column)."""
        coder = _KeyCoder(r1 - r0, tile_cols)
        rows = np.arange(r0, r1, dtype=np.int64)
        rank = self._row_perm(rows)
        f = self._forced_count(rank)
        need = self._extras(rank)
        local = np.repeat(np.arange(rows.size), f)
        j = np.arange(local.size) - np.repeat(np.cumsum(f) - f, f)
        k = rank[local] + j * self.m
        forced_keys = np.sort(coder.encode(local, self._forced_perm(k % self.n)))

        cap = self.n - f
        dense = (need > 0) & (need >= _DENSE_SHARE * cap)
        pieces = [forced_keys]
        sparse_keys, switch = self._draw_sparse(rows, need * ~dense, cap, forced_keys, coder)
        pieces.append(sparse_keys)
        dense_rows = np.flatnonzero(dense | (switch > 0))
        if dense_rows.size:
            remaining = np.where(dense, need, switch)[dense_rows]
            taken = np.sort(np.concatenate(pieces))
            pieces.append(self._draw_race(rows, dense_rows, remaining, taken, coder))
        keys = np.sort(np.concatenate(pieces), kind="stable")
        local, col = coder.decode(keys)
        return local + r0, col, _sorted_isin(forced_keys, keys)

    def _draw_sparse(
        self,
        rows: np.ndarray,
        need: np.ndarray,
        cap: np.ndarray,
        forced_keys: np.ndarray,
        coder: _KeyCoder,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The first `need` distinct unforced columns of each row's draws j = 0, 1, 2, ...

        Each round draws exactly what a row still needs, so it never overshoots and the
        result does not depend on the rounds. Returns the accepted keys (sorted) and, per
        row, how many ratings are still missing where further draws would cost more than
        the race over all columns (those rows are finished by :meth:`_draw_race`).
        """
        key = np.uint64(_key(self.seed, _DRAW))
        phi_n = float(_zipf_cdf(np.float64(self.n), self.skew))
        need = need.copy()
        drawn = np.zeros(rows.size, np.int64)
        switch = np.zeros(rows.size, np.int64)
        accepted = []
        pool = forced_keys  # keys of the rows still drawing, sorted
        while True:
            active = np.flatnonzero(need > 0)
            if not active.size:
                break
            k = need[active]
            local = np.repeat(active, k)
            j = np.arange(local.size) - np.repeat(np.cumsum(k) - k, k) + drawn[local]
            u = _unit(np, _hash(np, _hash(np, key, rows[local]), j))
            rank = np.minimum(_zipf_cdf_inv(u * phi_n, self.skew), self.n - 1).astype(np.int64)
            cand = _sorted_unique(coder.encode(local, self._col_perm(rank)))
            new = cand[~_sorted_isin(pool, cand)]
            accepted.append(new)
            got = np.bincount(coder.local(new), minlength=rows.size)[active]
            need[active] -= got
            drawn[active] += k
            left = need[active]
            # expected draws to finish vs the race's cost (one key per free column)
            slow = (left > 0) & (left * (k + 1) > (got + 1) * cap[active])
            switch[active[slow]] = left[slow]
            need[active[slow]] = 0
            pool = np.sort(np.concatenate([pool, new]))
            pool = pool[need[coder.local(pool)] > 0]
        return np.sort(np.concatenate(accepted)) if accepted else np.zeros(0, np.int64), switch

    def _draw_race(
        self,
        rows: np.ndarray,
        which: np.ndarray,
        need: np.ndarray,
        taken: np.ndarray,
        coder: _KeyCoder,
    ) -> np.ndarray:
        """`need` more columns for rows `which` by an exponential race over all columns:
        the columns with the least Exp(1) / popularity, skipping the `taken` keys."""
        key = _key(self.seed, _RACE)
        ranks = np.arange(self.n, dtype=np.float64)
        weight = _zipf_cdf(ranks + 1, self.skew) - _zipf_cdf(ranks, self.skew)
        racing = np.zeros(rows.size, bool)
        racing[which] = True
        taken_local, taken_col = coder.decode(taken[racing[coder.local(taken)]])
        order = np.argsort(taken_local, kind="stable")
        taken_local, taken_col = taken_local[order], taken_col[order]
        out = []
        per_batch = max(1, _RACE_CELLS // self.n)
        for b0 in range(0, which.size, per_batch):
            batch = which[b0 : b0 + per_batch]
            z = _hash(np, _hash(np, np.uint64(key), rows[batch])[:, None], np.arange(self.n))
            race = -np.log(_unit(np, z)) / weight
            lo = np.searchsorted(taken_local, batch[0])
            hi = np.searchsorted(taken_local, batch[-1], side="right")
            slot = np.searchsorted(batch, taken_local[lo:hi])
            race[slot, self._col_perm.inverse(taken_col[lo:hi])] = np.inf
            want = need[b0 : b0 + per_batch]
            top = int(want.max())
            order = np.argpartition(race, top - 1, axis=1)[:, :top]
            order = np.take_along_axis(
                order, np.argsort(np.take_along_axis(race, order, 1), axis=1), 1
            )
            pick = np.arange(top)[None, :] < want[:, None]
            local = np.broadcast_to(batch[:, None], order.shape)[pick]
            out.append(coder.encode(local, self._col_perm(order[pick])))
        return np.concatenate(out)

    # ------------------------------------------------------------------ values
    def _factors(self, xp: Any, stream: int, index: Any) -> Any:
        """Rows `index` of X* (stream _X) or Theta* (stream _THETA), float32 (len, rank)."""
        offset, std = self._factor_moments
        if stream == _THETA and self.mean < 0:
            offset = -offset
        pairs = (self.rank + 1) // 2
        base = _hash(xp, xp.uint64(_key(self.seed, stream)), index)
        z = _hash(xp, base[:, None], xp.arange(pairs))
        c, s = _normal_pairs(xp, z)
        normals = xp.stack([c, s], axis=2).reshape(len(index), 2 * pairs)[:, : self.rank]
        return (offset + std * normals).astype(xp.float32)

    def x(self, rows: Any, xp: Any = np) -> Any:
        """Rows of the planted X* (float32, len(rows) x rank)."""
        return self._factors(xp, _X, xp.asarray(rows))

    def theta(self, cols: Any, xp: Any = np) -> Any:
        """Rows of the planted Theta* (float32, len(cols) x rank)."""
        return self._factors(xp, _THETA, xp.asarray(cols))

    def clean(self, rows: Any, cols: Any, xp: Any = np) -> Any:
        """The planted X*[rows] . Theta*[cols] (float32), before noise, clipping, rounding."""
        rows, cols = xp.asarray(rows), xp.asarray(cols)
        return (self.x(rows, xp) * self.theta(cols, xp)).sum(axis=1)

    def ratings(
        self, rows: np.ndarray, cols: np.ndarray, use_gpu: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        """(rating, clean) of the pairs: clean plus noise, clipped and rounded, float32."""
        xp = import_cupy() if use_gpu else np
        vals, cleans = [], []
        r_lo = int(rows.min()) if rows.size else 0
        x_rows = self.x(xp.arange(r_lo, int(rows.max()) + 1 if rows.size else 0), xp)
        table = _theta_table(self, use_gpu) if self.n * self.rank <= _THETA_TABLE else None
        for c0 in range(0, rows.size, _VALUE_CHUNK):
            r = xp.asarray(rows[c0 : c0 + _VALUE_CHUNK])
            c = xp.asarray(cols[c0 : c0 + _VALUE_CHUNK])
            if table is not None:
                theta = table[c]
            else:
                uniq, inv = xp.unique(c, return_inverse=True)
                theta = self.theta(uniq, xp)[inv.ravel()]
            clean = (x_rows[r - r_lo] * theta).sum(axis=1)
            z = _hash(xp, _hash(xp, xp.uint64(_key(self.seed, _NOISE)), r), c)
            val = clean + self.noise * _normal_pairs(xp, z)[0]
            if self.rating_min is not None:
                val = xp.maximum(val, self.rating_min)
            if self.rating_max is not None:
                val = xp.minimum(val, self.rating_max)
            if self.round:
                val = xp.rint(val)
            vals.append(val.astype(xp.float32))
            cleans.append(clean)
        if not vals:
            return np.zeros(0, np.float32), np.zeros(0, np.float32)
        val, clean = xp.concatenate(vals), xp.concatenate(cleans)
        return (val.get(), clean.get()) if use_gpu else (val, clean)


# ----------------------------------------------------------------------------- building


@lru_cache(maxsize=2)
def _theta_table(model: PlantedModel, use_gpu: bool) -> Any:
    """All of Theta* for a small n, once per process."""
    xp = import_cupy() if use_gpu else np
    return model.theta(xp.arange(model.n), xp)


def _sorted_unique(x: np.ndarray) -> np.ndarray:
    """The distinct values of `x`, sorted."""
    x = np.sort(x)
    return x[np.concatenate(([True], x[1:] != x[:-1]))] if x.size else x


def _sorted_isin(ref: np.ndarray, x: np.ndarray) -> np.ndarray:
    """np.isin(x, ref) for a sorted `ref`."""
    if not ref.size:
        return np.zeros(x.shape, bool)
    return ref[np.minimum(np.searchsorted(ref, x), ref.size - 1)] == x


class _KeyCoder:
    """(local row, column) <-> one int64 whose order is (column tile, row, column): the
    order of a band in the store, so sorting keys both deduplicates and orders a band."""

    def __init__(self, n_rows: int, tile_cols: int):
        self.tile_cols = tile_cols
        self.col_bits = (tile_cols - 1).bit_length()
        self.row_bits = (max(n_rows, 1) - 1).bit_length()

    def encode(self, local: np.ndarray, col: np.ndarray) -> np.ndarray:
        tile, within = np.divmod(col, self.tile_cols)
        return (((tile << self.row_bits) | local) << self.col_bits) | within

    def local(self, keys: np.ndarray) -> np.ndarray:
        return (keys >> self.col_bits) & ((1 << self.row_bits) - 1)

    def decode(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        within = keys & ((1 << self.col_bits) - 1)
        return self.local(keys), (keys >> (self.col_bits + self.row_bits)) * self.tile_cols + within
