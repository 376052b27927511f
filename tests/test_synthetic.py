"""Synthetic generator: deterministic whatever the workers, the planted model's statistics."""

from __future__ import annotations

import argparse
import hashlib
import importlib
import re
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import dask
import fsspec
import numpy as np
import pytest
import zarr
from conftest import HAS_CUDA

from cumf_dask.compat import import_cupy
from cumf_dask.config import GenerateConfig, load_config
from cumf_dask.data import limits, synthetic
from cumf_dask.data.bands import to_host
from cumf_dask.data.hashing import hash64, split_mask, stream_key
from cumf_dask.data.planted import PlantedModel
from cumf_dask.data.presets import PRESETS, resolve_shape, smallest_scale
from cumf_dask.data.sampling import (
    KeyCoder,
    Permutation,
    repeat_rows,
    sorted_isin,
    sorted_unique,
    zipf_cdf,
    zipf_cdf_inv,
    zipf_mass,
)
from cumf_dask.data.store import RatingsStore
from cumf_dask.data.synthetic import generate
from cumf_dask.errors import ConfigError, CumfWarning, DeviceMemoryError, PlanError, StoreError

SMALL = PlantedModel.create(m=2000, n=300, nnz=40_000, rank=4, noise=0.3, seed=7)
TILES = {"tile_rows": 256, "tile_cols": 64}
TINY = PlantedModel.create(m=50, n=20, nnz=300)
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def snapshot(url):
    """Every array and the attributes of a store (but its build's own id), for exact
    comparison."""
    group = zarr.open_group(str(url), mode="r")
    out = {"attrs": {k: v for k, v in group.attrs.items() if k != "build"}}
    for path, node in group.members(max_depth=None):
        if isinstance(node, zarr.Array):
            out[path] = np.asarray(node[:])
    return out


def assert_same_store(a, b):
    assert a.keys() == b.keys()
    for key in a:
        if key == "attrs":
            assert a[key] == b[key]
        else:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def triples(store):
    """Training and test ratings as {(row, col): rating}."""
    out = {}
    for split in ("train", "test"):
        row, col, val = store.read_coo("row", split=split)
        out.update(zip(zip(row.tolist(), col.tolist(), strict=True), val.tolist(), strict=True))
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    url = tmp_path_factory.mktemp("synthetic") / "ref.zarr"
    generate(url, SMALL, **TILES)
    return snapshot(url)


def test_same_store_whatever_the_workers(tmp_path, reference, client2):
    """The same store from one thread and from two Dask workers (of a client that is not
    the default one: the tasks are awaited on its own loop)."""
    with dask.config.set(num_workers=1):
        generate(tmp_path / "one.zarr", SMALL, **TILES)
    assert_same_store(snapshot(tmp_path / "one.zarr"), reference)
    generate(tmp_path / "two.zarr", SMALL, client=client2, **TILES)
    assert_same_store(snapshot(tmp_path / "two.zarr"), reference)


def test_same_ratings_whatever_the_tiles(tmp_path, reference):
    a = generate(tmp_path / "a.zarr", SMALL, tile_rows=512, tile_cols=300)
    b = generate(tmp_path / "b.zarr", SMALL)  # default tiles
    assert (a.n_row_tiles, a.n_col_tiles) != (b.n_row_tiles, b.n_col_tiles)
    assert triples(a) == triples(b)
    assert a.attrs["nnz"] == reference["attrs"]["nnz"]


def test_seeds_differ(tmp_path):
    a = generate(tmp_path / "a.zarr", SMALL, **TILES)
    b = generate(tmp_path / "b.zarr", replace(SMALL, seed=8), **TILES)
    ta, tb = triples(a), triples(b)
    assert len(ta) == len(tb) == SMALL.nnz
    assert len(ta.keys() & tb.keys()) < 0.5 * len(ta)
    shared = sorted(ta.keys() & tb.keys())
    assert not np.allclose([ta[k] for k in shared], [tb[k] for k in shared])


def test_planted_statistics(tmp_path):
    gen = PlantedModel.create(m=4000, n=800, nnz=120_000, rank=5, noise=0.25, seed=3)
    store = generate(tmp_path / "s.zarr", gen, test_fraction=0.2, split_seed=5, **TILES)
    assert store.nnz + store.nnz_test == gen.nnz  # exact
    assert store.nnz_test == pytest.approx(0.2 * (gen.nnz - 4000), rel=0.03)  # forced: train
    for orient in ("row", "col"):
        counts = store.counts(orient)
        assert counts.min() >= 1  # nonempty: every row and column has a training rating
        assert counts.max() > 8 * counts.mean()  # Zipf-like skew
    assert store.stats["mean"] == pytest.approx(3.5, abs=0.1)
    assert store.stats["std"] == pytest.approx(np.hypot(1.0, 0.25), abs=0.1)
    # test ratings minus the planted X* Theta*^T: the noise
    row, col, val = store.read_coo("row", split="test")
    model = PlantedModel.from_source(store.source)
    residual = val - model.clean(row, col)
    assert residual.mean() == pytest.approx(0, abs=0.01)
    assert residual.std() == pytest.approx(0.25, rel=0.03)
    assert store.source["planted_test_rmse"] == pytest.approx(0.25, rel=0.03)
    assert store.source["noise"] == 0.25 and store.source["rank"] == 5


