"""A tiny random Fun-ASR-Nano (FunAsrNanoForConditionalGeneration: a Qwen3 under SenseVoice's
SAN-M encoder and a Transformer adaptor) for the audio and transcription tests: as a Hugging
Face folder (save_pretrained's layout, stories260K's tokenizer plus Qwen's chat tokens and
<|object_ref_start|>, the chat template transformers' converter writes), and transformers'
FunAsrNanoProcessor for it.

FunAsrNanoFeatureExtractor needs torchaudio, whose PyPI wheel does not load beside a CPU
build of torch: the processor here takes an extractor of the same frames, Kaldi's fbank by
kaldi-native-fbank (k2-fsa's implementation of Kaldi's, which FunASR's own runtime uses)
stacked by the extractor's own _apply_lfr, read from transformers' source file.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import torch
from helpers import STORIES_HF, randomize

# Ids 512 on, after stories260K's 512 tokens.
FUN_TOKENS = ("<|im_start|>", "<|im_end|>", "<|object_ref_start|>")
IM_START, IM_END, AUDIO = range(512, 515)
VOCAB = 515
# transformers' convert_fun_asr_nano_to_hf.py CHAT_TEMPLATE (the Hub checkpoint's).
TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% set audio_items = message['content'] | selectattr('type', 'equalto', 'audio') | list %}"
    "{% if message['role'] == 'user' and audio_items %}"
    "{% set text_items = message['content'] | selectattr('type', 'equalto', 'text') | list %}"
    "{% set keyword_items = message['content'] | selectattr('type', 'equalto', 'keywords') | list %}"
    "{% set language_items = message['content'] | selectattr('type', 'equalto', 'language') | list %}"
    "{% if text_items or keyword_items %}"
    "请结合上下文信息，更加准确地完成语音转写任务。如果没有相关信息，我们会留空。\n\n\n"
    "**上下文信息：**\n\n\n"
    "{% for item in text_items %}{{ item['text'] }}\n{% endfor %}"
    "{% set keyword_namespace = namespace(items=[]) %}"
    "{% for item in keyword_items %}"
    "{% set keyword_namespace.items = keyword_namespace.items + item['keywords'] %}"
    "{% endfor %}"
    "{% if keyword_namespace.items %}"
    "热词列表：[{{ keyword_namespace.items | join(', ') }}]\n"
    "{% endif %}"
    "{% endif %}"
    "语音转写{% if language_items %}成{{ language_items[0]['language'] }}{% endif %}："
    "{% for content in audio_items %}<|object_ref_start|>{% endfor %}"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'audio' %}"
    "<|object_ref_start|>"
    "{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant\n"
    "{% endif %}"
)
TEXT = dict(
    model_type="qwen3",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    eos_token_id=IM_END,
)
# Three layers, the second the last transcription one (both it and the last normalized);
# positions for 400 tokens (24 seconds), so that a longer clip is refused.
AUDIO_CONFIG = dict(
    model_type="fun_asr_nano_encoder",
    hidden_size=32,
    num_attention_heads=2,
    intermediate_size=48,
    num_hidden_layers=3,
    num_timestamp_prediction_layers=1,
    max_position_embeddings=401,
)
ADAPTOR_CONFIG = dict(
    hidden_size=64,
    intermediate_size=16,
    num_attention_heads=4,
    num_hidden_layers=2,
    projector_hidden_size=48,
)
PROCESSOR = {
    "feature_extractor_type": "FunAsrNanoFeatureExtractor",
    "feature_size": 80,
    "sampling_rate": 16000,
    "frame_length": 25,
    "frame_shift": 10,
    "num_frames_lfr": 7,
    "stride_lfr": 6,
    "window": "hamming",
    "padding_value": 0.0,
    "return_attention_mask": True,
}


def tiny_fun_asr_nano(seed: int = 0):
    """A random transformers FunAsrNanoForConditionalGeneration of TEXT, AUDIO_CONFIG and
    ADAPTOR_CONFIG."""
    import transformers

    config = transformers.FunAsrNanoConfig(
        text_config=TEXT,
        audio_config=AUDIO_CONFIG,
        adaptor_config=ADAPTOR_CONFIG,
        audio_token_id=AUDIO,
    )
    torch.manual_seed(seed)
    model = transformers.FunAsrNanoForConditionalGeneration(config).eval()
    randomize(model)
    return model


def save_fun_asr_nano_dir(model, path: Path) -> Path:
    """The model's folder, as save_pretrained writes it, with the tokenizer files and
    PROCESSOR."""
    model.save_pretrained(path)
    tok = json.loads((STORIES_HF / "tokenizer.json").read_text())
    tok["post_processor"] = None  # Qwen's tokenizer adds no BOS
    for i, content in enumerate(FUN_TOKENS, start=512):
        added = dict(id=i, content=content, single_word=False, lstrip=False, rstrip=False)
        tok["added_tokens"].append({**added, "normalized": False, "special": True})
    (path / "tokenizer.json").write_text(json.dumps(tok))
    tok_config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return path


def transformers_lfr():
    """FunAsrNanoFeatureExtractor._apply_lfr, from transformers' source file (the module
    itself does not import without torchaudio): (extractor settings, fbank) -> stacked."""
    import transformers.models.fun_asr_nano as package

    source = Path(package.__file__).with_name("feature_extraction_fun_asr_nano.py")
    tree = ast.parse(source.read_text())
    extractor = next(
        node
        for node in tree.body
        if isinstance(node, ast.ClassDef) and node.name == "FunAsrNanoFeatureExtractor"
    )
    method = next(
        node
        for node in extractor.body
        if isinstance(node, ast.FunctionDef) and node.name == "_apply_lfr"
    )
    namespace = {"torch": torch}
    exec(compile(ast.Module([method], []), str(source), "exec"), namespace)
    return namespace["_apply_lfr"]


def kaldi_fbank(samples: np.ndarray) -> torch.Tensor:
    """Kaldi's fbank [frames, 80] of 16 kHz samples with the extractor's settings, by
    kaldi-native-fbank."""
    import kaldi_native_fbank as knf

    options = knf.FbankOptions()
    options.frame_opts.dither = 0.0
    options.frame_opts.window_type = "hamming"
    options.mel_opts.num_bins = 80
    options.mel_opts.high_freq = 0.0
    fbank = knf.OnlineFbank(options)
    fbank.accept_waveform(16000, np.asarray(samples, dtype=np.float32).tolist())
    fbank.input_finished()
    return torch.tensor(np.stack([fbank.get_frame(i) for i in range(fbank.num_frames_ready)]))


def processor(folder: Path):
    """transformers' FunAsrNanoProcessor for the folder, its extractor's frames computed as
    the module docstring says."""
    import transformers
    from transformers.feature_extraction_sequence_utils import SequenceFeatureExtractor

    lfr = transformers_lfr()

    class Extractor(SequenceFeatureExtractor):
        model_input_names = ["input_features", "input_features_mask"]
        num_frames_lfr, stride_lfr = 7, 6

        def __call__(self, raw_speech, **kwargs):
            clips = raw_speech if isinstance(raw_speech, list) else [raw_speech]
            rows = [lfr(self, kaldi_fbank(clip)) for clip in clips]
            longest = max(len(r) for r in rows)
            features = torch.zeros(len(rows), longest, rows[0].shape[1])
            mask = torch.zeros(len(rows), longest, dtype=torch.long)
            for i, r in enumerate(rows):
                features[i, : len(r)], mask[i, : len(r)] = r, 1
            return transformers.BatchFeature(
                {"input_features": features, "input_features_mask": mask}
            )

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    extractor = Extractor(feature_size=80, sampling_rate=16000, padding_value=0.0)
    return transformers.FunAsrNanoProcessor(
        feature_extractor=extractor, tokenizer=tokenizer, chat_template=TEMPLATE
    )
