"""The README's main job, client side: wait for a local `serve`, send the example decisions,
print the answers as a table.

Run by scripts/demo.sh after it has built the embedded model's artifact and started the
server; usable on its own against any running adapter (`python -m adapter.demo --url ...`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from importlib import resources
from typing import Any

EXAMPLES = ("decision.json", "shared-decisions.json")


def load_example(name: str) -> dict[str, Any]:
    text = resources.files("adapter.examples").joinpath(name).read_text(encoding="utf-8")
    example: dict[str, Any] = json.loads(text)
    return example


def wait_for_ping(url: str, timeout_s: float) -> dict[str, Any]:
    """Poll /ping until the model is ready; fail fast if the server reports a failed load."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/ping", timeout=5) as response:  # noqa: S310
                ready: dict[str, Any] = json.loads(response.read())
                return ready
        except urllib.error.HTTPError as error:
            last = error.read().decode(errors="replace")
            if '"failed"' in last:
                raise SystemExit(f"demo: the server failed to load the model: {last}") from None
        except OSError as error:
            last = str(error)
        time.sleep(0.25)
    raise SystemExit(f"demo: {url}/ping not ready after {timeout_s:.0f} s ({last})")


def invoke(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(  # noqa: S310 - the URL is the operator's own server
        f"{url}/invocations",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:  # noqa: S310
            answer: dict[str, Any] = json.loads(response.read())
            return answer
    except urllib.error.HTTPError as error:
        raise SystemExit(f"demo: HTTP {error.code}: {error.read().decode()}") from None


def format_result(result: dict[str, Any]) -> str:
    ranked = sorted(
        zip(result["option_ids"], result["probabilities"], strict=True), key=lambda p: -p[1]
    )
    cells = "  ".join(f"{option}={probability:.3f}" for option, probability in ranked)
    mass = result["allowed_token_mass"]
    return f"  {result['id']:<14} -> {ranked[0][0]:<15} [{cells}]  (letter mass {mass:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for /ping")
    args = parser.parse_args()
    ping = wait_for_ping(args.url, args.wait)
    print(f"model {ping['model']} ready on backends {', '.join(ping['backends'])}")
    for name in EXAMPLES:
        answer = invoke(args.url, load_example(name))
        results = [answer["result"]] if "result" in answer else answer["results"]
        timing = answer["timing"]
        print(
            f"{name}: {len(results)} decision(s), {timing['evaluated_tokens']} tokens evaluated, "
            f"{timing['reused_tokens']} reused, {timing['total_seconds'] * 1000:.0f} ms"
        )
        for result in results:
            print(format_result(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
