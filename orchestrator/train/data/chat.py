"""A conversation → training examples through a chat template, labels on the tokens themselves (no torch).

For every assistant turn *i* the template renders two texts: the conversation before the turn
with the generation prompt (``prompt_i``) and the conversation up to and including it
(``upto_i``). The turn's answer is the part of ``upto_i`` after ``prompt_i``. Turns go into one
example while the example's text so far is a prefix of the next turn's prompt (ChatML, Llama 3:
the history stays as it was). A template that re-renders the history (Qwen3 drops earlier
turns' reasoning, and renders a finished turn without its think block) breaks that: the row is
then split, and turn *i* starts a new example whose prompt is the history exactly as the
template renders it at inference. So every assistant turn is trained, each in the context the
model will see.

Each example's text is then tokenized once, whole, and a token is trained where its characters
overlap an answer (the fast tokenizer's offsets): the labels sit on the ids of the sequence
itself, so a token that merges across the prompt's end is the answer's first token, not a
token cut in two. Tokenizing the prompt and the answer apart (the old encoder) gave ids the
text never tokenizes to. A slow tokenizer (no offsets) falls back to pieces cut at the spans.

Cost per row of *T* assistant turns and *L* tokens: 2*T* renderings (Jinja, each up to the
row's length, so O(T·L) characters) and one tokenization of each example: *L* tokens for a row
that stays one example, about (*T*+1)/2·*L* for one split per turn (its history repeated, and
trained on, in each example). The tokenizer is called once per chunk of rows.

Reasoning: an assistant turn's ``reasoning_content`` goes to the template under that key when
the template reads it (Qwen3's does); for one that does not, it is kept as a
``<think>\\n…\\n</think>\\n\\n`` block at the head of the content (the form Qwen3 renders) rather
than dropped. ``data.enable_thinking`` reaches the template as ``enable_thinking`` (not passed
for ``auto``); ``false`` also removes every turn's reasoning (``reasoning_content`` and a
``<think>`` block in the content), as LLaMA-Factory's ``enable_thinking: false`` does, so
under Qwen3's template the empty think block lands in the prompt (no loss). README.md,
"Chat templates and reasoning", has the decision and its sources.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...planning.chattemplate import AUTO, ChatTemplate
from ...planning.datarows import DataError

IGNORE = -100
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

Render = Callable[[list[dict[str, str]], bool], str]


def plain_render(messages: list[dict[str, str]], eos: str, add_generation_prompt: bool = False) -> str:
    """The documented plain template (``conversations`` module docstring), for tokenizers without one."""
    parts = []
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "system":
            parts.append(f"{content}\n\n")
        elif role == "user":
            parts.append(f"### Instruction:\n{content}\n\n")
        else:
            parts.append(f"### Response:\n{content}{eos}\n\n")
    if add_generation_prompt:
        parts.append("### Response:\n")
    return "".join(parts)


@dataclass(frozen=True)
class ChatRenderer:
    """How conversations become text: the template, what it reads, and how the summary line names it."""

    render: Render
    description: str  # "qwen3.jinja (file, sha256 1a2b…)", "auto: the tokenizer's own (sha256 …)", ...
    reads_reasoning: bool  # the template reads reasoning_content itself
    enable_thinking: object = AUTO  # True | False | "auto"


def make_renderer(tokenizer: Any, template: ChatTemplate | None = None, enable_thinking: object = AUTO) -> ChatRenderer:
    """The renderer for ``data.template`` (``None``: auto) and ``data.enable_thinking`` on this tokenizer."""
    template = template or ChatTemplate(AUTO, None)
    extra = {} if enable_thinking == AUTO else {"enable_thinking": enable_thinking}
    eos = getattr(tokenizer, "eos_token", None) or ""

    def plain(messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return plain_render(messages, eos, generation_prompt)

    def jinja(text: str | None) -> Render:
        chosen = {} if text is None else {"chat_template": text}

        def render(messages: list[dict[str, str]], generation_prompt: bool) -> str:
            if not messages:
                return ""
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, **chosen, **extra
            )

        return render

    if template.name == AUTO:
        own = getattr(tokenizer, "chat_template", None)
        if not own:
            return ChatRenderer(plain, "auto: plain (the tokenizer has no chat template)", False, enable_thinking)
        digest = ChatTemplate(AUTO, str(own)).digest
        return ChatRenderer(
            jinja(None), f"auto: the tokenizer's own (sha256 {digest})", _reads_reasoning(str(own)), enable_thinking
        )
    if template.text is None:  # plain
        return ChatRenderer(plain, "plain (built-in)", False, enable_thinking)
    kind = "file" if template.name.endswith((".jinja", ".j2", ".jinja2")) or "/" in template.name else "built-in"
    return ChatRenderer(
        jinja(template.text),
        f"{template.name} ({kind}, sha256 {template.digest})",
        _reads_reasoning(template.text),
        enable_thinking,
    )


def _reads_reasoning(source: str) -> bool:
    return "reasoning_content" in source


def split_think(content: str) -> tuple[str | None, str]:
    """A leading ``<think>…</think>`` block of ``content`` and the rest (as Qwen3's template splits it)."""
    if THINK_CLOSE not in content:
        return None, content
    head, _, rest = content.partition(THINK_CLOSE)
    if THINK_OPEN not in head and head.strip():
        return None, content  # a stray closing tag inside ordinary text: leave the text alone
    return head.split(THINK_OPEN)[-1].strip("\n"), rest.lstrip("\n")


@dataclass
class TurnStats:
    untrained_turns: int = 0  # assistant turns with no token of their own (the template rendered nothing new)
    cut_turns: int = 0  # assistant turns whose every token is past max_seq_len (cut away whole)
    split_rows: int = 0  # rows split into several examples (a template that re-renders history)
    reasoning_turns: int = 0  # assistant turns with reasoning (reasoning_content or a <think> block)
    reasoning_dropped: int = 0  # of those, reasoning removed by enable_thinking: false


def template_messages(
    messages: Sequence[tuple[str, str]], reasoning: Sequence[str | None], renderer: ChatRenderer, stats: TurnStats
) -> list[dict[str, str]]:
    """The template's input: role and content, and each assistant turn's reasoning as the template takes it."""
    out: list[dict[str, str]] = []
    for index, (role, content) in enumerate(messages):
        item = {"role": role, "content": content}
        thought = reasoning[index] if index < len(reasoning) else None
        if role == "assistant":
            inline, rest = split_think(content)
            if thought is not None or inline is not None:
                stats.reasoning_turns += 1
                if renderer.enable_thinking is False:
                    stats.reasoning_dropped += 1
                    item["content"], thought = rest, None
            if thought is not None:
                if renderer.reads_reasoning:
                    item["reasoning_content"] = thought
                else:
                    item["content"] = f"{THINK_OPEN}\n{thought.strip(chr(10))}\n{THINK_CLOSE}\n\n{content.lstrip()}"
        out.append(item)
    return out


@dataclass
class EncodedRow:
    examples: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (ids, labels), cut to max_len


def renderings(messages: list[dict[str, str]], renderer: ChatRenderer) -> list[tuple[str, str]]:
    """``(prompt_i, upto_i)`` for every assistant turn *i*, in order."""
    out = []
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = renderer.render(messages[:index], True) if index else ""
        out.append((prompt, renderer.render(messages[: index + 1], False)))
    return out


def encode_rows(
    rows: Sequence[tuple[Sequence[tuple[str, str]], Sequence[str | None]]],
    tokenizer: Any,
    renderer: ChatRenderer,
    max_len: int,
    stats: TurnStats,
    wheres: Sequence[str] | None = None,
) -> list[EncodedRow]:
    """Each row (its turns and their reasoning) as examples, with one tokenizer call for all their texts.

    ``wheres`` names the rows (``file:row N``) for the error when the template cannot render one.
    """
    plans = []
    for index, (messages, reasoning) in enumerate(rows):
        try:
            pairs = renderings(template_messages(messages, reasoning, renderer, stats), renderer)
        except Exception as exc:  # the template's own error (raise_exception, a missing key, ...)
            where = wheres[index] if wheres else f"row {index + 1}"
            raise DataError(
                f"{where}: the chat template ({renderer.description}) does not render this row: "
                f"{type(exc).__name__}: {exc}",
                fix="fix the row, or set data.template to a template that renders it (auto, chatml, plain, PATH.jinja)",
            ) from None
        plans.append(example_plan(pairs, stats))
    texts = [text for plan in plans for text, _ in plan]
    if getattr(tokenizer, "is_fast", False):
        labelled = _label_by_offsets(tokenizer, texts, [spans for plan in plans for _, spans in plan])
    else:
        labelled = _label_by_pieces(tokenizer, texts, [spans for plan in plans for _, spans in plan])
    out, cursor = [], 0
    for plan in plans:
        examples = labelled[cursor : cursor + len(plan)]
        # A turn whose first token is past the cut is out of the loss, even where its example stays for others.
        stats.cut_turns += sum(first >= max_len for _, _, firsts in examples for first in firsts)
        out.append(EncodedRow([(ids[:max_len], labels[:max_len]) for ids, labels, _ in examples]))
        cursor += len(plan)
    return out


Spans = list[tuple[int, int]]  # character ranges of an example's text that are trained


def example_plan(pairs: list[tuple[str, str]], stats: TurnStats) -> list[tuple[str, Spans]]:
    """The examples of one row: each example's text and its trained spans, from ``(prompt_i, upto_i)``.

    A turn joins the current example when the example's text so far is a prefix of the turn's prompt
    (the template kept the history as it was); otherwise it starts a new one, whose text is the
    history as the template re-rendered it. The turn's span runs from where its prompt ends (where
    the prompt is not a prefix of the turn's rendering: from where the two first differ) to the end
    of its rendering.
    """
    examples: list[tuple[str, Spans]] = []
    text, spans = "", []
    for prompt, upto in pairs:
        if text and not prompt.startswith(text):
            examples.append((text, spans))
            text, spans = "", []
            stats.split_rows += len(examples) == 1  # count the row once
        start = len(prompt) if upto.startswith(prompt) else _common_chars(prompt, upto)
        if start >= len(upto):
            stats.untrained_turns += 1
        else:
            spans.append((start, len(upto)))
        text = upto
    if text:
        examples.append((text, spans))
    return examples


Labelled = tuple[list[int], list[int], list[int]]  # ids, labels, each trained span's first token index


def _label_by_offsets(tokenizer: Any, texts: list[str], spans: list[Spans]) -> list[Labelled]:
    """Tokenize each whole text once; a token is trained where its characters overlap a trained span.

    The labels follow the tokens of the sequence itself: a token that straddles the end of the
    prompt (a merge across it) is the first token of the answer, and is trained.
    """
    if not texts:
        return []
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for ids, offsets, trained in zip(encoded["input_ids"], encoded["offset_mapping"], spans, strict=True):
        labels = [IGNORE] * len(ids)
        firsts = []
        position = 0
        for start, end in trained:
            while position < len(ids) and offsets[position][1] <= start:
                position += 1
            firsts.append(position)
            while position < len(ids) and offsets[position][0] < end:
                labels[position] = ids[position]
                position += 1
        out.append((ids, labels, firsts))
    return out


def _label_by_pieces(tokenizer: Any, texts: list[str], spans: list[Spans]) -> list[Labelled]:
    """A tokenizer without offsets (a slow, Python one): the text's pieces at the span edges, each tokenized."""
    pieces: list[str] = []
    layout: list[list[tuple[int, bool]]] = []
    for text, trained in zip(texts, spans, strict=True):
        parts, cursor = [], 0
        for start, end in trained:
            for piece, is_trained in ((text[cursor:start], False), (text[start:end], True)):
                if piece:
                    parts.append((len(pieces), is_trained))
                    pieces.append(piece)
            cursor = end
        if text[cursor:]:
            parts.append((len(pieces), False))
            pieces.append(text[cursor:])
        layout.append(parts)
    encoded = tokenizer(pieces, add_special_tokens=False)["input_ids"] if pieces else []
    out = []
    for parts in layout:
        ids: list[int] = []
        labels: list[int] = []
        firsts: list[int] = []
        for index, is_trained in parts:
            if is_trained:
                firsts.append(len(ids))
            ids += encoded[index]
            labels += encoded[index] if is_trained else [IGNORE] * len(encoded[index])
        out.append((ids, labels, firsts))
    return out


def _common_chars(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for position in range(n):
        if a[position] != b[position]:
            return position
    return n
