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
    assert "ndcg@10" in outputs[4]
    assert len(outputs[5].splitlines()) == 10


def test_quickstart_trains_the_embedded_config(checkout):
    setup = commands(section("Set up and run"))
    assert setup[0] == 'pip install -e ".[test]" && cumf-dask train'  # as in the README
    out = run(setup[0].split(" && ")[1], checkout).stdout
    assert re.search(r"final test RMSE 0\.\d{4}", out)
    assert len(list((checkout / "runs").glob("quickstart-*/rmse.png"))) == 1


def test_own_ratings_ingest(checkout):
    """The 'your own ratings' command, on a small MovieLens-1M style ratings.dat."""
    command = re.search(r"`(cumf-dask ingest ratings\.dat[^`]*)`", README, re.S).group(1)
    lines = [f"{u}::{i}::{1 + (u * i) % 5}::978300760" for u in range(1, 40) for i in range(1, 30)]
    (checkout / "ratings.dat").write_text("\n".join(lines) + "\n")
    run(" ".join(command.split()), checkout)
    assert (checkout / "data" / "ml.zarr").is_dir()


def test_dask_session_example(checkout):
    """The Python example, with a local in-process cluster in place of the remote scheduler."""
    (example,) = code_blocks(section("From a Dask session"), "python")
    prelude = textwrap.dedent("""\
        import distributed
        import numpy as np

        def local_client(address):
            cluster = distributed.LocalCluster(n_workers=1, processes=False, dashboard_address=None)
            return Client_(cluster)

        Client_, distributed.Client = distributed.Client, local_client
        rng = np.random.default_rng(0)
        pairs = np.unique(rng.integers(0, [200, 50], size=(3000, 2)), axis=0)
        users, items, ratings = pairs[:, 0], pairs[:, 1], rng.uniform(1, 5, len(pairs))
    """)
    script = checkout / "example.py"
    script.write_text(prelude + example + "print(model.metrics_[-1]['iteration'], X.shape)\n")
    out = run(f"{sys.executable} -W ignore {script.name}", checkout).stdout
    assert out.splitlines()[-1] == "10 (200, 64)"
