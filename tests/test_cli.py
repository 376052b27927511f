"""The command line end to end, in subprocesses: ingest -> plan -> train -> resume ->
evaluate -> recommend, generate -> info, exit codes, --quiet and --json."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from cumf_dask.cli import Output

PNG = b"\x89PNG\r\n\x1a\n"
CONFIG = """\
data:
  source: ingest
  store: data/ratings.zarr
  test_fraction: 0.2
  ingest:
    path: ratings.csv
model:
  factors: 4
  iterations: 3
cluster:
  n_workers: 1
  dashboard_address: null
output:
  name: tiny
"""


def cli(
    cwd: Path, *args: str, code: int = 0, terminal: bool = False
) -> subprocess.CompletedProcess:
    """Run `python -m cumf_dask ARGS` in `cwd`; check the exit code.

    `terminal`: rich draws progress bars as on a terminal (FORCE_COLOR), though piped.
    """
    env = {**os.environ, "FORCE_COLOR": "1"} if terminal else None
    proc = subprocess.run(
        [sys.executable, "-m", "cumf_dask", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == code, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def plain(text: str) -> str:
    """`text` without terminal escape sequences."""
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)


def one_json(proc: subprocess.CompletedProcess) -> dict:
    """stdout is exactly one JSON document."""
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A folder with a small ratings CSV in the user's own (string) ids and a config."""
    path = tmp_path_factory.mktemp("cli")
    rng = np.random.default_rng(0)
    pairs = np.unique(rng.integers(0, [80, 30], size=(1600, 2)), axis=0)
    lines = [f"user-{u},film {i},{rng.integers(1, 6)}" for u, i in pairs]
    (path / "ratings.csv").write_text("user,item,rating\n" + "\n".join(lines) + "\n")
    (path / "tiny.yaml").write_text(CONFIG)
    return path


@pytest.fixture(scope="module")
def flow(work: Path) -> dict:
    """plan, train 2 iterations, resume to 3, evaluate, recommend: each command's output."""
    out: dict = {"plan": cli(work, "plan", "tiny.yaml", "--json")}
    out["train"] = cli(
        work, "--json", "train", "tiny.yaml", "--set", "model.iterations=2", terminal=True
    )
    (run,) = (work / "runs").glob("tiny-*")
    out["run"] = run
    out["metrics_after_train"] = (run / "metrics.jsonl").read_text().splitlines()
    out["resume"] = cli(work, "train", "tiny.yaml", "--resume", "--quiet")
    model = str(run / "model.zarr")
    out["evaluate"] = cli(work, "evaluate", model, "data/ratings.zarr", "-k", "5", "--json")
    out["recommend"] = cli(work, "recommend", model, "--user", "user-7", "-k", "3", "--json")
    out["recommend_human"] = cli(work, "recommend", model, "--user", "user-7", "-k", "3")
    return out


def test_plan_ingests_the_store_and_prints_the_plan(flow, work):
    plan = one_json(flow["plan"])
    assert plan["x"]["f"] == 4 and plan["x"]["p"] == 1 and plan["theta"]["side"] == "theta"
    assert (work / "data" / "ratings.zarr").is_dir()


def test_train_writes_the_run_folder(flow):
    run, summary = flow["run"], one_json(flow["train"])
    assert summary["run"] == str(run.relative_to(run.parents[1]))
    assert summary["iterations"] == 2 and summary["factors"] == 4
    assert len(flow["metrics_after_train"]) == 2
    first = json.loads(flow["metrics_after_train"][0])
    assert {"iteration", "seconds", "x_seconds", "theta_seconds", "train_rmse", "test_rmse"} <= set(
        first
    )
    for name in ("config.yaml", "plan.txt", "plan.json", "model.zarr", "summary.json"):
        assert (run / name).exists(), name
    assert "update X" in (run / "plan.txt").read_text()
    assert (run / "rmse.png").read_bytes().startswith(PNG)
    # one summary line per iteration and the progress bar on stderr, the JSON alone on stdout
    lines = [line.strip() for line in re.split(r"[\r\n]", plain(flow["train"].stderr))]
    assert any(re.match(r"iteration 1/2 .* train rmse \d\.\d{4}  test rmse", x) for x in lines)
    assert any(x.startswith("iteration 2/2 ") for x in lines)
    assert any(re.match(r"train .* 2/2", x) for x in lines)


def test_resume_continues_the_run_quietly(flow):
    run = flow["run"]
    assert flow["resume"].stdout == "" and flow["resume"].stderr == ""
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in metrics] == [1, 2, 3]
    assert json.loads((run / "summary.json").read_text())["iterations"] == 3


