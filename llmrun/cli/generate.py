"""`run`, `chat` and `tokenize`: flags -> the generation and tokenizer calls."""

import inspect
import json
import sys
from typing import Annotated

import typer

from llmrun import ui
from llmrun.cli.app import (
    DEBUG,
    Activations,
    CacheType,
    CtxSize,
    Debug,
    Device,
    DraftMax,
    DraftOpt,
    DraftPMin,
    Dtype,
    Effort,
    LookupOpt,
    Lora,
    LoraScaled,
    MaxTokens,
    MinP,
    ModelOpt,
    RepeatLastN,
    RepeatPenalty,
    Seed,
    ShowThinking,
    Stop,
    Temperature,
    TemplateOpt,
    Think,
    Threads,
    TopK,
    TopP,
    Verbose,
    _adapters,
    _check_draft,
    _load,
    _max_tokens,
    _read_stdin,
    _split_model_and_prompt,
    _use_draft,
    app,
)
from llmrun.cli.batch import (
    Batch,
    BatchLines,
    Output,
    Parallel,
    Resume,
    Strict,
    Unordered,
    check_batch_only,
    run_batch,
)
from llmrun.errors import UsageError

Mmproj = Annotated[
    str | None,
    typer.Option(
        "--mmproj",
        metavar="FILE",
        help="The image or audio encoder GGUF of a GGUF model (llama.cpp's mmproj file).",
    ),
]
AudioOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--audio",
        metavar="PATH",
        help="A WAV file for the prompt, before its text and after any --image "
        "(repeatable), for the audio-language families README lists (Voxtral, Qwen2-Audio, "
        "Gemma 4, ...); Gemma 4 and the Omni models take images and audio in one prompt.",
    ),
]
Language = Annotated[
    str | None,
    typer.Option(
        "--language",
        metavar="LANG",
        help="Speech recognition: the language spoken in --audio, an ISO 639-1 code or a "
        "name (en, german); Whisper detects it when not given; SeamlessM4T's three-letter "
        "code (eng), which it writes.",
    ),
]
Task = Annotated[
    str | None,
    typer.Option(
        "--task",
        metavar="TASK",
        help="Whisper: transcribe (the default) or translate (into English).",
    ),
]
TranscriptFormat = Annotated[
    str | None,
    typer.Option(
        "--output-format",
        metavar="FORMAT",
        help="Speech recognition: print the transcript of --audio as text (the default), json, "
        "verbose_json, srt or vtt, as serve's /v1/audio/transcriptions answers them (srt, vtt "
        "and segments from Whisper's timestamps). Florence-2 and Kosmos-2 with --image: json, "
        "the reply and its boxes as the processor's post_process_generation parses them.",
    ),
]
WordTimestamps = Annotated[
    bool,
    typer.Option(
        "--word-timestamps",
        help="Whisper and Parakeet TDT/RNN-T, with --output-format verbose_json: each word's "
        "start and end too (Whisper's from the cross-attention of generation_config.json's "
        "alignment_heads, Parakeet's from its tokens' frames).",
    ),
]
Beams = Annotated[
    int | None,
    typer.Option(
        "--beams",
        metavar="N",
        min=1,
        help="Text-to-text and speech recognition models: beam search with N beams (1: "
        "greedy, or sampling with --temperature); default: generation_config.json's "
        "num_beams, when not sampling.",
    ),
]
SourceLanguage = Annotated[
    str | None,
    typer.Option(
        "--source-language",
        metavar="CODE",
        help="Many-to-many translators (mBART-50, NLLB, M2M100): the prompt's language, as "
        "the model's code (en_XX, eng_Latn, en).",
    ),
]
TargetLanguage = Annotated[
    str | None,
    typer.Option(
        "--target-language",
        metavar="CODE",
        help="Many-to-many translators: the language to translate into (de_DE, deu_Latn, de); "
        "a multilingual Marian's >>xxx<< target token (deu or >>deu<<); SeamlessM4T's (fra), "
        "of a text or of --audio.",
    ),
]


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
    cache_type: CacheType = None,
    activations: Activations = "f32",
    lora: Lora = None,
    lora_scaled: LoraScaled = None,
    threads: Threads = None,
    draft: DraftOpt = None,
    draft_max: DraftMax = None,
    draft_p_min: DraftPMin = None,
    lookup: LookupOpt = None,
    raw: Annotated[
        bool, typer.Option(help="Send the prompt as is, without the chat template.")
    ] = False,
    template: TemplateOpt = None,
    suffix: Annotated[
        str | None,
        typer.Option(
            "--suffix",
            "--fim-suffix",
            help="Fill in the middle: the code after the gap (the prompt is the code before "
            "it); prints the middle. For code models with FIM tokens.",
        ),
    ] = None,
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
    output_format: Annotated[
        str | None,
        typer.Option(
            "--format", help="Constrain the output: json (any object) or a JSON schema file."
        ),
    ] = None,
    grammar: Annotated[
        str | None, typer.Option("--grammar", help="Constrain the output to a GBNF grammar file.")
    ] = None,
    image: Annotated[
        list[str] | None,
        typer.Option(
            "--image",
            metavar="PATH",
            help="An image for the prompt, before its text (repeatable), for the "
            "vision-language families README lists (Gemma 3, Mistral 3, Qwen2.5-VL, ...).",
        ),
    ] = None,
    audio: AudioOpt = None,
    language: Language = None,
    task: Task = None,
    transcript_format: TranscriptFormat = None,
    word_timestamps: WordTimestamps = False,
    beams: Beams = None,
    source_language: SourceLanguage = None,
    target_language: TargetLanguage = None,
    mmproj: Mmproj = None,
    batch: Batch = None,
    batch_lines: BatchLines = False,
    unordered: Unordered = False,
    parallel: Parallel = None,
    output: Output = None,
    resume: Resume = False,
    strict: Strict = False,
    verbose: Verbose = False,
    debug: Debug = False,
) -> None:
    """Generate a completion for one prompt: `llmrun run [MODEL] "prompt"`; the prompt may be
    piped. With --batch FILE, one result line for each request of FILE. A speech recognition
    model (Whisper, Cohere Transcribe, Moonshine) prints the transcript of each --audio (the
    prompt, if any, is Whisper's initial prompt); so does an audio-language model given
    --audio and no prompt, by its family's transcription prompt (GLM-ASR, Fun-ASR-Nano, ...)."""
    DEBUG["on"] = debug
    if suffix is not None:
        _check_fim_flags(locals())
    if image and (batch is not None or suffix is not None or draft or lookup is not None):
        raise UsageError("--image does not go with --batch, --suffix, --draft or --lookup")
    if audio and (batch is not None or suffix is not None or draft or lookup is not None):
        raise UsageError("--audio does not go with --batch, --suffix, --draft or --lookup")
    if transcript_format is not None and image and not audio:
        _check_image_format(transcript_format, output_json)
    elif transcript_format is not None:
        _check_transcript_format(transcript_format, len(audio or []), output_json)
    if word_timestamps and transcript_format != "verbose_json":
        raise UsageError("--word-timestamps goes with --audio and --output-format verbose_json")
    if batch is not None:
        if (
            draft is not None
            or draft_max is not None
            or draft_p_min is not None
            or lookup is not None
        ):
            raise UsageError(
                "--draft and --lookup do not go with --batch (its requests decode together)"
            )
        if beams is not None or source_language is not None or target_language is not None:
            raise UsageError(
                "--beams, --source-language and --target-language do not go with --batch"
            )
        return run_batch(locals())
    check_batch_only(locals())
    model_spec, prompt = _split_model_and_prompt(list(args or []), model)
    piped = _read_stdin() if suffix is None else _read_code(prompt)
    if prompt is not None and piped:
        prompt = f"{prompt}\n\n{piped}"
    elif prompt is None:
        prompt = piped
    if (
        not prompt
        and ui.stdin_is_tty()
        and not (output_json or raw or stop or output_format or grammar or suffix is not None)
        and not image
        and not audio
    ):
        # `llmrun run MODEL` at a terminal chats, as `ollama run MODEL` does.
        chat_options = set(inspect.signature(chat).parameters) - {"model"}
        options = {k: v for k, v in locals().items() if k in chat_options}
        return chat(model=model_spec, **options)
    if not prompt and not audio and not image:
        # a speech recognition model transcribes audio without one; TrOCR reads an image
        raise UsageError(NO_PROMPT)
    if (language is not None or task is not None) and not audio:
        raise UsageError("--language and --task go with --audio and a speech recognition model")
    if logprobs is not None and not output_json:
        raise UsageError("--logprobs needs --json")
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise UsageError(f"--logprobs must be between 0 and 20, got {logprobs}")
    if raw and (think is not None or reasoning_effort is not None):
        raise UsageError(
            "--think/--no-think and --reasoning-effort need the chat template: drop --raw"
        )
    limit = _max_tokens(max_tokens)
    _check_draft(draft, draft_max, lookup, draft_p_min)
    from llmrun.audio import open_audio
    from llmrun.images import open_image
    from llmrun.reasoning import Splitter

    pictures = [open_image(path) for path in image or []]  # bad images fail before loading
    clips = [open_audio(path) for path in audio or []]  # so does bad audio
    engine = _load(
        model_spec,
        device=device,
        dtype=dtype,
        ctx_size=ctx_size,
        threads=threads,
        template_file=template,
        cache_type=cache_type,
        activations=activations,
        lora=_adapters(lora, lora_scaled),
        vision=bool(pictures),
        mmproj=mmproj,
        audio=bool(clips),
        transcribe=bool(clips),
        text_to_text=True,
    )
    options = None
    languages = source_language is not None or target_language is not None
    if (beams is not None and not engine.transcribes) or languages:
        if not engine.text_to_text:
            raise UsageError(
                "--beams, --source-language and --target-language go with a text-to-text "
                "model (T5, BART, Marian, M2M100, ...), --beams with a speech recognition "
                f"model too; not {engine.name}"
            )
        from llmrun.text_to_text import Options

        options = Options(beams, source_language, target_language)
    if engine.transcribes and (clips or not engine.text_to_text):  # SeamlessM4T: text too
        if source_language is not None:
            raise UsageError(
                "--source-language goes with a text prompt; the language spoken in --audio "
                "is --language"
            )
        return _transcribe(
            engine,
            clips,
            prompt,
            language,
            task,
            output_json,
            transcript_format,
            beams,
            target_language,
            words=word_timestamps,
            temperature=temperature,
            seed=seed,
        )
    if not prompt and clips and engine.audio is not None:
        if task is not None:
            raise UsageError(f"--task goes with a speech recognition model, not {engine.name}")
        from llmrun.transcript_formats import SUBTITLES

        if transcript_format in SUBTITLES:
            raise UsageError(
                f"--output-format {transcript_format}: {engine.name} is an audio-language "
                "model, which predicts no timestamps"
            )
        params = engine.sampling(locals())
        if temperature is None:  # greedy, as serve's transcriptions are unless asked
            params = params.updated(temperature=0.0)
        return _transcribe_by_prompt(
            engine, clips, language, params, limit, output_json, transcript_format
        )
    if language is not None or task is not None or (transcript_format and not pictures):
        raise UsageError(
            "--language, --task and --output-format go with a speech recognition model, not "
            f"{engine.name}"
        )
    if not prompt and not (pictures and (engine.text_to_text or engine.image_first)):
        raise UsageError(NO_PROMPT)
    # an image-to-text model's image alone (TrOCR takes no prompt; GIT captions it)
    prompt = prompt or ""
    load = dict(dtype=dtype, threads=threads, cache_type=cache_type, activations=activations)
    _use_draft(engine, draft, draft_max, lookup, draft_p_min, **load)
    params = engine.sampling(locals())
    images = None
    if suffix is None:
        switches = engine.switches(think, reasoning_effort)
        text = engine.prompt_text(
            prompt, raw=raw, images=len(pictures), audio=len(clips), **switches
        )
        if pictures or clips:
            ids, images = engine.media_prompt(text, pictures, clips)
            if transcript_format is not None:
                from llmrun.image_outputs import parser

                parse = parser(engine, prompt, ids, pictures[0])
        else:
            ids = engine.tokenizer.encode(text)
    else:
        from llmrun.infill import infill_ids

        ids = infill_ids(
            engine.tokenizer,
            engine.name,
            prompt,
            suffix,
            ctx_size=engine.ctx_size,
            max_tokens=limit,
        )
        text = engine.tokenizer.decode(ids, skip_special=False)
    if output_format is not None or grammar is not None:
        from llmrun import structured

        constraint = structured.for_cli(engine, output_format, grammar)
        params = params.updated(grammar=structured.for_prompt(constraint, engine.markers, text))
    if show_prompt:
        ui.print_prompt(text)
    split = Splitter(engine.markers, text)
    out = ui.ReplyWriter(ui.stdout_is_tty() if show_thinking is None else show_thinking)
    tokens, final, reply = [], None, []
    shown = not (output_json or transcript_format)
    try:
        for response in engine.generate(
            ids, params, limit, stop or (), logprobs, images=images, options=options
        ):
            for piece in split.feed(response.token, response.text):
                if shown:
                    out.write(piece)
            reply.append(response.text)
            tokens.extend(response.logprobs)
            final = response
    except KeyboardInterrupt:
        if shown:
            out.end()
            ui.end_text()
        raise
    if output_json:
        ui.print_json(engine.result_record(split, final, tokens if logprobs is not None else None))
    elif transcript_format:
        ui.print_json({"text": "".join(reply), "parsed": parse("".join(reply))})
    else:
        out.end()
        ui.end_text()
    if verbose:
        ui.print_stats(final.stats)


