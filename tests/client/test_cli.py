"""The `semif` CLI against a real local server (tiny model), including every command that
docs/client.md shows, and the installed console script."""

from __future__ import annotations

import io
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from adapter.app import create_app
from adapter.settings import Settings
from client.cli import main
from tests.support.live_server import live_server
from tests.support.scripted_endpoint import Answer, aws_error, busy, model_error, scripted_server
from tests.support.serving import REPO

DOC = REPO / "docs" / "client.md"
DOC_URL = "http://127.0.0.1:8080"
EXAMPLES = REPO / "client" / "examples"


@pytest.fixture(scope="module")
def url(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = tmp_path_factory.mktemp("cli-model")
    shutil.copy(tiny_gguf, model_dir / tiny_gguf.name)
    app = create_app(Settings(model_dir=model_dir, max_tokens=1024, threads=1))
    with live_server(app) as base:
        yield base


@pytest.fixture(autouse=True)
def dummy_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    """SageMaker commands run through --endpoint-url on loopback; boto3 still signs."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def run(
    capsys: pytest.CaptureFixture[str], *argv: str, stdin: str | None = None
) -> tuple[int, str, str]:
    if stdin is not None:
        sys.stdin = io.StringIO(stdin)
    try:
        code = main(list(argv))
    finally:
        sys.stdin = sys.__stdin__
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_decide_prints_a_table(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "decide", str(EXAMPLES / "decision.json"), "--url", url)
    assert code == 0
    (line,) = out.splitlines()
    found = re.match(
        r"^  support-route\s+-> (\w+)\s+\[(\w+)=0\.\d{3}  .*\(letter mass 0\.\d\d\)$", line
    )
    assert found is not None, line
    assert found.group(1) == found.group(2)  # the choice is the most probable option
    assert {"account_access=", "billing=", "sales="} <= set(re.findall(r"\w+=", line))


def test_shared_decisions_as_json(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    file = str(EXAMPLES / "shared-decisions.json")
    code, out, _ = run(capsys, "decide", file, "--url", url, "--json")
    assert code == 0
    assert [result["id"] for result in json.loads(out)["results"]] == [
        "queue",
        "priority",
        "refund",
    ]


def test_systemone_table(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "systemone", str(EXAMPLES / "systemone.json"), "--url", url)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["question", "type", "answer", "confidence", "probabilities"]
    assert lines[1].split()[:2] == ["refund", "noul"]
    assert lines[2].split()[:2] == ["queue", "choice"]
    assert re.match(r"^urgency\s+score\s+\d\.\d\d of 0\.\.2\s+\d\.\d{3}\s+", lines[3])
    assert lines[4].startswith("model tiny.gguf, ")


def test_errors_exit_1_with_the_endpoint_message(
    url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"decision": {"id": "x"}}))
    code, out, err = run(capsys, "decide", str(bad), "--url", url)
    assert (code, out) == (1, "")
    assert err.strip() == "semif: HTTP 400: decision.state: is required"


def test_request_file_problems_exit_2(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "decide", "-", "--url", url, stdin="{not json")
    assert code == 2
    assert "semif: - is not valid JSON" in err
    systemone = str(EXAMPLES / "systemone.json")
    code, _, err = run(capsys, "decide", systemone, "--url", url)
    assert code == 2
    assert 'must be a JSON object with "decision" or "decisions"' in err
    code, _, err = run(capsys, "decide", "/nonexistent.json", "--url", url)
    assert (code, "cannot read /nonexistent.json" in err) == (2, True)


def test_a_target_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["decide", str(EXAMPLES / "decision.json")])
    assert raised.value.code == 2
    assert "one of the arguments --url --endpoint-name is required" in capsys.readouterr().err


def documented_commands() -> list[str]:
    """Every `semif ...` line in docs/client.md's sh blocks."""
    blocks = re.findall(r"```sh\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.startswith("semif ")]


def test_the_docs_show_every_command() -> None:
    commands = {line.split()[1] for line in documented_commands()}
    assert commands == {"decide", "systemone", "chat", "wait", "check", "batch", "shadow-report"}


@pytest.mark.parametrize("line", documented_commands())
def test_documented_command_runs(
    url: str, capsys: pytest.CaptureFixture[str], line: str, tmp_path: Path
) -> None:
    if line.startswith(("semif wait --endpoint-name", "semif check --endpoint-name")):
        pytest.skip("DescribeEndpoint needs AWS; covered with botocore's Stubber in test_client")
    if line.startswith(("semif batch submit", "semif batch async")):
        pytest.skip("S3 and SageMaker jobs need AWS; covered with moto in test_batch_aws")
    if line.startswith("semif shadow-report"):
        pytest.skip("needs two servers' records: run by test_shadow_report on real servers")
    command, _, stdin_file = line.partition(" < ")
    argv = shlex.split(command)[1:]
    argv = [url if arg == DOC_URL else arg for arg in argv]
    if "--out" in argv:  # answers go to the test's folder, not the repository
        where = argv.index("--out") + 1
        argv[where] = str(tmp_path / argv[where])
    if "--endpoint-name" in argv:
        argv += ["--endpoint-url", url]
    stdin = (REPO / stdin_file).read_text() if stdin_file else None
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(REPO)
        code, out, err = run(capsys, *argv, stdin=stdin)
    assert code == 0, err
    assert out.strip()
    if "--json" in argv:
        json.loads(out)


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).with_name("semif")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    assert "{decide,systemone,chat,wait,check,batch,shadow-report}" in result.stdout


def test_check_passes_on_a_serving_endpoint(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "check", "--url", url, "--wait-timeout", "30")
    assert code == 0, err
    assert out.startswith(f"ok: {url}") or out.startswith("ok: ")
    assert "decision yes=" in out
    code, out, err = run(capsys, "check", "--url", url, "--probe", "chat", "--wait-timeout", "30")
    assert code == 0, err
    assert "chat reply" in out


@pytest.mark.parametrize(
    "answer",
    [
        {"result": {"option_ids": ["no", "yes"], "probabilities": [0.5, 0.5]}},
        {"result": {"option_ids": ["yes", "no"], "probabilities": [0.9, 0.9]}},
        {"error": "x"},
    ],
)
def test_check_rejects_a_wrong_answer(answer: dict[str, object]) -> None:
    from client.cli import check_decision_answer
    from client.decision_client import EndpointError

    with pytest.raises(EndpointError):
        check_decision_answer(answer)


def test_check_sends_what_the_deploy_check_sends() -> None:
    from cdk_constructs.endpoint_check import Probe
    from client.cli import check_body
    from stacks.endpoint_stacks import check_body as deploy_check_body

    for probe in Probe:
        assert check_body(probe.value) == deploy_check_body(probe)


def test_busy_retries_follow_the_options_and_botocore_adds_none(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--max-attempts 1 is one request: the CLI's boto3 client does not retry on its own
    (a default boto3 client sends a throttled call three times)."""
    with scripted_server(aws_error(400, "ThrottlingException", "Rate exceeded")) as server:
        sagemaker = ["--endpoint-name", "semif", "--region", "us-east-1"]
        argv = ["decide", "-", *sagemaker, "--endpoint-url", server.url, "--max-attempts", "1"]
        code, out, err = run(capsys, *argv, stdin='{"decision": {}}')
    assert (code, out, len(server.paths)) == (1, "", 1)
    assert re.fullmatch(
        r"semif: HTTP 400: gave up after 1 attempt over \d+\.\d s \(the attempt limit is 1\); "
        r"last answer: ThrottlingException: Rate exceeded\n",
        err,
    )


def test_an_overload_429_through_sagemaker_is_retried_with_its_place(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The adapter's load refusal (429, retryable, a retry token) reaches `semif` as a
    ModelError; the CLI waits the body's hint and sends the token back."""
    refusal = busy(429, retry_after_seconds=0, retry_token="place-3")
    answer = {"result": {"id": "x", "option_ids": [], "probabilities": []}}
    with scripted_server(model_error(refusal), Answer(200, answer)) as server:
        sagemaker = ["--endpoint-name", "semif", "--region", "us-east-1"]
        argv = ["decide", "-", *sagemaker, "--endpoint-url", server.url, "--json"]
        code, out, err = run(capsys, *argv, stdin='{"decision": {}}')
    assert (code, json.loads(out)) == (0, answer), err
    assert server.attributes == [None, "semif-retry-token=place-3"]


def test_the_retry_budget_option(capsys: pytest.CaptureFixture[str]) -> None:
    with scripted_server(busy(retry_after="1")) as server:
        argv = ["decide", "-", "--url", server.url, "--max-retry-s", "0"]
        code, _, err = run(capsys, *argv, stdin='{"decision": {}}')
    assert (code, len(server.paths)) == (1, 1)
    assert err.endswith("(the 0 s retry budget is spent); last answer: queue full\n")
    with pytest.raises(SystemExit):
        main(["decide", "-", "--url", "http://x", "--max-retry-s", "-1"])
    assert "-1 is not a number of seconds >= 0" in capsys.readouterr().err
