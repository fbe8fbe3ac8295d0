"""CPU backend reports as llama.cpp gives them on two SageMaker CPU families, for tests that
stub the query (adapter.backends.cpu_backend) on whatever CPU they run on, and stand-ins for
the library directory it is loaded from."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from adapter.weight_buffers import CpuBackend

# ml.c7i / m7i / r7i with the DLC's directory as published: ggml's registry picks the AMX
# variant, which offers AMX ahead of the CPU repack.
SAPPHIRE_RAPIDS = CpuBackend(
    library="libggml-cpu-sapphirerapids.so",
    features={"AVX512": "1", "AMX_INT8": "1", "AMX_BF16": "1", "REPACK": "1"},
    extra_buffer_types=("AMX", "CPU_REPACK"),
    host_amx=True,
)
# The same host with the AMX variant left out (the images): the best AVX-512 variant.
SAPPHIRE_RAPIDS_WITHOUT_AMX = CpuBackend(
    library="libggml-cpu-zen4.so",
    features={"AVX512": "1", "AVX512_VBMI": "1", "AVX512_BF16": "1", "REPACK": "1"},
    extra_buffer_types=("CPU_REPACK",),
    host_amx=True,
)
# ml.c6i / m6i / r6i: no AMX.
ICE_LAKE = CpuBackend(
    library="libggml-cpu-icelake.so",
    features={"AVX512": "1", "REPACK": "1"},
    extra_buffer_types=("CPU_REPACK",),
    host_amx=False,
)


def write_ggml_library(path: Path, *, amx: bool) -> Path:
    """A stand-in for one of a llama.cpp build's ggml libraries: a real, stripped shared
    object whose symbol table holds ggml's AMX buffer type entry point, as a CPU backend built
    for AMX does, or only the score function every variant has. Needs a C compiler."""
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler to build stand-in ggml libraries")
    symbol = "void *ggml_backend_amx_buffer_type(void)" if amx else "int ggml_backend_score(void)"
    source = path.with_suffix(".c")
    source.write_text(f"{symbol} {{ return 0; }}\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-s", "-o", str(path), str(source)], check=True)
    source.unlink()
    return path
