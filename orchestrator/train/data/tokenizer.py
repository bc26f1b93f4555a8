"""Tokenizers: the built-in byte-level one (no download needed) and a model's own.

``builtin:byte-level`` maps every UTF-8 byte to one token (ids 0..255, in byte
order) plus three specials, so any text, Chinese included, round-trips exactly.
It carries a ChatML chat template (the format Qwen models use), so tiny test
models exercise the same chat-template path as real ones.
"""

from __future__ import annotations

from ...planning.chattemplate import CHATML_TEMPLATE

BUILTIN_BYTE_LEVEL = "builtin:byte-level"
PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIALS = (PAD, IM_START, IM_END)
BYTE_LEVEL_VOCAB = 256 + len(SPECIALS)


def _byte_to_char() -> dict[int, str]:
    # Printable bytes stand for themselves; the rest are moved to code points from
    # 256 up, so every byte has a visible, non-whitespace character (the byte-level
    # pre-tokenizer of the tokenizers library uses this same mapping).
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping = {b: chr(b) for b in keep}
    shift = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shift)
            shift += 1
    return mapping


def build_byte_level_tokenizer():
    """A fast tokenizer: 256 byte tokens, then ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in _byte_to_char().items()}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting is needed when every byte is its own token.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIALS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=IM_END)
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.model_max_length = 1 << 30
    return tokenizer


def load_tokenizer(name: str | None, model_name_or_path: str):
    """``model.tokenizer`` (or the model's own directory/hub id) as a transformers tokenizer."""
    if name == BUILTIN_BYTE_LEVEL:
        return build_byte_level_tokenizer()
    if name and name.startswith("builtin:"):
        raise ValueError(f"model.tokenizer: unknown built-in tokenizer {name!r}; known: {BUILTIN_BYTE_LEVEL}")
    from transformers import AutoTokenizer

    source = name or model_name_or_path
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        # Padding positions never count in the loss (labels -100), so eos serves as pad.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
