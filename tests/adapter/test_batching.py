"""Continuous batching on real llama.cpp: results independent of history and batch mates,
requests riding together, a bounded queue, the request token budget, chat interleaving."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adapter.cancel import Cancellation
from adapter.core.failures import RefusedError
from adapter.core.generation import Sampling
from adapter.core.layout import Price, price
from adapter.core.scheduler import Scheduler
from adapter.decisions import decide
from adapter.errors import BusyError, RequestError
from adapter.likelihood import ReadoutChoice
from adapter.runtime import LoadedModel
from adapter.schema import Decision, Option
from adapter.service import DecisionService
from adapter.settings import QueueLimits
from tests.support.fake_engine import FakeEngine
from tests.support.models import open_engine, open_test_model


def _service(model: LoadedModel, **limits: int) -> DecisionService:
    return DecisionService(
        engine=model.engine,
        template=model.template,
        labels=model.labels,
        max_tokens=1024,
        model={},
        limits=QueueLimits(**limits),
    )


def _prompts(rng: random.Random, vocab: int, seen: list[list[int]]) -> list[list[int]]:
    """Prompts sharing a random stem; some repeat an earlier prompt, or extend one by a
    token or two (the cases where reuse would leave a stream a single row to decode)."""
    stem = [rng.randrange(3, vocab) for _ in range(rng.randrange(20, 120))]
    prompts = [
        stem[: rng.randrange(1, len(stem))]
        + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 60))]
        for _ in range(rng.randrange(1, 5))
    ]
    if seen and rng.random() < 0.5:
        earlier = rng.choice(seen)
        prompts.append(earlier + [rng.randrange(3, vocab) for _ in range(rng.randrange(0, 3))])
    return list({tuple(prompt): prompt for prompt in prompts}.values())


def _histories_match_alone(gguf: Path, trials: int, tolerance: float) -> None:
    rng = random.Random(1182)
    shared = open_engine(gguf)
    fresh = open_engine(gguf)
    seen: list[list[int]] = []
    reused = 0
    try:
        vocab = min(shared.vocab.n_vocab, 200)
        for _ in range(trials):
            prompts = _prompts(rng, vocab, seen)
            extra = [rng.sample(range(3, vocab), rng.choice([0, 0, 2])) for _ in prompts]
            # Where a whole-stream model may keep checkpoints (ignored by the others).
            cuts = [sorted(rng.sample(range(len(p) + 1), min(2, len(p) + 1))) for p in prompts]
            scores, _ = shared.score(prompts, extra, boundaries=cuts)
            reused += sum(score.reused_tokens for score in scores)
            seen.extend(prompts)
            for prompt, tokens, score in zip(prompts, extra, scores, strict=True):
                fresh.reset()
                (alone,), _ = fresh.score([prompt], [tokens])
                difference = float(np.abs(score.logits - alone.logits).max())
                for token in tokens:
                    after = score.next_logits[token] - alone.next_logits[token]
                    difference = max(difference, float(np.abs(after).max()))
                assert difference <= tolerance, (prompt, difference)
        assert reused > 0  # the histories were reused, not only decoded afresh
    finally:
        shared.close()
        fresh.close()


def test_random_histories_and_batches_match_alone(tiny_any_gguf: Path) -> None:
    # Bit-identical on the f32 models too: their weights take the tiled kernels that differ
    # from the one-row ones, so this is where a layout slip shows first (docs/adapter.md).
    # On the hybrid model prompts reuse only whole streams, checkpoints among them.
    _histories_match_alone(tiny_any_gguf, trials=20, tolerance=0.0)


@pytest.mark.slow
def test_random_histories_on_smollm2_match_alone(smollm2_gguf: Path) -> None:
    _histories_match_alone(smollm2_gguf, trials=6, tolerance=0.0)


def _decision(index: int) -> Decision:
    options = tuple(Option(o, f"The {o} option.") for o in ("refunds", "shipping", "sales"))
    return Decision(f"d{index}", "Order 1182 arrived damaged.", f"Which queue {index}?", options)


@pytest.fixture
def tiny(tiny_gguf: Path) -> LoadedModel:
    return open_test_model(tiny_gguf)


def _hold_first_pass_until(service: DecisionService, waiting: int) -> None:
    """Hold the engine's next pass until `waiting` requests are queued (the held one among
    them), so that the requests behind it can only ride together: on a fast tiny model they
    might otherwise arrive one pass at a time, and what the test shows would be timing."""
    real_score = service.engine.score
    scheduler = service.scheduler

    def held(*args: Any, **kwargs: Any) -> Any:
        service.engine.score = real_score  # type: ignore[method-assign]
        deadline = time.monotonic() + 30
        while scheduler.waiting < waiting and time.monotonic() < deadline:
            time.sleep(0.005)
        return real_score(*args, **kwargs)

    service.engine.score = held  # type: ignore[method-assign]


def test_concurrent_requests_ride_together_and_match_serial(tiny: LoadedModel) -> None:
    service = _service(tiny)
    try:
        serial = [decide(service, [_decision(i)], "single") for i in range(8)]
        _hold_first_pass_until(service, 8)
        with ThreadPoolExecutor(8) as pool:
            together = list(pool.map(lambda i: decide(service, [_decision(i)], "single"), range(8)))
        for alone, rode in zip(serial, together, strict=True):
            assert rode["results"][0]["probabilities"] == alone["results"][0]["probabilities"]
        assert max(r["timing"]["batch_requests"] for r in together) > 1
    finally:
        service.close(10)


def _long_chat(service: DecisionService) -> threading.Thread:
    chat = threading.Thread(
        target=service.generate,
        args=([{"role": "user", "content": "Tell a long story."}],),
        kwargs={"max_new_tokens": 400, "sampling": Sampling(), "stop": []},
    )
    chat.start()
    return chat


def test_a_full_queue_is_retryable(tiny: LoadedModel) -> None:
    service = _service(tiny, max_queue=1)
    try:
        chat = _long_chat(service)
        refused: list[BusyError] = []

        def ask(index: int) -> None:
            try:
                decide(service, [_decision(index)], "single")
            except BusyError as error:
                refused.append(error)

        for _ in range(50):
            threading.Thread(target=ask, args=(0,)).start()  # either one may be refused
            ask(1)
            if refused:
                break
        assert refused
        assert refused[0].retryable
        assert refused[0].retry_after is not None
        assert refused[0].retry_after >= 1
        chat.join()
    finally:
        service.close(30)


def test_an_over_budget_request_is_refused_before_queueing(tiny: LoadedModel) -> None:
    service = _service(tiny, max_request_tokens=50)
    try:
        with pytest.raises(RequestError, match=r"costs \d+ tokens.*limit is 50"):
            decide(service, [_decision(0)], "single")
        assert service.scheduler.waiting == 0
    finally:
        service.close(10)


def test_the_budget_charges_passes_and_copies_and_repeats_ride_free(tiny: LoadedModel) -> None:
    """The request budget is the layout's price: 64 questions about one state pay for each
    question's rows and its stream copy; the same question asked 64 times is scored once."""
    options = tuple(Option(o, f"The {o} option.") for o in ("refunds", "shipping", "sales"))
    same = [
        Decision(f"d{i}", "Order 1182 arrived damaged.", "Which queue?", options) for i in range(64)
    ]
    service = _service(tiny, max_request_tokens=600)
    try:
        answers = decide(service, same, "shared")
        assert len(answers["results"]) == 64
        assert answers["timing"]["passes"] == 1
        with pytest.raises(RequestError, match=r"costs \d+ tokens.*stream copies.*limit is 600"):
            decide(service, [_decision(i) for i in range(64)], "shared")
        assert service.scheduler.waiting == 0
    finally:
        service.close(10)


