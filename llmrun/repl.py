"""The `llmrun chat` loop: read input, run slash commands, stream replies.

On a terminal: a `>>> ` prompt with readline editing and history kept in the
state dir, multi-line input between \"\"\" lines, Ctrl-C to stop a reply,
Ctrl-D or /bye to leave. With stdin not a terminal: one message per line, each
reply printed as plain text followed by a blank line, until EOF.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

from llmrun import paths, ui
from llmrun.audio import open_audio
from llmrun.chat import SETTABLE, ChatSession, Turn
from llmrun.errors import LlmrunError
from llmrun.images import open_image

HELP = """Commands:
  /help                 this help
  /bye, /exit           leave (Ctrl-D too)
  /clear                start a new conversation
  /system TEXT          set the system message
  /image PATH           attach an image to the next message (vision models)
  /audio PATH           attach a WAV file to the next message (audio models)
  /set PARAM VALUE      set a parameter: {params}
  /set think on|off     switch thinking (models whose template has the switch)
  /show                 model, parameters and context use
  /save FILE            save the conversation as JSON
  /load FILE            load a saved conversation
  /retry                regenerate the last reply
  /undo                 drop the last exchange
Use \"\"\" to begin and end a multi-line message. Ctrl-C stops a reply.""".format(
    params=", ".join(SETTABLE)
)
MULTILINE = '"""'