def test_clipped_rounded_ratings(tmp_path):
    gen = PlantedModel.create(
        m=1500, n=200, nnz=30_000, rating_min=1, rating_max=5, round=True, noise=0.5
    )
    store = generate(tmp_path / "s.zarr", gen, **TILES)
    _, _, val = store.read_coo("row")
    assert set(np.unique(val).tolist()) == {1.0, 2.0, 3.0, 4.0, 5.0}
    assert store.stats["mean"] == pytest.approx(3.4, abs=0.15)
    assert store.source["planted_test_rmse"] > 0.5  # rounding adds error beyond the noise


@pytest.mark.parametrize(("lo", "hi", "levels"), [(0.5, 5, [1, 2, 3, 4, 5]), (1.5, 4.5, [2, 3, 4])])
def test_rounded_ratings_stay_within_a_fractional_scale(lo, hi, levels):
    """Rounded, then clipped to the integers in the scale: none below 0.5 (rint(0.4) = 0),
    and both ends reached (rint's halves to even never gave 1.5 -> 2 or 4.5 -> 4 alone)."""
    gen = PlantedModel.create(m=100, n=50, nnz=1500, noise=0.5, rating_min=lo, rating_max=hi,
                              round=True)  # fmt: skip
    row, col, _ = gen.band_pairs(0, gen.m, gen.n)
    assert np.unique(gen.ratings(row, col)[0]).tolist() == levels


def test_planted_values_without_noise(tmp_path):
    gen = PlantedModel.create(m=500, n=120, nnz=6000, rank=3, noise=0.0, seed=2)
    store = generate(tmp_path / "s.zarr", gen, test_fraction=0, **TILES)
    assert not store.has_test
    row, col, val = store.read_coo("col")
    model = PlantedModel.from_source(store.source)
    np.testing.assert_allclose(val, model.clean(col, row), rtol=1e-6)
    x, theta = model.x(np.arange(500)), model.theta(np.arange(120))
    full = x.astype(np.float64) @ theta.T.astype(np.float64)
    assert np.linalg.matrix_rank(full) == 3
    pairs = np.arange(20_000)
    planted = model.clean(pairs, pairs)  # independent draws of X*[i] . Theta*[v]
    assert planted.mean() == pytest.approx(3.5, abs=0.03)
    assert planted.std() == pytest.approx(1.0, abs=0.03)


@pytest.mark.parametrize(
    "m, n, nnz, skew, nonempty",
    [
        (3000, 500, 60_000, 0.8, True),
        (300, 2000, 60_000, 0.8, True),  # n > m: rows get several forced columns
        (100, 10, 1000, 0.8, True),  # completely dense
        (100, 10, 999, 1.0, True),
        (40, 1, 40, 0.8, True),
        (1000, 1000, 5000, 2.0, False),
        (200, 50, 9000, 0.0, True),  # uniform degrees
    ],
)
def test_degrees_exact(m, n, nnz, skew, nonempty):
    check_degrees_exact(PlantedModel(m=m, n=n, nnz=nnz, skew=skew, nonempty=nonempty))


def check_degrees_exact(model):
    """The degrees sum to nnz within the capacities, and the pairs drawn are those degrees,
    distinct, with the forced pairs."""
    m, n, nnz, skew, nonempty = model.m, model.n, model.nnz, model.skew, model.nonempty
    degrees = model.degrees(np.arange(m))
    assert degrees.sum() == nnz
    assert degrees.max() <= n
    rows, cols, n_forced = [], [], 0
    for r0 in range(0, m, 64):
        row, col, forced = model.band_pairs(r0, min(m, r0 + 64), 16)
        rows.append(row)
        cols.append(col)
        n_forced += int(forced.sum())
    row, col = np.concatenate(rows), np.concatenate(cols)
    assert n_forced == (max(m, n) if nonempty else 0)
    assert np.unique(row * n + col).size == nnz  # no pair twice
    np.testing.assert_array_equal(np.bincount(row, minlength=m), degrees)
    if nonempty:
        assert degrees.min() >= 1 and np.bincount(col, minlength=n).min() >= 1
    elif skew >= 1:
        assert degrees.min() == 0


@pytest.mark.parametrize("skew", [5.0, 10.0, 20.0, 50.0])
@pytest.mark.parametrize(
    "m, n, nnz, nonempty",
    [
        (100, 100, 1000, True),  # were 694 ratings at skew 20, 298 at skew 50
        (100, 100, 10_000, True),  # completely dense
        (200, 50, 9000, True),  # 90% dense: mostly full rows
        (50, 300, 12_000, True),  # n > m: several forced columns a row
        (300, 200, 3000, False),
        (7, 1, 6, False),
        (10, 10, 99, True),
    ],
)
def test_degrees_exact_at_steep_skews(m, n, nnz, nonempty, skew):
    """At steep skews Phi flattens out and its differences cancelled: the degrees summed to
    less than nnz (NaN counts clipped to 0) and the store had fewer ratings, exit 0."""
    check_degrees_exact(PlantedModel(m=m, n=n, nnz=nnz, skew=skew, nonempty=nonempty))


