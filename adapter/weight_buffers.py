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

- `auto` (default): extra types on unless the CPU backend offers one that is unsafe (AMX),
  or, on the exact path, unless CPU_REPACK would take weights whose repacked kernels round
  by a row's place in the micro-batch (below);
- `plain`: extra types off everywhere (the weights load as the GGUF stores them);
- `all`: llama.cpp's own default, AMX included where the backend offers it.

Exact scoring (SEMIF_EXACT_SCORING, docs/adapter.md "Exact scoring") needs a row's logits not
to depend on which micro-batch it rode in. CPU_REPACK's matrix products take a micro-batch's
rows four at a time (gemm) and the rest one at a time (gemv): for Q4_0 both give the same bits
(measured on SmolLM2 requantized, output head included), for Q4_K they do not (0.18 on a
tiny Q4_K_S llama, 5.6 on the gemma-3-270m Q4_K_M, docs/benchmark-history.md). So on the
exact path `auto` keeps CPU_REPACK only for GGUFs whose repackable weights are all of a
type measured exact; others load plain, where ggml's tiled K-quant kernels prefill as fast
(746 against 735 tokens/s on that gemma). `all` keeps the repack and says the scores are no
longer exact (`BufferChoice.exact`, shown in /ping).

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
REPACK = "CPU_REPACK"
# Weight types ggml's CPU_REPACK takes (ggml-cpu/repack.cpp, llama-cpp-python 0.3.36): on x86
# (AVX2, AVX-512) these; elsewhere (NEON, SVE, RISC-V) more. Of those, the ones whose repacked
# products were measured bit-identical whatever a row's place in its micro-batch
# (tests/adapter/test_quantized_exactness.py).
X86_REPACKED_TYPES = frozenset({"Q2_K", "Q4_0", "Q4_K", "IQ4_NL"})
REPACKED_TYPES = X86_REPACKED_TYPES | {"Q1_0", "Q5_K", "Q6_K", "Q8_0", "MXFP4"}
EXACT_REPACKED_TYPES = frozenset({"Q4_0"})


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
    exact: bool = True  # the kernels it allows score a row alike in any micro-batch

    @property
    def refused(self) -> tuple[str, ...]:
        return () if self.use_extra else self.offered


def choose_buffers(
    setting: WeightBuffers,
    cpu: CpuBackend,
    *,
    weight_types: frozenset[str] = frozenset(),
    exact: bool = False,
) -> BufferChoice:
    """Decide from the setting, what the CPU backend offers and, on the `exact` path, the
    GGUF's weight types (pure: no native calls)."""
    offered = cpu.extra_buffer_types
    x86 = any(cpu.features.get(flag) == "1" for flag in ("AVX", "AVX2", "AVX512"))
    repacked = X86_REPACKED_TYPES if x86 else REPACKED_TYPES
    inexact = sorted(weight_types & (repacked - EXACT_REPACKED_TYPES))
    repack_inexact = exact and REPACK in offered and bool(inexact)
    if setting == "all":
        return BufferChoice(
            setting, True, offered, "SEMIF_WEIGHT_BUFFERS=all", exact=not repack_inexact
        )
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
    if repack_inexact:
        reason = (
            f"exact scoring: {REPACK}'s kernels for {', '.join(inexact)} weights score a row "
            "by its place in the micro-batch; plain weights take ggml's tiled kernels"
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
