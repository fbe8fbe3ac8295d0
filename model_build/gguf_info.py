"""Check that a file is a GGUF the adapter can serve, and read the metadata the manifest records.

The header is checked by hand first (magic `GGUF`, version 2 or 3) so that a wrong file gets
a one-line answer instead of a parser traceback; the key/value metadata is then read with the
`gguf` package, which memory-maps the file (nothing is loaded). A GGUF without a chat
template is refused unless the build packs an operator's template (`--chat-template`): the
adapter renders every prompt with a chat template, the model's own by default.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

import gguf

from model_build.errors import BuildError
from model_build.manifest import GgufInfo

_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)


def inspect_gguf(
    path: Path, *, file: str, size: int, sha256: str, operator_template: bool = False
) -> GgufInfo:
    """Validate `path` and return its manifest entry (`file` is its name in the archive);
    with `operator_template` (one is packed beside it) the GGUF may lack its own."""
    _check_header(path, file)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, OSError) as exc:
        raise BuildError(f"not a GGUF file: {file} (unreadable metadata: {exc})") from None
    fields: dict[str, Any] = reader.fields

    def value(key: str) -> Any:
        field = fields.get(key)
        return None if field is None else field.contents()

    architecture = value("general.architecture")
    if not isinstance(architecture, str) or not architecture:
        raise BuildError(f"not a usable GGUF: {file} has no general.architecture")
    template = value("tokenizer.chat_template")
    has_template = isinstance(template, str) and bool(template.strip())
    if not has_template and not operator_template:
        raise BuildError(
            f"no chat template in {file} (tokenizer.chat_template): the adapter renders "
            "prompts with a chat template, so give one with --chat-template FILE"
        )
    vocab_size = value(f"{architecture}.vocab_size")
    if not isinstance(vocab_size, int):
        tokens = fields.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens.data) if tokens is not None else 0
    if vocab_size <= 0:
        raise BuildError(f"not a usable GGUF: {file} has no vocabulary (tokenizer.ggml.tokens)")
    name = value("general.name")
    context_length = value(f"{architecture}.context_length")
    return GgufInfo(
        file=file,
        bytes=size,
        sha256=sha256,
        architecture=architecture,
        name=name if isinstance(name, str) and name else None,
        file_type=_file_type_name(value("general.file_type")),
        context_length=context_length if isinstance(context_length, int) else None,
        vocab_size=vocab_size,
        chat_template_sha256=hashlib.sha256(template.encode("utf-8")).hexdigest()
        if has_template
        else None,
    )


def _check_header(path: Path, file: str) -> None:
    with path.open("rb") as handle:
        header = handle.read(8)
    if len(header) < 8 or header[:4] != _MAGIC:
        raise BuildError(f"not a GGUF file: {file} starts with {header[:4]!r}, not b'GGUF'")
    (version,) = struct.unpack("<I", header[4:])
    if version not in _SUPPORTED_VERSIONS:
        raise BuildError(f"not a supported GGUF: {file} is GGUF version {version}, not 2 or 3")


def _file_type_name(code: Any) -> str | None:
    """`general.file_type` as llama.cpp names it (15 -> `Q4_K_M`); None when absent."""
    if not isinstance(code, int):
        return None
    try:
        member = gguf.LlamaFileType(code)
    except ValueError:
        return f"unknown({code})"
    return member.name.removeprefix("MOSTLY_").removeprefix("ALL_")
