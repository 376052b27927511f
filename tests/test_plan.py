"""The planner follows the paper's memory model and best practices."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cumf_dask.config import HalfStepConfig, PlanConfig
from cumf_dask.engine.costs import half_step_cost
from cumf_dask.engine.plan import balanced_bounds, make_plan
from cumf_dask.errors import ConfigError, PlanError

GB = 10**9


def _plan(m, n, nnz, f, workers, budget, **cfg):
    rc = np.full(m, nnz // m)
    cc = np.full(n, nnz // n)
    return make_plan(m, n, nnz, f, workers, budget, rc, cc, PlanConfig(**cfg))


def test_netflix_on_one_big_worker_is_model_parallel():
    plan = _plan(480_189, 17_770, 99_000_000, 100, 1, 80 * GB)
    assert plan.x.p == 1 and plan.theta.p == 1
    assert plan.blocks == "device"


def test_huge_fixed_factor_needs_data_parallelism():
    # Hugewiki: X (50M x 100 floats = 20 GB) cannot be replicated in 12 GB workers.
    plan = _plan(50_082_603, 39_780, 3_100_000_000, 100, 4, 12 * GB)
    assert plan.x.p == 1  # Theta is small
    assert plan.theta.p > 1  # X must be split (paper: n f / p ~ C / 2)
    assert plan.theta.peak < 12 * GB
    assert plan.blocks == "store"  # CPU workers: the host is the device


def test_smallest_q_that_fits():
    plan = _plan(1_000_000, 1000, 10_000_000, 100, 1, 2 * GB)
    q = plan.x.q
    assert q > 1
    smaller = _plan(1_000_000, 1000, 10_000_000, 100, 1, 2 * GB, x=HalfStepConfig(q=q - 1))
    assert smaller.x.q == q - 1  # forced values are honoured ...
    assert plan.x.peak < 2 * GB * 0.9


def test_forced_values_and_errors():
    plan = _plan(1000, 500, 20_000, 8, 2, GB, p=2, q=3)
    assert (plan.x.p, plan.x.q, plan.theta.p, plan.theta.q) == (2, 3, 2, 3)
    with pytest.raises(PlanError, match="no partition fits"):
        _plan(100_000, 100_000, 10**7, 8192, 1, 10**8)  # one row of A is 268 MB
    with pytest.raises(ConfigError, match=r"plan\.groups"):
        _plan(1000, 500, 20_000, 8, 2, GB, groups=[[0], [0]])
    with pytest.raises(PlanError, match=r"plan\.blocks is device .* set plan\.blocks to store"):
        _plan(1_000_000, 1000, 100_000_000, 10, 1, GB, blocks="device")


def _gpu_plan(host_gb, held_out=0, **cfg):
    """Netflix on an 8 GB GPU worker: R (2.4 GB) fits only without the Hermitians' room."""
    return make_plan(480_189, 17_770, 99_000_000, 100, 1, 8 * GB, None, None,
                     PlanConfig(**cfg), "cupy", host_memory=int(host_gb * GB),
                     held_out=held_out)  # fmt: skip


def test_held_out_blocks_count_where_blocks_go():
    """Half of 5 GB holds both orientations (2.38 GB) but not also 11M held-out ratings."""
    assert _gpu_plan(5, memory_budget="3GB").blocks == "host"
    plan = _gpu_plan(5, held_out=11_000_000, memory_budget="3GB")
    assert plan.blocks == "store" and plan.block_bytes() == (2 * 99_000_000 + 11_000_000) * 12


