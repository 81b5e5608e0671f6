"""Structured outputs: the grammar engine's masks on the bundled stories260K (alone and in
batched steps); GBNF matched as llama.cpp matches it (its tests' cases and grammars);
JSON schemas, what is sampled under them checked by jsonschema, and those the engine
refuses; `run --format/--grammar`; and over a real server response_format (the openai
client's parse with a pydantic model) and forced tool calls."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Literal

import jsonschema
import numpy as np
import openai
import pytest
import torch

pytest.importorskip("llguidance")

from in_process import llmrun
from llguidance.numpy import apply_token_bitmask_inplace  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

from llmrun import api, gbnf, gbnf_lexemes, structured  # noqa: E402
from llmrun.batching import Request, Scheduler  # noqa: E402
from llmrun.sampling import SamplingParams  # noqa: E402
from llmrun.structured import GrammarError, check_schema  # noqa: E402

ENGINE = api.load(None, device="cpu", ctx_size=512)
VOCAB = structured.vocabulary(ENGINE.tokenizer, ENGINE.eos_ids)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "bird"]},
        "happy": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "happy"],
    "additionalProperties": False,
}


def generate(grammar, prompt="Once upon a time", max_tokens=120, **params):
    ids = ENGINE.tokenizer.encode(prompt)
    sampling = SamplingParams(**{"temperature": 0, **params}).updated(grammar=grammar)
    responses = list(ENGINE.generate(ids, sampling, max_tokens))
    return "".join(r.text for r in responses), responses[-1].finish_reason


def valid_person(text):
    person = json.loads(text)
    assert set(person) == set(PERSON["required"])
    assert isinstance(person["name"], str) and len(person["name"]) <= 12
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 120
    assert person["pet"] in ("cat", "dog", "bird") and isinstance(person["happy"], bool)
    return person


def test_a_schema_constrains_greedy_and_sampled_decoding():
    text, finish = generate(VOCAB.json_schema(PERSON))
    valid_person(text)
    assert finish == "stop"  # the grammar ends in an end-of-text token
    for seed in range(3):
        text, finish = generate(VOCAB.json_schema(PERSON), temperature=1.0, seed=seed)
        assert finish == "stop"
        valid_person(text)
    # Unconstrained, the model tells a story.
    assert not generate(None, max_tokens=20)[0].lstrip().startswith("{")


def test_any_json_object():
    grammar = VOCAB.json_schema(None)
    text, finish = generate(grammar, max_tokens=200, temperature=0.8, seed=1)
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert text.startswith("{")


def test_each_schema_is_compiled_once():
    assert VOCAB.json_schema(PERSON) is VOCAB.json_schema(json.loads(json.dumps(PERSON)))
    assert VOCAB.json_schema({"type": "object"}) is not VOCAB.json_schema(PERSON)


def test_the_mask_forbids_what_the_grammar_forbids():
    constraint = VOCAB.json_schema(PERSON).constraint()
    logits = torch.randn(ENGINE.tokenizer.vocab_size + 3)  # a padded embedding's extra rows
    masked = constraint.apply(logits)
    # llguidance's own (independent) way of applying its bitmask.
    reference = logits[None, : VOCAB.size].numpy().copy()
    apply_token_bitmask_inplace(reference, constraint.bits)
    assert np.array_equal(masked[: VOCAB.size].numpy(), reference[0])
    assert torch.isinf(masked[VOCAB.size :]).all()
    allowed = torch.isfinite(masked).nonzero().flatten().tolist()
    assert [ENGINE.tokenizer.token_bytes(i) for i in allowed] == [b"{"]
    assert torch.equal(logits, logits.clone())  # the raw logits are left alone


def test_gbnf_and_lark_grammars():
    yes_no = VOCAB.gbnf('root ::= ("yes" | "no") "!"')
    assert generate(yes_no) in (("yes!", "stop"), ("no!", "stop"))
    assert generate(VOCAB.lark('start: "Lily " ("ran" | "sat")'))[0] in ("Lily ran", "Lily sat")


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "string", "not": {"const": "x"}}, 'Unimplemented keys: ["not"]'),
        ({"type": "array", "uniqueItems": True}, 'Unimplemented keys: ["uniqueItems"]'),
        ({"type": "string", "pattern": "(?=a)"}, "look-around"),
        ({"type": "string", "format": "colour"}, "Unknown format: colour"),
        ({"type": "array", "contains": {"type": "integer"}}, 'Unimplemented keys: ["contains"]'),
        (
            {"if": {"type": "string"}, "then": {"minLength": 2}},
            'Unimplemented keys: ["if", "then"]',
        ),
        ({"dependentRequired": {"a": ["b"]}}, 'Unimplemented keys: ["dependentRequired"]'),
        ({"propertyNames": {"pattern": "^a"}}, 'Unimplemented keys: ["propertyNames"]'),
        ({"unevaluatedProperties": False}, 'Unimplemented keys: ["unevaluatedProperties"]'),
        (
            {"oneOf": [{"type": "integer"}, {"type": "number"}]},
            "oneOf constraints are not supported",
        ),
        (
            {"properties": {"a": {}}, "additionalProperties": True, "minProperties": 1},
            "min/maxProperties only supported when",
        ),
        ({"$ref": "https://example.com/s.json"}, "is not present in a registry"),
        ({"type": "string", "minLength": 3, "maxLength": 1}, "Unsatisfiable schema: minLength"),
    ],
)
def test_schemas_the_engine_refuses_name_the_feature(schema, named):
    with pytest.raises(GrammarError, match="grammar engine \\(llguidance\\) cannot use it") as e:
        VOCAB.json_schema(schema, "response_format")
    assert named in str(e.value)


def test_what_is_not_a_json_schema():
    assert check_schema(PERSON) is None and check_schema(True) is None
    assert "unknown type 'text'" in check_schema({"type": "text"})
    assert "properties must be an object" in check_schema({"properties": [1]})
    assert "at properties/a" in check_schema({"properties": {"a": {"type": 3}}})
    assert "anyOf must be a list" in check_schema({"anyOf": {}})
    assert "required must be a list" in check_schema({"required": "a"})
    # items: a schema, or (drafts 4 to 2019-09) a list of schemas, one per position
    assert check_schema({"items": [{"type": "integer"}, True]}) is None
    assert "unknown type 'x' at items/1" in check_schema({"items": [{}, {"type": "x"}]})
    assert "must be an object or a boolean" in check_schema([])


def test_batched_steps_give_each_sequence_its_own_mask():
    """Constrained and free sequences decoded together get what each gets alone."""
    schemas = [PERSON, None, {"type": "object", "properties": {"ok": {"type": "boolean"}}}]
    jobs = [
        ("Once upon a time", VOCAB.json_schema(PERSON)),
        ("The little dog", None),
        ("Lily and Tom went", VOCAB.json_schema(schemas[2])),
        ("One day, a big bird", VOCAB.gbnf('root ::= "yes" | "no"')),
        ("The sun was", VOCAB.json_schema(PERSON)),
    ]
    alone = [generate(grammar, prompt, 60) for prompt, grammar in jobs]
    scheduler = Scheduler(ENGINE, parallel=4, queue=8)
    scheduler.start()
    try:
        results = [[] for _ in jobs]
        done = [False] * len(jobs)
        import threading

        finished = threading.Event()

        def collect(i):
            def on_event(event):
                if isinstance(event, Exception):
                    results[i].append(event)
                    done[i] = True
                else:
                    results[i].append(event.text)
                    if event.finish_reason is not None:
                        results[i].append(event.finish_reason)
                        done[i] = True
                if all(done):
                    finished.set()

            return on_event

        for i, (prompt, grammar) in enumerate(jobs):
            params = SamplingParams(temperature=0).updated(grammar=grammar)
            scheduler.submit(Request(ENGINE.tokenizer.encode(prompt), params, 60), collect(i))
        assert finished.wait(120)
    finally:
        scheduler.close()
    together = [("".join(r[:-1]), r[-1]) for r in results]
    assert together == alone
    valid_person(together[0][0])
    valid_person(together[4][0])
    assert together[3][0] in ("yes", "no")


# ---- GBNF, as llama.cpp reads it -------------------------------------------------------

# llama.cpp's grammars/*.gbnf, fetched by tests/data/fetch.py (ignored by git).
GRAMMARS = Path(__file__).resolve().parent / "data" / "cache" / "grammars"
needs_grammars = pytest.mark.skipif(
    not any(GRAMMARS.glob("*.gbnf")),
    reason=f"llama.cpp's grammars are not in {GRAMMARS}: run python tests/data/fetch.py",
)


def matcher(grammar):
    """A fresh matcher of `grammar`, once the worker computing its first mask is done."""
    constraint = grammar.constraint()
    constraint.compute()
    return constraint.matcher


def accepts(grammar, *pieces) -> bool:
    """Whether `grammar` matches the pieces (text, or token ids) whole, the text cut into
    the vocabulary's longest tokens, so one token may span several terminals."""
    m = matcher(grammar)
    for piece in pieces:
        ids = [piece] if isinstance(piece, int) else VOCAB.tokenize(piece)
        if not all(m.consume_token(i) for i in ids):
            return False
    return m.is_accepting()


