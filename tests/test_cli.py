"""The command line end to end, in subprocesses: ingest -> plan -> train -> resume ->
evaluate -> recommend, generate -> info, exit codes, --quiet and --json."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from cumf_dask.cli import main
from cumf_dask.commands import OWN_DATA
from cumf_dask.errors import ConfigError, StoreError
from cumf_dask.output import Output, rmse_line

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
    (run,) = (work / "runs").glob("tiny-2*")  # tiny-<timestamp>, not tiny-latest
    out["run"] = run
    out["metrics_after_train"] = (run / "metrics.jsonl").read_text().splitlines()
    out["resume"] = cli(work, "train", "tiny.yaml", "--resume", "--quiet")
    latest = "runs/tiny-latest"  # the run folder of the newest run, whatever its timestamp
    out["evaluate"] = inproc(work, "evaluate", latest, "data/ratings.zarr", "-k", "5", "--json")
    out["recommend"] = inproc(work, "recommend", latest, "--user", "user-7", "-k", "3", "--json")
    out["recommend_human"] = inproc(work, "recommend", latest, "--user", "user-7", "-k", "3")
    return out


def inproc(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """main(args) in this process, in `cwd`, its output captured as cli() would capture it."""
    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        os.chdir(here)
    assert code == 0, f"exit {code}\n{out.getvalue()}\n{err.getvalue()}"
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def test_a_failed_train_leaves_latest_on_the_last_model(flow, work):
    """A run that fails (here: a damaged store) does not take the -latest link; failing
    before its first iteration, it leaves no run folder either (--resume would find none)."""
    before = (work / "runs" / "tiny-latest").resolve()
    folders = sorted((work / "runs").iterdir())
    bad = work / "bad.zarr"
    shutil.copytree(work / "data" / "ratings.zarr", bad)
    next((bad / "by_row").rglob("val/c/*")).unlink()
    cli(work, "train", "tiny.yaml", "--set", "data.source=store", "--set", "data.store=bad.zarr",
        "--quiet", code=3)  # fmt: skip
    assert (work / "runs" / "tiny-latest").resolve() == before
    assert (before / "model.zarr").is_dir()
    assert sorted((work / "runs").iterdir()) == folders


def test_a_folder_of_runs_or_a_failed_run_is_named_as_such(tmp_path):
    from cumf_dask.records import model_path

    run = tmp_path / "runs" / "x-20261124-000000"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    (tmp_path / "runs" / "x-latest").symlink_to(run.name)
    with pytest.raises(StoreError, match=r"is a folder of runs, not a model: .*x-latest"):
        model_path(tmp_path / "runs")
    with pytest.raises(StoreError, match="run folder without a saved model"):
        model_path(run)
    model = run / ".tmp-model.zarr-0badf00d"
    model.mkdir()
    (model / "zarr.json").write_text(json.dumps(
        {"attributes": {"format": "cumf-dask-model", "complete": True}}))  # fmt: skip
    with pytest.raises(StoreError, match=r"an interrupted save left complete copies beside it "
                       r"\(\.tmp-model\.zarr-0badf00d\): .*a run's model: run the command that "
                       r"started it again, with --resume\)"):
        from cumf_dask.model import ALS

        ALS.load(run)


def test_run_folders_of_one_second_and_a_latest_that_is_a_folder(tmp_path, monkeypatch):
    """Runs started in the same second get folders of their own; a -latest that is a real
    folder (runs copied with cp -rL) is left as it is, with a warning, and not claimed."""
    from concurrent.futures import ThreadPoolExecutor

    from cumf_dask.config import load_config
    from cumf_dask.errors import CumfWarning
    from cumf_dask.records import RunFolder

    config = load_config(overrides=[f"output.dir={tmp_path}", "output.name=x"])
    monkeypatch.setattr("time.strftime", lambda _: "20261124-000000")
    with ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(lambda _: RunFolder.create(config).path.name, range(8)))
    assert sorted(runs) == sorted(["x-20261124-000000", *(f"x-20261124-000000-{k}"
                                                          for k in range(2, 9))])  # fmt: skip
    assert RunFolder(tmp_path / runs[0]).make_latest(config) == tmp_path / "x-latest"
    (tmp_path / "x-latest").unlink()
    (tmp_path / "x-latest").mkdir()
    with pytest.warns(CumfWarning, match=r"x-latest is not a link .*; remove it to have it "
                      "follow the newest run again"):  # fmt: skip
        assert RunFolder(tmp_path / runs[1]).make_latest(config) is None
    assert (tmp_path / "x-latest").is_dir() and not (tmp_path / "x-latest").is_symlink()


def test_a_metrics_line_cut_short_by_a_kill_is_dropped(tmp_path):
    """A run killed while it wrote a line leaves it without its newline: the next record
    is not glued onto it (both would be lost as one line that does not parse)."""
    from cumf_dask.records import RunFolder

    run = RunFolder(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"iteration": 1}\n{"iteration": 2, "secon')
    run.append_metrics({"iteration": 2, "seconds": 0.5})
    run.append_metrics({"iteration": 3, "seconds": 0.5})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 2, 3]


def test_resume_without_checkpoints_is_refused_at_once(tmp_path):
    from cumf_dask.config import load_config
    from cumf_dask.pipeline import train

    config = load_config(overrides=[f"output.dir={tmp_path}", "output.checkpoint=false"])
    with pytest.raises(ConfigError, match=r"--resume needs output\.checkpoint: true \(this config "
                       r"turns checkpoints off\)"):  # fmt: skip
        train(config, resume=True, log=lambda _: None)


def test_plan_ingests_the_store_and_prints_the_plan(flow, work):
    plan = one_json(flow["plan"])
    assert plan["x"]["f"] == 4 and plan["x"]["p"] == 1 and plan["theta"]["side"] == "theta"
    assert plan["workers"] == 1 and not plan["estimated"] and plan["refused"] is None
    assert plan["forecast"]["iterations"] == 3 and plan["forecast"]["total"] > 0
    assert (work / "data" / "ratings.zarr").is_dir()


def test_train_writes_the_run_folder(flow):
    run, summary = flow["run"], one_json(flow["train"])
    assert summary["run"] == str(run.relative_to(run.parents[1]))
    latest = run.parent / "tiny-latest"
    assert latest.is_symlink() and latest.resolve() == run.resolve()
    assert summary["latest"] == str(latest.relative_to(run.parents[1]))
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
    assert lines[0] == "top 3 for user user-7" and lines[1].split() == ["rank", "item", "score"]
    rows = lines[2:]
    assert len(rows) == 3 and all(row.split()[1] == "film" for row in rows)
    assert [row.split()[0] for row in rows] == ["1", "2", "3"]
    # aligned: every column starts and ends at the same place on every line
    assert len({row.index("film") for row in rows} | {lines[1].index("item")}) == 1
    assert len({len(line) for line in lines[1:]}) == 1  # scores right-aligned to the header


@pytest.fixture
def run_cli(work, monkeypatch, capsys):
    """run_cli(*args, code=0) -> (stdout, stderr): main() in this process, in `work` (quicker
    than a subprocess; the process-level behaviour is what cli() tests)."""
    monkeypatch.chdir(work)

    def run(*args: str, code: int = 0) -> tuple[str, str]:
        try:
            got = main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            got = exc.code
        out, err = capsys.readouterr()
        assert got == code, f"exit {got}\n{out}\n{err}"
        return out, err

    return run


def test_ctrl_c_while_the_libraries_load_is_an_interrupt(monkeypatch, run_cli):
    """The command's module starts without Dask, Zarr or the engine (they load in main, where
    a Ctrl-C is 'interrupted', exit 130, not a traceback from the imports)."""
    started = subprocess.run(
        [sys.executable, "-c", "import sys, cumf_dask.cli; print(sorted({'dask', 'zarr', "
         "'cumf_dask.engine', 'cumf_dask.commands'} & set(sys.modules)))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert started.stdout.strip() == "[]"

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("cumf_dask.cli.build_parser", interrupted)
    out, err = run_cli("--json", "info", "x.zarr", code=130)
    assert "interrupted" in err and json.loads(out)["exit_code"] == 130


def test_sigterm_cleans_up_as_ctrl_c_does(work, run_cli, monkeypatch):
    """SIGTERM (`timeout`, a batch scheduler) during a fit: exit 143 and the same cleanup as
    a Ctrl-C, so no run folder without a finished iteration is left (nor its lock)."""

    def terminated(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr("cumf_dask.model.ALS.fit", terminated)
    out, err = run_cli("--json", "train", "tiny.yaml", "--set", "output.name=term", code=143)
    assert "terminated (SIGTERM)" in err and json.loads(out)["exit_code"] == 143
    assert not list((work / "runs").glob("term*"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored after the command


def test_generate_and_info(work, run_cli):
    gen, _ = run_cli("generate", "--m", "300", "--n", "50", "--nnz", "4000", "--rating-min", "1",
                     "--rating-max", "5", "-o", "data/gen.zarr", "--json")  # fmt: skip
    info = json.loads(run_cli("info", "data/gen.zarr", "--json")[0])
    assert json.loads(gen)["nnz"] == info["nnz"]
    assert (info["m"], info["n"], info["nnz"] + info["nnz_test"]) == (300, 50, 4000)
    assert info["rows"]["empty"] == 0 and info["bytes_on_disk"] > 0
    assert info["source"]["kind"] == "synthetic"
    human = run_cli("info", "data/gen.zarr")[0]
    assert "300 x 50" in human and "degree" in human
    assert cli(work, "--quiet", "info", "data/gen.zarr").stdout == ""
    verified = json.loads(run_cli("info", "data/gen.zarr", "--verify", "--json")[0])["verified"]
    assert (verified["ratings"], verified["held_out"]) == (info["nnz"], info["nnz_test"])
    assert "every chunk read and checked" in run_cli("info", "--verify", "data/gen.zarr")[0]
    shard = next((work / "data/gen.zarr/by_col/0/val/c").iterdir())
    shard.write_bytes(shard.read_bytes()[:-5] + b"\0" * 5)  # a damaged shard index
    run_cli("info", "data/gen.zarr", code=0)  # the metadata alone looks sound
    _, err = run_cli("info", "data/gen.zarr", "--verify", code=3)
    assert "damaged store" in err


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
        (["ingest", "ratings.csv", "--format", "xls", "-o", "data/x.zarr"], 2,
         "invalid choice: 'xls'"),
        (["bench", "nosuch"], 2, "no benchmark 'nosuch'"),
    ],
)  # fmt: skip
def test_exit_codes(work, run_cli, args, code, message):
    (work / "empty.csv").write_text("")
    out, err = run_cli(*args, code=code)
    assert message in err and out == ""


def test_bench_lists_the_available_benchmarks(run_cli):
    assert re.search(r"available: .*kernels", run_cli("bench", "nosuch", code=2)[1])


def test_running_out_of_host_memory_is_one_error(work, run_cli, monkeypatch):
    from cumf_dask.data.spill import StoreBuilder

    def too_big(*args, **kwargs):
        raise MemoryError("Unable to allocate 9.1 TiB")

    monkeypatch.setattr(StoreBuilder, "add", too_big)
    _, err = run_cli("ingest", "ratings.csv", "-o", "data/oom.zarr", code=4)
    assert "ran out of memory during `ingest`" in err and "9.1 TiB" in err
    assert "Traceback" not in err and not (work / "data/oom.zarr").exists()


def test_no_plan_fits_exits_4(flow, run_cli):
    run_cli("plan", "tiny.yaml", "--set", "plan.memory_budget=100B", code=4)


def test_model_errors(flow, run_cli):
    model = str(flow["run"] / "model.zarr")
    _, wrong = run_cli("recommend", model, "--user", "nobody", code=2)
    assert "'nobody' is not in the model's user ids" in wrong
    run_cli("generate", "--m", "20", "--n", "10", "--nnz", "100", "-o", "data/other.zarr")
    _, other = run_cli("evaluate", model, "data/other.zarr", code=3)
    assert "but the model is 80 x 30" in other


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


# ----------------------------------------------------------------------------- in process

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_cluster(monkeypatch):
    """Starting a cluster fails the test: what must happen before any cluster starts."""

    def refuse(*args, **kwargs):
        raise AssertionError("a cluster was started")

    monkeypatch.setattr("cumf_dask.engine.cluster.make_client", refuse)


def test_help_shows_defaults_choices_and_benchmarks(capsys):
    for command in ("ingest", "generate", "evaluate", "recommend", "train", "bench"):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "(default: 0.1)" in text and "(default: csv)" in text and "(default: 10)" in text
    assert "{csv,tsv,delimited,movielens-100k,movielens-1m,movielens-csv,netflix,parquet}" in text
    assert "(default: None)" not in text and "(default: False)" not in text
    seed = next(x for x in text.splitlines() if x.strip().startswith("--seed"))
    assert seed.endswith("(default: 0)")  # a default of 0 is still a default
    for option in ("--delimiter", "--seed", "--split-seed", "--tile-cols", "-k K", "--user USER"):
        line = next(x for x in text.splitlines() if x.strip().startswith(option))
        assert len(line.split(maxsplit=2 if " " in option else 1)) > 1, f"{option} has no help"
    assert re.search(r"available benchmarks: .*kernels", text, re.DOTALL)


def test_plan_of_a_local_run_starts_no_cluster(work, monkeypatch, no_cluster, capsys):
    monkeypatch.chdir(work)
    assert main(["plan", "tiny.yaml", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["workers"] == 1 and plan["backend"] in ("numpy", "cupy")


@pytest.mark.parametrize(
    ("config", "code", "message"),
    [
        ("data: {source: ingest, store: data/m.zarr, ingest: {path: missing.csv}}", 3,
         "missing.csv: no such file"),
        ("data: {source: store, store: data/none.zarr}", 3, "no rating store"),
        ("data: {source: generate, generate: {m: 10, n: 10}}", 2, "generate needs nnz"),
    ],
)  # fmt: skip
def test_missing_input_fails_before_any_cluster(work, monkeypatch, no_cluster, capsys,
                                                config, code, message):  # fmt: skip
    monkeypatch.chdir(work)
    (work / "bad.yaml").write_text(config + "\n")
    for command in ("train", "plan"):
        assert main([command, "bad.yaml"]) == code
        assert message in capsys.readouterr().err


CPU_NETFLIX = [str(ROOT / "configs" / "netflix.yaml"), "--set", "cluster.backend=numpy",
               "--set", "cluster.n_workers=2", "--set", "plan.memory_budget=64GB"]  # fmt: skip


def test_a_gpu_size_job_is_refused_on_the_cpu(tmp_path, monkeypatch, no_cluster, capsys):
    """Full-size Netflix on 2 CPU workers: refused before anything starts, with the forecast
    and the fixes (a scale, a GPU, --force); plan says the same."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("cumf_dask.budget.CPU_TIME_LIMIT", 600.0)  # machine independent
    assert main(["train", *CPU_NETFLIX]) == 2
    err = " ".join(capsys.readouterr().err.split())
    forecast = (r"forecast to take [\d.]+ (min|h) \([\d.]+ (s|min) per iteration x 10 \+ "
                r"[\d.]+ (s|min) generating 99,000,000 ratings\) on 2 CPU workers")  # fmt: skip
    assert re.search(forecast, err)
    # a store of its own for the small data: the full-size name stays free
    assert re.search(r"--set data.generate.scale=(0\.\d+) --set data.store=\S+-scale\1\.zarr "
                     r"\(forecast [\d.]+ (s|min)\)", err)  # fmt: skip
    assert "--force" in err
    assert not (tmp_path / "data").exists() and not (tmp_path / "runs").exists()
    assert main(["plan", *CPU_NETFLIX, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["estimated"] and plan["forecast"]["generate_nnz"] == 99_000_000
    assert "--force" in plan["refused"]


def test_force_runs_it_anyway(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("cumf_dask.budget.CPU_TIME_LIMIT", 600.0)

    def reached(*args, **kwargs):
        raise ConfigError("the cluster would start now")

    monkeypatch.setattr("cumf_dask.engine.cluster.make_client", reached)
    assert main(["train", *CPU_NETFLIX, "--force"]) == 2
    assert "the cluster would start now" in capsys.readouterr().err


def test_train_on_a_store_in_one_command(flow, work, monkeypatch, capsys):
    """`train --store PATH`: model settings for real data, the run named after the store."""
    monkeypatch.chdir(work)
    args = ["train", "--store", "data/ratings.zarr", "--set", "model.iterations=1",
            "--set", "cluster.dashboard_address=null", "--json"]  # fmt: skip
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["factors"] == OWN_DATA["factors"] == 64
    assert summary["run"].startswith("runs/ratings-") and summary["latest"] == "runs/ratings-latest"
    config = (work / summary["run"] / "config.yaml").read_text()
    assert "regularization: 0.1" in config and "source: store" in config


def test_rmse_line_names_the_reference():
    clipped = {"test_rmse": 0.2068, "planted_test_rmse": 0.2335, "noise": 0.25, "clipped": True}
    assert rmse_line(clipped).startswith(
        "final test RMSE 0.2068 (planted X* Theta*^T before clipping 0.2335, noise sigma 0.25;"
    )
    assert rmse_line({"test_rmse": 0.26, "noise": 0.25, "planted_test_rmse": 0.25}) == (
        "final test RMSE 0.2600 (the floor: noise sigma 0.25)"
    )
    assert rmse_line({"test_rmse": 0.9}) == "final test RMSE 0.9000"  # own data: no reference


def test_a_long_job_is_announced_with_a_smaller_scale(tmp_path, monkeypatch):
    """Under the refusal limit, a job over a minute is logged with its forecast first."""
    from cumf_dask.budget import check_cpu_time, forecast_note
    from cumf_dask.config import load_config
    from cumf_dask.pipeline import job_plan

    monkeypatch.chdir(tmp_path)
    config = load_config(CPU_NETFLIX[0], overrides=CPU_NETFLIX[2::2])
    planned = job_plan(config, None, log=lambda _: None)
    fc = check_cpu_time(config, planned.plan, planned.generate_nnz, force=False)
    note = forecast_note(config, planned.plan, fc)
    assert note.startswith("forecast: ") and "on 2 CPU workers" in note
    assert re.search(r"a CPU-size version: --set data\.generate\.scale=0\.\d+ --set "
                     r"data\.store=\S+\.zarr \(forecast", note)  # fmt: skip


# ----------------------------------------------------------------------------- review fixes


def strict_json(text: str) -> dict:
    """`text` as strict JSON: NaN and Infinity are not JSON."""

    def refuse(constant: str):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_plans_are_strict_json(flow):
    """CPU workers in this process (plan's): the link is unbounded, written as null; a GPU
    cluster's workers are processes, with the transport's assumed link."""
    plan = strict_json(flow["plan"].stdout)
    assert plan["link"] is None if plan["backend"] == "numpy" else plan["link"] > 0
    assert strict_json((flow["run"] / "plan.json").read_text())["workers"] == 1


def test_plan_never_rebuilds_a_store(flow, work, run_cli):
    """data.overwrite rebuilds an ingested store in train, never in plan."""
    meta = work / "data" / "ratings.zarr" / "zarr.json"
    build = json.loads(meta.read_text())["attributes"]["build"]
    plan = json.loads(run_cli("plan", "tiny.yaml", "--set", "data.overwrite=true", "--json")[0])
    assert json.loads(meta.read_text())["attributes"]["build"] == build and not plan["estimated"]
    assert "an existing store is never rebuilt" in " ".join(run_cli("plan", "--help")[0].split())


def test_a_store_of_another_kind_is_never_offered_for_overwrite(flow, run_cli):
    """A generate config on an ingested store: say what the store holds, keep it."""
    _, err = run_cli("plan", "tiny.yaml", "--set", "data.source=generate", "--set",
                     "data.generate={m: 80, n: 30, nnz: 1000}", code=3)  # fmt: skip
    err = " ".join(err.split())
    assert "data/ratings.zarr exists and holds ratings ingested from ratings.csv" in err
    assert "cumf-dask train --store data/ratings.zarr" in err and "overwrite" not in err


def test_evaluate_options_are_usage_errors(flow, run_cli):
    _, err = run_cli("evaluate", "runs/tiny-latest", "--users", "0", code=2)
    assert "--users must be at least 1, got 0" in err
    _, err = run_cli("evaluate", "runs/tiny-latest", "--threshold", "100", code=2)
    assert "threshold 100: no held-out rating is that high (the highest is 5)" in err


def test_evaluate_an_implicit_model(flow, work, run_cli, clients):
    """ranking_metrics_at_k takes no threshold and no sample of users: refused, not ignored;
    a store without held-out interactions names the CLI's fix."""
    from cumf_dask.implicit.model import ImplicitALS

    model = ImplicitALS(2, 0.1, 1.0, 1, backend="numpy")
    model.fit(str(work / "data" / "ratings.zarr"), client=clients(1)).save(work / "imp.zarr")
    result = json.loads(run_cli("evaluate", "imp.zarr", "-k", "3", "--json")[0])
    assert {"precision@3", "ndcg@3", "auc@3"} <= set(result)
    out, err = run_cli("evaluate", "imp.zarr", "-k", "40", "--json")  # 30 items: at k=30
    result = json.loads(out)
    assert "ranking metrics at k=30" in err and result["k"] == 30 and "precision@30" in result
    for option, value in (("--threshold", "3"), ("--users", "5")):
        _, err = run_cli("evaluate", "imp.zarr", option, value, code=2)
        assert f"{option} is for explicit models" in err
    run_cli("ingest", "ratings.csv", "-o", "data/whole.zarr", "--test-fraction", "0")
    _, err = run_cli("evaluate", "imp.zarr", "data/whole.zarr", code=2)
    assert "no held-out interactions" in err and "data.test_fraction > 0" in err


def test_recommend_names_store_when_the_training_store_is_gone(flow, work, run_cli, clients):
    """A model whose training store was moved or deleted: the error says it is the model's
    training store and that --store gives it (both kinds of model)."""
    from cumf_dask.implicit.model import ImplicitALS
    from cumf_dask.model import ALS

    explicit = ALS.load(flow["run"] / "model.zarr")
    implicit = ImplicitALS(2, 0.1, 1.0, 1, backend="numpy")
    implicit.fit(str(work / "data" / "ratings.zarr"), client=clients(1))
    for name, model in (("explicit", explicit), ("implicit", implicit)):
        model.store_url_ = str(work / "data" / "moved.zarr")
        model.save(work / f"{name}-moved.zarr")
        _, err = run_cli("recommend", f"{name}-moved.zarr", "--user", "user-7", code=3)
        assert "the model's training store cannot be opened" in err and "with --store" in err
        assert "or rank the items the user rated too with --include-rated" in err
        out, _ = run_cli("recommend", f"{name}-moved.zarr", "--user", "user-7", "-k", "2",
                         "--store", "data/ratings.zarr", "--json")  # fmt: skip
        assert len(json.loads(out)["items"]) == 2
        out, err = run_cli("recommend", f"{name}-moved.zarr", "--user", "user-7", "-k", "40",
                           "--include-rated", "--json")  # fmt: skip
        assert len(json.loads(out)["items"]) == explicit.shape_[1] and "rated" not in err
    _, err = run_cli("recommend", "explicit-moved.zarr", "--user", "user-7", "--store",
                     "data/ratings.zarr", "--include-rated", code=2)  # fmt: skip
    assert "give one of the two" in err


def test_a_folder_that_is_not_a_model_is_named_as_such(flow, work, run_cli):
    (work / "notes").mkdir(exist_ok=True)
    (work / "notes" / "todo.txt").write_text("mine")
    _, err = run_cli("evaluate", "notes", code=3)
    assert "notes: not a cumf-dask model" in err and "damaged" not in err
    _, err = run_cli("evaluate", "data/ratings.zarr", code=3)
    assert "not a cumf-dask model (a rating store)" in err
    checkpoints = flow["run"] / "checkpoints"
    step = next(checkpoints.glob("iter-*"))
    _, err = run_cli("evaluate", str(step), code=3)
    assert "a training checkpoint (iteration" in err and f"({flow['run']})" in err
    _, err = run_cli("recommend", str(checkpoints), "--user", "user-7", code=3)
    assert "is a run's checkpoints folder, not a model" in err and "--resume" in err


def test_user_ids_on_the_command_line_are_plain_digits():
    from types import SimpleNamespace

    from cumf_dask.commands import _user_id

    indices = SimpleNamespace(user_ids_=None)
    assert _user_id("10", indices) == 10 and _user_id("-1", indices) == -1
    for text in ("1_0", " 10", "\u0661"):
        with pytest.raises(ConfigError, match="is not in the model's user ids"):
            _user_id(text, indices)


def test_ingest_refuses_repeated_columns(work, run_cli):
    _, err = run_cli("ingest", "ratings.csv", "--columns", "2,2,2", "-o", "data/rep.zarr", code=2)
    assert "'--columns' names column 2 more than once" in err
    assert not (work / "data" / "rep.zarr").exists()


def test_bad_model_settings_stop_train_before_anything(work, run_cli, no_cluster):
    for setting, message in (("model.seed=-1", "'model.seed' must be >= 0"),
                             ("model.regularization_mode=plain", "is for model.kind: implicit")):
        for command in ("plan", "train"):
            _, err = run_cli(command, "tiny.yaml", "--set", setting, "--set",
                             "output.dir=refused-runs", code=2)  # fmt: skip
            assert message in err
    assert not (work / "refused-runs").exists()


def test_resume_finds_a_run_named_with_glob_characters(tmp_path):
    from cumf_dask.config import load_config
    from cumf_dask.records import RunFolder

    config = load_config(overrides=[f"output.dir={tmp_path}", "output.name=exp[1]"])
    run = tmp_path / "exp[1]-20261124-000000"
    (run / "checkpoints").mkdir(parents=True)
    assert RunFolder.latest(config).path == run


def test_a_fit_failing_before_its_first_iteration_leaves_no_run_folder(
    flow, work, tmp_path, monkeypatch, clients
):
    from cumf_dask.config import load_config
    from cumf_dask.pipeline import train

    def fails(self, *args, **kwargs):
        raise StoreError("the store broke at once")

    monkeypatch.setattr("cumf_dask.pipeline.ALS.fit", fails)
    config = load_config(overrides=[f"data.store={work / 'data' / 'ratings.zarr'}",
                                    f"output.dir={tmp_path}", "model.iterations=1"])  # fmt: skip
    with pytest.raises(StoreError, match="broke at once"):
        train(config, client=clients(1), log=lambda _: None)
    assert list(tmp_path.iterdir()) == []


WRITE_TEXT = Path.write_text


def full_disk(*names: str):
    """A Path.write_text that fails with a full disk for files whose name holds one of
    `names` (a temporary file beside them too)."""
    import errno

    def write_text(self, *args, **kwargs):
        if any(name in self.name for name in names):
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return WRITE_TEXT(self, *args, **kwargs)

    return write_text


def test_a_full_disk_while_recording_a_run_is_one_error(flow, work, run_cli, monkeypatch):
    """config.yaml at the start: one line and --json's document, exit 3, no folder left.
    The plan after the fit: the same, and the advice repeats the command (--store, --set:
    there is no CONFIG to name) with --resume, which then saves the model."""
    monkeypatch.setattr(Path, "write_text", full_disk("config.yaml"))
    out, err = run_cli("--json", "train", "tiny.yaml", "--set", "output.name=full", code=3)
    error = json.loads(out)
    assert error["exit_code"] == 3 and "Traceback" not in err
    assert "disk full while writing the run record (config.yaml)" in error["error"]
    assert not list((work / "runs").glob("full*"))
    monkeypatch.setattr(Path, "write_text", full_disk("plan.txt"))
    args = ["train", "--store", "data/ratings.zarr", "--set", "model.iterations=1", "--set",
            "output.name=full", "--set", "cluster.dashboard_address=null"]  # fmt: skip
    _, err = run_cli(*args, code=3)
    assert ("disk full while writing the run record (plan.txt)" in err
            and "free some space there, then run the same command with --resume: `cumf-dask "
            f"{' '.join(args)} --resume`" in err)  # fmt: skip
    monkeypatch.undo()
    monkeypatch.chdir(work)
    run_cli(*args, "--resume", "--quiet")
    assert (work / "runs" / "full-latest" / "model.zarr").is_dir()


def test_a_plot_that_cannot_be_written_is_a_warning(flow, work, run_cli, monkeypatch):
    """The model is saved by then: a full disk at the plot is a warning and "plot": null."""
    import errno

    from matplotlib.figure import Figure

    def full(self, path, *args, **kwargs):
        Path(path).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    out, err = run_cli("--json", "train", "tiny.yaml", "--set", "output.name=noplot")
    summary = json.loads(out)
    assert summary["plot"] is None and summary["latest"] == "runs/noplot-latest"
    assert "warning:" in err and "the plot was not written (No space left on device)" in err
    run = work / summary["run"]
    assert not (run / "rmse.png").exists() and (run / "summary.json").is_file()


def test_metrics_jsonl_is_rewritten_from_the_fits_own_list(flow, work, tmp_path, monkeypatch,
                                                           clients):  # fmt: skip
    """An iteration whose line was lost (a Ctrl-C between its checkpoint and its line, then
    --resume from that checkpoint) is back once the fit succeeds."""
    from cumf_dask.config import load_config
    from cumf_dask.pipeline import train
    from cumf_dask.records import RunFolder

    real = RunFolder.append_metrics
    monkeypatch.setattr(RunFolder, "append_metrics",
                        lambda self, r: None if r["iteration"] == 2 else real(self, r))  # fmt: skip
    config = load_config(overrides=[f"output.dir={tmp_path}", "model.iterations=3",
                                    "model.factors=2"],
                         data={"data": {"source": "store",
                                        "store": str(work / "data" / "ratings.zarr")}})  # fmt: skip
    result = train(config, client=clients(1), log=lambda _: None)
    lines = (result.run.path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in lines] == [1, 2, 3]
    assert [json.loads(line) for line in lines] == result.model.metrics_


def test_a_ctrl_c_while_the_cluster_closes_after_the_run_is_not_a_failure(
    flow, work, tmp_path, monkeypatch, clients
):
    from cumf_dask.config import load_config
    from cumf_dask.pipeline import train

    @contextlib.contextmanager
    def interrupted_on_close(*args, **kwargs):
        yield clients(1)
        raise KeyboardInterrupt

    monkeypatch.setattr("cumf_dask.pipeline.cluster_client", interrupted_on_close)
    config = load_config(overrides=[f"output.dir={tmp_path}", "model.iterations=1",
                                    "model.factors=2", "cluster.n_workers=1"],
                         data={"data": {"source": "store",
                                        "store": str(work / "data" / "ratings.zarr")}})  # fmt: skip
    logs: list[str] = []
    try:
        result = train(config, log=logs.append)
    except KeyboardInterrupt:  # not raised on: it would stop the whole test session
        pytest.fail("a Ctrl-C while the cluster closed failed a run that was recorded")
    assert (result.run.path / "summary.json").is_file() and result.summary["latest"]
    assert "interrupted while the cluster was closing; the run had finished" in logs[-1]


def test_dask_worker_logs_are_off_while_a_command_runs(run_cli, monkeypatch):
    """A worker's "Compute Failed" traceback or CancelledError lines would bury the command's
    one line: off in this process (workers that are threads) and for worker processes
    (DASK_LOGGING), and put back after."""
    import logging

    monkeypatch.delenv("DASK_LOGGING", raising=False)
    seen = {}

    def spy(args, out):
        seen["level"] = logging.getLogger("distributed.worker.state_machine").getEffectiveLevel()
        seen["env"] = os.environ.get("DASK_LOGGING", "")

    monkeypatch.setattr("cumf_dask.commands.cmd_info", spy)
    before = logging.getLogger("distributed.worker").level
    run_cli("info", "x.zarr")
    assert seen["level"] == logging.CRITICAL and "'distributed.worker': 'CRITICAL'" in seen["env"]
    assert logging.getLogger("distributed.worker").level == before
    assert "DASK_LOGGING" not in os.environ


def test_any_error_under_json_is_its_document(run_cli, monkeypatch, capsys):
    """An OSError no command worded: one line, exit 3; any other error (a bug) keeps its
    traceback, but --json still prints the error document."""
    import errno

    def denied(args, out):
        raise OSError(errno.EACCES, "Permission denied", "/x/y.zarr")

    monkeypatch.setattr("cumf_dask.commands.cmd_info", denied)
    out, err = run_cli("--json", "info", "y.zarr", code=3)
    assert json.loads(out)["error"].startswith("/x/y.zarr: Permission denied during `info`; ")
    assert "Traceback" not in err

    def bug(args, out):
        raise RuntimeError("a bug")

    monkeypatch.setattr("cumf_dask.commands.cmd_info", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["--json", "info", "y.zarr"])
    assert json.loads(capsys.readouterr().out) == {"error": "RuntimeError: a bug", "exit_code": 1}


def test_evaluate_without_held_out_ratings_says_so(flow, work, run_cli, clients):
    """Only the training RMSE, said in one line; ranking options asked for are refused."""
    from cumf_dask.model import ALS

    run_cli("ingest", "ratings.csv", "-o", "data/no-test.zarr", "--test-fraction", "0")
    model = ALS(2, 0.1, 1, backend="numpy")
    model.fit(str(work / "data" / "no-test.zarr"), client=clients(1)).save(work / "nt.zarr")
    out, err = run_cli("evaluate", "nt.zarr", "--json")
    assert set(json.loads(out)) == {"train_rmse"}
    assert "has no held-out ratings: only the training RMSE (a store with held-out" in err
    for option, value in (("--threshold", "3"), ("-k", "5"), ("--users", "5")):
        _, err = run_cli("evaluate", "nt.zarr", option, value, code=2)
        assert f"has no held-out ratings, so {option} have nothing to rank" in err


def test_evaluate_names_the_models_store_when_it_is_gone(flow, work, run_cli):
    from cumf_dask.model import ALS

    model = ALS.load(flow["run"] / "model.zarr")
    model.store_url_ = str(work / "data" / "gone.zarr")
    model.save(work / "store-gone.zarr")
    _, err = run_cli("evaluate", "store-gone.zarr", code=3)
    assert "the model's training store cannot be opened" in err
    assert "give the store to evaluate on after the model: cumf-dask evaluate MODEL STORE" in err


def test_recommend_reports_the_user_id_as_the_model_holds_it(work, run_cli, clients):
    from cumf_dask.model import ALS

    run_cli("generate", "--m", "20", "--n", "10", "--nnz", "100", "-o", "data/ints.zarr")
    model = ALS(2, 0.1, 1, backend="numpy")
    model.fit(str(work / "data" / "ints.zarr"), client=clients(1)).save(work / "ints.zarr")
    out, _ = run_cli("recommend", "ints.zarr", "--user", "007", "-k", "2", "--json")
    assert json.loads(out)["user"] == 7
    assert "top 2 for user 7" in run_cli("recommend", "ints.zarr", "--user", "007", "-k", "2")[0]


def test_bench_refuses_json_and_is_silent_when_quiet(tmp_path, run_cli, monkeypatch):
    (tmp_path / "bench_hello.py").write_text("print('hello from the bench')\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    out, _ = run_cli("--json", "bench", "--dir", str(tmp_path), "hello", code=2)
    assert "bench scripts print their own text" in json.loads(out)["error"]
    assert run_cli("-q", "bench", "--dir", str(tmp_path), "hello") == ("", "")
    assert run_cli("bench", "--dir", str(tmp_path), "hello")[0] == "hello from the bench\n"


def test_an_implicit_run_plots_and_prints_its_loss(flow, work, run_cli):
    out, _ = run_cli("train", "tiny.yaml", "--set", "model.kind=implicit", "--set",
                     "output.name=imp", "--set", "model.iterations=2")  # fmt: skip
    assert re.search(r"^final loss \d", out, re.MULTILINE)
    summary = json.loads((work / "runs" / "imp-latest" / "summary.json").read_text())
    assert summary["plot"].endswith("loss.png")
    assert (work / "runs" / "imp-latest" / "loss.png").read_bytes().startswith(PNG)


def test_a_run_folder_with_checkpoints_but_no_model_names_resume(tmp_path):
    from cumf_dask.records import model_path

    run = tmp_path / "x-20261124-000000"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    (run / "checkpoints" / "LATEST").write_text("iter-00001\n")
    with pytest.raises(StoreError, match=r"without a saved model .*goes on from its "
                       "checkpoints: run the command that started it again, with --resume"):
        model_path(run)
    with pytest.raises(StoreError, match=r"checkpoints folder, not a model: .*with --resume$"):
        model_path(run / "checkpoints")


def test_a_ctrl_c_while_the_process_exits_keeps_the_commands_exit_code(tmp_path):
    """The command done and reported, a Ctrl-C while the interpreter exits (joining Dask's
    threads, its atexit handlers, then its modules: the signal killed the process, exit
    130) leaves the command's own exit code and prints nothing."""
    code = """
import atexit, os, signal, sys, threading, time
from cumf_dask import cli, commands

def ctrl_c():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.1)

def late_ctrl_c():  # while the interpreter waits for this thread
    time.sleep(1.0)
    ctrl_c()

atexit.register(ctrl_c)  # registered first: the last atexit handler
commands.cmd_info = lambda args, out: threading.Thread(target=late_ctrl_c).start()
sys.argv = ["cumf-dask", "info", "x.zarr"]
sys.exit(cli.main())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == ""


# ----------------------------------------------------------------------------- review: the CLI


def test_an_ingested_store_is_reused_only_for_the_input_that_built_it(work, run_cli, no_cluster):
    """Another file (a missing one too), another split, or the file changed since: refused
    before anything runs, naming each difference and the ways on; the store is kept. A store
    ingested before these were recorded is compared on its path."""
    shutil.copy(work / "ratings.csv", work / "reuse.csv")
    store = work / "data" / "reuse.zarr"
    base = ["tiny.yaml", "--set", f"data.store={store}", "--set", "data.ingest.path=reuse.csv"]
    run_cli("plan", *base)  # ingests it
    meta = store / "zarr.json"
    build = json.loads(meta.read_text())["attributes"]["build"]
    _, err = run_cli("plan", *base, "--set", "data.ingest.path=typo.csv", code=3)
    assert f"input: {work / 'reuse.csv'} (the config: {work / 'typo.csv'})" in err
    _, err = run_cli("plan", *base, "--set", "data.test_fraction=0.5", "--set",
                     "data.split=users", code=3)  # fmt: skip
    assert "test_fraction: 0.2 (the config: 0.5); split: 'pairs' (the config: 'users')" in err
    assert ("set data.overwrite: true to rebuild it, point data.store elsewhere, or train on it "
            f"as it is: cumf-dask train --store {store}") in err  # fmt: skip
    os.utime(work / "reuse.csv", (1, 1))  # touched: a re-download of the same bytes
    _, err = run_cli("plan", *base, code=3)
    assert "reuse.csv changed since it was ingested (modified " in err
    with open(work / "reuse.csv", "a") as fh:
        fh.write("user-1,film 99,3\n")
    _, err = run_cli("train", *base, code=3)
    assert "reuse.csv changed since it was ingested (bytes " in err
    doc = json.loads(meta.read_text())
    doc["attributes"]["source"] = {"kind": "file", "format": "csv", "path": "reuse.csv",
                                   "duplicates": "error"}  # fmt: skip
    meta.write_text(json.dumps(doc))
    run_cli("plan", *base)
    run_cli("plan", *base, "--set", "data.ingest.path=ratings.csv", code=3)
    assert json.loads(meta.read_text())["attributes"]["build"] == build


def test_a_resume_that_would_build_the_store_again_is_refused_first(tmp_path, clients):
    """data.overwrite with --resume, or the store the checkpoints were made on gone: refused
    before the store is touched or built, so the run still resumes once it is back."""
    from dataclasses import replace

    from cumf_dask.config import load_config
    from cumf_dask.pipeline import prepare_store, train

    config = load_config(data={
        "data": {"source": "generate", "store": str(tmp_path / "g.zarr"),
                 "generate": {"m": 60, "n": 20, "nnz": 400}},
        "model": {"factors": 2, "iterations": 1},
        "output": {"dir": str(tmp_path / "runs"), "name": "g"},
    })  # fmt: skip
    prepare_store(config, log=lambda _: None)  # generated here; the run reuses it
    train(config, client=clients(1), log=lambda _: None)
    meta = tmp_path / "g.zarr" / "zarr.json"
    build = json.loads(meta.read_text())["attributes"]["build"]
    kept = replace(config, model=replace(config.model, iterations=2))
    rebuilt = replace(kept, data=replace(kept.data, overwrite=True))
    with pytest.raises(ConfigError, match=r"--resume with data\.overwrite: true would rebuild "
                       r".*g\.zarr, .*; resume with --set data\.overwrite=false"):  # fmt: skip
        train(rebuilt, resume=True, client=clients(1), log=lambda _: None)
    assert json.loads(meta.read_text())["attributes"]["build"] == build
    (tmp_path / "g.zarr").rename(tmp_path / "away.zarr")
    with pytest.raises(StoreError, match=r"g\.zarr: the store the checkpoints of .* were made on "
                       "is gone"):  # fmt: skip
        train(kept, resume=True, client=clients(1), log=lambda _: None)
    assert not (tmp_path / "g.zarr").exists()
    (tmp_path / "away.zarr").rename(tmp_path / "g.zarr")
    assert train(kept, resume=True, client=clients(1), log=lambda _: None).summary[
        "iterations"] == 2  # fmt: skip


def test_a_resume_takes_its_checkpoints_store_as_it_is(tmp_path, clients):
    """An ingested store whose input was touched since (the same bytes downloaded again) is
    not reused by a new run, but a --resume goes on, on the store its checkpoints were made
    on: whether it would be built the same today does not matter to them."""
    from dataclasses import replace

    from cumf_dask.config import load_config
    from cumf_dask.pipeline import train

    rng = np.random.default_rng(3)
    pairs = np.unique(rng.integers(0, [60, 20], size=(400, 2)), axis=0)
    (tmp_path / "r.csv").write_text("".join(f"{u},{i},{rng.integers(1, 6)}\n" for u, i in pairs))
    config = load_config(data={
        "data": {"source": "ingest", "store": str(tmp_path / "r.zarr"),
                 "ingest": {"path": str(tmp_path / "r.csv")}},
        "model": {"factors": 2, "iterations": 1},
        "output": {"dir": str(tmp_path / "runs"), "name": "r"},
    })  # fmt: skip
    train(config, client=clients(1), log=lambda _: None)
    os.utime(tmp_path / "r.csv", (1, 1))
    with pytest.raises(StoreError, match=r"r\.csv changed since it was ingested"):
        train(config, client=clients(1), log=lambda _: None)
    more = replace(config, model=replace(config.model, iterations=2))
    said: list[str] = []
    assert train(more, resume=True, client=clients(1), log=said.append).summary[
        "iterations"] == 2  # fmt: skip
    assert any("the store the checkpoints were made on, as it is" in line for line in said)


def test_a_reader_that_exits_early_ends_the_command_quietly(flow, work):
    """`cumf-dask ... | head` whose reader is gone before the output: exit 141 (128 +
    SIGPIPE, as a shell reports it) and nothing on stderr, with --json too."""
    for args in (["info", "data/ratings.zarr"],
                 ["--json", "recommend", "runs/tiny-latest", "--user", "user-7"]):  # fmt: skip
        proc = subprocess.Popen([sys.executable, "-m", "cumf_dask", *args], cwd=work,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        proc.stdout.close()  # before the command writes: it takes a second to start
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 141 and err == "", err


def test_a_damaged_models_advice_is_a_command_that_restores_it(flow, work, run_cli):
    """Also for a run started with --store (no CONFIG to name): the run's own config.yaml;
    for a run whose config rebuilds its store, with data.overwrite off (a resume never
    rebuilds the store its checkpoints were made on)."""
    import shlex

    from cumf_dask.records import how_to_resume

    run_cli("train", "tiny.yaml", "--set", "data.overwrite=true", "--set", "output.name=ow",
            "--set", "data.store=data/ow.zarr", "--set", "model.iterations=1", "-q")  # fmt: skip
    assert how_to_resume(work / "runs" / "ow-latest").endswith(
        "config.yaml --resume --set data.overwrite=false` (or the command that started the "
        "run, with --resume)")  # fmt: skip

    run_cli("train", "--store", "data/ratings.zarr", "--set", "model.iterations=1", "--set",
            "model.factors=2", "--set", "output.name=dmg", "--set",
            "cluster.dashboard_address=null", "-q")  # fmt: skip
    (work / "runs" / "dmg-latest" / "model.zarr" / "user_factors" / "c" / "0" / "0").unlink()
    _, err = run_cli("evaluate", "runs/dmg-latest", code=3)
    advice = re.search(r"restore it from its run's checkpoints: `(cumf-dask train \S+ --resume)` "
                       r"\(or the command that started the run, with --resume\)", err)  # fmt: skip
    assert advice, err
    run_cli(*shlex.split(advice.group(1))[1:], "-q")
    assert "test_rmse" in json.loads(run_cli("evaluate", "runs/dmg-latest", "--json")[0])


def test_a_failed_resume_leaves_metrics_jsonl_as_its_model(flow, work, tmp_path, clients):
    """The iterations a failed or stopped resume appended are not in the run's model,
    summary or plot: metrics.jsonl goes back to the model's."""
    from dataclasses import replace

    from cumf_dask.config import load_config
    from cumf_dask.pipeline import train

    config = load_config(overrides=[f"output.dir={tmp_path}", "model.iterations=2",
                                    "model.factors=2"],
                         data={"data": {"source": "store",
                                        "store": str(work / "data" / "ratings.zarr")}})  # fmt: skip
    first = train(config, client=clients(1), log=lambda _: None)

    def stop(record: dict) -> None:
        if record["iteration"] == 3:
            raise StoreError("stopped at iteration 3")

    more = replace(config, model=replace(config.model, iterations=4))
    with pytest.raises(StoreError, match="stopped at iteration 3"):
        train(more, resume=True, client=clients(1), on_iteration=stop, log=lambda _: None)
    lines = (first.run.path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == first.model.metrics_
    recorded = (first.run.path / "config.yaml").read_text()

    def save_cut_short(*args, **kwargs):  # Ctrl-C or a full disk while the model is saved
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr("cumf_dask.model.ALS.save", save_cut_short)
        train(more, resume=True, client=clients(1), log=lambda _: None)
    lines = (first.run.path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == first.model.metrics_
    assert (first.run.path / "config.yaml").read_text() == recorded


def test_recommend_says_when_rated_items_are_not_left_out(work, run_cli, clients):
    """A model fitted on arrays names no training store: its list may hold rated items."""
    from cumf_dask.model import ALS

    rng = np.random.default_rng(1)
    pairs = np.unique(rng.integers(0, [20, 10], size=(120, 2)), axis=0)
    ratings = rng.integers(1, 6, len(pairs)).astype(float)
    model = ALS(2, 0.1, 1, backend="numpy").fit((pairs[:, 0], pairs[:, 1], ratings),
                                                client=clients(1))  # fmt: skip
    model.save(work / "arrays.zarr")
    _, err = run_cli("recommend", "arrays.zarr", "--user", "0", "-k", "3")
    assert ("the model names no training store: items the user already rated are not left "
            "out (give the store with --store)") in err  # fmt: skip


def test_quiet_leaves_the_callers_warnings_as_they_were(run_cli, monkeypatch):
    """main(['-q', ...]) ignores warnings while the command runs, in the processes it starts
    too (PYTHONWARNINGS), and gives the calling process its own filters back."""
    import warnings

    monkeypatch.delenv("PYTHONWARNINGS", raising=False)
    seen = {}

    def spy(args, out):
        seen["env"] = os.environ.get("PYTHONWARNINGS")
        seen["filter"] = warnings.filters[0][:3:2]

    monkeypatch.setattr("cumf_dask.commands.cmd_info", spy)
    before = list(warnings.filters)
    run_cli("-q", "info", "x.zarr")
    assert seen == {"env": "ignore", "filter": ("ignore", Warning)}
    assert warnings.filters == before and "PYTHONWARNINGS" not in os.environ


def test_paths_in_the_wrong_place_name_the_fix(flow, work, run_cli, tmp_path):
    """A store given as the config or as the file to ingest, an empty data.ingest.path
    (a config error: exit 2), a -latest link whose run is gone."""
    _, err = run_cli("train", "data/ratings.zarr", code=2)
    assert ("data/ratings.zarr: is a rating store, not a config file: give it with --store "
            "(cumf-dask train --store data/ratings.zarr)") in err  # fmt: skip
    (tmp_path / "r.csv").write_text("user,item,rating\nu1,a,4\n")
    _, err = run_cli("train", str(tmp_path / "r.csv"), code=2)
    assert (f"{tmp_path}/r.csv: is a ratings file, not a config file: ingest it into a store "
            f"first (cumf-dask ingest {tmp_path}/r.csv -o ratings.zarr)") in err  # fmt: skip
    _, err = run_cli("info", str(flow["run"] / "model.zarr"), code=3)
    assert "(format 'cumf-dask-model', expected 'cumf-dask-ratings'): it is a saved model" in err
    _, err = run_cli("ingest", "data/ratings.zarr", "-o", "data/again.zarr", code=3)
    assert ("is a rating store already, not a ratings file: `cumf-dask info data/ratings.zarr` "
            "describes it") in err  # fmt: skip
    _, err = run_cli("plan", "--set", "data.source=ingest", "--set", "data.store=data/no.zarr",
                     code=2)  # fmt: skip
    assert "data.ingest.path is empty: set the input file to ingest" in err
    _, err = run_cli("plan", "--set", "data.source=ingest", "--set", "data.store=data/no.zarr",
                     "--set", "data.ingest.path=data/ratings.zarr", code=2)  # fmt: skip
    assert ("data.ingest.path data/ratings.zarr is a rating store already, not a ratings file: "
            "train on it with data.source: store") in err  # fmt: skip
    _, err = run_cli("ingest", "", "-o", "data/again.zarr", code=2)
    assert "the input path is empty: give the ratings file to ingest" in err
    (tmp_path / "gone-latest").symlink_to("gone-20990101-000000")
    _, err = run_cli("evaluate", str(tmp_path / "gone-latest"), code=3)
    assert "gone-latest is a link to gone-20990101-000000, which is gone (deleted or moved)" in err
