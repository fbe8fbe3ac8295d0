"""The engine on real llama.cpp, opened as the server opens it: label probing, one-pass
batching, block-granular prefix reuse."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import llama_cpp
import numpy as np
import pytest

from adapter.backends import cpu_backend
from adapter.core.engine import LlamaEngine
from adapter.core.failures import CapacityError, ModelLoadError
from adapter.core.layout import MIN_ROWS, common_prefix_length
from adapter.decisions import decide
from adapter.prompts import ANSWER_LETTERS, TemplateRenderError
from adapter.readout import read_slots
from adapter.runtime import LoadedModel
from adapter.schema import Decision, Option
from adapter.service import DecisionService
from model_build.tiny_gguf import write_tiny_gguf
from tests.support.models import open_test_model, service_of

STATE = "Order 1182 arrived damaged; the customer wants a refund and is angry."


@pytest.fixture
def model(tiny_gguf: Path) -> Iterator[LoadedModel]:
    loaded = open_test_model(tiny_gguf)
    yield loaded
    loaded.engine.close()


@pytest.fixture
def any_model(tiny_any_gguf: Path) -> Iterator[LoadedModel]:
    """The tiny model of each memory kind: attention only (llama) and hybrid (qwen35)."""
    loaded = open_test_model(tiny_any_gguf)
    yield loaded
    loaded.engine.close()


@pytest.fixture
def engine(model: LoadedModel) -> LlamaEngine:
    return model.engine


def questions() -> list[Decision]:
    asks = [
        ("route", "Which queue?", ("refunds", "shipping", "sales")),
        ("urgent", "Is this urgent?", ("yes", "no")),
        ("tone", "What is the tone?", ("calm", "angry", "confused", "happy")),
    ]
    return [
        Decision(key, STATE, question, tuple(Option(o, f"The {o} option.") for o in opts))
        for key, question, opts in asks
    ]


def test_answer_slots_are_single_distinct_letter_tokens(model: LoadedModel) -> None:
    slots = model.labels.letter_token_ids
    assert len(set(slots)) == len(ANSWER_LETTERS)
    assert [model.engine.vocab.piece(token) for token in slots] == list(ANSWER_LETTERS)


def test_model_whose_letter_merges_with_the_prompt_is_refused(tmp_path: Path) -> None:
    bad = write_tiny_gguf(tmp_path / "bad.gguf", fuse_answer_letter=True)
    with pytest.raises(ModelLoadError, match="answer letter 'A' does not append as exactly one"):
        open_test_model(bad)


def test_model_without_chat_template_is_refused(tmp_path: Path) -> None:
    bare = write_tiny_gguf(tmp_path / "bare.gguf", chat_template=None)
    with pytest.raises(ModelLoadError, match="has no chat template"):
        open_test_model(bare)


def _probabilities(
    service: DecisionService, decisions: list[Decision], mode: str
) -> list[list[float]]:
    response = decide(service, decisions, mode)  # type: ignore[arg-type]
    return [result["probabilities"] for result in response["results"]]


def test_shared_batch_matches_each_decision_alone(any_model: LoadedModel) -> None:
    service, engine = service_of(any_model), any_model.engine
    shared = decide(service, questions(), "shared")
    timing = shared["timing"]
    # One pass: the prompts' shared state costs its rows once (adapter.core.scheduler).
    assert timing["passes"] == 1
    # System prompt + state are decoded once for all three prompts.
    assert timing["evaluated_tokens"] < timing["input_tokens"] - 40
    alone = []
    for single in questions():
        engine.reset()
        alone.extend(_probabilities(service, [single], "single"))
    for batched, solo in zip(shared["results"], alone, strict=True):
        assert batched["probabilities"] == solo  # bit-identical
        assert abs(sum(batched["probabilities"]) - 1.0) < 1e-6


def test_request_wider_than_one_pass_is_split_over_passes(tiny_gguf: Path) -> None:
    narrow = open_test_model(tiny_gguf, max_branches=2)
    try:
        waved = decide(service_of(narrow), questions(), "shared")
        assert waved["timing"]["passes"] > 1
        wide = open_test_model(tiny_gguf)
        try:
            expected = decide(service_of(wide), questions(), "shared")
        finally:
            wide.engine.close()
        for got, want in zip(waved["results"], expected["results"], strict=True):
            assert got["probabilities"] == want["probabilities"]
    finally:
        narrow.engine.close()


def test_prefix_reuse_evaluates_only_the_new_suffix(any_model: LoadedModel) -> None:
    """A new question about a resident state decodes its question and options. Attention
    memory reuses the whole common prefix; whole-stream memory (hybrid) the checkpoint the
    first request left where its state ends, so a repeat decodes the question again."""
    service, engine = service_of(any_model), any_model.engine
    first, second = questions()[:2]
    cold = decide(service, [first], "single")
    assert cold["timing"]["reused_tokens"] == 0
    assert cold["timing"]["evaluated_tokens"] == cold["results"][0]["input_tokens"]
    warm = decide(service, [second], "single")
    tokens = warm["results"][0]["input_tokens"]
    suffix = warm["timing"]["evaluated_tokens"]
    assert warm["timing"]["reused_tokens"] + suffix == tokens
    ((_, first_tokens),) = service.render([first], "single")
    ((_, second_tokens),) = service.render([second], "single")
    common = common_prefix_length(first_tokens, second_tokens)
    assert warm["timing"]["reused_tokens"] > len(engine.vocab.tokenize(STATE))
    assert suffix < tokens / 2  # the question and options
    repeat = decide(service, [second], "single")
    assert repeat["results"][0]["probabilities"] == warm["results"][0]["probabilities"]
    if engine.recurrent:
        # Up to where the question starts (the checkpoint the first request left), no more
        # for the repeat: its stream ends after its last token, which it must decode again.
        assert warm["timing"]["reused_tokens"] == common
        assert repeat["timing"]["evaluated_tokens"] == suffix
        return
    # Reuse is the whole common prefix (system prompt and state).
    assert warm["timing"]["reused_tokens"] == common
    # Fully resident: only its last MIN_ROWS tokens are decoded again (exact path).
    assert repeat["timing"]["evaluated_tokens"] == MIN_ROWS
    assert repeat["timing"]["pad_tokens"] == MIN_ROWS - 1


def test_whole_stream_memory_costs_what_prefix_memory_does(
    tiny_gguf: Path, tiny_hybrid_gguf: Path
) -> None:
    """The hybrid-model targets, against the llama of the same size and tokenizer: a new
    question about a resident state within 1.2x of its cost there, and a question about a
    new state reusing the system turn (as there)."""
    costs: dict[bool, list[dict[str, int]]] = {}
    for gguf in (tiny_gguf, tiny_hybrid_gguf):
        loaded = open_test_model(gguf)
        try:
            service = service_of(loaded)
            asked = [decide(service, [question], "single") for question in questions()[:2]]
            new_state = Decision(
                "other", "A different order, lost in transit.", "Which?", questions()[0].options
            )
            asked.append(decide(service, [new_state], "single"))
            costs[loaded.engine.recurrent] = [answer["timing"] for answer in asked]
        finally:
            loaded.engine.close()
    (_, llama_new, llama_other), (_, hybrid_new, hybrid_other) = costs[False], costs[True]
    assert hybrid_new["evaluated_tokens"] <= 1.2 * llama_new["evaluated_tokens"]
    assert hybrid_other["reused_tokens"] == llama_other["reused_tokens"] > 0


def test_a_refused_cut_scores_from_scratch_and_keeps_the_instance(
    model: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cut llama.cpp refuses (memory that keeps only whole streams) empties the cache and
    scores the pass again from scratch, with the same answer; the service stays healthy."""
    service = service_of(model)
    first, second = questions()[:2]
    decide(service, [first], "single")
    want = decide(service, [second], "single")["results"][0]["probabilities"]
    decide(service, [first], "single")
    real = llama_cpp.llama_memory_seq_rm
    refused: list[int] = []

    def refuse_once(memory: object, seq: int, start: int, end: int) -> bool:
        if start > 0 and not refused:
            refused.append(seq)
            return False
        return bool(real(memory, seq, start, end))

    monkeypatch.setattr(llama_cpp, "llama_memory_seq_rm", refuse_once)
    again = decide(service, [second], "single")
    assert refused  # the reuse of the first question's prefix needed a cut
    assert again["timing"]["reused_tokens"] == 0  # decoded from scratch
    assert again["results"][0]["probabilities"] == want
    assert service.health.healthy


