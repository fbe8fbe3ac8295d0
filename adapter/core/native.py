"""Start-up's native steps: check the binding, read the weights into memory, say where.

Runs once, on the loading thread, before the engine's context exists. The checks turn an
ABI mismatch between the binding and libllama into a start error naming the cause, instead
of a failure deep inside a request.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import re
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import llama_cpp
import llama_cpp._logger
from gguf import GGMLQuantizationType

from adapter.core.failures import CancelledWorkError, ModelLoadError
from adapter.kv_memory import StreamCost
from adapter.weight_buffers import (
    BufferChoice,
    CpuBackend,
    WeightBufferError,
    WeightBuffers,
    check_landed,
    choose_buffers,
)

_ALL_LAYERS = 1_000_000
# llama.cpp's load log names every buffer the weights went to, with its size.
_BUFFER_LINE = re.compile(r"^\S+:\s+(\S+) model buffer size =\s+([0-9.]+) MiB")
# ... and, for a new context, the size of its KV cache and recurrent state.
_MEMORY_LINE = re.compile(
    r"^(?P<kind>llama_kv_cache|llama_memory_recurrent)\w*: size =\s+(?P<mib>[0-9.]+) MiB "
    r"\(\s*(?P<cells>\d+) cells"
)
_PROBE_STREAMS = 2
_PROBE_CELLS = 1024  # enough cells that the MiB the log prints (two decimals) are exact


# ggml's CPU backend multiplies K-quant weights (Q2_K..Q6_K, IQ*) with tiled kernels from 8
# rows of a micro-batch on and with per-row dot products below: the two round differently
# (0.12 on a tiny Q6_K llama when a prompt's last 2..7 rows were decoded apart from the rest).
# Forced, the tiled kernels take every micro-batch; ggml reads this once, at the first
# product. A build without them ignores it.
_TILED_KERNELS_EVERYWHERE = ("GGML_CPU_TILED_MM_FORCE", "1")


def pin_matmul_kernels() -> None:
    """One kernel per weight type whatever a micro-batch's row count (the exact path needs
    a row's logits not to depend on how many rows rode with it). An operator's own value of
    the variable wins; `GGML_CPU_TILED_MM=0` turns the tiled kernels off altogether, which
    is exact too and slower (590 against 746 tokens/s prefill on gemma-3-270m Q4_K_M)."""
    name, value = _TILED_KERNELS_EVERYWHERE
    os.environ.setdefault(name, value)


def weight_types(path: Path) -> frozenset[str]:
    """The tensor types a GGUF stores its weights in, for the weight-buffer policy: read
    from the header's tensor table, skipping the metadata (a 262k-token vocabulary takes
    gguf's reader 9 s to decode; stepping over it takes a fraction of one)."""
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return frozenset(_tensor_types(data))
    except (OSError, ValueError, struct.error) as error:
        raise ModelLoadError(f"cannot read the tensor types of {path}: {error}") from None


# GGUF metadata value types (gguf's GGUFValueType): fixed sizes, 8 string, 9 array.
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _tensor_types(data: mmap.mmap) -> list[str]:
    """Walk a GGUF header (magic, version, counts, key/values, then one entry per tensor:
    name, dimensions, type, offset) and return each tensor's type name."""
    if data[:4] != b"GGUF":
        raise ValueError("not a GGUF file")
    tensors, kvs = struct.unpack_from("<QQ", data, 8)
    at = 24

    def skip_string(at: int) -> int:
        (length,) = struct.unpack_from("<Q", data, at)
        return at + 8 + int(length)

    def skip_value(kind: int, at: int) -> int:
        if kind == _GGUF_STRING:
            return skip_string(at)
        if kind == _GGUF_ARRAY:
            item, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if item in _GGUF_SIZES:
                return at + int(count) * _GGUF_SIZES[item]
            for _ in range(count):
                at = skip_value(item, at)
            return at
        return at + _GGUF_SIZES[kind]

    for _ in range(kvs):
        at = skip_string(at)
        (kind,) = struct.unpack_from("<I", data, at)
        at = skip_value(kind, at + 4)
    found = []
    for _ in range(tensors):
        at = skip_string(at)
        (dims,) = struct.unpack_from("<I", data, at)
        (kind,) = struct.unpack_from("<I", data, at + 4 + 8 * dims)
        found.append(GGMLQuantizationType(kind).name)
        at += 4 + 8 * dims + 4 + 8
    return found