class Repl:
    def __init__(
        self,
        session: ChatSession,
        interactive: bool,
        verbose: bool = False,
        show_thinking: bool | None = None,
    ) -> None:
        self.session = session
        self.interactive = interactive
        self.verbose = verbose
        # Reasoning shows on a terminal and stays out of a pipe, unless told otherwise.
        self.show_thinking = ui.stdout_is_tty() if show_thinking is None else show_thinking
        self.commands: dict[str, Callable[[str], bool | None]] = {
            "/help": lambda _: ui.info(HELP),
            "/?": lambda _: ui.info(HELP),
            "/bye": lambda _: True,
            "/exit": lambda _: True,
            "/clear": self._clear,
            "/system": self._system,
            "/image": self._image,
            "/audio": self._audio,
            "/set": self._set,
            "/show": lambda _: ui.info(self._show()),
            "/save": self._save,
            "/load": self._load,
            "/retry": lambda _: self._stream(self.session.retry),
            "/undo": self._undo,
        }

    def run(self) -> None:
        if not self.session.uses_template:
            ui.info(
                "note: this model has no chat template; using a plain User:/Assistant: transcript"
            )
        if self.interactive:
            _setup_readline()
            ui.info("Type a message, /help for commands, Ctrl-D or /bye to leave.")
        for text, quoted in self._inputs():
            try:
                if text.startswith("/") and not text.startswith("//") and not quoted:
                    if self._command(text):
                        return
                elif text.strip():
                    self._stream(lambda turn, text=text: self.session.send(text, turn))
            except LlmrunError as e:
                if not self.interactive:
                    raise
                ui.error(str(e))
            except KeyboardInterrupt:
                # A Ctrl-C that lands just after a reply ends, or in a command: the REPL
                # goes on (it left with exit status 130).
                if not self.interactive:
                    raise
                ui.write("\n")

    def _inputs(self) -> Iterator[tuple[str, bool]]:
        """Each input and whether it was between \"\"\" lines: a message then, even one
        that begins with "/" (a pasted path, say), as in ollama."""
        if not self.interactive:
            for line in sys.stdin:
                yield line.rstrip("\r\n"), False  # a file written on Windows ends lines in CRLF
            return
        while True:
            try:
                line = input(">>> ")
                quoted = line.lstrip().startswith(MULTILINE)
                if quoted:
                    line = self._multiline(line.lstrip()[len(MULTILINE) :])
            except EOFError:
                ui.write("\n")
                return
            except KeyboardInterrupt:
                ui.write("\n")
                ui.info("Use Ctrl-D or /bye to exit.")
                continue
            yield line, quoted

    def _multiline(self, first: str) -> str:
        lines = [first] if first else []
        if first.endswith(MULTILINE):
            return first[: -len(MULTILINE)]
        while True:
            line = input("... ")
            if line.rstrip().endswith(MULTILINE):
                lines.append(line.rstrip()[: -len(MULTILINE)])
                return "\n".join(lines).strip("\n")
            lines.append(line)

    def _command(self, text: str) -> bool:
        name, _, arg = text.partition(" ")
        handler = self.commands.get(name.lower())
        if handler is None:
            ui.warn(f"unknown command {name}; /help lists the commands")
            return False
        return bool(handler(arg.strip()))

    def _stream(self, start: Callable[[Turn], Iterator[str]]) -> None:
        turn = Turn()
        pieces = start(turn)
        out = ui.ReplyWriter(self.show_thinking)
        try:
            for piece in pieces:
                out.write(piece)
        except KeyboardInterrupt:
            turn.interrupted = True
        finally:
            pieces.close()
            out.end()
        ui.write("\n\n" if not self.interactive else "\n")
        if turn.withdrawn:
            ui.info("(stopped before the reply began: the message is not kept)")
        elif turn.interrupted:
            ui.info("(stopped)")
        if turn.dropped:
            ui.warn(f"the context was full: dropped the {turn.dropped} oldest messages")
        # Under --context-overflow shift the next turn makes room itself: no /clear advice.
        shift = self.session.overflow == "shift"
        if (
            turn.finish_reason == "length"
            and self.session.context_used >= self.session.context_size
        ):
            ui.warn(
                "the context is full: "
                + ("the reply stops here" if shift else "/clear to start over")
            )
        elif self.session.near_full and not shift:
            ui.warn(f"context {self._usage()} used; /clear starts over")
        if self.verbose and turn.response is not None:
            ui.print_stats(turn.response.stats)

    def _usage(self) -> str:
        s = self.session
        return f"{s.context_used}/{s.context_size} tokens ({100 * s.context_used / s.context_size:.0f}%)"

    def _show(self) -> str:
        s = self.session
        engine = s.engine
        p = s.params
        lines = [
            f"model: {engine.name} ({engine.path})",
            f"architecture: {engine.checkpoint.config.get('model_type')}, {engine.checkpoint.n_params:,} parameters",
            f"device: {engine.device.type}, dtype: {str(engine.dtype).removeprefix('torch.')}",
            f"template: {'the model' + chr(39) + 's own' if s.uses_template else 'plain User:/Assistant: transcript'}",
            f"system: {s.system or '(none)'}",
            f"context: {self._usage()}",
            f"parameters: temperature={p.temperature} top_k={p.top_k} top_p={p.top_p} min_p={p.min_p} "
            f"repeat_penalty={p.repeat_penalty} repeat_last_n={p.repeat_last_n} "
            f"seed={p.seed if p.seed is not None else -1} "
            f"max_tokens={s.max_tokens if s.max_tokens is not None else -1}",
        ]
        return "\n".join(lines)

    def _clear(self, _: str) -> None:
        self.session.clear()
        ui.info("new conversation")

    def _system(self, text: str) -> None:
        self.session.system = text or None
        ui.info("system message set" if text else "system message cleared")

    def _image(self, path: str) -> None:
        if not path:
            ui.warn("usage: /image PATH")
            return
        self.session.attach([open_image(path)])
        ui.info(f"{path} goes with the next message")

    def _audio(self, path: str) -> None:
        if not path:
            ui.warn("usage: /audio PATH")
            return
        self.session.attach_audio([open_audio(path)])
        ui.info(f"{path} goes with the next message")

    def _set(self, arg: str) -> None:
        name, _, value = arg.partition(" ")
        if not value:
            ui.warn(f"usage: /set PARAM VALUE ({', '.join([*SETTABLE, 'think'])})")
            return
        self.session.set_param(name, value.strip())
        ui.info(f"{name} = {value.strip()}")

    def _save(self, path: str) -> None:
        if not path:
            ui.warn("usage: /save FILE")
            return
        self.session.save(path)
        ui.info(f"saved {len(self.session.messages)} messages to {path}")

    def _load(self, path: str) -> None:
        if not path:
            ui.warn("usage: /load FILE")
            return
        self.session.load(path)
        ui.info(f"loaded {len(self.session.messages)} messages from {path}")

    def _undo(self, _: str) -> None:
        self.session.undo()
        ui.info("dropped the last exchange")


def _setup_readline() -> None:
    try:
        import readline
    except ImportError:  # e.g. Windows without pyreadline: plain input() still works
        return
    history = paths.state_dir() / "chat_history"
    try:
        history.parent.mkdir(parents=True, exist_ok=True)
        if history.exists():
            readline.read_history_file(history)
    except OSError:
        return
    readline.set_history_length(1000)
    import atexit

    atexit.register(_save_history, readline, history)


def _save_history(readline, history) -> None:
    try:
        readline.write_history_file(history)
    except OSError:
        pass
