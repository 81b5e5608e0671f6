"""`pull`, `list`, `show` and `rm`: flags -> llmrun.hub."""

from typing import Annotated

import typer

from llmrun import ui
from llmrun.cli.app import DEBUG, Debug, app
from llmrun.errors import LlmrunError, UsageError

HubNameArg = Annotated[
    str,
    typer.Argument(
        help="org/repo, org/repo:QUANT or org/repo/file.gguf, each with an optional @revision.",
        metavar="REPO[:QUANT]",
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
    name: Annotated[
        str, typer.Argument(help="A downloaded model or a local path.", metavar="MODEL")
    ],
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
    names: Annotated[
        list[str], typer.Argument(help="Downloaded models.", metavar="MODEL", show_default=False)
    ],
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking.")] = False,
    debug: Debug = False,
) -> None:
    """Delete downloaded models, blobs included, and print the space freed."""
    DEBUG["on"] = debug
    from llmrun import hub

    plans = [hub.plan_removal(name) for name in dict.fromkeys(names)]  # each name once
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
