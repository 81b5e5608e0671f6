"""Images in `llmrun chat`: `--image` and `/image` give the first message an image that
later turns still see (each turn's greedy reply is transformers' over the whole
conversation with that image); a bad file or a model without vision is one error line."""

import pytest
from in_process import llmrun
from vision_helpers import (
    greedy_tokens,
    picture,
    processor_inputs,
    save_gemma3_vl_dir,
    tiny_gemma3_vl,
)

pytest.importorskip("transformers")
pytest.importorskip("PIL")
QUESTIONS = ("What is in this picture?", "And then?")
TOKENS = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat-images")
    model = tiny_gemma3_vl(seed=1)
    folder = save_gemma3_vl_dir(model, tmp / "model")
    image = tmp / "cat.png"
    image.write_bytes(picture(90, 120, seed=4))
    return model, folder, image


def transformers_transcript(model, folder, image) -> str:
    """What a piped chat prints for QUESTIONS with `image` in the first message: each
    reply transformers' greedy tokens after the conversation so far (the replies kept as
    text), decoded by llmrun's tokenizer, as the chat streams them."""
    from PIL import Image

    from llmrun.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder)
    first = [{"type": "image"}, {"type": "text", "text": QUESTIONS[0]}]
    messages, out = [], ""
    for question in QUESTIONS:
        messages.append({"role": "user", "content": first if not messages else question})
        inputs = processor_inputs(folder, [Image.open(image)], messages)
        reply = tokenizer.decode(greedy_tokens(model, inputs, TOKENS))
        messages.append({"role": "assistant", "content": reply})
        out += reply + "\n\n"
    return out


def test_a_chat_with_an_image_replies_as_transformers_in_every_turn(files):
    model, folder, image = files
    expected = transformers_transcript(model, folder, image)
    options = ("-n", str(TOKENS), "--temperature", "0")
    flag = llmrun("chat", folder, "--image", image, *options, input="\n".join(QUESTIONS))
    assert flag.returncode == 0, flag.stderr
    assert flag.stdout == expected
    command = llmrun("chat", folder, *options, input="\n".join([f"/image {image}", *QUESTIONS]))
    assert command.returncode == 0, command.stderr
    assert command.stdout == expected
    # The tower is not loaded at the start, but /image loads it: the note says so.
    assert "without the vision tower until an image is given (--image, /image)" in command.stderr
    assert "without the vision tower" not in flag.stderr


def test_image_of_a_missing_file_is_one_error_line_and_the_chat_goes_on(
    files, tmp_path, monkeypatch, capsys
):
    from llmrun import api
    from llmrun.chat import ChatSession
    from llmrun.repl import Repl
    from llmrun.sampling import SamplingParams

    folder = files[1]
    missing = tmp_path / "missing.png"
    session = ChatSession(api.load(str(folder), device="cpu"), SamplingParams(temperature=0), 3)
    lines = iter([f"/image {missing}", "Hello", "/bye"])
    monkeypatch.setattr("builtins.input", lambda prompt: next(lines))
    monkeypatch.setattr("llmrun.repl._setup_readline", lambda: None)
    Repl(session, interactive=True).run()
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert errors == [f"error: {missing}: cannot read the image (No such file or directory)"]
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert session.messages[0]["content"] == "Hello"  # no image went with it


def test_a_model_without_vision_refuses_images_as_run_does(tmp_path):
    image = tmp_path / "cat.png"
    image.write_bytes(picture(32, 32, seed=1))
    flag = llmrun("chat", "--image", image, input="Hi\n")
    run = llmrun("run", "--image", image, "Hi")
    command = llmrun("chat", input=f"/image {image}\nHi\n")
    assert flag.returncode == run.returncode == command.returncode == 2
    assert run.stderr.startswith("error: ") and "images go to Gemma 3" in run.stderr
    assert run.stderr.count("\n") == 1
    assert flag.stderr == run.stderr
    assert command.stderr.splitlines()[-1] == run.stderr.strip()  # after the chat's notes
