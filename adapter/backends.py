"""Load and name ggml compute backends (CPU variants, CUDA) before the model is loaded.

The llama.cpp DLC builds its backends as dlopen-able libraries (GGML_BACKEND_DL), so a
process reusing its libllama via LLAMA_CPP_LIB_PATH sees no backend at all until it loads
them from that directory; the pip-built binding links its CPU backend statically. Either
way the names are reported so operators can see on which hardware the model runs. The CPU
backend also reports the library it came from, the features it was built for and the extra
weight buffer types it offers (adapter/weight_buffers.py decides which of those the weights
may use).

The DLC ships one CPU backend library per CPU family, and ggml's registry loads the one
whose own score is highest on the host: every variant whose instruction sets the CPU has
scores, and AMX adds the highest bit, so a Sapphire Rapids host gets the AMX variant, whose
weight buffers crash. No environment variable steers that choice (GGML_BACKEND_PATH only
adds a backend after it), and loading another variant by path would mean replacing the
registry's whole loading loop in code that runs only on AMX hosts. So the image build
deletes the variants built with AMX (`drop_amx_variants`) and the registry, unchanged,
picks the best one left, as it does on every other host.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

from adapter.weight_buffers import CpuBackend

_DEVICE_TYPE_CPU = 0  # enum ggml_backend_dev_type
# ggml compiles its AMX kernels only into a CPU backend built for AMX (ggml-cpu/amx/, under
# __AMX_INT8__), and their names, ggml_backend_amx_*, are in such a library's symbol table
# and in the log strings it keeps even when stripped; no other ggml library holds them.
_AMX_KERNEL_NAMES = b"ggml_backend_amx_"
# How ggml's registry recognizes a CPU backend variant: libggml-cpu-<family>.so.
_CPU_VARIANTS = "libggml-cpu-*.so"
_CPUINFO = Path("/proc/cpuinfo")


class _Feature(ctypes.Structure):
    """struct ggml_backend_feature: one name/value pair of a backend's feature list."""

    _fields_ = [("name", ctypes.c_char_p), ("value", ctypes.c_char_p)]


# ggml_backend_get_features_t and ggml_backend_dev_get_extra_bufts_t
_GET_FEATURES = ctypes.CFUNCTYPE(ctypes.POINTER(_Feature), ctypes.c_void_p)
_GET_EXTRA_BUFTS = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


class _DlInfo(ctypes.Structure):
    """Dl_info, as dladdr fills it: the file a loaded address belongs to (and more)."""

    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


class BackendLoadError(RuntimeError):
    """The llama.cpp build directory holds no loadable libggml, or its CPU variants cannot
    be made free of AMX."""


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


def _names_amx_kernels(library: Path) -> bool:
    """Whether the file holds the AMX kernels' names (mapped, not read: a CUDA backend
    library is hundreds of MiB)."""
    if library.stat().st_size == 0:
        return False
    with library.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return data.find(_AMX_KERNEL_NAMES) >= 0


def amx_libraries(lib_dir: Path) -> list[Path]:
    """The ggml libraries in `lib_dir` built with llama.cpp's AMX kernels, read from the
    files, never loaded, so the check is the same on any build host."""
    return [
        path
        for path in sorted(lib_dir.glob("libggml*.so*"))
        if path.is_file() and _names_amx_kernels(path)
    ]


def drop_amx_variants(lib_dir: Path) -> list[str]:
    """Delete the CPU backend variants built with AMX from a GGML_BACKEND_DL build (the
    image build runs this on the DLC's directory), so ggml's registry picks the best variant
    without AMX, whose CPU_REPACK `auto` keeps; returns the names deleted. Deletes nothing and
    fails when an AMX library is no CPU variant (the registry would still load it) or when
    no variant would be left."""
    variants = set(lib_dir.glob(_CPU_VARIANTS))
    found = amx_libraries(lib_dir)
    other = [path.name for path in found if path not in variants]
    if other:
        raise BackendLoadError(
            f"{', '.join(other)} in {lib_dir} carry llama.cpp's AMX kernels and are not CPU "
            f"backend variants ({_CPU_VARIANTS}) that can be left out"
        )
    if variants and variants <= set(found):
        raise BackendLoadError(
            f"every CPU backend variant in {lib_dir} carries AMX kernels: none would be left"
        )
    for path in found:
        path.unlink()
    return [path.name for path in found]


def _library_of(address: int) -> str:
    """The file name of the loaded library that holds `address` (dladdr)."""
    info = _DlInfo()
    if ctypes.CDLL(None).dladdr(ctypes.c_void_p(address), ctypes.byref(info)) and info.dli_fname:
        return Path(info.dli_fname.decode()).name
    return "unknown library"


def host_has_amx(cpuinfo: Path = _CPUINFO) -> bool:
    """Whether the kernel reports AMX on this CPU (the amx_int8 flag; Linux only)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    return any(
        line.startswith("flags") and "amx_int8" in line.split() for line in text.splitlines()
    )


def cpu_backend(external_lib_dir: Path | None) -> CpuBackend:
    """What the loaded CPU backend reports (call after `load_backends`): the library it was
    loaded from, its feature list and, in llama.cpp's order of preference, the extra buffer
    types it offers for weights. A backend without either entry point reports none of them."""
    library = _ggml(external_lib_dir or bundled_lib_dir())
    host_amx = host_has_amx()
    device = library.ggml_backend_dev_by_type(_DEVICE_TYPE_CPU)
    if not device:
        return CpuBackend(library="none", features={}, extra_buffer_types=(), host_amx=host_amx)
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
    return CpuBackend(
        # The registry is a static object of the backend library, so its address names it.
        library=_library_of(registry),
        features=features,
        extra_buffer_types=tuple(extra),
        host_amx=host_amx,
    )
