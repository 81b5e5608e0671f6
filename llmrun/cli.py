"""The `llmrun` command line: flags -> options -> library calls.

The one place where LlmrunError becomes an `error:` line and an exit code
(0 ok, 1 error, 2 usage, 130 interrupted). torch and the model code are
imported inside the commands, so `llmrun --help` stays instant.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Annotated

import typer

from llmrun import __version__, ui
from llmrun.errors import LlmrunError, UsageError

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
Seed = Annotated[int | None, typer.Option(help="Random seed: the same seed gives the same text.")]
Stop = Annotated[list[str] | None, typer.Option("--stop", help="Stop at this text (repeatable).")]
CtxSize = Annotated[int | None, typer.Option("--ctx-size", "-c", help="Context size in tokens.")]
Device = Annotated[str, typer.Option(help="auto, cpu, cuda or mps.")]
Dtype = Annotated[str, typer.Option(help="auto, f32, bf16 or f16.")]
Threads = Annotated[int | None, typer.Option("--threads", "-t", help="CPU threads.")]
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


def _max_tokens(value: int | None) -> int | None:
    """-n as a limit: None (and -1) for "until end of text or a full context"."""
    if value is not None and value < -1:
        raise UsageError(f"--max-tokens must be >= -1, got {value}")
    return None if value in (None, -1) else value


@app.command()
def run(
    args: Annotated[
        list[str] | None, typer.Argument(help="[MODEL] [PROMPT]", show_default=False)
    ] = None,
    model: ModelOpt = None,
    max_tokens: MaxTokens = None,
    temperature: Temperature = None,
    top_k: TopK = None,
    top_p: TopP = None,
    min_p: MinP = None,
    repeat_penalty: RepeatPenalty = None,
    repeat_last_n: RepeatLastN = None,
    seed: Seed = None,
    stop: Stop = None,
    ctx_size: CtxSize = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    threads: Threads = None,
    raw: Annotated[
        bool, typer.Option(help="Send the prompt as is, without the chat template.")
    ] = False,
    template: TemplateOpt = None,
    show_prompt: Annotated[
        bool, typer.Option("--show-prompt", help="Print the prompt as fed to the model (stderr).")
    ] = False,
    output_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object with text, usage and timings.")
    ] = False,
    logprobs: Annotated[
        int | None,
        typer.Option(
            help="With --json: log-probabilities and the N most likely alternatives per token."
        ),
    ] = None,
    think: Think = None,
    reasoning_effort: Effort = None,
    show_thinking: ShowThinking = None,
    verbose: Verbose = False,
    debug: Debug = False,
) -> None:
    """Generate a completion for one prompt: `llmrun run [MODEL] "prompt"`; the prompt may be piped."""
    DEBUG["on"] = debug
    model_spec, prompt = _split_model_and_prompt(list(args or []), model)
    piped = _read_stdin()
    if prompt is not None and piped:
        prompt = f"{prompt}\n\n{piped}"
    elif prompt is None:
        prompt = piped
    if not prompt:
        raise UsageError('no prompt: give one (llmrun run [MODEL] "PROMPT") or pipe it on stdin')
    if logprobs is not None and not output_json:
        raise UsageError("--logprobs needs --json")
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise UsageError(f"--logprobs must be between 0 and 20, got {logprobs}")
    if raw and (think is not None or reasoning_effort is not None):
        raise UsageError(
            "--think/--no-think and --reasoning-effort need the chat template: drop --raw"
        )
    limit = _max_tokens(max_tokens)
    from llmrun.reasoning import Splitter

    engine = _load(
        model_spec,
        device=device,
        dtype=dtype,
        ctx_size=ctx_size,
        threads=threads,
        template_file=template,
    )
    params = engine.sampling(locals())
    text = engine.prompt_text(prompt, raw=raw, **engine.switches(think, reasoning_effort))
    if show_prompt:
        ui.print_prompt(text)
    ids = engine.tokenizer.encode(text)
    split = Splitter(engine.markers, text)
    out = ui.ReplyWriter(ui.stdout_is_tty() if show_thinking is None else show_thinking)
    tokens, final = [], None
    try:
        for response in engine.generate(ids, params, limit, stop or (), logprobs):
            for piece in split.feed(response.token, response.text):
                if not output_json:
                    out.write(piece)
            if response.logprob is not None:
                tokens.append(response.logprob)
            final = response
    except KeyboardInterrupt:
        if not output_json:
            out.end()
            ui.end_text()
        raise
    if output_json:
        ui.print_json(engine.result_record(split, final, tokens if logprobs is not None else None))
    else:
        out.end()
        ui.end_text()
    if verbose:
        ui.print_stats(final.stats)


@app.command()
def chat(
    model: Annotated[
        str | None, typer.Argument(help="MODEL (default: the bundled stories260K)")
    ] = None,
    system: Annotated[str | None, typer.Option(help="System message.")] = None,
    max_tokens: MaxTokens = None,
    temperature: Temperature = None,
    top_k: TopK = None,
    top_p: TopP = None,
    min_p: MinP = None,
    repeat_penalty: RepeatPenalty = None,
    repeat_last_n: RepeatLastN = None,
    seed: Seed = None,
    ctx_size: CtxSize = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    threads: Threads = None,
    template: TemplateOpt = None,
    context_overflow: Annotated[
        str,
        typer.Option(
            "--context-overflow",
            help="When the context is full: error, or shift out the oldest turns.",
        ),
    ] = "error",
    think: Think = None,
    reasoning_effort: Effort = None,
    show_thinking: ShowThinking = None,
    verbose: Verbose = False,
    debug: Debug = False,
) -> None:
    """Chat with a model in a REPL (or one message per line from a pipe)."""
    DEBUG["on"] = debug
    limit = _max_tokens(max_tokens)
    from llmrun.chat import ChatSession
    from llmrun.repl import Repl

    engine = _load(
        model,
        device=device,
        dtype=dtype,
        ctx_size=ctx_size,
        threads=threads,
        template_file=template,
    )
    params = engine.sampling(locals())
    session = ChatSession(engine, params, limit, system=system, overflow=context_overflow)
    session.switches = engine.switches(think, reasoning_effort)
    repl = Repl(session, ui.stdin_is_tty(), verbose=verbose, show_thinking=show_thinking)
    repl.run()


@app.command()
def tokenize(
    args: Annotated[
        list[str] | None, typer.Argument(help="[MODEL] [TEXT]", show_default=False)
    ] = None,
    model: ModelOpt = None,
    pieces: Annotated[bool, typer.Option("--pieces", help="Print id/piece pairs.")] = False,
    no_bos: Annotated[bool, typer.Option("--no-bos", help="Do not add the BOS token.")] = False,
    no_special: Annotated[
        bool, typer.Option("--no-special", help="Treat special-token text as plain text.")
    ] = False,
    batch: Annotated[
        bool,
        typer.Option("--batch", help="Each stdin line is a text: print one JSON list per line."),
    ] = False,
    threads: Annotated[
        int | None,
        typer.Option("--threads", "-t", min=1, help="Threads for --batch (default: all cores)."),
    ] = None,
    debug: Debug = False,
) -> None:
    """Print the token ids of TEXT (or stdin) as the model's tokenizer makes them."""
    DEBUG["on"] = debug
    model_spec, text = _split_model_and_prompt(list(args or []), model)
    if batch and text is not None:
        raise UsageError("--batch reads its texts from stdin, one per line, not as an argument")
    if threads is not None and not batch:
        raise UsageError("--threads goes with --batch")
    if batch:
        if sys.stdin is None or sys.stdin.isatty():
            raise UsageError("--batch reads its texts from stdin, one per line: pipe them in")
        texts = sys.stdin.read().split("\n")
        if texts[-1] == "":
            texts.pop()
    elif text is None:
        text = _read_stdin()
    if not batch and text is None:
        raise UsageError("no text: give it as an argument or pipe it on stdin")

    from llmrun import hub, paths
    from llmrun.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(hub.resolve_model(model_spec or paths.BUNDLED_MODEL.stem))
    options = dict(add_bos=False if no_bos else None, parse_special=not no_special)
    if batch:
        batches = tokenizer.encode_batch(texts, threads=threads, **options)
    else:
        batches = [tokenizer.encode(text, **options)]

    def piece(i: int) -> dict:
        return {"id": i, "piece": tokenizer.token_to_piece(i)}

    if pieces and not batch:
        lines = [json.dumps(piece(i), ensure_ascii=False) for i in batches[0]]
    elif pieces:
        lines = [json.dumps([piece(i) for i in ids], ensure_ascii=False) for ids in batches]
    else:
        lines = [json.dumps(ids) for ids in batches]
    sys.stdout.write("".join(line + "\n" for line in lines))


