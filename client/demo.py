"""The README's main job, client side: wait for a local `serve`, send the example decisions,
print the answers as a table (through client.decision_client, as application code would).

Run by scripts/demo.sh after it has built the embedded model's artifact and started the
server; usable on its own against any running adapter (`python -m client.demo --url ...`).
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from typing import Any

from client.cli import format_decision
from client.decision_client import DecisionClient, DecisionResult, EndpointError

EXAMPLES = ("decision.json", "shared-decisions.json")


def load_example(name: str) -> dict[str, Any]:
    text = resources.files("client.examples").joinpath(name).read_text(encoding="utf-8")
    example: dict[str, Any] = json.loads(text)
    return example


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for /ping")
    args = parser.parse_args()
    with DecisionClient.for_url(args.url, timeout_s=300) as client:
        _run(client, args.wait)


def _run(client: DecisionClient, wait_s: float) -> None:
    try:
        ping = client.wait_until_ready(wait_s)
        print(f"model {ping['model']} ready on backends {', '.join(ping['backends'])}")
        for name in EXAMPLES:
            answer = client.invoke(load_example(name))
            results = [answer["result"]] if "result" in answer else answer["results"]
            timing = answer["timing"]
            print(
                f"{name}: {len(results)} decision(s), {timing['evaluated_tokens']} tokens "
                f"evaluated, {timing['reused_tokens']} reused, "
                f"{timing['total_seconds'] * 1000:.0f} ms"
            )
            for result in results:
                print(format_decision(DecisionResult.from_json(result)))
    except EndpointError as error:
        raise SystemExit(f"demo: {error}") from None
    sys.stdout.flush()


if __name__ == "__main__":
    main()
