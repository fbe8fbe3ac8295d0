"""`semif shadow-report` (client.shadow_report): the pure comparison on hand-built records
(pairing, agreement, TV, gate crossings, what cannot be compared, templates, thresholds),
the sources it reads (a mixed-variant file, a CloudWatch export, S3 through moto), and end
to end against real local servers on the tiny model that differ in their option order:
live, and from the audit records those servers wrote, which must give the same numbers."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from moto import mock_aws

from adapter.app import create_app
from adapter.settings import Settings
from client.cli import main
from client.shadow_report import (
    Reading,
    ShadowInputError,
    Thresholds,
    breaches,
    compare,
    pair_readings,
    read_requests,
    reading,
    readings,
    split_variants,
    total_variation,
)
from model_build.calibration import OptionOrder
from tests.support.live_server import live_server, runtime_of
from tests.support.serving import REPO

DOC = REPO / "docs" / "client.md"
REGION = "us-east-1"


def record(
    decision_id: str = "d1", probabilities: tuple[float, ...] = (0.7, 0.3), **changes: Any
) -> dict[str, Any]:
    """An audit record as adapter/audit.py writes one (digest), with `changes`."""
    return {
        "api": "decision",
        "request_id": "r1",
        "decision_id": decision_id,
        "level": "digest",
        "state_sha256": "s" * 64,
        "question_sha256": "q" * 64,
        "options_sha256": "o" * 64,
        "model": {"file": "m.gguf", "sha256": "m" * 64, "calibration": None},
        "prompt_sha256": "p" * 64,
        "prompt_version": "semif-direct-options/1",
        "readout": "letters",
        "option_order": "canonical",
        "abstained": False,
        "abstain_reason": None,
        "timing": {"prompts": 1, "evaluated_tokens": 80, "reused_tokens": 20},
        "option_ids": ["a", "b"],
        "probabilities": list(probabilities),
        "request_seconds": 0.1,
        **changes,
    }


def read(*records: dict[str, Any]) -> list[Reading]:
    return [reading(one, f"test:{number}") for number, one in enumerate(records, start=1)]


def test_identical_answers_agree_at_no_distance() -> None:
    side = read(record("d1"), record("d2", (0.2, 0.8)))
    report = compare(pair_readings(side, side), gate=0.5)
    overall = report.overall
    assert overall is not None
    assert (overall.pairs, overall.agreement, overall.mean_tv, overall.max_tv) == (2, 1.0, 0, 0)
    assert (overall.gate_lost, overall.gate_gained) == (0, 0)
    assert (report.primary_only, report.candidate_only, report.mismatched) == (0, 0, 0)
    assert breaches(report, Thresholds(1.0, 0.0, 0.0)) == []


def test_distance_and_agreement_are_by_option_id() -> None:
    """The candidate lists the options in another order: compared by id, not position."""
    primary = read(record(probabilities=(0.7, 0.3)))
    candidate = read(record(option_ids=["b", "a"], probabilities=(0.6, 0.4)))
    assert total_variation(primary[0], candidate[0]) == pytest.approx(0.3)
    overall = compare(pair_readings(primary, candidate)).overall
    assert overall is not None
    assert overall.agreement == 0.0
    assert overall.mean_tv == pytest.approx(0.3)
    assert overall.gate_lost is None  # no gate, no crossings counted


def test_gate_crossings_count_each_direction_and_abstentions_fail() -> None:
    primary = read(
        record("lost", (0.7, 0.3)),
        record("gained", (0.55, 0.45)),
        record("abstained", (0.9, 0.1)),
        record("both", (0.9, 0.1)),
    )
    candidate = read(
        record("lost", (0.6, 0.4)),
        record("gained", (0.8, 0.2)),
        record("abstained", (0.9, 0.1), abstained=True, abstain_reason="min_confidence"),
        record("both", (0.95, 0.05)),
    )
    report = compare(pair_readings(primary, candidate), gate=0.65)
    overall = report.overall
    assert overall is not None
    assert (overall.gate_lost, overall.gate_gained) == (2, 1)
    assert overall.gate_crossing_rate == 0.75
    assert (overall.primary.abstention_rate, overall.candidate.abstention_rate) == (0, 0.25)
    assert breaches(report, Thresholds(max_gate_crossings=0.75)) == []
    assert breaches(report, Thresholds(max_gate_crossings=0.5)) == [
        "gate crossings 0.7500 of pairs (2 lost, 1 gained) are above --max-gate-crossings 0.5"
    ]


def test_records_pair_in_order_of_appearance_and_one_sided_ones_are_counted() -> None:
    """The same decision asked twice pairs first with first; what is left is counted."""
    primary = read(record(probabilities=(0.9, 0.1)), record(probabilities=(0.6, 0.4)), record("p"))
    candidate = read(
        record("c"), record(probabilities=(0.9, 0.1)), record(probabilities=(0.6, 0.4))
    )
    pairing = pair_readings(primary, candidate)
    assert [(p.where, c.where) for p, c in pairing.pairs] == [
        ("test:1", "test:2"),
        ("test:2", "test:3"),
    ]
    report = compare(pairing)
    assert report.overall is not None
    assert report.overall.max_tv == 0
    assert (report.primary_only, report.candidate_only) == (1, 1)


def test_an_audit_id_joins_whatever_the_order_and_the_rest_join_by_content() -> None:
    primary = read(
        record(audit_id="k1", probabilities=(0.9, 0.1)),
        record(audit_id="k2", probabilities=(0.6, 0.4)),
        record("plain"),
    )
    candidate = read(
        record("plain"),
        record(audit_id="k2", probabilities=(0.6, 0.4)),
        record(audit_id="k1", probabilities=(0.9, 0.1)),
    )
    pairing = pair_readings(primary, candidate)
    assert [(p.where, c.where) for p, c in pairing.pairs] == [
        ("test:1", "test:3"),
        ("test:2", "test:2"),
        ("test:3", "test:1"),
    ]
    overall = compare(pairing).overall
    assert overall is not None
    assert overall.max_tv == 0
    # A record whose audit id the other side lacks (an older adapter) still joins by content,
    # and one joined by its audit id joins nothing else.
    old = read(record(probabilities=(0.9, 0.1)))
    assert len(pair_readings(primary[:1], old).pairs) == 1
    twice = pair_readings(primary[:1], [candidate[2], *old])
    assert (len(twice.pairs), twice.primary_only, twice.candidate_only) == (1, 0, 1)


def test_cut_records_and_other_option_sets_are_counted_not_compared() -> None:
    primary = read(record("cut"), record("other"), record("ok"))
    candidate = read(
        record("cut", omitted=["options"]),
        record("other", option_ids=["a", "c"]),
        record("ok"),
    )
    report = compare(pair_readings(primary, candidate))
    assert (report.truncated, report.mismatched) == (1, 1)
    assert report.overall is not None
    assert report.overall.pairs == 1
    assert breaches(report, Thresholds()) == ["1 pairs answered different option sets"]
    nothing = compare(pair_readings(primary[:1], candidate[:1]))
    assert nothing.overall is None
    assert breaches(nothing, Thresholds()) == ["no decision pair could be compared"]


def test_each_question_template_is_reported_on_its_own() -> None:
    other = "Q" * 64
    primary = read(record("a1"), record("a2"), record("b1", question_sha256=other))
    candidate = read(record("a1"), record("a2"), record("b1", (0.2, 0.8), question_sha256=other))
    report = compare(pair_readings(primary, candidate))
    by_question = {t.question_sha256: t.comparison for t in report.templates}
    assert [t.comparison.pairs for t in report.templates] == [2, 1]  # the most pairs first
    assert by_question["q" * 64].agreement == 1.0
    assert by_question[other].agreement == 0.0
    assert by_question[other].mean_tv == pytest.approx(0.5)
    assert report.overall is not None
    assert report.overall.agreement == pytest.approx(2 / 3)
    assert report.overall.mean_tv == pytest.approx(0.5 / 3)
    assert report.overall.max_tv == pytest.approx(0.5)


def test_each_side_says_its_latency_and_tokens() -> None:
    primary = read(*(record(f"d{i}", request_seconds=s) for i, s in enumerate((0.1, 0.2, 0.3))))
    candidate = read(
        *(
            record(f"d{i}", timing={"evaluated_tokens": 10, "reused_tokens": 5}, request_seconds=s)
            for i, s in enumerate((1.0, 2.0, 9.0))
        )
    )
    overall = compare(pair_readings(primary, candidate)).overall
    assert overall is not None
    assert overall.primary.latency_p50_s == pytest.approx(0.2)
    assert overall.candidate.latency_p50_s == pytest.approx(2.0)
    assert overall.candidate.latency_p95_s == pytest.approx(8.3)  # 2 + 0.9 x (9 - 2)
    assert (overall.primary.evaluated_tokens, overall.primary.reused_tokens) == (240, 60)
    assert (overall.candidate.evaluated_tokens, overall.candidate.reused_tokens) == (30, 15)


def test_thresholds_name_what_was_crossed() -> None:
    primary = read(record("d1"), record("d2"))
    candidate = read(record("d1", (0.4, 0.6)), record("d2"))
    report = compare(pair_readings(primary, candidate))
    assert breaches(report, Thresholds(min_agreement=0.5, max_mean_tv=0.15)) == []
    assert breaches(report, Thresholds(min_agreement=0.9, max_mean_tv=0.1)) == [
        "agreement 0.5000 is below --min-agreement 0.9",
        "mean TV 0.1500 is above --max-mean-tv 0.1",
    ]


def test_a_record_that_cannot_be_compared_is_named_by_its_line() -> None:
    lines = [
        "2026-12-05T22:00:00Z INFO started",
        "2026-12-05T22:00:01Z " + json.dumps({"audit": record()}),
        "2026-12-05T22:00:02Z " + json.dumps({"audit": record(probabilities=(0.5,))}),
    ]
    with pytest.raises(ShadowInputError, match=r"^p\.log:3: the record's 'probabilities'"):
        readings(lines, "p.log")
    with pytest.raises(ShadowInputError, match=r"^x:1: the record's 'state_sha256'"):
        reading({**record(), "state_sha256": None}, "x:1")
    with pytest.raises(ShadowInputError, match=r"timing\.reused_tokens"):
        reading(record(timing={"reused_tokens": "many"}), "x:1")


def test_a_mixed_source_splits_by_variant() -> None:
    mixed = read(
        record(variant="AllTraffic"),
        record(variant="Candidate", probabilities=(0.5, 0.5)),
        record(variant="Canary"),
        record(),
    )
    primary, candidate, neither = split_variants(mixed, "AllTraffic", "Candidate")
    assert ([p.where for p in primary], [c.where for c in candidate], neither) == (
        ["test:1"],
        ["test:2"],
        2,
    )
    with pytest.raises(ShadowInputError, match="both 'x'"):
        split_variants(mixed, "x", "x")


def test_request_files_take_decision_bodies_only() -> None:
    ok = json.dumps({"decision": {"id": "d"}})
    assert [where for where, _ in read_requests([ok, "", ok], "r.jsonl")] == [
        "r.jsonl:1",
        "r.jsonl:3",
    ]
    systemone = json.dumps({"state": "s", "questions": {}})
    with pytest.raises(ShadowInputError, match=r"^r\.jsonl:2: a System One body"):
        read_requests([ok, systemone], "r.jsonl")
    with pytest.raises(ShadowInputError, match=r"^r\.jsonl:1: not JSON"):
        read_requests(["{"], "r.jsonl")
    with pytest.raises(ShadowInputError, match=r"^r\.jsonl:1: not a decision API body"):
        read_requests([json.dumps({"messages": []})], "r.jsonl")


def _log(*records: dict[str, Any]) -> str:
    """Records as a CloudWatch Logs export holds them: a timestamp first, other lines between."""
    return "".join(
        f"2026-12-05T22:00:{i:02d}.000Z {json.dumps({'audit': one})}\nINFO a log line {{x}}\n"
        for i, one in enumerate(records)
    )


@pytest.fixture
def dummy_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 through moto: boto3 still signs, with credentials of no account."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["shadow-report", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_command_exits_by_its_thresholds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "p.log").write_text(_log(record("d1"), record("d2")))
    (tmp_path / "c.log").write_text(_log(record("d1"), record("d2", (0.4, 0.6))))
    files = ["--primary", str(tmp_path / "p.log"), "--candidate", str(tmp_path / "c.log")]
    code, out, _ = _run(capsys, *files, "--min-agreement", "0.5", "--out", str(tmp_path / "r"))
    assert code == 0
    assert re.search(r"^all\s+2\s+0\.5000\s+0\.1500\s+0\.3000\s+-$", out, flags=re.M)
    saved = json.loads((tmp_path / "r" / "shadow-report.json").read_text())
    assert (saved["passed"], saved["overall"]["agreement"]) == (True, 0.5)
    assert (tmp_path / "r" / "shadow-report.png").stat().st_size > 0
    code, _, err = _run(capsys, *files, "--min-agreement", "0.9", "--no-plot")
    assert code == 1
    assert "semif: shadow report: agreement 0.5000 is below --min-agreement 0.9" in err
    code, _, err = _run(capsys, *files, "--max-gate-crossings", "0.1")
    assert (code, err.strip()) == (2, "semif: --max-gate-crossings needs --gate")
    code, _, err = _run(capsys, "--primary", str(tmp_path / "p.log"))
    assert code == 2
    assert "compares one source" in err
    code, _, err = _run(capsys, *files[:2], "--candidate", str(tmp_path / "missing.log"))
    assert code == 2
    assert "cannot read" in err
    assert "missing.log" in err
    with pytest.raises(SystemExit) as exit_info:
        _run(capsys, *files, "--gate", "1.5")
    assert exit_info.value.code == 2


def test_a_missing_matplotlib_skips_only_the_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "p.log").write_text(_log(record()))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # its import fails
    files = ["--primary", str(tmp_path / "p.log"), "--candidate", str(tmp_path / "p.log")]
    code, out, _ = _run(capsys, *files, "--out", str(tmp_path / "r"))
    assert code == 0
    assert "no plot: matplotlib is not installed" in out
    assert (tmp_path / "r" / "shadow-report.json").exists()
    assert not (tmp_path / "r" / "shadow-report.png").exists()


# End to end: real servers on the tiny model, their audit records captured as written.


@dataclass
class Server:
    url: str
    records: list[str]  # the audit lines it wrote, in order


@contextmanager
def _server(gguf: Path, model_dir: Path, order: OptionOrder, variant: str) -> Iterator[Server]:
    """A live server reading in `order` as SageMaker's `variant` would, its digest audit
    lines captured from its writer."""
    shutil.copy(gguf, model_dir / gguf.name)
    settings = Settings(
        model_dir=model_dir,
        max_tokens=1024,
        threads=1,
        option_order=order,
        audit="digest",
        variant=variant,
    )
    app = create_app(settings)
    written: list[str] = []
    runtime_of(app).audit._write = written.append
    with live_server(app) as url:
        yield Server(url, written)


@pytest.fixture(scope="module")
def servers(
    tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Server]]:
    """`primary` and `twin` read in the canonical option order, `candidate` as given."""
    sides: dict[str, tuple[OptionOrder, str]] = {
        "primary": ("canonical", "AllTraffic"),
        "twin": ("canonical", "Twin"),
        "candidate": ("as_given", "Candidate"),
    }
    with ExitStack() as stack:
        yield {
            name: stack.enter_context(_server(tiny_gguf, tmp_path_factory.mktemp(name), *side))
            for name, side in sides.items()
        }


QUEUE_OPTIONS = [
    {"id": "account", "description": "Account access and sign-in.", "label": "account"},
    {"id": "billing", "description": "Billing, invoices and refunds (café plan)."},
    {"id": "shipping", "description": "Shipping and delivery."},
]
URGENCY_OPTIONS = [
    {"id": "low", "description": "Not urgent."},
    {"id": "high", "description": "Urgent: the customer is blocked."},
]
QUEUE = "Which queue should handle this request?"
URGENCY = "How urgent is it?"


def _decision(decision_id: str, state: Any, question: str) -> dict[str, Any]:
    options = QUEUE_OPTIONS if question == QUEUE else URGENCY_OPTIONS
    return {"id": decision_id, "state": state, "question": question, "options": options}


SIGN_IN = "I cannot sign in since Monday."
REQUESTS: list[dict[str, Any]] = [
    {"decision": _decision("q1", "I was charged twice.", QUEUE)},
    {"decision": _decision("q2", {"ticket": 7, "text": "Où est mon colis ?"}, QUEUE)},
    {"decisions": [_decision("q3", SIGN_IN, QUEUE), _decision("u3", SIGN_IN, URGENCY)]},
    {"decision": _decision("u4", "Please update my address.", URGENCY), "audit_id": "ticket-4"},
]
DECISIONS = 5


def _expected(primary: str, candidate: str) -> tuple[float, float, float]:
    """(agreement, mean TV, max TV) computed here from each server's own answers."""
    agree, distances = 0, []
    for body in REQUESTS:
        sides = []
        for url in (primary, candidate):
            answer = httpx.post(f"{url}/invocations", json=body, timeout=60).json()
            results = [answer["result"]] if "result" in answer else answer["results"]
            sides.append(
                [dict(zip(r["option_ids"], r["probabilities"], strict=True)) for r in results]
            )
        for mine, theirs in zip(*sides, strict=True):
            agree += max(mine, key=mine.__getitem__) == max(theirs, key=theirs.__getitem__)
            distances.append(0.5 * sum(abs(mine[o] - theirs[o]) for o in mine))
    return agree / len(distances), sum(distances) / len(distances), max(distances)


