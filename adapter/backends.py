"""Load and name ggml compute backends (CPU variants, CUDA) before the model is loaded.

The llama.cpp DLC builds its backends as dlopen-able libraries (GGML_BACKEND_DL), so a
process reusing its libllama via LLAMA_CPP_LIB_PATH sees no backend at all until it loads
them from that directory; the pip-built binding links its CPU backend statically. Either
way the names are reported so operators can see on which hardware the model runs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path


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
