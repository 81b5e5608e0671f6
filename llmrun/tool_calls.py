"""Tool calls in a model's output, in the format its chat template teaches it.

The format is chosen from the chat template's source, never from a model name:

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes 2/3, Qwen2.5, Qwen3)
- llama3_json: `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`,
  several separated by `;` (Llama 3.1, 3.2, 3.3)
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral Nemo) or
  `[TOOL_CALLS]name[ARGS]{...}` repeated (Mistral Small 3.2, Devstral, Ministral 3)
- harmony: gpt-oss messages, a call being `<|channel|>commentary to=functions.NAME
  <|constrain|>json<|message|>{...}` (ended by `<|call|>`, an end-of-generation token)
- phi4_mini: `<|tool_call|>{...} or [{...}]<|/tool_call|>` (Phi-4-mini, whose template
  takes the tools in the system message, between `<|tool|>` and `<|/tool|>`)
- granite: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]` to the end of the output
  (Granite 3.x, whose template says "<|tool_call|> followed by a JSON list")
- qwen3_xml: `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n...
  </function>\n</tool_call>` (Qwen3-Coder, Qwen3.5); a value is text where the tool's
  schema says string, else JSON (as vLLM's qwen3_coder parser reads it)
- glm45: `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>`,
  with or without a newline before each tag (GLM-4.5, 4.6, 4.7); values as in qwen3_xml
- deepseek_v31: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (DeepSeek V3.1)
- deepseek_v3: the same markers around `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
  \n```json\n{...}\n```<｜tool▁call▁end｜>`, calls parted by newlines (DeepSeek R1, V3-0324
  and the R1 distills' templates)
- kimi_k2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
  <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>` (Kimi
  K2); `functions.NAME:IDX` is the call's id, which the template writes back
- command_r7b: `<|START_ACTION|>[{"tool_call_id": "0", "tool_name": ..., "parameters":
  {...}}, ...]<|END_ACTION|>` (Command R7B, Command A); the template numbers the ids itself
- seed_oss: `<seed:tool_call>\n<function=NAME>\n<parameter=KEY>VALUE</parameter>\n...
  </function>\n</seed:tool_call>` (Seed-OSS); values as in qwen3_xml
- minimax_m2: `<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="KEY">VALUE
  </parameter>\n...</invoke>\n...</minimax:tool_call>`, several invokes in one block
  (MiniMax-M2, M2.1, M2.5); values as in qwen3_xml
- gemma4: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`, Gemma's own notation
  for the arguments (Gemma 4; llmrun/gemma4_calls.py reads and writes it)
- muse_glimmer: a message to the tool, `<|start|>assistant to=NAME<|message|>
  <atem:function_calls>\n<atem:invoke name="NAME">\n<atem:parameter name="KEY">VALUE
  </atem:parameter>\n...</atem:invoke>\n</atem:function_calls>` (Muse Glimmer; the first
  message's `<|start|>assistant` is the prompt's); a value is text where the tool's schema
  allows a string, else JSON (as llama.cpp's common/parsers/muse-glimmer.cpp reads it)

ToolCallParser reads the generated text piece by piece: text outside calls passes on as
content as soon as it cannot begin a call, each call comes out whole once it is complete,
and a call that does not parse comes out as the text it was, never dropped or half-parsed.
Marker tokens that the detokenizer skips as special (`[TOOL_CALLS]`, `<|python_tag|>`, ...)
are given back their text first (ToolFormat.marker_ids), so the parser reads what the
model wrote. It also renders calls back into a prompt's history and writes the grammar
(llguidance's Lark, with `%json` schemas) that forces a valid call for `tool_choice:
"required"` or a named function. No torch here.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from llmrun import gemma4_calls
from llmrun.reasoning import ANSWER, REASONING, Piece

HERMES, LLAMA3, MISTRAL, HARMONY, PHI4 = "hermes", "llama3_json", "mistral", "harmony", "phi4_mini"
QWEN_XML, GRANITE, GLM = "qwen3_xml", "granite", "glm45"
DEEPSEEK_V31, DEEPSEEK_V3, KIMI, COMMAND = "deepseek_v31", "deepseek_v3", "kimi_k2", "command_r7b"
SEED, MINIMAX, GEMMA4, MUSE = "seed_oss", "minimax_m2", "gemma4", "muse_glimmer"
FORMATS = (HERMES, LLAMA3, MISTRAL, HARMONY, PHI4, QWEN_XML, GRANITE, GLM)
FORMATS += (DEEPSEEK_V31, DEEPSEEK_V3, KIMI, COMMAND, SEED, MINIMAX, GEMMA4, MUSE)
# OpenAI's rule for function names.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# How the grammars write JSON: as json.dumps does by default, the way these models were
# taught, with no free whitespace a weak model could loop in.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class _Vocab(Protocol):
    special_ids: frozenset[int]

    def token_id(self, text: str) -> int | None: ...


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: `arguments` is a JSON object's text, as OpenAI returns it."""

    name: str
    arguments: str
    id: str

    def as_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


Item = str | ToolCall  # what the parser hands on: content text (a Piece) or a call


# --- the formats ---------------------------------------------------------------------