def _audit_lines(server: Server, count: int) -> list[str]:
    """The server's next `count` audit lines once written (its writer is a thread)."""
    deadline = time.monotonic() + 10
    while len(server.records) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(server.records) >= count, server.records
    taken = server.records[:count]
    del server.records[:count]
    return taken


def _numbers(saved: dict[str, Any]) -> tuple[Any, ...]:
    overall = saved["overall"]
    templates = sorted(
        (t["question_sha256"], t["options_sha256"], t["comparison"]["pairs"])
        for t in saved["templates"]
    )
    return (overall["pairs"], overall["agreement"], overall["mean_tv"], overall["max_tv"],
            overall["gate_lost"], overall["gate_gained"], templates)  # fmt: skip


@pytest.mark.usefixtures("dummy_aws")
def test_live_and_recorded_reports_agree_with_the_answers(
    servers: dict[str, Server], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for server in servers.values():
        server.records.clear()
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(body, ensure_ascii=False) + "\n" for body in REQUESTS))
    primary, twin, candidate = (servers[name] for name in ("primary", "twin", "candidate"))

    def live(other: Server, out: str, *limits: str) -> tuple[int, dict[str, Any], str]:
        code, _, err = _run(
            capsys, "--requests", str(requests), "--primary-url", primary.url,
            "--candidate-url", other.url, "--gate", "0.4", "--out", str(tmp_path / out), *limits,
        )  # fmt: skip
        return code, json.loads((tmp_path / out / "shadow-report.json").read_text()), err

    # The same settings on both sides: every decision agrees at no distance.
    code, same, _ = live(twin, "same", "--min-agreement", "1", "--max-mean-tv", "0")
    assert code == 0
    assert _numbers(same)[:6] == (DECISIONS, 1.0, 0.0, 0.0, 0, 0)
    assert sorted(pairs for _, _, pairs in _numbers(same)[6]) == [2, 3]  # two templates
    assert same["overall"]["primary"]["latency_p50_s"] > 0
    same_records = [_audit_lines(primary, DECISIONS), _audit_lines(twin, DECISIONS)]

    # Another option order: the report says what the answers say.
    code, moved, err = live(candidate, "moved", "--max-mean-tv", "0")
    agreement, mean_tv, max_tv = _expected(primary.url, candidate.url)
    assert mean_tv > 0
    assert code == 1
    assert "mean TV" in err
    overall = moved["overall"]
    assert overall["agreement"] == pytest.approx(agreement)
    assert (overall["mean_tv"], overall["max_tv"]) == (
        pytest.approx(mean_tv),
        pytest.approx(max_tv),
    )
    assert overall["candidate"]["evaluated_tokens"] > 0
    moved_records = [_audit_lines(primary, DECISIONS), _audit_lines(candidate, DECISIONS)]
    for server in (primary, candidate):  # the answers fetched for _expected
        _audit_lines(server, DECISIONS)

    # The records those servers wrote give the same numbers, templates included (the
    # client hashes question and options as the adapter does).
    for name, (mine, theirs), live_report in (
        ("same", same_records, same),
        ("moved", moved_records, moved),
    ):
        (tmp_path / f"{name}-p.log").write_text(
            "".join(f"2026-12-05T22:00:00Z {line}\n" for line in mine)
        )
        (tmp_path / f"{name}-c.log").write_text("\n".join(theirs) + "\n")
        code, _, _ = _run(
            capsys, "--primary", str(tmp_path / f"{name}-p.log"),
            "--candidate", str(tmp_path / f"{name}-c.log"), "--gate", "0.4",
            "--out", str(tmp_path / f"{name}-records"),
        )  # fmt: skip
        assert code == 0
        saved = json.loads((tmp_path / f"{name}-records" / "shadow-report.json").read_text())
        assert _numbers(saved) == _numbers(live_report)

    # One log group holding both variants, as on SageMaker, from a file and from S3: the
    # records name the variant that wrote them (SEMIF_VARIANT).
    mine, theirs = moved_records
    assert sum('"audit_id": "ticket-4"' in line for line in mine + theirs) == 2  # joined by it
    both = [json.loads(line)["audit"] for pair in zip(mine, theirs, strict=True) for line in pair]
    endpoint_log = _log(*both, record("other", variant="Canary"))
    (tmp_path / "endpoint.log").write_text(endpoint_log)
    variants = ["--primary-variant", "AllTraffic", "--candidate-variant", "Candidate"]
    variants += ["--gate", "0.4"]
    code, out, _ = _run(capsys, "--records", str(tmp_path / "endpoint.log"), *variants,
                        "--out", str(tmp_path / "mixed"))  # fmt: skip
    assert code == 0
    assert "1 of neither variant" in out
    mixed = json.loads((tmp_path / "mixed" / "shadow-report.json").read_text())
    assert (_numbers(mixed), mixed["unassigned"]) == (_numbers(moved), 1)
    with mock_aws():
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket="audit")
        s3.put_object(Bucket="audit", Key="endpoint.log", Body=endpoint_log.encode())
        code, _, _ = _run(capsys, "--records", "s3://audit/endpoint.log", "--region", REGION,
                          *variants, "--out", str(tmp_path / "s3"))  # fmt: skip
        assert code == 0
        code, _, err = _run(capsys, "--records", "s3://audit/missing.log", "--region", REGION,
                            *variants)  # fmt: skip
        assert code == 2
        assert "s3://audit/missing.log" in err
    s3_saved = json.loads((tmp_path / "s3" / "shadow-report.json").read_text())
    assert _numbers(s3_saved) == _numbers(moved)