def gbnf_file(name):
    return (GRAMMARS / name).read_text(encoding="utf-8")


# (grammar, matched, refused) from llama.cpp's tests/test-grammar-integration.cpp; a tuple
# is pieces, ints being token ids.
LLAMA_CPP_CASES = [
    (
        'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= number\nnumber ::= [0-9]+',
        ["42", "1+2+3+4+5", "123+456"],
        ["+", "/ 3", "1+2+3+4+5+", "12a45"],
    ),
    (
        "root ::= <[10]> content <[11]>\ncontent ::= (!<[11]>)*",
        [
            (10, "hello world", 11),
            (10, "text with ", 12, " other tokens ", 13, " mixed in", 11),
            (10, 11),
            (10, 12, 13, 14, 15, 11),
            (10, "a", 11),
        ],
        [
            (10, "missing end token"),
            (10,),
            ("missing start token", 11),
            (10, 11, 11),
            (11, "wrong order", 10),
        ],
    ),
    (
        'root ::= ... "abc" ...',
        ["abcabcabc", "aaaabcccc", "🔵🟠✅abc❌🟠🔵"],
        ["aaabcccc", "aaaaabcccc", "aaaabccc", "aaaabccccc", "🔵🟠✅❌abc❌✅🟠🔵", "🔵🟠abc🟠🔵"],
    ),
    (
        "root ::= cons+ vowel* cons? (vowel cons)*\nvowel ::= [aeiouy]\n"
        "cons ::= [bcdfghjklmnpqrstvwxyz]",
        ["yes", "no", "noyes", "crwth", "four", "bryyyy"],
        ["yess", "yesno", "forty", "catyyy"],
    ),
    (
        'root ::= ("0x" [A-F0-9]{2} " "?){3,5}',
        ["0xFF 0x12 0xAB", "0xFF 0x12 0xAB 0x00 0x00"],
        ["", "0xFF", "0xFF 0x12", "0xFF 0x12 0xAB 0x00 0x00 0x00"],
    ),
    ("root ::= [ab]{4,}", ["aaaa", "aaaaab", "bbbb", "ababab"], ["", "aba"]),
    ("root ::= [ab]{0,4}", ["", "a", "aa", "aaa", "aaab"], ["aaaaa"]),
    ("root ::= ( [x]* )*", ["", "x", "xx"], ["y", "yy"]),  # llama.cpp's "segfault" case
]