NO_PROMPT = 'no prompt: give one (llmrun run [MODEL] "PROMPT") or pipe it on stdin'


def _transcribe_by_prompt(
    engine, clips, language, params, limit, output_json: bool, transcript_format: str | None
) -> None:
    """An audio-language model's transcript of each clip by its family's transcription
    prompt, a line each (--json: an object each; --output-format json or verbose_json: as
    serve answers them, an object a line)."""
    from llmrun import transcript_formats as formats
    from llmrun.audio import SAMPLE_RATE

    for clip in clips:
        ids, images = engine.audio_prompt(engine.transcription_prompt(language), [clip])
        responses = list(engine.generate(ids, params, limit, images=images))
        text = engine.transcript("".join(r.text for r in responses))
        if output_json:
            ui.print_json({"text": text, "language": language})
        elif transcript_format == "json":
            generated = sum(r.token is not None for r in responses)
            usage = {
                "type": "tokens",
                "input_tokens": len(ids),
                "output_tokens": generated,
                "total_tokens": len(ids) + generated,
            }
            ui.print_json({"text": text, "usage": usage})
        elif transcript_format == "verbose_json":
            duration = len(clip.samples) / SAMPLE_RATE
            ui.print_json(formats.verbose_json(text, language, "transcribe", duration))
        else:
            ui.write(text + "\n")


