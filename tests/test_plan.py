"""The planner follows the paper's memory model and best practices."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from cumf_dask.backend.base import split_bytes
from cumf_dask.blocks import Bands, BandSlice, block_on_host
from cumf_dask.config import HalfStepConfig, PlanConfig
from cumf_dask.engine.costs import RATES, half_step_cost
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
    assert "update X: p=2, set by plan.p" in plan.table()
    # "raise q" only where a larger q fits: one row of A (268 MB) fits at no q
    with pytest.raises(PlanError, match=r"no partition fits .*; use more workers") as err:
        _plan(100_000, 100_000, 10**7, 8192, 1, 10**8)
    assert "raise q" not in str(err.value)
    with pytest.raises(PlanError, match=r"p=1, q=2 needs .*; lower f or add memory$"):
        _plan(1000, 500, 20_000, 8192, 1, 10**8, p=1, q=2)
    with pytest.raises(PlanError, match=r"p=1, q=1 needs .*; raise q, lower f"):
        _plan(100_000, 1000, 10_000_000, 16, 1, 10**8, p=1, q=1)
    # a forced q at which p = 1 does not fit (R's block is too big) but p > 1 does
    split = _plan(1000, 1000, 1_000_000, 2, 1, 12_000_000, q=1, blocks="store")
    assert split.x.p > 1 and split.x.q == 1
    assert f"update X: p={split.x.p}, the config's q=1 leaves batches too big" in split.table()
    with pytest.raises(ConfigError, match=r"plan\.groups"):
        _plan(1000, 500, 20_000, 8, 2, GB, groups=[[0], [0]])
    with pytest.raises(PlanError, match=r"plan\.blocks is device but .* at any q; set "
                       r"plan\.blocks to store"):
        _plan(1_000_000, 1000, 100_000_000, 10, 1, GB, blocks="device")
    # host is device on CPU workers: the refusal keeps the user's word
    with pytest.raises(PlanError, match=r"plan\.blocks is host \(on CPU workers: their memory\) "
                       r"but .* set plan\.blocks to store"):
        _plan(1_000_000, 1000, 100_000_000, 10, 1, GB, blocks="host")


def test_a_larger_q_keeps_r_on_the_workers():
    """R (60 MB per worker) does not fit beside the smallest q's working set, but does at a
    larger q: auto and device keep R resident there; a forced q that is too small is named."""
    args = (100_000, 5_000, 5_000_000, 16, 2, 100_000_000)
    plan = make_plan(*args)
    assert plan.blocks == "device" and plan.x.peak + plan.block_bytes() < 0.9 * plan.budget
    assert make_plan(*args, config=PlanConfig(blocks="store")).x.q < plan.x.q
    with pytest.raises(PlanError, match=r"plan\.blocks is device .* at the forced q; raise "
                       r"plan\.q to 6 \(or leave it unset\), or set plan\.blocks to store"):
        make_plan(*args, config=PlanConfig(blocks="device", q=4))
    with pytest.raises(PlanError, match=r"raise plan\.x\.q to 6 and plan\.theta\.q to 4 "
                       r"\(or leave them unset\)"):
        make_plan(*args, config=PlanConfig(blocks="device", x=HalfStepConfig(q=3),
                                           theta=HalfStepConfig(q=2)))  # fmt: skip
    gpu = _gpu_plan(64, memory_budget="3.2GB")  # R (2.38 GB) fits 2.88 GB at a larger q
    assert gpu.blocks == "device" and gpu.x.q > _gpu_plan(64, memory_budget="3.2GB",
                                                          blocks="store").x.q  # fmt: skip
    # at 3 GB, R resident would push X off the GPU: the factors stay, R goes to host memory
    gpu = _gpu_plan(64, memory_budget="3GB")
    assert gpu.blocks == "host" and gpu.host_factor is None


def test_p_above_one_counts_the_sums_of_three_batches():
    """A worker's sums of batch j wait for batch j - 2's reduction (halfstep._partial_sums):
    it holds the sums of up to three batches, which the plan counts (of one before)."""
    f = 8
    packed = (f * (f + 1) // 2 + f) * 4
    for q in (1, 2, 6):
        h = make_plan(1200, 300, 20_000, f, 2, GB, config=PlanConfig(p=2, q=q)).x
        rows = max(np.diff(h.row_bounds))
        assert h.memory["partials"] == min(1200, 3 * rows) * packed


def test_memory_is_that_of_the_largest_batch_part_and_block():
    """Bounds balance ratings, so on skewed data the last batch has many more rows than
    m / q: the estimate is that batch's (and the largest block's), and the plan fits."""
    m, n, f = 200_000, 2_000, 32
    rc = np.r_[np.full(20, 50_000), np.ones(m - 20, np.int64)]  # 20 heavy users
    nnz = int(rc.sum())
    plan = make_plan(m, n, nnz, f, 2, GB // 2, rc, np.full(n, nnz // n))
    h = plan.x
    rows = max(np.diff(h.row_bounds))
    assert rows > 2 * math.ceil(m / h.q)
    assert h.memory["A"] == rows * f * f * 4 and h.memory["B"] == rows * f * 4
    largest = max(rc[a:b].sum() for a, b in itertools.pairwise(h.row_bounds))
    assert h.memory["R block"] == pytest.approx(largest * 12, abs=12)
    assert h.peak < 0.9 * GB // 2


def test_no_block_has_2_31_columns():
    """A block's column indices are int32: the planner splits wider fixed factors, and a
    block that wide is refused, not wrapped."""
    args = (1000, 3_000_000_000, 4_000_000_000, 2, 1, 400 * GB)
    plan = make_plan(*args)  # Theta (24 GB) fits, but not in one block
    assert plan.x.p == 2 and max(np.diff(plan.x.col_bounds)) < 2**31
    with pytest.raises(PlanError, match=r"p=1 leaves 3,000,000,000 columns .*raise p to at "
                       r"least 2"):
        make_plan(*args, config=PlanConfig(p=1))
    wide = 2**31 + 10
    band = BandSlice(0, 0, np.zeros(2, np.int32), np.array([3, 2**31 + 5]),
                     np.ones(2, np.float32))  # fmt: skip
    with pytest.raises(PlanError, match=r"2,147,483,658 columns .* int32"):
        block_on_host(Bands("x", (0, 1), (0, wide), 1, 1, wide, [2], lambda i: band))


def test_a_checkpoint_holding_the_saved_factors_is_counted():
    """A checkpoint holds its iteration's factor pieces until it is written, while the next
    iterations run: factors that fit the devices once but not twice do not stay there."""
    args = (1_000_000, 10_000, 1_000_000, 100, 1, int(1.3 * GB))  # X 400 MB
    device = PlanConfig(factors="device", blocks="store")
    assert make_plan(*args, None, None, device, "cupy").host_factor is None
    with pytest.raises(PlanError, match=r"X and Theta take 0\.40 GB per worker \(twice that "
                       r"while a checkpoint is written\)"):  # fmt: skip
        make_plan(*args, None, None, device, "cupy", checkpoint=True)
    plan = make_plan(*args, None, None, PlanConfig(blocks="store"), "cupy", checkpoint=True)
    assert plan.checkpoint and plan.host_factor == "x"
    roomy = (*args[:5], int(1.6 * GB), None, None, device, "cupy")
    assert make_plan(*roomy).theta.p == 1 and make_plan(*roomy, checkpoint=True).theta.p > 1


def test_a_budget_with_nothing_left_for_data_is_refused():
    """Worker processes whose own memory reaches Dask's pause threshold leave a budget of 0."""
    with pytest.raises(PlanError, match="no memory left for data"):
        make_plan(1000, 100, 10_000, 8, 2, 0)