def test_an_overloaded_queue_refuses_before_the_prompt_is_rendered(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client retrying under overload costs the server no rendering or tokenizing: the
    queue's refusal comes first."""
    service = _service(tiny)
    rendered: list[int] = []
    real_render = service._render

    def render(*args: Any) -> Any:
        rendered.append(1)
        return real_render(*args)

    def overloaded(*args: Any, **kwargs: Any) -> None:
        raise RefusedError("busy: overloaded", "overloaded", 3, "place")

    try:
        monkeypatch.setattr(service, "_render", render)
        monkeypatch.setattr(service.scheduler.admission, "admit", overloaded)
        with pytest.raises(BusyError, match="busy") as refused:
            decide(service, [_decision(0)], "single")
        assert rendered == []
        # the core's refusal, as the service answers it: a 429 with its place
        assert (refused.value.status, refused.value.cause) == (429, "overloaded")
        assert refused.value.headers() == {"retry-after": "3"}
        assert refused.value.extra["retry_token"] == "place"
    finally:
        service.close(10)


def test_a_request_that_cannot_finish_in_time_is_refused_at_once(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once passes have measured the speed, a request whose own passes would outlast
    SEMIF_REQUEST_TIMEOUT_S gets a 400 (no retry can help) before it queues, instead of a
    429 after holding the worker."""
    service = _service(tiny)
    try:
        decide(service, [_decision(0)], "single")  # a pass measures the speed
        assert service.scheduler.seconds_for(service_price(service, 1)) is not None
        # as if very slow: a second a row
        monkeypatch.setattr(service.scheduler.admission.speed, "coefficients", (0.0, 1.0, 0.0))
        with pytest.raises(RequestError, match=r"needs about \d+ s.*SEMIF_REQUEST_TIMEOUT_S"):
            decide(service, [_decision(i) for i in range(4)], "shared")
        assert service.scheduler.waiting == 0
    finally:
        service.close(10)


def test_a_request_found_too_slow_after_its_first_pass_gets_a_400_there(
    tiny: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The admission estimate reads other requests' passes and can be low; a request's own
    first pass then says it cannot end within SEMIF_REQUEST_TIMEOUT_S, and it ends there
    with the 400 naming its field, not after decoding to its deadline for a 429."""
    service = _service(tiny, request_timeout_seconds=2)
    real_score = tiny.engine.score
    passes: list[int] = []

    def slow_score(*args: Any, **kwargs: Any) -> Any:
        passes.append(1)
        time.sleep(0.5)  # a pass of this request takes 0.5 s more than it did
        return real_score(*args, **kwargs)

    try:
        monkeypatch.setattr(tiny.engine, "score", slow_score)
        count = 32
        engine = tiny.engine
        own = len(service_price(service, count).passes(engine.pass_rows, engine.max_branches))
        assert own >= 5  # 2.5 s or more of sleeping alone
        with pytest.raises(RequestError, match=r"needs about \d+ s of scoring at its first") as e:
            decide(service, [_decision(i) for i in range(count)], "shared")
        assert e.value.path == "decisions"
        assert len(passes) == 1
        assert service.scheduler.waiting == 0
    finally:
        service.close(10)


def service_price(service: DecisionService, count: int) -> Price:
    """What `count` decisions about one state cost (adapter.core.layout.price)."""
    tokens = [
        tokens for _, tokens in service.render([_decision(i) for i in range(count)], "shared")
    ]
    return price(tokens, [[] for _ in tokens], stream_cells=service.engine.stream_cells)


def test_scoring_finishes_while_a_long_chat_runs(tiny: LoadedModel) -> None:
    service = _service(tiny)
    try:
        chat = _long_chat(service)
        decide(service, [_decision(0)], "single")
        assert chat.is_alive()
        chat.join()
    finally:
        service.close(30)


def test_scoring_between_chat_steps_leaves_the_chat_as_it_is_alone(tiny_gguf: Path) -> None:
    """Passes that cycle through every other stream never touch the chat's; after a reset
    (what a failed pass does) the chat decodes its context again, not from an empty stream."""
    model = open_test_model(tiny_gguf, stream_cells=512)
    engine = model.engine
    rng = random.Random(7)
    prompt = [rng.randrange(3, 200) for _ in range(120)]
    try:
        solo = engine.start_generation(prompt, max_new_tokens=24, sampling=Sampling())
        try:
            while not solo.step():
                pass
        finally:
            solo.close()
        engine.reset()
        run = engine.start_generation(prompt, max_new_tokens=24, sampling=Sampling())
        try:
            for _ in range(8):
                assert not run.step()
            for _ in range(24):  # 72 new prompts: every free stream is overwritten twice
                engine.score([[rng.randrange(3, 200) for _ in range(150)] for _ in range(3)])
                run.step()  # a token between passes (it may finish meanwhile)
            engine.reset()
            while not run.step():
                pass
        finally:
            run.close()
        assert run.result().text == solo.result().text
    finally:
        engine.close()


def test_without_reuse_a_continuing_request_gets_its_last_pass_to_itself() -> None:
    """A newcomer in that pass would empty the cache the request's rest reads from."""
    # 95 rows: a 91-token prompt, but not its sibling too (adapter.core.scheduler prices)
    engine = FakeEngine(pass_rows=95, prefix_reuse=False)
    scheduler = Scheduler(
        engine,  # type: ignore[arg-type]
        limits=QueueLimits(
            max_queue=8,
            queue_timeout_seconds=10,
            max_batch_requests=8,
        ),
        on_native_failure=lambda _: None,
    )
    try:
        state = list(range(90))
        shared = scheduler.submit(
            [[*state, 1], [*state, 2]], [(), ()], time.monotonic() + 10, Cancellation()
        )
        assert engine.entered.wait(10)
        newcomer = scheduler.submit([[7, 8]], [()], time.monotonic() + 10, Cancellation())
        engine.release.set()
        shared.future.result(10)
        newcomer.future.result(10)
    finally:
        scheduler.close(5)
    # The first prompt fills a pass; its sibling and the newcomer would fit the next one.
    assert [(len(p.prompts), p.continuing) for p in engine.passes] == [
        (1, False),
        (1, True),
        (1, False),
    ]


@pytest.mark.parametrize("readout", ["letters", "likelihood"])
def test_a_prompt_longer_than_a_pass_is_decoded_in_chunks_bit_for_bit(
    tiny_gguf: Path, readout: str
) -> None:
    """A pass bounded to 128 rows: a 700-token prompt goes in its leading chunks first, a
    pass each (a newcomer waits behind one of them, not the whole prompt), and reads bit
    for bit what the prompt decoded in one pass reads. The chunks' rows count as decoded
    for the entry they were sent for: a letter prompt reuses nothing on a fresh cache, and
    by likelihood the branches after the first reuse the prompt the chunks left resident,
    as branches in later passes do; reused and decoded add up to the input."""
    long = Decision(
        "long",
        "An account history. " * 30,
        "Which queue?",
        tuple(Option(o, f"The {o} option.") for o in ("refunds", "shipping", "sales")),
    )
    choice = ReadoutChoice(readout)  # type: ignore[arg-type]
    results = []
    for most_rows in (128, 4096):
        service = _service(open_test_model(tiny_gguf))
        service.scheduler.admission.most_pass_rows = most_rows
        try:
            results.append(service.score([long], ["decision"], readouts=[choice]))
        finally:
            service.close(10)
    chunked, whole = results
    assert chunked.input_tokens == whole.input_tokens
    assert chunked.input_tokens[0] > 5 * 128
    assert chunked.timing.passes >= 5
    assert whole.timing.passes == 1
    assert chunked.readouts[0].option_logits == whole.readouts[0].option_logits
    if readout == "letters":
        assert chunked.reused_tokens == whole.reused_tokens == [0]
    else:  # each branch takes the prompt from the prompt decoded once (adapter.option_tree)
        assert whole.reused_tokens[0] > whole.input_tokens[0] // 2
    for batch in (chunked, whole):
        timing = batch.timing
        assert timing.reused_tokens + timing.evaluated_tokens == sum(batch.input_tokens)


def test_a_follow_up_in_chunks_skips_the_chunks_its_state_holds(tiny_gguf: Path) -> None:
    """A second question about a long state: its leading chunks lie inside the state a
    stream already holds, so none costs a pass (they count as reused), and it reads bit
    for bit what it reads sent whole."""
    state = "An account history. " * 30
    options = tuple(Option(o, f"The {o} option.") for o in ("refunds", "shipping", "sales"))
    first, second = (
        Decision(i, state, q, options) for i, q in (("a", "Which queue?"), ("b", "Who?"))
    )
    results = []
    for most_rows in (128, 4096):
        service = _service(open_test_model(tiny_gguf))
        service.scheduler.admission.most_pass_rows = most_rows
        try:
            service.score([first], ["decision"])
            results.append(service.score([second], ["decision"]))
        finally:
            service.close(10)
    chunked, whole = results
    assert chunked.input_tokens[0] > 5 * 128
    assert chunked.timing.passes == whole.timing.passes == 1
    assert chunked.readouts[0].option_logits == whole.readouts[0].option_logits
    assert chunked.reused_tokens == whole.reused_tokens
    assert chunked.timing.evaluated_tokens == whole.timing.evaluated_tokens