def require_kv_stream_binding() -> None:
    """Refuse a binding that cannot ask for one KV stream per sequence.

    Setting an unknown field on a ctypes structure silently creates a Python attribute, so
    an older binding would ignore `kv_unified` and the streams, and scoring would fail later,
    deep inside a request. The images build the binding from a pinned commit; this turns an
    ABI mismatch into a start error that names the cause.
    """
    fields = {name for name, *_ in llama_cpp.llama_context_params._fields_}
    missing = [name for name in ("kv_unified", "n_seq_max") if name not in fields]
    missing += [
        name
        for name in ("llama_memory_seq_cp", "llama_memory_seq_rm", "llama_get_memory")
        if not hasattr(llama_cpp, name)
    ]
    if missing:
        raise ModelLoadError(
            f"the llama-cpp-python binding lacks {', '.join(missing)}; it must match a "
            "llama.cpp with the llama_memory_* API and per-sequence KV streams"
        )


def read_weights_into_memory(params: llama_cpp.llama_model_params) -> None:
    """Load without mmap: with a mapped file, bytes rewritten in place after the sha256
    check would be served under the verified identity. Bindings spell this `load_mode`
    (newer) or `use_mmap` (older, the DLC's pin); setting a field a ctypes structure lacks
    silently does nothing, so the field is looked up first."""
    fields = {name for name, *_ in llama_cpp.llama_model_params._fields_}
    if "load_mode" in fields:
        params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
        if "lazy_mode" in fields:
            params.lazy_mode = llama_cpp.LLAMA_LAZY_MODE_OFF  # lazy reading needs mmap
    elif "use_mmap" in fields:
        params.use_mmap = False
    else:
        raise ModelLoadError(
            "the llama-cpp-python binding has neither load_mode nor use_mmap; cannot load "
            "the weights into memory"
        )


def restrict_weight_buffers(params: llama_cpp.llama_model_params, choice: BufferChoice) -> None:
    """Apply the weight-buffer choice to the load parameters. A binding without
    `use_extra_bufts` (setting an unknown ctypes field silently does nothing) cannot turn
    llama.cpp's extra buffer types off, so such a choice is refused, not ignored."""
    fields = {name for name, *_ in llama_cpp.llama_model_params._fields_}
    if "use_extra_bufts" in fields:
        params.use_extra_bufts = choice.use_extra
    elif not choice.use_extra:
        raise WeightBufferError(
            "the llama-cpp-python binding has no llama_model_params.use_extra_bufts, so "
            f"llama.cpp's extra weight buffers cannot be turned off ({choice.reason}); use a "
            "binding that matches the library, or SEMIF_WEIGHT_BUFFERS=all to accept them"
        )


