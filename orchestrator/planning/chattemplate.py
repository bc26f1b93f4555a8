"""``data.template``: which chat template renders the conversations, read and checked before any host is touched.

``auto`` is the tokenizer's own template (known only where the tokenizer is, on the nodes);
a NAME is one of the built-ins below; anything else is a Jinja file (``PATH.jinja``, relative
to the job file), read here, compiled and rendered once on a sample conversation the way
transformers renders templates (a sandboxed Jinja environment with ``trim_blocks`` and
``lstrip_blocks``). A file that is missing or does not render is an input error (exit 2)
naming the file and the Jinja error's line. Its text then travels inside the node's
``job.yaml`` (``data.template_text``), so nothing more is shipped.

Pure: it reads the job's own file and imports jinja2 only to check it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..spec.job import LoadedJob

# ChatML, as Qwen's templates render it, without tools or thinking blocks (the byte-level tokenizer's own).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# NAME -> template text; "plain" is the encoder's own documented text format (no Jinja).
BUILTIN_TEMPLATES: dict[str, str | None] = {"chatml": CHATML_TEMPLATE, "plain": None}
AUTO = "auto"

# What the check renders: every role, a reasoning turn and a later turn (templates that re-render history).
SAMPLE_CONVERSATION: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6"},
)


@dataclass(frozen=True)
class ChatTemplate:
    """The resolved ``data.template``: ``name`` as the summary line says it, ``text`` for a Jinja one."""

    name: str  # "auto", a built-in NAME, or the file as the user wrote it
    text: str | None  # Jinja source (None: the tokenizer's own for auto, the plain format for "plain")

    @property
    def digest(self) -> str:
        return hashlib.sha256((self.text or "").encode("utf-8")).hexdigest()[:12]


AUTO_TEMPLATE = ChatTemplate(AUTO, None)


def is_template_path(value: str) -> bool:
    return value.endswith((".jinja", ".j2", ".jinja2")) or "/" in value


def resolve_chat_template(job: LoadedJob) -> ChatTemplate:
    """``data.template`` of ``job``, a file read and checked; ``InputError`` naming the key, file and line."""
    value = job.spec.data.template
    where = f"{job.where('data.template')}: data.template"
    if value == AUTO:
        return ChatTemplate(AUTO, None)
    if value in BUILTIN_TEMPLATES:
        return ChatTemplate(value, BUILTIN_TEMPLATES[value])
    if not is_template_path(value):
        known = ", ".join([AUTO, *BUILTIN_TEMPLATES])
        raise InputError(
            f"{where}: unknown template {value!r}",
            fix=f"use one of {known}, or a Jinja file (PATH.jinja, relative to the job file)",
        )
    path = job.resolve_local(value)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(
            f"{where}: template file {path} not found", fix="check data.template (relative to the job file)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{where}: template file {path} cannot be read: {exc}") from None
    check_renders(text, str(path), where, enable_thinking=job.spec.data.enable_thinking)
    return ChatTemplate(value, text)


def node_chat_template(job: LoadedJob) -> ChatTemplate:
    """On a node: the text ``dzctl launch`` wrote into job.yaml, else (a trainer run by hand) the file itself."""
    data = job.spec.data
    if data.template_text is not None:
        return ChatTemplate(data.template, data.template_text)
    return resolve_chat_template(job)


def template_environment():
    """A Jinja environment as transformers builds one for chat templates (sandboxed, trimmed blocks)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        from jinja2.exceptions import TemplateError

        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: "1970-01-01"
    return env


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    import json

    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def check_renders(text: str, filename: str, where: str, *, enable_thinking: object = AUTO) -> None:
    """Compile ``text`` and render it on the sample, with and without a generation prompt; else ``InputError``."""
    from jinja2 import TemplateError, TemplateSyntaxError

    env = template_environment()
    try:
        template = env.from_string(text)
    except TemplateSyntaxError as exc:
        raise InputError(
            f"{where}: {filename}:{exc.lineno}: the template does not compile: {exc.message}",
            fix="fix the template at that line (Jinja syntax), or set data.template: auto",
        ) from None
    extra = {} if enable_thinking == AUTO else {"enable_thinking": enable_thinking}
    for generation_prompt in (False, True):
        for upto in range(1, len(SAMPLE_CONVERSATION) + 1):
            messages = [dict(m) for m in SAMPLE_CONVERSATION[:upto]]
            try:
                template.render(
                    messages=messages,
                    add_generation_prompt=generation_prompt,
                    bos_token="",
                    eos_token="",
                    **extra,
                )
            except TemplateError as exc:
                line = _template_line(exc)
                at = f"{filename}:{line}" if line else filename
                raise InputError(
                    f"{where}: {at}: the template does not render a conversation of {upto} message(s) "
                    f"(system, user, assistant, ...): {type(exc).__name__}: {exc}",
                    fix="fix the template at that line, or set data.template: auto",
                ) from None
            except Exception as exc:  # a Python error inside the template's expressions
                line = _template_line(exc)
                at = f"{filename}:{line}" if line else filename
                raise InputError(
                    f"{where}: {at}: the template fails on a conversation of {upto} message(s): "
                    f"{type(exc).__name__}: {exc}",
                    fix="fix the template at that line, or set data.template: auto",
                ) from None


def _template_line(exc: BaseException) -> int | None:
    """The template line a render error came from: Jinja rewrites the traceback to template frames."""
    tb = exc.__traceback__
    line = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line
