"""The Typer app, the options its commands share, and the small helpers they use."""

import re
import sys
from pathlib import Path
from typing import Annotated

import typer

from llmrun import __version__, ui
from llmrun.errors import UsageError

app = typer.Typer(
    name="llmrun",
    help="Run LLMs from GGUF and safetensors files, locally, in plain PyTorch.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

DEBUG = {"on": False}
HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+(/[^\s]+)?(:[\w.-]+)?(@[\w./-]+)?$")

# Options shared by run and chat.
ModelOpt = Annotated[
    str | None, typer.Option("--model", "-m", help="Model: .gguf file, HF directory or Hub name.")
]
MaxTokens = Annotated[
    int | None,
    typer.Option(
        "--max-tokens", "-n", help="Tokens to generate (-1: until end of text or full context)."
    ),
]
Temperature = Annotated[float | None, typer.Option(help="Sampling temperature; 0 is greedy.")]
TopK = Annotated[
    int | None, typer.Option("--top-k", help="Keep the k most likely tokens (0: off).")
]
TopP = Annotated[float | None, typer.Option("--top-p", help="Nucleus sampling mass, in (0, 1].")]
MinP = Annotated[
    float | None, typer.Option("--min-p", help="Drop tokens below min-p x the top probability.")
]
RepeatPenalty = Annotated[
    float | None, typer.Option("--repeat-penalty", help="Penalty for repeated tokens (1: off).")
]
RepeatLastN = Annotated[
    int | None, typer.Option("--repeat-last-n", help="Tokens the repeat penalty looks back at.")
]
Seed = Annotated[
    int | None,
    typer.Option(help="Random seed: the same seed gives the same text (-1: a random one)."),
]
Stop = Annotated[list[str] | None, typer.Option("--stop", help="Stop at this text (repeatable).")]
CtxSize = Annotated[int | None, typer.Option("--ctx-size", "-c", help="Context size in tokens.")]
Device = Annotated[str, typer.Option(help="auto, cpu, cuda or mps.")]
Dtype = Annotated[str, typer.Option(help="auto, f32, bf16 or f16.")]
Threads = Annotated[int | None, typer.Option("--threads", "-t", help="CPU threads.")]
CacheType = Annotated[
    str | None,
    typer.Option(
        "--cache-type",
        help="KV cache storage: f32, f16, bf16 or q8_0 (default: the compute dtype, exact).",
    ),
]
Activations = Annotated[
    str,
    typer.Option(
        "--activations",
        help="How quantized weights meet activations on CPU: f32 (exact) or q8 (quantized "
        "to Q8_0 or Q8_K first, as llama.cpp does: faster, not exact).",
    ),
]
Lora = Annotated[
    list[str] | None,
    typer.Option(
        "--lora",
        metavar="PATH",
        help="A LoRA adapter (GGUF file or PEFT folder) at scale 1 (repeatable).",
    ),
]
LoraScaled = Annotated[
    list[str] | None,
    typer.Option(
        "--lora-scaled",
        metavar="PATH:SCALE",
        help="A LoRA adapter at a scale, after the path's last colon (repeatable).",
    ),
]
DraftOpt = Annotated[
    str | None,
    typer.Option(
        "--draft",
        help="A draft model (smaller, same vocabulary; or a Gemma 4 model's assistant) for "
        "speculative decoding: it proposes tokens the model verifies in one forward.",
    ),
]
DraftMax = Annotated[
    int | None,
    typer.Option("--draft-max", min=1, help="Tokens the draft proposes a step (default: 3)."),
]
DraftPMin = Annotated[
    float | None,
    typer.Option(
        "--draft-p-min",
        min=0.0,
        max=1.0,
        metavar="P",
        help="Stop drafting a step where the draft's top probability falls below P "
        "(default: 0, never; llama.cpp's --draft-p-min).",
    ),
]
LookupOpt = Annotated[
    int | None,
    typer.Option(
        "--lookup",
        min=1,
        metavar="N",
        help="Speculative decoding without a draft model: N tokens a step drafted from "
        "the context where its last tokens occurred before (prompt lookup).",
    ),
]
Verbose = Annotated[
    bool, typer.Option("--verbose", "-v", help="Print timings and token counts to stderr.")
]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")]
Think = Annotated[
    bool | None,
    typer.Option(
        "--think/--no-think", help="Switch thinking on or off (templates with enable_thinking)."
    ),
]
Effort = Annotated[
    str | None,
    typer.Option("--reasoning-effort", help="low, medium or high (templates that read it)."),
]
ShowThinking = Annotated[
    bool | None,
    typer.Option(
        "--show-thinking/--hide-thinking",
        help="Print the model's reasoning (default: on a terminal, not in a pipe).",
    ),
]
TemplateOpt = Annotated[
    Path | None,
    typer.Option("--template", help="Chat template file (Jinja) to use instead of the model's."),
]


def _version(value: bool) -> None:
    if value:
        print(f"llmrun {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = False,
) -> None:
    """Run LLMs from GGUF and safetensors files, locally, in plain PyTorch."""


def _read_stdin() -> str | None:
    """Piped input without its trailing newline; None for a terminal or empty input."""
    if sys.stdin is None or sys.stdin.isatty():
        return None
    text = sys.stdin.read().rstrip("\n")
    return text if text.strip() else None


def _looks_like_model(arg: str) -> bool:
    if arg.endswith(".gguf") or HUB_NAME.match(arg):
        return True
    try:
        return Path(arg).expanduser().exists()
    except OSError:  # e.g. a long prompt is not a valid file name
        return False


def _split_model_and_prompt(args: list[str], model: str | None) -> tuple[str | None, str | None]:
    """`run [MODEL] [PROMPT...]`: with one argument, it is the model if it names one."""
    if model is not None:
        return model, " ".join(args) if args else None
    if not args:
        return None, None
    if len(args) == 1:
        return (args[0], None) if _looks_like_model(args[0]) else (None, args[0])
    return args[0], " ".join(args[1:])


def _load(spec: str | None, **options):
    """Resolve MODEL (download bars if it must be pulled), then load it under a spinner."""
    from llmrun import api

    with ui.download_progress() as progress:
        path = api.resolve(spec, progress)
    with ui.status("loading model"):
        return api.load(spec, path=path, **options)


def _adapters(lora: list[str] | None, lora_scaled: list[str] | None) -> list[tuple[str, float]]:
    """--lora PATH and --lora-scaled PATH:SCALE as (path, scale) pairs, in that order."""
    from llmrun.loading.lora import parse_spec

    return [(path, 1.0) for path in lora or []] + [parse_spec(s) for s in lora_scaled or []]


def _check_draft(
    spec: str | None, draft_max: int | None, lookup: int | None, p_min: float | None = None
) -> None:
    """Refuse --draft with --lookup, and --draft-max or --draft-p-min without --draft
    (before loading)."""
    if spec is not None and lookup is not None:
        raise UsageError("--draft and --lookup: choose one")
    if spec is None and draft_max is not None:
        raise UsageError("--draft-max goes with --draft")
    if spec is None and p_min is not None:
        raise UsageError("--draft-p-min goes with --draft")


def _use_draft(
    engine,
    spec: str | None,
    draft_max: int | None,
    lookup: int | None,
    p_min: float | None = None,
    **options,
) -> None:
    """Speculative decoding for `engine`: load --draft (with the model's other load
    `options`; a Gemma 4 assistant folder in the model's dtype), or draft by --lookup (the
    flags checked by _check_draft)."""
    if lookup is not None:
        engine.use_lookup(lookup)
    if spec is None:
        return
    from llmrun import api
    from llmrun.loading.gemma4_assistant import is_assistant
    from llmrun.speculative import DEFAULT_DRAFT_MAX, DEFAULT_DRAFT_P_MIN

    max_tokens = draft_max or DEFAULT_DRAFT_MAX
    p_min = DEFAULT_DRAFT_P_MIN if p_min is None else p_min
    with ui.download_progress() as progress:
        path = api.resolve(spec, progress)
    if is_assistant(path):
        with ui.status("loading the assistant"):
            engine.use_assistant(path, max_tokens, p_min)
        return
    with ui.status("loading model"):
        draft = api.load(
            spec, path=path, device=engine.device.type, ctx_size=engine.ctx_size, **options
        )
    engine.use_draft(draft, max_tokens, p_min)


def _max_tokens(value: int | None) -> int | None:
    """-n as a limit: None (and -1) for "until end of text or a full context"."""
    if value is not None and value < -1:
        raise UsageError(f"--max-tokens must be >= -1, got {value}")
    return None if value in (None, -1) else value