@pytest.mark.parametrize(("grammar", "matched", "refused"), LLAMA_CPP_CASES)
def test_gbnf_matches_what_llama_cpp_matches(grammar, matched, refused):
    compiled = VOCAB.gbnf(grammar)
    for pieces in matched:
        assert accepts(compiled, *(pieces if isinstance(pieces, tuple) else [pieces])), pieces
    for pieces in refused:
        assert not accepts(compiled, *(pieces if isinstance(pieces, tuple) else [pieces])), pieces


# Grammars llama.cpp reads, with text they match and text they do not.
GBNF_SYNTAX = [
    ('root ::= start\nstart ::= "a"', ["a"], ["b"]),  # a rule named start is still GBNF
    ("root ::= . .", ["a\n", "\n\n", "éx"], ["a", "abc"]),  # `.` is any character
    ('root ::= "\\u0041" [\\u0030-\\u0039] "\\U0001F600" "\\x41"', ["A5😀A"], ["A5😀", "B5😀A"]),
    ("root ::= [a\\-z]+", ["a-z", "-"], ["b"]),  # \- (which llama.cpp's own schemas use)
    ('root ::= "a"{0} "b"', ["b"], ["ab"]),
    ('root ::= "ab"* "c"', ["c", "ababc"], ["abac"]),  # a literal repeats whole
    ('root ::= ("a"?)+ ("b"+){2}', ["bb", "aabbb"], ["ab"]),
    ('root ::= 1x ws WS\n1x ::= "x"\nws ::= "-"\nWS ::= "_"', ["x-_"], ["x-"]),
    ('root ::= | "a"\r\n\r\nx ::= "b"\r\n', ["a", ""], ["b"]),  # CRLF, an empty option
    ('root ::= ( # one\n  "a"\n  | "b" # two\n)  # three\n', ["a", "b"], ["ab"]),
    ('root ::= "a" | root "a"', ["a", "aaa"], ["b"]),  # left recursion: llama.cpp refuses it
    ('root ::= [^"\\\\\\x00-\\x1F] "\\\\" ["\\]]', ['é\\"', "x\\]"], ['"\\"']),
]


