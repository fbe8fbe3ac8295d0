"""Which of llama.cpp's extra weight buffer types a model may load into (SEMIF_WEIGHT_BUFFERS).

llama.cpp's CPU backend offers "extra" buffer types that repack quantized weights at load
for faster kernels: CPU_REPACK (AVX2/AVX-512/NEON layouts of Q4_0, Q4_K, IQ4_NL, ...) and,
in a CPU backend compiled for Intel AMX (Sapphire Rapids and later: SageMaker
ml.c7i/m7i/r7i), AMX. The AMX path crashes the process on its first matrix multiply (a
general protection fault at `ldtilecfg` in `ggml_backend_amx_mul_mat`: the tile
configuration it loads is invalid where the compiler drops the copy it is loaded from
(Ollama fixed the same crash on AWS m7i by building with GCC 13 instead of 11, the DLC's,
ollama#17244), and worker threads never ask the kernel for tile permission;
ggml-org/llama.cpp#20824, fix pending in #26954; built with GCC 12 it died of SIGILL at the
first decode on this project's AMX VM, docs/benchmark-history.md). So weights never go to
AMX buffers unless the operator asks.

llama.cpp decides per tensor, from an ordered list of buffer types, and lets a caller shape
that list only as a whole: `llama_model_params.use_extra_bufts` turns every extra type on or
off, and a tensor override to the CPU buffer type puts the extra types (AMX first) back in
play, while an override to one extra type skips the check that the type supports the tensor.
So CPU_REPACK is kept on an AMX host by loading a CPU backend built without AMX, which then
offers CPU_REPACK alone: the images leave the DLC's AMX variant out of its directory
(`adapter.backends.drop_amx_variants`; ggml's registry then picks the best AMX-free variant),
and scripts/setup.sh compiles llama.cpp without AMX instructions. Where a backend still
offers AMX (another build), `auto` turns all extra types off. Settings:

- `auto` (default): extra types on unless the CPU backend offers one that is unsafe (AMX);
- `plain`: extra types off everywhere (the weights load as the GGUF stores them);
- `all`: llama.cpp's own default, AMX included where the backend offers it.

The decision is taken at model load from what the loaded CPU backend reports (the DLC's
own libraries too: it applies to builds we do not compile), and checked after the load
against the buffers the weights really landed in, read from llama.cpp's load log.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

WeightBuffers = Literal["auto", "plain", "all"]
WEIGHT_BUFFERS: tuple[WeightBuffers, ...] = ("auto", "plain", "all")
# Extra buffer types that `auto` refuses: their kernels crash the process.
UNSAFE_BUFFER_TYPES = frozenset({"AMX"})


class WeightBufferError(RuntimeError):
    """The weight-buffer policy cannot be applied or did not hold."""


@dataclass(frozen=True)
class CpuBackend:
    """What llama.cpp's CPU backend reports: the library it was loaded from (which of a
    GGML_BACKEND_DL build's per-family variants, e.g. libggml-cpu-icelake.so), the features
    it was built for (e.g. AVX2=1, AMX_INT8=1) and the extra buffer types it offers for
    weights, in its preference order; and whether the host CPU has AMX (the kernel's
    amx_int8 flag): on such a host, a backend that offers no AMX was built without it."""

    library: str
    features: Mapping[str, str]
    extra_buffer_types: tuple[str, ...]
    host_amx: bool

    def describe(self) -> str:
        flags = [
            name if value == "1" else f"{name}={value}" for name, value in self.features.items()
        ]
        host = "AMX" if self.host_amx else "no AMX"
        return f"{self.library} (host CPU: {host}), features: {' '.join(flags) or 'none reported'}"


@dataclass(frozen=True)
class BufferChoice:
    """The decision for one load: whether llama.cpp may use its extra buffer types, which
    offered types that keeps from the weights, and why."""

    setting: WeightBuffers
    use_extra: bool
    offered: tuple[str, ...]
    reason: str

    @property
    def refused(self) -> tuple[str, ...]:
        return () if self.use_extra else self.offered


def choose_buffers(setting: WeightBuffers, cpu: CpuBackend) -> BufferChoice:
    """Decide from the setting and what the CPU backend offers (pure: no native calls)."""
    offered = cpu.extra_buffer_types
    if setting == "all":
        return BufferChoice(setting, True, offered, "SEMIF_WEIGHT_BUFFERS=all")
    if setting == "plain":
        return BufferChoice(setting, False, offered, "SEMIF_WEIGHT_BUFFERS=plain")
    unsafe = sorted(UNSAFE_BUFFER_TYPES.intersection(offered))
    if unsafe:
        reason = (
            f"the CPU backend offers {', '.join(unsafe)}, whose kernels crash "
            "(llama.cpp#20824); llama.cpp can only turn extra buffer types off together, "
            "so a CPU backend built without AMX is what keeps CPU_REPACK"
        )
        return BufferChoice(setting, False, offered, reason)
    return BufferChoice(setting, True, offered, "no unsafe extra buffer type offered")


def check_landed(choice: BufferChoice, landed: Mapping[str, float]) -> None:
    """Fail the load, before any decode, if weights went to a buffer type the choice
    refused (a library that ignored the parameter): never fail open into a crash."""
    wrong = sorted(name for name in landed if name in choice.refused)
    if wrong:
        raise WeightBufferError(
            f"weights were loaded into {', '.join(wrong)} buffers although "
            f"SEMIF_WEIGHT_BUFFERS={choice.setting} refused them ({choice.reason})"
        )
