"""`semif`: ask a decision endpoint from the command line.

    semif decide client/examples/decision.json --url http://127.0.0.1:8080 [--stream]
    semif systemone client/examples/systemone.json --endpoint-name NAME --region REGION
    semif chat "Say hello in French." --url http://127.0.0.1:8080 [--stream]
    semif wait --endpoint-name NAME --region REGION
    semif check --endpoint-name NAME --region REGION [--probe decision|chat]
    semif batch local tickets.jsonl --url http://127.0.0.1:8080 --out answers.jsonl
    semif batch submit --model-name M --input s3://B/batch/input/ --output s3://B/batch/output/
        --kms-key-id KEY
    semif batch async tickets.jsonl --endpoint-name NAME --input-prefix s3://B/async/input/
        --out answers.jsonl
    semif shadow-report --primary RECORDS --candidate RECORDS --gate 0.8 --out DIR
    semif shadow-report --requests bodies.jsonl --primary-url URL --candidate-url URL

Requests come from a JSON file or stdin (`-`); answers print as a table, or as the raw
JSON with `--json`. Exit codes: 0 answered, 1 the endpoint refused or failed, 2 usage
(`shadow-report`: 1 when the candidate crosses a threshold).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from client.async_endpoint import run_async
from client.audit_records import AuditRecordsError, read_lines
from client.aws import aws_client
from client.batch_aws import TransformJob, cost, submit
from client.batch_local import run_local
from client.decision_client import (
    ChoiceAnswer,
    DecisionClient,
    DecisionResult,
    EndpointError,
    MultiAnswer,
    NoulAnswer,
    RetryPolicy,
    ScoreAnswer,
    SystemOneAnswers,
    WakeUp,
    check_prefix_aware_id,
)
from client.errors import BatchInputError
from client.series_check import SERIES, series_warning
from client.shadow_report import (
    Pairing,
    ShadowInputError,
    Thresholds,
    breaches,
    compare,
    format_report,
    live_pairing,
    pair_readings,
    read_requests,
    readings,
    split_variants,
    write_report,
)

TOP_PROBABILITIES = 5

# The post-deploy check's requests, shared with the deploy's own check: the stacks pass the
# same files to cdk_constructs/endpoint_probe/handler.py as its request body.
CHECK_BODIES = {"decision": "check-decision.json", "chat": "check-chat.json"}


def check_body(kind: str) -> dict[str, Any]:
    """The request `semif check --probe KIND` (and the deploy's check) sends."""
    text = resources.files("client.examples").joinpath(CHECK_BODIES[kind]).read_text()
    body: dict[str, Any] = json.loads(text)
    return body


class UsageError(Exception):
    """The command line or the request file is wrong (exit code 2)."""


def format_decision(result: DecisionResult) -> str:
    """One line per decision: the choice, then every option by falling probability."""
    ranked = sorted(
        zip(result.option_ids, result.probabilities, strict=True), key=lambda pair: -pair[1]
    )
    cells = "  ".join(f"{option}={probability:.3f}" for option, probability in ranked)
    mass = result.allowed_token_mass
    answer = result.choice if result.applies is None else "{" + ", ".join(result.applies) + "}"
    line = f"  {result.id:<14} -> {answer:<15} [{cells}]  (letter mass {mass:.2f})"
    if result.none_probability is not None:
        line += f"  none={result.none_probability:.3f}"
    if result.prediction_set is not None:
        line += f"  set at {result.coverage:g}: {{{', '.join(result.prediction_set)}}}"
    return line


def _cells(probabilities: dict[str, float]) -> str:
    ranked = sorted(probabilities.items(), key=lambda pair: -pair[1])
    shown = "  ".join(f"{key}={p:.3f}" for key, p in ranked[:TOP_PROBABILITIES])
    hidden = len(ranked) - TOP_PROBABILITIES
    return shown + (f"  (+{hidden} more)" if hidden > 0 else "")


def format_systemone(answers: SystemOneAnswers) -> str:
    """A table: question, type, answer, confidence, the most probable options."""
    lines = [f"{'question':<16} {'type':<7} {'answer':<16} {'confidence':<11} probabilities"]
    for key, answer in answers.answers.items():
        if isinstance(answer, NoulAnswer):
            row = ("noul", f"yes={answer.yes:.3f}", "", "")
        elif isinstance(answer, ChoiceAnswer):
            row = (
                "choice",
                answer.choice,
                f"{answer.confidence:.3f}",
                _cells(answer.probabilities),
            )
        elif isinstance(answer, MultiAnswer):
            row = (
                "multi",
                "{" + ", ".join(answer.applies) + "}",
                f"{answer.confidence:.3f}",
                _cells(answer.probabilities),
            )
        else:
            assert isinstance(answer, ScoreAnswer)
            top = len(answer.legend) - 1
            value = f"{answer.score:.2f} of 0..{top}"
            row = ("score", value, f"{answer.confidence:.3f}", _cells(answer.probabilities))
        kind, value, confidence, cells = row
        lines.append(f"{key:<16} {kind:<7} {value:<16} {confidence:<11} {cells}".rstrip())
    lines.append(f"model {answers.model}, {answers.input_tokens} input tokens")
    return "\n".join(lines)


def _read_request(source: str, required: tuple[str, ...]) -> dict[str, Any]:
    """Read a request body from a file or `-` (stdin) and check it is the expected API."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
        body = json.loads(text)
    except OSError as error:
        raise UsageError(f"cannot read {source}: {error.strerror or error}") from None
    except ValueError as error:
        raise UsageError(f"{source} is not valid JSON: {error}") from None
    if not isinstance(body, dict) or not any(key in body for key in required):
        wanted = " or ".join(f'"{key}"' for key in required)
        raise UsageError(f"{source} must be a JSON object with {wanted}")
    return body


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _seconds(text: str) -> float:
    """A duration >= 0: RetryPolicy refuses a negative one, and argparse should say so."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds >= 0")
    return value


