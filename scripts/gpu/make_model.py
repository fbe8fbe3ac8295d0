"""Write a random-weight llama GGUF of a chosen shape, on the tiny model's byte alphabet.

The GPU check needs a model whose compute cost is realistic (a Qwen2.5-0.5B-sized llama in
f16: 24 layers, grouped-query attention, a 151,936-token vocabulary) but no download: the
GPU machine has no network, and 1.3 GB does not fit the 64 MiB that may travel. Weights are
noise, so only timings and plumbing mean anything. The tokenizer is the tiny test model's
byte-level alphabet, control tokens and chat template (`model_build.tiny_gguf`), plus merges
of every lowercase letter pair, space + lowercase letter and digit pair: English text then
takes about one token per 1.6 characters, so a decision of ~300 tokens is a plausible
length of text (the tiny model's four merges give nearly a token per byte, and the
adapter's prompt scaffolding alone, system prompt, options and template, is over 300).
No merge crosses a letter/digit or whitespace boundary, so the answer letters still append
as single tokens. The vocabulary is padded with tokens no merge can produce, so the output
layer has a real model's width without changing how any text tokenizes.
"""

from __future__ import annotations

import argparse
import string
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from model_build.tiny_gguf import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    LlamaHeader,
    add_llama_header,
    byte_level_alphabet,
)

_LOWER = string.ascii_lowercase
MERGES = (
    *(("Ġ", letter) for letter in _LOWER),  # "Ġ" is the byte-level alphabet's space
    *((first, second) for first in _LOWER for second in _LOWER),
    *((first, second) for first in string.digits for second in string.digits),
)
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3
_WEIGHT_STD = 0.02  # the usual init scale: activations stay far from f16 overflow


@dataclass(frozen=True)
class Shape:
    """Model dimensions; `n_vocab` includes the byte alphabet, merges and control tokens."""

    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    context_length: int

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...]]]:
        """Every tensor's name and numpy shape (rows = outputs), in file order."""
        kv = self.n_head_kv * self.head_dim
        yield "token_embd.weight", (self.n_vocab, self.n_embd)
        yield "output_norm.weight", (self.n_embd,)
        yield "output.weight", (self.n_vocab, self.n_embd)
        for layer in range(self.n_layer):
            prefix = f"blk.{layer}"
            yield f"{prefix}.attn_norm.weight", (self.n_embd,)
            yield f"{prefix}.attn_q.weight", (self.n_embd, self.n_embd)
            yield f"{prefix}.attn_k.weight", (kv, self.n_embd)
            yield f"{prefix}.attn_v.weight", (kv, self.n_embd)
            yield f"{prefix}.attn_output.weight", (self.n_embd, self.n_embd)
            yield f"{prefix}.ffn_norm.weight", (self.n_embd,)
            yield f"{prefix}.ffn_gate.weight", (self.n_ff, self.n_embd)
            yield f"{prefix}.ffn_up.weight", (self.n_ff, self.n_embd)
            yield f"{prefix}.ffn_down.weight", (self.n_embd, self.n_ff)

    def parameter_count(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.tensors())


SHAPES = {
    # Qwen2.5-0.5B's dimensions in the llama architecture: ~0.63B parameters, 1.3 GB in f16.
    "gpu": Shape(
        n_vocab=151_936, n_embd=896, n_layer=24, n_head=14, n_head_kv=2, n_ff=4864,
        context_length=32_768,
    ),
    # The same layout at toy size, for tests and `gpu-check.sh run --cpu` on a small machine.
    "small": Shape(
        n_vocab=2048, n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128,
        context_length=16_384,
    ),
}  # fmt: skip


def vocabulary(n_vocab: int) -> tuple[list[str], list[int]]:
    """Tokens and their types: bytes, merges, padding (unreachable), then control tokens."""
    tokens = [*byte_level_alphabet(), *("".join(pair) for pair in MERGES)]
    padding = n_vocab - len(tokens) - len(SPECIAL_TOKENS)
    if padding < 0:
        raise ValueError(f"n_vocab {n_vocab} is below the tokenizer's own {len(tokens)} tokens")
    tokens += [f"<pad_{index}>" for index in range(padding)]
    types = [_TOKEN_NORMAL] * len(tokens) + [_TOKEN_CONTROL] * len(SPECIAL_TOKENS)
    return [*tokens, *SPECIAL_TOKENS], types


def _tensor(
    name: str, shape: tuple[int, ...], rng: np.random.Generator
) -> npt.NDArray[np.float16] | npt.NDArray[np.float32]:
    """Norm weights are ones in f32 (llama.cpp keeps norms in f32); matrices are f16 noise."""
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    values = rng.standard_normal(shape, dtype=np.float32)
    values *= _WEIGHT_STD
    return values.astype(np.float16)


def write_model(path: Path, shape: Shape, *, seed: int = 0) -> Path:
    """Write the model to `path`, one tensor at a time so memory stays at one tensor."""
    import gguf

    tokens, types = vocabulary(shape.n_vocab)
    writer = gguf.GGUFWriter(str(path), "llama")
    add_llama_header(
        writer,
        LlamaHeader(
            name="semif-gpu-check-random-llama",
            file_type=gguf.LlamaFileType.MOSTLY_F16,
            context_length=shape.context_length,
            n_embd=shape.n_embd,
            n_layer=shape.n_layer,
            n_ff=shape.n_ff,
            n_head=shape.n_head,
            n_head_kv=shape.n_head_kv,
            rms_eps=1e-6,
            tokens=tokens,
            token_types=types,
            merges=list(MERGES),
            chat_template=CHAT_TEMPLATE,
        ),
    )
    for name, dims in shape.tensors():
        dtype = np.dtype(np.float32 if len(dims) == 1 else np.float16)
        writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in shape.tensors():
        writer.write_tensor_data(_tensor(name, dims, rng))
    writer.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    args.path.parent.mkdir(parents=True, exist_ok=True)
    write_model(args.path, shape, seed=args.seed)
    print(f"{args.path}: {args.shape} {asdict(shape)}, {shape.parameter_count():,} parameters")


if __name__ == "__main__":
    main()