@dataclass(frozen=True)
class ToolFormat:
    name: str
    opens: tuple[str, ...]  # text that begins a call
    close: str | None = None  # text that ends one (None: the call runs to the end of the output)
    markers: tuple[str, ...] = ()  # tokens whose text the parser must see even when special
    at_start: tuple[str, ...] = ()  # text that begins a call only at the start of the output
    whole_output: bool = False  # the whole output is one structure (harmony)
    args_form: bool = False  # mistral: name[ARGS]{...} rather than a JSON list
    # The offered tools' parameter schemas by function name (for_tools), which a format
    # that writes arguments as text (qwen3_xml) reads values by.
    schemas: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)

    def for_tools(self, tools: Sequence[Mapping[str, Any]]) -> ToolFormat:
        """This format, reading calls of `tools` (OpenAI function tools)."""
        schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools}
        return replace(self, schemas=schemas)

    def marker_ids(self, vocab: _Vocab) -> dict[int, str]:
        """Special tokens of this format's markers in `vocab`, by id, with their text:
        the detokenizer skips them, so their text is put back before parsing."""
        found = {}
        for text in self.markers:
            token = vocab.token_id(text)
            if token is not None and token in vocab.special_ids:
                found[token] = text
        return found

    def new_id(self) -> str:
        if self.name == MISTRAL:  # Mistral's templates refuse any other length
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"

    def parse(self, region: str, new_id: Callable[[], str] | None = None) -> list[Item] | None:
        """The calls (and any text) in a region that begins with one of `opens` (or is the
        whole output, for harmony); None if it is not well-formed calls."""
        new_id = new_id or self.new_id
        try:
            calls = _PARSERS[self.name](self, region)
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        if calls is None:
            return None
        return [
            ToolCall(c[0], c[1], c[2] or new_id()) if isinstance(c, tuple) else c for c in calls
        ]

    def call_text(self, calls: Sequence[Mapping[str, Any]]) -> str:
        """Calls (OpenAI's shape, arguments as dicts) as this model writes them, for a
        template that cannot render `tool_calls` itself."""

        def one(call: Mapping[str, Any]) -> dict[str, Any]:
            function = call.get("function", call)
            return {"name": function["name"], "arguments": function.get("arguments") or {}}

        dump = dumps
        items = [one(c) for c in calls]
        if self.name == HERMES:
            return "\n".join(f"<tool_call>\n{dump(c)}\n</tool_call>" for c in items)
        if self.name == LLAMA3:
            return "; ".join(dump({"name": c["name"], "parameters": c["arguments"]}) for c in items)
        if self.name == MISTRAL:
            if self.args_form:
                return "".join(
                    f"[TOOL_CALLS]{c['name']}[ARGS]{dump(c['arguments'])}" for c in items
                )
            return "[TOOL_CALLS]" + dump(items)
        if self.name == PHI4:
            return "".join(f"<|tool_call|>{dump(c)}<|/tool_call|>" for c in items)
        if self.name == QWEN_XML:
            return "\n".join(_xml_call(c["name"], c["arguments"]) for c in items)
        if self.name == GRANITE:
            return "<|tool_call|>" + dump(items)
        if self.name == GLM:
            return "".join(_glm_call(c["name"], c["arguments"]) for c in items)
        if self.name in (DEEPSEEK_V31, DEEPSEEK_V3):
            v31 = self.name == DEEPSEEK_V31
            bodies = [
                f"{c['name']}{_DS_SEP}{dump(c['arguments'])}"
                if v31
                else f"function{_DS_SEP}{c['name']}{_DS_JSON_OPEN}{dump(c['arguments'])}"
                f"{_DS_JSON_CLOSE}"
                for c in items
            ]
            between = "" if v31 else "\n"
            return _DS_OPEN + between.join(_DS_BEGIN + b + _DS_END for b in bodies) + _DS_CLOSE
        if self.name == KIMI:
            return _kimi_calls(calls)
        if self.name == SEED:
            return "\n".join(_seed_call(c["name"], c["arguments"]) for c in items)
        if self.name == MINIMAX:
            invokes = "".join(_minimax_invoke(c["name"], c["arguments"]) for c in items)
            return f"{_MINIMAX_OPEN}\n{invokes}{_MINIMAX_CLOSE}"
        if self.name == GEMMA4:
            return "".join(gemma4_calls.write_call(c["name"], c["arguments"]) for c in items)
        if self.name == MUSE:
            return "<|eom|>".join(_muse_call(c["name"], c["arguments"]) for c in items)
        if self.name == COMMAND:
            actions = [
                {"tool_call_id": str(i), "tool_name": c["name"], "parameters": c["arguments"]}
                for i, c in enumerate(items)
            ]
            return f"{_COMMAND_OPEN}{dump(actions)}{_COMMAND_CLOSE}"
        return "".join(
            f"<|start|>assistant to=functions.{c['name']}<|channel|>commentary json"
            f"<|message|>{dump(c['arguments'])}<|call|>"
            for c in items
        )

    def answer(self, rule: str, token: Callable[[str], str]) -> str:
        """A Lark expression for an answer that `rule` spells, beside this format's
        grammar of calls (tool_choice auto with a response format): Muse Glimmer's in its
        message to the user, after its messages of reasoning (the calls' grammar's rule)."""
        if self.name == MUSE:
            return f'muse_reasoning* " to=user"? {token("<|message|>")} {rule}'
        return rule

    def grammar(
        self, tools: Sequence[Mapping[str, Any]], token: Callable[[str], str], parallel: bool
    ) -> str:
        """A Lark grammar (llguidance's dialect) that only lets the model write calls of
        `tools` (OpenAI function tools) whose arguments match their schemas. `token(text)`
        is how the grammar spells a marker: a special token's `<[id]>`, else a string."""

        def lit(text: str) -> str:
            return json.dumps(text)

        def schema(value: Any) -> str:
            return "%json " + json.dumps(value, ensure_ascii=False)

        functions = [t["function"] for t in tools]

        def params(f: Mapping[str, Any]) -> dict[str, Any]:
            return {**(f.get("parameters") or _ANY_OBJECT), "x-guidance": JSON_STYLE}

        def call_object(
            args_key: str, at: str = "", name_key: str = "name", id_key: str | None = None
        ) -> dict[str, Any]:
            """The call {"name": ..., args_key: parameters} as a schema that sits at JSON
            pointer `at` of the grammar's schema (with `id_key`, a number as a string first,
            and the name under `name_key`)."""
            one = len(functions) == 1
            ids = {id_key: {"type": "string", "pattern": "^[0-9]{1,3}$"}} if id_key else {}
            options = [
                {
                    "type": "object",
                    "properties": {
                        **ids,
                        name_key: {"const": f["name"]},
                        # its references ($defs, recursion) from where it now sits
                        args_key: _rebased(
                            f.get("parameters") or _ANY_OBJECT,
                            f"{at}{'' if one else f'/anyOf/{i}'}/properties/{args_key}",
                        ),
                    },
                    "required": [*ids, name_key, args_key],
                    "additionalProperties": False,
                }
                for i, f in enumerate(functions)
            ]
            return {**(options[0] if one else {"anyOf": options}), "x-guidance": JSON_STYLE}

        many = "+" if parallel else ""
        if self.name == HERMES:
            call = f'{token("<tool_call>")} "\\n" {schema(call_object("arguments"))} "\\n" {token("</tool_call>")}'
            rule = 'call ("\\n" call)*' if parallel else "call"
            return f"start: {rule}\ncall: {call}\n"
        if self.name == LLAMA3:
            return f"start: {schema(call_object('parameters'))}\n"
        if self.name == PHI4:
            call = f"{token('<|tool_call|>')} {schema(call_object('arguments'))} {token('<|/tool_call|>')}"
            return f"start: call{many}\ncall: {call}\n"
        if self.name == QWEN_XML:
            alts = " | ".join(
                f'{lit(f["name"] + ">")} "\\n" '
                f"{_xml_params(f.get('parameters') or _ANY_OBJECT, lit, schema, _qwen_param(lit))}"
                for f in functions
            )
            call = (
                f'{token("<tool_call>")} "\\n<function=" ({alts}) "</function>\\n" '
                f"{token('</tool_call>')}"
            )
            rule = 'call ("\\n" call)*' if parallel else "call"
            return f"start: {rule}\ncall: {call}\n"
        if self.name == SEED:
            alts = " | ".join(
                f'{lit(f["name"] + ">")} "\\n" '
                f"{_xml_params(f.get('parameters') or _ANY_OBJECT, lit, schema, _seed_param(lit))}"
                for f in functions
            )
            call = (
                f'{token(_SEED_OPEN)} "\\n<function=" ({alts}) "</function>\\n" '
                f"{token(_SEED_CLOSE)}"
            )
            rule = 'call ("\\n" call)*' if parallel else "call"
            return f"start: {rule}\ncall: {call}\n"
        if self.name == MINIMAX:
            alts = " | ".join(
                f'{lit(_minimax_opening(f["name"]))} "\\n" '
                f"{_xml_params(f.get('parameters') or _ANY_OBJECT, lit, schema, _minimax_param(lit))}"
                for f in functions
            )
            invoke = f'({alts}) {lit("</invoke>")} "\\n"'
            opening, closing = token(_MINIMAX_OPEN), token(_MINIMAX_CLOSE)
            return f'start: {opening} "\\n" invoke{many} {closing}\ninvoke: {invoke}\n'
        if self.name == GLM:
            alts = " | ".join(
                f"{lit(f['name'])} "
                f"{_xml_params(f.get('parameters') or _ANY_OBJECT, lit, schema, _glm_param(lit, token))}"
                for f in functions
            )
            call = f'{token("<tool_call>")} ({alts}) "\\n"? {token("</tool_call>")}'
            rule = 'call ("\\n"? call)*' if parallel else "call"
            return f"start: {rule}\ncall: {call}\n"
        if self.name in (DEEPSEEK_V31, DEEPSEEK_V3):
            v31 = self.name == DEEPSEEK_V31
            alts = " | ".join(
                f"{lit(f['name'])} {token(_DS_SEP)} {schema(params(f))}"
                if v31
                else f'"function" {token(_DS_SEP)} {lit(f["name"] + _DS_JSON_OPEN)} '
                f"{schema(params(f))} {lit(_DS_JSON_CLOSE)}"
                for f in functions
            )
            call = f"{token(_DS_BEGIN)} ({alts}) {token(_DS_END)}"
            between = "" if v31 else lit("\n")
            rule = f"call ({between} call)*" if parallel else "call"
            opening, closing = token(_DS_OPEN), token(_DS_CLOSE)
            return f"start: {opening} {rule} {closing}\ncall: {call}\n"
        if self.name == KIMI:
            alts = " | ".join(
                f"{lit('functions.' + f['name'] + ':')} /[0-9]{{1,3}}/ "
                f"{token(_KIMI_ARGS)} {schema(params(f))}"
                for f in functions
            )
            call = f"{token(_KIMI_BEGIN)} ({alts}) {token(_KIMI_END)}"
            opening, closing = token(_KIMI_OPEN), token(_KIMI_CLOSE)
            return f"start: {opening} call{many} {closing}\ncall: {call}\n"
        if self.name == GEMMA4:
            return gemma4_calls.grammar(functions, token, parallel)
        if self.name == MUSE:

            def muse_call(f: Mapping[str, Any]) -> str:
                name, parameters = f["name"], f.get("parameters") or _ANY_OBJECT
                invoke = f"{token(_ATEM_INVOKE)} {lit(' name=' + json.dumps(name) + '>')}"
                return (
                    f'{lit(" to=" + name)} {token("<|message|>")} {token(_ATEM_OPEN)} "\\n" '
                    f'{invoke} "\\n" {_xml_params(parameters, lit, schema, _atem_param(lit, token))} '
                    f'{token("</atem:invoke>")} "\\n" {token(_ATEM_CLOSE)}'
                )

            alts = " | ".join(muse_call(f) for f in functions)
            eom, start = token("<|eom|>"), token("<|start|>")
            # Messages of reasoning first, as llama.cpp's grammar allows (any text: special
            # tokens are no text); each further call in a message of its own, as the
            # template writes them.
            more = f' ({eom} {start} "assistant" call)*' if parallel else ""
            return (
                f"start: muse_reasoning* call{more}\ncall: {alts}\n"
                f'muse_reasoning: " to=self" {token("<|message|>")} MUSE_THOUGHT {eom} {start} '
                '"assistant"\nMUSE_THOUGHT: /(?s:.*)/\n'
            )
        if self.name == COMMAND:
            # laid out as the template writes its calls and the system prompt asks
            action = schema(call_object("parameters", "", "tool_name", "tool_call_id"))
            more = '(",\\n    " action)*' if parallel else ""
            return (
                f'start: {token(_COMMAND_OPEN)} "[\\n    " action {more} "\\n]" '
                f"{token(_COMMAND_CLOSE)}\naction: {action}\n"
            )
        if self.name in (MISTRAL, GRANITE) and not self.args_form:
            items = {"type": "array", "items": call_object("arguments", "/items"), "minItems": 1}
            if not parallel:
                items["maxItems"] = 1
            marker = token("[TOOL_CALLS]" if self.name == MISTRAL else "<|tool_call|>")
            return f"start: {marker} {schema({**items, 'x-guidance': JSON_STYLE})}\n"
        if self.name == MISTRAL:
            alts = " | ".join(
                f"{token('[TOOL_CALLS]')} {lit(f['name'])} {token('[ARGS]')} {schema(params(f))}"
                for f in functions
            )
            return f"start: call{many}\ncall: {alts}\n"
        alts = " | ".join(
            f"{token('<|channel|>')} {lit('commentary to=functions.' + f['name'] + ' ')} "
            f'{token("<|constrain|>")} "json" {token("<|message|>")} {schema(params(f))}'
            for f in functions
        )
        return f"start: {alts}\n"


