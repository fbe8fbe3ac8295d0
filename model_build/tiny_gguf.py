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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class TinyVocabulary:
    """The byte-level BPE vocabulary every tiny model shares: 256 byte tokens, a few merges,
    then the control tokens (in that order, so token ids agree across the tiny models)."""

    tokens: list[str]
    token_types: list[int]
    merges: list[tuple[str, str]]


def tiny_vocabulary(*, fuse_answer_letter: bool = False) -> TinyVocabulary:
    """The tiny models' vocabulary; `fuse_answer_letter` adds the merge "t"+"A" (see the
    module docstring)."""
    merges = [("Ġ", "t"), ("h", "e"), ("Ġ", "a"), ("i", "n")]
    if fuse_answer_letter:
        merges.append(("t", "A"))
    tokens = [*byte_level_alphabet(), *("".join(pair) for pair in merges), *SPECIAL_TOKENS]
    n_normal = len(tokens) - len(SPECIAL_TOKENS)
    token_types = [_TOKEN_NORMAL] * n_normal + [_TOKEN_CONTROL] * len(SPECIAL_TOKENS)
    return TinyVocabulary(tokens, token_types, merges)


@dataclass(frozen=True, kw_only=True)
class LlamaHeader:
    """The GGUF metadata of a random llama with this module's byte-level BPE tokenizer."""

    name: str
    file_type: int  # a gguf.LlamaFileType
    context_length: int
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    rms_eps: float
    tokens: list[str]
    token_types: list[int]
    merges: list[tuple[str, str]]
    chat_template: str | None


