"""An operator's chat template (issue 37, part 3): SEMIF_CHAT_TEMPLATE and the template
model-build packs, which one renders the prompts, what answers report, and the start errors
when no usable template is left.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from adapter.core.failures import ModelLoadError
from adapter.model_files import ModelFilesError
from adapter.prompts import TemplateRenderError
from adapter.runtime import load_service
from adapter.settings import Settings, SettingsError, load_settings
from model_build.embedded import sha256_of
from model_build.gguf_info import inspect_gguf
from model_build.manifest import CHAT_TEMPLATE_NAME
from model_build.tiny_gguf import CHAT_TEMPLATE, write_tiny_gguf
from tests.support.manifests import write_manifest
from tests.support.serving import decision, serving

HEADERS = {"content-type": "application/json"}
# The tiny model's own template behind a line of operator text: it renders (and keeps
# request text marked) like the GGUF's, but every prompt differs.
OPERATOR_TEMPLATE = "Operator preamble.\n" + CHAT_TEMPLATE
OTHER_TEMPLATE = "Another operator.\n" + CHAT_TEMPLATE
PACKED_BYTES = len(OPERATOR_TEMPLATE.encode("utf-8"))


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _template_file(directory: Path, text: str, name: str = "operator.jinja") -> Path:
    path = directory / name
    path.write_text(text, encoding="utf-8")
    return path


def _settings(model_dir: Path, template: Path | None = None) -> Settings:
    """Settings as the environment gives them (SEMIF_CHAT_TEMPLATE read at start)."""
    env = {"SEMIF_MODEL_DIR": str(model_dir), "SEMIF_THREADS": "1", "SEMIF_MAX_TOKENS": "1024"}
    if template is not None:
        env["SEMIF_CHAT_TEMPLATE"] = str(template)
    return load_settings(env)


def _answer(settings: Settings) -> tuple[dict[str, Any], str, Any]:
    """One decision's `model` block and prompt_sha256, and /ping's `chat_template`."""
    with serving(settings) as client:
        response = client.post(
            "/invocations", content=json.dumps({"decision": decision()}), headers=HEADERS
        )
        assert response.status_code == 200, response.text
        ping = client.get("/ping").json()
    body = response.json()
    return body["model"], body["result"]["prompt_sha256"], ping["chat_template"]


@pytest.fixture
def bare_model_dir(tmp_path: Path) -> Path:
    """A model directory whose GGUF carries no chat template."""
    model_dir = tmp_path / "bare"
    model_dir.mkdir()
    write_tiny_gguf(model_dir / "bare.gguf", chat_template=None)
    return model_dir


def test_setting_serves_a_bare_gguf_and_wins_over_the_ggufs_template(
    bare_model_dir: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    template = _template_file(tmp_path, OPERATOR_TEMPLATE)
    operator = {"source": "operator", "sha256": _sha256(OPERATOR_TEMPLATE)}
    bare_model, bare_prompt, bare_ping = _answer(_settings(bare_model_dir, template))
    assert bare_model["chat_template"] == bare_ping == operator
    # The same operator template over a GGUF that has its own renders the same prompt...
    over_model, over_prompt, _ = _answer(_settings(tiny_model_dir, template))
    assert (over_model["chat_template"], over_prompt) == (operator, bare_prompt)
    # ...which is not the GGUF template's prompt.
    own_model, own_prompt, _ = _answer(_settings(tiny_model_dir))
    assert own_prompt != bare_prompt
    gguf = next(tiny_model_dir.glob("*.gguf"))
    info = inspect_gguf(gguf, file=gguf.name, size=gguf.stat().st_size, sha256=sha256_of(gguf))
    # The hash is the manifest's convention: sha256 of the template text's UTF-8 bytes.
    assert own_model["chat_template"] == {"source": "gguf", "sha256": info.chat_template_sha256}
    assert info.chat_template_sha256 == _sha256(CHAT_TEMPLATE)


def test_no_template_anywhere_is_refused_naming_the_setting(bare_model_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"has no chat template .* SEMIF_CHAT_TEMPLATE"):
        load_service(_settings(bare_model_dir))


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "cannot be read (No such file or directory)"),
        ("dir", "cannot be read (Is a directory)"),
        (b"", "is empty"),
        (b" \n\t", "is empty"),
        (b"{{ messages }}\xff", "is not UTF-8 text (invalid start byte at byte 14)"),
    ],
)
def test_an_unusable_template_file_is_a_start_error(
    content: bytes | str | None, reason: str, tmp_path: Path
) -> None:
    path = tmp_path / "template.jinja"
    if content == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    with pytest.raises(SettingsError) as raised:
        load_settings({"SEMIF_CHAT_TEMPLATE": str(path)})
    assert str(raised.value).startswith(f"SEMIF_CHAT_TEMPLATE={path} {reason}")


@pytest.mark.parametrize(
    ("template", "reason"),
    [
        ("{% for message in messages %}", "does not compile"),
        ("{{ raise_exception('System role not supported') }}", "System role not supported"),
        ("{{ messages[0]['content'] + 1 }}", "failed to render: TypeError"),
        ("{{ 'a fixed prompt' }}", "drops request text"),
    ],
)
def test_an_operator_template_that_cannot_render_is_a_start_error(
    template: str, reason: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    path = _template_file(tmp_path, template)
    with pytest.raises(TemplateRenderError) as raised:
        load_service(_settings(tiny_model_dir, path))
    message = str(raised.value)
    assert message.startswith(f"SEMIF_CHAT_TEMPLATE={path}: chat template"), message
    assert reason in message


def test_a_gguf_template_that_cannot_render_points_at_the_setting(tmp_path: Path) -> None:
    model_dir = tmp_path / "strict"
    model_dir.mkdir()
    refusing = "{{ raise_exception('System role not supported') }}"
    write_tiny_gguf(model_dir / "strict.gguf", chat_template=refusing)
    with pytest.raises(TemplateRenderError) as raised:
        load_service(_settings(model_dir))
    message = str(raised.value)
    assert message.startswith("the GGUF's chat template (tokenizer.chat_template): "), message
    assert message.endswith(
        "set SEMIF_CHAT_TEMPLATE to a Jinja chat template file, or pack "
        "one with model-build --chat-template"
    )
    service = load_service(_settings(model_dir, _template_file(tmp_path, OPERATOR_TEMPLATE)))
    assert service.model["chat_template"]["source"] == "operator"
    service.engine.close()


def test_the_packed_template_is_verified_and_used_unless_the_setting_overrides_it(
    bare_model_dir: Path, tmp_path: Path
) -> None:
    write_manifest(bare_model_dir, chat_template=OPERATOR_TEMPLATE)
    packed = load_service(_settings(bare_model_dir))
    assert packed.model["chat_template"] == {
        "source": "operator",
        "sha256": _sha256(OPERATOR_TEMPLATE),
    }
    packed.engine.close()
    other = _template_file(tmp_path, OTHER_TEMPLATE)
    overridden = load_service(_settings(bare_model_dir, other))
    assert overridden.model["chat_template"]["sha256"] == _sha256(OTHER_TEMPLATE)
    overridden.engine.close()


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda text: text.replace("Operator", "Attacker"), r"sha256 \w+ does not match manifest"),
        (
            lambda text: text + " ",
            f"size {PACKED_BYTES + 1} bytes does not match manifest {PACKED_BYTES}",
        ),
    ],
)
def test_a_tampered_packed_template_is_refused_like_a_tampered_gguf(
    tamper: Callable[[str], str], message: str, bare_model_dir: Path, tmp_path: Path
) -> None:
    write_manifest(bare_model_dir, chat_template=OPERATOR_TEMPLATE)
    path = bare_model_dir / CHAT_TEMPLATE_NAME
    path.write_text(tamper(OPERATOR_TEMPLATE), encoding="utf-8")
    with pytest.raises(ModelFilesError, match=f"^{CHAT_TEMPLATE_NAME}: {message}"):
        load_service(_settings(bare_model_dir))
    # The setting does not excuse it: what the manifest lists is verified all the same.
    override = _template_file(tmp_path, OTHER_TEMPLATE)
    with pytest.raises(ModelFilesError, match=message):
        load_service(_settings(bare_model_dir, override))
    path.unlink()
    with pytest.raises(ModelFilesError, match=f"lists chat template {CHAT_TEMPLATE_NAME}"):
        load_service(_settings(bare_model_dir))


def test_a_template_file_the_manifest_does_not_list_is_not_read(tiny_model_dir: Path) -> None:
    write_manifest(tiny_model_dir)
    (tiny_model_dir / CHAT_TEMPLATE_NAME).write_text("{{ 'never read' }}", encoding="utf-8")
    service = load_service(_settings(tiny_model_dir))
    assert service.model["chat_template"]["source"] == "gguf"
    service.engine.close()
