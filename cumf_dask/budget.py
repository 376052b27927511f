"""How long a configured job will take, and the refusal of a GPU-size job on a CPU.

The forecast is the planner's cost model (:mod:`.engine.costs`): the predicted seconds of
both half-steps times the iterations, plus generating the store when it must be built
first. On the CPU (the NumPy backend) a job forecast over :data:`CPU_TIME_LIMIT` is refused
before anything starts (a ConfigError, exit code 2) with the forecast and the fixes: a
smaller ``data.generate.scale`` (the largest that fits a few minutes is suggested), a GPU,
or ``--force`` (``force=True``). ``configs/netflix.yaml`` at full size is such a job.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from .config import Config
from .data.presets import PRESETS, resolve_shape, smallest_scale
from .engine.costs import generate_seconds
from .engine.plan import Plan, make_plan
from .errors import ConfigError, PlanError

CPU_TIME_LIMIT = 3600.0  # seconds a CPU job may be forecast to take without --force
SUGGEST_SECONDS = 300.0  # the suggested scale's forecast stays under this
NOTE_SECONDS = 60.0  # train logs the forecast of a job at least this long before it starts
_SCALES = [k * 10.0**e for e in range(0, -7, -1) for k in (5, 2, 1)]  # 5, 2, 1, 0.5, ...


@dataclass(frozen=True)
class Forecast:
    """Predicted seconds: per iteration (both half-steps), iterations, and generating."""

    per_iteration: float
    iterations: int
    generate: float
    generate_nnz: int

    @property
    def total(self) -> float:
        return self.per_iteration * self.iterations + self.generate

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "total": self.total}

    def describe(self) -> str:
        """'5.2 min (31.0 s per iteration x 10 + 10.0 s generating 9,900,000 ratings)'."""
        text = f"{duration(self.per_iteration)} per iteration x {self.iterations}"
        if self.generate_nnz:
            text += f" + {duration(self.generate)} generating {self.generate_nnz:,} ratings"
        return f"{duration(self.total)} ({text})"


def duration(seconds: float) -> str:
    """0.52 s, 31.0 s, 5.2 min, 2.3 h."""
    if seconds < 10:
        return f"{seconds:.2g} s"
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def forecast(config: Config, plan: Plan, generate_nnz: int = 0) -> Forecast:
    """The job's predicted seconds on the plan's workers; `generate_nnz` ratings are
    generated first (0: the store exists). The generator runs on the CPU cores."""
    per_iteration = plan.x.predicted.get("seconds", 0.0) + plan.theta.predicted.get("seconds", 0.0)
    cores = plan.workers if plan.backend == "numpy" else os.cpu_count() or 1
    generate = generate_seconds(generate_nnz, cores) if generate_nnz else 0.0
    return Forecast(per_iteration, config.model.iterations, generate, generate_nnz)


def check_cpu_time(
    config: Config, plan: Plan, generate_nnz: int = 0, *, force: bool = False
) -> Forecast:
    """The forecast; a ConfigError when a CPU job is forecast over CPU_TIME_LIMIT, unforced."""
    fc = forecast(config, plan, generate_nnz)
    if force or plan.backend != "numpy" or fc.total <= CPU_TIME_LIMIT:
        return fc
    fixes = ["run it where a GPU is visible", "or add --force to run it anyway"]
    scale = suggest_scale(config, plan)
    if scale is not None:
        fixes.insert(0, f"for a CPU-size version use {scaled_settings(config, scale[0])} "
                        f"(forecast {duration(scale[1])})")  # fmt: skip
    else:
        fixes.insert(0, "lower model.factors or model.iterations")
    raise ConfigError(
        f"this job is forecast to take {fc.describe()} on {plan.workers} CPU workers, over "
        f"the {duration(CPU_TIME_LIMIT)} a CPU job may take unasked: a GPU-size job. "
        + ", ".join(fixes)
    )


def forecast_note(config: Config, plan: Plan, fc: Forecast) -> str | None:
    """The line train logs before a job of NOTE_SECONDS or more starts: the forecast, and on
    the CPU a smaller scale that takes a few minutes, if the data is a generated preset."""
    if fc.total < NOTE_SECONDS:
        return None
    where = f"{plan.workers} {'CPU' if plan.backend == 'numpy' else 'GPU'} workers"
    line = f"forecast: {fc.describe()} on {where}"
    scale = suggest_scale(config, plan) if plan.backend == "numpy" else None
    if scale is not None:
        line += (f"; a CPU-size version: {scaled_settings(config, scale[0])} (forecast "
                 f"{duration(scale[1])})")  # fmt: skip
    return line


def scaled_settings(config: Config, scale: float) -> str:
    """The --set options of a scaled-down job: the scale, and a store of its own (the
    full-size store's name, the scale in it), so the small data never takes the big name."""
    store = config.data.store
    stem = store[: -len(".zarr")] if store.endswith(".zarr") else store
    stem = re.sub(r"-scale[0-9.e+-]+$", "", stem)
    return f"--set data.generate.scale={scale:g} --set data.store={stem}-scale{scale:g}.zarr"


def suggest_scale(config: Config, plan: Plan) -> tuple[float, float] | None:
    """(scale, forecast seconds): the largest round data.generate.scale below the config's
    whose job is forecast under SUGGEST_SECONDS on the same workers; None if the data is
    not a generated preset or no such scale keeps every row nonempty."""
    gen = config.data.generate
    if config.data.source != "generate" or gen.preset is None or {gen.m, gen.n, gen.nnz} != {None}:
        return None
    smallest = smallest_scale(PRESETS[gen.preset.lower()]) if gen.nonempty else 0.0
    settings = replace(config.plan, memory_budget=None)  # plan.budget has it applied
    for scale in (s for s in _SCALES if smallest <= s < gen.scale):
        m, n, total = resolve_shape(preset=gen.preset, scale=scale, nonempty=gen.nonempty)
        nnz = int(total * (1 - config.data.test_fraction))
        try:
            small = make_plan(m, n, nnz, config.model.factors, plan.workers, plan.budget,
                              None, None, settings, plan.backend, link=plan.link,
                              checkpoint=plan.checkpoint)  # fmt: skip
        except PlanError:
            continue
        seconds = forecast(config, small, total).total
        if seconds <= SUGGEST_SECONDS:
            return scale, seconds
    return None