def _check_image_format(output_format: str, output_json: bool) -> None:
    """Refuse a bad --output-format for --image before the model loads."""
    if output_format != "json":
        raise UsageError(f"--output-format {output_format!r} with --image: give json")
    if output_json:
        raise UsageError("--json and --output-format: give one")


def _check_transcript_format(transcript_format: str, clips: int, output_json: bool) -> None:
    """Refuse a bad --output-format before the model loads."""
    from llmrun.transcript_formats import FORMATS, SUBTITLES

    if not clips:
        raise UsageError(
            "--output-format goes with --audio and a speech recognition model, or with --image "
            "and Florence-2 or Kosmos-2 (json)"
        )
    if transcript_format not in FORMATS:
        raise UsageError(f"--output-format {transcript_format!r}: give {', '.join(FORMATS)}")
    if output_json:
        raise UsageError("--json and --output-format: give one")
    if transcript_format in SUBTITLES and clips > 1:
        raise UsageError(f"--output-format {transcript_format} takes one --audio (one file each)")


def _transcribe(
    engine,
    clips,
    prompt,
    language,
    task,
    output_json: bool,
    transcript_format: str | None,
    beams: int | None,
    target_language: str | None = None,
    words: bool = False,
    temperature: float | None = None,
    seed: int | None = None,
) -> None:
    """A speech recognition model's transcript of each clip, a line each (--json: an object
    each; --output-format: as serve answers it, json and verbose_json an object a line);
    `beams`: --beams; `target_language`: --target-language (SeamlessM4T's translation);
    `words`: --word-timestamps; `temperature`: --temperature (Whisper's temperature
    fallback from it), `seed`: --seed."""
    from llmrun import transcript_formats as formats
    from llmrun.audio import SAMPLE_RATE

    if transcript_format in formats.SUBTITLES and not engine.speech_timestamps:
        raise UsageError(
            f"--output-format {transcript_format}: {engine.name} is a {engine.speech_family} "
            "model, which predicts no timestamps"
        )
    timed = engine.speech_timestamps and transcript_format in formats.TIMED
    for clip in clips:
        result = engine.transcribe(
            clip, language, task, prompt, timed, beams, target_language, words, temperature, seed
        )
        if output_json:
            ui.print_json({"text": result.text, "language": result.language})
        elif transcript_format == "json":
            ui.print_json(formats.json_body(result))
        elif transcript_format == "verbose_json":
            duration = len(clip.samples) / SAMPLE_RATE
            body = formats.verbose_json(
                result.text,
                result.language,
                task or "transcribe",
                duration,
                result.segments,
                result.words,
            )
            ui.print_json(body)
        elif transcript_format in formats.SUBTITLES:
            ui.write(formats.subtitles(transcript_format, result.segments))
        else:
            ui.write(result.text + "\n")