@pytest.mark.parametrize(("grammar", "matched", "refused"), GBNF_SYNTAX)
def test_gbnf_syntax(grammar, matched, refused):
    compiled = VOCAB.gbnf(grammar)
    assert [t for t in matched if not accepts(compiled, t)] == []
    assert [t for t in refused if accepts(compiled, t)] == []


# Grammars where a terminal taking its longest match refuses text the grammar allows.
GREEDY_TRAPS = [
    ('root ::= x "b"\nx ::= [a-z]*', ["b", "ab", "abab"]),
    ('root ::= x y\nx ::= "a"+\ny ::= "a" "b"', ["aab", "aaab"]),
    ('root ::= ("a" | "ab") "bc"', ["abc", "abbc"]),
    ('root ::= word "!" | "ab" "c"\nword ::= [a-z] [a-z]*', ["ab!", "abc"]),
    ('root ::= [0-9]+ [0-9] "x"', ["12x", "123x"]),
    ('root ::= (kw | id) " "\nkw ::= "in" | "int"\nid ::= [a-z] [a-z]*', ["in ", "int ", "i "]),
]


@pytest.mark.parametrize(("grammar", "matched"), GREEDY_TRAPS)
def test_gbnf_matches_character_by_character(grammar, matched):
    compiled = VOCAB.gbnf(grammar)
    assert [t for t in matched if not accepts(compiled, t)] == []


@needs_grammars
@pytest.mark.parametrize(
    ("name", "matched"),
    [
        ("arithmetic.gbnf", ["a=b\n", "x+1= 2\n", "(a+b)*c=d\nq=1\n"]),
        ("c.gbnf", ["int main(){return 0;}", "int f(int x){int y = x+1;return y;}"]),
        ("chess.gbnf", ["1. e4 e5\n2. Nf3 Nc6\n"]),
        ("english.gbnf", ["Hello, world.", "a b"]),
        ("japanese.gbnf", ["ひらがな カタカナ 漢字"]),
        ("json.gbnf", ['{"a": [1, 2.5e3, "x\\n", true, null], "b": {}}']),
        ("json_arr.gbnf", ['[\n1,\n"a"]']),
        ("list.gbnf", ["- milk\n- 2 eggs\n"]),
    ],
)
def test_llama_cpp_grammars(name, matched):
    compiled = VOCAB.gbnf(gbnf_file(name), name)
    assert [t for t in matched if not accepts(compiled, t)] == []


@needs_grammars
def test_sampled_json_gbnf_outputs_are_json():
    grammar = VOCAB.gbnf(gbnf_file("json.gbnf"))
    # Nudged toward closing strings and objects, so some end within max_tokens.
    bias = [(VOCAB.tokenize(c)[0], 4.0) for c in '"}']
    done = 0
    for seed in range(8):
        text, finish = generate(
            grammar, max_tokens=150, temperature=1.2, seed=seed, logit_bias=bias
        )
        if finish == "stop":
            done += 1
            assert isinstance(json.loads(text), dict), text
    assert done


