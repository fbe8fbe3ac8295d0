"""The checks construct props run in `__post_init__`: a bad value fails synth, naming the field."""

from __future__ import annotations

import re

# `repo@sha256:<64 hex>`: the only image reference accepted anywhere (a tag can move).
_DIGEST_IMAGE = re.compile(r"^[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}$")
_INSTANCE_TYPE = re.compile(r"^ml\.[a-z0-9]+\.[a-z0-9]+$")


class PropsError(ValueError):
    """A construct prop is invalid; the message names the field."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise PropsError(message)


def require_digest_image(uri: str, what: str) -> str:
    """Reject anything but `repo@sha256:<64 hex>`: a tag can be re-pointed, a digest cannot."""
    require(
        bool(_DIGEST_IMAGE.fullmatch(uri)),
        f"{what}: {uri!r} is not digest-pinned; use 'repository@sha256:<64 lowercase hex>'",
    )
    return uri


def require_instance_type(value: str, what: str) -> None:
    require(
        bool(_INSTANCE_TYPE.fullmatch(value)),
        f"{what}: {value!r} is not a SageMaker instance type (ml.<family>.<size>)",
    )