# run's flags that have no meaning for a fill-in-the-middle prompt, which is no chat.
_NOT_WITH_SUFFIX = {
    "batch": "--batch",
    "raw": "--raw",
    "template": "--template",
    "think": "--think/--no-think",
    "reasoning_effort": "--reasoning-effort",
    "output_format": "--format",
    "grammar": "--grammar",
}


def _check_fim_flags(flags: dict) -> None:
    for name, flag in _NOT_WITH_SUFFIX.items():
        if flags[name] not in (None, False):
            raise UsageError(f"{flag} does not go with --suffix")


def _read_code(prompt: str | None) -> str | None:
    """The code before the gap from stdin, as it is (its last newline matters), where no
    argument gives it; None from a terminal."""
    if prompt is not None or sys.stdin is None or sys.stdin.isatty():
        return None
    return sys.stdin.read() or None


@app.command()
def chat(
    model: Annotated[
        str | None,
        typer.Argument(help="MODEL (default: the bundled stories260K)", metavar="MODEL"),
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
    cache_type: CacheType = None,
    activations: Activations = "f32",
    lora: Lora = None,
    lora_scaled: LoraScaled = None,
    threads: Threads = None,
    draft: DraftOpt = None,
    draft_max: DraftMax = None,
    draft_p_min: DraftPMin = None,
    lookup: LookupOpt = None,
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
    tools: Annotated[
        str | None,
        typer.Option("--tools", help="A JSON file of function tools the model may call (shown)."),
    ] = None,
    image: Annotated[
        list[str] | None,
        typer.Option(
            "--image",
            metavar="PATH",
            help="An image for the first message, before its text (repeatable); /image "
            "attaches one later. The vision-language families README lists.",
        ),
    ] = None,
    audio: AudioOpt = None,
    mmproj: Mmproj = None,
    verbose: Verbose = False,
    debug: Debug = False,
) -> None:
    """Chat with a model in a REPL (or one message per line from a pipe)."""
    DEBUG["on"] = debug
    limit = _max_tokens(max_tokens)
    _check_draft(draft, draft_max, lookup, draft_p_min)
    if image and (draft or lookup is not None):
        raise UsageError("--image does not go with --draft or --lookup")
    if audio and (draft or lookup is not None):
        raise UsageError("--audio does not go with --draft or --lookup")
    from llmrun.api import untemplated_text_to_text
    from llmrun.audio import open_audio
    from llmrun.chat import ChatSession
    from llmrun.images import open_image
    from llmrun.repl import Repl

    pictures = [open_image(path) for path in image or []]  # bad images fail before loading
    clips = [open_audio(path) for path in audio or []]  # so does bad audio
    engine = _load(
        model,
        device=device,
        dtype=dtype,
        ctx_size=ctx_size,
        threads=threads,
        template_file=template,
        cache_type=cache_type,
        activations=activations,
        lora=_adapters(lora, lora_scaled),
        vision=bool(pictures),
        mmproj=mmproj,
        audio=bool(clips),
        text_to_text=True,
    )
    if engine.text_to_text and engine.template is None:
        raise UsageError(untemplated_text_to_text(engine.name))
    load = dict(dtype=dtype, threads=threads, cache_type=cache_type, activations=activations)
    _use_draft(engine, draft, draft_max, lookup, draft_p_min, **load)
    params = engine.sampling(locals())
    session = ChatSession(engine, params, limit, system=system, overflow=context_overflow)
    session.switches = engine.switches(think, reasoning_effort)
    if pictures:
        session.attach(pictures)
    if clips:
        session.attach_audio(clips)
    if tools is not None:
        from llmrun import tool_use

        tool_use.offer_tools(session, tool_use.load_tools(tools))
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