@pytest.mark.parametrize(
    ("grammar", "error"),
    [
        (
            'root ::= x\nx ::= numero\nnumber ::= "1"',
            "line 2, column 7: rule numero is used but not defined",
        ),
        ('rot ::= "a"', "no rule named root"),
        ("", "no rule named root"),
        ('root ::= "a"\nroot ::= "b"', "line 2, column 1: rule root is defined twice"),
        ('root ::= "\\q"', "line 1, column 11: unknown escape \\\\q"),
        ('root ::= "\\u12"', "\\\\u needs 4 hex digits"),
        ('root ::= "\\UFFFFFFFF"', "past the last Unicode character"),
        ('root ::= "\\uD800"', "U\\+D800 is a surrogate"),
        ('root ::= ("a"', "line 1, column 10: no \\) closes this group"),
        ('root ::= "a', "unexpected end of the grammar"),
        ("root ::= [z-a]", "the range z-a is reversed"),
        ("root ::= []", "matches no character"),
        ("root ::= [^\\x00-\\U0010FFFF]", "matches no character"),
        ('root ::= "a" root', "root matches no text: every way through it recurs"),
        ('root ::= * "a"', "\\* follows nothing to repeat"),
        ('root ::= "a"{2,1}', "repeats at most fewer than at least"),
        ('root ::= "a" )', "line 1, column 14: unexpected '\\)' in rule root"),
        ("root := 'a'", "expected ::= after the rule name root"),
        ("root ::= <nope>", "<nope> is not one token of the vocabulary"),
        (
            "root ::= !<[512]>",
            "line 1, column 10: token 512 is past the vocabulary \\(512 tokens\\)",
        ),
    ],
)
def test_gbnf_errors_say_where_and_what(grammar, error):
    with pytest.raises(GrammarError, match=f"^--grammar g.gbnf: .*{error}"):
        VOCAB.gbnf(grammar, "--grammar g.gbnf")


def test_a_grammar_starting_with_llguidance_is_lark():
    compiled = VOCAB.gbnf('%llguidance {}\nstart: "a" B\nB: /[0-9]+/')
    assert accepts(compiled, "a12") and not accepts(compiled, "a")


def test_named_tokens_are_the_vocabularys():
    eos = ENGINE.tokenizer.decode([2], skip_special=False)  # "</s>"
    compiled = VOCAB.gbnf(f'root ::= "ok" {eos}')
    assert accepts(compiled, "ok", 2) and not accepts(compiled, "ok")


# Grammars whose repetitions may or may not be one terminal: both ways must match the same
# text, every string over a, b and c of up to four characters tried.
TERMINAL_CASES = [
    *[g for g, *_ in GREEDY_TRAPS],
    'root ::= "a" [ab]* "c" | "a" "b" "b" "a"',
    'root ::= [a] [ab]+ "c" | [a] "b" "b" "a"',
    'root ::= x | y\nx ::= [a] [0-9]+ "b"\ny ::= [a-c] "1" "1" "c"',
    'root ::= ([ab]{1,2})* "c"',
    "root ::= [ab]{1,2} [ab]{1,2}",
    'root ::= ("a" [bc]*)+',
    'root ::= "a"* "b"* | "b"+ "a"',
    "root ::= x x\nx ::= [abc]*",
    'root ::= ([ab]+ "c")* [ab]*',
    'root ::= ("ab" | "a")* "b"? "c"',
    'root ::= [bc]+ ("a")? "c" [ab]',  # an optional terminal between: "c" follows [bc]+
    'root ::= ([a-c] | "abc"){1} "b"',  # after "a", "b" may go on toward "abc"
    # found by fuzzing
    'root ::= "" | "" | (. | "ba" [^a] "ba")?{1,3} (root)?',
    'root ::= ((([bc]){1,} ("a")? "c") ([a-c] "ba" | "abc" [ab] | "b" "abc")? ([ab])+) [a-c]',
]
SHORT_TEXTS = [""] + ["".join(t) for n in range(1, 5) for t in itertools.product("abc", repeat=n)]


@pytest.mark.parametrize("grammar", TERMINAL_CASES)
def test_repetitions_made_terminals_lose_no_text(grammar):
    rules = gbnf.parse(grammar, ENGINE.tokenizer.token_id, VOCAB.size)
    fast = VOCAB.lark(gbnf.lark(rules, gbnf_lexemes.terminals(rules)))
    exact = VOCAB.lark(gbnf.lark(rules))  # every terminal one character
    assert [t for t in SHORT_TEXTS if accepts(fast, t) != accepts(exact, t)] == []


@needs_grammars
def test_long_repetitions_are_terminals_where_safe():
    def lark(name):
        rules = gbnf.parse(gbnf_file(name), ENGINE.tokenizer.token_id, VOCAB.size)
        return gbnf.lark(rules, gbnf_lexemes.terminals(rules))

    # A JSON string's body and a list item's text are one terminal each: llguidance's
    # lexer, not its parser, reads them (fast for a large vocabulary).
    assert "/(?:(?:[^\\x{22}\\x{5C}\\x{7F}\\x{0}-\\x{1F}]|" in lark("json.gbnf")
    assert "/(?:[^\\x{D}\\x{A}" in lark("list.gbnf")
    # In C, a name's letters stay one at a time: as one greedy terminal they would eat
    # the "eturn" of "return".
    assert "(/[\\x{61}-\\x{7A}\\x{41}-\\x{5A}\\x{5F}\\x{30}-\\x{39}]/*)" in lark("c.gbnf")


