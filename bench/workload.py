"""The decisions the performance report sends: single tasks, and many questions about one
long account history (the shared-state case decision models exist for).

Everything is deterministic, so two runs of the report measure the same token sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

from adapter.schema import Decision, Option
from bench.tasks import load_tasks

_EVENTS = (
    "ticket T-{n} opened by email: invoice {n} shows {seats} seats but only {used} are in use",
    "payment of {amount} EUR for invoice {n} failed; card ending {card} was declined",
    "customer called support about slow report exports on the {region} cluster",
    "plan changed from Team to Business by admin j.ortiz@northwind.example",
    "ticket T-{n} closed: duplicate charge of {amount} EUR refunded",
    "login from a new country ({region}) blocked; two-factor challenge passed an hour later",
    "customer asked for a quote for {seats} more seats before the end of the quarter",
    "outage notice sent: API error rate above 5 percent for 40 minutes in {region}",
    "NPS survey answered with score {score}: 'exports are slow, support is kind'",
    "contract renewal reminder sent; renewal date is 30 days away",
)
_REGIONS = ("eu-west", "us-east", "ap-south", "eu-central")

# Questions an application asks about one account, each with its own options.
_SHARED_QUESTIONS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("Which team should own the next action on this account?",
     (("billing", "Billing team."), ("support", "Technical support."), ("sales", "Sales."))),
    ("How likely is this customer to churn at renewal?",
     (("low", "Low risk."), ("medium", "Medium risk."), ("high", "High risk."))),
    ("Is there an unresolved payment problem?",
     (("yes", "Yes, a payment is still failing."), ("no", "No open payment problem."))),
    ("Should we offer a discount at renewal?",
     (("yes", "Offer a discount."), ("no", "No discount."))),
    ("What is the customer's overall sentiment?",
     (("negative", "Negative."), ("neutral", "Neutral."), ("positive", "Positive."))),
    ("Is there a sales opportunity on this account?",
     (("yes", "Yes, the customer may buy more."), ("no", "No opportunity."))),
    ("Has the account had a security event?",
     (("yes", "Yes, a suspicious login happened."), ("no", "No security event."))),
    ("Which product area causes the most friction?",
     (("exports", "Report exports."), ("billing", "Invoices and payments."),
      ("login", "Login and authentication."), ("api", "The API."))),
    ("What priority should the account review get?",
     (("urgent", "Urgent."), ("high", "High."), ("normal", "Normal."), ("low", "Low."))),
    ("Is the account paying for seats it does not use?",
     (("yes", "Yes, some seats are unused."), ("no", "No, every seat is used."))),
    ("Should the account manager call the customer this week?",
     (("yes", "Yes, call this week."), ("no", "No call needed."))),
    ("Which plan fits the account best?",
     (("team", "Team plan."), ("business", "Business plan."), ("enterprise", "Enterprise."))),
    ("Was the customer affected by an outage?",
     (("yes", "Yes, an outage affected them."), ("no", "No outage affected them."))),
    ("How engaged is the customer with our surveys and emails?",
     (("low", "Barely engaged."), ("medium", "Somewhat engaged."), ("high", "Very engaged."))),
    ("Should finance review the account's invoices?",
     (("yes", "Yes, review the invoices."), ("no", "No review needed."))),
    ("What should the next email to the customer be about?",
     (("renewal", "The renewal."), ("refund", "A refund."), ("performance", "Export speed."),
      ("security", "Account security."))),
)  # fmt: skip
MAX_SHARED = len(_SHARED_QUESTIONS)
_SERIES_STRIDE = 100_000  # account variants per series of concurrent decisions


def account_state(events: int, variant: int = 0, first_event: int = 0) -> str:
    """A dated account history of `events` lines (~30 SmolLM2 tokens each); `variant` changes
    the first line, so each variant is a new state with no prefix in common past the header.
    `first_event` starts the history further into the event sequence (other events, dates
    and amounts), so states of different accounts differ throughout, not only in the header."""
    lines = [
        f"Account ACC-{4100 + variant}: Northwind Traders, Business plan, customer since 2019."
    ]
    for index in range(first_event, first_event + events):
        template = _EVENTS[index % len(_EVENTS)]
        text = template.format(
            n=7000 + 13 * index,
            seats=40 + index % 9,
            used=31 + index % 7,
            amount=120 + 35 * (index % 11),
            card=1000 + 97 * index % 9000,
            region=_REGIONS[index % len(_REGIONS)],
            score=index % 11,
        )
        lines.append(f"2026-{1 + index // 28 % 12:02d}-{1 + index % 28:02d}: {text}")
    return "\n".join(lines)


def shared_decisions(state: str, count: int) -> list[Decision]:
    """`count` different questions about one state (one shared-state request)."""
    if not 1 <= count <= MAX_SHARED:
        raise ValueError(f"shared decisions: 1..{MAX_SHARED}, got {count}")
    return [
        Decision(
            id=f"q{index:02d}",
            state=state,
            question=question,
            options=tuple(Option(option_id, text) for option_id, text in options),
        )
        for index, (question, options) in enumerate(_SHARED_QUESTIONS[:count])
    ]


# Who asks: with these, one state can be asked up to 4 x 16 = 64 different questions (the
# server's SEMIF_MAX_SHARED_DECISIONS), each its own prompt suffix.
_ASKERS = ("the billing team", "technical support", "the sales team", "the account manager")
MAX_MANY = len(_ASKERS) * MAX_SHARED
# How to read the history, after each question: ~100 SmolLM2 tokens that every prompt of a
# long request decodes on its own (they follow the point where its prompt diverges).
_RULES = (
    "Answer for {asker}. Weigh only the events dated in the history above. A ticket that "
    "was closed no longer counts as open, a refund ends the payment problem it refunded, and "
    "a blocked login counts as a security event even when a later challenge passed. When two "
    "options fit equally well, prefer the one that needs the least work from {asker} this "
    "week, and do not assume facts that the history does not state."
)


def many_questions(state: str, count: int) -> list[Decision]:
    """`count` (1..64) different questions about one state: the 16 shared questions, each
    asked for up to four teams in turn with the rules for reading the history, so no two
    prompts are the same and each decodes a suffix of ~160 tokens (one long shared-state
    request that takes several passes)."""
    if not 1 <= count <= MAX_MANY:
        raise ValueError(f"many questions: 1..{MAX_MANY}, got {count}")
    decisions = []
    for index in range(count):
        question, options = _SHARED_QUESTIONS[index % MAX_SHARED]
        asker = _ASKERS[index // MAX_SHARED]
        decisions.append(
            Decision(
                id=f"m{index:02d}",
                state=state,
                question=f"{question} {_RULES.format(asker=asker)}",
                options=tuple(Option(option_id, text) for option_id, text in options),
            )
        )
    return decisions


def concurrent_decisions(
    count: int, *, series: int, events: int, shared_every: int | None = None
) -> list[Decision]:
    """`count` single decisions, each about its own account (no state repeats within a
    series, nor across series, so a server's cache never holds one from an earlier run),
    with the questions in turn. With `shared_every` k, every k-th decision is instead about
    one hot account of the series, as when many questions arrive about a busy customer."""
    if not 0 <= count < _SERIES_STRIDE:
        raise ValueError(f"concurrent decisions: 0..{_SERIES_STRIDE - 1} per series, got {count}")
    base = series * _SERIES_STRIDE
    hot = account_state(events, variant=base + count, first_event=(base + count) * events)
    decisions = []
    for index in range(count):
        question, options = _SHARED_QUESTIONS[index % MAX_SHARED]
        shared = shared_every is not None and index % shared_every == 0
        variant = base + index
        decisions.append(
            Decision(
                id=f"s{series}-{index}",
                state=hot if shared else account_state(events, variant, variant * events),
                question=question,
                options=tuple(Option(option_id, text) for option_id, text in options),
            )
        )
    return decisions


def single_decisions(count: int) -> list[Decision]:
    """`count` smoke tasks spread evenly over the file, so every family is represented."""
    tasks = load_tasks()
    step = max(1, len(tasks) // max(count, 1))
    return [task.decision for task in tasks[::step][:count]]


@dataclass(frozen=True)
class Workload:
    """Every decision one round of the report sends, by figure."""

    singles: list[Decision]
    shared: list[Decision]
    # Pairs: a first question that leaves a new state in the cache, then a second about it.
    follow_ups: list[tuple[Decision, Decision]]
    # How often the shared request is measured per round (it is long, so noise hits it).
    shared_repeats: int


def build_workload(
    singles: int, shared: int, state_events: int, repeats: int, round_index: int
) -> Workload:
    """The same singles and shared request every round; every follow-up pair is about a
    state variant no earlier pair has put in a cache."""
    follow_ups = []
    for repeat in range(repeats):
        variant = 1 + round_index * repeats + repeat
        first, second = shared_decisions(account_state(state_events, variant), 2)
        follow_ups.append((first, second))
    return Workload(
        singles=single_decisions(singles),
        shared=shared_decisions(account_state(state_events), shared),
        follow_ups=follow_ups,
        shared_repeats=repeats,
    )
