"""Prompts with audio, for OmniASR (Omnilingual ASR's LLM models): each audio place the
chat template marks (one <extra_id_1>) expanded into a placeholder per encoder frame, as
OmniASRProcessor counts them over the clip's samples (50 a second), and the clips encoded
from their samples, normalized as OmniASRFeatureExtractor does (zero mean and unit
variance over the clip, the variance biased and 1e-5 added under the root).

A transcription's prompt is OmniASRProcessor.apply_transcription_request's: the chat
template (the checkpoint's own) of a user turn of the clip and, where given, its language
as a {"type": "language"} part, with the generation prompt. A language is an ISO 639-1
code (en) or one of the model's codes (eng_Latn), lower-cased and checked against the
vocabulary's <|lang:CODE|> tokens as the processor does (`auto`: its language-agnostic
mode, also the default).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from llmrun import audio, qwen2_audio_clips
from llmrun.errors import TokenizerError, UsageError
from llmrun.loading.omniasr import OmniASRAudio
from llmrun.multimodal import PromptImages
from llmrun.tokenizer import Tokenizer

AUDIO = "<extra_id_1>"
EPSILON = 1e-5  # OmniASRFeatureExtractor's, inside the square root
# OmniASRProcessor's ISO 639-1 codes of the languages that have one -> the model's codes.
ISO_639_1 = dict(
    pair.split(":")
    for pair in (
        "ab:abk_cyrl af:afr_latn ak:aka_latn am:amh_ethi an:arg_latn ar:arb_arab as:asm_beng "
        "av:ava_cyrl ay:ayr_latn az:aze_latn ba:bak_cyrl be:bel_cyrl bg:bul_cyrl bi:bis_latn "
        "bm:bam_latn bn:ben_beng bo:bod_tibt br:bre_latn bs:bos_latn ca:cat_latn ce:che_cyrl "
        "cs:ces_latn cv:chv_cyrl cy:cym_latn da:dan_latn de:deu_latn dv:div_thaa dz:dzo_tibt "
        "ee:ewe_latn el:ell_grek en:eng_latn eo:epo_latn es:spa_latn et:ekk_latn eu:eus_latn "
        "fa:fas_arab ff:ful_latn fi:fin_latn fj:fij_latn fo:fao_latn fr:fra_latn fy:fry_latn "
        "ga:gle_latn gl:glg_latn gn:grn_latn gu:guj_gujr gv:glv_latn ha:hau_latn he:heb_hebr "
        "hi:hin_deva hr:hrv_latn ht:hat_latn hu:hun_latn hy:hye_armn hz:her_latn ia:ina_latn "
        "id:ind_latn ig:ibo_latn ik:ipk_latn is:isl_latn it:ita_latn ja:jpn_jpan jv:jav_latn "
        "ka:kat_geor ki:kik_latn kj:kua_latn kk:kaz_cyrl km:khm_khmr kn:kan_knda ko:kor_hang "
        "kr:knc_latn ks:kas_arab ku:kur_arab kv:kpv_cyrl kw:cor_latn ky:kir_cyrl la:lat_latn "
        "lb:ltz_latn lg:lug_latn ln:lin_latn lo:lao_laoo lt:lit_latn lv:lav_latn mg:mlg_latn "
        "mh:mah_latn mi:mri_latn mk:mkd_cyrl ml:mal_mlym mn:mon_cyrl mr:mar_deva ms:zsm_latn "
        "mt:mlt_latn my:mya_mymr nb:nob_latn ne:nep_deva ng:ndo_latn nl:nld_latn nn:nno_latn "
        "no:nob_latn ny:nya_latn oc:oci_latn om:orm_latn or:ory_orya os:oss_cyrl pa:pan_guru "
        "pl:pol_latn ps:pus_arab pt:por_latn rn:run_latn ro:ron_latn ru:rus_cyrl rw:kin_latn "
        "sc:srd_latn sd:snd_arab sg:sag_latn si:sin_sinh sk:slk_latn sl:slv_latn sm:smo_latn "
        "sn:sna_latn so:som_latn sq:als_latn sr:srp_cyrl su:sun_latn sv:swe_latn sw:swh_latn "
        "ta:tam_taml te:tel_telu tg:tgk_cyrl th:tha_thai ti:tir_ethi tk:tuk_latn tl:tgl_latn "
        "tn:tsn_latn tr:tur_latn ts:tso_latn tt:tat_cyrl tw:twi_latn ug:uig_arab uk:ukr_cyrl "
        "ur:urd_arab uz:uzb_latn vi:vie_latn wo:wol_latn xh:xho_latn yi:ydd_hebr yo:yor_latn "
        "za:zyb_latn zh:cmn_hans zu:zul_latn"
    ).split()
)


def clip_tokens(encoder: OmniASRAudio, clip: audio.Clip) -> int:
    """The <extra_id_1> tokens a clip takes, one per encoder frame; a clip too short for
    one is refused."""
    tokens = encoder.encoder.args.frames(len(clip.samples))
    if tokens < 1:
        raise UsageError(f"{clip.name}: {len(clip.samples)} samples, too short for OmniASR")
    return tokens


def normalized(samples: torch.Tensor) -> torch.Tensor:
    """A clip's samples at zero mean and unit variance, as OmniASRFeatureExtractor has them."""
    mean = samples.mean()
    variance = ((samples - mean) ** 2).mean()
    return (samples - mean) / torch.sqrt(variance + EPSILON)


@torch.inference_mode()
def encode(encoder: OmniASRAudio, clips: Sequence[audio.Clip]) -> list[torch.Tensor]:
    """Each clip's token embeddings [clip_tokens, text hidden]."""
    out = []
    for clip in clips:
        clip_tokens(encoder, clip)  # refuses a clip too short
        samples = torch.tensor(clip.samples, dtype=torch.float32)
        out.append(encoder.encoder(normalized(samples)))
    return out


def prompt(
    tokenizer: Tokenizer, text: str, embeds: Sequence[torch.Tensor]
) -> tuple[list[int], PromptImages]:
    """The ids of `text` with each <extra_id_1> repeated for its clip's tokens, and the
    clips as generate() takes them. The text must mark exactly one place per clip."""
    return qwen2_audio_clips.prompt(tokenizer, text, embeds, pad=AUDIO)


def language_code(tokenizer: Tokenizer, language: str) -> str:
    """The model's code of a language (OmniASRProcessor._resolve_language): lower-cased,
    an ISO 639-1 code mapped, and refused where the vocabulary has no <|lang:CODE|>."""
    code = language.lower()
    code = ISO_639_1.get(code, code)
    if tokenizer.token_id(f"<|lang:{code}|>") is None:
        raise UsageError(
            f"language {language!r}: the model has no <|lang:{code}|> token; give an ISO "
            "639-1 code (en), one of its language codes (eng_Latn), or auto"
        )
    return code


def transcription(
    tokenizer: Tokenizer,
    render: Callable[..., str],
    language: str | None,
    context: str | None = None,
) -> str:
    """A transcription request's prompt text: the chat template (`render`, asked for the
    generation prompt) of a user turn of the clip and, where given, its language."""
    if tokenizer.token_id(AUDIO) is None:
        raise TokenizerError(f"the tokenizer has no {AUDIO}: not OmniASR's")
    content: list[dict[str, str]] = [{"type": "audio"}]
    if language is not None:
        content.append({"type": "language", "language": language_code(tokenizer, language)})
    return render([{"role": "user", "content": content}], add_generation_prompt=True)