def test_prefix_reuse_can_be_disabled(tiny_gguf: Path) -> None:
    fresh = open_test_model(tiny_gguf, prefix_reuse=False)
    try:
        service = service_of(fresh)
        decide(service, questions()[:1], "single")
        again = decide(service, questions()[:1], "single")
        assert again["timing"]["reused_tokens"] == 0
    finally:
        fresh.engine.close()


def test_without_reuse_a_request_over_several_passes_decodes_its_state_once(
    tiny_any_gguf: Path,
) -> None:
    fresh = open_test_model(tiny_any_gguf, prefix_reuse=False)
    try:
        fresh.engine.pass_rows = 64  # below one prompt: every question takes passes of its own
        service = service_of(fresh)
        asked = decide(service, questions(), "shared")
        prompts = [tokens for _, tokens in service.render(questions(), "shared")]
        state = common_prefix_length(prompts[0], prompts[1])
        timing = asked["timing"]
        # A pass each at least (in chunks where a pass is time-bounded: not on whole-stream
        # memory), and what was not decoded is reported as reused, chunks or not.
        assert timing["passes"] >= len(prompts)
        assert timing["reused_tokens"] + timing["evaluated_tokens"] == timing["input_tokens"]
        # Later passes continue from the first one's stream (or, on whole-stream memory,
        # from the checkpoint it left where the state ends): the state is decoded once.
        once = sum(len(prompt) for prompt in prompts) - (len(prompts) - 1) * (state - MIN_ROWS)
        assert timing["evaluated_tokens"] <= once
        # The next request starts from an empty cache.
        again = decide(service, questions()[:1], "single")
        assert again["timing"]["reused_tokens"] == 0
    finally:
        fresh.engine.close()


