"""CPU backend reports as llama.cpp gives them on two SageMaker CPU families, for tests that
stub the query (adapter.backends.cpu_backend) on whatever CPU they run on."""

from __future__ import annotations

from adapter.weight_buffers import CpuBackend

# ml.c7i / m7i / r7i: AMX is offered ahead of the CPU repack.
SAPPHIRE_RAPIDS = CpuBackend(
    features={"AVX512": "1", "AMX_INT8": "1", "AMX_BF16": "1", "REPACK": "1"},
    extra_buffer_types=("AMX", "CPU_REPACK"),
)
# ml.c6i / m6i / r6i: no AMX.
ICE_LAKE = CpuBackend(features={"AVX512": "1", "REPACK": "1"}, extra_buffer_types=("CPU_REPACK",))
