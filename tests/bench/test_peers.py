"""The benchmark peers hold their weights where our server does (SEMIF_WEIGHT_BUFFERS)."""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import llama_cpp.llama_cpp as binding
import pytest

import bench.local
import bench.python_peer
from adapter.weight_buffers import CpuBackend
from tests.support.cpus import ICE_LAKE, SAPPHIRE_RAPIDS


@pytest.mark.parametrize(
    ("cpu", "setting", "flags"),
    [
        (SAPPHIRE_RAPIDS, "", ["--no-repack"]),
        (ICE_LAKE, "", []),
        (ICE_LAKE, "plain", ["--no-repack"]),
        (SAPPHIRE_RAPIDS, "all", []),
    ],
)
def test_llama_server_gets_the_choice_our_server_makes(
    monkeypatch: pytest.MonkeyPatch, cpu: CpuBackend, setting: str, flags: list[str]
) -> None:
    monkeypatch.setattr(bench.local, "cpu_backend", lambda lib_dir: cpu)
    monkeypatch.setenv("SEMIF_WEIGHT_BUFFERS", setting)
    assert bench.local.llama_server_weight_flags() == flags
    assert bench.local.peer_extra_buffers() == (flags == [])


def test_the_python_peer_loads_with_the_choice(
    monkeypatch: pytest.MonkeyPatch, tiny_gguf: Path
) -> None:
    """llama-cpp-python's server has no option for it: bench.python_peer sets it for every
    model its `Llama` loads."""
    from llama_cpp import Llama

    monkeypatch.setattr(binding, "llama_model_default_params", llama_cpp.llama_model_default_params)
    bench.python_peer.use_extra_buffers(False)
    model = Llama(model_path=str(tiny_gguf), n_ctx=64, verbose=False)
    try:
        assert model.model_params.use_extra_bufts is False
    finally:
        model.close()
