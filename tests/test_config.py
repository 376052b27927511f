"""Configs: every shipped config loads, the reference documents every key, errors name the
file and the key, --set overrides, sizes."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import yaml

from cumf_dask.commands import QUICKSTART
from cumf_dask.config import Config, load_config, parse_size, read_yaml
from cumf_dask.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
REFERENCE = CONFIGS / "reference.yaml"


def dotted_fields(cls: type, prefix: str = "") -> set[str]:
    """Every key of a config dataclass, nested sections included, as 'section.key'."""
    keys = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        keys.add(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            keys |= dotted_fields(hints[f.name], f"{prefix}{f.name}.")
    return keys


def dotted_keys(raw: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in raw.items():
        keys.add(prefix + key)
        if isinstance(value, dict):
            keys |= dotted_keys(value, f"{prefix}{key}.")
    return keys


@pytest.mark.parametrize(
    "path", [*sorted(CONFIGS.glob("*.yaml")), QUICKSTART], ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_every_config_loads(path):
    assert isinstance(load_config(path), Config)


def test_configs_quickstart_is_the_embedded_default():
    assert (CONFIGS / "quickstart.yaml").read_text() == QUICKSTART.read_text()


def test_reference_documents_every_key_with_its_default():
    raw = yaml.safe_load(REFERENCE.read_text())
    assert dotted_keys(raw) == dotted_fields(Config)
    assert load_config(REFERENCE) == Config()  # the values shown are the defaults
    for line in REFERENCE.read_text().splitlines():
        if re.match(r"\s*\w+:", line):
            assert "#" in line, f"reference.yaml: no comment on {line.strip()!r}"


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model:\n  factor: 3\n", r"unknown key 'model\.factor' \(did you mean 'factors'\?\)"),
        ("modle:\n  factors: 3\n", r"unknown key 'modle' \(did you mean 'model'\?\)"),
        ("data:\n  generate:\n    sclae: 2\n", r"'data\.generate\.sclae' \(did you mean 'scale'"),
        ("model:\n  factors: many\n", r"'model\.factors' must be an integer, got 'many'"),
        ("model:\n  factors: 2.5\n", r"'model\.factors' must be an integer"),
        ("model:\n  regularization: high\n", r"'model\.regularization' must be a number"),
        ("output:\n  checkpoint: 1\n", r"'output\.checkpoint' must be true or false"),
        ("plan:\n  reduction: tree\n", r"'plan\.reduction' must be one of 'scatter', 'two-phase'"),
        ("cluster:\n  devices: 0\n", r"'cluster\.devices' must be a list of integers or null"),
        ("plan:\n  groups: [[0, a]]\n", r"'plan\.groups\[0\]\[1\]' must be an integer, got 'a'"),
        ("model: 3\n", r"'model' must be a mapping, got int"),
        ("- model\n", r"the top level must be a mapping"),
        ("model:\n  factors: [1\n", r"not valid YAML"),
    ],
)
def test_errors_name_the_file_and_the_key(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ".*" + message):
        load_config(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml: config file not found"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.factors", r"override 'model\.factors' must look like section\.key=value"),
        ("model.factor=3", r"unknown key 'model\.factor' \(did you mean 'factors'\?\)"),
        ("model.factors=abc", r"'model\.factors' must be an integer, got 'abc'"),
        ("data.generate=5", r"'data\.generate' must be a mapping"),
    ],
)
def test_bad_overrides(tmp_path, override, message):
    """The error names the override that caused it, not the config file."""
    path = write(tmp_path, "model:\n  factors: 8\n")
    with pytest.raises(ConfigError, match=re.escape(f"--set {override}: ") + message) as err:
        load_config(path, overrides=[override])
    assert str(path) not in str(err.value)


def test_overrides_of_nested_keys_lists_and_numbers(tmp_path):
    path = write(tmp_path, "model:\n  factors: 8\n  iterations: 3\ndata:\n  generate:\n    m: 10\n")
    config = load_config(
        path,
        overrides=[
            "model.factors=64",
            "model.regularization=1",  # an integer for a float key
            "data.generate.scale=0.5",
            "plan.x.p=2",
            "plan.groups=[[0,1],[2,3]]",
            "cluster.devices=[0, 1]",
            "cluster.dashboard_address=null",
            "cluster.memory_limit=4GB",
            "output.name=run-64",
            "model.factors=32",  # the last override wins
        ],
    )
    assert config.model.factors == 32 and config.model.iterations == 3  # file keys kept
    assert config.model.regularization == 1.0 and isinstance(config.model.regularization, float)
    assert config.data.generate.scale == 0.5 and config.data.generate.m == 10
    assert config.plan.x.p == 2 and config.plan.theta.p is None
    assert config.plan.groups == [[0, 1], [2, 3]]
    assert config.cluster.devices == [0, 1]
    assert config.cluster.dashboard_address is None
    assert config.cluster.memory_limit == "4GB"
    assert config.output.name == "run-64"


def test_overrides_without_a_file():
    config = load_config(overrides=["model.factors=5"])
    assert config.model.factors == 5 and config.data == Config().data


@pytest.mark.parametrize(
    ("text", "total", "expected"),
    [
        (None, None, None),
        (1000, None, 1000),
        ("12GB", None, 12 * 10**9),
        ("1.5 GB", None, 1_500_000_000),
        ("512MiB", None, 512 * 2**20),
        ("2kib", None, 2048),
        ("100B", None, 100),
        ("10%", 5000, 500),
        (0.8, 1000, 800),
        ("0.25", 1000, 250),
        ("4096", None, 4096),
        (1, 1000, 1000),  # a number in (0, 1] is a share
        (10**9, 10**12, 10**9),
        ("1e9", None, 10**9),
        ("0", None, 0),
    ],
)
def test_parse_size(text, total, expected):
    assert parse_size(text, total) == expected


@pytest.mark.parametrize(
    ("text", "total", "message"),
    [
        ("10%", None, "is a share but no total"),
        (0.5, None, "is a share but no total"),  # not 0 bytes
        ("lots", None, "not understood"),
        ("nan", None, "not understood"),
        ("-5GB", None, "is negative"),
    ],
)
def test_parse_size_errors(text, total, message):
    with pytest.raises(ConfigError, match=message):
        parse_size(text, total)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("cluster.threads_per_worker=0", r"'cluster\.threads_per_worker' must be >= 1"),
        ("plan.q=0", r"'plan\.q' must be >= 1"),
        ("model.regularization=0", r"'model\.regularization' must be > 0"),
        ("model.factors=0", r"'model\.factors' must be >= 1"),
        ("data.test_fraction=1", r"'data\.test_fraction' must be < 1"),
        ("data.generate.seed=-1", r"'data\.generate\.seed' must be an integer in \[0, 2\*\*64\)"),
        (f"data.generate.seed={2**64}", r"'data\.generate\.seed' must be an integer in \[0, 2"),
        (f"data.split_seed={2**63}", r"'data\.split_seed' must be an integer in \[0, 2\*\*63\)"),
        ("data.generate.rating_min=.nan", r"'data\.generate\.rating_min' must be a finite number"),
        ("data.generate.rating_max=1e30", r"'data\.generate\.rating_max' must be <= 1000000000"),
        ("data.generate={rating_min: 5, rating_max: 1}",
         r"'data\.generate\.rating_min' \(5\.0\) must be below 'data\.generate\.rating_max'"),
    ],
)  # fmt: skip
def test_out_of_range_values_are_config_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=[override])


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1e-3", 0.001), ("1E5", 1e5), ("-2.5e+3", -2500.0), ("2.0e3", 2000.0), (".5e1", 5.0)],
)
def test_scientific_notation_is_a_number(text, expected):
    """YAML 1.1 reads 1e-3 (no dot, or no exponent sign) as a string; a config reads a float."""
    assert read_yaml(f"x: {text}", "<test>") == {"x": expected}
    assert read_yaml(f"x: '{text}'", "<test>") == {"x": text}  # quoted: a string still
    assert read_yaml("x: [1e, e5, 1e5x, 1_000]", "<test>") == {"x": ["1e", "e5", "1e5x", 1000]}


def test_scientific_notation_in_files_and_overrides(tmp_path):
    text = "model:\n  regularization: 1e-3\ndata:\n  ingest:\n    rating_min: -1E2\n"
    path = write(tmp_path, text)
    config = load_config(path)
    assert config.model.regularization == 0.001 and config.data.ingest.rating_min == -100.0
    config = load_config(path, ["model.regularization=2e-2", "model.alpha=4E1",
                                "model.kind=implicit"])  # fmt: skip
    assert config.model.regularization == 0.02 and config.model.alpha == 40.0


@pytest.mark.parametrize(
    ("value", "total", "expected"),
    [
        ("0.5", 8000, 4000),
        (0.5, 8000, 4000),
        ("50%", 8000, 4000),
        (1, 8000, 8000),  # 1: all of it
        ("100%", 8000, 8000),
        (1000, 8000, 1000),  # a number above 1: bytes
        ("1e3", 8000, 1000),
        ("6GB", 8000, 6 * 10**9),
    ],
)
def test_memory_budget_is_a_size_or_a_share(value, total, expected):
    config = load_config(overrides=[f"plan.memory_budget={value}"])
    assert parse_size(config.plan.memory_budget, total) == expected


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("plan.memory_budget=-5GB", r"'plan\.memory_budget' must be positive, got '-5GB'"),
        ("plan.memory_budget=0%", r"'plan\.memory_budget' must be positive, got '0%'"),
        ("plan.memory_budget=0", r"'plan\.memory_budget' must be positive, got 0"),
        ("plan.memory_budget=-0.5", r"'plan\.memory_budget' must be positive, got -0\.5"),
        ("plan.memory_budget=150%", r"'plan\.memory_budget' is a share .* at most 100%"),
        ("plan.memory_budget=abc", r"'plan\.memory_budget' must be a size: bytes .*got 'abc'"),
        ("plan.memory_budget=[1]", r"'plan\.memory_budget' must be a string or a number or null"),
        ("plan.headroom=-10%", r"'plan\.headroom' must be 0 or more, got '-10%'"),
        ("plan.headroom=100%", r"'plan\.headroom' is a share of the budget: .* below 100%"),
        ("cluster.memory_limit=-4GB", r"'cluster\.memory_limit' must be positive"),
        ("cluster.memory_limit=0GB", r"'cluster\.memory_limit' must be positive"),
        ("cluster.memory_limit=50%", r"'cluster\.memory_limit' must be a size in bytes"),
        ("cluster.memory_limit=0.5", r"'cluster\.memory_limit' must be a size in bytes"),
        ("cluster.rmm_pool_size=lots", r"'cluster\.rmm_pool_size' must be a size"),
        ("cluster.rmm_pool_size=150%", r"'cluster\.rmm_pool_size' is a share of the GPU"),
    ],
)
def test_bad_sizes_name_the_key(override, message):
    with pytest.raises(ConfigError, match=re.escape(f"--set {override}: ") + message):
        load_config(overrides=[override])


def test_good_sizes_of_other_keys():
    config = load_config(
        overrides=["plan.headroom=0", "plan.headroom=0.2", "cluster.memory_limit=4000000000"]
    )
    assert config.plan.headroom == 0.2 and config.cluster.memory_limit == 4_000_000_000


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model:\n  factors: 4\n  factors: 8\n", r"'model\.factors' on line 3 \(first on line 2\)"),
        ("model: {}\nplan: {}\nmodel:\n  factors: 8\n", r"'model' on line 3 \(first on line 1\)"),
        ("plan:\n  groups:\n  - {a: 1, a: 2}\n", r"'plan\.groups\[0\]\.a' on line 3"),
    ],
)
def test_duplicate_keys_are_refused(tmp_path, text, message):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: duplicate key ") + message):
        load_config(path)


def test_duplicate_keys_in_an_override():
    message = r"--set plan\.x=\{p: 1, p: 2\}: duplicate key 'plan\.x\.p'"
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=["plan.x={p: 1, p: 2}"])


@pytest.mark.parametrize("text", ["", "\n", "# nothing set\n", "---\n", "null\n"])
def test_an_empty_file_is_refused(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: empty config file")):
        load_config(path)


def test_ingest_format_is_checked_at_load(tmp_path):
    path = write(tmp_path, "data:\n  source: ingest\n  ingest:\n    format: csvv\n")
    message = r"'data\.ingest\.format' must be one of 'csv', 'tsv', .*'parquet', got 'csvv'"
    with pytest.raises(ConfigError, match=re.escape(str(path)) + ": " + message):
        load_config(path)
    config = load_config(overrides=["data.ingest.format=netflix"])
    assert config.data.ingest.format == "netflix"


def test_numpy_numbers_in_a_config_are_written_as_plain_numbers():
    """The checks take NumPy integers; config.yaml and plan.json are written with Python's."""
    import json

    import numpy as np

    from cumf_dask.config import PlanConfig
    from cumf_dask.engine.plan import make_plan

    config = Config()
    config.plan.p, config.model.factors = np.int64(2), np.int64(8)
    assert yaml.safe_load(yaml.safe_dump(config.to_dict()))["plan"]["p"] == 2
    plan = make_plan(1000, 500, 20_000, np.int64(8), 2, 10**9, config=PlanConfig(p=np.int64(2)))
    assert json.loads(json.dumps(plan.to_dict()))["x"]["p"] == 2


def test_set_values_yaml_reads_as_no_text():
    """A delimiter '#' (YAML: a comment) or ' ' is taken as written, never dropped for the
    format's; a number, true/false or null for a text key names the quoting that gives text."""
    assert load_config(overrides=["data.ingest.delimiter=#"]).data.ingest.delimiter == "#"
    assert load_config(overrides=["data.ingest.delimiter= "]).data.ingest.delimiter == " "
    assert load_config(overrides=["data.ingest.delimiter=null"]).data.ingest.delimiter is None
    for text, kind in (("2024", "a number"), ("no", "the boolean false"), ("~", "null")):
        message = (f"--set output.dir={text}: 'output.dir' must be a string, and YAML reads "
                   f"{text} as {kind}; quote it: --set 'output.dir=\"{text}\"'")  # fmt: skip
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(overrides=[f"output.dir={text}"])
    assert load_config(overrides=['output.dir="~"']).output.dir == str(Path.home())
    with pytest.raises(ConfigError, match=r"'output\.name' must be a string, got None"):
        load_config(overrides=["output.name= "])  # blank: a delimiter's value alone
    with pytest.raises(ConfigError, match=r"'output\.name' is ' a': give a name without space"):
        load_config(data={"output": {"name": " a"}})
