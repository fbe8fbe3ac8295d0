"""A calibration for the model-build and manifest tests (and the adapter's manifest check)."""

from __future__ import annotations

from pathlib import Path

from model_build.calibration import Calibration

CALIBRATION = Calibration(
    prompt_version="semif-direct-options/1",
    option_order="canonical",
    temperatures={"choice": 1.5, "noul": 0.8},
    tasks_sha256="d" * 64,
    counts={"choice": 40, "noul": 12},
    position_prior={2: (0.6, 0.4)},
    metrics={"nll_before": 0.71, "nll_after": 0.64},
)


def write_calibration(path: Path, calibration: Calibration = CALIBRATION) -> Path:
    """Write `calibration` as semif-calibrate would and return the path."""
    path.write_text(calibration.to_json(), encoding="utf-8")
    return path
