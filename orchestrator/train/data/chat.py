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
from types import SimpleNamespace
from typing import Any

from ...planning.chattemplate import AUTO, ChatTemplate
from ...planning.datarows import DataError

IGNORE = -100
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

Render = Callable[..., str]  # (messages, add_generation_prompt, tools=None) -> text


@dataclass(frozen=True)
class TrainingRule:
    """Which turns carry loss (a source's roles_to_train and train_on_eos; docs/data.md)."""

    roles: tuple[str, ...] = ("assistant",)
    eos: str = "turn"  # turn: each trained turn's end token | last: only the last one's | all | none

    @classmethod
    def of(cls, source: Any) -> TrainingRule:
        roles = getattr(source, "roles_to_train", None)
        return cls(tuple(roles) if roles else ("assistant",), getattr(source, "train_on_eos", None) or "turn")


DEFAULT_RULE = TrainingRule()


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
    reads_tools: bool = False  # the template renders tools and tool calls (Qwen3's, Llama 3.1's, ...)
    eos: str = ""  # the tokenizer's end-of-sequence text, for train_on_eos


def make_renderer(tokenizer: Any, template: ChatTemplate | None = None, enable_thinking: object = AUTO) -> ChatRenderer:
    """The renderer for ``data.template`` (``None``: auto) and ``data.enable_thinking`` on this tokenizer."""
    template = template or ChatTemplate(AUTO, None)
    extra = {} if enable_thinking == AUTO else {"enable_thinking": enable_thinking}
    eos = getattr(tokenizer, "eos_token", None) or ""

    def plain(messages: list[dict[str, str]], generation_prompt: bool, tools=None) -> str:
        return plain_render(messages, eos, generation_prompt)

    def jinja(text: str | None) -> Render:
        chosen = {} if text is None else {"chat_template": text}

        def render(messages: list[dict[str, str]], generation_prompt: bool, tools=None) -> str:
            if not messages:
                return ""
            with_tools = {"tools": list(tools)} if tools else {}
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt, **chosen, **extra, **with_tools
            )

        return render

    if template.name == AUTO:
        own = getattr(tokenizer, "chat_template", None)
        if not own:
            return ChatRenderer(
                plain, "auto: plain (the tokenizer has no chat template)", False, enable_thinking, eos=eos
            )
        digest = ChatTemplate(AUTO, str(own)).digest
        return ChatRenderer(
            jinja(None),
            f"auto: the tokenizer's own (sha256 {digest})",
            _reads_reasoning(str(own)),
            enable_thinking,
            _reads_tools(str(own)),
            eos,
        )
    if template.text is None:  # plain
        return ChatRenderer(plain, "plain (built-in)", False, enable_thinking, eos=eos)
    kind = "file" if template.name.endswith((".jinja", ".j2", ".jinja2")) or "/" in template.name else "built-in"
    return ChatRenderer(
        jinja(template.text),
        f"{template.name} ({kind}, sha256 {template.digest})",
        _reads_reasoning(template.text),
        enable_thinking,
        _reads_tools(template.text),
        eos,
    )


def _reads_reasoning(source: str) -> bool:
    return "reasoning_content" in source


def _reads_tools(source: str) -> bool:
    # A template that renders tool calls names them: Qwen's, Llama 3.1's, Mistral's, Hermes' all do.
    return "tool_calls" in source and "tools" in source


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
    messages: Sequence[tuple[str, str]],
    reasoning: Sequence[str | None],
    renderer: ChatRenderer,
    stats: TurnStats,
    tool_calls: Sequence[Any] = (),
) -> list[dict[str, Any]]:
    """The template's input: role and content, each assistant turn's reasoning as the template takes it, its calls."""
    out: list[dict[str, Any]] = []
    for index, (role, content) in enumerate(messages):
        item: dict[str, Any] = {"role": role, "content": content}
        calls = tool_calls[index] if index < len(tool_calls) else None
        if calls:
            item["tool_calls"] = [dict(call) for call in calls]
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


def turn_is_trained(role: str, flag: bool | None, rule: TrainingRule) -> bool:
    """A turn's own train flag decides; without one, its role (roles_to_train)."""
    return flag if flag is not None else role in rule.roles


