"""`quantize`: write a GGUF model quantized under a llama-quantize preset (Q4_K_M, ...)."""

from pathlib import Path
from typing import Annotated

import typer

from llmrun import ui
from llmrun.cli.app import DEBUG, Debug, Threads, app
from llmrun.errors import UsageError


@app.command()
def quantize(
    source: Annotated[Path, typer.Argument(help="The GGUF model to quantize.", metavar="INPUT")],
    target: Annotated[Path, typer.Argument(help="The GGUF file to write.", metavar="OUTPUT")],
    preset: Annotated[
        str,
        typer.Argument(
            help="llama-quantize's type: Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, Q2_K, Q3_K_M, F16, "
            "IQ4_XS, IQ3_M, TQ2_0, ...; IQ1_*, IQ2_*, IQ3_XXS, IQ3_XS and Q2_K_S need --imatrix "
            "(any case).",
            metavar="TYPE",
        ),
    ],
    allow_requantize: Annotated[
        bool,
        typer.Option("--allow-requantize", help="Requantize tensors that are already quantized."),
    ] = False,
    leave_output_tensor: Annotated[
        bool,
        typer.Option("--leave-output-tensor", help="Keep output.weight as it is."),
    ] = False,
    pure: Annotated[
        bool,
        typer.Option(
            "--pure", help="Give every quantized tensor TYPE's default type (no mix of types)."
        ),
    ] = False,
    output_tensor_type: Annotated[
        str | None,
        typer.Option("--output-tensor-type", metavar="T", help="The type of output.weight."),
    ] = None,
    token_embedding_type: Annotated[
        str | None,
        typer.Option(
            "--token-embedding-type", metavar="T", help="The type of the token embeddings."
        ),
    ] = None,
    imatrix: Annotated[
        Path | None,
        typer.Option(
            "--imatrix",
            metavar="FILE",
            help="An importance matrix (llmrun imatrix or llama-imatrix; GGUF or .dat) to "
            "weigh each weight's rounding error by.",
        ),
    ] = None,
    threads: Threads = None,
    debug: Debug = False,
) -> None:
    """Quantize a GGUF model as llama-quantize does: the same tensor types and bytes."""
    DEBUG["on"] = debug
    from llmrun import quantize as q
    from llmrun.quant import presets
    from llmrun.threads import default_threads

    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be positive, got {threads}")
    chosen = presets.parse_preset(preset)
    overrides = presets.Overrides(
        leave_output_tensor=leave_output_tensor,
        pure=pure,
        output_tensor_type=None
        if output_tensor_type is None
        else presets.parse_tensor_type(output_tensor_type, "--output-tensor-type"),
        token_embedding_type=None
        if token_embedding_type is None
        else presets.parse_tensor_type(token_embedding_type, "--token-embedding-type"),
    )

    importance, metadata = None, []
    if imatrix is not None:
        from llmrun import imatrix as im

        loaded = im.read(imatrix)
        importance, metadata = loaded.means(), im.quantize_metadata(loaded, str(imatrix))

    def report(index: int, total: int, p: q.TensorPlan) -> None:
        if index == 0:  # the input is read and its plan checked
            ui.info(f"quantizing {source} to {target} as {chosen.name}")
            if imatrix is not None:
                ui.info(
                    f"with the importance matrix {imatrix}: {len(importance)} entries over "
                    f"{loaded.chunk_count} chunks"
                )
        change = (
            p.info.ggml_type.name
            if p.new_type == p.info.ggml_type
            else f"{p.info.ggml_type.name} -> {p.new_type.name}"
        )
        shape = "x".join(map(str, p.ne))
        ui.info(
            f"[{index + 1:{len(str(total))}d}/{total}] {p.info.name} [{shape}] {change}, "
            f"{_mib(p.info.nbytes)} -> {_mib(p.new_nbytes)}"
        )

    summary = q.quantize_file(
        source,
        target,
        chosen,
        overrides,
        allow_requantize=allow_requantize,
        threads=threads or default_threads(),
        progress=report,
        imatrix=importance,
        metadata=metadata,
    )
    bits = 8 / max(1, summary.parameters)
    ui.info(
        f"model size {_mib(summary.bytes_before)} ({summary.bytes_before * bits:.2f} BPW) -> "
        f"{_mib(summary.bytes_after)} ({summary.bytes_after * bits:.2f} BPW)"
    )
    ui.info(f"wrote {target}")


def _mib(n: int) -> str:
    return f"{n / 1024 / 1024:.2f} MiB"