def test_the_tensor_core_split_of_the_fixed_factor_is_counted():
    """The GPU's tensor-core Gram (float32 factors, explicit ratings, f <= 111) reads the
    fixed factor's part split into float16 halves, a copy as large as the part: a fixed
    factor that fits a worker alone but not beside its split is partitioned. A bfloat16 or
    implicit fit has no split; the NumPy backend never does."""
    args = (400_000_000, 1000, 2_000_000_000, 16, 1, 80 * GB)  # X: 25.6 GB, split 38.4 GB
    plan = make_plan(*args, backend="cupy")
    cols = max(np.diff(plan.theta.col_bounds))
    assert plan.tensor_cores and plan.theta.p > 1
    assert plan.theta.memory["fixed split"] == split_bytes(cols, 16) == cols * 24 * 4
    without = make_plan(*args, backend="cupy", tensor_cores=False)
    assert not without.tensor_cores and without.theta.p == 1
    assert "fixed split" not in without.theta.memory
    wide = make_plan(*args[:3], 112, *args[4:], backend="cupy")  # above the tensor cores' f
    assert not wide.tensor_cores and "fixed split" not in wide.x.memory
    assert "fixed split" not in make_plan(*args, backend="numpy").x.memory


def _gpu_plan(host_gb, held_out=0, **cfg):
    """Netflix on an 8 GB GPU worker (R: 2.4 GB per worker)."""
    return make_plan(480_189, 17_770, 99_000_000, 100, 1, 8 * GB, None, None,
                     PlanConfig(**cfg), "cupy", host_memory=int(host_gb * GB),
                     held_out=held_out)  # fmt: skip