HubNameArg = Annotated[
    str,
    typer.Argument(
        help="org/repo, org/repo:QUANT or org/repo/file.gguf, each with an optional @revision.",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]


@app.command()
def pull(name: HubNameArg, debug: Debug = False) -> None:
    """Download a model from the Hugging Face Hub into llmrun's cache; a cut download resumes."""
    DEBUG["on"] = debug
    from llmrun import hub

    with ui.download_progress() as progress:
        path = hub.pull(name, progress)
    print(path)


@app.command("list")
def list_models(output_json: JsonOpt = False, debug: Debug = False) -> None:
    """List downloaded models, in llmrun's cache and in the Hugging Face cache."""
    DEBUG["on"] = debug
    from llmrun import hub

    models = hub.list_models()
    if not output_json:
        ui.print_models(models)
        return
    ui.print_json([m.as_json() for m in models])


@app.command()
def show(
    name: Annotated[str, typer.Argument(help="A downloaded model or a local path.")],
    template: Annotated[bool, typer.Option("--template", help="Print the chat template.")] = False,
    output_json: JsonOpt = False,
    debug: Debug = False,
) -> None:
    """Show a model's architecture, size, weights, tokenizer, chat template, license and files."""
    DEBUG["on"] = debug
    from llmrun import hub

    info = hub.model_info(name)
    if template:
        if not info["chat_template"]:
            raise LlmrunError(f"{info['name']} has no chat template")
        print(info["chat_template"])
    elif output_json:
        ui.print_json(info)
    else:
        ui.print_model_info(info)


@app.command()
def rm(
    names: Annotated[list[str], typer.Argument(help="Downloaded models.", show_default=False)],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking.")] = False,
    debug: Debug = False,
) -> None:
    """Delete downloaded models, blobs included, and print the space freed."""
    DEBUG["on"] = debug
    from llmrun import hub

    plans = [hub.plan_removal(name) for name in names]
    if not yes:
        if not ui.stdin_is_tty():
            raise UsageError("rm asks before deleting: pass -y to delete without asking")
        for plan in plans:
            where = ", ".join(str(r) for r in plan.repos)
            ui.info(f"{plan.name}: {ui.size(plan.freed)} in {where}")
        if not typer.confirm(f"delete {len(plans)} model(s)?", err=True):
            ui.info("nothing deleted")
            return
    for plan in plans:
        print(f"deleted {plan.name}: {ui.size(hub.remove(plan.name))} freed")


BENCH_OUTPUTS = ("json", "jsonl", "csv", "md")


@app.command("bench")
def bench_command(
    models: Annotated[
        list[str] | None,
        typer.Argument(help="MODEL... (default: the bundled stories260K)", show_default=False),
    ] = None,
    n_prompt: Annotated[
        str,
        typer.Option(
            "--n-prompt", "-p", metavar="N,...", help="Prompt lengths to process (comma list)."
        ),
    ] = "512",
    n_gen: Annotated[
        str, typer.Option("--n-gen", "-n", metavar="N,...", help="Tokens to generate (comma list).")
    ] = "128",
    pg: Annotated[
        list[str] | None,
        typer.Option(
            "--pg",
            metavar="P,G",
            help="PROMPT,GEN: process, then generate, as one test (repeatable).",
        ),
    ] = None,
    n_depth: Annotated[
        str,
        typer.Option(
            "--n-depth", "-d", metavar="N,...", help="Tokens already in the KV cache (comma list)."
        ),
    ] = "0",
    repetitions: Annotated[
        int, typer.Option("--repetitions", "-r", help="Timed runs per test, after a warm-up.")
    ] = 5,
    threads: Annotated[
        str | None,
        typer.Option("--threads", "-t", metavar="N,...", help="CPU threads (comma list)."),
    ] = None,
    batch_size: Annotated[
        str,
        typer.Option(
            "--batch-size",
            "-b",
            metavar="N,...",
            help="Prompt tokens per forward pass (comma list).",
        ),
    ] = "512",
    device: Device = "auto",
    dtype: Dtype = "auto",
    roofline: Annotated[
        bool,
        typer.Option(
            "--roofline",
            help="Measure the machine's read bandwidth and the % of it decoding reaches.",
        ),
    ] = False,
    output: Annotated[
        str | None,
        typer.Option(
            "--output",
            "-o",
            metavar="FORMAT",
            help="json, jsonl, csv or md (default: a table, markdown in a pipe).",
        ),
    ] = None,
    debug: Debug = False,
) -> None:
    """Measure prompt processing (ppN) and generation (tgN) tokens/s, like llama-bench."""
    DEBUG["on"] = debug
    if output is not None and output not in BENCH_OUTPUTS:
        raise UsageError(f"-o/--output must be one of {', '.join(BENCH_OUTPUTS)}, got {output!r}")
    from llmrun import bench

    options = bench.BenchOptions.from_flags(
        n_prompt,
        n_gen,
        pg or [],
        n_depth,
        batch_size,
        threads,
        repetitions,
        device,
        dtype,
        roofline,
    )
    specs = list(models or [None])
    with ui.bench_progress(bench.total_runs(options, len(specs))) as progress:
        records = bench.benchmark(specs, options, progress)
    ui.print_bench(records, output)


@app.command()
def serve(
    model: Annotated[
        str | None, typer.Argument(help="MODEL (default: the bundled stories260K)")
    ] = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on (0: any free port).")] = 8080,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="LLMRUN_API_KEY",
            help="Require `Authorization: Bearer KEY` on /v1 endpoints.",
        ),
    ] = None,
    parallel: Annotated[
        int, typer.Option("--parallel", help="Requests decoded together (KV cache slots).")
    ] = 4,
    queue: Annotated[
        int, typer.Option(help="Requests that may wait for a slot; more get 503.")
    ] = 64,
    ctx_size: CtxSize = None,
    device: Device = "auto",
    dtype: Dtype = "auto",
    threads: Annotated[
        int | None,
        typer.Option("--threads", "-t", help="CPU threads (default: all cores but one)."),
    ] = None,
    template: TemplateOpt = None,
    debug: Debug = False,
) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions)."""
    DEBUG["on"] = debug
    if parallel < 1:
        raise UsageError(f"--parallel must be positive, got {parallel}")
    if queue < 0:
        raise UsageError(f"--queue must be >= 0, got {queue}")
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {port}")
    try:
        from llmrun import server
    except ImportError as e:
        raise UsageError(
            f"serve needs {e.name}, from the serve extra: pip install 'llmrun[serve]'"
        ) from None
    from llmrun import api

    with ui.download_progress() as progress:
        path = api.resolve(model, progress)
    sock = server.bind(host, port)
    name = model or path.stem
    address = sock.getsockname()
    ui.info(f"serving {name} on http://{_url_host(address[0])}:{address[1]}/v1")
    server.run(
        sock,
        model,
        path,
        name,
        api_key=api_key or None,
        parallel=parallel,
        queue=queue,
        device=device,
        dtype=dtype,
        ctx_size=ctx_size,
        threads=threads,
        template_file=template,
    )


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _is_usage_error(e: Exception) -> bool:
    # typer >= 0.20 vendors click, so its UsageError is not click's; match by shape.
    return any(cls.__name__ == "UsageError" for cls in type(e).__mro__) and hasattr(
        e, "format_message"
    )


def main() -> None:
    """Console entry point: run the app, turn errors into one line and an exit code."""
    try:
        code = app(prog_name="llmrun", standalone_mode=False)
    except LlmrunError as e:
        if DEBUG["on"]:
            raise
        ui.error(str(e))
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, typer.Abort):
        sys.exit(130)
    except BrokenPipeError:
        # The reader went away (`llmrun run ... | head`): not an error.
        sys.stderr.close()
        sys.exit(0)
    except Exception as e:
        if not _is_usage_error(e) or DEBUG["on"]:
            raise
        if type(e).__name__ == "NoArgsIsHelpError":
            print(e.format_message())
            sys.exit(0)
        message = e.format_message()
        ui.error(message[:1].lower() + message[1:])
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)
