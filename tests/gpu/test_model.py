"""The GPU check's model and checks on CPU: what can be known before a GPU is lent.

The generated model must start through the adapter's own path and pass its label checks,
the GPU shape must be the size the docs claim, the workload must reach the GPU sizes with
this tokenizer, and a GPU request on a CPU-only build must fail the start check loudly.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path, PurePosixPath

import pytest

from adapter.runtime import load_service
from adapter.service import DecisionService
from adapter.settings import Settings
from scripts.gpu import checks
from scripts.gpu.figures import SINGLE_TOKENS, STATE_TOKENS, size_workload
from scripts.gpu.make_model import SHAPES, write_model
from scripts.gpu.prepare import keep


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("model") / "small.gguf", SHAPES["small"])


@pytest.fixture(scope="module")
def service(small_gguf: Path) -> Iterator[DecisionService]:
    # The SageMaker way: the GGUF is discovered in the model directory.
    loaded = load_service(Settings(model_dir=small_gguf.parent, threads=2))
    yield loaded
    loaded.engine.close()


def test_small_model_starts_through_the_adapter_and_scores_every_label_group(
    service: DecisionService,
) -> None:
    assert service.model["backends"] == ["CPU"]
    assert service.engine.vocab.n_vocab == SHAPES["small"].n_vocab
    assert checks.labels(service) == {"option_counts": [16, 60]}


def test_start_check_passes_on_cpu_and_reports_no_offload(small_gguf: Path) -> None:
    service, check = checks.start(Settings(gguf_path=small_gguf, threads=2))
    assert service is not None
    service.engine.close()
    assert check.passed, check.error
    assert check.detail["offloaded_layers"] is None  # a CPU-only build logs no offload


def test_start_check_fails_when_offload_is_asked_of_a_cpu_build(small_gguf: Path) -> None:
    service, check = checks.start(Settings(gguf_path=small_gguf, threads=2, n_gpu_layers=-1))
    assert service is None
    assert not check.passed
    assert check.error is not None
    assert "no GPU backend is loaded" in check.error


def test_shared_state_and_prefix_reuse_checks_pass_on_cpu(service: DecisionService) -> None:
    from bench.workload import account_state, shared_decisions

    decisions = shared_decisions(account_state(8), 4)
    shared = checks.shared_state(service, decisions)
    assert shared["largest_difference"] < 1e-3  # CPU: the same kernels either way
    reuse = checks.prefix_reuse(service, *shared_decisions(account_state(8, 3), 2))
    assert reuse["evaluated_tokens"] < reuse["input_tokens"] / 3


def test_workload_reaches_the_gpu_sizes_with_this_tokenizer(service: DecisionService) -> None:
    # The GPU shape has the same merges (only more padding), so it tokenizes alike.
    sizes = size_workload(service)
    singles, shared = sizes.single_prompt_tokens, sizes.shared_prompt_tokens
    assert all(0.9 * SINGLE_TOKENS <= tokens <= 1.4 * SINGLE_TOKENS for tokens in singles)
    assert all(0.95 * STATE_TOKENS <= tokens <= 1.1 * STATE_TOKENS for tokens in shared)


def test_vocabulary_padding_does_not_change_tokenization(tmp_path: Path) -> None:
    text = "Customer asked for a quote for 42 more seats; ticket T-7013 is open."
    token_lists = []
    for n_vocab in (2048, 4096):
        gguf = write_model(tmp_path / f"{n_vocab}.gguf", replace(SHAPES["small"], n_vocab=n_vocab))
        loaded = load_service(Settings(gguf_path=gguf, threads=1))
        token_lists.append(loaded.engine.vocab.tokenize(text))
        loaded.engine.close()
    assert token_lists[0] == token_lists[1]
    assert len(token_lists[0]) < len(text) / 1.5  # merges work: well under a token per byte


def test_gpu_shape_is_a_half_billion_parameter_llama() -> None:
    shape = SHAPES["gpu"]
    assert 0.5e9 < shape.parameter_count() < 0.8e9
    assert shape.head_dim == 64  # a head size CUDA flash attention has kernels for
    assert shape.n_head % shape.n_head_kv == 0
    assert shape.n_vocab == 151_936


@pytest.mark.parametrize(
    ("path", "kept"),
    [
        ("CMakeLists.txt", True),
        ("llama_cpp/llama_cpp.py", True),
        ("vendor/llama.cpp/CMakeLists.txt", True),
        ("vendor/llama.cpp/src/models/llama.cpp", True),
        ("vendor/llama.cpp/ggml/src/ggml.c", True),
        ("vendor/llama.cpp/ggml/src/ggml-cuda/template-instances/mmq-instance-q8_0.cu", True),
        ("vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp", False),
        ("vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf", False),
        ("vendor/llama.cpp/tools/server/public/index.html", False),
        ("vendor/llama.cpp/tests/test-backend-ops.cpp", False),
        ("vendor/llama.cpp/docs/build.md", False),
        ("examples/server/server.py", False),
        (".git/modules/vendor/llama.cpp/HEAD", False),
    ],
)
def test_trim_keeps_only_what_the_library_build_reads(path: str, kept: bool) -> None:
    assert keep(PurePosixPath(path)) is kept
