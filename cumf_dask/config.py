"""YAML run configs loaded into typed, validated dataclasses.

Every error names the file, the dotted key and what is allowed, e.g.::

    configs/x.yaml: unknown key 'model.factor' (did you mean 'factors'?); allowed: factors, ...

One namespace, one schema: the dataclasses below *are* the schema; ``configs/reference.yaml``
documents every key with a comment. Files and ``--set`` values are read alike, numbers as in
YAML 1.2: ``1e-3`` is a number, ``064`` is 64 (not YAML 1.1's octal 52: octal is ``0o100``),
``1:30`` is text (not 1.1's base-60 90); a key repeated in a mapping and an empty file are
errors. A leading ``~`` in ``data.store`` and ``output.dir`` is the home folder. A ``--set``
value that YAML reads as nothing (``#``, a space) is taken as written; one it reads as a
number, true/false or null, given to a key that takes text, is refused with its quoting.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from numbers import Integral
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import numpy as np
import yaml

from .checks import (
    check_choice,
    check_fraction,
    check_number,
    check_positive_int,
    check_scale,
)
from .data.duplicates import DuplicatePolicy
from .data.formats import FORMATS
from .data.hashing import SplitKind
from .data.limits import SPLIT_SEED_BITS, check_seed
from .errors import ConfigError
from .paths import expand_home, is_url, normalize_url

Reduction = Literal["scatter", "two-phase", "one"]
BackendName = Literal["auto", "numpy", "cupy"]
Protocol = Literal["auto", "tcp", "ucx"]
BlockTier = Literal["auto", "device", "host", "store"]
FactorTier = Literal["auto", "device", "host"]
# bytes ("6GB", "512MiB", 6000000000) or, where a key says so, a share ("50%", 0.5)
Size = str | int | float


@dataclass
class GenerateConfig:
    """Synthetic planted-model data (``cumf-dask generate``)."""

    preset: str | None = None  # netflix, yahoomusic, hugewiki, sparkals, factorbird, facebook
    scale: float = 1.0  # multiplies the preset's nnz, and m and n by sqrt(scale)
    m: int | None = None  # rows (users); overrides the preset
    n: int | None = None  # columns (items)
    nnz: int | None = None  # ratings, train and test together
    rank: int | None = None  # of the planted X* Theta*^T, <= min(m, n); None: 10 or min(m, n)
    # sigma of the Gaussian noise: the best achievable test RMSE (unclipped: within +-1e9)
    noise: float = 0.1
    # Zipf exponent of the row degrees (0 = uniform); columns are drawn from the same law
    # without replacement, so their degrees follow it only for skew below about 1 (about
    # 1/skew above: a steeper skew gives flatter column degrees)
    skew: float = 0.8
    rating_min: float | None = None  # clip ratings to [rating_min, rating_max] (within +-1e9)
    rating_max: float | None = None
    round: bool = False  # round ratings to integers, then clip them to the integers in the scale
    nonempty: bool = True  # every row and every column gets at least one rating
    seed: int = 0  # in [0, 2**64)


@dataclass
class IngestConfig:
    """Reading ratings from files (``cumf-dask ingest``)."""

    path: str = ""  # input file (local path or fsspec URL)
    # csv, tsv, delimited, movielens-100k, movielens-1m, movielens-csv, netflix, parquet
    format: str = "csv"
    delimiter: str | None = None  # for 'delimited' (and to override csv/tsv)
    header: bool | None = None  # None: guess from the first line
    columns: list[str | int] | None = None  # user, item, rating: names or 0-based positions
    duplicates: DuplicatePolicy = "error"  # what to do with repeated (user, item) pairs
    m: int | None = None  # declared shape: ids must be integers in [0, m) / [0, n)
    n: int | None = None
    rating_min: float | None = None  # declared scale: a rating outside it is an error
    rating_max: float | None = None  # (none declared: |rating| <= 1e9)


@dataclass
class DataConfig:
    """Where the ratings come from and how the store is laid out."""

    store: str = "data/ratings.zarr"  # the RatingsStore path or URL (read, or written first)
    source: Literal["store", "generate", "ingest"] = "store"
    overwrite: bool = False  # rebuild the store even if a complete one exists
    # held-out share (deterministic by seed), 0 for none; generate: of the ratings beyond
    # the one per row and column that nonempty gives (those stay in training)
    test_fraction: float = 0.1
    split_seed: int = 0  # in [0, 2**63)
    split: SplitKind = "pairs"  # ingest: share of all pairs | "users": of each user's, never all
    tile_rows: int | None = None  # rows per tile (None: chosen from the shape)
    tile_cols: int | None = None
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)


@dataclass
class ModelConfig:
    """The ALS model: explicit ratings (cuMF's weighted lambda) or implicit feedback."""

    kind: Literal["explicit", "implicit"] = "explicit"  # implicit: counts, Hu et al.
    factors: int = 10  # f, the latent dimension
    regularization: float = 0.05  # lambda
    # weighted: lambda * n_u (cuMF) | plain: lambda | auto: weighted explicit, plain implicit
    regularization_mode: Literal["auto", "weighted", "plain"] = "auto"
    iterations: int = 10  # full iterations (update X, then Theta)
    seed: int = 0  # initial factors
    precision: Literal["float32", "bfloat16"] = "float32"  # fixed-factor storage (bf16: half)
    solver: Literal["cholesky", "cg"] = "cholesky"  # exact, or CG steps from the last factors
    cg_steps: int = 3  # CG steps per row and half-step
    alpha: float = 1.0  # implicit: confidence c = 1 + alpha r (or the log form)
    confidence: Literal["linear", "log"] = "linear"  # log: c = 1 + alpha log(1 + r / eps)
    eps: float = 1.0  # the log form's scale

    def regularization_kind(self) -> str:
        """'weighted' or 'plain' ('auto' resolved by the model kind)."""
        if self.regularization_mode != "auto":
            return self.regularization_mode
        return "plain" if self.kind == "implicit" else "weighted"


@dataclass
class HalfStepConfig:
    """Forced partition of one half-step; None lets the planner choose."""

    p: int | None = None  # partitions of the fixed factor (data parallelism)
    q: int | None = None  # batches of the solved factor (model parallelism)


@dataclass
class PlanConfig:
    """How SU-ALS partitions the work; every field optional."""

    p: int | None = None  # both half-steps, unless x/theta say otherwise
    q: int | None = None
    x: HalfStepConfig = field(default_factory=HalfStepConfig)  # update-X overrides
    theta: HalfStepConfig = field(default_factory=HalfStepConfig)  # update-Theta overrides
    memory_budget: Size | None = None  # per worker: "12GB", "50%", 0.5 (share); None: all of it
    # where the rating blocks live between half-steps: device (worker memory: GPU on GPU
    # workers), host (pinned host memory of GPU workers, copied over per half-step), store
    # (read again every half-step); auto: the first of these that fits
    blocks: BlockTier = "auto"
    # where the larger factor (X when there are more users than items) lives: device (its
    # pieces on the workers' GPUs), host (pinned host memory of GPU workers: solved batches
    # are copied out, and the other half-step copies it in part by part); auto: device when
    # both factors fit next to the working set
    factors: FactorTier = "auto"
    reduction: Reduction = "scatter"  # p > 1: reduce-scatter, two-phase, or one (baseline)
    groups: list[list[int]] | None = None  # worker groups for the two-phase reduction
    headroom: Size = "10%"  # per-worker memory kept free (epsilon in the paper)


@dataclass
class ClusterConfig:
    """Which Dask cluster runs the job."""

    backend: BackendName = "auto"  # auto: cupy when a GPU is visible, else numpy
    address: str | None = None  # join an existing scheduler (tcp://host:8786)
    n_workers: int | None = None  # local cluster size (None: one per GPU, or per core)
    threads_per_worker: int = 1
    # local CPU workers as processes (true), as threads of this process (false), or auto:
    # threads for problems up to engine.cluster.IN_PROCESS_MAX_NNZ ratings, else processes
    processes: bool | Literal["auto"] = "auto"
    # host memory per local worker (CPU or GPU), e.g. "4GB"; at most the machine's share each
    memory_limit: Size | None = None
    devices: list[int] | None = None  # GPUs to use, 0-based among the visible ones; None: all
    rmm_pool_size: Size | None = None  # RMM pool per GPU worker: "20GB", "50%"; None: 4GB over UCX
    protocol: Protocol = "auto"  # transport between local GPU workers; auto: UCX if it can
    dashboard_address: str | None = ":0"  # None: no dashboard


@dataclass
class OutputConfig:
    """Where a training run writes its record."""

    dir: str = "runs"  # a run folder <dir>/<name>-<timestamp> is made inside
    name: str = "run"
    checkpoint: bool = True  # write X and Theta while the fit runs (atomic; the last always)


@dataclass
class Config:
    """A whole run: data -> plan -> fit -> evaluate -> save."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def to_dict(self) -> dict[str, Any]:
        return plain(dataclasses.asdict(self))


def plain(value: Any) -> Any:
    """`value` with NumPy scalars (numbers the checks accept, losses computed in float32)
    made Python's own, in dicts, lists and tuples: YAML's and JSON's writers refuse them
    (config.yaml, plan.json, a checkpoint's or model's attrs)."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(item) for item in value)
    return value.item() if isinstance(value, np.generic) else value


# ----------------------------------------------------------------------------- sizes


_UNITS = {
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "b": 1,
}
_SIZE_FORMS = "bytes (6000000000), '6GB', '512MiB'"


def read_size(text: str | int | float) -> tuple[float, bool]:
    """(number, share): a share of some total from ``"10%"`` or a bare number in (0, 1]
    (``0.8``, ``"0.8"``), else bytes (``"12GB"``, ``"512MiB"``, ``4096``)."""
    s = str(text).strip().lower().replace(" ", "")
    number, mult, div, share = s, 1, 1, None  # None: a bare number, a share if in (0, 1]
    if isinstance(text, bool):
        number = ""
    elif s.endswith("%"):
        number, div, share = s[:-1], 100, True
    else:
        for suffix, size in _UNITS.items():
            if s.endswith(suffix):
                number, mult, share = s[: -len(suffix)], size, False
                break
    try:
        value = float(number) * mult / div
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ConfigError(
            f"size {text!r} not understood; use {_SIZE_FORMS}, or a share '10%' or fraction 0.1"
        )
    return value, (0 < value <= 1) if share is None else share


def size_text(size: float) -> str:
    """Bytes as people read them: 12.3 kB, 4.5 MB, 6.7 GB (parse_size reads them back)."""
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000:
            return f"{size:.3g} {unit}"
        size /= 1000
    return f"{size:,.1f} TB"


def parse_size(text: str | int | float | None, total: int | None = None) -> int | None:
    """Bytes from ``"12GB"``, ``"512MiB"``, ``"10%"``, a fraction ``0.8`` of `total`, or an int."""
    if text is None:
        return None
    value, share = read_size(text)
    if value < 0:
        raise ConfigError(f"size {text!r} is negative; use {_SIZE_FORMS}")
    if share:
        if total is None:
            raise ConfigError(f"size {text!r} is a share but no total is known; use {_SIZE_FORMS}")
        return int(value * total)
    return int(value)


def check_size(key: str, value: Any, *, of: str | None = None, free: bool = False) -> None:
    """A size key: bytes >= 1, or a share in (0, 100%] of `of` (None: no share allowed).

    `free`: memory kept free, so 0 is allowed and 100% is not.
    """
    forms = _SIZE_FORMS + (f", or a share of {of}: '50%' or 0.5" if of else "")
    try:
        number, share = read_size(value)
    except ConfigError:
        raise ConfigError(f"'{key}' must be a size: {forms}; got {value!r}") from None
    low = "0 or more" if free else "positive"
    if number < 0 or (number == 0 and not free) or (not share and 0 < number < 1):
        raise ConfigError(f"'{key}' must be {low}, got {value!r}; use {forms}")
    if share and of is None:
        raise ConfigError(f"'{key}' must be a size in bytes, got {value!r}; use {forms}")
    if share and (number > 1 or (free and number == 1)):
        top = "below 100% (1.0)" if free else "at most 100% (1.0)"
        raise ConfigError(f"'{key}' is a share of {of}: it must be {top}, got {value!r}")


# ----------------------------------------------------------------------------- loading


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    data: dict[str, Any] | None = None,
) -> Config:
    """Load a YAML file (or a dict) into a validated :class:`Config`.

    ``overrides`` are ``dotted.key=value`` strings (``model.factors=64``); values are read
    as YAML, so ``plan.groups=[[0,1],[2,3]]`` works. An error the file causes names the
    file; one an override causes names the override (``--set model.factor=3: ...``). Keys
    that must agree with each other are checked once all overrides are in, so their order
    does not matter.
    """
    source = str(path) if path is not None else "<config>"
    raw: Any = {}
    if path is not None:
        raw = _read_file(Path(path), source)
        if not isinstance(raw, dict):
            raise ConfigError(
                f"{source}: the top level must be a mapping of sections (data, model, plan, "
                f"cluster, output), got {type(raw).__name__}"
            )
    config = _build(Config, raw, source, "")  # the file as written: `data` cannot hide its errors
    if data is not None:
        raw = _merge(raw, data)
        config = _build(Config, raw, source, "")
    _check_ranges(config, source)
    blame, conflict = source, _conflict(config)
    for item in overrides or []:
        where = f"--set {item}"
        raw = _merge(raw, _parse_override(item, where))
        config = _build(Config, raw, where, "")
        _check_ranges(config, where)
        found = _conflict(config)
        if found != conflict:  # blame the override that made the keys disagree
            blame, conflict = where, found
    if conflict:
        raise ConfigError(f"{blame}: {conflict}")
    return _expand_home(config)


