"""What the server refuses to load or start with, and where it listens and checks keys.

Regression tests for issue 10, items 3 (unverified and broken models, weights changed in
place), 4 (settings that must be start errors) and 5 (bind address and key scope).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from adapter import settings as settings_module
from adapter.app import create_app
from adapter.core.failures import ModelLoadError
from adapter.labels import letter_mass_floor, probe_decision
from adapter.model_files import ModelFilesError, resolve_model_files
from adapter.runtime import load_service
from adapter.settings import Settings, SettingsError, load_settings
from tests.support.broken_models import crush_letter_mass, perturb_output, poison_with_nan
from tests.support.manifests import write_manifest
from tests.support.model_build import CALIBRATION
from tests.support.models import open_test_model
from tests.support.serving import decision, serving

HEADERS = {"content-type": "application/json"}


@pytest.fixture
def sagemaker_dir(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Make the tiny model directory count as SageMaker's /opt/ml/model."""
    monkeypatch.setattr(settings_module, "SAGEMAKER_MODEL_DIR", tiny_model_dir)
    return tiny_model_dir


# -- 3. unverified and broken models ------------------------------------------------------


def test_the_sagemaker_rule_follows_where_the_model_comes_from(tmp_path: Path) -> None:
    assert Settings().in_sagemaker
    assert Settings().manifest_required
    assert load_settings({}).in_sagemaker
    assert not Settings(model_dir=tmp_path).in_sagemaker
    assert not Settings(gguf_path=tmp_path / "m.gguf").in_sagemaker  # bench, scripts
    assert not Settings(allow_unverified_model=True).manifest_required
    assert load_settings({"SEMIF_ALLOW_UNVERIFIED_MODEL": "true"}).allow_unverified_model
    with pytest.raises(SettingsError, match="SEMIF_ALLOW_UNVERIFIED_MODEL='sure'"):
        load_settings({"SEMIF_ALLOW_UNVERIFIED_MODEL": "sure"})


def test_sagemaker_model_dir_without_manifest_refuses_to_start(sagemaker_dir: Path) -> None:
    with pytest.raises(ModelFilesError, match="SEMIF_ALLOW_UNVERIFIED_MODEL=true"):
        load_service(Settings(model_dir=sagemaker_dir, threads=1))


def test_sagemaker_model_dir_serves_a_verified_or_explicitly_allowed_model(
    sagemaker_dir: Path,
) -> None:
    allowed = load_service(
        Settings(model_dir=sagemaker_dir, threads=1, allow_unverified_model=True)
    )
    assert allowed.model["manifest"] is None
    allowed.engine.close()
    write_manifest(sagemaker_dir)
    verified = load_service(Settings(model_dir=sagemaker_dir, threads=1))
    assert verified.model["manifest"] == "model-manifest.json"
    verified.engine.close()


def test_the_manifest_calibration_is_exposed_and_summarised(tiny_model_dir: Path) -> None:
    write_manifest(tiny_model_dir)
    plain = resolve_model_files(tiny_model_dir, None)
    assert (plain.calibration, plain.identity["calibration"]) == (None, None)
    write_manifest(tiny_model_dir, CALIBRATION)
    files = resolve_model_files(tiny_model_dir, None)
    assert files.calibration == CALIBRATION
    # Enough to tell which fit produced the probabilities; priors and metrics stay in the file.
    assert files.identity["calibration"] == {
        "prompt_version": CALIBRATION.prompt_version,
        "option_order": CALIBRATION.option_order,
        "temperatures": {"choice": 1.5, "noul": 0.8},
        "tasks_sha256": CALIBRATION.tasks_sha256,
        "likelihood": None,
    }


def test_a_manifest_with_the_old_calibration_form_is_refused(tiny_model_dir: Path) -> None:
    write_manifest(tiny_model_dir)
    path = tiny_model_dir / "model-manifest.json"
    document = json.loads(path.read_text())
    path.write_text(json.dumps({**document, "calibration": {"temperature": 1.7}}))
    with pytest.raises(ModelFilesError, match="the single 'temperature' form is not read"):
        resolve_model_files(tiny_model_dir, None)


def test_outside_sagemaker_a_bare_gguf_still_loads(tiny_model_dir: Path) -> None:
    service = load_service(Settings(model_dir=tiny_model_dir, threads=1))
    assert service.model["manifest"] is None
    service.engine.close()


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (poison_with_nan, "NaN or infinite logits"),
        (crush_letter_mass, "of the probability on the answer letters, below the floor"),
    ],
)
def test_a_broken_model_is_refused_by_the_probe_decision(
    tmp_path: Path, tiny_gguf: Path, breakage: Callable[[Path], None], message: str
) -> None:
    gguf = Path(shutil.copy(tiny_gguf, tmp_path / "broken.gguf"))
    breakage(gguf)
    with pytest.raises(ModelLoadError, match=message):
        open_test_model(gguf)


def test_the_healthy_tiny_model_passes_the_probe_with_margin(tiny_gguf: Path) -> None:
    model = open_test_model(tiny_gguf)
    try:
        mass = probe_decision(model.engine, model.template, model.labels)
        assert mass > 10 * letter_mass_floor(model.engine.vocab.n_vocab)
        assert model.engine.score([model.engine.vocab.tokenize("x")])[1].reused_tokens == 0
    finally:
        model.engine.close()


