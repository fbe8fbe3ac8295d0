"""Load and name ggml compute backends (CPU variants, CUDA) before the model is loaded.

The llama.cpp DLC builds its backends as dlopen-able libraries (GGML_BACKEND_DL), so a
process reusing its libllama via LLAMA_CPP_LIB_PATH sees no backend at all until it loads
them from that directory; the pip-built binding links its CPU backend statically. Either
way the names are reported so operators can see on which hardware the model runs. The CPU
backend also reports the features it was built for and the extra weight buffer types it
offers (adapter/weight_buffers.py decides which of those the weights may use).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from adapter.weight_buffers import CpuBackend

_DEVICE_TYPE_CPU = 0  # enum ggml_backend_dev_type


class _Feature(ctypes.Structure):
    """struct ggml_backend_feature: one name/value pair of a backend's feature list."""

    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_char_p)]


# ggml_backend_get_features_t and ggml_backend_dev_get_extra_bufts_t
_GET_FEATURES = ctypes.CFUNCTYPE(ctypes.POINTER(_Feature), ctypes.c_void_p)
_GET_EXTRA_BUFTS = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


class BackendLoadError(RuntimeError):
    """The llama.cpp build directory holds no loadable libggml."""


def _ggml(lib_dir: Path) -> ctypes.CDLL:
    candidates = [lib_dir / "libggml.so", *sorted(lib_dir.glob("libggml.so.*"))]
    found = next((path for path in candidates if path.is_file()), None)
    if found is None:
        raise BackendLoadError(f"no libggml.so in {lib_dir} (LLAMA_CPP_LIB_PATH)")
    library = ctypes.CDLL(str(found), mode=ctypes.RTLD_GLOBAL)
    library.ggml_backend_load_all_from_path.argtypes = [ctypes.c_char_p]
    library.ggml_backend_load_all_from_path.restype = None
    library.ggml_backend_reg_count.restype = ctypes.c_size_t
    library.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
    library.ggml_backend_reg_get.restype = ctypes.c_void_p
    library.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    library.ggml_backend_reg_name.restype = ctypes.c_char_p
    library.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    library.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    library.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    library.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    library.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    library.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    library.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    library.ggml_backend_buft_name.restype = ctypes.c_char_p
    return library


def bundled_lib_dir() -> Path:
    """Where the binding keeps its own libllama/libggml when no external build is used."""
    import llama_cpp

    return Path(llama_cpp.__file__).parent / "lib"


def load_backends(external_lib_dir: Path | None) -> list[str]:
    """Load the external build's backends (if any) and return every registered backend name."""
    library = _ggml(external_lib_dir or bundled_lib_dir())
    if external_lib_dir is not None:
        library.ggml_backend_load_all_from_path(str(external_lib_dir).encode())
    names: list[str] = []
    for index in range(library.ggml_backend_reg_count()):
        raw = library.ggml_backend_reg_name(library.ggml_backend_reg_get(index))
        names.append(raw.decode() if raw else "?")
    return names


def cpu_backend(external_lib_dir: Path | None) -> CpuBackend:
    """What the loaded CPU backend reports (call after `load_backends`): its feature list
    and, in llama.cpp's order of preference, the extra buffer types it offers for weights.
    A backend without either entry point reports none of it."""
    library = _ggml(external_lib_dir or bundled_lib_dir())
    device = library.ggml_backend_dev_by_type(_DEVICE_TYPE_CPU)
    if not device:
        return CpuBackend(features={}, extra_buffer_types=())
    registry = library.ggml_backend_dev_backend_reg(device)
    features: dict[str, str] = {}
    address = library.ggml_backend_reg_get_proc_address(registry, b"ggml_backend_get_features")
    if address:
        listed = _GET_FEATURES(address)(registry)
        index = 0
        while listed and listed[index].name:
            features[listed[index].name.decode()] = (listed[index].value or b"").decode()
            index += 1
    extra: list[str] = []
    address = library.ggml_backend_reg_get_proc_address(
        registry, b"ggml_backend_dev_get_extra_bufts"
    )
    if address:
        buffer_types = _GET_EXTRA_BUFTS(address)(device)
        index = 0
        while buffer_types and buffer_types[index]:
            name = library.ggml_backend_buft_name(buffer_types[index])
            extra.append(name.decode() if name else "?")
            index += 1
    return CpuBackend(features=features, extra_buffer_types=tuple(extra))