def test_degrees_that_miss_nnz_are_an_error():
    """A degree outside [0, capacity] (here a plan whose width cancelled to 0, as at steep
    skews before) is an error naming the skew, never a store with fewer ratings."""
    model = PlantedModel(m=100, n=100, nnz=1000, skew=20.0)
    h, rest, _, _, _ = model._degree_plan
    model.__dict__["_degree_plan"] = (h, rest, False, 0.0, 0.0)
    with (
        np.errstate(divide="ignore", invalid="ignore"),
        pytest.raises(ConfigError, match=r"skew=20\.0 is too steep .* not sum to nnz=1000"),
    ):
        model.degrees(np.arange(100))


@pytest.mark.parametrize(
    "model, expect",
    [
        (SMALL, ("e4424166a8b1cfd8", "940f3ccdb5bd05cc")),
        (PlantedModel(m=400, n=60, nnz=16_000, seed=3), ("87064bdf087717f0", "d8c76a861b09a488")),
        (PlantedModel(m=300, n=5000, nnz=200_000, skew=1.0, seed=5),
         ("2f34c7343973943f", "ffe17157d4719257")),
        (PlantedModel(m=1000, n=1000, nnz=5000, skew=2.0, nonempty=False),
         ("913b5abf7a5b9ee4", "8efc7f3ba39e3b23")),
        (PlantedModel(m=200, n=50, nnz=9000, skew=0.0), ("b0390d62c2ecdd4c", "96fa3ac68686cbbe")),
    ],
    ids=["small", "race", "forced", "no-forced", "uniform"],
)  # fmt: skip
def test_degrees_and_pairs_are_pinned(model, expect):
    """Degrees and pairs of usual skews as generated before the steep skews were fixed:
    benchmarks recorded on planted stores keep their data."""

    def digest(a):
        return hashlib.sha256(np.ascontiguousarray(a, dtype="<i8").tobytes()).hexdigest()[:16]

    pairs = [model.band_pairs(r0, min(model.m, r0 + 256), 64) for r0 in range(0, model.m, 256)]
    keys = np.sort(np.concatenate([row * model.n + col for row, col, _ in pairs]))
    assert (digest(model.degrees(np.arange(model.m))), digest(keys)) == expect


def test_presets_and_scale():
    assert set(PRESETS) == {"netflix", "yahoomusic", "hugewiki", "sparkals", "factorbird",
                            "facebook"}  # fmt: skip
    netflix = PRESETS["netflix"]
    assert (netflix.m, netflix.n, netflix.nnz, netflix.f, netflix.lam) == (
        480_189, 17_770, 99_000_000, 100, 0.05,
    )  # fmt: skip
    assert PRESETS["yahoomusic"].lam == 1.4 and PRESETS["facebook"].f == 16
    assert resolve_shape(preset="Netflix") == (480_189, 17_770, 99_000_000)
    # scale multiplies nnz, and m and n by sqrt(scale): 0.1 -> x 0.31623 each
    assert resolve_shape(preset="netflix", scale=0.1) == (151_849, 5_619, 9_900_000)
    assert resolve_shape(preset="facebook", scale=1e-6, nnz=10**6) == (
        1_000_000, 48_000, 1_000_000,
    )  # fmt: skip
    assert resolve_shape(m=10, n=20, nnz=30) == (10, 20, 30)


@pytest.mark.parametrize("name", list(PRESETS))
def test_scaled_presets_keep_density_and_aspect(name):
    """A scaled preset is the data set's shape in small: density and m/n kept (to rounding),
    the ratings per row and column shrunk by sqrt(scale), and every row can have a rating
    down to the preset's smallest scale (below it, the error names that scale)."""
    full = PRESETS[name]
    smallest = smallest_scale(full)
    for scale in (1.0, 0.1, 0.01, 1e-3, 1e-4, 1e-5):
        if scale < smallest:
            with pytest.raises(ConfigError, match=f"use scale >= {smallest:.3g} for {name}"):
                resolve_shape(preset=name, scale=scale)
            continue
        m, n, nnz = resolve_shape(preset=name, scale=scale)
        assert nnz == round(full.nnz * scale) and nnz >= max(m, n)
        density, full_density = nnz / (m * n), full.nnz / (full.m * full.n)
        assert density == pytest.approx(full_density, rel=0.02)
        assert m / n == pytest.approx(full.m / full.n, rel=0.02)
        assert nnz / m == pytest.approx(full.nnz / full.m * scale**0.5, rel=0.02)


def test_every_config_resolves_with_nonempty_rows():
    """The shipped configs' scales make a shape in which every row and column has a rating."""
    for path in sorted((Path(__file__).parents[1] / "configs").glob("*.yaml")):
        gen = load_config(path).data.generate
        if gen.preset is None and gen.m is None:
            continue
        m, n, nnz = resolve_shape(preset=gen.preset, scale=gen.scale, m=gen.m, n=gen.n,
                                  nnz=gen.nnz, nonempty=gen.nonempty)  # fmt: skip
        assert nnz >= max(m, n), path.name


