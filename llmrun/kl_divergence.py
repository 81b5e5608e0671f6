"""llama-perplexity's KL-divergence pair: a base model's log-probabilities saved over a
text's chunks, then another model (a quantization of it) scored on the same tokens and
compared with them, token by token.

The base file is a safetensors file (an 8-byte header length, a JSON header, raw
tensors), written here and read back through llmrun's own validated reader, memory-mapped
and never unpickled: `tokens` I32 [N, ctx], the chunks as evaluated (see
llmrun.perplexity), and `log_probs` F16 [N, ctx - 1 - ctx // 2, vocab], every token's
log-probability at each scored position (llama.cpp stores them in 16 bits too, as
levels of each row's range; f16 keeps the likely tokens more exactly), each row
renormalized when read back. Its metadata names the format, the context and the
tokenizer (a digest of every token's bytes), so a comparison through another tokenizer
or vocabulary is refused.

The statistics are llama.cpp's: PPL of both models and their ratio, the mean and
percentiles of the KL divergence of the model's distribution from the base's (every
token whose base probability is not zero counted: llama.cpp drops those under e^-16),
of Δp (the model's probability of the right token minus the base's), and how often both
rank the same token first.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from llmrun import perplexity
from llmrun.errors import LlmrunError, ModelFormatError, UsageError
from llmrun.loading.safetensors_io import load_tensors, read_header_metadata
from llmrun.perplexity import Estimate, NewCache
from llmrun.tokenizer import Tokenizer

FORMAT = "llmrun-kl-divergence-base/1"
# KLD and Δp percentiles reported, as llama-perplexity lists them (Δp adds 75 and 25).
KLD_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 10.0, 5.0, 1.0, 0.1)
DELTA_P_PERCENTILES = (99.9, 99.0, 95.0, 90.0, 75.0, 25.0, 10.0, 5.0, 1.0, 0.1)


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    """A SHA-256 of the tokenizer's vocabulary (every token's bytes, in id order) and its
    BOS: the same for the same tokenizer read from a GGUF or a model folder."""
    digest = hashlib.sha256()
    for i in range(tokenizer.vocab_size):
        piece = tokenizer.token_bytes(i)
        digest.update(struct.pack("<I", len(piece)) + piece)
    digest.update(struct.pack("<q", -1 if tokenizer.bos_id is None else tokenizer.bos_id))
    return digest.hexdigest()


class BaseWriter:
    """Writes a base file chunk by chunk: to NAME.part, renamed to NAME once every chunk
    is in, so an interrupted run leaves no file that looks complete."""

    def __init__(self, path: Path, chunks: torch.Tensor, tokenizer: Tokenizer, model: str) -> None:
        self.path = path
        self.part = path.with_name(path.name + ".part")
        self.chunks = chunks
        self.metadata = {
            "format": FORMAT,
            "ctx": str(chunks.shape[1]),
            "tokenizer": tokenizer_digest(tokenizer),
            "model": model,
        }
        self.written = 0
        try:
            self.file = open(self.part, "wb")
        except OSError as e:
            raise UsageError(f"--kl-divergence-base {path}: {e.strerror or e}") from None

    def _start(self, vocab: int) -> None:
        """The header (the vocabulary is known at the first chunk's log-probs), then the tokens."""
        count, ctx = self.chunks.shape
        scored = ctx - 1 - ctx // 2
        tokens_bytes = count * ctx * 4
        header: dict[str, Any] = {
            "__metadata__": self.metadata,
            "tokens": {"dtype": "I32", "shape": [count, ctx], "data_offsets": [0, tokens_bytes]},
            "log_probs": {
                "dtype": "F16",
                "shape": [count, scored, vocab],
                "data_offsets": [tokens_bytes, tokens_bytes + count * scored * vocab * 2],
            },
        }
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # tensors start 8-byte aligned
        self.file.write(struct.pack("<Q", len(text)) + text)
        self.file.write(self.chunks.to(torch.int32).numpy().astype("<i4").tobytes())

    def add(self, logprobs: torch.Tensor) -> None:
        """The next chunk's scored log-probabilities [ctx - 1 - ctx // 2, vocab]."""
        if self.written == 0:
            self._start(logprobs.shape[-1])
        self.file.write(logprobs.to(torch.float16).cpu().numpy().astype("<f2").tobytes())
        self.written += 1

    def close(self) -> None:
        """Finish the file where every chunk was written, else remove the partial one."""
        self.file.close()
        if self.written == len(self.chunks):
            os.replace(self.part, self.path)
        else:
            self.part.unlink(missing_ok=True)


def save_base(
    model: nn.Module,
    new_cache: NewCache,
    tokenizer: Tokenizer,
    chunks: torch.Tensor,
    path: Path,
    name: str,
    batch_size: int = perplexity.DEFAULT_BATCH,
) -> Iterator[Estimate]:
    """perplexity.measure's running estimates, saving each chunk's log-probs to `path`
    (the model named `name` in its metadata)."""
    writer = BaseWriter(path, chunks, tokenizer, name)
    try:
        logprobs = perplexity.scored_logprobs(model, new_cache, chunks, batch_size)
        yield from perplexity.estimates(_saved(logprobs, writer), chunks)
    finally:
        writer.close()


def _saved(logprobs: Iterator[torch.Tensor], writer: BaseWriter) -> Iterator[torch.Tensor]:
    for chunk_logprobs in logprobs:
        writer.add(chunk_logprobs)
        yield chunk_logprobs


@dataclass
class Base:
    """A base file read back: the chunks [N, ctx] and their scored log-probs [N, S, vocab]
    (float16, memory-mapped)."""

    path: Path
    chunks: torch.Tensor
    log_probs: torch.Tensor
    model: str

    @property
    def ctx(self) -> int:
        return self.chunks.shape[1]


def base_ctx(path: Path) -> int:
    """The context a base file was computed with (its header alone is read)."""
    _, metadata, _ = _header(path)
    return _ctx(metadata, path)


def _header(path: Path) -> tuple[dict[str, Any], dict[str, Any], int]:
    if not path.is_file():
        raise UsageError(f"--kl-divergence-base {path}: no such file")
    try:
        header, metadata, start = read_header_metadata(path)
    except LlmrunError as e:
        raise ModelFormatError(f"not a base file of log-probabilities: {e}") from None
    if metadata.get("format") != FORMAT:
        raise ModelFormatError(
            f"{path}: not a base file of llmrun's log-probabilities (write one with "
            "`llmrun perplexity BASE_MODEL -f TEXT --kl-divergence-base FILE`)"
        )
    return header, metadata, start


def _ctx(metadata: dict[str, Any], path: Path) -> int:
    ctx = metadata.get("ctx")
    if not (isinstance(ctx, str) and ctx.isdigit() and int(ctx) >= perplexity.MIN_CTX):
        raise ModelFormatError(f"{path}: its context {ctx!r} is not a number of tokens")
    return int(ctx)


def read_base(path: Path, tokenizer: Tokenizer) -> Base:
    """The base file at `path`, refused where its tokenizer is not `tokenizer` or its
    tensors do not fit one another."""
    header, metadata, _ = _header(path)
    ctx = _ctx(metadata, path)
    if metadata.get("tokenizer") != tokenizer_digest(tokenizer):
        raise UsageError(
            f"{path} was computed with another tokenizer (vocabulary) than this model's: "
            "the two models must share one to be compared"
        )
    tokens, log_probs = header.get("tokens"), header.get("log_probs")
    if (
        set(header) != {"tokens", "log_probs"}
        or tokens["dtype"] != "I32"
        or log_probs["dtype"] != "F16"
        or len(tokens["shape"]) != 2
        or len(log_probs["shape"]) != 3
    ):
        raise ModelFormatError(f"{path}: expected tensors tokens (I32) and log_probs (F16)")
    count, scored = tokens["shape"][0], ctx - 1 - ctx // 2
    if tokens["shape"] != [count, ctx] or log_probs["shape"][:2] != [count, scored] or count < 1:
        raise ModelFormatError(
            f"{path}: tokens {tokens['shape']} and log_probs {log_probs['shape']} do not "
            f"fit a context of {ctx}"
        )
    tensors = load_tensors(path)
    chunks = tensors["tokens"].long()
    if not bool(((chunks >= 0) & (chunks < tokenizer.vocab_size)).all()):
        raise ModelFormatError(f"{path}: token ids outside the vocabulary")
    return Base(path, chunks, tensors["log_probs"], metadata.get("model", "?"))


def _mean_and_error(total: float, squares: float, count: int) -> tuple[float, float]:
    """llama-perplexity's mean and uncertainty: the error 0 up to 10 values."""
    mean, error = perplexity.mean_and_error(total, squares, count)
    return mean, error if error is not None and count > 10 else 0.0


def _covariance(a: float, b: float, ab: float, count: int) -> float:
    """The covariance of two means from the sums (llama-perplexity's; 0 under 10 values)."""
    if count < 10:
        return 0.0
    return (ab / count - (a / count) * (b / count)) / (count - 1)


class Divergence:
    """Running sums of a model's scored tokens against the base's."""

    def __init__(self) -> None:
        self.count = 0
        self.same_top = 0
        self.sums = dict.fromkeys(
            ("nll", "nll2", "base", "base2", "nll_base", "kld", "kld2", "dp", "dp2", "dp4"), 0.0
        )
        self.kld_values: list[np.ndarray] = []
        self.dp_values: list[np.ndarray] = []

    def add(self, logprobs: torch.Tensor, base: torch.Tensor, targets: torch.Tensor) -> None:
        """A chunk's log-probs [S, vocab] (the model's, the base's) and its targets [S]."""
        # Renormalized: the f16 values' rounding leaves them summing to 1 +- 1e-3, which
        # gave a model compared with itself KLDs of +-3e-4 a token; renormalized, under 1e-6.
        base = torch.log_softmax(base.to(logprobs.device, torch.float32), dim=-1)
        nll = perplexity.nll(logprobs, targets).double()
        nll_base = perplexity.nll(base, targets).double()
        p_base = base.exp()
        # 0 * (-inf) where the base gives a token no chance: that token adds nothing.
        kld = torch.where(p_base > 0, p_base * (base - logprobs), 0.0).sum(-1).double()
        dp = torch.exp(-nll) - torch.exp(-nll_base)
        self.count += nll.numel()
        self.same_top += int((logprobs.argmax(-1) == base.argmax(-1)).sum())
        for key, value in (
            ("nll", nll),
            ("nll2", nll * nll),
            ("base", nll_base),
            ("base2", nll_base * nll_base),
            ("nll_base", nll * nll_base),
            ("kld", kld),
            ("kld2", kld * kld),
            ("dp", dp),
            ("dp2", dp * dp),
            ("dp4", dp**4),
        ):
            self.sums[key] += float(value.sum())
        self.kld_values.append(kld.float().cpu().numpy())
        self.dp_values.append(dp.float().cpu().numpy())

    def _ppl(self, key: str) -> tuple[float, float, float]:
        """ln PPL's mean and error, and PPL (of the model, or of the base)."""
        mean, error = _mean_and_error(self.sums[key], self.sums[key + "2"], self.count)
        return mean, error, math.exp(mean)

    def running(self) -> dict[str, float]:
        """llama-perplexity's per-chunk line: PPL, ln(PPL(Q)/PPL(base)), KLD, RMS Δp and
        the same top token's share, each with its error."""
        s, n = self.sums, self.count
        ln_q, ln_q_error, ppl = self._ppl("nll")
        ln_base, ln_base_error, _ = self._ppl("base")
        covariance = _covariance(s["nll"], s["base"], s["nll_base"], n)
        kld, kld_error = _mean_and_error(s["kld"], s["kld2"], n)
        mse, mse_error = _mean_and_error(s["dp2"], s["dp4"], n)
        rms = math.sqrt(mse)
        same = self.same_top / n
        return {
            "ppl": ppl,
            "ppl_error": ppl * ln_q_error,
            "ln_ppl_ratio": ln_q - ln_base,
            "ln_ppl_ratio_error": math.sqrt(
                max(ln_q_error**2 + ln_base_error**2 - 2 * covariance, 0.0)
            ),
            "kld": kld,
            "kld_error": kld_error,
            "rms_delta_p": rms,
            "rms_delta_p_error": 0.5 / rms * mse_error if rms > 0 else 0.0,
            "same_top_p": same,
            "same_top_p_error": math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0,
        }

    def summary(self) -> dict[str, Any]:
        """The final statistics, as llama-perplexity's three tables give them."""
        s, n = self.sums, self.count
        row = self.running()
        ln_q, ln_q_error, ppl = self._ppl("nll")
        ln_base, ln_base_error, base_ppl = self._ppl("base")
        covariance = _covariance(s["nll"], s["base"], s["nll_base"], n)
        ratio = math.exp(row["ln_ppl_ratio"])
        base_error = base_ppl * ln_base_error
        kld = np.concatenate(self.kld_values)
        dp = np.concatenate(self.dp_values)
        dp_mean, dp_error = _mean_and_error(s["dp"], s["dp2"], n)
        errors = ln_q_error * ln_base_error
        return {
            "tokens": n,
            "ppl": ppl,
            "ppl_error": row["ppl_error"],
            "base_ppl": base_ppl,
            "base_ppl_error": base_error,
            "ln_ppl_correlation": covariance / errors if errors else None,
            "ln_ppl_ratio": row["ln_ppl_ratio"],
            "ln_ppl_ratio_error": row["ln_ppl_ratio_error"],
            "ppl_ratio": ratio,
            "ppl_ratio_error": ratio * row["ln_ppl_ratio_error"],
            "ppl_difference": ppl - base_ppl,
            "ppl_difference_error": math.sqrt(
                max(
                    row["ppl_error"] ** 2 + base_error**2 - 2 * ppl * base_ppl * covariance,
                    0.0,
                )
            ),
            "kld": {
                "mean": row["kld"],
                "error": row["kld_error"],
                "max": float(kld.max()),
                **_percentiles(kld, KLD_PERCENTILES),
                "median": float(np.median(kld)),
                "min": float(kld.min()),
            },
            "delta_p": {
                "mean": dp_mean,
                "error": dp_error,
                "max": float(dp.max()),
                **_percentiles(dp, DELTA_P_PERCENTILES),
                "median": float(np.median(dp)),
                "min": float(dp.min()),
                "rms": row["rms_delta_p"],
                "rms_error": row["rms_delta_p_error"],
            },
            "same_top_p": row["same_top_p"],
            "same_top_p_error": row["same_top_p_error"],
        }


def _percentiles(values: np.ndarray, points: tuple[float, ...]) -> dict[str, float]:
    """Linearly interpolated percentiles (llama-perplexity's rule), keyed "99.9%"."""
    return {f"{p}%": float(np.percentile(values, p)) for p in points}


@dataclass
class Step:
    """The comparison after `chunks` of `total` chunks."""

    chunks: int
    total: int
    divergence: Divergence


def compare(
    model: nn.Module,
    new_cache: NewCache,
    base: Base,
    limit: int | None = None,
    batch_size: int = perplexity.DEFAULT_BATCH,
) -> Iterator[Step]:
    """`model` scored on the base's chunks (the first `limit` of them) and compared with
    the base's log-probs, after each chunk."""
    if limit is not None and limit < 1:
        raise UsageError(f"--chunks must be positive, got {limit}")
    chunks = base.chunks[:limit]
    targets = perplexity.scored_targets(chunks)
    divergence = Divergence()
    logprobs = perplexity.scored_logprobs(model, new_cache, chunks, batch_size)
    for i, chunk_logprobs in enumerate(logprobs):
        if chunk_logprobs.shape[-1] != base.log_probs.shape[-1]:
            raise UsageError(
                f"{base.path} holds log-probs over {base.log_probs.shape[-1]} tokens, this "
                f"model's over {chunk_logprobs.shape[-1]}: the models must share a vocabulary"
            )
        divergence.add(chunk_logprobs, base.log_probs[i], targets[i])
        yield Step(i + 1, len(chunks), divergence)
