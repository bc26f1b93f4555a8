"""A conversation → training examples through a chat template, labels aligned by tokens (no torch).

For every assistant turn *i* the template renders two texts: the conversation before the turn
with the generation prompt (``prompt_i``) and the conversation up to and including it
(``upto_i``). Both are tokenized; the turn's trained tokens are those of ``upto_i`` after its
longest common token prefix with ``prompt_i``. Comparing tokens, not strings, keeps the labels
on the ids the model really sees, even where the tokenizer merges characters across the
prompt's end.

Turns go into one example while each rendering extends the previous one token for token
(ChatML, Llama 3: the history stays as it was). A template that re-renders the history
(Qwen3 drops earlier turns' reasoning, and renders a finished turn without its think block)
makes ``upto_{i-1}`` no prefix of ``upto_i``: the row is then split, and turn *i* starts a new
example whose prompt is the history exactly as the template renders it at inference. So
every assistant turn is trained, each in the context the model will see.

Cost per row of *T* assistant turns and *L* tokens: 2*T* renderings and 2*T* tokenized texts
of up to *L* tokens, so O(T·L) tokens through the tokenizer (one call per chunk of rows), against
O(L) for a single-turn row; a re-rendering template adds the split examples' repeated prompts to
the training tokens.

Reasoning: an assistant turn's ``reasoning_content`` goes to the template under that key when
the template reads it (Qwen3's does); for one that does not, it is kept as a
``<think>\\n…\\n</think>\\n\\n`` block at the head of the content (the form Qwen3 renders) rather
than dropped. ``data.enable_thinking`` reaches the template as ``enable_thinking`` (not passed
for ``auto``); ``false`` also removes every turn's reasoning (``reasoning_content`` and a
``<think>`` block in the content), as LLaMA-Factory's ``enable_thinking: false`` does, so
under Qwen3's template the empty think block lands in the prompt (no loss). README.md,
"Chat templates", has the decision and its sources.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...planning.chattemplate import AUTO, ChatTemplate

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
) -> list[EncodedRow]:
    """Each row (its turns and their reasoning) as examples, with one tokenizer call for all their texts."""
    texts: list[str] = []
    plans: list[int] = []  # assistant turns per row
    for messages, reasoning in rows:
        pairs = renderings(template_messages(messages, reasoning, renderer, stats), renderer)
        plans.append(len(pairs))
        for prompt, upto in pairs:
            texts += [prompt, upto]
    tokens = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    out = []
    cursor = 0
    for turns in plans:
        row = EncodedRow()
        ids: list[int] = []
        labels: list[int] = []
        split = False
        for _ in range(turns):
            prompt, upto = tokens[cursor], tokens[cursor + 1]
            cursor += 2
            start = _common_prefix(prompt, upto)
            if start == len(upto):
                stats.untrained_turns += 1
            if ids and upto[: len(ids)] != ids:
                # The template re-rendered the history: this turn starts an example of its own.
                row.examples.append((ids[:max_len], labels[:max_len]))
                ids, labels, split = [], [], True
            base = len(ids)
            labels += [token if position >= start else IGNORE for position, token in enumerate(upto[base:], base)]
            ids += upto[base:]
        if ids:
            row.examples.append((ids[:max_len], labels[:max_len]))
        stats.split_rows += split
        out.append(row)
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    if b[: len(a)] == a:  # the usual case, compared at C speed
        return len(a)
    n = min(len(a), len(b))
    for position in range(n):
        if a[position] != b[position]:
            return position
    return n