def test_held_out_blocks_count_where_blocks_go():
    """Half of 5 GB holds both orientations (2.38 GB) but not also 11M held-out ratings."""
    assert _gpu_plan(5, memory_budget="2.5GB").blocks == "host"
    plan = _gpu_plan(5, held_out=11_000_000, memory_budget="2.5GB")
    assert plan.blocks == "store" and plan.block_bytes() == (2 * 99_000_000 + 11_000_000) * 12
    for h in (plan.x, plan.theta):  # the next block is read while one computes: two held
        assert h.memory["R block ahead"] == h.memory["R block"] > 0


def test_gpu_blocks_go_to_host_memory_then_to_the_store():
    assert _gpu_plan(64).blocks == "device"
    assert _gpu_plan(64, memory_budget="2.5GB").blocks == "host"  # half of 64 GB holds 2.4
    assert _gpu_plan(4, memory_budget="2.5GB").blocks == "store"  # half of 4 GB does not
    assert _gpu_plan(4, blocks="store").blocks == "store"
    with pytest.raises(PlanError, match=r"plan\.blocks is host .* half of the host memory "
                       r"limit \(4 GB\) allows; set plan\.blocks to store"):
        _gpu_plan(4, memory_budget="2.5GB", blocks="host")
    with pytest.raises(PlanError, match=r"plan\.blocks is host .* set plan\.blocks to device or"):
        _gpu_plan(4, blocks="host")
    with pytest.raises(ConfigError, match=r"plan\.blocks"):
        _gpu_plan(4, blocks="gpu")
    assert _plan(1000, 500, 20_000, 8, 2, GB, blocks="host").blocks == "device"  # CPU workers
    assert "pinned host memory" in _gpu_plan(64, memory_budget="2.5GB").table()


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
    assert "update X: p=1, every worker holds all of Theta (it fits)" in text
    # update Theta split because X does not fit (chosen, not forced), each said so
    text = make_plan(200_000, 30, 200_000, 64, 3, 20_000_000, transport="tcp").table()
    assert "update X: p=1, every worker holds all of Theta" in text
    assert "update Theta: p=6, X does not fit one worker beside a batch" in text
    assert "forced" not in text and "set by" not in text


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


