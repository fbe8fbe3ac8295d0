"""Write a tiny random-weight llama GGUF with a byte-level BPE vocabulary and a chat template.

Tests and the image smoke test need a real model that llama.cpp loads in milliseconds.
Its answers are noise, but its tokenizer behaves like a production one: every byte is a
token, a handful of merges exist, and the chat template uses control tokens. The
`fuse_answer_letter` switch adds a merge that breaks the adapter's answer-slot
precondition (its template ends the prompt inside a word, and a merge fuses the letter
"A" with that word's last character), so tests can check that such a model is refused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_FUSING_TEMPLATE = CHAT_TEMPLATE.replace("assistant\n{% endif %}", "assistant{% endif %}")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3


def byte_level_alphabet() -> list[str]:
    """GPT-2's reversible byte-to-character map: 256 distinct printable characters."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars: dict[int, str] = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in chars:
            chars[byte] = chr(256 + extra)
            extra += 1
    return [chars[byte] for byte in range(256)]


def write_tiny_gguf(
    path: Path,
    *,
    fuse_answer_letter: bool = False,
    chat_template: str | None = CHAT_TEMPLATE,
    seed: int = 0,
    n_embd: int = 32,
    n_layer: int = 2,
    context_length: int = 2048,
) -> Path:
    """Write the model to `path` and return it; the same arguments give the same bytes."""
    import gguf  # the writer is only needed here, not by importers of CHAT_TEMPLATE

    alphabet = byte_level_alphabet()
    merges = [("Ġ", "t"), ("h", "e"), ("Ġ", "a"), ("i", "n")]
    if fuse_answer_letter:
        merges.append(("t", "A"))
        chat_template = _FUSING_TEMPLATE
    tokens = [*alphabet, *("".join(pair) for pair in merges), *SPECIAL_TOKENS]
    token_types = [_TOKEN_NORMAL] * (len(tokens) - len(SPECIAL_TOKENS)) + [_TOKEN_CONTROL] * len(
        SPECIAL_TOKENS
    )
    n_vocab = len(tokens)
    n_head = 2
    n_ff = 2 * n_embd
    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-random-llama")
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(context_length)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges([f"{left} {right}" for left, right in merges])
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)

    writer.add_tensor("token_embd.weight", weights(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", weights(n_vocab, n_embd))
    for layer in range(n_layer):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{prefix}.{name}.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{prefix}.ffn_gate.weight", weights(n_ff, n_embd))
        writer.add_tensor(f"{prefix}.ffn_up.weight", weights(n_ff, n_embd))
        writer.add_tensor(f"{prefix}.ffn_down.weight", weights(n_embd, n_ff))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main() -> None:
    """Command line: write a tiny GGUF (used by the image smoke test)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_gguf(args.path, seed=args.seed))


if __name__ == "__main__":
    main()
