"""Config and cluster settings that must be one clear error at load (or before a cluster
starts), not a silent default, a traceback or a failure after work began; YAML 1.2 numbers;
``~`` in the folders a job writes; strict JSON of a plan."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from cumf_dask.config import ClusterConfig, load_config, read_yaml
from cumf_dask.engine.cluster import _dashboard, local_resources, make_client
from cumf_dask.engine.plan import make_plan
from cumf_dask.errors import ConfigError
from cumf_dask.paths import normalize_url

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str | bytes, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- model:\n    factors: 128\n", r"the top level must be a mapping of sections .*got list"),
        ("just text\n", r"the top level must be a mapping of sections .*got str"),
        ("data: [1]\n", r"'data' must be a mapping, got list"),
        ("model: 3\n", r"'model' must be a mapping, got int"),
    ],
)
def test_a_file_that_is_not_a_mapping_is_refused_with_a_store_given(tmp_path, text, message):
    """`train CONFIG --store PATH` merges the store in: the file's own errors still count."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ": " + message):
        load_config(path, data={"data": {"source": "store", "store": "s.zarr"}})


def test_a_file_that_cannot_be_read_is_a_config_error(tmp_path, monkeypatch):
    binary = write(tmp_path, b"\xff\xfe\x00model: {}\n")
    with pytest.raises(ConfigError, match=re.escape(f"{binary}: not a UTF-8 text file")):
        load_config(binary)
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}: is a folder, not a config")):
        load_config(tmp_path)
    locked = write(tmp_path, "model: {}\n", "locked.yaml")

    def denied(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(ConfigError, match=rf"{re.escape(str(locked))}: cannot read the config "
                       r"file \(Permission denied\); check its permissions"):  # fmt: skip
        load_config(locked)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("064", 64), ("0o100", 64), ("0x40", 64), ("-7", -7), ("1_000", 1000), ("0", 0)],
)
def test_integers_are_read_as_in_yaml_1_2(text, expected):
    """YAML 1.1 reads 064 as octal 52; YAML 1.2 (and a config) as decimal 64."""
    assert read_yaml(f"x: {text}", "<test>") == {"x": expected}


def test_base_60_and_octal_look_alikes_are_not_numbers(tmp_path):
    assert read_yaml("x: [1:30, 12:30:00, 0b11, 0o8]", "<test>") == {
        "x": ["1:30", "12:30:00", "0b11", "0o8"]
    }
    path = write(tmp_path, "model:\n  factors: 064\n")
    assert load_config(path).model.factors == 64
    assert load_config(overrides=["model.factors=064"]).model.factors == 64
    with pytest.raises(ConfigError, match=r"'model\.iterations' must be an integer, got '1:30'"):
        load_config(overrides=["model.iterations=1:30"])
    sixty = write(tmp_path, "model:\n  regularization: 1:30.5\n", "f.yaml")
    with pytest.raises(ConfigError, match=r"'model\.regularization' must be a number, got '1:30"):
        load_config(sixty)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.seed=-1", r"'model\.seed' must be >= 0, got -1"),
        ("model.regularization_mode=plain",
         r"'model\.regularization_mode' plain is for model\.kind: implicit"),
        ("data.ingest.columns=[2,2,2]", r"'data\.ingest\.columns' names column 2 more than once"),
        ("output.name=exp/a", r"'output\.name' is 'exp/a', a path: give a plain name, and the "
         r"folder the runs go in as output\.dir"),
        ("model.alpha=40", r"'model\.alpha' \(40\.0\) is for model\.kind: implicit .*set "
         r"model\.kind: implicit, or remove model\.alpha"),
        ("model={confidence: log, eps: 2}", r"'model\.confidence' \('log'\) and 'model\.eps' "
         r"\(2\.0\) are for model\.kind: implicit"),
        ("data={source: generate, split: users}", r"'data\.split' users is for data\.source: "
         r"ingest; .*set data\.split: pairs"),
    ],
)  # fmt: skip
def test_model_and_column_settings_are_checked_at_load(override, message):
    with pytest.raises(ConfigError, match=re.escape(f"--set {override}: ") + message):
        load_config(overrides=[override])


def test_implicit_settings_are_fine_for_the_implicit_model_in_any_order():
    config = load_config(overrides=["model.kind=implicit", "model.regularization_mode=plain"])
    assert config.model.regularization_kind() == "plain"
    config = load_config(overrides=["model.alpha=40", "model.kind=implicit"])  # kind set last
    assert config.model.alpha == 40.0


