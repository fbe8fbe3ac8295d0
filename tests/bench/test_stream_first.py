"""bench.stream_first on the tiny model: each round times a decision alone and the streamed
request's first result inside its whole, and finds the streamed results bit-identical to
the whole answer's (the figure's failure condition)."""

from __future__ import annotations

from pathlib import Path

from bench.stream_first import measure


def test_a_round_times_the_first_result_within_the_stream(tiny_gguf: Path) -> None:
    (one,) = measure(tiny_gguf, threads=2, rounds=1)
    assert one.identical
    assert 0 < one.first < one.streamed
    assert one.alone > 0
    assert one.whole > 0
