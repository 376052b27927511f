"""The README's commands run as written.

They are meant for the repository root; here they run in a fresh folder that links the
repository's ``configs/`` (so ``configs/netflix.yaml`` resolves and nothing is written into
the checkout), with this interpreter's ``cumf-dask`` first on PATH.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def section(title: str) -> str:
    """The README text under a '## title' heading, up to the next one."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", README, re.S | re.M)
    assert match, f"README has no section '{title}'"
    return match.group(1)


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def commands(text: str) -> list[str]:
    """The command lines of the bash blocks in `text` (comments and blank lines dropped)."""
    lines = "\n".join(code_blocks(text, "bash")).splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{command}\nexit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    return tmp_path


@pytest.mark.slow
def test_five_minute_tour(checkout):
    tour = commands(section("A five-minute tour"))
    assert [c.split()[1] for c in tour] == [
        "generate", "info", "plan", "train", "evaluate", "recommend",
    ]  # fmt: skip
    outputs = [run(command, checkout).stdout for command in tour]
    # the scaled Netflix is as dense as Netflix (99M / (480,189 x 17,770) = 1.16%, 90% of it
    # for training), not a dense toy
    assert 0.009 < float(re.search(r"density ([0-9.e+-]+)\)", outputs[1]).group(1)) < 0.0125
    assert "forecast:" in outputs[2]
    assert (checkout / "runs" / "netflix-latest" / "model.zarr").is_dir()
    assert "ndcg@10" in outputs[4]
    lines = outputs[5].splitlines()
    assert lines[1].split() == ["rank", "item", "score"] and len(lines) == 12


def test_quickstart_trains_the_embedded_config(checkout):
    setup = commands(section("Set up and run"))
    assert setup[0] == 'pip install -e ".[test]" && cumf-dask train'  # as in the README
    out = run(setup[0].split(" && ")[1], checkout).stdout
    assert re.search(r"final test RMSE 0\.\d{4} \(planted X\* Theta\*\^T before clipping 0\.\d{4}, "
                     r"noise sigma 0\.25;", out)  # fmt: skip
    assert len(list((checkout / "runs").glob("quickstart-2*/rmse.png"))) == 1
    assert (checkout / "runs" / "quickstart-latest" / "rmse.png").is_file()


def test_own_data(checkout):
    """'Your own data' as written, on a small MovieLens-1M style ratings.dat."""
    steps = commands(section("Your own data"))
    assert [c.split()[1] for c in steps] == ["ingest", "train", "recommend"]
    lines = [f"{u}::{i}::{1 + (u * i) % 5}::978300760" for u in range(1, 40) for i in range(1, 40)
             if (u + i) % 3]  # each user leaves a third of the items unrated
    (checkout / "ratings.dat").write_text("\n".join(lines) + "\n")
    outputs = [run(command, checkout).stdout for command in steps]
    assert "final test RMSE" in outputs[1]
    assert (checkout / "runs" / "ml-latest" / "model.zarr").is_dir()
    assert outputs[2].splitlines()[0] == "top 10 for user 1"


def test_dask_session_example(checkout):
    """The Python example, with a local in-process cluster in place of the remote scheduler;
    it ends without warnings (the with block closes the client before the cluster)."""
    (example,) = code_blocks(section("From a Dask session"), "python")
    prelude = textwrap.dedent("""\
        import distributed
        import numpy as np

        class LocalClient(distributed.Client):  # a Client of a local cluster, any address
            def __init__(self, address):
                super().__init__(distributed.LocalCluster(n_workers=1, processes=False,
                                                          dashboard_address=":0"))

        distributed.Client = LocalClient
        rng = np.random.default_rng(0)
        pairs = np.unique(rng.integers(0, [200, 50], size=(3000, 2)), axis=0)
        users, items, ratings = pairs[:, 0] + 1000, pairs[:, 1], rng.uniform(1, 5, len(pairs))
    """)
    check = textwrap.dedent("""\
        assert set(top.ravel().tolist()) <= set(items.tolist())
        print(model.metrics_[-1]['iteration'], X.shape)
    """)
    script = checkout / "example.py"
    script.write_text(prelude + example + check)
    proc = run(f"{sys.executable} {script.name}", checkout)
    assert proc.stdout.splitlines()[-1] == "10 (200, 64)"
    assert proc.stderr == ""


def test_client_left_open_at_exit_is_quiet(checkout):
    """A fit on a client that is never closed: the interpreter exits without Dask's warnings
    about lost tasks (the factors were still held on the cluster)."""
    script = checkout / "open.py"
    script.write_text(textwrap.dedent("""\
        import numpy as np
        from distributed import Client, LocalCluster
        from cumf_dask import ALS

        rng = np.random.default_rng(0)
        pairs = np.unique(rng.integers(0, [60, 30], size=(600, 2)), axis=0)
        client = Client(LocalCluster(n_workers=2, processes=False, dashboard_address=":0"))
        model = ALS(4, 0.1, 2).fit((pairs[:, 0], pairs[:, 1], np.ones(len(pairs))), client=client)
        X, Theta = model.factors_as_dask()
        print(model.recommend(pairs[:1, 0], k=3)[0].shape)
    """))
    proc = run(f"{sys.executable} {script.name}", checkout)
    assert proc.stdout.strip() == "(1, 3)"
    loud = _without_info_records(proc.stderr)
    quiet = not any(word in loud for word in ("lose already computed", "Traceback", "WARNING"))
    assert quiet, proc.stderr[-3000:]


def _without_info_records(stderr: str) -> str:
    """stderr without Dask's INFO log records (with their tracebacks: a comm closed while the
    in-process cluster shuts down logs one at INFO now and then, which is not a warning)."""
    records = re.split(r"(?m)^(?=\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ - )", stderr)
    return "".join(r for r in records if not re.match(r"[\d\- :,]+ - [\w.]+ - INFO - ", r))