def test_a_conflict_names_the_override_that_made_it(tmp_path):
    path = write(tmp_path, "model:\n  kind: implicit\n  eps: 2\n")
    with pytest.raises(ConfigError, match=r"^--set model\.kind=explicit: 'model\.eps'"):
        load_config(path, ["model.kind=explicit", "output.name=a"])
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: 'model\\.eps'"):
        load_config(path, ["output.name=a"], data={"model": {"kind": "explicit"}})


def test_home_is_expanded_in_the_folders_a_job_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    config = load_config(overrides=["data.store=~/data/s.zarr", "output.dir=~/runs"])
    assert config.data.store == f"{tmp_path}/data/s.zarr"
    assert config.output.dir == f"{tmp_path}/runs"
    assert normalize_url("~/m.zarr/") == f"{tmp_path}/m.zarr"
    assert normalize_url("memory://~/x") == "memory://~/x"  # a URL as it is


def test_an_output_dir_url_is_refused_and_a_file_url_is_a_local_folder(tmp_path):
    """Run folders are renamed and linked locally: s3://b/runs would silently be written to
    a local folder named 's3:'; file:///x is the folder /x, not ./file:/x."""
    for url in ("s3://bucket/runs", "memory://runs"):
        with pytest.raises(ConfigError, match=rf"output\.dir: {re.escape(url)} is a URL, but run "
                           "folders are written to a local or mounted folder; give a local path"):
            load_config(overrides=[f"output.dir={url}"])
    config = load_config(overrides=[f"output.dir=file://{tmp_path}/runs"])
    assert config.output.dir == f"{tmp_path}/runs"


@pytest.mark.parametrize(
    ("address", "message"),
    [("localhost", "missing port"), ("foo://bar:1", "unknown address scheme")],
)
def test_a_malformed_scheduler_address_is_a_config_error(address, message):
    pattern = rf"cluster\.address '{re.escape(address)}' is not a scheduler address \({message}"
    with pytest.raises(ConfigError, match=pattern + ".*give one such as tcp://host:8786"):
        make_client(ClusterConfig(address=address))


@pytest.mark.parametrize("address", ["nohost.invalid", ":abc", "nohost.invalid:0"])
def test_a_dashboard_address_this_machine_cannot_serve_is_a_config_error(address):
    with pytest.raises(ConfigError, match=rf"cluster\.dashboard_address '{address}' cannot be "
                       r"served here .*or null for no dashboard"):  # fmt: skip
        _dashboard(ClusterConfig(dashboard_address=address))
    assert _dashboard(ClusterConfig(dashboard_address="localhost:0")) == "localhost:0"
    assert _dashboard(ClusterConfig(dashboard_address=None)) == ":0"


def test_cupy_without_a_gpu_says_so(monkeypatch):
    monkeypatch.setattr("cumf_dask.engine.cluster.gpu_memories", lambda: [])
    monkeypatch.setattr("cumf_dask.engine.cluster.cuda_device_count", lambda: 0)
    with pytest.raises(ConfigError, match=r"cluster\.backend is cupy but no CUDA GPU is "
                       r"visible .*cluster\.backend: numpy"):  # fmt: skip
        local_resources(ClusterConfig(backend="cupy"))


def test_a_plan_is_strict_json():
    """Workers in one process: an unbounded link, null in JSON (Infinity is not JSON)."""
    plan = make_plan(100, 50, 1000, 4, 2, 10**9, transport="inproc")
    assert math.isinf(plan.link)

    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")

    data = json.loads(json.dumps(plan.to_dict(), allow_nan=False), parse_constant=refuse)
    assert data["link"] is None
    assert make_plan(100, 50, 1000, 4, 2, 10**9, transport="tcp").to_dict()["link"] == 1.5e9


def test_the_docs_evaluate_one_model():
    """`evaluate MODEL`: a glob (runs/x-*/model.zarr) names several runs, an argparse error."""
    texts = [ROOT / "README.md", *sorted((ROOT / "configs").glob("*.yaml"))]
    for path in texts:
        for line in path.read_text().splitlines():
            if "cumf-dask evaluate" in line:
                model = line.split("cumf-dask evaluate", 1)[1].split()[0]
                assert not set("*?[") & set(model), f"{path.name}: {line.strip()}"
