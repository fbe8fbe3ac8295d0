"""The model's vocabulary: tokenizing, token pieces, and the prompt-injection defence.

Threads: any. llama.cpp never changes a vocabulary after load, so request threads tokenize
while the worker decodes; the service keeps the engine's `close` from freeing it under them.

Prompts mix template text with text from requests. `tokenize_prompt` turns control-token
texts (`<|im_start|>`, ...) into control tokens only where the template wrote them: text
inside the given user spans is always tokenized as plain text, so a request cannot forge a
turn.
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp

# Tokens llama.cpp's special-token parsing splits out of text; with parse_special off it
# still splits USER_DEFINED ones, so only CONTROL and UNKNOWN can be forged.
_SPECIAL_ATTRS = (
    llama_cpp.LLAMA_TOKEN_ATTR_CONTROL
    | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
    | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
)
_FORGEABLE_ATTRS = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_UNKNOWN
_C_SPACE = " \t\n\v\f\r"  # what llama.cpp's isspace() strips next to LSTRIP/RSTRIP tokens


@dataclass(frozen=True)
class SpecialToken:
    """A token llama.cpp's special parsing splits out of text, with its attributes."""

    id: int
    text: str
    attr: int

    @property
    def forgeable(self) -> bool:
        """A control (or unknown) token: only the template may produce it."""
        return bool(self.attr & _FORGEABLE_ATTRS)


# A prompt cut at special tokens: token ids, and (start, end) spans of raw text.
_Fragment = int | tuple[int, int]