def test_a_failing_side_is_listed_and_its_pair_counted_one_sided(
    servers: dict[str, Server], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A body the servers refuse (here both: an unknown field) is a failure on each side;
    a candidate that cannot be reached fails every request."""
    bad = {"decision": REQUESTS[0]["decision"], "unknown": 1}
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps(REQUESTS[0]) + "\n" + json.dumps(bad) + "\n")
    base = ["--requests", str(requests), "--primary-url", servers["primary"].url]
    code, out, _ = _run(capsys, *base, "--candidate-url", servers["twin"].url)
    assert code == 0
    assert "2 failed" in out
    assert re.search(r"failed: primary: .*requests\.jsonl:2: HTTP 400: body", out)
    code, out, err = _run(
        capsys, *base, "--candidate-url", "http://127.0.0.1:9", "--max-attempts", "1"
    )
    assert code == 1
    assert "1 primary only" in out
    assert "no decision pair could be compared" in err


def _documented() -> list[str]:
    section = DOC.read_text(encoding="utf-8").split("## Shadow reports", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.startswith("semif ")]


@pytest.mark.usefixtures("dummy_aws")
def test_the_documented_commands_run(
    servers: dict[str, Server],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each `semif shadow-report` line of docs/client.md, "Shadow reports", on the servers'
    own records (S3 through moto) and answers: it runs, and judges (exit 0 or 1)."""
    lines = _documented()
    assert len(lines) == 4
    for server in servers.values():
        server.records.clear()
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(json.dumps(body) + "\n" for body in REQUESTS))
    primary, candidate = servers["primary"], servers["candidate"]
    assert main(["shadow-report", "--requests", str(requests), "--primary-url", primary.url,
                 "--candidate-url", candidate.url]) == 0  # fmt: skip
    logs = {
        "primary.log": _audit_lines(primary, DECISIONS),
        "candidate.log": _audit_lines(candidate, DECISIONS),
    }
    for name, lines_written in logs.items():
        (tmp_path / name).write_text("\n".join(lines_written) + "\n")
    both = [json.loads(line)["audit"] for lines_written in logs.values() for line in lines_written]
    (tmp_path / "endpoint.log").write_text(_log(*both))
    urls = {"http://127.0.0.1:8080": primary.url, "http://127.0.0.1:8081": candidate.url}
    monkeypatch.chdir(tmp_path)
    with mock_aws():
        s3 = boto3.client("s3", region_name=REGION)
        s3.create_bucket(Bucket="semif-dev-artifacts")
        for name in logs:
            s3.put_object(
                Bucket="semif-dev-artifacts",
                Key=f"audit/{name}",
                Body=(tmp_path / name).read_bytes(),
            )
        for line in lines:
            argv = [urls.get(arg, arg) for arg in shlex.split(line)[1:]]
            code = main(argv)
            out = capsys.readouterr().out
            assert code in (0, 1), line
            assert re.search(rf"^all\s+{DECISIONS}\s", out, flags=re.M), (line, out)
