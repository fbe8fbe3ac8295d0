"""Smoke-test a built adapter image before it is pushed (run by images/buildspec.yml).

Checks that the image's entry point is the adapter's `serve` by absolute path (the base
image has its own `/usr/bin/serve`) and that a required file is in the image (the CUDA
backend library of a CUDA image), then starts the image the way SageMaker does
(`docker run IMAGE serve`, model mounted at /opt/ml/model), waits for `/ping`, checks the
reported ggml backends, scores one decision and one shared-state pair (the path that needs
the binding's KV-cache sequence API to match the DLC's libllama), checks the answers, and
checks that `/metrics` (which SageMaker scrapes) counts the two calls. `/ping` also says
which CPU backend library and weight buffers the model loaded into; `--weights-in` makes one
of those buffers required (on an AMX host with a Q4_0 or Q4_K model: CPU_REPACK).
Build hosts have no GPU: both flavors are served with the CPU backend here (a CUDA image
with `--env SEMIF_N_GPU_LAYERS=0`), which still runs the image's own libllama.
stdlib only: it runs on the CodeBuild host, not in the image. Exit status 0 means the
image may be pushed.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONTAINER_PORT = "8080/tcp"
ENTRYPOINT = ["/opt/semif/bin/serve"]
DECISION: dict[str, Any] = {
    "decision": {
        "id": "smoke",
        "state": "The customer cannot sign in after resetting the password.",
        "question": "Which queue should handle this request?",
        "options": [
            {"id": "account-access", "description": "Account access support."},
            {"id": "billing", "description": "Billing support."},
        ],
    }
}

SHARED: dict[str, Any] = {
    "decisions": [
        {**DECISION["decision"], "id": "smoke-queue"},
        {
            **DECISION["decision"],
            "id": "smoke-urgent",
            "question": "Is this urgent?",
            "options": [
                {"id": "yes", "description": "Yes."},
                {"id": "no", "description": "No."},
            ],
        },
    ]
}


class SmokeError(RuntimeError):
    """The image did not behave like a serving decision endpoint."""


def docker(*args: str) -> str:
    result = subprocess.run(["docker", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SmokeError(f"docker {args[0]} failed: {result.stderr.strip()}")
    return result.stdout.strip()


def check_entrypoint(image: str) -> list[str]:
    entrypoint = json.loads(
        docker("image", "inspect", "--format", "{{json .Config.Entrypoint}}", image)
    )
    if entrypoint != ENTRYPOINT:
        raise SmokeError(f"entry point is {entrypoint}, not {ENTRYPOINT}")
    return list(entrypoint)


def check_file(image: str, pattern: str) -> str:
    """The first file inside `image` matching the glob `pattern` (run without the entry point)."""
    found = docker(
        "run",
        "--rm",
        "--entrypoint",
        "python3",
        image,
        "-c",
        "import glob, sys; hits = sorted(glob.glob(sys.argv[1])); print(hits[0] if hits else '')",
        pattern,
    )
    if not found:
        raise SmokeError(f"no file in the image matches {pattern}")
    return found


def parse_env(text: str) -> list[str]:
    """`KEY=VALUE KEY2=VALUE2` (space-separated) as `docker run --env` values."""
    pairs = text.split()
    for pair in pairs:
        if "=" not in pair or not pair.split("=", 1)[0]:
            raise SmokeError(f"--env {pair!r} is not KEY=VALUE")
    return pairs


def start(image: str, model_dir: Path, env: Sequence[str] = ()) -> str:
    """Run detached with the model read-only, port 8080 published on loopback only."""
    args = ["run", "--detach", "--publish", f"127.0.0.1::{CONTAINER_PORT.split('/')[0]}"]
    args += ["--volume", f"{model_dir.resolve()}:/opt/ml/model:ro"]
    # The smoke model is a generated GGUF with no manifest; in /opt/ml/model the adapter
    # refuses such a model unless told it is deliberate.
    args += ["--env", "SEMIF_ALLOW_UNVERIFIED_MODEL=true"]
    for pair in env:
        args += ["--env", pair]
    return docker(*args, image, "serve")


def base_url(container: str) -> str:
    mapping = docker("port", container, CONTAINER_PORT).splitlines()[0]
    return f"http://{mapping.strip()}"


def request(url: str, body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(  # noqa: S310 - loopback http URL built above
        url, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as response:  # noqa: S310
            return int(response.status), json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return int(error.code), {"error": error.read().decode(errors="replace")[:500]}


def how_it_ended(status: int, oom_killed: bool) -> str:
    """A container's end in words: docker reports a process killed by signal N as 128 + N."""
    if oom_killed:
        return "was killed for memory (OOMKilled)"
    if status > 128:
        number = status - 128
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = "unknown signal"
        return f"exited: signal {number} ({name})"
    return f"exited with status {status}"


