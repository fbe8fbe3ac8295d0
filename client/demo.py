"""The README's main job, client side: wait for a local `serve`, send the example decisions,
print the answers as a table (through client.decision_client, as application code would),
then score the example ticket file offline (`semif batch local`'s code, client.batch_local).

Run by scripts/demo.sh after it has built the embedded model's artifact and started the
server; usable on its own against any running adapter (`python -m client.demo --url ...`).
"""

from __future__ import annotations

import argparse
import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from client.batch_local import run_local
from client.cli import format_decision
from client.decision_client import DecisionClient, DecisionResult, EndpointError

EXAMPLES = ("decision.json", "shared-decisions.json")
BATCH = "tickets.jsonl"  # one request per line, shuffled questions about four tickets


def load_example(name: str) -> dict[str, Any]:
    text = resources.files("client.examples").joinpath(name).read_text(encoding="utf-8")
    example: dict[str, Any] = json.loads(text)
    return example


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for /ping")
    parser.add_argument(
        "--batch-out",
        type=Path,
        default=Path(".models/tickets-answers.jsonl"),
        help="where the offline batch's answers go",
    )
    args = parser.parse_args()
    with DecisionClient.for_url(args.url, timeout_s=300) as client:
        _run(client, args.wait, args.batch_out)


def _run(client: DecisionClient, wait_s: float, batch_out: Path) -> None:
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
        with resources.as_file(resources.files("client.examples").joinpath(BATCH)) as source:
            summary = run_local(client, source, batch_out)
        print(f"{BATCH} (offline batch, semif batch local): {summary.describe()}")
        print(f"  answers, one line per input line: {batch_out}")
    except EndpointError as error:
        raise SystemExit(f"demo: {error}") from None
    sys.stdout.flush()


if __name__ == "__main__":
    main()