def test_gpu_blocks_go_to_host_memory_then_to_the_store():
    assert _gpu_plan(64).blocks == "device"
    assert _gpu_plan(64, memory_budget="3GB").blocks == "host"  # half of 64 GB holds 2.4
    assert _gpu_plan(4, memory_budget="3GB").blocks == "store"  # half of 4 GB does not
    assert _gpu_plan(4, blocks="store").blocks == "store"
    with pytest.raises(PlanError, match=r"plan\.blocks is host .* half of the host memory "
                       r"limit \(4\.00 GB\) allows; set plan\.blocks to store"):
        _gpu_plan(4, memory_budget="3GB", blocks="host")
    with pytest.raises(PlanError, match=r"plan\.blocks is host .* set plan\.blocks to device or"):
        _gpu_plan(4, blocks="host")
    with pytest.raises(ConfigError, match=r"plan\.blocks"):
        _gpu_plan(4, blocks="gpu")
    assert _plan(1000, 500, 20_000, 8, 2, GB, blocks="host").blocks == "device"  # CPU workers
    assert "pinned host memory" in _gpu_plan(64, memory_budget="3GB").table()


def _facebook_plan(budget_gb, workers=1, **cfg):
    """Facebook x 0.01 (100M x 4.8M, 1.12B ratings, f = 16: X 6.4 GB) on 80 GB GPUs."""
    m, n, nnz = 100_000_000, 4_800_000, 1_120_000_000
    return make_plan(m, n, nnz, 16, workers, 80 * GB, None, None,
                     PlanConfig(memory_budget=f"{budget_gb}GB", **cfg), "cupy",
                     host_memory=128 * GB)  # fmt: skip


def test_factor_goes_to_host_memory_when_it_does_not_fit():
    assert _facebook_plan(80).host_factor is None  # R (27 GB) and X fit the GPU
    plan = _facebook_plan(6)
    assert plan.host_factor == "x" and plan.blocks == "host"
    assert plan.theta.p > 1  # X comes to the GPU in parts of at most half the budget
    assert plan.theta.peak + plan.factor_bytes() < 6 * GB * 0.9
    assert plan.factor_bytes() == 4_800_000 * 16 * 4  # Theta stays on the GPU
    # X crosses to the GPU once per half-step: the sums of all of Theta's batches fit
    assert plan.theta.parts_outer and plan.theta.copied_in == pytest.approx(6.4e9, rel=1e-6)
    assert "X in pinned host memory (copied in once per half-step)" in plan.table()
    tight = _facebook_plan(3.5)  # they do not: X crosses once per batch
    assert not tight.theta.parts_outer and tight.theta.copied_in >= tight.theta.q * 6.4e9
    assert "(copied in once per batch)" in tight.table()
    # update X's blocks (over 256 MB) are copied ahead: three on the GPU at once, counted
    assert plan.x.staged and not plan.theta.staged and "copied ahead" in plan.table()
    assert plan.x.memory["R blocks ahead"] == 2 * plan.x.memory["R block"]
    assert plan.x.peak + plan.factor_bytes() < 6 * GB * 0.9
    assert _facebook_plan(80, factors="host").host_factor == "x"  # forced
    # two workers: each holds half of X, and in update Theta the parts of X it gathered
    # (the other half's worth): that fits 8 GB, not 6
    assert _facebook_plan(8, workers=2).host_factor is None
    assert _facebook_plan(6, workers=2).host_factor == "x"
    with pytest.raises(PlanError, match=r"plan\.factors is device .* set plan\.factors to host"):
        _facebook_plan(6, factors="device")
    with pytest.raises(ConfigError, match=r"plan\.factors"):
        _facebook_plan(6, factors="disk")
    assert _plan(1000, 500, 20_000, 8, 2, GB, factors="host").host_factor is None  # CPU


def test_table_mentions_both_half_steps():
    text = _plan(1000, 500, 20_000, 8, 2, GB).table()
    assert "update X" in text and "update Theta" in text and "peak GB" in text


def test_balanced_bounds_cover_and_balance():
    counts = np.r_[np.full(10, 100), np.ones(990)]
    bounds = balanced_bounds(counts, 4)
    assert bounds[0] == 0 and bounds[-1] == 1000 and np.all(np.diff(bounds) > 0)
    loads = [counts[a:b].sum() for a, b in itertools.pairwise(bounds)]
    assert max(loads) < 0.5 * counts.sum()