@contextmanager
def capture_log(pattern: re.Pattern[str]) -> Iterator[list[re.Match[str]]]:
    """Collect the llama.cpp log lines matching `pattern` while the block runs (the list
    fills in as they arrive), passing every line on to the binding's own logger. The log
    callback is process-wide: one load at a time, as the server does."""
    found: list[re.Match[str]] = []
    forward = llama_cpp._logger.llama_log_callback

    def record(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        match = pattern.match(text.decode("utf-8", errors="replace").strip())
        if match:
            found.append(match)
        forward(level, text, user_data)

    callback = llama_cpp.llama_log_callback(record)  # referenced until the restore below
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    try:
        yield found
    finally:
        llama_cpp.llama_log_set(forward, ctypes.c_void_p(0))


def measure_stream_cost(model: llama_cpp.llama_model_p) -> StreamCost:
    """What one KV stream costs on this model, read from the sizes llama.cpp reports for a
    probe context of two small streams: attention KV per cell (every attention layer, in
    the cache's types) and the recurrent state a sequence keeps (hybrid and recurrent
    models). Measured, not derived from the architecture, so every model is sized alike."""
    params = llama_cpp.llama_context_default_params()
    params.n_seq_max = _PROBE_STREAMS
    params.n_ctx = _PROBE_STREAMS * _PROBE_CELLS
    params.kv_unified = False
    params.swa_full = True  # as the engine's: a sliding-window layer keeps every cell
    params.n_batch = params.n_ubatch = _PROBE_STREAMS  # at least one output per stream
    with capture_log(_MEMORY_LINE) as lines:
        context = llama_cpp.llama_init_from_model(model, params)
    if not context:
        raise ModelLoadError("llama.cpp could not create a probe context to size the KV cache")
    llama_cpp.llama_free(context)
    cell_bytes = state_bytes = 0.0
    for line in lines:
        size = float(line.group("mib")) * (1 << 20)
        if line.group("kind") == "llama_memory_recurrent":
            state_bytes += size / int(line.group("cells"))
        else:
            cell_bytes += size / (int(line.group("cells")) * _PROBE_STREAMS)
    if not lines:
        raise ModelLoadError("llama.cpp did not report its KV cache size; cannot size it")
    return StreamCost(math.ceil(cell_bytes), math.ceil(state_bytes))


@dataclass(frozen=True)
class WeightPlacement:
    """Where the weights went and why: the CPU backend's report, the buffer-type choice
    made from it, and the buffers (name -> MiB) llama.cpp loaded them into."""

    cpu: CpuBackend
    choice: BufferChoice
    landed: dict[str, float]

    def describe(self) -> str:
        """One log line: what an operator needs to read a native crash at the first decode."""
        buffers = ", ".join(f"{name} {mib:.1f} MiB" for name, mib in self.landed.items())
        refused = ", ".join(self.choice.refused) or "none"
        return (
            f"llama.cpp CPU backend: {self.cpu.describe()}; extra weight buffer types "
            f"offered: {', '.join(self.choice.offered) or 'none'}; refused: {refused} "
            f"(SEMIF_WEIGHT_BUFFERS={self.choice.setting}: {self.choice.reason}); weights "
            f"in: {buffers or 'not reported'}"
        )

    def summary(self) -> dict[str, object]:
        return {
            "setting": self.choice.setting,
            "cpu_backend": self.cpu.library,
            "host_amx": self.cpu.host_amx,
            "offered": list(self.choice.offered),
            "refused": list(self.choice.refused),
            "exact_kernels": self.choice.exact,
            "weights_in": sorted(self.landed),
        }


@dataclass(frozen=True)
class LoadedWeights:
    """A native model (freed by its owner, the engine) and where its weights went."""

    model: llama_cpp.llama_model_p
    placement: WeightPlacement


def load_weights(
    gguf: Path,
    *,
    n_gpu_layers: int,
    weight_buffers: WeightBuffers,
    cpu: CpuBackend,
    exact: bool,
    cancel: threading.Event,
) -> LoadedWeights:
    """Read the GGUF into memory in the buffer types the policy allows (on the `exact`
    path, none whose kernels round by a row's place in its micro-batch); `cancel` (set at
    shutdown) aborts the load. Weights that landed where the policy refused are freed and
    refused."""
    model_params = llama_cpp.llama_model_default_params()
    model_params.n_gpu_layers = _ALL_LAYERS if n_gpu_layers < 0 else n_gpu_layers
    read_weights_into_memory(model_params)
    choice = choose_buffers(weight_buffers, cpu, weight_types=weight_types(gguf), exact=exact)
    restrict_weight_buffers(model_params, choice)
    # Returning False aborts the load; referenced until the load returns.
    progress = llama_cpp.llama_progress_callback(lambda progress, data: not cancel.is_set())
    model_params.progress_callback = progress
    with capture_log(_BUFFER_LINE) as lines:
        model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), model_params)
    landed: dict[str, float] = {}
    for line in lines:
        landed[line.group(1)] = landed.get(line.group(1), 0.0) + float(line.group(2))
    if not model:
        if cancel.is_set():
            raise CancelledWorkError("model load cancelled: the server is shutting down")
        raise ModelLoadError(f"llama.cpp could not load {gguf}")
    try:
        check_landed(choice, landed)
    except WeightBufferError:
        llama_cpp.llama_model_free(model)
        raise
    return LoadedWeights(model, WeightPlacement(cpu, choice, landed))
