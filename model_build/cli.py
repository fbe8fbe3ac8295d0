"""`model-build`: turn a pinned GGUF source into a verified model.tar.gz in S3 (or locally).

Every flag defaults from an environment variable, so the CodeBuild buildspec runs a bare
`model-build` with variables set by the CDK project. Progress goes to stderr; the last line
on stdout is one JSON object describing the result (the deploy reads it). Any failure
prints one line, `model-build: <problem>`, and exits 1; the steps below guarantee that no
partial object is left in S3 and no partial archive on disk.
"""

from __future__ import annotations

import argparse
import errno
import functools
import logging
import os
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

import boto3
from botocore.config import Config

from model_build.build import BuildRequest, run_build
from model_build.calibration import Calibration, CalibrationError, load_calibration
from model_build.embedded import SMOLLM2
from model_build.errors import BuildError
from model_build.fetch import HttpSettings, RetryPolicy
from model_build.manifest import CHAT_TEMPLATE_NAME, ChatTemplateFileError, read_chat_template
from model_build.publish import parse_destination
from model_build.sources import (
    EMBEDDED,
    HF_DEFAULT_BASE_URL,
    PINNED_SHA256,
    PRODUCTION_MODEL,
    Source,
    parse_sha256,
    parse_source,
)

_PROG = "model-build"
log = logging.getLogger("model_build")


def _parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Build model.tar.gz (GGUF + model-manifest.json) from a pinned source.",
        epilog="Each flag defaults from the environment variable named in its help "
        "(argparse converts and checks those values like command-line ones).",
    )
    parser.add_argument(
        "--source",
        default=env.get("MODEL_SOURCE_URI") or PRODUCTION_MODEL.source_uri,
        help="hf://<org>/<repo>@<40-hex commit>/<file>.gguf, s3://<bucket>/<key>.gguf, a local "
        f"path, or '{EMBEDDED}' (also spelled {SMOLLM2.source_uri}) "
        "[MODEL_SOURCE_URI; default: the production Qwen3.5-4B pin]",
    )
    parser.add_argument(
        "--embedded",
        dest="source",
        action="store_const",
        const=EMBEDDED,
        help=f"same as --source {EMBEDDED}: the SmolLM2 GGUF from {SMOLLM2.source_uri}",
    )
    parser.add_argument(
        "--sha256",
        default=env.get("MODEL_SHA256"),
        help="expected sha256 of the GGUF; required unless the source is the production or "
        "embedded pin [MODEL_SHA256]",
    )
    parser.add_argument(
        "--dest",
        default=env.get("MODEL_DEST_URI"),
        help="s3://<bucket>/<prefix>/model.tar.gz or a local path ending in model.tar.gz "
        "[MODEL_DEST_URI]",
    )
    parser.add_argument(
        "--kms-key-id",
        default=env.get("MODEL_KMS_KEY_ID") or None,
        help="KMS key (ARN or id) for SSE-KMS on the uploaded object [MODEL_KMS_KEY_ID]",
    )
    parser.add_argument(
        "--hf-base-url",
        default=env.get("MODEL_BUILD_HF_BASE_URL") or HF_DEFAULT_BASE_URL,
        help=f"where hf:// files are downloaded from [MODEL_BUILD_HF_BASE_URL; "
        f"default {HF_DEFAULT_BASE_URL}]",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=Path(env.get("MODEL_BUILD_WORK_DIR") or ".cache/model-build"),
        help="downloads and scratch space; needs about twice the GGUF size free "
        "[MODEL_BUILD_WORK_DIR; default .cache/model-build]",
    )
    parser.add_argument(
        "--calibration",
        type=Path,
        default=env.get("MODEL_CALIBRATION_FILE") or None,
        metavar="FILE",
        help="a calibration file (semif-calibrate's output), validated and recorded as the "
        "manifest's calibration section [MODEL_CALIBRATION_FILE]",
    )
    parser.add_argument(
        "--chat-template",
        type=Path,
        default=env.get("MODEL_CHAT_TEMPLATE_FILE") or None,
        metavar="FILE",
        help="a Jinja chat template (UTF-8) to serve the model with instead of the GGUF's "
        f"own, packed as {CHAT_TEMPLATE_NAME} and recorded in the manifest; a GGUF without "
        "a template needs one [MODEL_CHAT_TEMPLATE_FILE]",
    )
    parser.add_argument(
        "--retries",
        type=int,
        default=env.get("MODEL_BUILD_RETRIES") or str(RetryPolicy.attempts),
        help="download attempts without progress before giving up [MODEL_BUILD_RETRIES]",
    )
    parser.add_argument(
        "--retry-wait",
        type=float,
        default=env.get("MODEL_BUILD_RETRY_WAIT") or str(RetryPolicy.first_wait_s),
        help="seconds before the first retry, doubling each time [MODEL_BUILD_RETRY_WAIT]",
    )
    parser.add_argument(
        "--part-size-mb",
        type=int,
        default=env.get("MODEL_BUILD_PART_SIZE_MB") or "64",
        help="multipart upload part size in MiB, at least 5 [MODEL_BUILD_PART_SIZE_MB]",
    )
    return parser


