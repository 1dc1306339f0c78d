"""A what-if: the recorded run beside simulations of it under configs
(``renqueue replay --what-if other.toml``).

:func:`load_what_if` reads the other config: a Ren-Queue config file, which
may also give models for backends the log has no calls of
(``[whatif.models.<name>]``, a :class:`~renqueue.sim.ModelSpec`; the table is
the what-if's own and never reaches the config). :func:`compare` fits the
backend models from the trace once, simulates it under each config with the
same seed, and sums up each run (:class:`Comparison`), the recorded one first.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import msgspec
from msgspec import Struct

from ..config import Config, parse_config, read_toml
from ..errors import ConfigError
from ._models import ModelSpec, fit_models
from ._outcomes import Simulation
from ._report import Column, Summary, recorded_outcomes, summarize
from ._simulator import simulate
from ._trace import Trace

__all__ = ["Comparison", "WhatIfFile", "compare", "load_what_if"]


class WhatIfFile(Struct, frozen=True, kw_only=True):
    """A what-if's config, and the models it gives for backends the log has no calls of."""

    config: Config
    models: dict[str, ModelSpec] = {}


def load_what_if(path: str | os.PathLike[str]) -> WhatIfFile:
    """Read a what-if config file; raises :class:`~renqueue.errors.ConfigError`
    naming the file (and the field) when it cannot be read or is not valid."""
    source = str(path)
    data = read_toml(path)
    extra = data.pop("whatif", {})
    if not isinstance(extra, Mapping) or set(extra) - {"models"}:
        raise ConfigError("expected a table with only 'models'", path="$.whatif", source=source)
    models = extra.get("models", {})
    if not isinstance(models, Mapping):
        raise ConfigError("expected a table", path="$.whatif.models", source=source)
    given: dict[str, ModelSpec] = {}
    for name, value in models.items():
        try:
            given[name] = msgspec.convert(value, ModelSpec, strict=True)
        except msgspec.ValidationError as exc:
            message, _, where = str(exc).partition(" - at `")
            field = f"$.whatif.models.{name}" + where.rstrip("`")[1:]
            raise ConfigError(message, path=field, source=source) from exc
    return WhatIfFile(config=parse_config(data, source=source), models=given)


class Comparison(Struct, frozen=True, kw_only=True):
    """The recorded run and each simulation, summed up, in the order given."""

    columns: tuple[Column, ...]
    simulations: tuple[Simulation, ...]

    def summary(self, index: int) -> Summary:
        return self.columns[index].summary


def compare(
    trace: Trace,
    configs: Sequence[tuple[str, Config]],
    *,
    seed: int = 0,
    models: Mapping[str, ModelSpec] | None = None,
) -> Comparison:
    """The recorded run of ``trace``, then a simulation under each of
    ``configs`` (title, config), on backend models fitted from ``trace`` (or
    ``models`` for a backend it has no calls of). The first config is taken
    to be the one the log was recorded under (its backends' slots)."""
    names = list(dict.fromkeys(name for _, config in configs for name in config.backends))
    recorded = configs[0][1] if configs else None
    slots = (
        None
        if recorded is None
        else {name: backend.limits.concurrency for name, backend in recorded.backends.items()}
    )
    fitted = fit_models(trace, names, models, slots=slots)
    levels = list(dict.fromkeys(level for _, config in configs for level in config.priorities))
    recorded_summary = summarize(recorded_outcomes(trace), levels)
    running = recorded_summary.ended.get("unfinished", 0)
    recorded_notes = (
        (
            f"recorded: {running} requests had not ended when the log was read; they count as"
            " not in time there, while the simulations run them to their end (an --until"
            " some minutes back compares like with like)",
        )
        if running
        else ()
    )
    columns = [Column(title="recorded", summary=recorded_summary, notes=recorded_notes)]
    simulations = []
    for title, config in configs:
        simulation = simulate(trace, config, fitted, seed=seed)
        simulations.append(simulation)
        notes = []
        for name in simulation.assumed:
            notes.append(
                f"{title}: no call of {name} in the log: it was simulated on every backend's"
                f" calls pooled (give [whatif.models.{name}] in the what-if file for a model"
                " of its own)"
            )
        if simulation.stopped_early:
            notes.append(
                f"{title}: the simulation stopped with requests still waiting (counted"
                " unfinished): its rounds or its horizon ran out"
            )
        columns.append(
            Column(
                title=title,
                summary=summarize(simulation.outcomes, levels),
                notes=tuple(notes),
            )
        )
    return Comparison(columns=tuple(columns), simulations=tuple(simulations))
