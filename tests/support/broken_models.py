"""GGUFs broken on purpose: weights rewritten in place, as flipped bytes or a bad
conversion would leave them, for the tests of what the server refuses to load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

Rewrite = Callable[[npt.NDArray[np.float32]], npt.NDArray[np.float32]]


def rewrite_tensor(path: Path, name: str, rewrite: Rewrite) -> None:
    """Overwrite one f32 tensor of the GGUF at `path` in place (same size, same layout)."""
    reader = gguf.GGUFReader(str(path), "r+")
    for tensor in reader.tensors:
        if tensor.name == name:
            tensor.data[...] = rewrite(np.asarray(tensor.data, dtype=np.float32))
            reader.data.flush()
            return
    raise KeyError(f"{path} has no tensor {name!r}")


def poison_with_nan(path: Path) -> None:
    """Every logit becomes NaN."""
    rewrite_tensor(path, "output_norm.weight", lambda data: np.full_like(data, np.nan))


def crush_letter_mass(path: Path) -> None:
    """Logits scaled 1000x: all probability on one non-letter token, letters ~0."""
    rewrite_tensor(path, "output_norm.weight", lambda data: data * 1000.0)


def perturb_output(path: Path) -> None:
    """Change the output projection (a model changed in place after it was verified)."""
    rewrite_tensor(path, "output.weight", lambda data: data[::-1].copy())