def test_evaluate_reports_rmse_and_ranking_metrics(flow):
    result = one_json(flow["evaluate"])
    assert {"train_rmse", "test_rmse", "precision@5", "recall@5", "ndcg@5"} <= set(result)
    assert 0 < result["test_rmse"] < 5 and 0 <= result["ndcg@5"] <= 1


def test_recommend_speaks_the_users_ids(flow):
    result = one_json(flow["recommend"])
    assert result["user"] == "user-7" and len(result["items"]) == 3
    assert all(item.startswith("film ") for item in result["items"])
    assert result["scores"] == sorted(result["scores"], reverse=True)
    lines = flow["recommend_human"].stdout.splitlines()
    assert lines[0].startswith("  1. film ") and len(lines) == 3


def test_generate_and_info(work):
    gen = cli(work, "generate", "--m", "300", "--n", "50", "--nnz", "4000", "--rating-min", "1",
              "--rating-max", "5", "-o", "data/gen.zarr", "--json")  # fmt: skip
    info = one_json(cli(work, "info", "data/gen.zarr", "--json"))
    assert one_json(gen)["nnz"] == info["nnz"]
    assert (info["m"], info["n"], info["nnz"] + info["nnz_test"]) == (300, 50, 4000)
    assert info["rows"]["empty"] == 0 and info["bytes_on_disk"] > 0
    assert info["source"]["kind"] == "synthetic"
    human = cli(work, "info", "data/gen.zarr").stdout
    assert "300 x 50" in human and "degree" in human
    assert cli(work, "--quiet", "info", "data/gen.zarr").stdout == ""


def test_ingest_quiet_prints_nothing(work):
    proc = cli(work, "ingest", "ratings.csv", "-o", "data/quiet.zarr", "--quiet")
    assert proc.stdout == "" and proc.stderr == ""


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["train", "missing.yaml"], 2, "missing.yaml: config file not found"),
        (["plan", "tiny.yaml", "--set", "model.factor=3"], 2, "did you mean 'factors'"),
        (["train", "--bogus"], 2, "unrecognized arguments"),
        (["info", "nope.zarr"], 3, "nope.zarr: no rating store here"),
        (["ingest", "empty.csv", "-o", "data/empty.zarr"], 3, "empty.csv"),
        (["bench", "nosuch"], 2, "no benchmark 'nosuch'"),
    ],
)
def test_exit_codes(work, args, code, message):
    (work / "empty.csv").write_text("")
    proc = cli(work, *args, code=code)
    assert message in proc.stderr and proc.stdout == ""


def test_bench_lists_the_available_benchmarks(work):
    assert re.search(r"available: .*kernels", cli(work, "bench", "nosuch", code=2).stderr)


def test_no_plan_fits_exits_4(flow, work):
    cli(work, "plan", "tiny.yaml", "--set", "plan.memory_budget=100B", code=4)


def test_model_errors(flow, work):
    model = str(flow["run"] / "model.zarr")
    wrong = cli(work, "recommend", model, "--user", "nobody", code=2)
    assert "'nobody' is not in the model's user ids" in wrong.stderr
    cli(work, "generate", "--m", "20", "--n", "10", "--nnz", "100", "-o", "data/other.zarr",
        "--quiet")  # fmt: skip
    other = cli(work, "evaluate", model, "data/other.zarr", code=3)
    assert "but the model is 80 x 30" in other.stderr


def test_json_errors_are_one_json_document(work):
    error = one_json(cli(work, "info", "nope.zarr", "--json", code=3))
    assert error["exit_code"] == 3 and "nope.zarr" in error["error"]


def test_log_lines_and_progress_bars_do_not_tear():
    """Lines logged while a bar is live come out whole, above the bar."""
    buffer = io.StringIO()
    out = Output(quiet=False, as_json=False, console=Console(file=buffer, force_terminal=True))
    lines = [f"iteration {i}/3  0.100 s  train rmse 0.5000" for i in (1, 2, 3)]
    with out.progress() as progress:
        for i, line in enumerate(lines, 1):
            progress("train", i - 1, 3)
            out.log(line)
            progress("train", i, 3)
    pieces = [p.strip() for p in re.split(r"[\r\n]", plain(buffer.getvalue()))]
    assert all(line in pieces for line in lines)
    assert any(re.match(r"train .* 3/3", p) for p in pieces)


def test_no_bars_when_not_a_terminal():
    buffer = io.StringIO()
    out = Output(quiet=False, as_json=False, console=Console(file=buffer))
    with out.progress() as progress:
        progress("read", 5, 10)
        out.log("a line")
    assert buffer.getvalue() == "a line\n"