def renderings(
    messages: list[dict[str, Any]],
    renderer: ChatRenderer,
    tools: Sequence[dict[str, Any]] | None = None,
    trained: Sequence[bool | None] = (),
    rule: TrainingRule = DEFAULT_RULE,
) -> list[tuple[str, str]]:
    """``(prompt_i, upto_i)`` for every trained turn *i* (by default: every assistant turn), in order.

    An assistant turn's prompt ends with the generation prompt (its header is not its own text);
    another role's turn (roles_to_train) is trained as the template renders it, header included."""
    out = []
    for index, message in enumerate(messages):
        flag = trained[index] if index < len(trained) else None
        if not turn_is_trained(message["role"], flag, rule):
            continue
        generation = message["role"] == "assistant"
        prompt = renderer.render(messages[:index], generation, tools) if index else ""
        out.append((prompt, renderer.render(messages[: index + 1], False, tools)))
    return out


def _turns_of(row: Any) -> Any:
    """A row as ``encode_rows`` reads it: a ``Conversation``, or the older ``(messages, reasoning)`` pair."""
    if isinstance(row, tuple):
        return SimpleNamespace(messages=tuple(row[0]), reasoning=tuple(row[1]))  # read with getattr defaults
    return row


def encode_rows(
    rows: Sequence[Any],
    tokenizer: Any,
    renderer: ChatRenderer,
    max_len: int,
    stats: TurnStats,
    wheres: Sequence[str] | None = None,
) -> list[EncodedRow]:
    """Each row (a ``Conversation``: its turns, reasoning, tool calls, tools, train flags, or its text)
    as examples, with one tokenizer call for all their texts.

    ``wheres`` names the rows (``file:row N``) for the error when the template cannot render one.
    """
    plans = []
    for index, row in enumerate(rows):
        row = _turns_of(row)
        where = wheres[index] if wheres else (getattr(row, "where", "") or f"row {index + 1}")
        if getattr(row, "text", None) is not None:
            plans.append([(row.text + renderer.eos, [(0, len(row.text) + len(renderer.eos), True)])])
            continue
        tools = getattr(row, "tools", None)
        calls = getattr(row, "tool_calls", ())
        if (tools or any(calls)) and not renderer.reads_tools:
            raise DataError(
                f"{where}: the row has {'tool calls' if any(calls) else 'tools'}, and the chat template "
                f"({renderer.description}) renders none: they would be dropped",
                fix="set data.template to one that renders tools (auto with a model whose template has them, "
                "such as Qwen3's; or PATH.jinja)",
            )
        rule = getattr(row, "rule", None) or DEFAULT_RULE
        try:
            messages = template_messages(row.messages, row.reasoning, renderer, stats, calls)
            pairs = renderings(messages, renderer, tools, getattr(row, "trained", ()), rule)
        except Exception as exc:  # the template's own error (raise_exception, a missing key, ...)
            raise DataError(
                f"{where}: the chat template ({renderer.description}) does not render this row: "
                f"{type(exc).__name__}: {exc}",
                fix="fix the row, or set data.template to a template that renders it (auto, chatml, plain, PATH.jinja)",
            ) from None
        plans.append(example_plan(pairs, stats, renderer.eos, rule.eos))
    texts = [text for plan in plans for text, _ in plan]
    if getattr(tokenizer, "is_fast", False):
        labelled = _label_by_offsets(tokenizer, texts, [spans for plan in plans for _, spans in plan])
    else:
        labelled = _label_by_pieces(tokenizer, texts, [spans for plan in plans for _, spans in plan])
    out, cursor = [], 0
    for row, plan in zip(rows, plans, strict=True):
        examples = labelled[cursor : cursor + len(plan)]
        cursor += len(plan)
        if getattr(row, "text", None) is not None:
            # A document is every token trained, cut into blocks of max_len (none lost, as
            # LLaMA-Factory's pretraining splits its text into blocks of cutoff_len).
            ((ids, labels, _),) = examples
            blocks = [(ids[i : i + max_len], labels[i : i + max_len]) for i in range(0, len(ids), max_len)]
            out.append(EncodedRow(blocks))
            continue
        # A turn whose first token is past the cut is out of the loss, even where its example stays for others.
        stats.cut_turns += sum(first >= max_len for _, _, firsts in examples for first in firsts)
        out.append(EncodedRow([(ids[:max_len], labels[:max_len]) for ids, labels, _ in examples]))
    return out


