"""The planted low-rank model behind ``cumf-dask generate``: degrees, pairs and values.

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

The hashes are in :mod:`.hashing`, the permutations, Zipf law and pair keys in
:mod:`.sampling`, the preset shapes in :mod:`.presets`; this module holds the model itself.

GPU: the pairs (:meth:`PlantedModel.band_pairs`) and the rating values (factors, dot
products, noise) can be computed with CuPy. The row degrees are computed on the CPU either
way (in float64, then copied over), so every row has exactly the same number of ratings and
they still sum to nnz. The columns a row draws go through floating point (the inverse Zipf
law, the race's logarithms), and CuPy's expm1/log1p/log need not round as NumPy's do: where
a draw lands within rounding of a rank boundary, or two race entries within rounding of
each other, the GPU can pick a different column than the CPU. That is rare (the tests
compare small models exactly), and each path is deterministic. The GPU's values match the
CPU's to float32 rounding, not bit for bit.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from ..checks import MAX_RATING, check_number, check_positive_int, check_scale
from ..errors import ConfigError
from .hashing import hash64, normal_pairs, stream_key, unit
from .limits import check_seed
from .presets import resolve_shape
from .sampling import (
    Array,
    KeyCoder,
    Permutation,
    bin_counts,
    repeat_rows,
    sorted_isin,
    sorted_unique,
    zipf_cdf,
    zipf_cdf_inv,
    zipf_mass,
)

#: fields that say how the shape was chosen, not what the model is
_PROVENANCE = ("preset", "scale")
# Independent hash streams of one seed.
_ROW_RANK, _COL_RANK, _FORCED, _DRAW, _RACE, _X, _THETA, _NOISE = range(1, 9)

# ----------------------------------------------------------------------------- the model

#: rows whose degree is at least this share of the free columns use the exponential race
_DENSE_SHARE = 0.5
#: cells (rows x columns) of one batch of the exponential race
_RACE_CELLS = 1 << 22
#: the planted model's rank when none is given (capped at min(m, n))
DEFAULT_RANK = 10
#: ratings per chunk when computing values (bounds the rank-wide temporaries)
_VALUE_CHUNK = 1 << 20
#: Draws at steep skews repeat the few popular columns: a row lacking a few columns draws
#: them a few at a time, and the per-round test of _draw_sparse never judges that slow (a
#: 1000-column band of skew 5 took 380,000 rounds, 30 s; a million-column band of skew 3
#: more than 3 million, 12 minutes). From round _HOPELESS_FROM on (every row starts in
#: round 1, so this does not depend on the band), at each power of two, a row goes to the
#: race where its expected draws to finish (left over p, the law's share of its free
#: columns) exceed _HOPELESS times the race's cost, or its last column alone expects more
#: than twice _MAX_ROUNDS rounds (1 / p); after _MAX_ROUNDS every row does. Rows of skews
#: up to 1 take at most a few hundred rounds and are far from hopeless, rows of skew 2
#: about 8,000 rounds for a million columns: they draw exactly as before.
_HOPELESS_FROM = 64
_HOPELESS = 64
_MAX_ROUNDS = 1 << 14
#: Theta* is tabulated once per process when n * rank is at most this
_THETA_TABLE = 1 << 24
#: the degrees use differences of Phi where their rounding error bound is at most this
#: (ratings, in any cumulative count): below half a rating no degree can leave [0, capacity]
_DIFFERENCE_SLACK = 0.25
#: the race divides by differences of Phi where each is within this relative error
_WEIGHT_SLACK = 2.0**-10
#: the largest hashed normal (hashing.normal_pairs: Box-Muller of a 32-bit uniform, at
#: least 2**-33): factor entries and noise never exceed it in standard deviations
_NORMAL_MAX = math.sqrt(-2.0 * math.log(2.0**-33))


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

    #: how the shape was chosen (recorded in the store's source; not part of the model)
    preset: str | None = field(default=None, compare=False)
    scale: float = field(default=1.0, compare=False)

    @classmethod
    def create(
        cls,
        *,
        preset: str | None = None,
        scale: float = 1.0,
        m: int | None = None,
        n: int | None = None,
        nnz: int | None = None,
        rank: int | None = None,
        noise: float = 0.1,
        skew: float = 0.8,
        rating_min: float | None = None,
        rating_max: float | None = None,
        round: bool = False,
        nonempty: bool = True,
        seed: int = 0,
    ) -> PlantedModel:
        """Validate the generator settings and resolve the shape (see :func:`resolve_shape`).

        The keywords are those of ``data.generate`` in a config (``GenerateConfig``), so
        ``PlantedModel.create(**dataclasses.asdict(gen))`` builds a config's model. The rating
        scale is checked as ingest checks a declared one (finite, within +-1e9, min < max),
        and with `round` it must hold an integer; the seed is one of [0, 2**64). `rank`
        (default 10, or min(m, n) when smaller) is at most min(m, n), and ratings not clipped
        on both sides must stay within +-1e9.
        """
        m, n, nnz = resolve_shape(preset=preset, scale=scale, m=m, n=n, nnz=nnz, nonempty=nonempty)
        rank = min(DEFAULT_RANK, m, n) if rank is None else rank
        check_positive_int("rank", rank)
        if rank > min(m, n):
            raise ConfigError(
                f"'rank' must be at most min(m, n) = {min(m, n)}, got {rank}: X* Theta*^T of "
                f"{m:,} x {n:,} has no higher rank; lower rank (--rank)"
            )
        check_number("noise", noise, 0)
        check_number("skew", skew, 0)
        check_scale(rating_min, rating_max)
        check_seed("seed", seed)
        model = cls(
            m=m, n=n, nnz=nnz, rank=rank, noise=float(noise), skew=float(skew),
            rating_min=rating_min, rating_max=rating_max, round=round, nonempty=nonempty,
            seed=seed, preset=preset.lower() if preset else None, scale=scale,
        )  # fmt: skip
        lo, hi = model.value_range
        if lo is not None and hi is not None and lo > hi:
            raise ConfigError(
                f"generate: round needs an integer in [rating_min, rating_max], and "
                f"[{rating_min}, {rating_max}] holds none; widen the scale, or do not round"
            )
        model._check_reach()
        return model

    def _check_reach(self) -> None:
        """Ratings not clipped on both sides stay within +-MAX_RATING, as ingest requires:
        a ConfigError naming noise otherwise (mean and signal_std are 3.5 and 1 there)."""
        if self.rating_min is not None and self.rating_max is not None:
            return
        offset, std = self._factor_moments
        clean = self.rank * (offset + std * _NORMAL_MAX) ** 2  # |X*[i] . Theta*[v]| at most
        reach = clean + self.noise * _NORMAL_MAX
        if reach > MAX_RATING:
            raise ConfigError(
                f"'noise' {self.noise:g} makes ratings up to {reach:.3g}, beyond +-"
                f"{MAX_RATING:.0e}; lower it (at most {(MAX_RATING - clean) / _NORMAL_MAX:.3g}),"
                " or clip the ratings (set both rating_min and rating_max)"
            )

    @classmethod
    def from_source(cls, source: dict[str, Any]) -> PlantedModel:
        """The model of a generated store, from its ``source`` attribute."""
        if source.get("kind") != "synthetic":
            raise ConfigError("this store was not generated: it has no planted model")
        settings = {f.name: source[f.name] for f in fields(cls) if f.name not in _PROVENANCE}
        return cls(**settings, preset=source.get("preset"), scale=source.get("scale", 1.0))

    @property
    def settings(self) -> dict[str, Any]:
        """The fields that decide every rating (all but `preset` and `scale`), by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _PROVENANCE}

    # ------------------------------------------------------------------ rating moments
    @property
    def mean(self) -> float:
        lo, hi = self.rating_min, self.rating_max
        return lo + 0.625 * (hi - lo) if lo is not None and hi is not None else 3.5

    @property
    def signal_std(self) -> float:
        lo, hi = self.rating_min, self.rating_max
        return (hi - lo) / 4 if lo is not None and hi is not None else 1.0

    @property
    def value_range(self) -> tuple[float | None, float | None]:
        """The range the ratings are clipped to (None: open): [rating_min, rating_max], or
        with `round` the integers in it, [ceil(rating_min), floor(rating_max)], so that a
        rounded rating never leaves the scale (ratings are rounded, then clipped)."""
        lo, hi = self.rating_min, self.rating_max
        if self.round:
            lo = None if lo is None else float(math.ceil(lo))
            hi = None if hi is None else float(math.floor(hi))
        return lo, hi

    @property
    def varied_values(self) -> bool:
        """Whether the ratings are varied floats, which compression cannot shrink much (see
        :data:`.limits.NOISY_RATING_BYTES`): not rounded, and clipped on both sides or on
        neither (one bound alone may catch them all) to a range of many float32 steps."""
        lo, hi = self.rating_min, self.rating_max
        if self.round:
            return False
        if lo is None or hi is None:
            return lo is None and hi is None
        return hi - lo >= 2.0**-10 * max(abs(lo), abs(hi))

    @cached_property
    def _factor_moments(self) -> tuple[float, float]:
        """(offset, std) of the factor entries: rank*a^2 = mean, rank(2a^2b^2 + b^4) = std^2."""
        a2 = abs(self.mean) / self.rank
        b2 = math.sqrt(a2 * a2 + self.signal_std**2 / self.rank) - a2
        return math.sqrt(a2), math.sqrt(b2)

    # ------------------------------------------------------------------ degrees
    @cached_property
    def _row_perm(self) -> Permutation:
        return Permutation(self.m, stream_key(self.seed, _ROW_RANK))

    @cached_property
    def _col_perm(self) -> Permutation:
        return Permutation(self.n, stream_key(self.seed, _COL_RANK))

    @cached_property
    def _forced_perm(self) -> Permutation:
        return Permutation(self.n, stream_key(self.seed, _FORCED))

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
    def _degree_plan(self) -> tuple[int, int, bool, float, float]:
        """(h, R, relative, base, width): ranks below h are full rows; the other ranks share
        the R remaining extra ratings by Zipf mass, each at most its capacity minus one before
        rounding (so at most its capacity after). h is the least rank where that holds; the
        condition is monotone in h, hence the bisection. The ranks below x >= h get
        ``rint(R * mass(x) / width)`` of the R, where mass(x) is the Zipf mass over [h, x]:
        ``Phi(x) - base`` (base = Phi(h)), or where `relative`, ``zipf_mass(h, x)``.

        The difference of Phi is the original form, kept where its rounding cannot move a
        count by _DIFFERENCE_SLACK of a rating, so that the degrees of stores generated
        before do not change; at steep skews (from about 3, with many full rows) it cancels,
        and the relative form, which does not, takes over. Either way the counts at h and m
        are 0 and R exactly, so the degrees telescope to nnz; :meth:`_extras` checks every
        degree it computes, so no store is ever written with fewer ratings than nnz.
        """
        m, n, s = self.m, self.n, self.skew
        extras = self.nnz - self.n_forced
        q, rem = divmod(self.n_forced, m)

        def least(fits: Callable[[int, int, int], bool]) -> int:
            lo, hi = 0, m
            while lo < hi:
                h = (lo + hi) // 2
                if fits(h, extras - self._sum_capacity(h), n - q - (1 if h < rem else 0)):
                    hi = h
                else:
                    lo = h + 1
            return lo

        def fits_difference(h: int, rest: int, cap: int) -> bool:
            phi = zipf_cdf(np, np.array([h, h + 1, m], np.float64), s)
            return rest * (phi[1] - phi[0]) <= (cap - 1) * (phi[2] - phi[0])

        h = least(fits_difference)
        phi_h, phi_m = zipf_cdf(np, np.array([h, m], np.float64), s)
        width = float(phi_m - phi_h)
        # Phi(x) = expm1(z) / (1 - s) with z = (1 - s) log1p(x): a few ulps, and |z| more
        # where z > 0 amplifies log1p's error; the difference keeps the absolute error
        ulps = 4 + 2 * max(0.0, (1.0 - s) * math.log1p(m))
        error = (extras - self._sum_capacity(h)) * ulps * np.finfo(np.float64).eps * phi_m
        if h >= m or (width > 0 and error <= _DIFFERENCE_SLACK * width):
            return h, extras - self._sum_capacity(h), False, float(phi_h), width

        def fits(h: int, rest: int, cap: int) -> bool:
            mass = zipf_mass(np, float(h), np.array([h + 1, m], np.float64), s)
            return rest * mass[0] <= (cap - 1) * mass[1]

        h = least(fits)
        width = float(zipf_mass(np, float(h), np.float64(m), s)) if h < m else 1.0
        if not 0 < width < math.inf:
            raise ConfigError(
                f"generate: skew={s} is too steep to share nnz={self.nnz} ratings over {m} "
                f"rows in float64 (the Zipf mass of ranks {h} to {m} is {width}); lower the skew"
            )
        return h, extras - self._sum_capacity(h), True, 0.0, width

    def _extras(self, rank: np.ndarray) -> np.ndarray:
        """Unforced ratings of the rows with these ranks (telescoped: they sum to exactly
        nnz - n_forced over all ranks, which the check that each lies within [0, capacity]
        ensures: a count clipped there would change the sum)."""
        h, rest, relative, base, width = self._degree_plan
        cap = self.n - self._forced_count(rank)
        if h >= self.m:
            return cap
        r = np.maximum(rank, h).astype(np.float64)

        def cum(x: np.ndarray) -> np.ndarray:
            if relative:
                return np.rint(rest * (zipf_mass(np, float(h), x, self.skew) / width))
            return np.rint(rest * ((zipf_cdf(np, x, self.skew) - base) / width))

        mid = cum(r + 1) - cum(r)
        bad = np.flatnonzero((rank >= h) & ~((mid >= 0) & (mid <= cap)))  # NaN is bad too
        if bad.size:
            i = bad[0]
            raise ConfigError(
                f"generate: skew={self.skew} is too steep for exact degrees in float64: rank "
                f"{rank[i]} of {self.m} would get {mid[i]} ratings of at most {cap[i]}, and the "
                f"degrees would not sum to nnz={self.nnz}; lower the skew"
            )
        return np.where(rank < h, cap, mid.astype(np.int64))

    def degrees(self, rows: np.ndarray) -> np.ndarray:
        """Ratings (training and test) of the given rows; they sum to nnz over all rows."""
        rank = self._row_perm(rows)
        return self._forced_count(rank) + self._extras(rank)

    # ------------------------------------------------------------------ pairs
    def band_pairs(
        self, r0: int, r1: int, tile_cols: int, xp: Any = np
    ) -> tuple[Array, Array, Array]:
        """(row, col, forced) of rows [r0, r1), sorted by (column tile, row, column), computed
        with `xp` (NumPy, or CuPy on the GPU) and returned as its arrays. The degrees are
        computed on the CPU either way and copied over (see the module's GPU note)."""
        coder = KeyCoder(r1 - r0, tile_cols)
        rows = np.arange(r0, r1, dtype=np.int64)
        rank = self._row_perm(rows)
        f = self._forced_count(rank)
        need = self._extras(rank)
        rows, rank, f, need = (xp.asarray(a) for a in (rows, rank, f, need))
        local, j = repeat_rows(xp, f)
        k = rank[local] + j * self.m
        forced_keys = xp.sort(coder.encode(local, self._forced_perm(k % self.n)))

        cap = self.n - f
        dense = (need > 0) & (need >= _DENSE_SHARE * cap)
        pieces = [forced_keys]
        sparse_keys, switch = self._draw_sparse(xp, rows, need * ~dense, cap, forced_keys, coder)
        pieces.append(sparse_keys)
        dense_rows = xp.flatnonzero(dense | (switch > 0))
        if dense_rows.size:
            remaining = xp.where(dense, need, switch)[dense_rows]
            taken = xp.sort(xp.concatenate(pieces))
            pieces.append(self._draw_race(xp, rows, dense_rows, remaining, taken, coder))
        keys = xp.sort(xp.concatenate(pieces), kind="stable")
        local, col = coder.decode(keys)
        return local + r0, col, sorted_isin(xp, forced_keys, keys)

    def _draw_sparse(
        self,
        xp: Any,
        rows: Array,
        need: Array,
        cap: Array,
        forced_keys: Array,
        coder: KeyCoder,
    ) -> tuple[Array, Array]:
        """The first `need` distinct unforced columns of each row's draws j = 0, 1, 2, ...

        Each round draws exactly what a row still needs, so it never overshoots and the
        result does not depend on the rounds. Returns the accepted keys (sorted) and, per
        row, how many ratings are still missing where further draws would cost more than
        the race over all columns (those rows are finished by :meth:`_draw_race`).
        """
        key = xp.uint64(stream_key(self.seed, _DRAW))
        phi_n = float(zipf_cdf(np, np.float64(self.n), self.skew))
        need = need.copy()
        drawn = xp.zeros(rows.size, xp.int64)
        switch = xp.zeros(rows.size, xp.int64)
        accepted = []
        pool = forced_keys  # keys of the rows still drawing, sorted
        for rounds in itertools.count(1):
            active = xp.flatnonzero(need > 0)
            if not active.size:
                break
            k = need[active]
            i, j = repeat_rows(xp, k)
            local = active[i]
            j += drawn[local]
            u = unit(xp, hash64(xp, hash64(xp, key, rows[local]), j))
            # fmin: at steep skews u * phi_n can round past the law's total (a NaN rank)
            rank = xp.fmin(zipf_cdf_inv(xp, u * phi_n, self.skew), self.n - 1).astype(xp.int64)
            cand = sorted_unique(xp, coder.encode(local, self._col_perm(rank)))
            new = cand[~sorted_isin(xp, pool, cand)]
            accepted.append(new)
            got = bin_counts(xp, coder.local(new), rows.size)[active]
            need[active] -= got
            drawn[active] += k
            left = need[active]
            # expected draws to finish vs the race's cost (one key per free column)
            slow = (left > 0) & (
                (left * (k + 1) > (got + 1) * cap[active]) | (rounds == _MAX_ROUNDS)
            )
            if rounds >= _HOPELESS_FROM and not rounds & (rounds - 1):
                free = self._free_share(xp, xp.concatenate([pool, new]), coder, rows.size)
                free = free[active]
                slow |= (left > 0) & (
                    (left > _HOPELESS * cap[active] * free) | (free * (2 * _MAX_ROUNDS) < 1)
                )
            switch[active[slow]] = left[slow]
            need[active[slow]] = 0
            pool = xp.sort(xp.concatenate([pool, new]))
            pool = pool[need[coder.local(pool)] > 0]
        return xp.sort(xp.concatenate(accepted)) if accepted else xp.zeros(0, xp.int64), switch

    def _free_share(self, xp: Any, taken: Array, coder: KeyCoder, size: int) -> Array:
        """Per local row, the share of the column law outside the `taken` keys (the chance
        that a draw is new), from the masses of the taken columns (which do not cancel)."""
        local, col = coder.decode(taken)
        rank = self._col_perm.inverse(col).astype(xp.float64)
        s = self.skew
        mass = xp.exp((1.0 - s) * xp.log1p(rank) + xp.log(zipf_mass(xp, rank, rank + 1, s)))
        if xp is np:
            total = np.bincount(local, weights=mass, minlength=size)
        else:
            total = xp.zeros(size, xp.float64)
            xp.add.at(total, local, mass)
        return 1.0 - total / float(zipf_cdf(np, np.float64(self.n), s))

    @cached_property
    def _log_race(self) -> bool:
        """Whether the race compares logarithms: a column's weight, the difference Phi(r + 1)
        - Phi(r) (the original form, kept where it is accurate so that stores generated
        before do not change), cancels in the tail of a steep law (to 0 from about rank 60
        at skew 10, where free columns would tie with the taken ones at infinity). The
        lightest weight, of rank n - 1, is the least accurate; this is decided on the CPU,
        so a GPU run takes the same path."""
        n, s = self.n, self.skew
        log_lightest = (1.0 - s) * math.log(n) + math.log(zipf_mass(np, n - 1.0, float(n), s))
        error = 4 * np.finfo(np.float64).eps * float(zipf_cdf(np, np.float64(n), s))
        return bool(math.log(error / _WEIGHT_SLACK) > log_lightest)

    def _draw_race(
        self,
        xp: Any,
        rows: Array,
        which: Array,
        need: Array,
        taken: Array,
        coder: KeyCoder,
    ) -> Array:
        """`need` more columns for rows `which` by an exponential race over all columns:
        the columns with the least Exp(1) / popularity, skipping the `taken` keys."""
        key = xp.uint64(stream_key(self.seed, _RACE))
        ranks = xp.arange(self.n, dtype=xp.float64)
        if self._log_race:
            # the same order as Exp(1) / weight: log Exp(1) - log weight, which stays finite
            log_weight = (1.0 - self.skew) * xp.log1p(ranks) + xp.log(
                zipf_mass(xp, ranks, ranks + 1, self.skew)
            )
        else:
            weight = zipf_cdf(xp, ranks + 1, self.skew) - zipf_cdf(xp, ranks, self.skew)
        racing = xp.zeros(rows.size, bool)
        racing[which] = True
        taken_local, taken_col = coder.decode(taken[racing[coder.local(taken)]])
        order = xp.argsort(taken_local, kind="stable")
        taken_local, taken_col = taken_local[order], taken_col[order]
        out = []
        per_batch = max(1, _RACE_CELLS // self.n)
        for b0 in range(0, which.size, per_batch):
            batch = which[b0 : b0 + per_batch]
            z = hash64(xp, hash64(xp, key, rows[batch])[:, None], xp.arange(self.n))
            if self._log_race:
                race = xp.log(-xp.log(unit(xp, z))) - log_weight
            else:
                race = -xp.log(unit(xp, z)) / weight
            lo = int(xp.searchsorted(taken_local, batch[0]))
            hi = int(xp.searchsorted(taken_local, batch[-1], side="right"))
            slot = xp.searchsorted(batch, taken_local[lo:hi])
            race[slot, self._col_perm.inverse(taken_col[lo:hi])] = xp.inf
            want = need[b0 : b0 + per_batch]
            top = int(want.max())
            order = xp.argpartition(race, top - 1, axis=1)[:, :top]
            order = xp.take_along_axis(
                order, xp.argsort(xp.take_along_axis(race, order, 1), axis=1), 1
            )
            pick = xp.arange(top)[None, :] < want[:, None]
            local = xp.broadcast_to(batch[:, None], order.shape)[pick]
            out.append(coder.encode(local, self._col_perm(order[pick])))
        return xp.concatenate(out)

    # ------------------------------------------------------------------ values
    def _factors(self, xp: Any, stream: int, index: Any) -> Any:
        """Rows `index` of X* (stream _X) or Theta* (stream _THETA), float32 (len, rank)."""
        offset, std = self._factor_moments
        if stream == _THETA and self.mean < 0:
            offset = -offset
        pairs = (self.rank + 1) // 2
        base = hash64(xp, xp.uint64(stream_key(self.seed, stream)), index)
        z = hash64(xp, base[:, None], xp.arange(pairs))
        c, s = normal_pairs(xp, z)
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

    def ratings(self, rows: Array, cols: Array, xp: Any = np) -> tuple[Array, Array]:
        """(rating, clean) of the pairs: clean plus noise, rounded and clipped (to
        :attr:`value_range`), float32.
        `rows` and `cols` are arrays of `xp` (NumPy, or CuPy to compute on the GPU), and so
        are the results."""
        vals, cleans = [], []
        r_lo = int(rows.min()) if rows.size else 0
        span = int(rows.max()) + 1 - r_lo if rows.size else 0
        # X* of the whole row span at once where the ratings cover it; else (a sparse band
        # spans millions of rows) per chunk, of the rated rows only: rank floats per row
        x_rows = self.x(xp.arange(r_lo, r_lo + span), xp) if span <= rows.size else None
        table = _theta_table(self, xp) if self.n * self.rank <= _THETA_TABLE else None
        lo, hi = self.value_range
        for c0 in range(0, rows.size, _VALUE_CHUNK):
            r = rows[c0 : c0 + _VALUE_CHUNK]
            c = cols[c0 : c0 + _VALUE_CHUNK]
            if table is not None:
                theta = table[c]
            else:
                uniq, inv = xp.unique(c, return_inverse=True)
                theta = self.theta(uniq, xp)[inv.ravel()]
            if x_rows is not None:
                x = x_rows[r - r_lo]
            else:
                uniq, inv = xp.unique(r, return_inverse=True)
                x = self.x(uniq, xp)[inv.ravel()]
            clean = (x * theta).sum(axis=1)
            z = hash64(xp, hash64(xp, xp.uint64(stream_key(self.seed, _NOISE)), r), c)
            val = clean + self.noise * normal_pairs(xp, z)[0]
            if self.round:
                val = xp.rint(val)
            if lo is not None:
                val = xp.maximum(val, lo)
            if hi is not None:
                val = xp.minimum(val, hi)
            vals.append(val.astype(xp.float32))
            cleans.append(clean)
        if not vals:
            return xp.zeros(0, xp.float32), xp.zeros(0, xp.float32)
        return xp.concatenate(vals), xp.concatenate(cleans)


@lru_cache(maxsize=2)
def _theta_table(model: PlantedModel, xp: Any) -> Any:
    """All of Theta* for a small n, once per process (and array module)."""
    return model.theta(xp.arange(model.n), xp)