def ended(container: str) -> str | None:
    """None while the container runs; how it ended once it has."""
    state = docker(
        "inspect",
        "--format",
        "{{.State.Running}} {{.State.ExitCode}} {{.State.OOMKilled}}",
        container,
    ).split()
    if state[0] == "true":
        return None
    return how_it_ended(int(state[1]), state[2] == "true")


def wait_for_ping(url: str, container: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        end = ended(container)
        if end is not None:
            raise SmokeError(f"the container {end} before /ping answered 200")
        try:
            status, body = request(f"{url}/ping")
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            status, body = 0, {}
        if status == 200:
            return body
        time.sleep(2)
    raise SmokeError(f"/ping did not answer 200 within {timeout_s:.0f} s")


def check_backends(ping: dict[str, Any], expected: str) -> list[str]:
    backends = [str(name) for name in ping.get("backends") or []]
    if expected not in backends:
        raise SmokeError(f"/ping reports backends {backends}; expected {expected!r} among them")
    return backends


def check_weights(ping: dict[str, Any], required: str) -> Any:
    """What /ping says about the weights' buffers (the CPU backend library, the buffer types
    offered, refused and used), and, where a buffer type is `required`, that the weights
    landed in it."""
    weights = (ping.get("serving") or {}).get("weight_buffers")
    landed = weights.get("weights_in", []) if isinstance(weights, dict) else []
    if required and required not in landed:
        raise SmokeError(f"the weights are not in {required} buffers: {str(weights)[:300]}")
    return weights


def check_decision(answer: dict[str, Any]) -> list[float]:
    result = answer.get("result")
    if not isinstance(result, dict):
        raise SmokeError(f"/invocations returned no 'result': {str(answer)[:300]}")
    expected_ids = [option["id"] for option in DECISION["decision"]["options"]]
    if result.get("id") != "smoke" or result.get("option_ids") != expected_ids:
        raise SmokeError(f"result ids do not match the request: {str(result)[:300]}")
    probabilities = [float(p) for p in result.get("probabilities", [])]
    if len(probabilities) != len(expected_ids) or not math.isclose(
        sum(probabilities), 1.0, abs_tol=1e-3
    ):
        raise SmokeError(f"probabilities {probabilities} are not a distribution over the options")
    return probabilities


def check_shared(answer: dict[str, Any]) -> list[str]:
    """Both branches answered, in order, after one shared prefix was evaluated."""
    results = answer.get("results")
    if not isinstance(results, list) or [r.get("id") for r in results] != [
        "smoke-queue",
        "smoke-urgent",
    ]:
        raise SmokeError(f"shared request returned wrong results: {str(answer)[:300]}")
    timing = answer.get("timing", {})
    if timing.get("passes") != 1 or not timing.get("evaluated_tokens", 0) < timing.get(
        "input_tokens", 0
    ):
        raise SmokeError(f"shared request did not share its prefix: {str(answer)[:300]}")
    for result in results:
        total = sum(float(p) for p in result.get("probabilities", []))
        if not math.isclose(total, 1.0, abs_tol=1e-3):
            raise SmokeError(f"shared result {result.get('id')} sums to {total}")
    return [str(result["id"]) for result in results]


# The Prometheus sample that counts answered decision calls (adapter/metrics.py).
_DECISIONS_ANSWERED = re.compile(
    r'^semif_requests_total\{api="decision",status="200"\} ([0-9.e+]+)$', re.MULTILINE
)


def check_metrics(text: str, calls: int) -> float:
    """The /metrics exposition counts at least `calls` answered decision calls."""
    match = _DECISIONS_ANSWERED.search(text)
    if match is None or float(match.group(1)) < calls:
        found = match.group(0) if match else "no semif_requests_total sample for them"
        raise SmokeError(f"/metrics does not count the {calls} decision calls: {found}")
    return float(match.group(1))


# A JSON Lines body (adapter/lines.py): both smoke requests and a line that is not JSON.
BAD_LINE = "{not json"


def lines_body() -> bytes:
    return "\n".join([json.dumps(DECISION), json.dumps(SHARED), BAD_LINE, ""]).encode()


def check_lines(text: str) -> list[int]:
    """One answer per line, in order: the two requests answered, the bad line a 400."""
    try:
        answers = [json.loads(line) for line in text.splitlines()]
    except ValueError:
        raise SmokeError(f"JSON Lines answer is not JSON Lines: {text[:300]}") from None
    if [answer.get("line") for answer in answers] != [0, 1, 2]:
        raise SmokeError(f"JSON Lines answer has the wrong lines: {text[:300]}")
    check_decision(answers[0])
    check_shared(answers[1])
    if answers[2].get("status") != 400:
        raise SmokeError(f"the bad line was not answered 400: {str(answers[2])[:300]}")
    return [int(answer.get("status", 200)) for answer in answers]


def check_execution_parameters(answer: dict[str, Any]) -> dict[str, Any]:
    """What SageMaker batch transform reads before a job (adapter/lines.py)."""
    if answer.get("BatchStrategy") != "MULTI_RECORD" or not answer.get("MaxPayloadInMB"):
        raise SmokeError(f"/execution-parameters answered {str(answer)[:300]}")
    return answer


def post_lines(url: str) -> str:
    req = urllib.request.Request(  # noqa: S310 - loopback http URL built above
        f"{url}/invocations", data=lines_body(), headers={"Content-Type": "application/jsonlines"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as response:  # noqa: S310
            return str(response.read().decode())
    except (urllib.error.URLError, OSError) as error:
        raise SmokeError(f"JSON Lines /invocations failed: {error}") from None


def scrape(url: str) -> str:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:  # noqa: S310
            return str(response.read().decode())
    except (urllib.error.URLError, OSError) as error:
        raise SmokeError(f"/metrics failed: {error}") from None


def invoke(url: str, container: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST /invocations; a connection lost because the server died says how it died."""
    try:
        return request(f"{url}/invocations", body)
    except (urllib.error.URLError, ConnectionError) as error:
        end = ended(container)
        if end is not None:
            raise SmokeError(f"the container {end} while scoring a decision") from None
        raise SmokeError(f"/invocations failed: {error}") from None


def smoke(
    image: str,
    model_dir: Path,
    backend: str,
    timeout_s: float,
    env: Sequence[str] = (),
    require_file: str = "",
    weights_in: str = "",
) -> None:
    check_entrypoint(image)
    library = check_file(image, require_file) if require_file else None
    container = start(image, model_dir, env)
    try:
        url = base_url(container)
        ping = wait_for_ping(url, container, timeout_s)
        backends = check_backends(ping, backend)
        weights = check_weights(ping, weights_in)
        status, answer = invoke(url, container, DECISION)
        if status != 200:
            raise SmokeError(f"/invocations answered {status}: {str(answer)[:300]}")
        probabilities = check_decision(answer)
        status, shared = invoke(url, container, SHARED)
        if status != 200:
            raise SmokeError(f"shared /invocations answered {status}: {str(shared)[:300]}")
        check_shared(shared)
        counted = check_metrics(scrape(url), calls=2)
        line_statuses = check_lines(post_lines(url))
        status, parameters = request(f"{url}/execution-parameters")
        if status != 200:
            raise SmokeError(f"/execution-parameters answered {status}: {str(parameters)[:300]}")
        check_execution_parameters(parameters)
        report = {
            "smoke": "passed",
            "backends": backends,
            "weight_buffers": weights,
            "probabilities": probabilities,
            "decision_calls_counted": counted,
            "json_lines_statuses": line_statuses,
        }
        print(json.dumps({**report, "required_file": library}))
    except SmokeError:
        print(docker("logs", "--tail", "200", container), file=sys.stderr)
        raise
    finally:
        subprocess.run(["docker", "rm", "--force", container], capture_output=True, check=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", required=True)
    parser.add_argument("--model-dir", type=Path, required=True, help="holds one tiny .gguf")
    parser.add_argument("--backend", required=True, help="ggml backend /ping must report")
    parser.add_argument("--env", default="", help="KEY=VALUE ... passed to the container")
    parser.add_argument("--require-file", default="", help="a glob that must match in the image")
    parser.add_argument(
        "--weights-in", default="", help="a buffer type the weights must load into (CPU_REPACK)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for /ping")
    args = parser.parse_args(argv)
    try:
        smoke(
            args.image,
            args.model_dir,
            args.backend,
            args.timeout,
            env=parse_env(args.env),
            require_file=args.require_file,
            weights_in=args.weights_in,
        )
    except SmokeError as error:
        print(f"image smoke test failed: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