def test_cost_model_keeps_a_tall_factor_where_it_was_solved():
    """Hugewiki-like (m >> n f / 2): update Theta is data parallel over the X batches, so X
    (20 GB) never moves; only packed partial Hermitians do."""
    m, n, nnz = 50_082_603, 39_780, 3_100_000_000
    kw = {"row_counts": np.full(m, nnz // m), "col_counts": np.full(n, nnz // n)}
    plan = make_plan(m, n, nnz, 100, 4, 140 * GB, backend="cupy", link=60e9, **kw)
    assert plan.x.p == 1 and plan.theta.p == plan.x.q and plan.theta.aligned
    assert plan.theta.col_bounds == plan.x.row_bounds  # parts = the batches X was solved in
    replicate = make_plan(
        m, n, nnz, 100, 4, 140 * GB, backend="cupy", link=60e9, config=PlanConfig(p=1), **kw
    )
    assert plan.theta.predicted["moved"] < replicate.theta.predicted["moved"] / 10
    assert "data parallel over the batches" in plan.table()


def test_cost_model_replicates_a_short_factor():
    """Netflix on 2 GPUs over NVLink: all-gathering X (192 MB) moves less than reducing
    17,770 packed 100 x 100 Hermitians, so both half-steps stay model parallel."""
    plan = _plan(480_189, 17_770, 99_000_000, 100, 2, 80 * GB)
    assert (plan.x.p, plan.theta.p) == (1, 1) and plan.x.q >= 2
    fast = make_plan(480_189, 17_770, 99_000_000, 100, 2, 80 * GB, backend="cupy", link=60e9)
    slow = make_plan(480_189, 17_770, 99_000_000, 100, 2, 80 * GB, backend="cupy", link=1e9)
    assert slow.theta.predicted["transfer"] > 30 * fast.theta.predicted["transfer"] > 0
    assert "60.0 GB/s (measured)" in fast.table()


def test_counts_that_leave_a_worker_idle_cost_what_they_leave():
    """The busiest worker sets a half-step's time: 3 batches (or parts) on 2 workers take
    as long as 2 of 2 bigger ones would, so the planner runs as many on every worker."""
    args = (1_000_000, 20_000, 50_000_000, 32)
    cost = {(p, q): half_step_cost(*args, p, q, 2, "cupy", 60e9).compute
            for p, q in ((1, 2), (1, 3), (1, 4), (2, 4), (3, 4), (4, 4))}  # fmt: skip
    assert cost[1, 3] == pytest.approx(cost[1, 4] * 4 / 3)
    assert cost[1, 2] == pytest.approx(cost[1, 4])
    assert cost[3, 4] > cost[4, 4] == pytest.approx(cost[2, 4])
    plan = _plan(1_000_000, 1000, 10_000_000, 100, 2, 2 * GB)
    assert plan.x.p == 1 and plan.x.q > 2 and plan.x.q % 2 == 0


def test_reduce_to_one_costs_one_worker_every_sum_and_solve():
    """reduction "one": the one worker receives the other holders' whole sums and solves
    every row; the reduce-scatter spreads both over the workers."""
    args = (2_000_000, 40_000, 100_000_000, 100, 4, 4, 4, "cupy", 60e9)
    one, scatter = (half_step_cost(*args, aligned=True, reduction=r) for r in ("one", "scatter"))
    assert one.moved == pytest.approx(scatter.moved * 4)  # 3 whole sums vs 3/4 of one
    assert one.compute > scatter.compute
    one, scatter = (_plan(50_000, 200_000, 5_000_000, 32, 4, 4 * GB, p=4, q=2, reduction=r)
                    for r in ("one", "scatter"))  # fmt: skip
    assert one.theta.predicted["seconds"] > scatter.theta.predicted["seconds"]  # the plan's
