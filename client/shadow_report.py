"""`semif shadow-report`: does a candidate decision endpoint answer as the primary does?

A pipeline switching to a new GGUF, prompt version, option order or calibration runs the
candidate beside the primary (a SageMaker shadow variant, or a second endpoint) and gates
the switch on how far their answers part. Both sides' answered decisions become `Reading`s,
from the adapter's audit records (adapter/audit.py; client.audit_records reads them) or
from live answers to the same request bodies, and are paired:

- records carrying the caller's `audit_id` on both sides join by (audit_id, decision_id);
- the rest by content, (decision_id, state, question, options sha256), in order of
  appearance: a shadow gets the same requests in the same order, so the n-th occurrence on
  one side is the n-th on the other;
- what pairs with nothing is counted on its side, never dropped unsaid.

A pair is compared on the top option (agreement), the total-variation distance between the
two distributions by option id (half the L1 distance; for a multi-label question, whose
probabilities are each option's own, the same formula over them), and, given a gate P, on
whether each side's answer passes it (top probability >= P and no abstention). A pair whose
option ids differ as sets is an error count, and one whose record kept only its most
probable options (`omitted: ["options"]`) cannot be compared and is counted apart. The
comparison is pure (`pair_readings`, `compare`, `breaches`); reading, asking and writing
are kept to the edges (`readings`, `live_pairing`, `write_report`) so the numbers are
tested on hand-built readings.

Matplotlib is not a client dependency: the plot is drawn only when it is importable.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections import defaultdict, deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from client.audit_records import numbered_records
from client.errors import EndpointError

REPORT_JSON = "shadow-report.json"
REPORT_PLOT = "shadow-report.png"
PLOTTED_TEMPLATES = 20  # templates drawn, those with the largest mean TV first
SIDES = ("primary", "candidate")

# Posts one request body to an endpoint and returns its parsed answer (DecisionClient.invoke).
Ask = Callable[[Mapping[str, Any]], Any]


class ShadowInputError(ValueError):
    """Records or request bodies that cannot be compared; the message names the line."""


@dataclass(frozen=True)
class Reading:
    """One answered decision as the comparison reads it, from an audit record or a live
    answer (whose results carry the same fields)."""

    where: str  # SOURCE:LINE, for messages
    decision_id: str
    state_sha256: str
    question_sha256: str
    options_sha256: str
    option_ids: tuple[str, ...]
    probabilities: tuple[float, ...]
    abstained: bool = False
    seconds: float | None = None  # the request's latency (a shared batch's, for each)
    evaluated_tokens: int = 0
    reused_tokens: int = 0
    truncated: bool = False  # the record kept only its most probable options
    audit_id: str | None = None
    variant: str | None = None

    @property
    def template(self) -> tuple[str, str]:
        """The question template: the same question over the same options."""
        return self.question_sha256, self.options_sha256

    @property
    def top(self) -> str:
        """The most probable option (the first on a tie, as the client's `choice`)."""
        best = max(range(len(self.probabilities)), key=self.probabilities.__getitem__)
        return self.option_ids[best]

    def passes(self, gate: float) -> bool:
        """Whether an application gating on `gate` acts on this answer."""
        return not self.abstained and max(self.probabilities) >= gate


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def options_sha256(options: Sequence[Mapping[str, Any]]) -> str:
    """A request's options hashed as adapter/audit.py hashes them: `[[id, description,
    label], ...]` (label null when absent) in JSON, non-ASCII kept."""
    rows = [[o["id"], o["description"], o.get("label")] for o in options]
    return sha256_text(json.dumps(rows, ensure_ascii=False))


def state_text(state: Any) -> str:
    """The state as the model reads it (adapter.schema.Decision.state_text): a string
    verbatim, JSON compactly in the key order sent."""
    return state if isinstance(state, str) else json.dumps(state, ensure_ascii=False)


def _text(record: Mapping[str, Any], key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise ShadowInputError(f"{where}: the record's {key!r} is not a string")
    return value


def _optional_text(record: Mapping[str, Any], key: str, where: str) -> str | None:
    return None if record.get(key) is None else _text(record, key, where)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _tokens(timing: Any, key: str, where: str) -> int:
    """A count from the record's `timing` (0 when it has none: a record of an older adapter)."""
    value = timing.get(key, 0) if isinstance(timing, dict) else 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ShadowInputError(f"{where}: the record's 'timing.{key}' is not a count")
    return value


def reading(record: Mapping[str, Any], where: str) -> Reading:
    """One audit record (or a live result with the record's hashes added) as a Reading;
    ShadowInputError naming `where` when a field the comparison reads is wrong."""
    option_ids = record.get("option_ids")
    probabilities = record.get("probabilities")
    if not isinstance(option_ids, list) or not all(isinstance(o, str) for o in option_ids):
        raise ShadowInputError(f"{where}: the record's 'option_ids' is not a list of strings")
    if len(set(option_ids)) != len(option_ids) or not option_ids:
        raise ShadowInputError(f"{where}: the record's 'option_ids' are empty or repeat")
    if (
        not isinstance(probabilities, list)
        or len(probabilities) != len(option_ids)
        or not all(_number(p) for p in probabilities)
    ):
        raise ShadowInputError(
            f"{where}: the record's 'probabilities' are not one number per option id"
        )
    seconds: Any = record.get("request_seconds")
    timing = record.get("timing")
    omitted = record.get("omitted")
    return Reading(
        where=where,
        decision_id=_text(record, "decision_id", where),
        state_sha256=_text(record, "state_sha256", where),
        question_sha256=_text(record, "question_sha256", where),
        options_sha256=_text(record, "options_sha256", where),
        option_ids=tuple(option_ids),
        probabilities=tuple(float(p) for p in probabilities),
        abstained=record.get("abstained") is True,
        seconds=float(seconds) if _number(seconds) else None,
        evaluated_tokens=_tokens(timing, "evaluated_tokens", where),
        reused_tokens=_tokens(timing, "reused_tokens", where),
        truncated=isinstance(omitted, list) and "options" in omitted,
        audit_id=_optional_text(record, "audit_id", where),
        variant=_optional_text(record, "variant", where),
    )


def readings(lines: Iterable[str], source: str) -> list[Reading]:
    """Every audit record among a source's lines (client.audit_records), as Readings."""
    return [reading(record, f"{source}:{number}") for number, record in numbered_records(lines)]


def split_variants(
    mixed: Sequence[Reading], primary: str, candidate: str
) -> tuple[list[Reading], list[Reading], int]:
    """One source holding both sides (on SageMaker both variants log to one log group),
    split by each record's `variant`; also how many records named neither."""
    if primary == candidate:
        raise ShadowInputError(f"the primary and candidate variants are both {primary!r}")
    by_variant: dict[str | None, list[Reading]] = defaultdict(list)
    for one in mixed:
        by_variant[one.variant].append(one)
    neither = len(mixed) - len(by_variant[primary]) - len(by_variant[candidate])
    return by_variant[primary], by_variant[candidate], neither


@dataclass(frozen=True)
class Pairing:
    """The two sides' readings paired, and what could not be."""

    pairs: list[tuple[Reading, Reading]]
    primary_only: int
    candidate_only: int
    unassigned: int = 0  # a mixed source's records of neither variant
    failures: list[str] = field(
        default_factory=list
    )  # live: requests a side answered with an error


def _audit_key(one: Reading) -> Hashable | None:
    return None if one.audit_id is None else (one.audit_id, one.decision_id)


def _content_key(one: Reading) -> Hashable:
    return one.decision_id, one.state_sha256, one.question_sha256, one.options_sha256


def pair_readings(primary: Sequence[Reading], candidate: Sequence[Reading]) -> Pairing:
    """Pairs by (audit_id, decision_id) where both sides carry the audit id, then what is
    left by content in order of appearance; the pairs in the primary's order."""
    matched: list[tuple[int, int]] = []
    taken_primary: set[int] = set()
    taken_candidate: set[int] = set()
    key_of: Callable[[Reading], Hashable | None]
    for key_of in (_audit_key, _content_key):
        waiting: dict[Hashable, deque[int]] = defaultdict(deque)
        for index, one in enumerate(candidate):
            key = key_of(one)
            if index not in taken_candidate and key is not None:
                waiting[key].append(index)
        for index, one in enumerate(primary):
            key = key_of(one)
            if index in taken_primary or key is None or not waiting.get(key):
                continue
            other = waiting[key].popleft()
            matched.append((index, other))
            taken_primary.add(index)
            taken_candidate.add(other)
    matched.sort()
    return Pairing(
        pairs=[(primary[i], candidate[j]) for i, j in matched],
        primary_only=len(primary) - len(taken_primary),
        candidate_only=len(candidate) - len(taken_candidate),
    )


def total_variation(primary: Reading, candidate: Reading) -> float:
    """Half the L1 distance between the two distributions, option by option id."""
    theirs = dict(zip(candidate.option_ids, candidate.probabilities, strict=True))
    return 0.5 * sum(
        abs(p - theirs[option])
        for option, p in zip(primary.option_ids, primary.probabilities, strict=True)
    )


def quantile(values: Sequence[float], q: float) -> float:
    """The q-quantile, interpolated between the nearest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Side:
    """One side's answers over the compared pairs (both sides over the same decisions)."""

    abstention_rate: float
    latency_p50_s: float | None  # None: no reading said its latency
    latency_p95_s: float | None
    evaluated_tokens: int
    reused_tokens: int


def _side(answers: Sequence[Reading]) -> Side:
    seconds = [one.seconds for one in answers if one.seconds is not None]
    return Side(
        abstention_rate=sum(one.abstained for one in answers) / len(answers),
        latency_p50_s=quantile(seconds, 0.5) if seconds else None,
        latency_p95_s=quantile(seconds, 0.95) if seconds else None,
        evaluated_tokens=sum(one.evaluated_tokens for one in answers),
        reused_tokens=sum(one.reused_tokens for one in answers),
    )


@dataclass(frozen=True)
class Comparison:
    """How far the candidate's answers part from the primary's over some pairs (at least
    one). The gate counts are None without a gate."""

    pairs: int
    agreement: float  # share of pairs with the same top option
    mean_tv: float
    max_tv: float
    gate_lost: int | None  # the primary's answer passed the gate, the candidate's did not
    gate_gained: int | None  # the reverse
    primary: Side
    candidate: Side

    @property
    def gate_crossing_rate(self) -> float | None:
        """Pairs whose answers fall on different sides of the gate, as a share."""
        if self.gate_lost is None or self.gate_gained is None:
            return None
        return (self.gate_lost + self.gate_gained) / self.pairs


def _compare(pairs: Sequence[tuple[Reading, Reading]], gate: float | None) -> Comparison:
    distances = [total_variation(p, c) for p, c in pairs]
    lost = gained = None
    if gate is not None:
        lost = sum(p.passes(gate) and not c.passes(gate) for p, c in pairs)
        gained = sum(c.passes(gate) and not p.passes(gate) for p, c in pairs)
    return Comparison(
        pairs=len(pairs),
        agreement=sum(p.top == c.top for p, c in pairs) / len(pairs),
        mean_tv=sum(distances) / len(distances),
        max_tv=max(distances),
        gate_lost=lost,
        gate_gained=gained,
        primary=_side([p for p, _ in pairs]),
        candidate=_side([c for _, c in pairs]),
    )


@dataclass(frozen=True)
class Template:
    """One question template's comparison (question and options sha256, as records say)."""

    question_sha256: str
    options_sha256: str
    comparison: Comparison

    @property
    def name(self) -> str:
        return f"q {self.question_sha256[:8]} o {self.options_sha256[:8]}"


@dataclass(frozen=True)
class ShadowReport:
    """The comparison overall and per question template, and what was not compared."""

    gate: float | None
    overall: Comparison | None  # None: no pair could be compared
    templates: list[Template]  # the most pairs first
    primary_only: int
    candidate_only: int
    mismatched: int  # pairs whose option ids differ as sets: an error
    truncated: int  # pairs where a record kept only its most probable options
    unassigned: int
    failures: list[str]


def compare(pairing: Pairing, gate: float | None = None) -> ShadowReport:
    """The report on a pairing; pairs with other option sets or cut records are counted,
    not compared."""
    compared: list[tuple[Reading, Reading]] = []
    mismatched = truncated = 0
    for primary, candidate in pairing.pairs:
        if set(primary.option_ids) != set(candidate.option_ids):
            mismatched += 1
        elif primary.truncated or candidate.truncated:
            truncated += 1
        else:
            compared.append((primary, candidate))
    by_template: dict[tuple[str, str], list[tuple[Reading, Reading]]] = defaultdict(list)
    for pair in compared:
        by_template[pair[0].template].append(pair)
    templates = [
        Template(question, options, _compare(pairs, gate))
        for (question, options), pairs in by_template.items()
    ]
    return ShadowReport(
        gate=gate,
        overall=_compare(compared, gate) if compared else None,
        templates=sorted(templates, key=lambda t: -t.comparison.pairs),
        primary_only=pairing.primary_only,
        candidate_only=pairing.candidate_only,
        mismatched=mismatched,
        truncated=truncated,
        unassigned=pairing.unassigned,
        failures=list(pairing.failures),
    )


@dataclass(frozen=True)
class Thresholds:
    """What the candidate must meet (None: not checked). Gate crossings are a share of the
    compared pairs, both directions together, so one threshold fits any traffic volume."""

    min_agreement: float | None = None
    max_mean_tv: float | None = None
    max_gate_crossings: float | None = None


def breaches(report: ShadowReport, thresholds: Thresholds) -> list[str]:
    """Why the candidate fails, one line each; empty when it passes. Pairs with other option
    sets and a report with nothing compared always fail: neither can vouch for a switch."""
    found = []
    if report.mismatched:
        found.append(f"{report.mismatched} pairs answered different option sets")
    overall = report.overall
    if overall is None:
        return [*found, "no decision pair could be compared"]
    if thresholds.min_agreement is not None and overall.agreement < thresholds.min_agreement:
        found.append(
            f"agreement {overall.agreement:.4f} is below --min-agreement "
            f"{thresholds.min_agreement:g}"
        )
    if thresholds.max_mean_tv is not None and overall.mean_tv > thresholds.max_mean_tv:
        found.append(
            f"mean TV {overall.mean_tv:.4f} is above --max-mean-tv {thresholds.max_mean_tv:g}"
        )
    crossings = overall.gate_crossing_rate
    limit = thresholds.max_gate_crossings
    if limit is not None and crossings is not None and crossings > limit:
        found.append(
            f"gate crossings {crossings:.4f} of pairs ({overall.gate_lost} lost, "
            f"{overall.gate_gained} gained) are above --max-gate-crossings {limit:g}"
        )
    return found


def read_requests(lines: Iterable[str], source: str) -> list[tuple[str, dict[str, Any]]]:
    """(SOURCE:LINE, body) of each decision API body in a JSON Lines file (blank lines
    skipped); ShadowInputError naming the line for anything else, before anything is sent.
    System One bodies are refused: their answers carry no option ids to pair by."""
    found = []
    for number, line in enumerate(lines, start=1):
        where = f"{source}:{number}"
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except json.JSONDecodeError as error:
            raise ShadowInputError(f"{where}: not JSON ({error.msg})") from None
        if isinstance(body, dict) and "questions" in body:
            raise ShadowInputError(
                f"{where}: a System One body; live shadow reports compare decision API "
                'bodies ("decision" or "decisions") only: compare System One traffic by '
                "its audit records"
            )
        if not isinstance(body, dict) or ("decision" in body) == ("decisions" in body):
            raise ShadowInputError(
                f'{where}: not a decision API body (a JSON object with "decision" or "decisions")'
            )
        found.append((where, body))
    return found


def answered(body: Mapping[str, Any], answer: Any, seconds: float, where: str) -> list[Reading]:
    """A live answer's results as Readings: the hashes a record would carry computed from
    the body, the round trip as each result's latency."""
    asked = [body["decision"]] if "decision" in body else list(body["decisions"])
    shape = answer if isinstance(answer, dict) else {}
    results = [shape.get("result")] if "decision" in body else shape.get("results")
    if (
        not isinstance(results, list)
        or len(results) != len(asked)
        or not all(isinstance(result, dict) for result in results)
    ):
        raise EndpointError(200, f"the answer does not hold one result per decision: {answer}")
    try:
        return [
            reading(
                {
                    **result,
                    "decision_id": result.get("id"),
                    "audit_id": body.get("audit_id"),
                    "state_sha256": sha256_text(state_text(decision["state"])),
                    "question_sha256": sha256_text(decision["question"]),
                    "options_sha256": options_sha256(decision["options"]),
                    "request_seconds": seconds,
                },
                where,
            )
            for decision, result in zip(asked, results, strict=True)
        ]
    except ShadowInputError as error:
        raise EndpointError(200, f"a malformed answer: {error}") from None


def live_pairing(
    requests: Sequence[tuple[str, Mapping[str, Any]]],
    primary: Ask,
    candidate: Ask,
    clock: Callable[[], float] = time.perf_counter,
) -> Pairing:
    """Each body sent to the primary, then to the candidate; the answers paired within the
    body. A side's error answer (after its retries) is a failure; the other side's
    answers to that body count as one-sided."""
    pairs: list[tuple[Reading, Reading]] = []
    alone = dict.fromkeys(SIDES, 0)
    failures: list[str] = []
    for where, body in requests:
        sides: dict[str, list[Reading]] = {}
        for side, ask in zip(SIDES, (primary, candidate), strict=True):
            started = clock()
            try:
                answer = ask(body)
                sides[side] = answered(body, answer, clock() - started, where)
            except EndpointError as error:
                failures.append(f"{side}: {where}: {error}")
        if len(sides) == len(SIDES):
            paired = pair_readings(sides["primary"], sides["candidate"])
            pairs += paired.pairs
            alone["primary"] += paired.primary_only
            alone["candidate"] += paired.candidate_only
        else:
            for side, answers in sides.items():
                alone[side] += len(answers)
    return Pairing(pairs, alone["primary"], alone["candidate"], failures=failures)


def _cell(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_report(report: ShadowReport) -> str:
    """The report as a table: overall and per template, then each side, then what was not
    compared."""
    lines = [f"{'':<22} {'pairs':>6} {'agree':>7} {'mean TV':>8} {'max TV':>7} {'gate -/+':>9}"]
    rows = [("all", report.overall)] + [(t.name, t.comparison) for t in report.templates]
    for name, row in rows:
        if row is None:
            lines.append(f"{name:<22} {0:>6}")
            continue
        crossings = "-" if row.gate_lost is None else f"{row.gate_lost}/{row.gate_gained}"
        lines.append(
            f"{name:<22} {row.pairs:>6} {row.agreement:>7.4f} {row.mean_tv:>8.4f} "
            f"{row.max_tv:>7.4f} {crossings:>9}"
        )
    if report.overall is not None:
        lines.append("")
        lines.append(
            f"{'side':<10} {'abstained':>9} {'p50 s':>8} {'p95 s':>8} {'evaluated':>10} "
            f"{'reused':>8}"
        )
        for name in SIDES:
            side: Side = getattr(report.overall, name)
            lines.append(
                f"{name:<10} {side.abstention_rate:>9.4f} {_cell(side.latency_p50_s):>8} "
                f"{_cell(side.latency_p95_s):>8} {side.evaluated_tokens:>10} "
                f"{side.reused_tokens:>8}"
            )
    gate = "no gate" if report.gate is None else f"gate {report.gate:g}"
    lines.append("")
    lines.append(
        f"{gate}; not compared: {report.primary_only} primary only, {report.candidate_only} "
        f"candidate only, {report.mismatched} other option sets, {report.truncated} cut "
        f"records, {report.unassigned} of neither variant, {len(report.failures)} failed"
    )
    lines += [f"  failed: {failure}" for failure in report.failures]
    return "\n".join(lines)


def report_json(
    report: ShadowReport, thresholds: Thresholds, found: Sequence[str]
) -> dict[str, Any]:
    """What `shadow-report.json` holds: the report, the thresholds and the breaches."""
    return {
        **asdict(report),
        "thresholds": asdict(thresholds),
        "breaches": list(found),
        "passed": not found,
    }


def write_report(
    report: ShadowReport,
    thresholds: Thresholds,
    found: Sequence[str],
    out: Path,
    *,
    plot: bool = True,
) -> list[str]:
    """`shadow-report.json` (and, with matplotlib, `shadow-report.png`) in `out`; returns
    a line for each file written or skipped."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / REPORT_JSON
    path.write_text(json.dumps(report_json(report, thresholds, found), indent=2) + "\n")
    notes = [f"wrote {path}"]
    if not plot:
        return notes
    if report.overall is None:
        return [*notes, "no plot: no pair was compared"]
    try:
        import matplotlib
    except ImportError:
        return [*notes, "no plot: matplotlib is not installed (pip install matplotlib)"]
    matplotlib.use("Agg")  # no display on servers and CI
    return [*notes, f"wrote {write_plot(report, out / REPORT_PLOT)}"]


def write_plot(report: ShadowReport, path: Path) -> Path:
    """Per template (the PLOTTED_TEMPLATES with the largest mean TV) and overall: top-option
    agreement, and mean TV with the max as a whisker."""
    from matplotlib import pyplot

    assert report.overall is not None
    shown = sorted(report.templates, key=lambda t: -t.comparison.mean_tv)[:PLOTTED_TEMPLATES]
    rows = [("all", report.overall)] + [(t.name, t.comparison) for t in shown]
    names = [name for name, _ in rows]
    figure, (agree, distance) = pyplot.subplots(1, 2, figsize=(11, 1.5 + 0.35 * len(rows)))
    positions = list(range(len(rows)))
    agree.barh(positions, [row.agreement for _, row in rows], color="tab:blue")
    agree.set_xlim(0, 1)
    agree.set_xlabel("top-option agreement")
    distance.barh(
        positions,
        [row.mean_tv for _, row in rows],
        xerr=[[0.0] * len(rows), [row.max_tv - row.mean_tv for _, row in rows]],
        color="tab:orange",
    )
    distance.set_xlim(0, 1)
    distance.set_xlabel("total-variation distance (bar: mean, whisker: max)")
    for axes in (agree, distance):
        axes.set_yticks(positions, names)
        axes.invert_yaxis()
    more = len(report.templates) - len(shown)
    note = f" ({more} more templates not drawn)" if more > 0 else ""
    figure.suptitle(f"shadow report: {report.overall.pairs} pairs{note}")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
    return path