Spans = list[tuple[int, int, bool]]  # character ranges of an example's text that are trained; True: a turn's


def example_plan(
    pairs: list[tuple[str, str]], stats: TurnStats, eos: str = "", train_on_eos: str = "turn"
) -> list[tuple[str, Spans]]:
    """The examples of one row: each example's text and its trained spans, from ``(prompt_i, upto_i)``.

    A turn joins the current example when the example's text so far is a prefix of the turn's prompt
    (the template kept the history as it was); otherwise it starts a new one, whose text is the
    history as the template re-rendered it. The turn's span runs from where its prompt ends (where
    the prompt is not a prefix of the turn's rendering: from where the two first differ) to the end
    of its rendering. ``train_on_eos`` then moves the spans' ends (``_eos_spans``).
    """
    examples: list[tuple[str, Spans]] = []
    text, spans = "", []
    for prompt, upto in pairs:
        if text and not prompt.startswith(text):
            examples.append((text, spans))
            text, spans = "", []
            stats.split_rows += len(examples) == 1  # count the row once
        start = len(prompt) if upto.startswith(prompt) else common_prefix(prompt, upto)
        if start >= len(upto):
            stats.untrained_turns += 1
        else:
            spans.append((start, len(upto), True))
        text = upto
    if text:
        examples.append((text, spans))
    if train_on_eos == "turn" or not eos:
        return examples
    last = len(examples) - 1
    return [(text, _eos_spans(text, spans, eos, train_on_eos, n == last)) for n, (text, spans) in enumerate(examples)]


def _eos_spans(text: str, spans: Spans, eos: str, train_on_eos: str, last_example: bool) -> Spans:
    """axolotl's train_on_eos: none (no turn's end token), last (the row's last trained turn's only; a row
    split per turn has it in its last example), all (every end token of the text, trained turn or not)."""
    out: Spans = []
    for number, (start, end, turn) in enumerate(spans):
        is_last = last_example and number == len(spans) - 1
        keep = train_on_eos == "all" or (train_on_eos == "last" and is_last)
        cut = text.rfind(eos, start, end)
        out.append((start, cut if cut > start and not keep else end, turn))
    if train_on_eos == "all":  # the end tokens of the turns not trained (the prompt's, the user's) too
        at = text.find(eos)
        while at >= 0:
            if not any(start <= at < end for start, end, _ in out):
                out.append((at, at + len(eos), False))
            at = text.find(eos, at + len(eos))
        out.sort()
    return out


Labelled = tuple[list[int], list[int], list[int]]  # ids, labels, each trained turn's first token index


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
        for start, end, turn in trained:
            while position < len(ids) and offsets[position][1] <= start:
                position += 1
            if turn:
                firsts.append(position)
            while position < len(ids) and offsets[position][0] < end:
                labels[position] = ids[position]
                position += 1
        out.append((ids, labels, firsts))
    return out


def _label_by_pieces(tokenizer: Any, texts: list[str], spans: list[Spans]) -> list[Labelled]:
    """A tokenizer without offsets (a slow, Python one): the text's pieces at the span edges, each tokenized."""
    pieces: list[str] = []
    layout: list[list[tuple[int, bool, bool]]] = []
    for text, trained in zip(texts, spans, strict=True):
        parts, cursor = [], 0
        for start, end, turn in trained:
            for piece, is_trained in ((text[cursor:start], False), (text[start:end], True)):
                if piece:
                    parts.append((len(pieces), is_trained, is_trained and turn))
                    pieces.append(piece)
            cursor = end
        if text[cursor:]:
            parts.append((len(pieces), False, False))
            pieces.append(text[cursor:])
        layout.append(parts)
    encoded = tokenizer(pieces, add_special_tokens=False)["input_ids"] if pieces else []
    out = []
    for parts in layout:
        ids: list[int] = []
        labels: list[int] = []
        firsts: list[int] = []
        for index, is_trained, turn in parts:
            if turn:
                firsts.append(len(ids))
            ids += encoded[index]
            labels += encoded[index] if is_trained else [IGNORE] * len(encoded[index])
        out.append((ids, labels, firsts))
    return out


def common_prefix(a: Sequence, b: Sequence) -> int:
    """How many leading items (characters, token ids) ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for position in range(n):
        if a[position] != b[position]:
            return position
    return n
