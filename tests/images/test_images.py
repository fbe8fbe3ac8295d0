"""Dockerfiles, the image buildspec and the smoke test script, checked without a Docker engine."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML (via cfn-lint); no stubs pinned
from starlette.testclient import TestClient

from cdk_constructs.image_build import BUILDSPEC, SOURCE_PATHS, ImageFlavor
from images import smoke as image_smoke
from stacks.environments import PUBLISHED_DLC_IMAGES
from tests.support.cpus import write_ggml_library
from tests.support.locks import locked_versions

REPO = Path(__file__).resolve().parents[2]
# The llama-cpp-python commits aws-samples/sagemaker-genai-hosting-examples validated for
# these DLC digests (03-features/semif-decision-model/Dockerfile and Dockerfile.gpu).
SAMPLE_BINDING_COMMITS = {
    ImageFlavor.CPU: "8a0810fa04bde084bd3446d126831ae5bd65e373",
    ImageFlavor.CUDA: "ea3b56bdc386d5a6f31120338ffe907211b0907c",
}
BASE_IMAGES = {
    ImageFlavor.CPU: PUBLISHED_DLC_IMAGES.cpu,
    ImageFlavor.CUDA: PUBLISHED_DLC_IMAGES.cuda,
}
SECRET_PATTERNS = [
    re.compile(r"AKIA[0-9A-Z]{16}"),
    re.compile(r"(?i)aws_secret_access_key"),
    re.compile(r"(?i)(password|passwd|secret|token)\s*[=:]\s*\S+"),
    re.compile(r"(?i)BEGIN (RSA |EC |OPENSSH )?PRIVATE KEY"),
]


def dockerfile(flavor: ImageFlavor) -> str:
    return (REPO / flavor.dockerfile).read_text()


def instructions(text: str) -> list[str]:
    """Dockerfile instructions with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [
        line.strip()
        for line in joined.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


@pytest.mark.parametrize("flavor", list(ImageFlavor))
def test_dockerfile_is_from_the_digest_pinned_dlc_of_the_config(flavor: ImageFlavor) -> None:
    lines = instructions(dockerfile(flavor))
    assert lines[0] == f"ARG DLC_IMAGE={BASE_IMAGES[flavor]}"
    assert lines[1] == "FROM ${DLC_IMAGE}"
    assert [line for line in lines if line.startswith("FROM")] == ["FROM ${DLC_IMAGE}"]


@pytest.mark.parametrize("flavor", list(ImageFlavor))
def test_binding_is_the_commit_the_aws_sample_validated(flavor: ImageFlavor) -> None:
    text = dockerfile(flavor)
    assert f"ARG LLAMA_CPP_PYTHON_COMMIT={SAMPLE_BINDING_COMMITS[flavor]}" in text
    assert "aws-samples/sagemaker-genai-hosting-examples" in text
    assert 'CMAKE_ARGS="-DLLAMA_BUILD=OFF' in text  # reuse the DLC's libllama, build nothing
    assert "git+https://github.com/abetlen/llama-cpp-python.git@${LLAMA_CPP_PYTHON_COMMIT}" in text


@pytest.mark.parametrize("flavor", list(ImageFlavor))
def test_dockerfile_uses_the_dlc_libraries_and_serve_entry_point(flavor: ImageFlavor) -> None:
    lines = instructions(dockerfile(flavor))
    assert any(
        "LLAMA_CPP_LIB_PATH=/opt/llama.cpp/bin" in line for line in lines if line.startswith("ENV")
    )
    # By absolute path: the DLC has its own /usr/bin/serve.
    assert lines[-1] == f"ENTRYPOINT {json.dumps(image_smoke.ENTRYPOINT)}"
    assert "EXPOSE 8080" in lines
    assert any("import llama_cpp, adapter.serve" in line for line in lines)


@pytest.mark.parametrize("flavor", list(ImageFlavor))
def test_build_fails_unless_serve_is_the_adapter(flavor: ImageFlavor) -> None:
    (install,) = [
        line
        for line in instructions(dockerfile(flavor))
        if line.startswith("RUN") and "/opt/semif/bin/serve" in line
    ]
    # The console script named serve must come from our distribution and point at the adapter,
    # and the entry point script must import it.
    assert "e.dist.name == 'semif-adapter'" in install
    assert "found == ['adapter.serve:main']" in install
    assert "grep -qx 'from adapter.serve import main' /opt/semif/bin/serve" in install
    assert install.index("> /opt/semif/bin/serve") < install.index("grep -qx")


def test_entry_point_script_runs_the_adapter(tmp_path: Path) -> None:
    """The script the Dockerfile writes, run here with this Python: it is adapter.serve."""
    (install,) = [
        line
        for line in instructions(dockerfile(ImageFlavor.CPU))
        if line.startswith("RUN") and "/opt/semif/bin/serve" in line
    ]
    template = re.search(r"printf '([^']+)'", install)
    assert template is not None
    script = template.group(1).replace("\\n", "\n").replace("%s", sys.executable)
    path = tmp_path / "serve"
    path.write_text(script.encode().decode("unicode_escape"))
    path.chmod(0o755)
    result = subprocess.run(
        [str(path), "unexpected-argument"], capture_output=True, text=True, check=False, cwd=REPO
    )
    assert result.returncode != 0
    assert "usage: serve" in result.stderr  # adapter.serve's own usage message


@pytest.mark.parametrize("flavor", list(ImageFlavor))
def test_dockerfile_pins_every_pip_requirement(flavor: ImageFlavor) -> None:
    locked = locked_versions()
    pinned = re.findall(r'"([a-z0-9-]+)==([0-9.]+)"', dockerfile(flavor))
    assert {name for name, _ in pinned} >= {
        "starlette",
        "uvicorn",
        "numpy",
        "jinja2",
        "prometheus-client",
    }
    for name, version in pinned:
        assert locked.get(name) == version, f"{name} differs from the lock (requirements/)"
    unpinned = re.findall(r'pip install[^&]*?"([a-z0-9-]+)(>=|<|~=)', dockerfile(flavor))
    assert unpinned == []


@pytest.mark.parametrize("flavor", list(ImageFlavor))
def test_the_image_leaves_out_the_dlc_cpu_variants_built_with_amx(
    flavor: ImageFlavor, tmp_path: Path
) -> None:
    """The build step, run here on a stand-in of the DLC's library directory: the AMX
    variant is deleted, once the adapter that decides it is installed and before the
    import check loads anything."""
    (install,) = [
        line
        for line in instructions(dockerfile(flavor))
        if line.startswith("RUN") and "drop_amx_variants" in line
    ]
    steps = [step.strip() for step in install.removeprefix("RUN").split("&&")]
    [drop] = [index for index, step in enumerate(steps) if "drop_amx_variants" in step]
    assert steps.index("python3 -m pip install --no-cache-dir --no-deps /opt/semif/src") < drop
    assert drop < steps.index('python3 -c "import llama_cpp, adapter.serve"')
    for name, amx in [("libggml-cpu-icelake.so", False), ("libggml-cpu-sapphirerapids.so", True)]:
        write_ggml_library(tmp_path / name, amx=amx)
    command = shlex.split(steps[drop])
    assert command[:2] == ["python3", "-c"]
    result = subprocess.run(
        [sys.executable, *command[1:]],
        env={**os.environ, "LLAMA_CPP_LIB_PATH": str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    assert result.stdout == (
        "CPU backend variants deleted for their AMX kernels: ['libggml-cpu-sapphirerapids.so']\n"
    )
    assert [path.name for path in tmp_path.iterdir()] == ["libggml-cpu-icelake.so"]


def test_cuda_image_offloads_and_drops_the_symbol_the_dlc_lacks() -> None:
    text = dockerfile(ImageFlavor.CUDA)
    assert "SEMIF_N_GPU_LAYERS=-1" in text
    assert "Load a LoRA adapter from an open FILE pointer" in text


@pytest.mark.parametrize(
    "path", [f.dockerfile for f in ImageFlavor] + [BUILDSPEC, "images/smoke.py"]
)
def test_no_secrets_in_image_inputs(path: str) -> None:
    text = (REPO / path).read_text()
    for pattern in SECRET_PATTERNS:
        assert not pattern.search(text), f"{path} matches {pattern.pattern}"


@pytest.fixture(scope="module")
def buildspec() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((REPO / BUILDSPEC).read_text())
    return loaded


def build_script(buildspec: dict[str, Any]) -> str:
    return "\n".join(buildspec["phases"]["build"]["commands"])


def test_buildspec_exports_the_digest_pinned_image_uri(buildspec: dict[str, Any]) -> None:
    assert buildspec["version"] == 0.2
    assert buildspec["env"]["exported-variables"] == ["IMAGE_URI", "IMAGE_DIGEST"]
    script = build_script(buildspec)
    assert 'export IMAGE_URI="${ECR_REPOSITORY_URI}@${digest}"' in script
    assert 'export IMAGE_DIGEST="${digest}"' in script
    # The model is built from IMAGE_DIGEST (container_image.DIGEST_ATTRIBUTE): it is checked
    # before it is exported.
    assert script.index("^sha256:[0-9a-f]{64}$") < script.index("export IMAGE_DIGEST")
    assert "post_build" not in buildspec["phases"]  # post_build would run after a failure too


def test_buildspec_smoke_tests_before_it_pushes(buildspec: dict[str, Any]) -> None:
    script = build_script(buildspec)
    order = [
        script.index("docker build"),
        script.index("python -m model_build.tiny_gguf"),
        script.index("images/smoke.py"),
        script.index("docker push"),
    ]
    assert order == sorted(order)
    assert '--build-arg "DLC_IMAGE=${DLC_IMAGE}"' in script
    assert '--backend "${SMOKE_BACKEND}"' in script
    assert '--env "${SMOKE_ENV:-}"' in script
    assert '--require-file "${SMOKE_REQUIRE_FILE:-}"' in script
    assert "--gpus" not in script  # no GPU build host
    assert "set -euo pipefail" in script


DOCKER_V2 = "application/vnd.docker.distribution.manifest.v2+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"


def _pushed_build(tmp_path: Path, buildspec: dict[str, Any], media_type: str) -> Any:
    """The build script for a tag already in ECR, with `aws` and `docker` stubbed: ECR says
    the image's digest, and `media_type` for its imageManifestMediaType."""
    stubs = tmp_path / "bin"
    stubs.mkdir(parents=True)
    (stubs / "aws").write_text(
        "#!/bin/bash\n"
        'case "$*" in\n'
        '  *imageManifestMediaType*) echo "${FAKE_MEDIA_TYPE}" ;;\n'
        f"  *imageDigest*) echo sha256:{'a' * 64} ;;\n"
        "  *) echo token ;;\n"
        "esac\n"
    )
    (stubs / "docker").write_text("#!/bin/bash\ncat > /dev/null\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    environment = {
        "PATH": f"{stubs}:/usr/bin:/bin",
        "FAKE_MEDIA_TYPE": media_type,
        "AWS_DEFAULT_REGION": "us-east-1",
        "ECR_REPOSITORY_URI": "111122223333.dkr.ecr.us-east-1.amazonaws.com/adapter",
        "IMAGE_TAG": "cpu-" + "b" * 32,
        "DOCKERFILE": "images/Dockerfile",
        "DLC_IMAGE": "mirror@sha256:" + "c" * 64,
        "SMOKE_BACKEND": "CPU",
    }
    return subprocess.run(
        ["bash", "-c", build_script(buildspec)],
        env=environment,
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )


def test_buildspec_exports_only_a_docker_v2_image(
    tmp_path: Path, buildspec: dict[str, Any]
) -> None:
    accepted = _pushed_build(tmp_path / "v2", buildspec, DOCKER_V2)
    assert accepted.returncode == 0, accepted.stderr
    assert f"IMAGE_URI=111122223333.dkr.ecr.us-east-1.amazonaws.com/adapter@sha256:{'a' * 64}" in (
        accepted.stdout
    )
    refused = _pushed_build(tmp_path / "oci", buildspec, OCI_INDEX)
    assert refused.returncode == 1
    assert f"is {OCI_INDEX}; SageMaker serves only {DOCKER_V2}" in refused.stderr
    script = build_script(buildspec)
    # Both paths (pushed now, or earlier) pass the check before the digest is exported, and
    # the build asks BuildKit for no attestations.
    assert script.index("imageManifestMediaType") < script.index("export IMAGE_DIGEST")
    assert script.index("docker push") < script.index("imageManifestMediaType")
    assert script.index("BUILDX_NO_DEFAULT_ATTESTATIONS=1") < script.index("docker build")


def test_buildspec_inputs_are_in_the_uploaded_source() -> None:
    for flavor in ImageFlavor:
        assert (REPO / flavor.dockerfile).is_file()
        assert flavor.dockerfile.split("/")[0] in SOURCE_PATHS
    assert (REPO / "images" / "smoke.py").is_file()
    assert (REPO / "model_build" / "tiny_gguf.py").is_file()
    assert {"images", "adapter", "model_build"} <= set(SOURCE_PATHS)


# --- the smoke script's checks ---------------------------------------------------------

GOOD_RESULT = {
    "result": {
        "id": "smoke",
        "option_ids": ["account-access", "billing"],
        "probabilities": [0.7, 0.3],
    }
}

GOOD_SHARED = {
    "results": [
        {"id": "smoke-queue", "probabilities": [0.6, 0.4]},
        {"id": "smoke-urgent", "probabilities": [0.1, 0.9]},
    ],
    "timing": {"input_tokens": 70, "reused_tokens": 0, "evaluated_tokens": 40, "passes": 1},
}


def test_metrics_check_needs_the_decision_calls_counted() -> None:
    text = (
        "# TYPE semif_requests_total counter\n"
        'semif_requests_total{api="decision",status="200"} 2.0\n'
        'semif_requests_total{api="decision",status="400"} 5.0\n'
    )
    assert image_smoke.check_metrics(text, calls=2) == 2.0
    with pytest.raises(image_smoke.SmokeError, match="does not count the 3 decision calls"):
        image_smoke.check_metrics(text, calls=3)
    with pytest.raises(image_smoke.SmokeError, match="no semif_requests_total"):
        image_smoke.check_metrics('semif_requests_total{api="chat",status="200"} 9.0\n', calls=1)


def test_json_lines_check_wants_every_line_in_order() -> None:
    answers: list[dict[str, Any]] = [
        GOOD_RESULT,
        GOOD_SHARED,
        {"status": 400, "error": "invalid JSON"},
    ]
    good = "\n".join(json.dumps({**answer, "line": i}) for i, answer in enumerate(answers))
    assert image_smoke.check_lines(good) == [200, 200, 400]
    with pytest.raises(image_smoke.SmokeError, match="wrong lines"):
        image_smoke.check_lines("\n".join(good.splitlines()[:2]))
    with pytest.raises(image_smoke.SmokeError, match="not JSON Lines"):
        image_smoke.check_lines('{"error": "x"')
    assert image_smoke.lines_body().count(b"\n") == 3


def test_execution_parameters_check() -> None:
    answer = {"MaxConcurrentTransforms": 2, "BatchStrategy": "MULTI_RECORD", "MaxPayloadInMB": 6}
    assert image_smoke.check_execution_parameters(answer) == answer
    with pytest.raises(image_smoke.SmokeError):
        image_smoke.check_execution_parameters({"error": "Not Found"})


def test_backend_check_requires_the_expected_backend() -> None:
    assert image_smoke.check_backends({"status": "ok", "backends": ["CPU", "CUDA"]}, "CUDA") == [
        "CPU",
        "CUDA",
    ]
    with pytest.raises(image_smoke.SmokeError, match="CUDA"):
        image_smoke.check_backends({"status": "ok", "backends": ["CPU"]}, "CUDA")
    with pytest.raises(image_smoke.SmokeError):
        image_smoke.check_backends({"status": "ok"}, "CPU")


@pytest.mark.parametrize(
    "answer",
    [
        {},
        {"result": {**GOOD_RESULT["result"], "id": "other"}},
        {"result": {**GOOD_RESULT["result"], "option_ids": ["billing", "account-access"]}},
        {"result": {**GOOD_RESULT["result"], "probabilities": [0.7, 0.7]}},
        {"result": {**GOOD_RESULT["result"], "probabilities": [1.0]}},
    ],
)
def test_decision_check_rejects_malformed_answers(answer: dict[str, Any]) -> None:
    with pytest.raises(image_smoke.SmokeError):
        image_smoke.check_decision(answer)


def test_weights_check_requires_the_named_buffer_type_only_when_asked() -> None:
    weights = {"setting": "auto", "cpu_backend": "libggml-cpu-zen4.so", "host_amx": True}
    repacked = {"serving": {"weight_buffers": {**weights, "weights_in": ["CPU", "CPU_REPACK"]}}}
    plain = {"serving": {"weight_buffers": {**weights, "weights_in": ["CPU"]}}}
    assert image_smoke.check_weights(repacked, "CPU_REPACK")["host_amx"] is True
    assert image_smoke.check_weights(plain, "")["weights_in"] == ["CPU"]  # reported only
    with pytest.raises(image_smoke.SmokeError, match=r"not in CPU_REPACK buffers: .*zen4"):
        image_smoke.check_weights(plain, "CPU_REPACK")
    with pytest.raises(image_smoke.SmokeError, match="not in CPU_REPACK buffers: None"):
        image_smoke.check_weights({"status": "ok"}, "CPU_REPACK")


def test_smoke_weights_check_reads_the_real_adapter_ping(tiny_client: TestClient) -> None:
    ping = tiny_client.get("/ping").json()
    weights = image_smoke.check_weights(ping, "CPU")
    assert weights["setting"] == "auto"
    assert weights["cpu_backend"].startswith("libggml-cpu")
    with pytest.raises(image_smoke.SmokeError, match="not in AMX buffers"):
        image_smoke.check_weights(ping, "AMX")


def test_decision_check_accepts_a_distribution() -> None:
    assert image_smoke.check_decision(GOOD_RESULT) == [0.7, 0.3]


class FakeDocker:
    """Records docker calls; the container 'runs' and publishes 8080 on a loopback port."""

    def __init__(self, state: str = "true 0 false") -> None:
        self.calls: list[tuple[str, ...]] = []
        self.state = state  # Running ExitCode OOMKilled, as `docker inspect` formats them

    def __call__(self, *args: str) -> str:
        self.calls.append(args)
        if args[:2] == ("image", "inspect"):
            return json.dumps(image_smoke.ENTRYPOINT)
        if args[0] == "run" and "--rm" in args:
            return "/opt/llama.cpp/bin/libggml-cuda.so"
        return {"run": "c0ffee", "port": "127.0.0.1:49153", "inspect": self.state, "logs": "log"}[
            args[0]
        ]


@pytest.mark.parametrize(("backends", "code"), [(["CPU"], 0), ([], 1)])
def test_main_runs_the_image_like_sagemaker_and_cleans_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, backends: list[str], code: int
) -> None:
    fake = FakeDocker()
    removed: list[list[str]] = []
    requests: list[str] = []

    def request(url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        requests.append(url)
        if url.endswith("/ping"):
            return 200, {"status": "ok", "backends": backends}
        if url.endswith("/execution-parameters"):
            return 200, {"BatchStrategy": "MULTI_RECORD", "MaxPayloadInMB": 6}
        if body == image_smoke.SHARED:
            return 200, GOOD_SHARED
        assert body == image_smoke.DECISION
        return 200, GOOD_RESULT

    def post_lines(url: str) -> str:
        requests.append(url + " lines")
        answers: list[dict[str, Any]] = [GOOD_RESULT, GOOD_SHARED, {"status": 400}]
        return "\n".join(json.dumps({**a, "line": i}) for i, a in enumerate(answers))

    monkeypatch.setattr(image_smoke, "docker", fake)
    monkeypatch.setattr(image_smoke, "request", request)
    monkeypatch.setattr(image_smoke, "post_lines", post_lines)

    def scrape(url: str) -> str:
        requests.append(url)
        return 'semif_requests_total{api="decision",status="200"} 2.0\n'

    monkeypatch.setattr(image_smoke, "scrape", scrape)
    monkeypatch.setattr(subprocess, "run", lambda args, **_: removed.append(list(args)))
    status = image_smoke.main(
        [
            *("--image", "semif-adapter:cpu-x", "--model-dir", str(tmp_path), "--backend", "CPU"),
            *("--env", "SEMIF_N_GPU_LAYERS=0"),
            *("--require-file", "/opt/llama.cpp/bin/libggml-cuda*.so"),
        ]
    )
    assert status == code
    assert fake.calls[0][:2] == ("image", "inspect")
    assert fake.calls[1][-1] == "/opt/llama.cpp/bin/libggml-cuda*.so"
    run = fake.calls[2]
    env = [run[index + 1] for index, arg in enumerate(run) if arg == "--env"]
    # The smoke model has no manifest: the opt-in is deliberate, and only here.
    assert env == ["SEMIF_ALLOW_UNVERIFIED_MODEL=true", "SEMIF_N_GPU_LAYERS=0"]
    assert run[-2:] == ("semif-adapter:cpu-x", "serve")
    assert f"{tmp_path.resolve()}:/opt/ml/model:ro" in run
    assert "127.0.0.1::8080" in run
    assert "--gpus" not in run
    assert requests[0] == "http://127.0.0.1:49153/ping"
    served = requests[-3:] == [
        "http://127.0.0.1:49153",  # scraped once it served
        "http://127.0.0.1:49153 lines",
        "http://127.0.0.1:49153/execution-parameters",
    ]
    assert served == (code == 0)
    assert removed == [["docker", "rm", "--force", "c0ffee"]]


def test_smoke_checks_accept_the_real_adapter_answers(tiny_client: TestClient) -> None:
    """The smoke test's expectations match what the adapter really answers."""
    single = tiny_client.post("/invocations", json=image_smoke.DECISION).json()
    assert len(image_smoke.check_decision(single)) == 2
    shared = tiny_client.post("/invocations", json=image_smoke.SHARED).json()
    assert image_smoke.check_shared(shared) == ["smoke-queue", "smoke-urgent"]
    with pytest.raises(image_smoke.SmokeError, match="wrong results"):
        image_smoke.check_shared({"results": shared["results"][::-1], "timing": shared["timing"]})
    assert image_smoke.check_metrics(tiny_client.get("/metrics").text, calls=2) >= 2
    lines = tiny_client.post(
        "/invocations",
        content=image_smoke.lines_body(),
        headers={"content-type": "application/jsonlines"},
    )
    assert image_smoke.check_lines(lines.text) == [200, 200, 400]
    parameters = tiny_client.get("/execution-parameters").json()
    assert image_smoke.check_execution_parameters(parameters) == parameters


@pytest.mark.parametrize(
    ("status", "oom", "words"),
    [
        (139, False, "exited: signal 11 (SIGSEGV)"),
        (134, False, "exited: signal 6 (SIGABRT)"),
        (1, False, "exited with status 1"),
        (137, True, "was killed for memory (OOMKilled)"),
    ],
)
def test_a_container_end_is_named(status: int, oom: bool, words: str) -> None:
    assert image_smoke.how_it_ended(status, oom) == words


def _smoke_args(tmp_path: Path) -> list[str]:
    return ["--image", "semif-adapter:cpu-x", "--model-dir", str(tmp_path), "--backend", "CPU"]


def test_a_server_that_dies_at_start_fails_the_smoke_at_once_with_its_log(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeDocker(state="false 139 false")
    monkeypatch.setattr(image_smoke, "docker", fake)
    monkeypatch.setattr(image_smoke, "request", lambda url, body=None: pytest.fail("no /ping"))
    monkeypatch.setattr(subprocess, "run", lambda args, **_: None)
    assert image_smoke.main(_smoke_args(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "the container exited: signal 11 (SIGSEGV) before /ping answered 200" in err
    assert ("logs", "--tail", "200", "c0ffee") in fake.calls


def test_a_server_that_dies_while_scoring_fails_the_smoke_with_how(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fake = FakeDocker()

    def request(url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        if url.endswith("/ping"):
            return 200, {"status": "ok", "backends": ["CPU"]}
        fake.state = "false 139 false"  # the first decode crashes the server
        raise ConnectionResetError("connection reset by peer")

    monkeypatch.setattr(image_smoke, "docker", fake)
    monkeypatch.setattr(image_smoke, "request", request)
    monkeypatch.setattr(subprocess, "run", lambda args, **_: None)
    assert image_smoke.main(_smoke_args(tmp_path)) == 1
    err = capsys.readouterr().err
    assert "the container exited: signal 11 (SIGSEGV) while scoring a decision" in err
    assert ("logs", "--tail", "200", "c0ffee") in fake.calls