def test_scaled_preset_store(tmp_path):
    gen = PlantedModel.create(preset="yahoomusic", scale=1e-3, rating_min=0, rating_max=100)
    store = generate(tmp_path / "y.zarr", gen)
    assert (store.m, store.n, store.nnz + store.nnz_test) == (31_654, 19_763, 252_800)
    assert store.source["preset"] == "yahoomusic" and store.source["scale"] == 1e-3
    assert store.stats["min"] >= 0 and store.stats["max"] <= 100


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"preset": "movielens"}, "unknown; choose one of netflix"),
        ({"preset": "netflix", "scale": 1e-5}, r"use scale >= 2\.38e-05 for netflix"),
        ({"preset": "netflix", "scale": 0}, "'scale' must be > 0"),
        ({"m": 10, "n": 10, "nnz": 101}, "do not fit in a 10 x 10 matrix"),
        ({"m": 0, "n": 10, "nnz": 5, "nonempty": False}, "'m' must be >= 1"),
        ({"m": 10, "n": 10}, "generate needs nnz"),
        ({"m": 10, "n": 10, "nnz": 20, "scale": 2}, "no preset is set"),
        ({"m": 100, "n": 10, "nnz": 50}, r"at least max\(m, n\) = 100"),
        ({"m": 10, "n": 10, "nnz": 20, "rank": 0}, "'rank' must be >= 1"),
        ({"m": 50, "n": 20, "nnz": 300, "rank": 21},
         r"'rank' must be at most min\(m, n\) = 20, got 21: X\* Theta\*\^T of 50 x 20 has no "
         r"higher rank; lower rank"),
        ({"m": 10, "n": 10, "nnz": 20, "noise": -1}, "noise"),
        ({"m": 10, "n": 10, "nnz": 20, "noise": 1e20},
         r"'noise' 1e\+20 makes ratings up to 6\.76e\+20, beyond \+-1e\+09; lower it \(at most "
         r"1\.48e\+08\), or clip the ratings \(set both rating_min and rating_max\)"),
        ({"m": 10, "n": 10, "nnz": 20, "skew": -0.5}, "skew"),
        ({"m": 10, "n": 10, "nnz": 20, "rating_min": 5, "rating_max": 1}, "rating_min"),
        ({"m": 10, "n": 10, "nnz": 20, "rating_min": np.nan}, "'rating_min' must be a finite"),
        ({"m": 10, "n": 10, "nnz": 20, "rating_min": 1, "rating_max": np.inf},
         "'rating_max' must be a finite"),
        ({"m": 10, "n": 10, "nnz": 20, "rating_min": 1e30}, r"'rating_min' must be <= 1000000000"),
        ({"m": 10, "n": 10, "nnz": 20, "rating_min": 0.5, "rating_max": 0.7, "round": True},
         r"round needs an integer in \[rating_min, rating_max\], and \[0\.5, 0\.7\] holds none"),
        ({"m": 10, "n": 10, "nnz": 20, "seed": -1}, r"'seed' must be an integer in \[0, 2\*\*64\)"),
        ({"m": 10, "n": 10, "nnz": 20, "seed": 2**64}, r"'seed' must be an integer in \[0, 2"),
    ],
)  # fmt: skip
def test_bad_input(tmp_path, settings, match):
    with pytest.raises(ConfigError, match=match):
        generate(tmp_path / "bad.zarr", PlantedModel.create(**settings))
    assert not (tmp_path / "bad.zarr").exists()


def test_the_default_rank_is_ten_or_the_smaller_side():
    """No rank given: 10, capped at min(m, n) (a rank above it does not exist)."""
    assert PlantedModel.create(m=50, n=20, nnz=300).rank == 10
    assert PlantedModel.create(m=50, n=4, nnz=120).rank == 4
    assert GenerateConfig().rank is None


def test_create_takes_the_config_settings():
    """PlantedModel.create's keywords are GenerateConfig's fields: a config builds its model."""
    gen = GenerateConfig(preset="Netflix", scale=0.1, rank=3, seed=5)
    model = PlantedModel.create(**asdict(gen))
    assert (model.m, model.n, model.nnz) == resolve_shape(preset="netflix", scale=0.1)
    assert (model.preset, model.scale, model.rank, model.seed) == ("netflix", 0.1, 3, 5)
    assert model == replace(model, preset=None, scale=1.0)  # provenance, not the model