def _request(args: argparse.Namespace, env: Mapping[str, str]) -> BuildRequest:
    if not args.dest:
        raise BuildError("no destination: pass --dest or set MODEL_DEST_URI")
    dest = parse_destination(args.dest)
    source, sha256 = _resolve_source(args.source, args.sha256)
    calibration = None if args.calibration is None else _calibration(args.calibration)
    chat_template = None if args.chat_template is None else _chat_template(args.chat_template)
    if args.part_size_mb < 5:
        raise BuildError(f"bad part size {args.part_size_mb} MiB: S3 parts are at least 5 MiB")
    if args.retries < 1 or args.retry_wait < 0:
        raise BuildError("bad retry settings: --retries must be >= 1 and --retry-wait >= 0")
    return BuildRequest(
        source=source,
        sha256=sha256,
        dest=dest,
        work_dir=args.work_dir,
        built_at=_built_at(env),
        http=HttpSettings(base_url=args.hf_base_url, token=env.get("HF_TOKEN") or None),
        retry=RetryPolicy(attempts=args.retries, first_wait_s=args.retry_wait),
        kms_key_id=args.kms_key_id,
        calibration=calibration,
        chat_template=chat_template,
        part_bytes=args.part_size_mb << 20,
    )


def _resolve_source(text: str, sha256: str | None) -> tuple[Source, str]:
    """The source and its expected sha256; only the known pins may omit the sha256."""
    source = parse_source(text)
    expected = sha256 or PINNED_SHA256.get(source.uri)
    if not expected:
        raise BuildError(f"no expected sha256 for {text}: pass --sha256 or set MODEL_SHA256")
    return source, parse_sha256(expected)


def _calibration(path: Path) -> Calibration:
    """The calibration file, checked against its format before anything is downloaded.

    Whether it was fitted for the prompts the adapter renders (`prompt_version`) is checked
    by the CDK app at synth and by the adapter at start; the builder packs models for any
    adapter version."""
    try:
        calibration = load_calibration(path)
    except CalibrationError as error:
        raise BuildError(str(error)) from None
    log.info(
        "calibration %s: prompt version %s, option order %s, temperatures %s",
        path,
        calibration.prompt_version,
        calibration.option_order,
        calibration.temperatures,
    )
    return calibration


def _chat_template(path: Path) -> bytes:
    """The operator's chat template file, checked to be UTF-8 text before anything is
    downloaded. Whether it renders is checked by the adapter at start (jinja2 is not in the
    build environment), with the same checks as a GGUF's own template."""
    try:
        data, _ = read_chat_template(path)
    except ChatTemplateFileError as error:
        raise BuildError(f"{path}: chat template {error}") from None
    return data


def _built_at(env: Mapping[str, str]) -> datetime:
    """Now, or SOURCE_DATE_EPOCH when set (reproducible builds: same inputs, same bytes)."""
    epoch = env.get("SOURCE_DATE_EPOCH")
    if not epoch:
        return datetime.now(UTC)
    try:
        return datetime.fromtimestamp(int(epoch), UTC)
    except (ValueError, OverflowError, OSError):
        raise BuildError(f"bad SOURCE_DATE_EPOCH {epoch!r}: expected Unix seconds") from None


def _s3_client_factory() -> Callable[[], Any]:
    """A lazily created S3 client: local builds never need AWS credentials."""

    @functools.cache
    def client() -> Any:
        # A fresh session per build reads the credentials in effect now, not cached ones.
        return boto3.session.Session().client(
            "s3", config=Config(retries={"mode": "standard", "max_attempts": 10})
        )

    return client


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _fail(message: str, code: int = 1) -> int:
    print(f"{_PROG}: {' '.join(message.split())}", file=sys.stderr, flush=True)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Console script entry point; returns the exit status."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{_PROG}: %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False
    env = os.environ
    # CodeBuild stops a build with SIGTERM: unwind like Ctrl-C, so the cleanups run (temporary
    # archive removed, multipart upload aborted) instead of dying mid-write.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        args = _parser(env).parse_args(argv)
        result = run_build(_request(args, env), _s3_client_factory())
    except BuildError as exc:
        return _fail(str(exc))
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            return _fail(f"disk full: no space left writing {exc.filename or 'the archive'}")
        where = f": {exc.filename}" if exc.filename else ""
        return _fail(f"{exc.strerror or exc}{where}")
    except KeyboardInterrupt:
        return _fail("interrupted", code=130)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(result.to_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