def test_cost_model_counts_ratings_and_rows_at_small_f():
    """At small f the flops are a sliver of a half-step: the CPU's seconds per rating and per
    row and factor add to them (0.004 s of flops, 1.3 s in all, at f = 2 on 4.5M
    ratings); the GPU reads ratings while it computes, so its flop-bound Netflix (f = 100)
    keeps its forecast (0.099 s per iteration; measured 0.077 on an H100)."""
    cpu = half_step_cost(200_000, 20_000, 4_500_000, 2, 1, 1, 1, "numpy", math.inf)
    rates = RATES["numpy"]
    assert cpu.compute == pytest.approx(
        4_500_000 * 6 / rates.gram_fused + 200_000 * 8 / 3 / rates.solve
        + 4_500_000 * rates.rating + 200_000 * 2 * rates.row)  # fmt: skip
    assert cpu.compute > 50 * (4_500_000 * 6 / rates.gram_fused)
    netflix = make_plan(480_189, 17_770, 99_000_000, 100, 1, 80 * GB, backend="cupy")
    assert sum(h.predicted["seconds"] for h in (netflix.x, netflix.theta)) == pytest.approx(
        0.099, abs=0.005)
    small = half_step_cost(82_500_000, 2_400_000, 437_500_000, 10, 1, 1, 1, "cupy", math.inf)
    assert small.compute == pytest.approx(0.0547, rel=0.05)  # RESULTS.md, session 18
    host = _gpu_plan(64, memory_budget="2.5GB")  # R copied over the bus each half-step
    assert host.x.predicted["copy"] == pytest.approx(99_000_000 * 12 / 45e9, rel=1e-6)


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


def test_gpu_factors_above_the_kernels_limit_are_a_config_error():
    """The GPU kernels' limit is known before anything starts: one ConfigError (exit 2)
    from the plan, not a task's ValueError after the cluster started and the blocks loaded."""
    from cumf_dask.backend.base import MAX_F

    assert MAX_F == 2032
    with pytest.raises(ConfigError, match=r"model\.factors 2040: the GPU backend supports up "
                                          r"to 2032 .*cluster\.backend: numpy"):  # fmt: skip
        make_plan(1000, 500, 20_000, MAX_F + 8, 1, 80 * GB, backend="cupy")
    assert make_plan(1000, 500, 20_000, MAX_F, 1, 80 * GB, backend="cupy").x.p >= 1
    assert make_plan(1000, 500, 20_000, MAX_F + 8, 1, 80 * GB, backend="numpy").x.p >= 1


def test_gpu_factors_are_refused_before_fit_starts_a_cluster(monkeypatch):
    """ALS().fit() without a client checks the limit before its own cluster starts."""
    import cumf_dask.model as model

    def no_cluster(*args, **kwargs):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr(model, "resolve_backend_name", lambda name: "cupy")
    monkeypatch.setattr(model, "cluster_client", no_cluster)
    users, items = np.arange(6) % 3, np.arange(6) % 2
    with pytest.raises(ConfigError, match=r"model\.factors 2040: the GPU backend"):
        model.ALS(factors=2040, backend="cupy").fit((users, items, np.ones(6, np.float32)))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (PlanConfig(p=0), r"'plan\.p' must be >= 1, got 0"),
        (PlanConfig(q=-1), r"'plan\.q' must be >= 1, got -1"),
        (PlanConfig(p=2.5), r"'plan\.p' must be an integer, got 2\.5"),
        (PlanConfig(x=HalfStepConfig(p="2")), r"'plan\.x\.p' must be an integer, got '2'"),
        (PlanConfig(p=2, reduction="scatterr"),
         r"'plan\.reduction' must be one of 'scatter', 'two-phase', 'one', got 'scatterr'"),
        (PlanConfig(headroom=None), r"'plan\.headroom' must be a size such as '10%'"),
    ],
)
def test_a_plan_config_made_in_python_is_checked_as_a_files(config, message):
    """The rules of a config file's plan section, not p=0 run as 1, a misspelt reduction
    recorded as the one used, or a NumPy error deep in the planner."""
    from cumf_dask.implicit.model import ImplicitALS
    from cumf_dask.model import ALS

    with pytest.raises(ConfigError, match=message):
        make_plan(1000, 500, 20_000, 8, 2, GB, config=config)
    for cls in (ALS, ImplicitALS):  # before the data is read or a cluster starts
        with pytest.raises(ConfigError, match=message):
            cls(plan=config).fit("no-such-store.zarr")