def test_hashes_are_pinned():
    """Hash keys, hashes and permutations of fixed inputs, as computed before the hashing
    moved to one module: the same settings generate the same store after any refactoring."""
    keys = [stream_key(seed, stream) for seed, stream in ((0, 1), (7, 8), (2**64 + 3, 5))]
    assert keys == [627405149472732430, 4226922219821352084, 14871207630202690639]
    assert hash64(np, np.uint64(stream_key(7, 3)), np.arange(4)).tolist() == [
        5365726563078732598, 11248596980798508817, 16693346848406779205, 6324683520024795016,
    ]  # fmt: skip
    perm = Permutation(1000, stream_key(7, 1))
    assert perm(np.arange(10)).tolist() == [203, 952, 281, 813, 918, 46, 632, 196, 860, 154]
    np.testing.assert_array_equal(perm.inverse(perm(np.arange(1000))), np.arange(1000))


def test_bad_options(tmp_path):
    gen = PlantedModel.create(m=10, n=10, nnz=20)
    with pytest.raises(ConfigError, match="test_fraction"):
        generate(tmp_path / "s.zarr", gen, test_fraction=1.0)
    with pytest.raises(ConfigError, match="tile_rows"):
        generate(tmp_path / "s.zarr", gen, tile_rows=0)
    for seed in (-1, 2**63):
        with pytest.raises(ConfigError, match=r"'split_seed' must be an integer in \[0, 2\*\*63\)"):
            generate(tmp_path / "s.zarr", gen, split_seed=seed)
    if not HAS_CUDA:
        with pytest.raises(ConfigError, match="no CUDA GPU"):
            generate(tmp_path / "s.zarr", gen, use_gpu=True)
    assert not (tmp_path / "s.zarr").exists()


def test_existing_store_needs_overwrite(tmp_path):
    url = tmp_path / "s.zarr"
    generate(url, SMALL, **TILES)
    with pytest.raises(StoreError, match="overwrite"):
        generate(url, SMALL, **TILES)
    assert RatingsStore.open(str(url)).nnz > 0  # untouched
    gen = PlantedModel.create(m=300, n=40, nnz=2000)
    assert generate(url, gen, overwrite=True).m == 300


def test_noise_is_bounded_unless_ratings_are_clipped_on_both_sides(tmp_path):
    """Unclipped ratings must stay within +-1e9 (as ingest requires): one bound leaves the
    other side open; a scale on both sides clips every rating into it, whatever the noise."""
    with pytest.raises(ConfigError, match=r"^'noise' 1\.5e\+08 makes ratings up to 1\.01e\+09"):
        PlantedModel.create(m=50, n=20, nnz=300, noise=1.5e8, rating_min=1)
    gen = PlantedModel.create(m=50, n=20, nnz=300, noise=1e20, rating_min=1, rating_max=5)
    stats = generate(tmp_path / "c.zarr", gen, use_gpu=False).stats
    assert stats["min"] >= 1 and stats["max"] <= 5


@pytest.fixture
def memory_root(tmp_path):
    """A folder of its own in fsspec's (process-wide) memory filesystem, removed after."""
    root = f"/{tmp_path.name}"
    yield root
    fs = fsspec.filesystem("memory")
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_a_url_target_that_is_not_a_store_is_never_replaced(tmp_path, memory_root):
    """What is at a URL is asked of its filesystem (zarr took a folder of files, or a file,
    for nothing there, and wrote over it); local:// is a local path, refused as one."""
    fs = fsspec.filesystem("memory")
    root = memory_root
    fs.pipe({f"{root}/foreign/important.txt": b"precious", f"{root}/notes.txt": b"notes"})
    for name in ("foreign", "notes.txt"):
        with pytest.raises(StoreError, match=rf"^memory://{root}/{name}: exists and is not a "
                           r"cumf-dask rating store; refusing to replace it"):  # fmt: skip
            generate(f"memory://{root}/{name}", TINY, overwrite=True, use_gpu=False)
    assert fs.cat([f"{root}/foreign/important.txt", f"{root}/notes.txt"]) == {
        f"{root}/foreign/important.txt": b"precious", f"{root}/notes.txt": b"notes",
    }  # fmt: skip
    thesis = tmp_path / "thesis"
    thesis.mkdir()
    (thesis / "ch1.tex").write_text("chapter 1")
    with pytest.raises(StoreError, match=rf"^{re.escape(str(thesis))}: exists and is not a "):
        generate(f"local://{thesis}", TINY, overwrite=True, use_gpu=False)
    assert (thesis / "ch1.tex").read_text() == "chapter 1"
    store = generate(f"local://{tmp_path}/new.zarr", TINY, use_gpu=False)
    assert store.url == f"{tmp_path}/new.zarr"


def test_a_url_target_that_cannot_be_read_is_an_error_never_empty(memory_root, monkeypatch):
    """Only 'not found' means nothing is at a URL: another error (a permission or network
    one) is raised as it is, and what is there stays."""
    fs = fsspec.filesystem("memory")
    path = f"{memory_root}/s.zarr/ratings.csv"
    fs.pipe(path, b"1,2,3")

    def denied(self, path, **kwargs):
        raise PermissionError(f"{path}: access denied")

    with monkeypatch.context() as patch:
        patch.setattr(type(fs), "info", denied)
        with pytest.raises(PermissionError, match="access denied"):
            generate(f"memory://{memory_root}/s.zarr", TINY, overwrite=True, use_gpu=False)
    assert fs.cat(path) == b"1,2,3"