def test_a_state_asked_over_many_passes_is_decoded_once(tiny_any_gguf: Path) -> None:
    """16 questions about one state, a pass each: the state is decoded in the first pass
    only, on both memory kinds (whole-stream memory: later passes start from the checkpoint
    the first left where the questions begin). The server has answered about another state
    before, so the system turn is resident (on whole-stream memory its checkpoint is made
    once, by the first request a server answers)."""
    loaded = open_test_model(tiny_any_gguf)
    try:
        loaded.engine.pass_rows = 64  # below one prompt: every question takes passes of its own
        service = service_of(loaded)
        options = questions()[0].options
        decide(service, [Decision("warm", "Another order.", "Which?", options)], "single")
        asked = [
            Decision(f"q{i}", STATE, f"{chr(65 + i)}: which queue?", options) for i in range(16)
        ]
        answer = decide(service, asked, "shared")
        prompts = [tokens for _, tokens in service.render(asked, "shared")]
        state = common_prefix_length(prompts[0], prompts[1])
        timing = answer["timing"]
        assert timing["passes"] >= 16
        assert timing["reused_tokens"] + timing["evaluated_tokens"] == timing["input_tokens"]
        once = sum(len(prompt) for prompt in prompts) - 15 * state
        assert timing["evaluated_tokens"] <= once + 16 * MIN_ROWS
    finally:
        loaded.engine.close()


def test_a_prompt_larger_than_the_cache_is_a_capacity_error(tiny_gguf: Path) -> None:
    small = LlamaEngine(
        tiny_gguf,
        stream_cells=256,
        max_branches=16,
        threads=2,
        n_gpu_layers=0,
        weight_buffers="auto",
        cpu=cpu_backend(None),
    )
    try:
        with pytest.raises(CapacityError, match="a stream has 256"):
            small.score([list(range(10)) + [i % 200 for i in range(300)]])
        # A prompt that fills a stream but for one cell, with many label continuations:
        # each continuation is a stream of its own (the prompt and one token), so it fits.
        # Counting all of them against one stream refused it, a 503 no retry could fix.
        full = [i % 200 for i in range(255)]
        (score,), _ = small.score([full], [list(range(12))])
        assert len(score.next_logits) == 12
    finally:
        small.close()


def test_slot_readout_matches_full_vocabulary_softmax(model: LoadedModel) -> None:
    service, engine = service_of(model), model.engine
    ((_, tokens),) = service.render([questions()[0]], "single")
    scores, _ = engine.score([tokens])
    slots = list(model.labels.letter_token_ids[:3])
    readout = read_slots(scores[0].logits, slots)
    logits = scores[0].logits.astype(np.float64)
    full = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    assert readout.allowed_token_mass == pytest.approx(full[slots].sum(), rel=1e-6)
    assert readout.probabilities == pytest.approx(full[slots] / full[slots].sum(), rel=1e-6)


def test_binding_without_kv_streams_is_refused(
    tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class OldContextParams(ctypes.Structure):
        _fields_ = [("n_ctx", ctypes.c_uint32), ("n_seq_max", ctypes.c_uint32)]

    monkeypatch.setattr(llama_cpp, "llama_context_params", OldContextParams)
    with pytest.raises(ModelLoadError, match="binding lacks kv_unified"):
        open_test_model(tiny_gguf)


def test_refused_model_frees_its_native_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    freed: list[str] = []
    real_free, real_model_free = llama_cpp.llama_free, llama_cpp.llama_model_free

    def free_context(context: object) -> None:
        freed.append("context")
        real_free(context)

    def free_model(model: object) -> None:
        freed.append("model")
        real_model_free(model)

    monkeypatch.setattr(llama_cpp, "llama_free", free_context)
    monkeypatch.setattr(llama_cpp, "llama_model_free", free_model)
    refusing = "{{ raise_exception('System role not supported') }}"
    with pytest.raises(TemplateRenderError, match="System role not supported"):
        open_test_model(write_tiny_gguf(tmp_path / "strict.gguf", chat_template=refusing))
    assert freed == ["context", "context", "model"]  # the probe sizing the cache, then its own