def test_letter_mass_floor_is_a_hundredth_of_uniform() -> None:
    assert letter_mass_floor(49152) == pytest.approx(0.01 * 16 / 49152)
    assert letter_mass_floor(262_144) > 4.6e-9  # the flipped-bytes model stays refused


def test_weights_rewritten_in_place_after_start_do_not_change_answers(
    tiny_model_dir: Path,
) -> None:
    body = json.dumps({"decision": decision()})
    with serving(Settings(model_dir=tiny_model_dir, threads=1, prefix_reuse=False)) as client:
        before = client.post("/invocations", content=body, headers=HEADERS).json()["result"]
        perturb_output(next(tiny_model_dir.glob("*.gguf")))  # the weights are in memory
        after = client.post("/invocations", content=body, headers=HEADERS).json()["result"]
    assert after["option_logits"] == before["option_logits"]
    # The rewrite does change what a fresh load serves, so the check above means something.
    with serving(Settings(model_dir=tiny_model_dir, threads=1, prefix_reuse=False)) as client:
        fresh = client.post("/invocations", content=body, headers=HEADERS).json()["result"]
    assert fresh["option_logits"] != before["option_logits"]


def test_a_gguf_replaced_with_its_mtime_kept_is_refused(tiny_model_dir: Path) -> None:
    """`cp -p` / `rsync -t` keep size and mtime; the inode and ctime still change."""
    files = resolve_model_files(tiny_model_dir, None)
    stat = files.gguf.stat()
    replacement = files.gguf.with_suffix(".new")
    replacement.write_bytes(files.gguf.read_bytes())
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    replacement.replace(files.gguf)
    with pytest.raises(ModelFilesError, match="changed on disk while it was being loaded"):
        files.check_unchanged()


def test_a_gguf_that_changes_during_the_load_is_refused(tiny_model_dir: Path) -> None:
    files = resolve_model_files(tiny_model_dir, None)
    files.check_unchanged()
    stat = files.gguf.stat()
    os.utime(files.gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    with pytest.raises(ModelFilesError, match="changed on disk while it was being loaded"):
        files.check_unchanged()


# -- 4. settings that must be start errors ------------------------------------------------


@pytest.mark.parametrize("blank", ["", "   ", "\t"])
def test_a_blank_api_key_is_a_start_error(blank: str) -> None:
    with pytest.raises(SettingsError, match="SEMIF_API_KEY is set but blank"):
        load_settings({"SEMIF_API_KEY": blank})


def test_lib_path_without_libllama_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError) as raised:
        load_settings({"LLAMA_CPP_LIB_PATH": str(tmp_path)})
    assert str(raised.value).startswith(f"LLAMA_CPP_LIB_PATH={tmp_path} holds no libllama.so")
    (tmp_path / "libllama.so").write_bytes(b"")
    assert load_settings({"LLAMA_CPP_LIB_PATH": str(tmp_path)}).llama_lib_path == tmp_path


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SEMIF_BODY_TIMEOUT_S", "0"),
        ("SEMIF_BODY_TIMEOUT_S", "nan"),
        ("SEMIF_SHUTDOWN_GRACE_S", "30"),
        # grace + serve's 4 s backstop + 3 s to free the model must end before 30 s
        ("SEMIF_SHUTDOWN_GRACE_S", "23"),
        ("SEMIF_SHUTDOWN_GRACE_S", "soon"),
    ],
)
def test_time_limits_are_range_checked(name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=name):
        load_settings({name: value})


# -- 5. bind address and key scope --------------------------------------------------------


def test_bind_address_is_loopback_outside_sagemaker(tmp_path: Path) -> None:
    assert load_settings({}).host == "0.0.0.0"
    assert load_settings({"SEMIF_MODEL_DIR": "/opt/ml/model"}).host == "0.0.0.0"
    assert load_settings({"SEMIF_MODEL_DIR": str(tmp_path)}).host == "127.0.0.1"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert load_settings({"SEMIF_GGUF_PATH": str(gguf)}).host == "127.0.0.1"
    explicit = {"SEMIF_MODEL_DIR": str(tmp_path), "SEMIF_HOST": "0.0.0.0"}
    assert load_settings(explicit).host == "0.0.0.0"


def test_outside_sagemaker_a_key_guards_every_route_but_ping(tiny_model_dir: Path) -> None:
    settings = Settings(model_dir=tiny_model_dir, threads=1, api_key="s3cret")
    assert settings.guard_invocations
    body = json.dumps({"decision": decision()})
    key = {"authorization": "Bearer s3cret"}
    with serving(settings) as client:
        for path in ("/invocations", "/endpoints/local/invocations"):
            missing = client.post(path, content=body, headers=HEADERS)
            assert missing.status_code in (401, 424), path
            assert client.post(path, content=body, headers={**HEADERS, **key}).status_code == 200
        unauthorized = client.post("/invocations", content=body, headers=HEADERS)
        assert unauthorized.json()["field"] == "headers.authorization"
        assert client.get("/ping").status_code == 200


def test_without_a_key_nothing_is_guarded(tiny_model_dir: Path) -> None:
    with TestClient(create_app(Settings(model_dir=tiny_model_dir, threads=1))) as client:
        assert not client.app.state.runtime.settings.guard_invocations  # type: ignore[attr-defined]
