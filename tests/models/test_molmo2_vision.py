"""Molmo 2 (molmo2: a ViT on overlapping crops, an attention-pooling adapter, its own
Qwen3-like language model) with images against transformers: a tiny random
Molmo2ForConditionalGeneration (text hidden 64 in 2 layers, 8 added embedding rows for
the image tokens; ViT hidden 32 in 3 layers, of which the adapter reads layers 1 and 0,
on 35-pixel crops of 7-pixel patches overlapping by one patch each side, at most 4 crops,
2x2 patches pooled a token). Two images, 40x90 (a 1x3 tiling) and 20x25 (one crop,
upscaled), in one prompt: their tokens see each other both ways across the text between.

The prompt ids, patches and pooling windows are Molmo2Processor's (stored in
tests/data/molmo2_processor.json: its image processor needs torchvision; checked live
where torchvision is installed); the image features, the logits and 8 greedy tokens are
Molmo2ForConditionalGeneration's on those inputs. Pooling windows that keep the crops'
overlaps, and image tokens seen causally, fail.

Tolerances: patches 1e-6 relative on two checksums; f32 image features and logits 1e-4;
embeddings of the ids around either cut of the two tables exact.
"""

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from helpers import STORIES_HF, randomize
from in_process import llmrun
from vision_checks import check_run_chat_and_serve_with_an_image
from vision_helpers import picture

from llmrun import api, generate, molmo2_images
from llmrun.errors import UsageError
from llmrun.images import open_image
from llmrun.loading import loader
from llmrun.models import molmo2_text
from llmrun.quant import kernels
from llmrun.quant.linear import QuantEmbedding
from llmrun.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

STORED = Path(__file__).parent.parent / "data" / "molmo2_processor.json"
# The added embedding rows' tokens, ids 512 on (after stories260K's 512).
IMAGE_TOKENS = ("<im_patch>", "<im_col>", "<im_start>", "<low_res_im_start>", "<im_end>")
PATCH_ID, COL_ID, START_ID, LOW_START_ID, END_ID = 512, 513, 514, 515, 516
CROP, PATCH = 35, 7
TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}:"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|image|> and {% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
QUESTION = "What is in these pictures?"
IMAGES = ((40, 90, 1), (20, 25, 2))  # height, width, seed
GREEDY = SamplingParams(temperature=0.0)
PROCESSOR = {
    "image_processor_type": "Molmo2ImageProcessor",
    "size": {"height": CROP, "width": CROP},
    "patch_size": PATCH,
    "max_crops": 4,
    "overlap_margins": [1, 1],
    "pooling_size": [2, 2],
}


def tiny_model():
    config = transformers.Molmo2Config(
        vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=2, head_dim=16, image_size=[CROP, CROP], patch_size=PATCH,
        ),
        adapter_config=dict(
            vision_feature_layer=[-2, 0], hidden_size=32, num_attention_heads=2,
            num_key_value_heads=2, head_dim=16, intermediate_size=48, text_hidden_size=64,
        ),
        text_config=dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, additional_vocab_size=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            bos_token_id=1, eos_token_id=2,
        ),
        image_start_token_id=START_ID, low_res_image_start_token_id=LOW_START_ID,
        image_end_token_id=END_ID, image_patch_id=PATCH_ID,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Molmo2ForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_folder(model, path: Path) -> Path:
    """The model's folder as save_pretrained writes it (AI2's tensor names), with
    stories260K's tokenizer plus IMAGE_TOKENS, TEMPLATE and PROCESSOR."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    for i, content in enumerate(IMAGE_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def checksums(values: torch.Tensor) -> list[float]:
    """Sums that a wrong value, crop or order changes: the plain sum, and one weighted by
    each value's place."""
    flat = values.double().flatten()
    weights = torch.cos(torch.arange(len(flat), dtype=torch.float64) * 0.01)
    return [flat.sum().item(), (flat * weights).sum().item()]


