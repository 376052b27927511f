"""The optional bfloat16 factor storage: off by default, close to float32 when on."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BACKENDS, random_ratings, rel_err

from cumf_dask.backend import backend_spec, get_backend
from cumf_dask.backend.base import round_bfloat16
from cumf_dask.data.spill import build_store
from cumf_dask.errors import ConfigError
from cumf_dask.model import ALS


def test_round_bfloat16_keeps_8_significant_bits():
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    r = round_bfloat16(np, x)
    assert (r.view(np.uint32) & 0xFFFF == 0).all()
    assert np.abs(r - x).max() <= np.abs(x).max() * 2.0**-8
    assert rel_err(r, x) < 3e-3


@pytest.mark.parametrize("name", BACKENDS)
def test_bfloat16_fit_is_close_to_float32(tmp_path, name, clients):
    rows, cols, vals = random_ratings(120, 80, 0.15, seed=9)
    store = build_store(
        str(tmp_path / "r.zarr"), rows, cols, vals, shape=(120, 80), test_fraction=0.1
    )
    client = clients(1)
    full = ALS(8, 0.1, 4, backend=name).fit(store, client=client)
    half = ALS(8, 0.1, 4, backend=name, precision="bfloat16").fit(store, client=client)
    assert get_backend(backend_spec(name, "bfloat16")).precision == "bfloat16"
    assert 0 < rel_err(half.user_factors_, full.user_factors_) < 0.05
    assert abs(half.metrics_[-1]["test_rmse"] - full.metrics_[-1]["test_rmse"]) < 0.02


def test_unknown_precision_is_refused():
    with pytest.raises(ConfigError, match="precision"):
        ALS(4, precision="float8").fit((np.array([0]), np.array([0]), np.array([1.0])))
