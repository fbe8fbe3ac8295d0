"""A request whose client has gone never holds the engine for nobody: on a real uvicorn
socket, a caller that gives up while its request waits is dropped before it is scored."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapter.app import create_app
from adapter.settings import Settings
from tests.support.live_server import live_server, post_in_background, runtime_of
from tests.support.serving import decision


def test_a_request_whose_client_left_is_dropped_before_its_pass(tiny_model_dir: Path) -> None:
    app = create_app(Settings(model_dir=tiny_model_dir, threads=1))
    with live_server(app) as url:
        service = runtime_of(app).service
        assert service is not None
        engine = service.engine
        real_score = engine.score
        scored: list[int] = []
        first_pass = threading.Event()

        def slow_score(prompts: Sequence[Sequence[int]], *args: Any, **kwargs: Any) -> Any:
            # The first pass holds the worker long enough for the second caller to leave.
            scored.append(len(prompts))
            if len(scored) == 1:
                first_pass.set()
                time.sleep(1.5)
            return real_score(prompts, *args, **kwargs)

        engine.score = slow_score  # type: ignore[method-assign]
        slow = post_in_background(url, {"decision": decision("slow")})
        assert first_pass.wait(30)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/invocations", json={"decision": decision("gone")}, timeout=0.3)
        slow.join(30)
        deadline = time.monotonic() + 10
        while service.scheduler.waiting and time.monotonic() < deadline:
            time.sleep(0.02)
        assert service.scheduler.waiting == 0
        assert scored == [1]  # only the slow request was ever scored
        after = httpx.post(f"{url}/invocations", json={"decision": decision("next")}, timeout=30)
        assert after.status_code == 200
        assert scored == [1, 1]