def processor_record(folder: Path) -> dict:
    """Molmo2Processor's inputs for one user message of IMAGES then QUESTION (needs
    torchvision)."""
    processor = transformers.Molmo2Processor(
        image_processor=transformers.Molmo2ImageProcessor(
            **{k: v for k, v in PROCESSOR.items() if k != "image_processor_type"}
        ),
        video_processor=transformers.Molmo2VideoProcessor(),
        tokenizer=transformers.AutoTokenizer.from_pretrained(folder),
        chat_template=TEMPLATE,
    )
    content = [{"type": "image"}] * len(IMAGES) + [{"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = [open_image(picture(*image)) for image in IMAGES]
    inputs = processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    return {
        "input_ids": inputs["input_ids"][0].tolist(),
        "mm_token_type_ids": inputs["mm_token_type_ids"][0].tolist(),
        "crops": inputs["image_num_crops"].tolist(),
        "patch_sums": checksums(inputs["pixel_values"]),
        "pooling": inputs["image_token_pooling"].tolist(),
        "grids": inputs["image_grids"].tolist(),
    }


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def folder(model, tmp_path_factory):
    return save_folder(model, tmp_path_factory.mktemp("molmo2"))


@pytest.fixture(scope="module")
def engine(folder):
    return api.load(str(folder), device="cpu", vision=True)


@pytest.fixture(scope="module")
def images():
    return [open_image(picture(*image)) for image in IMAGES]


@pytest.fixture(scope="module")
def prompt(engine, images):
    return engine.image_prompt(engine.prompt_text(QUESTION, images=len(images)), images)


@pytest.fixture(scope="module")
def model_inputs(engine, images, prompt):
    """transformers' inputs from llmrun's patches and pooling windows: each image's
    windows index its own patches, as the processor gives them."""
    ids, _ = prompt
    parts = [molmo2_images.inputs(engine.vision, image) for image in images]
    grids = [molmo2_images.grid(engine.vision, i.height, i.width) for i in images]
    image_ids = torch.tensor([PATCH_ID, COL_ID, START_ID, LOW_START_ID, END_ID])
    return dict(
        input_ids=torch.tensor([ids]),
        pixel_values=torch.cat([patches for patches, _ in parts]),
        image_token_pooling=torch.cat([pooling for _, pooling in parts]),
        image_grids=torch.tensor(grids),
        image_num_crops=torch.tensor([len(patches) for patches, _ in parts]),
        mm_token_type_ids=torch.isin(torch.tensor([ids]), image_ids).long(),
    )


def test_the_prompt_and_patches_are_the_processors(model_inputs, prompt):
    stored = json.loads(STORED.read_text())
    ids, prompt_images = prompt
    assert ids == stored["input_ids"]
    assert model_inputs["mm_token_type_ids"][0].tolist() == stored["mm_token_type_ids"]
    assert model_inputs["image_num_crops"].tolist() == stored["crops"] == [4, 2]
    assert model_inputs["image_grids"].tolist() == stored["grids"]
    assert model_inputs["image_token_pooling"].tolist() == stored["pooling"]
    sums = checksums(model_inputs["pixel_values"])
    assert sums == pytest.approx(stored["patch_sums"], rel=1e-6, abs=1e-3)
    # Each image's span: from its <low_res_im_start> to its crops' <im_end>.
    for start, embeds in zip(prompt_images.starts, prompt_images.embeds, strict=True):
        assert ids[start] == LOW_START_ID and ids[start + len(embeds) - 1] == END_ID


def test_the_stored_inputs_are_the_processors_own(folder):
    pytest.importorskip("torchvision")
    live, stored = processor_record(folder), json.loads(STORED.read_text())
    assert live["patch_sums"] == pytest.approx(stored.pop("patch_sums"), rel=1e-6, abs=1e-3)
    assert {k: live[k] for k in stored} == stored


def test_features_logits_and_greedy_tokens_match_transformers(model, engine, prompt, model_inputs):
    ids, prompt_images = prompt
    patches = torch.tensor(ids) == PATCH_ID
    features = torch.cat(prompt_images.embeds)[
        torch.cat([torch.tensor(ids[a:b]) for a, b in prompt_images.spans()]) == PATCH_ID
    ]
    with torch.no_grad():
        expected = model.get_image_features(
            model_inputs["pixel_values"],
            model_inputs["image_token_pooling"],
            model_inputs["image_grids"],
            model_inputs["image_num_crops"],
        ).pooler_output
    torch.testing.assert_close(features, torch.cat(expected), atol=1e-4, rtol=0)
    assert int(patches.sum()) == len(features)
    with torch.no_grad():
        ours = engine.model(
            torch.tensor([ids]),
            torch.arange(len(ids))[None],
            images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
        )[0]
        theirs = model(**model_inputs).logits[0]
        out = model.generate(**model_inputs, max_new_tokens=8, do_sample=False)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    # Prefill chunks of the second image's start: the images are still fed together.
    chunk = prompt_images.starts[1]
    last = generate.prefill(engine.model, engine.new_state(128), ids, chunk, images=prompt_images)
    torch.testing.assert_close(last, theirs[-1], atol=1e-4, rtol=0)
    expected_tokens = out[0, len(ids) :].tolist()
    stream = engine.generate(ids, GREEDY, 8, images=prompt_images)
    assert [r.token for r in stream if r.token is not None] == expected_tokens
    assert len(expected_tokens) == 8


def test_keeping_the_overlaps_or_causal_image_tokens_fails(
    model, engine, images, prompt, model_inputs, monkeypatch
):
    ids, prompt_images = prompt
    with torch.no_grad():
        theirs = model(**model_inputs).logits[0]
    with monkeypatch.context() as patch:
        patch.setattr(molmo2_text.BlockImageTokens, "unmask", lambda self, frames, window: frames)
        with torch.no_grad():
            causal = engine.model(
                torch.tensor([ids]),
                torch.arange(len(ids))[None],
                images=prompt_images.tokens(0, len(ids), torch.device("cpu")),
            )[0]
    assert (causal - theirs).abs().max() > 1e-2
    engine.vision.margins, kept = (0, 0), engine.vision.margins
    try:
        overlapping = molmo2_images.inputs(engine.vision, images[0])[1]
    finally:
        engine.vision.margins = kept
    assert overlapping.tolist() != json.loads(STORED.read_text())["pooling"][: len(overlapping)]


def test_image_places_must_match_the_images(engine, images):
    with pytest.raises(UsageError, match=r"marks 1 image place \(<\|image\|>\) for 2"):
        engine.image_prompt("user:<|image|>two?", images)
    with pytest.raises(UsageError, match="image tokens .* of its own"):
        engine.image_prompt("user:<|image|><|image|><im_patch>?", images)


def test_run_chat_and_serve_with_an_image_reply_as_transformers(model, folder, engine, tmp_path):
    """`llmrun run MODEL --image PATH "prompt"`, `chat`'s /image and serve's image parts give
    transformers' greedy tokens; text alone runs the language model with a note."""
    image = tmp_path / "cat.png"
    image.write_bytes(picture(*IMAGES[0]))
    opened = open_image(image.read_bytes())
    ids, _ = engine.image_prompt(engine.prompt_text(QUESTION, images=1), [opened])
    patches, pooling = molmo2_images.inputs(engine.vision, opened)
    grid = molmo2_images.grid(engine.vision, opened.height, opened.width)
    image_ids = torch.tensor([PATCH_ID, COL_ID, START_ID, LOW_START_ID, END_ID])
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            pixel_values=patches,
            image_token_pooling=pooling,
            image_grids=torch.tensor([grid]),
            image_num_crops=torch.tensor([len(patches)]),
            mm_token_type_ids=torch.isin(torch.tensor([ids]), image_ids).long(),
            max_new_tokens=8,
            do_sample=False,
        )
    expected = out[0, len(ids) :].tolist()
    check_run_chat_and_serve_with_an_image(engine, folder, image, QUESTION, expected, "Molmo 2")


def test_a_processor_that_does_not_fit_the_tower_is_one_error_line(folder, tmp_path):
    import shutil

    other = shutil.copytree(folder, tmp_path / "odd")
    (other / "preprocessor_config.json").write_text(json.dumps({**PROCESSOR, "patch_size": 5}))
    image = tmp_path / "cat.png"
    image.write_bytes(picture(*IMAGES[1]))
    result = llmrun("run", other, "--image", image, "hi", "-n", "1")
    assert result.returncode != 0
    assert result.stderr.startswith("error: ") and "do not fit the vision tower" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def recut_tables(folder: Path, path: Path, rows: int) -> Path:
    """A copy of `folder` whose wte.embedding holds the first `rows` rows of the joined
    table and wte.new_embedding the rest (AI2's files cut at the base vocabulary)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, path)
    file = path / "model.safetensors"
    tensors = load_file(file)
    wte = "model.transformer.wte."
    joined = torch.cat([tensors[wte + "embedding"], tensors[wte + "new_embedding"]])
    tensors[wte + "embedding"], tensors[wte + "new_embedding"] = joined[:rows], joined[rows:]
    save_file({k: t.contiguous() for k, t in tensors.items()}, file, metadata={"format": "pt"})
    return path


def test_the_model_holds_the_checkpoints_two_tables_without_a_copy(model, folder, tmp_path):
    """save_pretrained cuts the 520 rows in halves; the loaded model reads the file's
    tables where they are mapped (f32 as they are, bf16 as raw 2-byte blocks)."""
    half = copy.deepcopy(model).to(torch.bfloat16)
    for files in (folder, save_folder(half, tmp_path / "bf16")):
        loaded = loader.load_model(files, torch.device("cpu"), "f32")
        tables = loaded.model.model.embed_tokens
        for name in ("embedding", "new_embedding"):
            held = getattr(tables, name)
            mapped = loaded.checkpoint.weights[f"model.embed_tokens.{name}.weight"].tensor
            assert held.weight.data_ptr() == mapped.data_ptr()
            assert held.num_embeddings == 260
            if files != folder:
                assert kernels.supports(T.BF16, 64) and isinstance(held, QuantEmbedding)
        shapes = [tuple(t.shape) for t in loaded.model.state_dict().values()]
        assert (520, 64) not in shapes


def test_ids_on_both_sides_of_the_boundary_embed_as_transformers(model, engine, folder, tmp_path):
    """Both cuts of the tables (the halves, AI2's base vocabulary then image tokens):
    the ids around each cut and the ends embed as transformers' joined table does."""
    ids = torch.tensor([[0, 259, 260, 261, 511, 512, 513, 519]])
    with torch.no_grad():
        theirs = model.get_input_embeddings()(ids)
        assert torch.equal(engine.model.embed(ids), theirs)
        ai2 = api.load(str(recut_tables(folder, tmp_path / "ai2", 512)), device="cpu")
        assert ai2.model.model.embed_tokens.new_embedding.num_embeddings == 8
        assert torch.equal(ai2.model.embed(ids), theirs)
        text = torch.tensor([engine.tokenizer.encode("user:" + QUESTION)])
        positions = torch.arange(text.shape[1])[None]
        torch.testing.assert_close(
            ai2.model(text, positions)[0], model(input_ids=text).logits[0], atol=1e-4, rtol=0
        )


def test_olmo_attention_and_norms_after_match_transformers(tmp_path):
    """Molmo 2's OLMo-like text (Molmo2-O: q/k norms over the whole projection, the norms
    after each sublayer, q/k/v biases), text alone, against transformers' logits."""
    config = tiny_model().config
    config.text_config.qk_norm_type, config.text_config.norm_after = "olmo", True
    config.text_config.attention_bias = True
    torch.manual_seed(1)
    model = transformers.Molmo2ForConditionalGeneration(config).eval()
    randomize(model)
    engine = api.load(str(save_folder(model, tmp_path / "olmo")), device="cpu")
    ids = engine.tokenizer.encode("user:What is in these pictures?\nassistant:")
    with torch.no_grad():
        ours = engine.model(torch.tensor([ids]), torch.arange(len(ids))[None])[0]
        theirs = model(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