# ---- JSON schemas, outputs checked by jsonschema ----------------------------------------


class Pet(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: Literal["cat", "dog"]
    name: str = Field(max_length=8)


class Owner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: int = Field(ge=1, le=999)
    pets: list[Pet] = Field(max_length=2)
    nickname: str | None = Field(default=None, max_length=6)


def closed(properties, required=()):
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


# Schemas whose outputs stories260K ends within max_tokens: bounded strings and numbers,
# no extra properties (which the spec allows and the model would write forever).
SAMPLED = {
    "pydantic model with $defs, nullable": Owner.model_json_schema(),
    "openai strict function": openai.pydantic_function_tool(Owner)["function"]["parameters"],
    "enum and const": closed({"v": {"const": "v1"}, "c": {"enum": ["red", 42, None, [1]]}}, "vc"),
    "anyOf": {
        "anyOf": [
            {"type": "integer", "minimum": -5, "maximum": 5},
            {"type": "boolean"},
            {"type": "string", "maxLength": 3},
        ]
    },
    "oneOf": {"oneOf": [{"type": "null"}, {"type": "array", "items": {"type": "boolean"}}]},
    "nullable type": {"type": ["string", "null"], "maxLength": 4},
    "minItems maxItems": {
        "type": "array",
        "items": {"type": "integer", "minimum": 10, "maximum": 20},
        "minItems": 2,
        "maxItems": 4,
    },
    "string lengths and pattern": closed(
        {
            "s": {"type": "string", "minLength": 2, "maxLength": 5},
            "p": {"type": "string", "pattern": "^[A-Z][a-z]{1,3}-[0-9]{2}$"},
        },
        "sp",
    ),
    "uuid": {"type": "string", "format": "uuid"},
    "numbers": closed(
        {
            "i": {"type": "integer", "exclusiveMinimum": -3, "maximum": 300},
            "n": {"type": "number", "minimum": 0.5, "maximum": 2.25},
            "m": {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 100},
        },
        "inm",
    ),
    "additionalProperties schema": {
        "type": "object",
        "properties": {"a": {"type": "boolean"}},
        "required": ["a"],
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
        "maxProperties": 3,
    },
    "optional properties": closed(
        {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "boolean"}}
    ),
    "nested arrays": {
        "type": "array",
        "items": {
            "type": "array",
            "items": {"type": "array", "items": {"enum": [0, 1]}, "maxItems": 2},
            "maxItems": 2,
        },
        "maxItems": 2,
    },
    "tuple (draft 7)": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "array",
        "items": [{"type": "boolean"}, {"enum": ["x", "y"]}],
        "additionalItems": False,
    },
    "recursive $ref": {
        "$defs": {"t": closed({"k": {"type": "array", "items": {"$ref": "#/$defs/t"}}}, "k")},
        "$ref": "#/$defs/t",
    },
}