class Vocabulary:
    """A loaded model's vocabulary and chat template (the model outlives it: the engine
    frees both together)."""

    def __init__(self, model: llama_cpp.llama_model_p) -> None:
        self._model = model
        self._vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self._vocab))
        self.special_tokens = self._special_tokens()

    def chat_template_source(self) -> str | None:
        """The GGUF's chat template (tokenizer.chat_template), None when it carries none."""
        raw = llama_cpp.llama_model_chat_template(self._model, None)
        return bytes(raw).decode("utf-8") if raw else None

    def special_texts(self) -> tuple[str, str]:
        """The BOS and EOS tokens as text, for templates that spell them out."""
        return (
            self.piece(llama_cpp.llama_vocab_bos(self._vocab), special=True),
            self.piece(llama_cpp.llama_vocab_eos(self._vocab), special=True),
        )

    def _special_tokens(self) -> list[SpecialToken]:
        """The tokens llama.cpp's special parsing looks for, longest text first (its order)."""
        found = []
        for token in range(self.n_vocab):
            attr = int(llama_cpp.llama_vocab_get_attr(self._vocab, token))
            if not attr & _SPECIAL_ATTRS:
                continue
            raw = llama_cpp.llama_vocab_get_text(self._vocab, token)
            try:
                text = raw.decode("utf-8") if raw else ""
            except UnicodeDecodeError:
                continue  # never matched: request and template text are valid UTF-8 strings
            if text:
                found.append(SpecialToken(token, text, attr))
        found.sort(key=lambda special: len(special.text.encode("utf-8")), reverse=True)
        return found

    def tokenize(self, text: str) -> list[int]:
        """Tokenize text the template wrote entirely, parsing its special tokens (llama.cpp's
        own parsing), adding BOS if due. Text from a request goes through `tokenize_prompt`."""
        return self._with_bos(self._tokenize_raw(text, parse_special=True))

    def tokenize_prompt(self, text: str, user_spans: Sequence[tuple[int, int]]) -> list[int]:
        """Tokenize a rendered prompt whose `user_spans` (character ranges) came from a
        request: control tokens are parsed only where the template wrote them.

        This is llama.cpp's special-token parsing done here: cut the text at the special
        tokens (longest first, honouring their LSTRIP/RSTRIP whitespace rules), skipping
        any control-token occurrence that touches user text, then tokenize every piece
        as plain text. With no control-token text inside user spans the result is exactly
        `tokenize(text)`; a forged marker only becomes its own plain-text tokens.
        """
        fragments: list[_Fragment] = [(0, len(text))]
        for special in self.special_tokens:
            if special.text not in text:
                continue
            fragments = self._split_at(text, fragments, special, user_spans)
        tokens: list[int] = []
        for fragment in fragments:
            if isinstance(fragment, int):
                tokens.append(fragment)
            else:
                start, end = fragment
                tokens.extend(self._tokenize_raw(text[start:end], parse_special=False))
        return self._with_bos(tokens)

    def prompt_cut(self, text: str, user_spans: Sequence[tuple[int, int]]) -> int | None:
        """Where a rendered prompt may be cut so that its text from there on, with request
        text appended, tokenizes (`tokenize_prompt`) as the end of the whole does, the tokens
        before the cut unchanged: the start of the last special token the template wrote
        after every user span; None where that is not certain. The likelihood readout then
        tokenizes only this tail with each option, not the whole prompt again
        (adapter.option_branches).

        Why it holds: special-token parsing splits the text at special tokens and tokenizes
        each piece between them on its own, so text after a special token split out at the
        cut cannot change the tokens before it. That token is split out there, in the
        prompt alone and with any text appended, where no special token's text occurs, or
        could once text is appended, across the cut or starting inside the token (nor
        starting at the cut and running past the prompt's end), and where the cut is not
        whitespace that a neighbour's LSTRIP or RSTRIP would strip across it. Reads no
        native memory, so any thread may ask, even while the model closes.
        """
        after = max((end for _, end in user_spans), default=0)
        cut = max((text.rfind(special.text, after) for special in self.special_tokens), default=-1)
        if cut <= 0 or text[cut] in _C_SPACE:
            return None
        first = next(token for token in self.special_tokens if text.startswith(token.text, cut))
        for special in self.special_tokens:
            length = len(special.text)
            for start in range(max(0, cut - length + 1), cut + len(first.text)):
                piece = text[start : start + length]  # shorter at the end: text may follow
                if special.text.startswith(piece) and (start != cut or piece != special.text):
                    return None
        return cut

    @staticmethod
    def _split_at(
        text: str,
        fragments: list[_Fragment],
        special: SpecialToken,
        user_spans: Sequence[tuple[int, int]],
    ) -> list[_Fragment]:
        """Cut every raw fragment at the occurrences of one special token."""

        spans = sorted(user_spans)  # disjoint: only the last span starting before `end`
        starts = [span_start for span_start, _ in spans]  # can reach back past `start`

        def user_owned(start: int, end: int) -> bool:
            index = bisect.bisect_left(starts, end) - 1
            return index >= 0 and spans[index][1] > start

        result: list[_Fragment] = []
        length = len(special.text)
        for fragment in fragments:
            if isinstance(fragment, int):
                result.append(fragment)
                continue
            start, end = fragment
            search = start
            while True:
                match = text.find(special.text, search, end)
                if match < 0:
                    break
                if special.forgeable and user_owned(match, match + length):
                    search = match + 1  # request text: stays plain
                    continue
                left_end = match
                if special.attr & llama_cpp.LLAMA_TOKEN_ATTR_LSTRIP:
                    while left_end > start and text[left_end - 1] in _C_SPACE:
                        left_end -= 1
                if left_end > start:
                    result.append((start, left_end))
                result.append(special.id)
                start = search = match + length
                if special.attr & llama_cpp.LLAMA_TOKEN_ATTR_RSTRIP:
                    while start < end and text[start] in _C_SPACE:
                        start += 1
                    search = start
            if start < end:
                result.append((start, end))
        return result

    def _tokenize_raw(self, text: str, *, parse_special: bool) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buffer = (llama_cpp.llama_token * capacity)()
        count = llama_cpp.llama_tokenize(
            self._vocab, data, len(data), buffer, capacity, False, parse_special
        )
        if count < 0:
            capacity = -count
            buffer = (llama_cpp.llama_token * capacity)()
            count = llama_cpp.llama_tokenize(
                self._vocab, data, len(data), buffer, capacity, False, parse_special
            )
        return list(buffer[:count])

    def _with_bos(self, tokens: list[int]) -> list[int]:
        bos = int(llama_cpp.llama_vocab_bos(self._vocab))
        if llama_cpp.llama_vocab_get_add_bos(self._vocab) and (not tokens or tokens[0] != bos):
            tokens.insert(0, bos)
        return tokens

    def piece(self, token: int, *, special: bool = False) -> str:
        return self.piece_bytes(token, special=special).decode("utf-8", errors="replace")

    def piece_bytes(self, token: int, *, special: bool = False) -> bytes:
        """A token's raw bytes; one character may span several tokens, so decode later."""
        buffer = ctypes.create_string_buffer(256)
        length = llama_cpp.llama_token_to_piece(self._vocab, token, buffer, 256, 0, special)
        return buffer.raw[: max(length, 0)]

    @property
    def end_of_turn(self) -> int:
        """The token that ends an assistant's turn: end-of-turn where the vocabulary has
        one, else end-of-sequence (the likelihood readout scores it after each option)."""
        eot = int(llama_cpp.llama_vocab_eot(self._vocab))
        return eot if eot >= 0 else int(llama_cpp.llama_vocab_eos(self._vocab))

    def is_end(self, token: int) -> bool:
        """An end-of-generation token (EOS, EOT, ...)."""
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))
