"""Deterministic packing, refusal of unsafe members, and GGUF validation on generated files."""

from __future__ import annotations

import hashlib
import io
import os
import struct
import tarfile
from pathlib import Path

import pytest

from model_build.archive import write_archive
from model_build.errors import BuildError
from model_build.gguf_info import inspect_gguf
from model_build.tiny_gguf import CHAT_TEMPLATE
from tests.support.model_build import tiny_model


def _pack(members: list[tuple[str, Path]], out: Path) -> str:
    with out.open("wb") as handle:
        return write_archive(members, handle).sha256


def test_same_inputs_give_the_same_archive_bytes(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    for directory, mtime in ((first, 1_000_000), (second, 2_000_000)):
        directory.mkdir()
        (directory / "model.gguf").write_bytes(b"weights" * 1000)
        (directory / "model-manifest.json").write_text("{}\n")
        for file in directory.iterdir():
            os.utime(file, (mtime, mtime))
            file.chmod(0o600 if mtime == 1_000_000 else 0o755)
    # Different member order, different output file names, different mtimes and modes.
    sha_a = _pack(
        [
            ("model.gguf", first / "model.gguf"),
            ("model-manifest.json", first / "model-manifest.json"),
        ],
        tmp_path / "one.tar.gz",
    )
    sha_b = _pack(
        [
            ("model-manifest.json", second / "model-manifest.json"),
            ("model.gguf", second / "model.gguf"),
        ],
        tmp_path / "another-name.tar.gz",
    )
    assert sha_a == sha_b
    assert (tmp_path / "one.tar.gz").read_bytes() == (tmp_path / "another-name.tar.gz").read_bytes()
    assert hashlib.sha256((tmp_path / "one.tar.gz").read_bytes()).hexdigest() == sha_a


def test_members_are_sorted_root_files_with_fixed_metadata(tmp_path: Path) -> None:
    (tmp_path / "b.gguf").write_bytes(b"B" * 10)
    (tmp_path / "a.json").write_bytes(b"A")
    buffer = io.BytesIO()
    digest = write_archive(
        [("b.gguf", tmp_path / "b.gguf"), ("a.json", tmp_path / "a.json")], buffer
    )
    assert digest.size == len(buffer.getvalue())
    assert digest.members == {
        "a.json": hashlib.sha256(b"A").hexdigest(),
        "b.gguf": hashlib.sha256(b"B" * 10).hexdigest(),
    }
    assert buffer.getvalue()[3] == 0  # gzip FLG: no file name in the header
    assert buffer.getvalue()[4:8] == b"\0\0\0\0"  # gzip MTIME
    buffer.seek(0)
    with tarfile.open(fileobj=buffer, mode="r:gz") as tar:
        infos = tar.getmembers()
        assert [i.name for i in infos] == ["a.json", "b.gguf"]
        for info in infos:
            assert info.isreg()
            assert (info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode) == (
                0,
                0,
                0,
                "",
                "",
                0o644,
            )
        extracted = tar.extractfile("b.gguf")
        assert extracted is not None
        assert extracted.read() == b"B" * 10


@pytest.mark.parametrize("name", ["../model.gguf", "sub/model.gguf", "/abs.gguf", "..", "", "a\\b"])
def test_path_traversal_names_are_refused(tmp_path: Path, name: str) -> None:
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(BuildError, match="refusing to pack"):
        write_archive([(name, tmp_path / "f")], io.BytesIO())


def test_links_and_non_files_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "real.gguf"
    target.write_bytes(b"x")
    (tmp_path / "link.gguf").symlink_to(target)
    with pytest.raises(BuildError, match="symbolic link"):
        write_archive([("model.gguf", tmp_path / "link.gguf")], io.BytesIO())
    with pytest.raises(BuildError, match="not a regular file"):
        write_archive([("model.gguf", tmp_path)], io.BytesIO())


def test_duplicate_names_are_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(BuildError, match="duplicate"):
        write_archive([("m.gguf", tmp_path / "f"), ("m.gguf", tmp_path / "f")], io.BytesIO())


def test_gguf_metadata_is_read_from_a_generated_model(tmp_path: Path) -> None:
    model = tiny_model(tmp_path)
    info = inspect_gguf(model.path, file="tiny.gguf", size=len(model.data), sha256=model.sha256)
    assert info.file == "tiny.gguf"
    assert (info.bytes, info.sha256) == (len(model.data), model.sha256)
    assert info.architecture == "llama"
    assert info.name == "tiny-random-llama"
    assert info.file_type == "F32"
    assert info.context_length == 2048
    assert info.vocab_size == 256 + 4 + 3  # bytes, merges, special tokens
    assert info.chat_template_sha256 == hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()


def test_gguf_without_chat_template_is_refused_unless_one_is_packed(tmp_path: Path) -> None:
    model = tiny_model(tmp_path, chat_template=None)
    size, sha256 = len(model.data), model.sha256
    with pytest.raises(BuildError, match=r"^no chat template in tiny\.gguf.*--chat-template FILE"):
        inspect_gguf(model.path, file="tiny.gguf", size=size, sha256=sha256)
    info = inspect_gguf(
        model.path, file="tiny.gguf", size=size, sha256=sha256, operator_template=True
    )
    assert (info.architecture, info.chat_template_sha256) == ("llama", None)


def test_not_a_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "zip.gguf"
    path.write_bytes(b"PK\x03\x04" + os.urandom(100))
    with pytest.raises(
        BuildError, match=r"^not a GGUF file: zip\.gguf starts with b'PK\\x03\\x04'"
    ):
        inspect_gguf(path, file="zip.gguf", size=104, sha256="0" * 64)


def test_unsupported_gguf_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "old.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<I", 1) + bytes(64))
    with pytest.raises(BuildError, match="GGUF version 1, not 2 or 3"):
        inspect_gguf(path, file="old.gguf", size=72, sha256="0" * 64)


def test_truncated_gguf_is_refused(tmp_path: Path) -> None:
    model = tiny_model(tmp_path)
    path = tmp_path / "cut.gguf"
    path.write_bytes(model.data[:200])
    with pytest.raises(BuildError, match=r"^not a GGUF file: cut\.gguf \(unreadable metadata"):
        inspect_gguf(path, file="cut.gguf", size=200, sha256="0" * 64)