#: file name suffixes of ratings (never of a YAML config): given as one, say how to use them
_RATINGS_SUFFIXES = {".csv", ".tsv", ".dat", ".parquet", ".pq", ".gz", ".bz2", ".xz", ".zip"}


def _read_file(path: Path, source: str) -> Any:
    """The YAML document of a config file; anything that stops it being read is a ConfigError."""
    if path.is_dir():
        if is_rating_store(path):
            raise ConfigError(f"{source}: is a rating store, not a config file: give it with "
                              f"--store (cumf-dask train --store {source})")  # fmt: skip
        raise ConfigError(f"{source}: is a folder, not a config file (give a YAML file)")
    if not path.is_file():
        raise ConfigError(f"{source}: config file not found (give an existing YAML file)")
    if path.suffix.lower() in _RATINGS_SUFFIXES:
        raise ConfigError(
            f"{source}: is a ratings file, not a config file: ingest it into a store first "
            f"(cumf-dask ingest {source} -o ratings.zarr), then cumf-dask train --store "
            "ratings.zarr; or name it in a config as data.ingest.path"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{source}: not a UTF-8 text file (byte {exc.object[exc.start]:#04x} at offset "
            f"{exc.start}); a config is YAML text: save it as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"{source}: cannot read the config file ({exc.strerror or exc}); check its "
            "permissions, or give another file"
        ) from None
    try:
        raw = read_yaml(text, source)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from None
    if raw is None:
        raise ConfigError(
            f"{source}: empty config file; give the sections to set (data, model, plan, "
            "cluster, output: every key is in configs/reference.yaml)"
        )
    return raw


def is_rating_store(path: str | Path) -> bool:
    """Whether `path` is a folder that holds a rating store (its zarr.json says so): given
    where a config or a ratings file goes, it is to be given as a store instead."""
    from .data.store import FORMAT  # zarr's import, here only when a path is in question

    try:
        meta = json.loads((Path(path) / "zarr.json").read_text(encoding="utf-8"))
        return meta["attributes"]["format"] == FORMAT
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _expand_home(config: Config) -> Config:
    """A leading ``~`` in the local folders the job writes, as a shell (and data.ingest.path's
    fsspec) would read it; otherwise a folder literally named ``~`` would be made."""
    config.data.store = expand_home(config.data.store)
    config.output.dir = _runs_folder(config.output.dir)
    return config


def _runs_folder(text: str) -> str:
    """output.dir as a local folder (``~`` and ``file://`` read as local paths); a URL is
    refused: run folders are renamed into place and linked, which object stores cannot do,
    and ``s3://b/runs`` would otherwise name a local folder ``s3:/b/runs``."""
    local = normalize_url(text)
    if is_url(local):
        raise ConfigError(
            f"output.dir: {text} is a URL, but run folders are written to a local or mounted "
            "folder; give a local path (copy the run folder to the bucket afterwards)"
        )
    return local


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's numbers (the core schema's; ``1_000`` as before).

    YAML 1.1 (PyYAML) reads ``064`` as octal 52 and ``1:30`` as base-60 90, and wants a dot
    and a signed exponent in a float (``1.0e-3``: ``1e-3`` is a string). YAML 1.2 reads
    ``064`` as 64, ``0o100`` as octal, ``0x40`` as hex, ``1:30`` as a string and ``1e-3``,
    ``1E5``, ``2.0e3`` as floats, as Python does, and so does a config.
    """


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_DIGITS = r"[0-9]+(?:_[0-9]+)*"
_Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        rf"^(?:[-+]?(?:(?:{_DIGITS}\.[0-9_]*|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?"
        rf"|{_DIGITS}[eE][-+]?[0-9]+)|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)
_Loader.add_implicit_resolver(
    _INT, re.compile(rf"^(?:[-+]?{_DIGITS}|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """A YAML 1.2 integer: decimal (leading zeros too: ``064`` is 64), ``0o`` octal, ``0x`` hex."""
    text = str(loader.construct_scalar(node)).replace("_", "")
    for prefix, base in (("0o", 8), ("0x", 16)):
        if text.startswith(prefix):
            return int(text[2:], base)
    return int(text)


_Loader.add_constructor(_INT, _construct_int)


def read_yaml(text: str, source: str, prefix: str = "") -> Any:
    """The YAML document in `text` (None if it has none), refusing a key repeated in a mapping.

    PyYAML keeps the last of repeated keys silently; in a config that hides an edit.
    `prefix` is the dotted key the document sits at (``--set plan.x={...}``).
    """
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_repeated_keys(node, source, prefix, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_repeated_keys(node: yaml.Node, source: str, prefix: str, seen: set[int]) -> None:
    """Raise a ConfigError naming the dotted key and its lines if a mapping repeats a key."""
    if id(node) in seen:  # an alias of a node already walked
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_repeated_keys(item, source, f"{prefix.rstrip('.')}[{i}].", seen)
    elif isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key, value in node.value:
            line = key.start_mark.line + 1
            if isinstance(key, yaml.ScalarNode):
                if key.value in lines:
                    raise ConfigError(
                        f"{source}: duplicate key '{prefix}{key.value}' on line {line} (first "
                        f"on line {lines[key.value]}); keep one of them"
                    )
                lines[key.value] = line
            _refuse_repeated_keys(value, source, f"{prefix}{key.value}.", seen)


def _at_least(low: float, inclusive: bool = True) -> Callable[[str, Any], None]:
    return partial(check_number, low=low, low_inclusive=inclusive)


def check_columns(name: str, columns: list[str | int]) -> None:
    """The user, item and rating columns name no column twice (a store of one column read
    as user, item and rating would be nonsense); how many there are, ingest checks."""
    repeated = next((c for c in columns if columns.count(c) > 1), None)
    if repeated is not None:
        raise ConfigError(
            f"'{name}' names column {repeated!r} more than once ({columns!r}); give three "
            "different columns, user, item and rating in that order, by name or 0-based position"
        )


def check_run_name(name: str, value: str) -> None:
    """A run's name is one folder name: a path in it would hide its runs from --resume,
    which looks for ``<name>-<timestamp>`` folders in output.dir; a blank one or one with
    space at its ends would name folders no one could tell apart or type."""
    if not value.strip() or value != value.strip():
        raise ConfigError(f"'{name}' is {value!r}: give a name without space at its ends "
                          "(e.g. output.name: netflix)")  # fmt: skip
    if "/" in value or "\\" in value:
        raise ConfigError(
            f"'{name}' is {value!r}, a path: give a plain name, and the folder the runs go in "
            "as output.dir (e.g. output.dir: runs/exp, output.name: a)"
        )


def check_groups(name: str, groups: Any) -> None:
    """Worker groups: a list of lists of worker indices (which workers, the planner checks)."""

    def indices(group: Any) -> bool:
        return isinstance(group, list) and all(
            isinstance(w, Integral) and not isinstance(w, bool) for w in group
        )

    if not (isinstance(groups, list) and all(indices(g) for g in groups)):
        raise ConfigError(
            f"'{name}' must be a list of lists of worker indices (e.g. [[0, 1], [2, 3]]), "
            f"got {groups!r}"
        )


def check_devices(name: str, devices: list[int]) -> None:
    """GPU positions: at least one, none negative or named twice (one worker per GPU)."""
    bad = sorted({d for d in devices if d < 0 or devices.count(d) > 1})
    if not devices or bad:
        raise ConfigError(
            f"'{name}' is {devices!r}: give the GPUs to use once each, 0-based among the "
            "visible ones (e.g. [0, 1]), or null for all"
        )


# dotted key -> its check (a None value, where allowed, is not checked)
_RANGES: dict[str, Callable[[str, Any], None]] = {
    "model.factors": check_positive_int,
    "model.iterations": _at_least(0),
    "model.seed": _at_least(0),
    "model.regularization": _at_least(0, inclusive=False),
    "model.cg_steps": check_positive_int,
    "model.alpha": _at_least(0),
    "model.eps": _at_least(0, inclusive=False),
    "plan.p": check_positive_int,
    "plan.q": check_positive_int,
    "plan.x.p": check_positive_int,
    "plan.x.q": check_positive_int,
    "plan.theta.p": check_positive_int,
    "plan.theta.q": check_positive_int,
    "plan.groups": check_groups,
    "cluster.n_workers": check_positive_int,
    "cluster.threads_per_worker": check_positive_int,
    "cluster.devices": check_devices,
    "data.tile_rows": check_positive_int,
    "data.tile_cols": check_positive_int,
    "data.test_fraction": check_fraction,
    "data.split_seed": partial(check_seed, bits=SPLIT_SEED_BITS),
    "data.generate.seed": check_seed,
    "data.generate.scale": _at_least(0, inclusive=False),
    "data.generate.rank": partial(check_positive_int, optional=True),
    "data.generate.noise": _at_least(0),
    "data.ingest.format": partial(check_choice, allowed=FORMATS),
    "data.ingest.columns": check_columns,
    "output.name": check_run_name,
    "plan.memory_budget": partial(check_size, of="the worker's memory"),
    "plan.headroom": partial(check_size, of="the budget", free=True),
    "cluster.memory_limit": check_size,  # no share: the cluster reads it as bytes
    "cluster.rmm_pool_size": partial(check_size, of="the GPU's memory"),
}


def _check_ranges(config: Config, source: str) -> None:
    """Values of the right type but outside their range: one error naming file, key and
    range, at load, so plan and train refuse before any work (keys at odds with each other:
    :func:`_conflict`).

    The checks are those of the Python API (:mod:`cumf_dask.checks`), named by dotted key.
    """
    try:
        _check_keys(config)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _check_keys(section: Any, prefix: str = "") -> None:
    """The _RANGES checks of the keys under `prefix` (all: ""), run on `section`, the
    object at `prefix` (a None value, where allowed, is not checked)."""
    for key, check in _RANGES.items():
        if not key.startswith(prefix):
            continue
        value: Any = section
        for part in key[len(prefix) :].split("."):
            value = getattr(value, part)
        if value is not None:
            check(key, value)


# the plan keys whose type allows a few words only, by field
_PLAN_CHOICES = {"reduction": Reduction, "blocks": BlockTier, "factors": FactorTier}


def check_plan_config(plan: PlanConfig) -> None:
    """A PlanConfig made in Python, checked by the rules a config file's plan section meets
    (its words, integers and ranges; each error names the key): else the planner would run
    p=0 as p=1, record a misspelt reduction as the one used, or fail deep in NumPy on
    p=2.5."""
    for side in ("x", "theta"):
        half = getattr(plan, side)
        if not isinstance(half, HalfStepConfig):
            raise ConfigError(
                f"'plan.{side}' must be a HalfStepConfig, got {half!r}: e.g. "
                f"PlanConfig({side}=HalfStepConfig(p=2))"
            )
    for name, words in _PLAN_CHOICES.items():
        check_choice(f"plan.{name}", getattr(plan, name), get_args(words))
    if plan.headroom is None:  # a file's `headroom: null` is refused too (None: no headroom)
        raise ConfigError("'plan.headroom' must be a size such as '10%' or '2GB' (0 for none), "
                          "not None")  # fmt: skip
    _check_keys(plan, "plan.")


#: model keys only the implicit model reads (the explicit one has no confidence weights)
_IMPLICIT_ONLY = ("alpha", "confidence", "eps")


def _conflict(config: Config) -> str | None:
    """What makes keys of `config` disagree with each other (a rating scale's ends, settings
    the model kind or the data source would silently ignore), or None.

    Checked on the config with all its overrides, so that they may come in any order
    (``--set model.alpha=40 --set model.kind=implicit``); the error names the file or the
    override that made them disagree.
    """
    data, model = config.data, config.model
    for kind in ("ingest", "generate"):
        section = getattr(data, kind)
        names = (f"data.{kind}.rating_min", f"data.{kind}.rating_max")
        try:
            check_scale(section.rating_min, section.rating_max, names)
        except ConfigError as exc:
            return str(exc)
    if model.kind == "explicit" and model.regularization_mode == "plain":
        return ("'model.regularization_mode' plain is for model.kind: implicit; the explicit "
                "model uses cuMF's weighted lambda (set weighted or auto, or model.kind: "
                "implicit)")  # fmt: skip
    default = ModelConfig()
    changed = [k for k in _IMPLICIT_ONLY if getattr(model, k) != getattr(default, k)]
    if model.kind == "explicit" and changed:
        keys = " and ".join(f"'model.{k}' ({getattr(model, k)!r})" for k in changed)
        verb, them = ("is", f"model.{changed[0]}") if len(changed) == 1 else ("are", "them")
        return (f"{keys} {verb} for model.kind: implicit (the confidence of counts); the "
                f"explicit model has no confidence weights: set model.kind: implicit, or "
                f"remove {them}")  # fmt: skip
    if data.source == "generate" and data.split == "users":
        return ("'data.split' users is for data.source: ingest; the generator holds out "
                "test_fraction of all its pairs (every row and column keeps one in training): "
                "set data.split: pairs, or leave it out")  # fmt: skip
    return None


def _parse_override(item: str, source: str) -> dict[str, Any]:
    if "=" not in item:
        raise ConfigError(f"{source}: override {item!r} must look like section.key=value")
    key, _, text = item.partition("=")
    value = _override_value(key.strip(), text, source)
    node: dict[str, Any] = {}
    cursor = node
    parts = key.strip().split(".")
    for part in parts[:-1]:
        cursor[part] = {}
        cursor = cursor[part]
    cursor[parts[-1]] = value
    return node


_NULL_WORDS = ("null", "Null", "NULL", "~")  # how YAML spells null (as does an empty value)


def _override_value(key: str, text: str, source: str) -> Any:
    """The value of ``--set key=text``, read as a config file reads it (YAML: the same
    numbers, no repeated keys). Text that YAML reads as nothing without spelling null (a
    lone '#' starts a comment; ' ', blank, for data.ingest.delimiter alone) is taken as
    written, not dropped; a number,
    true/false or null for a key that takes text is refused with the quoting that gives
    text (else the error names 2024 or False, not what to type)."""
    try:
        value = read_yaml(text, source, key + ".")
    except yaml.YAMLError:
        return text
    shown = text.strip()
    if value is None and shown not in _NULL_WORDS and (shown or key == "data.ingest.delimiter"):
        return text  # ('#' starts a YAML comment; a blank is a delimiter's only)
    if shown and isinstance(value, (bool, int, float, type(None))) and _text_only(key, value):
        kind = ("null" if value is None else "a number" if not isinstance(value, bool)
                else f"the boolean {str(value).lower()}")  # fmt: skip
        raise ConfigError(f"{source}: '{key}' must be a string, and YAML reads {shown} as "
                          f"{kind}; quote it: --set '{key}=\"{shown}\"'")  # fmt: skip
    return value


def _text_only(key: str, value: Any) -> bool:
    """Whether dotted `key` takes text alone (or null, when `value` is not null): a value
    of another type is then wrong only for how YAML read it."""
    tp: Any = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(tp):
            return False  # an unknown key: _build names it
        tp = typing.get_type_hints(tp).get(part)
    options = get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)
    if value is None and type(None) in options:
        return False
    return [t for t in options if t is not type(None)] == [str]


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` with `extra`'s keys set (nested mappings merged key by key, the rest replaced)."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _build(cls: type, raw: Any, source: str, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the top level"
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: '{where}' must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(
                f"{source}: unknown key '{prefix}{key}'{hint}; allowed: {', '.join(names)}"
            )
        kwargs[key] = _coerce(hints[key], value, source, f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, source: str, key: str) -> Any:
    """Check `value` against type `tp`; return it (ints accepted for floats)."""
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, source, key + ".")
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: a nested error keeps its exact position
            try:
                return _coerce(options[0], value, source, key)
            except ConfigError as exc:
                if f"'{key}' must be" not in str(exc):
                    raise
                raise ConfigError(
                    f"{source}: '{key}' must be {_describe(tp)}, got {value!r}"
                ) from None
        for arg in options:
            try:
                return _coerce(arg, value, source, key)
            except ConfigError:
                pass
        raise ConfigError(f"{source}: '{key}' must be {_describe(tp)}, got {value!r}")
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(
                f"{source}: '{key}' must be one of {', '.join(map(repr, allowed))}, got {value!r}"
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{source}: '{key}' must be {_describe(tp)}, got {value!r}")
        (item_tp,) = get_args(tp)
        return [_coerce(item_tp, v, source, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: '{key}' must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: '{key}' must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: '{key}' must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source}: '{key}' must be a string, got {value!r}")
        return value
    raise ConfigError(f"{source}: '{key}' has an unsupported type {tp!r}")  # pragma: no cover


def _describe(tp: Any) -> str:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if float in args:  # "a number" covers the integers
            args = tuple(a for a in args if a is not int)
        return " or ".join(_describe(a) for a in args)
    if origin is list:
        return f"a list of {_plural(get_args(tp)[0])}"
    if origin is Literal:
        return "one of " + ", ".join(map(repr, get_args(tp)))
    if tp is type(None):
        return "null"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


def _plural(tp: Any) -> str:
    if get_origin(tp) is list:
        return f"lists of {_plural(get_args(tp)[0])}"
    if get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_plural(a) for a in get_args(tp))
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(tp, str(tp))
