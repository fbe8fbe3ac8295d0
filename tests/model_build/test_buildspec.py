"""model_build/buildspec.yml: its pins match requirements.txt and its build phase really runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from model_build.calibration import load_calibration
from model_build.manifest import MANIFEST_NAME, parse_manifest
from tests.support.locks import locked_versions
from tests.support.model_build import tiny_model

REPO = Path(__file__).resolve().parents[2]
# A calibration file in the repository (the CDK tests' fixture), named as the CDK app names one.
VALID_CALIBRATION = "tests/cdk/calibration/valid.json"
BUILDSPEC: dict[str, Any] = yaml.safe_load((REPO / "model_build" / "buildspec.yml").read_text())


def test_install_pins_match_requirements() -> None:
    requirements = locked_versions()
    commands = " ".join(BUILDSPEC["phases"]["install"]["commands"])
    pins = dict(re.findall(r"([\w-]+)==([\w.]+)", commands))
    assert pins == {name: requirements[name] for name in ("gguf", "numpy", "boto3")}
    # The build runs the package from the source root; the project's packaging file (lint
    # rules, dev tools) is not an input, so editing it never rebuilds the model.
    assert "pip install --quiet --no-deps ." not in commands
    assert "python -m model_build.cli" in "\n".join(BUILDSPEC["phases"]["build"]["commands"])


def test_build_phase_runs_model_build_and_exports_the_result(tmp_path: Path) -> None:
    model = tiny_model(tmp_path)
    dest = tmp_path / "out" / "model.tar.gz"
    script = "\n".join(BUILDSPEC["phases"]["build"]["commands"])
    exported = BUILDSPEC["env"]["exported-variables"]
    show = "".join(f'\necho "{name}=${{{name}}}"' for name in exported)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "MODEL_SOURCE_URI": str(model.path),
        "MODEL_SHA256": model.sha256,
        "MODEL_DEST_URI": str(dest),
        "MODEL_BUILD_WORK_DIR": str(tmp_path / "work"),
        # As the CDK app sets it: the file's path in the source, which is the repository's.
        "MODEL_CALIBRATION_FILE": VALID_CALIBRATION,
    }
    env.pop("MODEL_KMS_KEY_ID", None)
    done = subprocess.run(
        ["bash", "-c", script + show],
        env=env,
        cwd=REPO,  # CodeBuild runs the buildspec in the source root
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith('{"archive_bytes": ')  # the result line shows in the log
    values = dict(line.split("=", 1) for line in lines[1:])
    assert values["MODEL_ARCHIVE_URI"] == str(dest)
    assert values["MODEL_GGUF_SHA256"] == model.sha256
    assert len(values["MODEL_ARCHIVE_SHA256"]) == 64
    assert "model-build: packed" in done.stderr  # progress reaches the log too
    with tarfile.open(dest) as tar:
        manifest = tar.extractfile(MANIFEST_NAME)
        assert manifest is not None
        packed = parse_manifest(json.load(manifest)).calibration
    assert packed == load_calibration(REPO / VALID_CALIBRATION)


def test_build_phase_fails_on_a_refused_source(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "MODEL_SOURCE_URI": "hf://org/repo@main/model.gguf",
        "MODEL_SHA256": "0" * 64,
        "MODEL_DEST_URI": str(tmp_path / "model.tar.gz"),
    }
    script = "\n".join(BUILDSPEC["phases"]["build"]["commands"])
    done = subprocess.run(
        ["bash", "-c", script], env=env, cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode != 0
    assert done.stderr.strip().endswith("(branch and tag names move, so they are refused)")