def validator(schema):
    """jsonschema's validator for the schema's draft (2020-12 unless it says), formats too."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


@pytest.mark.parametrize("name", SAMPLED)
def test_sampled_outputs_follow_the_schema(name):
    schema = SAMPLED[name]
    grammar, check = VOCAB.json_schema(schema, name), validator(schema)
    bias = [(VOCAB.tokenize(c)[0], 3.0) for c in '",}]']  # toward ends, within max_tokens
    done = 0
    for seed in range(6):
        text, finish = generate(
            grammar, max_tokens=100, temperature=1.5, seed=seed, logit_bias=bias
        )
        if finish == "stop":
            done += 1
            assert [e.message for e in check.iter_errors(json.loads(text))] == [], text
    assert done


# (schema, JSON the grammar writes, invalid JSON it refuses, valid JSON it does not write:
# a fixed key order, ", " and ": " between items, no other whitespace, no "\u00e9" escapes).
INSTANCES = [
    (
        {"type": "integer", "minimum": -123, "maximum": 42},
        ["-123", "0", "-0", "42"],
        ["-124", "43", "01", "1.5"],
        ["1.0", "1e1"],
    ),
    (
        {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10000},
        ["1", "9999"],
        ["0", "10000"],
        [],
    ),
    (
        {"type": "number"},
        ["0", "-0", "1.5e10", "1E+5", "-0.0e-0"],
        ["01", "1.", ".5", "+1", "00"],
        [],
    ),
    (
        {"type": "string", "minLength": 2, "maxLength": 3},
        ['"😀😀"', '"\\n\\n"', '"éé"', '"a\\"b"'],
        ['"😀"', '"éééé"', '"a\tb"', '"\\x41"'],
        ['"\\u00e9\\u00e9"', '"\\/\\/"'],
    ),
    (
        {"type": "string", "pattern": "^a\\^\\$\\.\\[\\]\\(\\)\\|\\{\\}\\*\\+\\?b$"},
        ['"a^$.[]()|{}*+?b"'],
        ['"ab"'],
        [],
    ),
    ({"type": "string", "pattern": "[0-9]"}, ['"x1y"'], ['"x"'], []),
    (
        {"type": "string", "format": "uuid"},
        ['"12345678-1234-1234-1234-1234567890ab"'],
        ['"1234"'],
        [],
    ),
    (
        {"type": "string", "format": "date-time"},
        ['"2024-01-01T10:00:00Z"', '"2024-01-01T10:00:00.5+01:00"'],
        ['"2024-01-01T25:00:00Z"', '"2024-01-01 10:00:00Z"'],
        [],
    ),
    (
        {"type": ["array", "null"], "items": {"type": "string"}},
        ["null", "[]", '["foo", "bar"]'],
        ['"foo"', '["foo", 42]'],
        ['["foo","bar"]', "[ ]"],
    ),
    (
        {"items": {"type": "number"}, "minItems": 3, "maxItems": 5},
        ["[1, 2, 3]", "[1, 2, 3, 4, 5]"],
        ["[1, 2]", "[1, 2, 3, 4, 5, 6]"],
        [],
    ),
    (
        {
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "additionalProperties": True,
        },
        ['{"a": 42}', '{"c": ""}', '{"a": 42, "c": ""}', '{"a_": ""}'],
        ['{"a": ""}', '{"a": "", "b": ""}'],
        [],
    ),
    (
        closed({"b": {"type": "string"}, "a": {"type": "string"}, "d": {"type": "string"}}, "ab"),
        ['{"b": "x", "a": "y"}', '{"b": "x", "a": "y", "d": "z"}'],
        ['{"b": "x"}', '{"b": "x", "a": "y", "c": "z"}'],
        ['{"a": "y", "b": "x"}', '{"b":"x","a":"y"}'],
    ),
    (
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "items": [{"type": "integer"}, {"type": "string"}],
        },
        ['[1, "a"]', "[1]", "[]", '[1, "a", null]'],
        ['["a", 1]'],
        [],
    ),
    ({"$defs": {"a": {"$anchor": "n", "type": "integer"}}, "$ref": "#n"}, ["1"], ['"x"'], []),
    ({}, ["[" * 60 + "]" * 60, '{"a": {"b": [null, true]}}'], ['{"a"}', ""], []),
    # Properties listed, others unsaid: only those listed are written, as llama.cpp does.
    (
        {"properties": {"p": {"properties": {"x": {"type": "integer"}}}}},
        ['{"p": {"x": 1}}', "{}", '{"p": {}}'],
        ['{"p": {"x": "1"}}'],
        ['{"p": {"x": 1, "y": 2}}', '{"p": {"x": 1}, "q": 2}'],
    ),
    (
        {"properties": {"a": {"type": "integer"}, "b": {}}, "minProperties": 1},
        ['{"a": 1}', '{"b": null}'],
        ["{}", '{"a": "1"}'],
        [],
    ),
    (
        {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"required": ["b"]}]},
        ['{"a": 1, "b": 2}', '{"b": 2}'],
        ['{"a": "1", "b": 2}', '{"a": 1}'],
        [],
    ),
    (
        {"properties": {"a": {"type": "integer"}}, "anyOf": [{"properties": {"b": {}}}]},
        ['{"a": 1, "b": 2}', '{"c": 3}'],
        ['{"a": "1"}'],
        [],
    ),
]


@pytest.mark.parametrize(("schema", "written", "refused", "not_written"), INSTANCES)
def test_the_grammar_writes_the_valid_and_refuses_the_invalid(
    schema, written, refused, not_written
):
    grammar, check = VOCAB.json_schema(schema), validator(schema)

    def valid(text):
        try:
            return check.is_valid(json.loads(text))
        except ValueError:
            return False

    assert [t for t in written if not (valid(t) and accepts(grammar, t))] == []
    assert [t for t in refused if valid(t) or accepts(grammar, t)] == []
    assert [t for t in not_written if not valid(t) or accepts(grammar, t)] == []


def test_boolean_schemas():
    grammar = VOCAB.json_schema(True, "--format any.json")  # any JSON value
    assert accepts(grammar, "[1]") and accepts(grammar, '"a"') and not accepts(grammar, "a")
    with pytest.raises(GrammarError, match="^--format none.json is false, a schema that no"):
        VOCAB.json_schema(False, "--format none.json")


@pytest.mark.xfail(
    strict=True,
    reason="llguidance's date format is a regular expression that takes year 0000 and "
    "29 February of every year, which RFC 3339 (and Python's date) refuse",
)
def test_dates_are_real_dates():
    grammar = VOCAB.json_schema({"type": "string", "format": "date"})
    assert accepts(grammar, '"2024-02-29"')
    assert not accepts(grammar, '"2023-02-29"') and not accepts(grammar, '"0000-01-01"')


# ---- run --format / --grammar --------------------------------------------------------


def test_run_format_json_and_schema_and_grammar(tmp_path):
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    r = llmrun("run", "Once upon a time", "--temperature", "0", "--format", str(schema))
    assert r.returncode == 0, r.stderr
    assert r.stdout == generate(VOCAB.json_schema(PERSON), max_tokens=None)[0]
    valid_person(r.stdout)
    r = llmrun("run", "Once", "--format", "json", "-n", "30", "--temperature", "0")
    assert r.returncode == 0 and r.stdout.startswith("{")
    gbnf = tmp_path / "yes.gbnf"
    gbnf.write_text('root ::= "yes" | "no"\n')
    r = llmrun("run", "Once", "--grammar", str(gbnf), "--temperature", "0")
    assert (r.returncode, r.stdout) in ((0, "yes"), (0, "no"))


def test_run_format_errors(tmp_path):
    r = llmrun("run", "Once", "--format", "yaml")
    assert r.returncode == 2 and "--format yaml" in r.stderr and "give json" in r.stderr
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "array", "uniqueItems": true}')
    r = llmrun("run", "Once", "--format", str(bad))
    assert r.returncode == 2
    assert r.stderr.startswith(f"error: --format {bad}: the grammar engine (llguidance)")
    gbnf = tmp_path / "x.gbnf"
    gbnf.write_text("root ::= ")
    r = llmrun("run", "Once", "--grammar", str(gbnf), "--format", "json")
    assert r.returncode == 2 and "either --format or --grammar" in r.stderr


# ---- a real server -------------------------------------------------------------------


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    degrees: int = Field(ge=-40, le=50)
    sunny: bool
    note: str = Field(max_length=10)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    import openai
    from serving import Server

    server = Server(tmp_path_factory.mktemp("serve"))
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", max_retries=0), server
    server.stop()


def test_parse_with_a_pydantic_model(client):
    client, _ = client
    messages = [{"role": "user", "content": "The weather in Paris?"}]
    completion = client.beta.chat.completions.parse(
        model="stories260K", messages=messages, response_format=Weather, temperature=0
    )
    weather = completion.choices[0].message.parsed
    assert isinstance(weather, Weather)
    assert completion.choices[0].finish_reason == "stop"
    # Streamed, the same text (with the schema the parse helper sends: strict, no extras).
    schema = {**Weather.model_json_schema(), "additionalProperties": False}
    stream = client.chat.completions.create(
        model="stories260K",
        messages=messages,
        temperature=0,
        stream=True,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": schema, "strict": True},
        },
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert Weather.model_validate_json(text) == weather


def test_json_object(client):
    client, _ = client
    reply = client.chat.completions.create(
        model="stories260K",
        messages=[{"role": "user", "content": "Hi"}],
        response_format={"type": "json_object"},
        max_tokens=60,
        temperature=0,
    )
    assert reply.choices[0].message.content.startswith("{")


def test_a_schema_the_engine_refuses_is_400(client):
    import httpx

    _, server = client
    schema = {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "b"}}}}
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert 'Unimplemented keys: ["not"]' in error["message"]
    assert error["message"].startswith("response_format.json_schema.schema: the grammar engine")
    assert error["param"] == "response_format.json_schema.schema"
