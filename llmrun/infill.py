"""Fill-in-the-middle: the code before and after a cursor (and other files' text) as the
prompt a code model completes the middle of, in the order llama.cpp's server builds for
/infill (format_prompt_infill, "prefix-suffix-middle"):

    [FIM_REP]myproject\\n [FIM_SEP]file\\n text ... [FIM_SEP]filename\\n
    [BOS] [FIM_PRE] prefix prompt [FIM_SUF] suffix [FIM_MID]

The other files (each a name and its text) go first, as a repository: with the model's
repo and file-separator tokens where it has them, else each after a "--- snippet ---" line.
The prefix keeps its end and the suffix its start where they are too long. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmrun.errors import ContextOverflowError, UnsupportedError
from llmrun.tokenizer import Tokenizer

# llama-server's default --batch-size: the prefix may take 3/4 of it, the suffix and the
# prompt the other 1/4.
FIM_BATCH = 2048
# What llama.cpp writes before each other file's text where the vocabulary has no
# file-separator token, and the repository and file names it writes where it has them.
SNIPPET = "\n\n--- snippet ---\n\n"
REPO_NAME = "myproject"
FILE_NAME = "filename"
_NEEDED = {"pre": "prefix", "suf": "suffix", "mid": "middle"}


def check_fim(tokenizer: Tokenizer, name: str) -> None:
    """Refuses, in one line, a model whose vocabulary lacks the FIM tokens."""
    missing = [word for key, word in _NEEDED.items() if key not in tokenizer.fim_ids]
    if missing:
        raise UnsupportedError(
            f"{name} has no fill-in-the-middle {', '.join(missing)} token"
            f"{'s' if len(missing) > 1 else ''}: it is not a code-completion model"
        )


def fim_prompt(
    tokenizer: Tokenizer,
    prefix: str,
    suffix: str,
    extra: Sequence[tuple[str, str]] = (),
    prompt: str = "",
    *,
    n_ctx: int,
    n_batch: int = FIM_BATCH,
    n_predict: int = -1,
) -> list[int]:
    """The ids of a FIM prompt, as llama.cpp's server makes them: `extra` holds other
    files as (file name, text); `prompt` continues the prefix. The prefix keeps at most its
    last 3/4 of `n_batch` tokens, the suffix its first n_batch/4 - 2 - len(prompt); the other
    files their last n_ctx - n_batch - 2 * n_predict. The texts are read as plain text
    (special tokens in them are not parsed), the prompt with special tokens parsed."""
    fim = tokenizer.fim_ids

    def plain(text: str) -> list[int]:
        return tokenizer.encode(text, add_bos=False, parse_special=False)

    extra_ids: list[int] = []
    if "rep" in fim:
        extra_ids += [fim["rep"], *plain(REPO_NAME + "\n")]
    for filename, text in extra:
        if "sep" in fim:
            extra_ids += [fim["sep"], *plain(filename + "\n")]
        else:
            extra_ids += plain(SNIPPET)
        extra_ids += plain(text)
    if "sep" in fim:
        extra_ids += [fim["sep"], *plain(FILE_NAME + "\n")]

    prefix_ids, suffix_ids = plain(prefix), plain(suffix)
    prompt_ids = tokenizer.encode(prompt, add_bos=False, parse_special=True)
    prefix_take = min(len(prefix_ids), 3 * (n_batch // 4))
    suffix_take = min(len(suffix_ids), max(0, n_batch // 4 - (2 + len(prompt_ids))))
    extra_take = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_ids))

    ids = extra_ids[len(extra_ids) - extra_take :]
    # llama.cpp puts BOS after the other files, before the FIM prefix token.
    if tokenizer.add_bos and tokenizer.bos_id is not None:
        ids.append(tokenizer.bos_id)
    ids += [fim["pre"], *prefix_ids[len(prefix_ids) - prefix_take :], *prompt_ids]
    ids += [fim["suf"], *suffix_ids[:suffix_take], fim["mid"]]
    return ids


def infill_ids(
    tokenizer: Tokenizer,
    name: str,
    prefix: str,
    suffix: str,
    extra: Sequence[tuple[str, str]] = (),
    prompt: str = "",
    *,
    ctx_size: int,
    max_tokens: int | None = None,
) -> list[int]:
    """`fim_prompt` sized to leave room in a context of `ctx_size` tokens for `max_tokens`
    (None: a quarter of the context), for the model `name` (refused without FIM tokens)."""
    check_fim(tokenizer, name)
    room = max_tokens if max_tokens is not None else ctx_size // 4
    # Half of the rest for the prefix and suffix (llama.cpp's batch, at most FIM_BATCH),
    # the other files in what is left beyond twice the room (as llama.cpp leaves it).
    n_batch = min(FIM_BATCH, (ctx_size - room) // 2)
    if n_batch < 8:
        raise ContextOverflowError(
            f"a context of {ctx_size} tokens leaves no room for a fill-in-the-middle prompt "
            f"and {room} tokens to generate"
        )
    # The prompt is at most n_batch + 2 + max(0, n_ctx - n_batch - 2 * n_predict) tokens
    # (the prompt text beyond the suffix's quarter aside), which leaves n_predict - 2.
    return fim_prompt(
        tokenizer,
        prefix,
        suffix,
        extra,
        prompt,
        n_ctx=ctx_size,
        n_batch=n_batch,
        n_predict=room + 2,
    )