_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_DS_OPEN, _DS_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_BEGIN, _DS_END, _DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_DS_JSON_OPEN, _DS_JSON_CLOSE = "\n```json\n", "\n```"  # around DeepSeek-R1's arguments
_KIMI_OPEN, _KIMI_CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
_KIMI_BEGIN, _KIMI_ARGS, _KIMI_END = (
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
_COMMAND_OPEN, _COMMAND_CLOSE = "<|START_ACTION|>", "<|END_ACTION|>"
_SEED_OPEN, _SEED_CLOSE = "<seed:tool_call>", "</seed:tool_call>"
_MINIMAX_OPEN, _MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
_ATEM_OPEN, _ATEM_CLOSE, _ATEM_INVOKE = (
    "<atem:function_calls>",
    "</atem:function_calls>",
    "<atem:invoke",
)
# The tokens llama.cpp keeps whole in Muse Glimmer's output (its preserved_tokens), but for
# the ends of messages, which the reply reader takes apart already.
_ATEM_MARKERS = ("<|start|>", "<|message|>", _ATEM_OPEN, _ATEM_INVOKE, "<atem:parameter")
_ATEM_MARKERS += ("</atem:parameter>", "</atem:invoke>", _ATEM_CLOSE)
_DS_MARKERS = (_DS_OPEN, _DS_CLOSE, _DS_BEGIN, _DS_END, _DS_SEP)
_KIMI_MARKERS = (_KIMI_OPEN, _KIMI_CLOSE, _KIMI_BEGIN, _KIMI_ARGS, _KIMI_END)
_HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")

_FORMATS = {
    HERMES: ToolFormat(HERMES, ("<tool_call>",), "</tool_call>", ("<tool_call>", "</tool_call>")),
    LLAMA3: ToolFormat(LLAMA3, ("<|python_tag|>",), markers=("<|python_tag|>",), at_start=("{",)),
    MISTRAL: ToolFormat(
        MISTRAL, ("[TOOL_CALLS]",), markers=("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")
    ),
    HARMONY: ToolFormat(HARMONY, (), markers=_HARMONY_TOKENS, whole_output=True),
    PHI4: ToolFormat(
        PHI4, ("<|tool_call|>",), "<|/tool_call|>", ("<|tool_call|>", "<|/tool_call|>")
    ),
    QWEN_XML: ToolFormat(
        QWEN_XML, ("<tool_call>",), "</tool_call>", ("<tool_call>", "</tool_call>")
    ),
    GRANITE: ToolFormat(GRANITE, ("<|tool_call|>",), markers=("<|tool_call|>",)),
    GLM: ToolFormat(GLM, ("<tool_call>",), "</tool_call>", ("<tool_call>", "</tool_call>")),
    DEEPSEEK_V31: ToolFormat(DEEPSEEK_V31, (_DS_OPEN,), _DS_CLOSE, _DS_MARKERS),
    DEEPSEEK_V3: ToolFormat(DEEPSEEK_V3, (_DS_OPEN,), _DS_CLOSE, _DS_MARKERS),
    KIMI: ToolFormat(KIMI, (_KIMI_OPEN,), _KIMI_CLOSE, _KIMI_MARKERS),
    COMMAND: ToolFormat(COMMAND, (_COMMAND_OPEN,), _COMMAND_CLOSE, (_COMMAND_OPEN, _COMMAND_CLOSE)),
    SEED: ToolFormat(SEED, (_SEED_OPEN,), _SEED_CLOSE, (_SEED_OPEN, _SEED_CLOSE)),
    MINIMAX: ToolFormat(MINIMAX, (_MINIMAX_OPEN,), _MINIMAX_CLOSE, (_MINIMAX_OPEN, _MINIMAX_CLOSE)),
    GEMMA4: ToolFormat(
        GEMMA4,
        (gemma4_calls.OPEN,),
        gemma4_calls.CLOSE,
        (gemma4_calls.OPEN, gemma4_calls.CLOSE, gemma4_calls.QUOTE),
    ),
    # The reply reader (reasoning.Splitter) passes a message to a tool on as written, from
    # <|start|>, or for the reply's first message, whose header the prompt opened, from
    # ` to=`; an answer's header it takes away.
    MUSE: ToolFormat(MUSE, ("<|start|>",), _ATEM_CLOSE, _ATEM_MARKERS, at_start=("to=",)),
}


def get_format(name: str, args_form: bool = False) -> ToolFormat:
    fmt = _FORMATS[name]
    return ToolFormat(**{**fmt.__dict__, "args_form": True}) if args_form else fmt


def detect_format(template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template teaches, from its source; None if it has none."""
    if not template:
        return None
    if "<|channel|>" in template and "functions." in template:
        return _FORMATS[HARMONY]
    if _ATEM_OPEN in template and "<|start|>" in template:
        return _FORMATS[MUSE]
    if _KIMI_OPEN in template and _KIMI_BEGIN in template:
        return _FORMATS[KIMI]
    if _DS_OPEN in template and _DS_SEP in template:  # R1's arguments are in a ```json block
        return _FORMATS[DEEPSEEK_V3 if "```json" in template else DEEPSEEK_V31]
    if _COMMAND_OPEN in template and '"tool_name"' in template:
        return _FORMATS[COMMAND]
    if _SEED_OPEN in template:
        return _FORMATS[SEED]
    if _MINIMAX_OPEN in template:
        return _FORMATS[MINIMAX]
    if gemma4_calls.OPEN + "call:" in template:
        return _FORMATS[GEMMA4]
    if "[TOOL_CALLS]" in template:
        return get_format(MISTRAL, args_form="[ARGS]" in template)
    if "<|tool_call|>" in template and "<|start_of_role|>" in template:
        return _FORMATS[GRANITE]
    if "<|tool_call|>" in template or ("<|tool|>" in template and "<|/tool|>" in template):
        return _FORMATS[PHI4]
    if "<tool_call>" in template and "<function=" in template and "<parameter=" in template:
        return _FORMATS[QWEN_XML]
    if "<tool_call>" in template and "<arg_key>" in template:
        return _FORMATS[GLM]
    if "<tool_call>" in template:
        return _FORMATS[HERMES]
    if "<|python_tag|>" in template or (
        "<|start_header_id|>" in template and '"parameters": ' in template
    ):
        return _FORMATS[LLAMA3]
    return None


# --- parsing regions -----------------------------------------------------------------

_Call = tuple[str, str, str | None]  # name, arguments JSON, id (None: make one)


# Keywords whose values are data, not schemas: a "$ref" inside them is not a reference.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _rebased(schema: Any, at: str) -> Any:
    """`schema` placed at JSON pointer `at` inside another: its local references ("#",
    "#/$defs/X", "#/properties/...") made to point where their targets now are."""
    if isinstance(schema, list):
        return [_rebased(v, at) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = "#" + at + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _rebased(value, at)
    return out


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _call(
    obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters"), bare: bool = False
) -> _Call:
    """A call object: a name, and its arguments under one of `args_keys`. Inside a
    format's markers a call of no arguments may leave them out; any other key beside the
    name means it is not a call (arguments written flat would be lost). `bare` (JSON with
    no marker around it, which may well be an answer): the arguments key is required."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a call")
    name = obj["name"]
    if not NAME_PATTERN.match(name):
        raise ValueError(f"bad function name {name!r}")
    key = next((k for k in args_keys if k in obj), None)
    if key is None and (bare or set(obj) - {"name", "id", "type"}):
        raise ValueError("no arguments")
    return name, _arguments(obj[key] if key else {}), None


def _arguments(args: Any) -> str:
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = json.loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise ValueError("arguments are not an object")
    return dumps(args)


def _json_values(text: str, separator: str = "") -> list[Any]:
    """Every JSON value in `text`, which holds nothing else but whitespace and `separator`."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (separator and text[i] == separator)):
            i += 1
        if i == len(text):
            return values
        value, i = decoder.raw_decode(text, i)
        values.append(value)


def _one_json(text: str) -> Any:
    values = _json_values(text)
    if len(values) != 1:
        raise ValueError("expected one JSON value")
    return values[0]


def _calls_in(value: Any) -> list[_Call]:
    items = value if isinstance(value, list) else [value]
    if not items:
        raise ValueError("no calls")
    return [_call(item) for item in items]


def _hermes(fmt: ToolFormat, region: str) -> list[_Call]:
    body = region.removeprefix("<tool_call>")
    body = body.removesuffix("</tool_call>")
    return [_call(_one_json(body))]


def _phi4(fmt: ToolFormat, region: str) -> list[_Call]:
    body = region.removeprefix("<|tool_call|>").removesuffix("<|/tool_call|>")
    return _calls_in(_one_json(body))


def _granite(fmt: ToolFormat, region: str) -> list[_Call]:
    return _calls_in(_one_json(region.removeprefix("<|tool_call|>")))


def _llama3(fmt: ToolFormat, region: str) -> list[_Call]:
    body = region.removeprefix("<|python_tag|>")
    values = _json_values(body, separator=";")
    if not values:
        raise ValueError("no calls")
    bare = not region.lstrip().startswith("<|python_tag|>")
    return [_call(v, ("parameters", "arguments"), bare) for v in values]


def _mistral(fmt: ToolFormat, region: str) -> list[_Call]:
    calls = []
    chunks = [c for c in region.split("[TOOL_CALLS]") if c.strip()]
    if not chunks or region.lstrip()[: len("[TOOL_CALLS]")] != "[TOOL_CALLS]":
        raise ValueError("no calls")
    for chunk in chunks:
        if "[ARGS]" not in chunk:
            calls += _calls_in(_one_json(chunk))
            continue
        head, args = chunk.split("[ARGS]", 1)
        name, _, call_id = head.partition("[CALL_ID]")
        name = name.strip()
        if not NAME_PATTERN.match(name):
            raise ValueError(f"bad function name {name!r}")
        call_id = call_id.strip()
        ok_id = len(call_id) == 9 and call_id.isalnum()
        calls.append((name, _arguments(_one_json(args)), call_id if ok_id else None))
    return calls


_XML_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
_SEED_CALL = re.compile(
    r"<seed:tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</seed:tool_call>", re.S
)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


_MUSE_CALL = re.compile(
    r"(?:<\|start\|>\s*assistant)?\s*to=[^<]*<\|message\|>\s*"
    + re.escape(_ATEM_OPEN)
    + "(.*)"
    + re.escape(_ATEM_CLOSE),
    re.S,
)
_ATEM_INVOKE_BLOCK = re.compile(r'<atem:invoke name="([^"\n]+)">(.*?)</atem:invoke>', re.S)
_ATEM_PARAM = re.compile(r'\s*<atem:parameter name="([^"\n]+)">(.*?)</atem:parameter>\s*', re.S)


def _muse(fmt: ToolFormat, region: str) -> list[_Call]:
    """The calls of a message to a tool: its invokes, each a call whatever the message's
    recipient (llama.cpp takes the name from the invoke too); a value is the text itself
    where its schema allows a string, else the JSON it spells."""
    m = _MUSE_CALL.fullmatch(region.strip())
    if m is None:
        raise ValueError("not a message to a tool")
    calls = []
    for invoke in _in_sequence(_ATEM_INVOKE_BLOCK, m.group(1)):
        name, body = _name(invoke.group(1)), invoke.group(2)
        if _ATEM_PARAM.sub("", body).strip():
            raise ValueError("text between parameters")
        parameters = (fmt.schemas or {}).get(name) or {}
        properties = parameters.get("properties") or {}
        args = {
            key: value if may_be_string(properties.get(key), parameters) else _json_or_text(value)
            for key, value in _ATEM_PARAM.findall(body)
        }
        calls.append((name, dumps(args), None))
    return calls


def may_be_string(schema: Any, root: Any = None, seen: frozenset[str] = frozenset()) -> bool:
    """Whether a value of `schema` may be a string, as llama.cpp's may_be_string decides it
    (common/json-schema.cpp): a string type, a string const or enum member, a reference to
    such a schema (in `root`), any of anyOf's, all of allOf's; a schema with no type not."""
    if not isinstance(schema, Mapping):
        return False
    kinds = schema.get("type")
    if kinds == "string" or (isinstance(kinds, list) and "string" in kinds):
        return True
    if "const" in schema:
        return isinstance(schema["const"], str)
    if isinstance(schema.get("enum"), list):
        return any(isinstance(v, str) for v in schema["enum"])
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/") and ref not in seen:
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, Mapping) else None
        return may_be_string(target, root, seen | {ref})
    options = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(options, list):
        return any(may_be_string(o, root, seen) for o in options)
    parts = [p for p in schema.get("allOf") or () if isinstance(p, Mapping) and p]
    return bool(parts) and all(may_be_string(p, root, seen) for p in parts)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _muse_call(name: str, arguments: Mapping[str, Any]) -> str:
    """One call as Muse Glimmer's template writes it: strings as they are, others as JSON."""
    params = "".join(
        f'<atem:parameter name="{key}">{value if isinstance(value, str) else dumps(value)}'
        "</atem:parameter>\n"
        for key, value in arguments.items()
    )
    return (
        f"<|start|>assistant to={name}<|message|>{_ATEM_OPEN}\n"
        f'{_ATEM_INVOKE} name="{name}">\n{params}</atem:invoke>\n{_ATEM_CLOSE}'
    )


def _atem_param(
    lit: Callable[[str], str], token: Callable[[str], str]
) -> Callable[[str, str], str]:
    def param(key: str, value: str) -> str:
        opening = f"{token('<atem:parameter')} {lit(' name=' + json.dumps(key) + '>')}"
        return f'{opening} {value} {token("</atem:parameter>")} "\\n"'

    return param


def _qwen_xml(fmt: ToolFormat, region: str) -> list[_Call]:
    return _xml_function(fmt, _XML_CALL.fullmatch(region.strip()))


def _seed(fmt: ToolFormat, region: str) -> list[_Call]:
    return _xml_function(fmt, _SEED_CALL.fullmatch(region.strip()))


def _xml_function(fmt: ToolFormat, m: re.Match[str] | None) -> list[_Call]:
    """The call of a `<function=NAME>` block with its `<parameter=KEY>` ones."""
    if m is None:
        raise ValueError("not a call")
    name, body = m.group(1).strip(), m.group(2)
    if not NAME_PATTERN.match(name):
        raise ValueError(f"bad function name {name!r}")
    if _XML_PARAM.sub("", body).strip():
        raise ValueError("text between parameters")
    properties = ((fmt.schemas or {}).get(name) or {}).get("properties") or {}
    args = {
        key.strip(): _xml_value(value, properties.get(key.strip()))
        for key, value in _XML_PARAM.findall(body)
    }
    return [(name, dumps(args), None)]


def _xml_value(text: str, schema: Any) -> Any:
    """A parameter's value: the text itself where the schema says string (or says
    nothing and the text is no JSON), else the JSON it spells."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    texts = schema.get("enum", []) if isinstance(schema, dict) else []
    if kind == "string" or (isinstance(kind, list) and kind and kind[0] == "string"):
        return text
    if text in texts:  # an enum of strings, written unquoted
        return text
    if kind == "boolean" and text in ("True", "False"):  # as Seed-OSS's template writes them
        return text == "True"
    try:
        return json.loads(text)
    except ValueError:
        return text


def _xml_call(name: str, arguments: Mapping[str, Any]) -> str:
    params = "".join(
        f"<parameter={key}>\n{value if isinstance(value, str) else dumps(value)}\n</parameter>\n"
        for key, value in arguments.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _seed_call(name: str, arguments: Mapping[str, Any]) -> str:
    params = "".join(
        f"<parameter={key}>{value if isinstance(value, str) else dumps(value)}</parameter>\n"
        for key, value in arguments.items()
    )
    return f"{_SEED_OPEN}\n<function={name}>\n{params}</function>\n{_SEED_CLOSE}"


def _glm_call(name: str, arguments: Mapping[str, Any]) -> str:
    args = "".join(
        f"<arg_key>{key}</arg_key><arg_value>{value if isinstance(value, str) else dumps(value)}"
        "</arg_value>"
        for key, value in arguments.items()
    )
    return f"<tool_call>{name}{args}</tool_call>"


_GLM_CALL = re.compile(r"<tool_call>\s*([^<\n]+?)\s*((?:<arg_key>.*)?)</tool_call>", re.S)
_GLM_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>\s*", re.S)


def _glm(fmt: ToolFormat, region: str) -> list[_Call]:
    m = _GLM_CALL.fullmatch(region.strip())
    if m is None:
        raise ValueError("not a call")
    name, body = m.group(1).strip(), m.group(2)
    if not NAME_PATTERN.match(name):
        raise ValueError(f"bad function name {name!r}")
    if _GLM_ARG.sub("", body):
        raise ValueError("text between arguments")
    properties = ((fmt.schemas or {}).get(name) or {}).get("properties") or {}
    args = {
        key.strip(): _xml_value(value, properties.get(key.strip()))
        for key, value in _GLM_ARG.findall(body)
    }
    return [(name, dumps(args), None)]


_MINIMAX_INVOKE = re.compile(r'<invoke name="([^"\n]+)">(.*?)</invoke>', re.S)
_MINIMAX_PARAM = re.compile(r'\s*<parameter name="([^"\n]+)">(.*?)</parameter>\s*', re.S)


def _minimax(fmt: ToolFormat, region: str) -> list[_Call]:
    """The invokes of a `<minimax:tool_call>` block, each a call; values read by the
    tools' schemas, as in qwen3_xml."""
    calls = []
    for m in _in_sequence(_MINIMAX_INVOKE, _section(region, _MINIMAX_OPEN, _MINIMAX_CLOSE)):
        name, body = _name(m.group(1).strip()), m.group(2)
        if _MINIMAX_PARAM.sub("", body).strip():
            raise ValueError("text between parameters")
        properties = ((fmt.schemas or {}).get(name) or {}).get("properties") or {}
        args = {
            key: _xml_value(value, properties.get(key))
            for key, value in _MINIMAX_PARAM.findall(body)
        }
        calls.append((name, dumps(args), None))
    return calls


def _minimax_invoke(name: str, arguments: Mapping[str, Any]) -> str:
    """One call as MiniMax-M2's template writes it: strings as they are, others as JSON."""
    params = "".join(
        f'<parameter name="{key}">{value if isinstance(value, str) else dumps(value)}</parameter>\n'
        for key, value in arguments.items()
    )
    return f"{_minimax_opening(name)}\n{params}</invoke>\n"


def _minimax_opening(name: str) -> str:
    return f'<invoke name="{name}">'


def _in_sequence(pattern: re.Pattern[str], body: str) -> list[re.Match[str]]:
    """Every match of `pattern` in `body`, which holds nothing else but whitespace."""
    matches, at = [], 0
    for m in pattern.finditer(body):
        if body[at : m.start()].strip():
            raise ValueError("text between calls")
        matches.append(m)
        at = m.end()
    if not matches or body[at:].strip():
        raise ValueError("not calls")
    return matches


def _section(region: str, opening: str, closing: str) -> str:
    """What lies between a section's markers; the closing one may be missing where the
    output ended after the last call."""
    body = region.strip()
    if not body.startswith(opening):
        raise ValueError("not a call section")
    return body.removeprefix(opening).removesuffix(closing)


def _name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise ValueError(f"bad function name {name!r}")
    return name


_DS_V31_CALL = re.compile(
    re.escape(_DS_BEGIN) + r"\s*([^<\s]+?)\s*" + re.escape(_DS_SEP) + "(.*?)" + re.escape(_DS_END),
    re.S,
)
_DS_V3_CALL = re.compile(
    re.escape(_DS_BEGIN)
    + r"\s*(\w+)\s*"
    + re.escape(_DS_SEP)
    + r"\s*([^\n]+?)\s*\n```(?:json)?\s*\n(.*?)\n?```\s*"
    + re.escape(_DS_END),
    re.S,
)


def _deepseek_v31(fmt: ToolFormat, region: str) -> list[_Call]:
    body = _section(region, _DS_OPEN, _DS_CLOSE)
    return [
        (_name(m.group(1)), _arguments(_one_json(m.group(2))), None)
        for m in _in_sequence(_DS_V31_CALL, body)
    ]


def _deepseek_v3(fmt: ToolFormat, region: str) -> list[_Call]:
    calls = []
    for m in _in_sequence(_DS_V3_CALL, _section(region, _DS_OPEN, _DS_CLOSE)):
        if m.group(1) != "function":
            raise ValueError(f"a call of type {m.group(1)!r}")
        calls.append((_name(m.group(2)), _arguments(_one_json(m.group(3))), None))
    return calls


_KIMI_CALL = re.compile(
    re.escape(_KIMI_BEGIN)
    + r"\s*(functions\.([^:<\s]+):[0-9]+)\s*"
    + re.escape(_KIMI_ARGS)
    + "(.*?)"
    + re.escape(_KIMI_END),
    re.S,
)


def _kimi(fmt: ToolFormat, region: str) -> list[_Call]:
    body = _section(region, _KIMI_OPEN, _KIMI_CLOSE)
    return [
        (_name(m.group(2)), _arguments(_one_json(m.group(3))), m.group(1))
        for m in _in_sequence(_KIMI_CALL, body)
    ]


def _kimi_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    """Calls as Kimi K2 writes them, each under its id (`functions.NAME:IDX`; another id
    is replaced by one of that form, numbered by its place)."""
    parts = []
    for i, call in enumerate(calls):
        function = call.get("function", call)
        call_id = kimi_id(call.get("id") or "", function["name"], i)
        parts.append(
            f"{_KIMI_BEGIN}{call_id}{_KIMI_ARGS}{dumps(function.get('arguments') or {})}{_KIMI_END}"
        )
    return _KIMI_OPEN + "".join(parts) + _KIMI_CLOSE


def kimi_id(call_id: str, name: str, index: int) -> str:
    """A call id as Kimi K2's templates write them, `functions.NAME:IDX`: the id itself
    if it is one, else one made of the name and the call's `index` in its message."""
    m = _KIMI_ID.fullmatch(call_id)
    return call_id if m and m.group(1) == name else f"functions.{name}:{index}"


_KIMI_ID = re.compile(r"functions\.([A-Za-z0-9_-]{1,64}):[0-9]+")


_ACTION_KEYS = frozenset({"tool_call_id", "tool_name", "parameters"})


def _command(fmt: ToolFormat, region: str) -> list[_Call]:
    body = _section(region, _COMMAND_OPEN, _COMMAND_CLOSE)
    actions = _one_json(body)
    if not isinstance(actions, list) or not actions:
        raise ValueError("no calls")
    calls = []
    for action in actions:
        if not isinstance(action, dict) or set(action) - _ACTION_KEYS:
            raise ValueError("not a call")  # arguments written flat would be lost
        calls.append((_name(action["tool_name"]), _arguments(action.get("parameters") or {}), None))
    return calls


def _qwen_param(lit: Callable[[str], str]) -> Callable[[str, str], str]:
    def param(key: str, value: str) -> str:
        return f'{lit(f"<parameter={key}>")} "\\n" {value} "\\n" {lit("</parameter>")} "\\n"'

    return param


def _seed_param(lit: Callable[[str], str]) -> Callable[[str, str], str]:
    def param(key: str, value: str) -> str:
        return f'{lit(f"<parameter={key}>")} {value} {lit("</parameter>")} "\\n"'

    return param


def _minimax_param(lit: Callable[[str], str]) -> Callable[[str, str], str]:
    def param(key: str, value: str) -> str:
        opening = lit(f'<parameter name="{key}">')
        return f'{opening} {value} {lit("</parameter>")} "\\n"'

    return param


def _glm_param(lit: Callable[[str], str], token: Callable[[str], str]) -> Callable[[str, str], str]:
    def param(key: str, value: str) -> str:
        return (
            f'"\\n"? {token("<arg_key>")} {lit(key)} {token("</arg_key>")} "\\n"? '
            f"{token('<arg_value>')} {value} {token('</arg_value>')}"
        )

    return param


def _xml_params(
    parameters: Mapping[str, Any],
    lit: Callable[[str], str],
    schema: Callable,
    param: Callable[[str, str], str],
) -> str:
    """The grammar of a call's parameters, in the schema's order, each required one
    once and each other one at most once, each written by `param(key, value rule)`; a
    string's value is text without "</"."""
    required = set(parameters.get("required") or ())
    # Each value's schema stands alone: the definitions its references point to go with it.
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    parts = []
    for key, spec in (parameters.get("properties") or {}).items():
        spec = spec if isinstance(spec, dict) else {}
        texts = spec.get("enum", [spec["const"]] if "const" in spec else None)
        if texts and all(isinstance(t, str) for t in texts):
            value = "(" + " | ".join(lit(t) for t in texts) + ")"  # written as is, unquoted
        elif spec.get("type") == "string":
            value = "/([^<]|<[^\\/])*/"
        else:
            value = schema({**spec, **defs, "x-guidance": JSON_STYLE})
        parts.append(f"({param(key, value)})" + ("" if key in required else "?"))
    return " ".join(parts)


_HARMONY_END = re.compile(r"<\|end\|>|<\|call\|>|<\|return\|>")
_RECIPIENT = re.compile(r"\bto=functions\.([A-Za-z0-9_-]{1,64})")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


def _harmony(fmt: ToolFormat, region: str) -> list[Item] | None:
    if "<|message|>" not in region:
        return None
    reasoning, content, calls = [], [], []
    for message in region.split("<|start|>"):
        if not message.strip():
            continue
        header, found, body = message.partition("<|message|>")
        if not found:  # text outside any message (a final answer the reader took apart)
            content.append(message)
            continue
        body = _HARMONY_END.split(body, 1)[0]
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient:
            calls.append((recipient.group(1), _arguments(_one_json(body)), None))
        elif " to=" in header:  # a built-in tool (browser, python): not a function call
            raise ValueError("a call to a built-in tool")
        elif channel and channel.group(1) == "analysis":
            reasoning.append(body.strip())
        else:
            content.append(body)
    items: list[Item] = []
    if any(reasoning):
        items.append(Piece(REASONING, "\n".join(r for r in reasoning if r)))
    if content:
        items.append(Piece(ANSWER, "".join(content)))
    return items + calls


_PARSERS: dict[str, Callable[[ToolFormat, str], Any]] = {
    HERMES: _hermes,
    LLAMA3: _llama3,
    MISTRAL: _mistral,
    HARMONY: _harmony,
    PHI4: _phi4,
    QWEN_XML: _qwen_xml,
    GRANITE: _granite,
    GLM: _glm,
    DEEPSEEK_V31: _deepseek_v31,
    DEEPSEEK_V3: _deepseek_v3,
    KIMI: _kimi,
    COMMAND: _command,
    SEED: _seed,
    MINIMAX: _minimax,
    GEMMA4: lambda fmt, region: [(*gemma4_calls.parse_call(region), None)],
    MUSE: _muse,
}


# --- the streaming parser ------------------------------------------------------------


@dataclass
class ToolCallParser:
    """Reads generated text and hands on content (Pieces) and whole calls, in order.

    Content is passed on as soon as it cannot begin a call; whitespace between content
    and a call is dropped, but content on both sides of calls stays parted by the
    whitespace that followed them (an output without calls passes exactly as generated). Feeding
    the whole text at once gives the same content and calls as feeding it piece by piece.
    """

    fmt: ToolFormat
    new_id: Callable[[], str] | None = None
    calls: list[ToolCall] = field(default_factory=list)
    content: str = ""
    reasoning: str = ""
    _buffer: str = ""  # text not yet decided on
    _region: str | None = None  # a call being read
    _space: str = ""  # whitespace held back from the content
    _dropped: str = ""  # the whitespace dropped before the call being read
    _after_call: bool = False  # a call came since the last content
    _started: bool = False  # whether the output has shown anything but whitespace

    def __post_init__(self) -> None:
        if self.fmt.whole_output:
            self._region = ""

    def feed(self, text: str) -> list[Item]:
        out: list[Item] = []
        if self._region is not None:
            self._region += text
        else:
            self._buffer += text
        while True:
            if self._region is None:
                start = self._find_open()
                if start is None:
                    keep = len(self._buffer) - self._holdback()
                    self._content(self._buffer[:keep], out)
                    self._buffer = self._buffer[keep:]
                    return out
                self._content(self._buffer[:start], out)
                self._dropped, self._space = self._space, ""
                self._region, self._buffer = self._buffer[start:], ""
            if self.fmt.close is None:
                return out  # the call runs to the end of the output
            end = self._region.find(self.fmt.close)
            if end < 0:
                return out
            end += len(self.fmt.close)
            block, self._buffer = self._region[:end], self._region[end:]
            self._region = None
            self._emit(block, out)

    def finish(self) -> list[Item]:
        """Whatever is left: an unfinished call (as text unless it parses), held text."""
        out: list[Item] = []
        if self._region is not None:
            region, self._region = self._region, None
            self._emit(region, out)
        self._content(self._buffer, out)
        self._buffer = ""
        if not self.calls:
            self._pass(self._space, out)
        self._space = ""
        return out

    def items(self, texts: Iterable[str]) -> list[Item]:
        """Every item of a whole output given as pieces (feed each, then finish)."""
        out = [item for text in texts for item in self.feed(text)]
        return out + self.finish()

    def _find_open(self) -> int | None:
        buf = self._buffer
        found = [i for i in (buf.find(m) for m in self.fmt.opens) if i >= 0]
        if not self._started:
            lead = len(buf) - len(buf.lstrip())
            if any(buf.startswith(m, lead) for m in self.fmt.at_start):
                found.append(lead)
        return min(found) if found else None

    def _holdback(self) -> int:
        """How much of the buffer's end might still begin a call."""
        buf, hold = self._buffer, 0
        for marker in self.fmt.opens:
            for n in range(min(len(marker) - 1, len(buf)), hold, -1):
                if buf.endswith(marker[:n]):
                    hold = n
                    break
        if not self._started and self.fmt.at_start and not buf.strip():
            hold = len(buf)  # only whitespace yet: a call may still open the output
        return hold

    def _content(self, text: str, out: list[Item]) -> None:
        body = text.rstrip()
        if not body:
            self._space += text
            return
        full = self._space + body
        if self._after_call:
            # The whitespace after a call goes with it, unless content came before the
            # call: then it parts that content from this (as llama.cpp keeps it).
            full, self._after_call = (full if self.content else full.lstrip()), False
        self._started = True
        self._pass(full, out)
        self._space = text[len(body) :]

    def _pass(self, text: str, out: list[Item]) -> None:
        if text:
            self.content += text
            out.append(Piece(ANSWER, text))

    def _emit(self, block: str, out: list[Item]) -> None:
        items = self.fmt.parse(block, self.new_id)
        if items is None:  # not a call after all: it is text
            self._space = self._dropped + self._space
            self._content(block, out)
            return
        for item in items:
            if isinstance(item, ToolCall):
                self.calls.append(item)
                out.append(item)
                self._space, self._after_call = "", True
            elif isinstance(item, Piece) and item.kind == REASONING:
                self.reasoning += item
                out.append(item)
            else:
                self._content(item, out)
        self._dropped = ""


def parse(fmt: ToolFormat, text: str) -> tuple[str, list[ToolCall]]:
    """The content and calls of a whole output."""
    parser = ToolCallParser(fmt)
    parser.items([text])
    return parser.content, parser.calls