def test_a_store_path_that_is_a_link_is_rebuilt_where_it_points(tmp_path):
    """The store is replaced where the link points (on that disk) and the link stays; a link
    to nothing yet gets its store there. Nothing else is left beside either."""
    real, link = tmp_path / "disk" / "t3", tmp_path / "t4"
    generate(real, TINY, use_gpu=False)
    link.symlink_to(real)
    with pytest.raises(StoreError, match="already exists"):
        generate(link, TINY, use_gpu=False)
    generate(link, replace(TINY, seed=3), overwrite=True, use_gpu=False)
    assert link.is_symlink() and RatingsStore.open(str(real)).source["seed"] == 3
    (tmp_path / "t5").symlink_to(tmp_path / "disk" / "t5")
    assert generate(tmp_path / "t5", TINY, use_gpu=False).m == 50
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "t4", "t5"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["t3", "t5"]


def test_every_rating_held_out_is_a_config_error(tmp_path):
    """A setting, not bad data: named as such, not as an empty input in a hidden folder."""
    gen = PlantedModel.create(m=3, n=3, nnz=1, rank=1, nonempty=False)
    with pytest.raises(ConfigError, match=r"^generate: every rating was held out for testing "
                       r"\(test_fraction=0\.99 of nnz=1\), none is left to train on; lower "
                       r"test_fraction or raise nnz$"):  # fmt: skip
        generate(tmp_path / "e0.zarr", gen, test_fraction=0.99, use_gpu=False)
    assert not list(tmp_path.iterdir())


def test_build_errors_name_the_target_not_its_work_folder(tmp_path, monkeypatch):
    """The hidden work folder is gone when the message is read: it names the target."""

    def damaged(url, band, *gpu):
        raise StoreError(f"{url}: damaged store: band 'by_row/0' is out of range")

    monkeypatch.setattr(synthetic, "transpose_band", damaged)
    url = tmp_path / "s.zarr"
    with pytest.raises(StoreError, match=rf"^{re.escape(str(url))}: damaged store"):
        generate(url, TINY, use_gpu=False)
    assert not list(tmp_path.iterdir())


def test_os_errors_of_a_build_name_the_target_not_its_work_folder(tmp_path, monkeypatch):
    def refused(url, band, *gpu):
        raise PermissionError(13, "Permission denied", f"{url}/by_col/0")

    monkeypatch.setattr(synthetic, "transpose_band", refused)
    url = tmp_path / "s.zarr"
    with pytest.raises(PermissionError) as err:
        generate(url, TINY, use_gpu=False)
    assert err.value.filename == f"{url}/by_col/0"