def add_llama_header(writer: Any, header: LlamaHeader) -> None:
    """Write `header` into a `gguf.GGUFWriter`: the shape, the tokenizer (BOS <|endoftext|>,
    EOS <|im_end|>, no BOS added) and the chat template, so every generated model is one
    llama.cpp loads and the adapter's label checks accept."""
    writer.add_name(header.name)
    writer.add_file_type(header.file_type)
    writer.add_context_length(header.context_length)
    writer.add_embedding_length(header.n_embd)
    writer.add_block_count(header.n_layer)
    writer.add_feed_forward_length(header.n_ff)
    writer.add_head_count(header.n_head)
    writer.add_head_count_kv(header.n_head_kv)
    writer.add_rope_dimension_count(header.n_embd // header.n_head)
    writer.add_layer_norm_rms_eps(header.rms_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(header.tokens)
    writer.add_token_types(header.token_types)
    writer.add_token_merges([f"{left} {right}" for left, right in header.merges])
    writer.add_bos_token_id(header.tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(header.tokens.index("<|im_end|>"))
    writer.add_add_bos_token(False)
    if header.chat_template is not None:
        writer.add_chat_template(header.chat_template)


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

    vocab = tiny_vocabulary(fuse_answer_letter=fuse_answer_letter)
    if fuse_answer_letter:
        chat_template = _FUSING_TEMPLATE
    tokens, token_types, merges = vocab.tokens, vocab.token_types, vocab.merges
    n_vocab = len(tokens)
    n_head = 2
    n_ff = 2 * n_embd
    weights = _random_weights(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    add_llama_header(
        writer,
        LlamaHeader(
            name="tiny-random-llama",
            file_type=gguf.LlamaFileType.ALL_F32,
            context_length=context_length,
            n_embd=n_embd,
            n_layer=n_layer,
            n_ff=n_ff,
            n_head=n_head,
            n_head_kv=n_head,
            rms_eps=1e-5,
            tokens=tokens,
            token_types=token_types,
            merges=merges,
            chat_template=chat_template,
        ),
    )

    _add_embeddings(writer, weights, n_vocab, n_embd)
    for layer in range(n_layer):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", _ones(n_embd))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"{prefix}.{name}.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", _ones(n_embd))
        _add_ffn(writer, weights, prefix, n_embd, n_ff)
    _write(writer)
    return path


_QWEN35_ROPE_SECTIONS = (6, 5, 5, 0)  # IMROPE text/height/width/extra pairs; 16 = head_dim / 2


def write_tiny_hybrid_gguf(
    path: Path,
    *,
    chat_template: str | None = CHAT_TEMPLATE,
    fuse_answer_letter: bool = False,
    seed: int = 0,
    n_embd: int = 64,
    n_layer: int = 4,
    full_attention_interval: int = 4,
    context_length: int = 2048,
) -> Path:
    """Write a tiny random Qwen3.5 (llama.cpp architecture `qwen35`) to `path` and return it;
    the same arguments give the same bytes.

    Qwen3.5 is a hybrid: gated-delta-net layers keep one recurrent state per sequence (no
    per-token cells), and every `full_attention_interval`-th layer is full attention with a
    per-token KV cache. Such a model's memory can copy a whole sequence exactly but refuses
    to drop a sequence's tail, which the adapter's prefix reuse must respect; this model lets
    tests exercise that path in milliseconds, with the same tokenizer and chat template as
    `write_tiny_gguf`. The default is the production layout in miniature: three recurrent
    layers then one attention layer, with more value heads than key heads (as in Qwen3.5)
    and grouped-query attention. Tensor shapes follow llama.cpp's `llama_model_qwen35`
    loader (src/models/qwen35.cpp in llama-cpp-python 0.3.36); weights are f32.
    """
    import gguf

    n_head, n_head_kv = 2, 1
    head_dim = n_embd // n_head
    n_ff = 2 * n_embd
    # Gated delta net: key heads (ssm.group_count) x state size for q and k, value heads
    # (ssm.time_step_rank) x state size for v; llama.cpp needs inner size = value dim.
    d_state, n_k_heads, n_v_heads, d_conv = 16, 2, 4, 4
    key_dim, value_dim = d_state * n_k_heads, d_state * n_v_heads
    conv_dim = 2 * key_dim + value_dim
    weights, ones = _random_weights(seed), _ones
    writer, n_vocab = _grouped_query_writer(
        path,
        gguf.MODEL_ARCH.QWEN35,
        chat_template=chat_template,
        fuse_answer_letter=fuse_answer_letter,
        n_embd=n_embd,
        n_layer=n_layer,
        context_length=context_length,
    )
    writer.add_rope_dimension_sections(list(_QWEN35_ROPE_SECTIONS))
    writer.add_full_attention_interval(full_attention_interval)
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(value_dim)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(n_v_heads)
    writer.add_ssm_group_count(n_k_heads)

    _add_embeddings(writer, weights, n_vocab, n_embd)
    for layer in range(n_layer):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", ones(n_embd))
        writer.add_tensor(f"{prefix}.post_attention_norm.weight", ones(n_embd))
        if (layer + 1) % full_attention_interval == 0:  # full attention, llama.cpp's rule
            # attn_q carries the query and its output gate, interleaved per head.
            writer.add_tensor(f"{prefix}.attn_q.weight", weights(2 * n_head * head_dim, n_embd))
            writer.add_tensor(f"{prefix}.attn_k.weight", weights(n_head_kv * head_dim, n_embd))
            writer.add_tensor(f"{prefix}.attn_v.weight", weights(n_head_kv * head_dim, n_embd))
            writer.add_tensor(f"{prefix}.attn_output.weight", weights(n_embd, n_head * head_dim))
            writer.add_tensor(f"{prefix}.attn_q_norm.weight", ones(head_dim))
            writer.add_tensor(f"{prefix}.attn_k_norm.weight", ones(head_dim))
        else:  # gated delta net
            writer.add_tensor(f"{prefix}.attn_qkv.weight", weights(conv_dim, n_embd))
            writer.add_tensor(f"{prefix}.attn_gate.weight", weights(value_dim, n_embd))
            writer.add_tensor(f"{prefix}.ssm_conv1d.weight", weights(conv_dim, d_conv))
            writer.add_tensor(f"{prefix}.ssm_dt.bias", weights(n_v_heads))
            # ssm_a is -exp(A_log): negative, so the state decays.
            writer.add_tensor(f"{prefix}.ssm_a", -np.exp(weights(n_v_heads)))
            writer.add_tensor(f"{prefix}.ssm_beta.weight", weights(n_v_heads, n_embd))
            writer.add_tensor(f"{prefix}.ssm_alpha.weight", weights(n_v_heads, n_embd))
            writer.add_tensor(f"{prefix}.ssm_norm.weight", ones(d_state))
            writer.add_tensor(f"{prefix}.ssm_out.weight", weights(n_embd, value_dim))
        _add_ffn(writer, weights, prefix, n_embd, n_ff)
    _write(writer)
    return path


def write_tiny_swa_gguf(
    path: Path,
    *,
    chat_template: str | None = CHAT_TEMPLATE,
    fuse_answer_letter: bool = False,
    seed: int = 0,
    n_embd: int = 32,
    n_layer: int = 4,
    sliding_window: int = 8,
    context_length: int = 2048,
) -> Path:
    """Write a tiny random Gemma 3 (llama.cpp architecture `gemma3`) to `path` and return it;
    the same arguments give the same bytes.

    Gemma 3 interleaves sliding-window attention (a layer attends to the last
    `sliding_window` positions only) with full attention: llama.cpp keeps the two kinds in
    two KV caches (`llama_kv_cache_iswa`), and may reuse a sliding-window layer's cells once
    every later position has left them behind, which the adapter's prefix reuse must
    respect. The window is a few tokens here, so short test prompts cross it many times.
    The layout is the production one in miniature: every second layer is full attention
    (Gemma 3 has one in six), grouped-query attention with query and key norms, norms after
    attention and after the feed-forward block, a different RoPE base per kind. Tensor
    shapes follow llama.cpp's `llama_model_gemma3` loader (src/models/gemma3.cpp in
    llama-cpp-python 0.3.36); the output head is tied to the embeddings, as in Gemma 3.
    """
    import gguf

    n_head, n_head_kv = 2, 1
    head_dim = n_embd // n_head
    n_ff = 2 * n_embd
    weights, ones = _random_weights(seed), _ones
    writer, n_vocab = _grouped_query_writer(
        path,
        gguf.MODEL_ARCH.GEMMA3,
        chat_template=chat_template,
        fuse_answer_letter=fuse_answer_letter,
        n_embd=n_embd,
        n_layer=n_layer,
        context_length=context_length,
    )
    writer.add_sliding_window(sliding_window)
    writer.add_sliding_window_pattern(2)  # layers 0, 2, ... slide; 1, 3, ... see everything
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_rope_freq_base_swa(10_000.0)

    writer.add_tensor("token_embd.weight", weights(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", ones(n_embd))
    for layer in range(n_layer):
        prefix = f"blk.{layer}"
        writer.add_tensor(f"{prefix}.attn_norm.weight", ones(n_embd))
        writer.add_tensor(f"{prefix}.attn_q.weight", weights(n_head * head_dim, n_embd))
        writer.add_tensor(f"{prefix}.attn_k.weight", weights(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"{prefix}.attn_v.weight", weights(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"{prefix}.attn_output.weight", weights(n_embd, n_head * head_dim))
        writer.add_tensor(f"{prefix}.attn_q_norm.weight", ones(head_dim))
        writer.add_tensor(f"{prefix}.attn_k_norm.weight", ones(head_dim))
        writer.add_tensor(f"{prefix}.post_attention_norm.weight", ones(n_embd))
        writer.add_tensor(f"{prefix}.ffn_norm.weight", ones(n_embd))
        _add_ffn(writer, weights, prefix, n_embd, n_ff)
        writer.add_tensor(f"{prefix}.post_ffw_norm.weight", ones(n_embd))
    _write(writer)
    return path


def _grouped_query_writer(
    path: Path,
    arch: Any,
    *,
    chat_template: str | None,
    fuse_answer_letter: bool,
    n_embd: int,
    n_layer: int,
    context_length: int,
) -> tuple[Any, int]:
    """A GGUF writer for `arch` (a gguf.MODEL_ARCH) with the tiny vocabulary and template
    written, and the shape the qwen35 and gemma3 writers share: two query heads over one
    key/value head (grouped-query attention), a feed-forward twice as wide. Returns it and
    the vocabulary's size."""
    import gguf

    vocab = tiny_vocabulary(fuse_answer_letter=fuse_answer_letter)
    if fuse_answer_letter:
        chat_template = _FUSING_TEMPLATE
    name = gguf.MODEL_ARCH_NAMES[arch]
    writer = gguf.GGUFWriter(str(path), name)
    add_llama_header(
        writer,
        LlamaHeader(
            name=f"tiny-random-{name}",
            file_type=gguf.LlamaFileType.ALL_F32,
            context_length=context_length,
            n_embd=n_embd,
            n_layer=n_layer,
            n_ff=2 * n_embd,
            n_head=2,
            n_head_kv=1,
            rms_eps=1e-6,
            tokens=vocab.tokens,
            token_types=vocab.token_types,
            merges=vocab.merges,
            chat_template=chat_template,
        ),
    )
    writer.add_key_length(n_embd // 2)
    writer.add_value_length(n_embd // 2)
    return writer, len(vocab.tokens)


Weights = Callable[..., np.ndarray]


def _random_weights(seed: int) -> Weights:
    """Deterministic f32 weights by shape (numpy order: ggml's dimensions reversed); the
    same seed and the same sequence of shapes give the same bytes."""
    rng = np.random.default_rng(seed)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    return weights


def _ones(size: int) -> np.ndarray:
    return np.ones(size, dtype=np.float32)


def _add_embeddings(writer: Any, weights: Weights, n_vocab: int, n_embd: int) -> None:
    writer.add_tensor("token_embd.weight", weights(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", _ones(n_embd))
    writer.add_tensor("output.weight", weights(n_vocab, n_embd))


def _add_ffn(writer: Any, weights: Weights, prefix: str, n_embd: int, n_ff: int) -> None:
    writer.add_tensor(f"{prefix}.ffn_gate.weight", weights(n_ff, n_embd))
    writer.add_tensor(f"{prefix}.ffn_up.weight", weights(n_ff, n_embd))
    writer.add_tensor(f"{prefix}.ffn_down.weight", weights(n_embd, n_ff))


def _write(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    """Command line: write a tiny GGUF (used by the image smoke test)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_tiny_gguf(args.path, seed=args.seed))


if __name__ == "__main__":
    main()
