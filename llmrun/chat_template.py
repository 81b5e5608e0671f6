"""Render a model's Jinja chat template exactly as transformers' apply_chat_template does.

Templates come from model files and are untrusted code, so they run in jinja2's
ImmutableSandboxedEnvironment with the globals, filters and render context that
transformers gives them (utils/chat_template_utils.py). Anything that fails,
including an attempt to reach Python internals, becomes one TemplateError line.
"""

import json
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from llmrun.errors import TemplateError

# jinja2 releases before 3.1.6 have known sandbox escapes (CVE-2024-56326, CVE-2025-27516).
_MIN_JINJA2 = (3, 1, 6)

# The names a message's reasoning goes by; templates read the first one.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _Sandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        # jinja2 returns a silent Undefined here, so `{{ ''.__class__ }}` would
        # render as ''; a template that probes internals is refused outright.
        raise SecurityError(f"attribute {attribute!r} of type {type(obj).__name__!r}")


class _TemplateDict:
    # A stand-in for the `dict` global that exposes no type to climb from.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    def __init__(*args: Any, **kwargs: Any) -> None:
        # Same signature trick as jinja2's Namespace, so `namespace(self=...)` works.
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    # transformers' `{% generation %}` marks assistant text for training masks;
    # for inference it only renders its body.
    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template error: {message}")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Replaces jinja2's tojson, which HTML-escapes and sorts keys.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _check_jinja2_version() -> None:
    found = tuple(int(part) for part in re.findall(r"\d+", jinja2.__version__)[:3])
    if found < _MIN_JINJA2:
        raise TemplateError(
            f"jinja2 {jinja2.__version__} has known sandbox escapes and cannot run chat "
            "templates safely; upgrade it with `pip install -U 'jinja2>=3.1.6'`"
        )


def _environment() -> jinja2.Environment:
    env = _Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain(value: Any) -> Any:
    # Everything the template sees is rebuilt from plain JSON-like types, so no
    # caller object lends it methods the sandbox does not know are dangerous.
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: list[dict]) -> list[dict]:
    if not messages:
        raise TemplateError("cannot render an empty conversation; give at least one message")
    prepared = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(f"chat messages must be dicts, got {message!r}")
        # Many templates print a None content as "None" but handle a missing key.
        message = _plain({key: value for key, value in message.items() if value is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        prepared.append(message)
    return prepared


def _template_line(exc: BaseException) -> int | None:
    # jinja2 rewrites tracebacks so that template frames carry template line numbers.
    line = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


class ChatTemplate:
    """A compiled chat template, rendered with the context transformers gives it."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        _check_jinja2_version()
        self.source = source  # what the template says, for what it teaches (tool-call formats)
        env = _environment()
        try:
            self._template = env.from_string(source)
            # The variables the template reads, so a switch it ignores can be refused.
            self.variables = frozenset(jinja2.meta.find_undeclared_variables(env.parse(source)))
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(
                f"chat template has a syntax error at line {e.lineno}: {e.message}"
            ) from e
        # transformers passes only the special tokens a tokenizer has; "" means none.
        self._special = {
            name: token
            for name, token in (("bos_token", bos_token), ("eos_token", eos_token))
            if token
        }

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render `messages`; `extra` holds tools, documents and template switches.

        `tools` is a list of JSON schemas and `documents` a list of dicts, as in
        apply_chat_template; any other keyword (enable_thinking, date_string,
        unk_token, ...) reaches the template as a variable and overrides a
        special token of the same name.
        """
        tools = extra.pop("tools", None)
        documents = extra.pop("documents", None)
        for label, items in (("tools", tools), ("documents", documents)):
            if items is not None and not all(isinstance(item, Mapping) for item in items):
                raise TemplateError(f"{label} must be a list of dicts (JSON schemas for tools)")
        context = {
            **self._special,
            **_plain(extra),
            "messages": _prepare_messages(messages),
            "tools": _plain(tools),
            "documents": _plain(documents),
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(context)
        except TemplateError:
            raise
        except SecurityError as e:
            raise TemplateError(
                f"chat template tried to access {e}, which the sandbox forbids; refusing it"
            ) from e
        except Exception as e:
            line = _template_line(e)
            where = f" at line {line}" if line is not None else ""
            raise TemplateError(
                f"chat template failed to render{where}: {type(e).__name__}: {e}"
            ) from e


# llama.cpp's built-in templates that its converter writes by name in place of a Jinja one
# (RWKV's "rwkv-world", where its llama-cpp-rwkv-world.jinja is missing), written in Jinja
# from how llama-chat.cpp renders them: each message trimmed, "Assistant:" after a last
# user message (the model's "\n\n" token ends a reply).
NAMED_TEMPLATES = {
    "rwkv-world": (
        "{%- for message in messages -%}"
        "{%- if message.role == 'system' -%}{{ 'System: ' + message.content | trim + '\n\n' }}"
        "{%- elif message.role == 'user' -%}{{ 'User: ' + message.content | trim + '\n\n' }}"
        "{%- if loop.last %}{{ 'Assistant:' }}{% endif -%}"
        "{%- elif message.role == 'assistant' -%}"
        "{{ 'Assistant: ' + message.content | trim + '\n\n' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
    ),
}


def select_template(chat_template: str | list[dict] | None, name: str = "default") -> str | None:
    """Pick the template to use from tokenizer_config.json's `chat_template` value.

    It is a template string, a list of {"name", "template"} entries (one of
    which is usually "default"), or None when the model has no template.
    """
    if chat_template is None or isinstance(chat_template, str):
        return chat_template
    templates = {}
    for entry in chat_template:
        if not isinstance(entry, Mapping) or not {"name", "template"} <= entry.keys():
            raise TemplateError(
                f"chat_template list entries need 'name' and 'template' keys, got {entry!r}"
            )
        templates[entry["name"]] = entry["template"]
    if name not in templates:
        raise TemplateError(
            f"no chat template named {name!r}; this model has {', '.join(sorted(templates))}"
        )
    return templates[name]


def plain_transcript(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """A transcript for base models that have no chat template.

    Each message is one "Role: content" line, the role capitalised ("System:",
    "User:", "Assistant:"), lines joined by "\\n". With add_generation_prompt a
    last line "Assistant:" (no trailing space) asks the model to answer, so each
    turn's prompt is a prefix of the next. Content given as a list of blocks
    contributes its "text" blocks. Generation should stop at "\\nUser:".

        System: Be brief.
        User: Hi
        Assistant: Hello!
        User: Bye
        Assistant:
    """
    lines = []
    for message in messages:
        content = message.get("content") or ""
        if not isinstance(content, str):
            content = "".join(block["text"] for block in content if "text" in block)
        lines.append(f"{message['role'].capitalize()}: {content}")
    if add_generation_prompt:
        lines.append("Assistant:")
    return "\n".join(lines)