def test_failure_removes_partial_store(tmp_path, monkeypatch):
    def broken(url, band, *gpu):  # a third argument where a GPU transposes
        raise RuntimeError("disk full")

    monkeypatch.setattr(synthetic, "transpose_band", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        generate(tmp_path / "s.zarr", SMALL, **TILES)
    assert not (tmp_path / "s.zarr").exists()


def test_shape_beyond_memory_is_refused_before_anything_is_written(tmp_path):
    url = tmp_path / "h.zarr"
    huge = PlantedModel.create(m=10**11, n=10, nnz=100, nonempty=False)
    with pytest.raises(PlanError, match=r"m=100,000,000,000, n=10 cannot be built on this "
                       r"machine: .*800\.0 GB for 8-byte rating counts.*lower m and n"):
        generate(url, huge)
    with pytest.raises(PlanError, match=r"bands of 4,000,000,000 rows.*lower tile_rows"):
        generate(url, replace(huge, m=4 * 10**9), tile_rows=4 * 10**9)
    assert not url.exists() and not Path(f"{url}.lock").exists()


def test_tiles_taller_than_the_matrix_are_one_band_of_m_rows(tmp_path):
    """A band never holds more than m rows: tile_rows far above m is not a memory need."""
    gen = PlantedModel.create(m=50, n=20, nnz=300)
    store = generate(tmp_path / "t.zarr", gen, tile_rows=10**11, use_gpu=False)
    assert (store.n_row_tiles, store.nnz + store.nnz_test) == (1, 300)


def test_store_beyond_the_free_disk_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """2,000 unrounded ratings need 2 kB at the least: refused with 1.5 kB free. Rounded
    ones may compress to almost nothing: never refused on that estimate."""
    monkeypatch.setattr(limits.shutil, "disk_usage", lambda path: SimpleNamespace(free=1500))
    url, gen = tmp_path / "d.zarr", PlantedModel.create(m=300, n=40, nnz=2000)
    with pytest.raises(PlanError, match=r"a store of 2,000 unrounded ratings \(typically 5-14 "
                       r"bytes each, at least 1\) needs at least 0\.0 GB on disk and "
                       rf"{re.escape(str(tmp_path))} has 0\.0 GB free; free space there"):
        generate(url, gen)
    assert not url.exists() and not list(tmp_path.iterdir())
    assert generate(url, replace(gen, rating_min=1, rating_max=5, round=True)).nnz > 0


def test_far_fewer_held_out_than_asked_is_a_warning(tmp_path):
    """Every rating of a 200 x 10 store of 200 gives a row its one: none can be held out."""
    gen = PlantedModel.create(m=200, n=10, nnz=200)
    with pytest.warns(CumfWarning, match=r"held out 0 of 200 ratings \(0\.0%\), far less than "
                      r"test_fraction=0\.1 asks: the 200 ratings that give every row and column "
                      r"one \(nonempty\) stay in training"):
        store = generate(tmp_path / "f.zarr", gen)
    assert not store.has_test


def test_out_of_memory_while_generating_is_one_clean_error(tmp_path, monkeypatch):
    def no_memory(*args):
        raise MemoryError("Unable to allocate 745. GiB")

    monkeypatch.setattr(synthetic, "_row_band", no_memory)
    with pytest.raises(DeviceMemoryError, match=r"generating a 2,000 x 300 store \(Unable to "
                       r"allocate 745\. GiB\); lower m and n") as info:
        generate(tmp_path / "s.zarr", SMALL, **TILES)
    assert info.value.__context__ is None and info.value.__cause__ is None
    assert not (tmp_path / "s.zarr").exists() and not (tmp_path / "s.zarr.partial").exists()


def test_very_sparse_shape_is_built_in_bounded_bands(tmp_path):
    """1 rating per 100,000 rows: bands of at most MAX_TILE rows, not one band of all rows."""
    gen = PlantedModel.create(m=1 << 23, n=10, nnz=80, nonempty=False, seed=4)
    store = generate(tmp_path / "s.zarr", gen, use_gpu=False)
    assert (store.tile_rows, store.n_row_tiles) == (1 << 22, 2)
    assert store.nnz + store.nnz_test == 80
    row, col, _ = store.read_coo("row")
    assert np.unique(row).size == row.size  # scattered rows: the rated rows' factors only
    clean = np.concatenate([gen.ratings(row[k : k + 1], col[k : k + 1])[1]
                            for k in range(row.size)])  # fmt: skip
    np.testing.assert_allclose(gen.ratings(row, col)[1], clean, rtol=1e-6)


def test_progress(tmp_path):
    seen = []
    store = generate(tmp_path / "s.zarr", SMALL, progress=lambda *a: seen.append(a), **TILES)
    rows = [a for a in seen if a[0] == "generate"]
    cols = [a for a in seen if a[0] == "transpose"]
    assert [a[1] for a in rows] == list(range(1, store.n_row_tiles + 1))
    assert [a[1] for a in cols] == list(range(1, store.n_col_tiles + 1))
    assert seen.index(rows[-1]) < seen.index(cols[0])


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    return np if request.param == "numpy" else import_cupy()


def test_sampling_helpers_match_numpy(xp):
    """The array-module-generic primitives give NumPy's own results (CuPy's too)."""
    rng = np.random.default_rng(3)
    counts = np.r_[rng.integers(0, 5, 200), 0, 0]  # some empty rows, at the end too
    row, pos = repeat_rows(xp, xp.asarray(counts))
    expect = np.repeat(np.arange(counts.size), counts)
    np.testing.assert_array_equal(to_host(row), expect)
    np.testing.assert_array_equal(
        to_host(pos), np.arange(expect.size) - np.repeat(np.cumsum(counts) - counts, counts)
    )
    assert to_host(repeat_rows(xp, xp.zeros(3, xp.int64))[0]).size == 0
    x, ref = rng.integers(0, 1000, 5000), np.unique(rng.integers(0, 1000, 300))
    np.testing.assert_array_equal(to_host(sorted_unique(xp, xp.asarray(x))), np.unique(x))
    np.testing.assert_array_equal(
        to_host(sorted_isin(xp, xp.asarray(ref), xp.asarray(x))), np.isin(x, ref)
    )
    assert not to_host(sorted_isin(xp, xp.zeros(0, xp.int64), xp.asarray(x))).any()
    perm = Permutation(1000, stream_key(7, 1))
    np.testing.assert_array_equal(to_host(perm(xp.asarray(x % 1000))), perm(x % 1000))
    np.testing.assert_array_equal(to_host(perm.inverse(perm(xp.arange(1000)))), np.arange(1000))
    coder = KeyCoder(300, 64)
    local, col = x % 300, x * 7
    keys = coder.encode(xp.asarray(local), xp.asarray(col))
    np.testing.assert_array_equal(to_host(keys), coder.encode(local, col))
    np.testing.assert_array_equal(to_host(coder.decode(keys)[1]), col)
    ranks = np.linspace(0, 1e5, 101)
    back = zipf_cdf_inv(xp, zipf_cdf(xp, xp.asarray(ranks), 0.8), 0.8)
    np.testing.assert_allclose(to_host(back), ranks, rtol=1e-9, atol=1e-9)
    # the mass between ranks, relative to the level at the lower one: the difference of
    # Phi where that is accurate, and no cancellation where it is not (skew 2: (x-h)/(x+1))
    for skew in (0.0, 0.8, 1.0, 1.5):
        mass = zipf_mass(xp, 3.0, xp.asarray(ranks), skew) * 4.0 ** (1 - skew)
        diff = zipf_cdf(np, ranks, skew) - zipf_cdf(np, 3.0, skew)
        np.testing.assert_allclose(to_host(mass), diff, rtol=1e-12, atol=1e-12)
    lo, far = 1e6, xp.asarray([1e6 + 1, 2e6, 1e12])
    np.testing.assert_allclose(to_host(zipf_mass(xp, lo, far, 2.0)),
                               to_host((far - lo) / (far + 1)), rtol=1e-14)  # fmt: skip
    steep = to_host(zipf_mass(xp, xp.arange(1e5), xp.arange(1e5) + 1, 50.0))
    assert (steep > 0).all() and (np.diff(steep) < 0).all()  # was 0 from rank 2 on
    np.testing.assert_array_equal(
        to_host(split_mask(xp.asarray(x), xp.asarray(x * 3), 0.3, 5)), split_mask(x, x * 3, 0.3, 5)
    )


@pytest.mark.gpu
@pytest.mark.parametrize(
    "model, tile_rows, tile_cols",
    [
        (SMALL, 256, 64),  # dense rows: the exponential race
        (PlantedModel(m=400, n=60, nnz=16_000, seed=3), 64, 16),  # mostly the race
        (PlantedModel(m=300, n=5000, nnz=200_000, seed=5), 64, 512),  # ~17 forced pairs a row
        (PlantedModel(m=1000, n=1000, nnz=5000, skew=2.0, nonempty=False), 128, 100),
        (PlantedModel(m=300, n=200, nnz=3000, skew=5.0, nonempty=False), 64, 50),  # hopeless
        (PlantedModel(m=100, n=100, nnz=1000, skew=10.0), 32, 100),  # the log-space race
    ],
    ids=["small", "race", "forced", "no-forced", "skew-5", "skew-10"],
)
def test_gpu_band_pairs_match_cpu(model, tile_rows, tile_cols):
    cupy = import_cupy()
    for r0 in range(0, model.m, tile_rows):
        r1 = min(model.m, r0 + tile_rows)
        cpu = model.band_pairs(r0, r1, tile_cols)
        gpu = model.band_pairs(r0, r1, tile_cols, cupy)
        for name, a, b in zip(("row", "col", "forced"), cpu, gpu, strict=True):
            np.testing.assert_array_equal(b.get(), a, err_msg=f"{name}, rows {r0}:{r1}")


@pytest.mark.gpu
def test_gpu_store_matches_cpu(tmp_path):
    """A store generated on the GPU has the CPU store's pairs, split and order exactly (both
    orientations) and its values to float32 rounding."""
    generate(tmp_path / "cpu.zarr", SMALL, use_gpu=False, **TILES)
    generate(tmp_path / "gpu.zarr", SMALL, use_gpu=True, **TILES)
    cpu, gpu = snapshot(tmp_path / "cpu.zarr"), snapshot(tmp_path / "gpu.zarr")
    assert cpu.keys() == gpu.keys()
    for key in cpu.keys() - {"attrs"}:
        if key.endswith("/val"):
            np.testing.assert_allclose(gpu[key], cpu[key], rtol=1e-5, atol=1e-5, err_msg=key)
        else:
            np.testing.assert_array_equal(gpu[key], cpu[key], err_msg=key)
    assert gpu["attrs"]["stats"] == pytest.approx(cpu["attrs"]["stats"], rel=1e-5)


# ----------------------------------------------------------------------------- benchmarks


@pytest.fixture
def bench(monkeypatch):
    """Import a benchmark script as a module (benchmarks/ on the path for this test)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module


def test_bench_generate_overrides_the_preset_shape(bench):
    """--m, --n or --nnz apply on top of the preset at --scale, as in cumf-dask generate,
    and the label says which were overridden."""
    m, n, nnz = resolve_shape(preset="netflix", scale=0.001)
    args = argparse.Namespace(preset="netflix", scale=0.001, m=None, n=None, nnz=20_000, rank=4)
    model, label = bench("bench_generate").planted_model(args)
    assert ((model.m, model.n, model.nnz, model.rank), label) == (
        (m, n, 20_000, 4), "netflix x 0.001, nnz overridden")  # fmt: skip
    args.m, args.nnz = 300, None
    model, label = bench("bench_generate").planted_model(args)
    assert ((model.m, model.n, model.nnz), label) == (
        (300, n, nnz), "netflix x 0.001, m overridden")  # fmt: skip


def test_bench_summaries_of_a_one_iteration_fit(bench):
    """--iterations 1 has no iteration after the first: bench_scaling takes the first,
    bench_billion says n/a (both failed after the whole fit)."""
    one = [{"seconds": 2.0, "x_seconds": 1.5, "theta_seconds": 0.5}]
    assert bench("bench_scaling").iteration_seconds(one) == {
        "iteration1_s": 2.0, "median_s": 2.0, "x_s": 1.5, "theta_s": 0.5,
    }  # fmt: skip
    assert bench("bench_billion").steady_text(None) == "n/a (one iteration)"
