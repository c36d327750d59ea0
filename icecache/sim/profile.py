"""Calibration profiles: the files the simulator reads (it never makes them; ``icecache calibrate`` does).

A `CalibrationProfile` holds the fitted predictors of one machine with the raw samples, the machine and the
library versions and pager code they were measured with (Vidur issues #60/#72: a profile is only valid for the
stack it was measured on; ``icecache calibrate --check`` compares them with the running stack, the simulator does
not). `default_profile_path` is the profile shipped with the package (measured on the 2-vCPU machine of
``experiments/sim/README.md``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from icecache.core.errors import ConfigError
from icecache.sim.predictors import Predictor

__all__ = ["PROFILE_SCHEMA", "CalibrationProfile", "default_profile_path", "default_runs_path"]

PROFILE_SCHEMA = 1


def default_profile_path() -> Path:
    """The calibration profile shipped with the package (``icecache/sim/data/profile_this_machine.json``)."""
    return Path(str(resources.files("icecache.sim") / "data" / "profile_this_machine.json"))


def default_runs_path() -> Path:
    """The measured runs shipped with the package (``icecache/sim/data/measured_runs.jsonl``), which
    ``experiments/sim/measure_runs.py`` wrote and ``python -m icecache.sim validate`` scores by default."""
    return Path(str(resources.files("icecache.sim") / "data" / "measured_runs.jsonl"))


@dataclass
class CalibrationProfile:
    """Everything measured on one machine: fitted predictors, raw samples, machine and versions.

    Attributes
    ----------
    machine : dict
        CPU model, core count, OS, host name (identifies where it was measured).
    versions : dict
        Library versions at measurement time (``icecache calibrate`` records them).
    pager_hashes : dict
        Source hashes of the measured pagers (recorded the same way; ``icecache calibrate --check``
        compares both with the running stack).
    created : str
        ISO time of the measurement.
    predictors : dict of str to Predictor
        Keyed by predictor name (see `MeasuredCosts` for the names it uses).
    meta : dict
        Measurement settings: model name and shape, dtype bytes, queries per select (group size), head dim,
        threads measured, pool efficiencies, pager list, wall time, notes.
    samples : dict
        Raw samples per component (lists of dicts with the features and ``seconds`` lists).
    """

    machine: dict[str, Any]
    versions: dict[str, str]
    pager_hashes: dict[str, str]
    created: str
    predictors: dict[str, Predictor]
    meta: dict[str, Any] = field(default_factory=dict)
    samples: dict[str, Any] = field(default_factory=dict)
    schema: int = PROFILE_SCHEMA

    def predictor(self, name: str) -> Predictor:
        try:
            return self.predictors[name]
        except KeyError:
            raise ConfigError(
                f"calibration profile has no predictor {name!r} (has: {', '.join(sorted(self.predictors))}); "
                "re-run `icecache calibrate`"
            ) from None

    def decode_index_settings(self, pager: str) -> dict[str, int]:
        """``{"budget", "page_size"}`` at which the calibration timed ``pager`` inside the runtime's decode
        (component ``decode_index``); read from the raw samples, or from ``meta`` in a `lean` profile."""
        kept = self.meta.get("decode_index_settings", {}).get(pager)
        if kept is not None:
            return dict(kept)
        try:
            first = self.samples["decode_index"][pager][0]
        except (KeyError, IndexError, TypeError):
            raise ConfigError(f"calibration profile has no decode_index timing of pager {pager!r}; re-run "
                              "`icecache calibrate` with that component") from None
        return {"budget": int(first["budget"]), "page_size": int(first["page_size"])}

    def lean(self) -> CalibrationProfile:
        """This profile without its raw samples (what simulator workers get), keeping in ``meta`` the few facts
        the cost models read from them (`decode_index_settings`)."""
        kept = {p: self.decode_index_settings(p) for p in self.samples.get("decode_index", {})}
        meta = {**self.meta, "decode_index_settings": {**self.meta.get("decode_index_settings", {}), **kept}}
        return dataclasses.replace(self, samples={}, meta=meta)

    @property
    def pagers(self) -> list[str]:
        """Pagers with a measured select cost."""
        return sorted(k.split("/", 1)[1] for k in self.predictors if k.startswith("select/"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": self.schema,
            "created": self.created,
            "machine": self.machine,
            "versions": self.versions,
            "pager_hashes": self.pager_hashes,
            "meta": self.meta,
            "predictors": {k: v.to_dict() for k, v in sorted(self.predictors.items())},
            "samples": self.samples,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CalibrationProfile:
        if not isinstance(d, dict):
            raise ConfigError(f"a calibration profile is a JSON object, got {type(d).__name__}")
        if d.get("schema") != PROFILE_SCHEMA:
            raise ConfigError(f"calibration profile schema {d.get('schema')!r} is not {PROFILE_SCHEMA}; re-run calibrate")
        missing = [k for k in ("machine", "versions", "created", "predictors") if k not in d]
        if missing:
            raise ConfigError(f"calibration profile lacks {missing}")
        try:
            predictors = {k: Predictor.from_dict(v) for k, v in d["predictors"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"calibration profile has a malformed predictor: {exc!r}") from None
        return cls(
            machine=dict(d["machine"]), versions=dict(d["versions"]), pager_hashes=dict(d.get("pager_hashes", {})),
            created=str(d["created"]), predictors=predictors, meta=dict(d.get("meta", {})), samples=dict(d.get("samples", {})),
        )

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n")
        tmp.replace(p)
        return p

    @classmethod
    def load(cls, path: str | Path) -> CalibrationProfile:
        """Read a profile (`ConfigError` when the file is missing or not a profile)."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"no calibration profile at {p}; run `icecache calibrate --out {p}`")
        try:
            data = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{p} is not a calibration profile (not JSON: {exc})") from None
        try:
            return cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{p}: {exc}") from None