def _prefix_aware_id(text: str) -> str:
    try:
        check_prefix_aware_id(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _client(args: argparse.Namespace) -> DecisionClient:
    retry = RetryPolicy(max_attempts=args.max_attempts, max_total_s=args.max_retry_s)
    if args.url:
        api_key = os.environ.get("SEMIF_API_KEY") or None
        return DecisionClient.for_url(
            args.url,
            retry=retry,
            timeout_s=args.timeout,
            api_key=api_key,
            prefix_aware_id=args.prefix_aware_id,
        )
    return DecisionClient.for_endpoint(
        args.endpoint_name,
        region=args.region,
        endpoint_url=args.endpoint_url,
        retry=retry,
        prefix_aware_id=args.prefix_aware_id,
        inference_component=args.inference_component,
        wake_up=WakeUp(args.wake_up_s) if args.wake_up_s > 0 else None,
        on_wait=_waking(args.inference_component or args.endpoint_name),
    )


def _waking(name: str) -> Callable[[float], None]:
    """The waiting line while an endpoint that scaled to zero starts a copy."""

    def waiting(seconds: float) -> None:
        print(
            f"{name} scaled to zero: waiting for a copy to start ({seconds:.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    return waiting


def _emit(args: argparse.Namespace, answer: Any, table: Callable[[Any], str]) -> None:
    print(json.dumps(answer, indent=2, ensure_ascii=False) if args.json else table(answer))


def _decide(args: argparse.Namespace) -> None:
    body = _read_request(args.file, ("decision", "decisions"))
    if args.stream:
        _stream_decide(args, body)
        return
    answer = _client(args).invoke(body)

    def table(answer: dict[str, Any]) -> str:
        results = [answer["result"]] if "result" in answer else answer["results"]
        return "\n".join(format_decision(DecisionResult.from_json(r)) for r in results)

    _emit(args, answer, table)


def _stream_decide(args: argparse.Namespace, body: dict[str, Any]) -> None:
    """Each decision printed as it arrives (a table row, or with --json its line as the
    endpoint sent it), then with --json the closing line."""
    reading = {key: value for key, value in body.items() if key not in ("decision", "decisions")}
    asked = body["decision"] if "decision" in body else body["decisions"]
    with _client(args).stream_decide(asked, **reading) as stream:
        for item in stream:
            if args.json:
                line = {"index": item.index, "result": item.result.raw}
                print(json.dumps(line, ensure_ascii=False), flush=True)
            else:
                print(format_decision(item.result), flush=True)
        if args.json and stream.summary is not None:
            print(json.dumps(stream.summary.raw, ensure_ascii=False), flush=True)


def _systemone(args: argparse.Namespace) -> None:
    body = _read_request(args.file, ("questions",))
    answer = _client(args).invoke(body)
    _emit(args, answer, lambda raw: format_systemone(SystemOneAnswers.from_json(raw)))


def _chat(args: argparse.Namespace) -> None:
    if (args.message is None) == (args.file is None):
        raise UsageError("chat needs a MESSAGE or --file FILE (one of them)")
    if args.file is not None:
        body = _read_request(args.file, ("messages",))
    else:
        messages = [{"role": "user", "content": args.message}]
        if args.system:
            messages.insert(0, {"role": "system", "content": args.system})
        body = {"messages": messages, "temperature": args.temperature}
        if args.max_tokens is not None:
            body["max_tokens"] = args.max_tokens
    if args.stream:
        if args.json:
            raise UsageError("chat --stream prints the text as it comes; --json the whole answer")
        with _client(args).stream_chat_body(body) as stream:
            for text in stream:
                print(text, end="", flush=True)
        print(flush=True)
        return
    answer = _client(args).invoke(body)
    _emit(args, answer, lambda raw: str(raw["choices"][0]["message"]["content"]))


def _progress() -> Callable[[str], None]:
    shown: list[str] = []

    def progress(line: str) -> None:
        if not shown or shown[-1] != line:  # a URL is polled often; print changes only
            shown.append(line)
            print(line, file=sys.stderr, flush=True)

    return progress


def _wait(args: argparse.Namespace) -> None:
    client = _client(args)
    client.wait_until_ready(args.wait_timeout, _progress())
    print(f"ready: {client.transport.describe()}")


def check_decision_answer(answer: Any) -> str:
    """The summary of a valid answer to the check decision; EndpointError for anything else."""
    result = answer.get("result") if isinstance(answer, dict) else None
    expected = [option["id"] for option in check_body("decision")["decision"]["options"]]
    if not isinstance(result, dict) or result.get("option_ids") != expected:
        raise EndpointError(0, f"the check decision got a wrong answer: {str(answer)[:300]}")
    probabilities = [float(p) for p in result.get("probabilities", [])]
    if len(probabilities) != len(expected) or not math.isclose(
        sum(probabilities), 1.0, abs_tol=1e-3
    ):
        raise EndpointError(0, f"probabilities {probabilities} are not a distribution")
    return "decision " + ", ".join(
        f"{option}={p:.3f}" for option, p in zip(expected, probabilities, strict=True)
    )


def check_chat_answer(answer: Any) -> str:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    first = choices[0] if isinstance(choices, list) and choices else None
    message = first.get("message") if isinstance(first, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if not isinstance(content, str):
        raise EndpointError(0, f"the check chat got no message: {str(answer)[:300]}")
    return f"chat reply {content.strip()[:40]!r}"


CHECKS: dict[str, Callable[[Any], str]] = {
    "decision": check_decision_answer,
    "chat": check_chat_answer,
}


def _check(args: argparse.Namespace) -> None:
    """Wait until the endpoint serves, then one real request that must answer right; on a
    SageMaker decision endpoint, then warn if its container series do not reach CloudWatch
    (client.series_check: its PromQL alarms would watch nothing), without failing."""
    client = _client(args)
    client.wait_until_ready(args.wait_timeout, _progress())
    first_call_at = time.time()
    summary = CHECKS[args.probe](client.invoke(check_body(args.probe)))
    print(f"ok: {client.transport.describe()} answered {summary}")
    # A URL, or an endpoint_url elsewhere, publishes nothing to this account's CloudWatch.
    on_sagemaker = args.endpoint_name and not args.endpoint_url
    if args.probe != "decision" or not on_sagemaker or args.series_wait_s <= 0:
        return
    import boto3

    print(
        f"waiting up to {args.series_wait_s:.0f} s for {SERIES[0]} in CloudWatch",
        file=sys.stderr,
        flush=True,
    )
    session = boto3.session.Session(region_name=args.region)
    warning = series_warning(session, args.endpoint_name, first_call_at, args.series_wait_s)
    if warning is None:
        print(f"ok: {args.endpoint_name}'s {SERIES[0]} series are in CloudWatch")
    else:
        print(f"semif: warning: {warning}", file=sys.stderr)


def _batch_local(args: argparse.Namespace) -> None:
    """A JSON Lines file through a running endpoint, resumably (client.batch_local)."""
    try:
        summary = run_local(
            _client(args),
            Path(args.file),
            Path(args.out),
            max_lines=args.max_lines,
            in_flight=args.in_flight,
            progress=_progress(),
        )
    except BatchInputError as error:
        raise UsageError(str(error)) from None
    print(f"{args.out}: {summary.describe()}")


def _batch_submit(args: argparse.Namespace) -> None:
    """A batch transform job on the deployed decision model (client.batch_aws)."""
    try:
        job = TransformJob(
            model_name=args.model_name,
            input_uri=args.input,
            output_uri=args.output,
            kms_key_id=args.kms_key_id,
            instances=args.instances,
            instance_type=args.instance_type,
            job_name=args.job_name or "",
        )
        name, summary = submit(
            aws_client("sagemaker", args.region),
            aws_client("s3", args.region),
            job,
            poll_s=args.poll_s,
            progress=_progress(),
        )
    except BatchInputError as error:
        raise UsageError(str(error)) from None
    line = f"{name}: {summary.describe()}"
    if args.price_per_hour is not None:
        spent = cost(summary.seconds, args.instances, args.price_per_hour)
        line += f"; about ${spent:.2f} at ${args.price_per_hour:g}/h x {args.instances}"
    print(line)


def _batch_async(args: argparse.Namespace) -> None:
    """A JSON Lines file through the asynchronous endpoint (client.async_endpoint)."""
    try:
        summary = run_async(
            aws_client("sagemaker-runtime", args.region),
            aws_client("s3", args.region),
            endpoint_name=args.endpoint_name,
            source=Path(args.file),
            input_prefix=args.input_prefix,
            out=Path(args.out),
            timeout_s=args.wait_timeout,
            progress=_progress(),
        )
    except BatchInputError as error:
        raise UsageError(str(error)) from None
    print(f"{args.out}: {summary.describe()}")


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a number from 0 to 1")
    return value


def _shadow_pairing(args: argparse.Namespace) -> Pairing:
    """The two sides paired from whichever source the command line names (one of three)."""
    records = (args.primary, args.candidate)
    mixed = (args.records, args.primary_variant, args.candidate_variant)
    live = (args.requests, args.primary_url, args.candidate_url)
    named = [group for group in (records, mixed, live) if any(group)]
    if len(named) != 1 or not all(named[0]):
        raise UsageError(
            "shadow-report compares one source: --primary RECORDS --candidate RECORDS, or "
            "--records RECORDS --primary-variant NAME --candidate-variant NAME, or "
            "--requests FILE --primary-url URL --candidate-url URL"
        )
    if args.primary:
        return pair_readings(
            readings(read_lines(args.primary, args.region), args.primary),
            readings(read_lines(args.candidate, args.region), args.candidate),
        )
    if args.records:
        both = readings(read_lines(args.records, args.region), args.records)
        primary, candidate, neither = split_variants(
            both, args.primary_variant, args.candidate_variant
        )
        return replace(pair_readings(primary, candidate), unassigned=neither)
    bodies = read_requests(read_lines(args.requests, args.region), args.requests)
    retry = RetryPolicy(max_attempts=args.max_attempts, max_total_s=args.max_retry_s)
    api_key = os.environ.get("SEMIF_API_KEY") or None
    with (
        DecisionClient.for_url(
            args.primary_url, retry=retry, timeout_s=args.timeout, api_key=api_key
        ) as primary_client,
        DecisionClient.for_url(
            args.candidate_url, retry=retry, timeout_s=args.timeout, api_key=api_key
        ) as candidate_client,
    ):
        return live_pairing(bodies, primary_client.invoke, candidate_client.invoke)


def _shadow_report(args: argparse.Namespace) -> int:
    """Compare the candidate with the primary (client.shadow_report); 1 when it crosses a
    threshold, which the report names."""
    if args.max_gate_crossings is not None and args.gate is None:
        raise UsageError("--max-gate-crossings needs --gate")
    try:
        pairing = _shadow_pairing(args)
    except (AuditRecordsError, ShadowInputError) as error:
        raise UsageError(str(error)) from None
    report = compare(pairing, args.gate)
    thresholds = Thresholds(args.min_agreement, args.max_mean_tv, args.max_gate_crossings)
    found = breaches(report, thresholds)
    print(format_report(report))
    if args.out:
        for note in write_report(report, thresholds, found, Path(args.out), plot=not args.no_plot):
            print(note)
    for breach in found:
        print(f"semif: shadow report: {breach}", file=sys.stderr)
    return 1 if found else 0


def _retrying() -> argparse.ArgumentParser:
    """The retry and timeout options of every command that calls an endpoint."""
    retrying = argparse.ArgumentParser(add_help=False)
    retries = retrying.add_argument_group("retries")
    defaults = RetryPolicy()
    retries.add_argument(
        "--max-attempts",
        type=_positive_int,
        default=defaults.max_attempts,
        help="most tries while an endpoint is busy (503, 429; default %(default)s)",
    )
    retries.add_argument(
        "--max-retry-s",
        type=_seconds,
        default=defaults.max_total_s,
        help="no retry starts later than this after the first try (default %(default)s)",
    )
    retries.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="HTTP timeout for a URL, seconds (SageMaker calls: the runtime's 70 s)",
    )
    return retrying


def _parser() -> argparse.ArgumentParser:
    retrying = _retrying()
    target = argparse.ArgumentParser(add_help=False, parents=[retrying])
    where = target.add_argument_group("endpoint (one of)")
    choice = where.add_mutually_exclusive_group(required=True)
    choice.add_argument("--url", help="a local or self-hosted serve, e.g. http://127.0.0.1:8080")
    choice.add_argument("--endpoint-name", help="a SageMaker endpoint")
    where.add_argument("--region", help="AWS region of the endpoint (default: boto3's)")
    where.add_argument(
        "--endpoint-url", help="send SageMaker runtime calls here (e.g. a local serve)"
    )
    where.add_argument(
        "--inference-component",
        help="call the endpoint through this inference component (the stack's "
        "DecisionInferenceComponentName, on an endpoint that can scale to zero)",
    )
    where.add_argument(
        "--wake-up-s",
        type=_seconds,
        default=0.0,
        help="with --endpoint-name: wait up to this long for an endpoint that scaled to zero "
        "to start a copy (default 0: fail at once, saying so); a copy takes minutes",
    )
    where.add_argument(
        "--prefix-aware-id",
        type=_prefix_aware_id,
        help="a routing hint for an endpoint with prefix-aware routing (1-64 characters): "
        "requests with the same leading bytes and id go to the same instance",
    )
    behaviour = target.add_argument_group("behaviour")
    behaviour.add_argument("--json", action="store_true", help="print the raw JSON answer")

    parser = argparse.ArgumentParser(prog="semif", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    decide = commands.add_parser("decide", parents=[target], help="a decision or shared decisions")
    decide.add_argument("file", help='JSON file with "decision" or "decisions"; - for stdin')
    decide.add_argument(
        "--stream", action="store_true", help="print each decision as soon as it is scored"
    )
    decide.set_defaults(run=_decide)
    system_one = commands.add_parser("systemone", parents=[target], help="System One questions")
    system_one.add_argument("file", help="JSON file with state and questions; - for stdin")
    system_one.set_defaults(run=_systemone)
    chat = commands.add_parser("chat", parents=[target], help="one chat message")
    chat.add_argument("message", nargs="?", help="the user message")
    chat.add_argument("--file", help='or a chat request: JSON with "messages"; - for stdin')
    chat.add_argument("--system", help="a system message to send first")
    chat.add_argument("--max-tokens", type=_positive_int)
    chat.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    chat.add_argument("--stream", action="store_true", help="print the text as it is written")
    chat.set_defaults(run=_chat)
    wait = commands.add_parser("wait", parents=[target], help="wait until the endpoint serves")
    wait.add_argument("--wait-timeout", type=float, default=1800.0, help="seconds to wait")
    wait.set_defaults(run=_wait)
    check = commands.add_parser(
        "check", parents=[target], help="wait, then one request that must answer right"
    )
    check.add_argument(
        "--probe",
        choices=sorted(CHECKS),
        default="decision",
        help="decision (the decision endpoint, default) or chat (the standard endpoint)",
    )
    check.add_argument("--wait-timeout", type=float, default=1800.0, help="seconds to wait")
    check.add_argument(
        "--series-wait-s",
        type=_seconds,
        default=180.0,
        help="after the decision check, how long its container series may take to reach "
        "CloudWatch before a warning (default %(default)s; 0 skips)",
    )
    check.set_defaults(run=_check)
    batch = commands.add_parser("batch", help="offline batches of JSON Lines")
    batches = batch.add_subparsers(dest="batch_command", required=True)
    local = batches.add_parser(
        "local",
        parents=[target],
        help="score a JSON Lines file through a running endpoint (resumable)",
    )
    local.add_argument(
        "file", help="JSON Lines: one decision, decisions or System One body per line"
    )
    local.add_argument("--out", required=True, help="where the answers go, one line per input line")
    local.add_argument(
        "--max-lines",
        type=_positive_int,
        default=256,
        help="lines per request, whole states together (default %(default)s)",
    )
    local.add_argument(
        "--in-flight",
        type=_positive_int,
        default=2,
        help="requests sent at once (default %(default)s)",
    )
    local.set_defaults(run=_batch_local)
    aws = argparse.ArgumentParser(add_help=False)
    aws.add_argument("--region", help="AWS region (default: boto3's)")
    submit_job = batches.add_parser(
        "submit", parents=[aws], help="a batch transform job on the deployed decision model"
    )
    submit_job.add_argument("--model-name", required=True, help="the stack's DecisionModelName")
    submit_job.add_argument("--input", required=True, help="s3:// prefix of JSON Lines objects")
    submit_job.add_argument("--output", required=True, help="s3:// prefix for the answers")
    submit_job.add_argument("--kms-key-id", required=True, help="the environment's KMS key")
    submit_job.add_argument("--instances", type=_positive_int, default=1)
    submit_job.add_argument(
        "--instance-type",
        default="ml.c6i.2xlarge",
        help="a CPU type (default %(default)s); GPU types are refused: no transform AMI "
        "has a driver for the CUDA 13 image",
    )
    submit_job.add_argument(
        "--job-name", help="1-63 letters, digits, hyphens; default semif-batch-<UTC time>-<random>"
    )
    submit_job.add_argument(
        "--price-per-hour", type=_seconds, help="one instance's price, for a cost estimate"
    )
    submit_job.add_argument("--poll-s", type=_seconds, default=30.0, help=argparse.SUPPRESS)
    submit_job.set_defaults(run=_batch_submit)
    queued = batches.add_parser(
        "async", parents=[aws], help="a JSON Lines file through the asynchronous endpoint"
    )
    queued.add_argument("file", help="JSON Lines: one request body per line")
    queued.add_argument("--endpoint-name", required=True, help="the stack's AsyncEndpointName")
    queued.add_argument("--input-prefix", required=True, help="the stack's AsyncInputPrefix")
    queued.add_argument("--out", required=True, help="where the answers go")
    queued.add_argument(
        "--wait-timeout", type=float, default=3600.0, help="seconds to wait for the answer"
    )
    queued.set_defaults(run=_batch_async)
    shadow = commands.add_parser(
        "shadow-report",
        parents=[retrying],
        help="compare a candidate endpoint's answers with the primary's (records or live)",
    )
    sources = shadow.add_argument_group(
        "source (one of: --primary/--candidate, --records with the variants, --requests "
        "with the URLs); RECORDS: a file or s3://bucket/key of audit record lines"
    )
    sources.add_argument("--primary", help="the primary's audit records")
    sources.add_argument("--candidate", help="the candidate's audit records")
    sources.add_argument("--records", help="both sides' records, told apart by `variant`")
    sources.add_argument("--primary-variant", help="the primary's variant name in --records")
    sources.add_argument("--candidate-variant", help="the candidate's variant name in --records")
    sources.add_argument("--requests", help="JSON Lines of decision API bodies, sent to both")
    sources.add_argument("--primary-url", help="the primary serve, for --requests")
    sources.add_argument("--candidate-url", help="the candidate serve, for --requests")
    sources.add_argument("--region", help="AWS region for s3:// records (default: boto3's)")
    gates = shadow.add_argument_group("thresholds (exit status 1 when one is crossed)")
    gates.add_argument(
        "--gate",
        type=_fraction,
        help="an answer passes when its top probability is at least this and it did not "
        "abstain; pairs on either side of it are gate crossings",
    )
    gates.add_argument("--min-agreement", type=_fraction, help="least top-option agreement")
    gates.add_argument("--max-mean-tv", type=_fraction, help="most mean total-variation distance")
    gates.add_argument(
        "--max-gate-crossings",
        type=_fraction,
        help="most gate crossings, as a share of the pairs compared (both directions)",
    )
    shadow.add_argument("--out", help="a folder for shadow-report.json and shadow-report.png")
    shadow.add_argument("--no-plot", action="store_true", help="write no plot")
    shadow.set_defaults(run=_shadow_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `semif` console script; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    for option in ("endpoint_url", "inference_component", "wake_up_s"):
        if getattr(args, option, None) and not args.endpoint_name:
            parser.error(f"--{option.replace('_', '-')} goes with --endpoint-name")
    try:
        code: int | None = args.run(args)  # a command that judges says its own status
    except UsageError as error:
        print(f"semif: {error}", file=sys.stderr)
        return 2
    except EndpointError as error:
        print(f"semif: {error}", file=sys.stderr)
        return 1
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
