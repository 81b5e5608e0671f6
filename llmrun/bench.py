"""`llmrun bench`: prompt-processing and generation speed, memory and bandwidth, as records.

Tests follow llama-bench: ppP feeds P random token ids in chunks of the batch
size, tgN runs N single-token decode steps, ppP+tgN does both as one test, each
after D tokens already in the KV cache ("@ dD"). With a draft model (or prompt
lookup), tgN generates N tokens greedily by speculative decoding instead
(llmrun.speculative), and the record has the share of drafted tokens the model
accepted. Every test runs once as a
discarded warm-up, then `repetitions` times; the device is synchronized before
each timestamp and tokens/s counts only the test's own tokens. The records are
flat dicts (ui.py prints them), one per test, each carrying what is needed to
compare results from different machines.
"""

from __future__ import annotations

import gc
import platform
import random
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from gguf import Keys, LlamaFileType
from torch import nn

from llmrun import __version__, api, native
from llmrun.errors import UsageError
from llmrun.generate import KVState, Stats, decode, prefill, prefill_chunk
from llmrun.loading import gemma4_assistant, safetensors_io
from llmrun.loading.loader import Checkpoint
from llmrun.models import kv_cache_bytes
from llmrun.models.cache import BYTES_PER_VALUE
from llmrun.quant.linear import QuantEmbedding
from llmrun.quant.planes import PlanarLinear
from llmrun.sampling import Sampler, SamplingParams
from llmrun.speculative import DEFAULT_DRAFT_MAX

ROOFLINE_BYTES = 1 << 30  # far larger than any L3 cache, so the reads come from DRAM
ROOFLINE_REPEATS = 5
DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}  # as --dtype

Progress = Callable[[str, int], None]  # (what is running now, runs just finished)


@dataclass(frozen=True)
class Test:
    n_prompt: int
    n_gen: int
    n_depth: int
    n_batch: int | None  # None: generate.prefill_chunk's
    threads: int | None

    @property
    def name(self) -> str:
        parts = [f"pp{self.n_prompt}"] if self.n_prompt else []
        parts += [f"tg{self.n_gen}"] if self.n_gen else []
        depth = f" @ d{self.n_depth}" if self.n_depth else ""
        return "+".join(parts) + depth

    @property
    def positions(self) -> int:
        return self.n_depth + self.n_prompt + self.n_gen


@dataclass
class BenchOptions:
    n_prompt: list[int]
    n_gen: list[int]
    pg: list[tuple[int, int]]
    depths: list[int]
    batches: list[int | None]  # None: as run feeds a prompt (generate.prefill_chunk)
    threads: list[int | None]
    repetitions: int = 5
    device: str = "auto"
    dtype: str = "auto"
    roofline: bool = False
    cache_type: str | None = None  # --cache-type (None: the compute dtype)
    activations: str = "f32"  # --activations
    lora: list[tuple[str, float]] = field(default_factory=list)  # --lora/--lora-scaled
    draft: str | None = None  # --draft: a draft model for the tg tests
    draft_max: int = DEFAULT_DRAFT_MAX  # --draft-max
    lookup: int | None = None  # --lookup: tokens drafted a step by prompt lookup

    @classmethod
    def from_flags(
        cls,
        n_prompt: str,
        n_gen: str,
        pg: list[str],
        n_depth: str,
        batch_size: str,
        threads: str | None,
        repetitions: int,
        device: str,
        dtype: str,
        roofline: bool,
        cache_type: str | None = None,
        activations: str = "f32",
        lora: list[tuple[str, float]] | None = None,
        draft: str | None = None,
        draft_max: int | None = None,
        lookup: int | None = None,
    ) -> BenchOptions:
        """Options from `llmrun bench`'s flags as typed (comma lists), validated."""
        options = cls(
            n_prompt=parse_ints("-p/--n-prompt", n_prompt),
            n_gen=parse_ints("-n/--n-gen", n_gen),
            pg=[parse_pg(text) for text in pg],
            depths=parse_ints("-d/--n-depth", n_depth),
            batches=[None] if batch_size == "auto" else parse_ints("-b/--batch-size", batch_size),
            threads=parse_ints("-t/--threads", threads) if threads else [None],
            repetitions=repetitions,
            device=device,
            dtype=dtype,
            roofline=roofline,
            cache_type=cache_type,
            activations=activations,
            lora=lora or [],
            draft=draft,
            draft_max=DEFAULT_DRAFT_MAX if draft_max is None else draft_max,
            lookup=lookup,
        )
        if draft is None and draft_max is not None:
            raise UsageError("--draft-max goes with --draft")
        options.validate()
        return options

    def tests(self) -> list[Test]:
        """Every test, in llama-bench's order: threads, batch, depth, then pp, tg, pg."""
        sizes = [(p, 0) for p in self.n_prompt if p] + [(0, n) for n in self.n_gen if n]
        sizes += self.pg
        return [
            Test(p, n, d, b, t)
            for t in self.threads
            for b in self.batches
            for d in self.depths
            for p, n in sizes
        ]

    def validate(self) -> None:
        checks = [
            ("-p/--n-prompt", self.n_prompt, 0),
            ("-n/--n-gen", self.n_gen, 0),
            ("-d/--n-depth", self.depths, 0),
            ("-b/--batch-size", [b for b in self.batches if b is not None], 1),
            ("-t/--threads", [t for t in self.threads if t is not None], 1),
        ]
        for flag, values, low in checks:
            bad = [v for v in values if v < low]
            if bad:
                raise UsageError(f"{flag} must be at least {low}, got {bad[0]}")
        for p, n in self.pg:
            if p < 1 or n < 1:
                raise UsageError(f"--pg needs a positive prompt and generation length, got {p},{n}")
        if self.draft_max < 1:
            raise UsageError(f"--draft-max must be at least 1, got {self.draft_max}")
        if self.lookup is not None and self.lookup < 1:
            raise UsageError(f"--lookup must be at least 1, got {self.lookup}")
        if self.lookup is not None and self.draft is not None:
            raise UsageError("--draft and --lookup: choose one")
        if self.repetitions < 1:
            raise UsageError(f"-r/--repetitions must be at least 1, got {self.repetitions}")
        if not self.tests():
            raise UsageError("nothing to run: -p and -n are both 0 and there is no --pg test")


def parse_ints(flag: str, text: str) -> list[int]:
    """A comma list of integers, like llama-bench's: "128,512" -> [128, 512]."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    return values


def parse_pg(text: str) -> tuple[int, int]:
    """--pg "512,128" -> (512, 128)."""
    values = parse_ints("--pg", text)
    if len(values) != 2:
        raise UsageError(f"--pg takes PROMPT,GEN (two integers), got {text!r}")
    return values[0], values[1]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        result = subprocess.run(
            ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True
        )
        if result.returncode == 0 and result.stdout.strip():
            return result.stdout.strip()
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple MPS ({cpu_model()})"
    return cpu_model()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "cpu":
        # Linux: writing 5 resets the process's peak RSS (VmHWM) to its current RSS.
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            pass


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what was measured): CUDA's peak allocation, the MPS driver's current
    allocation (it has no peak counter, but it caches freed blocks), or the process's
    peak resident set size, which includes the mapped weights and Python itself."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max allocated"
    if device.type == "mps":
        return torch.mps.driver_allocated_memory(), "mps driver allocated"
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024, "peak rss"
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024, "peak rss"


def read_bandwidth(
    device: torch.device, nbytes: int = ROOFLINE_BYTES, repeats: int = ROOFLINE_REPEATS
) -> float:
    """The best GB/s of summing a buffer of `nbytes` with the current thread count:
    the read bandwidth that decoding, which reads every weight once per token, can reach."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        buffer.sum()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter (linear weights and
    biases, lm_head included, norms) in the form the model holds it (quantized
    blocks or the compute dtype), except embedding tables, of which a lookup reads
    one row. A tied lm_head reads the whole shared table, counted once. Of a
    mixture-of-experts block (`experts` and `top_k`) a token reads top_k experts:
    all its experts' bytes x top_k / their number (the experts of a block are alike)."""
    share: dict[int, float] = {}
    for module in model.modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.ModuleList) and hasattr(module, "top_k"):
            held = (p for m in experts.modules() for p in _weights(m))
            share.update((id(p), module.top_k / len(experts)) for p in held)
    seen: set[int] = set()
    total = 0.0
    for module in model.modules():
        for p in _weights(module):
            if isinstance(module, (nn.Embedding, QuantEmbedding)):
                total += p.nbytes // p.shape[0]
            elif id(p) not in seen:
                seen.add(id(p))
                total += p.nbytes * share.get(id(p), 1.0)
    return round(total)


def _weights(module: nn.Module) -> list[torch.Tensor]:
    """A module's own weights: its parameters, and a PlanarLinear's planes (buffers)."""
    weights = list(module.parameters(recurse=False))
    if isinstance(module, PlanarLinear):
        weights += module.planes.values()
    return weights


def disk_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(f.stat().st_size for f in safetensors_io.safetensors_files(path))
    return path.stat().st_size


def quant_name(checkpoint: Checkpoint) -> str:
    """The file's quantization as llama.cpp names it (Q4_K_M, F16, ...): the GGUF
    general.file_type, else the storage type holding the most parameters."""
    if checkpoint.gguf is not None:
        file_type = checkpoint.gguf.get(Keys.General.FILE_TYPE)
        if isinstance(file_type, int) and file_type in LlamaFileType._value2member_map_:
            return LlamaFileType(file_type).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    types = checkpoint.weight_types
    return max(types, key=types.get) if types else "-"


def model_name(path: Path) -> str:
    return path.stem if path.suffix == ".gguf" else path.name


def _random_ids(vocab_size: int, n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def _run_once(
    engine: api.Engine,
    state: KVState,
    test: Test,
    ids: list[int],
    depth_windows: Any = None,
    stats: Stats | None = None,
) -> tuple[float, float]:
    """One timed run after the cached depth: (seconds, seconds to the first new token's logits).
    `depth_windows`: the sliding-window layers' rings as the depth left them (a ring
    does not keep what the previous run overwrote; see KVCache.save_windows). With the
    engine's speculator, the generated tokens are the model's greedy ones, drafted and
    verified (`stats` counts the drafts)."""
    device = engine.device
    del state.tokens[test.n_depth :]
    state.cache.restore_windows(depth_windows)
    synchronize(device)
    start = time.perf_counter()
    first = None
    if test.n_prompt:
        prefill(engine.model, state, ids[: test.n_prompt], test.n_batch)
        synchronize(device)
        first = time.perf_counter() - start
    if engine.speculator is not None and test.n_gen:
        # The first token is fed as a decode step's is; the model's own tokens follow.
        greedy = Sampler(SamplingParams(temperature=0))
        fed = ids[test.n_prompt : test.n_prompt + 1]
        counts = stats if stats is not None else Stats()
        steps = engine.speculator.generate_step(engine.model, state, fed, greedy, [], counts)
        for _ in zip(range(test.n_gen), steps, strict=False):
            if first is None:
                synchronize(device)
                first = time.perf_counter() - start
        steps.close()
    else:
        for token in ids[test.n_prompt :]:
            decode(engine.model, state, token)
            if first is None:
                synchronize(device)
                first = time.perf_counter() - start
    synchronize(device)
    return time.perf_counter() - start, first


def run_test(
    engine: api.Engine,
    test: Test,
    repetitions: int,
    progress: Progress,
    stats: Stats | None = None,
) -> tuple[list[float], list[float]]:
    """Seconds and seconds-to-first-token of each timed run, after one warm-up; `stats`
    counts the timed runs' drafts (with the engine's speculator)."""
    rng = random.Random(0)
    vocab = min(engine.tokenizer.vocab_size, engine.model.args.vocab_size)
    state = engine.new_state(test.positions)
    with torch.inference_mode():
        if test.n_depth:
            prefill(engine.model, state, _random_ids(vocab, test.n_depth, rng), test.n_batch)
        depth_windows = state.cache.save_windows()
        seconds, firsts = [], []
        for rep in range(repetitions + 1):
            label = "warm-up" if rep == 0 else f"run {rep}/{repetitions}"
            progress(f"{test.name} {label}", 0)
            ids = _random_ids(vocab, test.n_prompt + test.n_gen, rng)
            counted = stats if rep else None
            elapsed, first = _run_once(engine, state, test, ids, depth_windows, counted)
            if rep:
                seconds.append(elapsed)
                firsts.append(first)
            progress(f"{test.name} {label}", 1)
    return seconds, firsts


def bench_model(
    spec: str | None,
    options: BenchOptions,
    roofline: dict[int, float],
    progress: Progress,
    path: Path | None = None,
) -> list[dict[str, Any]]:
    """Load one model (found at `path`, if given) and run every test on it: one record per
    test."""
    tests = options.tests()
    longest = max(tests, key=lambda t: t.positions)
    progress(f"loading {spec or 'stories260K'}", 0)
    reset_peak_memory(api.pick_device(options.device))
    engine = api.load(
        spec,
        options.device,
        options.dtype,
        ctx_size=longest.positions,
        cache_type=options.cache_type,
        activations=options.activations,
        path=path,
        lora=options.lora,
    )
    checkpoint = engine.checkpoint
    name = model_name(engine.path)
    cache_type = engine.cache_type or DTYPE_NAMES[engine.dtype]
    max_positions = checkpoint.config.get("max_position_embeddings")
    if max_positions and longest.positions > max_positions:
        raise UsageError(
            f"test {longest.name} needs {longest.positions} positions, but "
            f"{name} holds {max_positions}; use smaller -p/-n/-d/--pg"
        )
    drafting = {}
    if options.draft is not None:
        progress(f"loading draft {options.draft}", 0)
        path = api.resolve(options.draft)
        if gemma4_assistant.is_assistant(path):
            engine.use_assistant(path, options.draft_max)
        else:
            draft = api.load(
                options.draft,
                engine.device.type,
                options.dtype,
                ctx_size=longest.positions,
                path=path,
                cache_type=options.cache_type,
                activations=options.activations,
            )
            engine.use_draft(draft, options.draft_max)
        drafting = dict(draft=model_name(path), draft_max=options.draft_max)
    elif options.lookup is not None:
        engine.use_lookup(options.lookup)
        drafting = dict(draft="lookup", draft_max=options.lookup)
    common = dict(
        llmrun_version=__version__,
        torch_version=torch.__version__,
        device=engine.device.type,
        device_name=device_name(engine.device),
        cpu=cpu_model(),
        # Only CPU runs use them; elsewhere asking would build them for nothing.
        cpu_kernels=native.status() if engine.device.type == "cpu" else None,
        model=name,
        model_path=str(engine.path),
        architecture=checkpoint.config.get("model_type"),
        format=checkpoint.format,
        quant=quant_name(checkpoint),
        n_params=checkpoint.n_params,
        model_bytes=disk_bytes(engine.path),
        weight_bytes_per_token=weight_bytes_per_token(engine.model),
        dtype=DTYPE_NAMES[engine.dtype],
        cache_type=cache_type,  # as llama-bench's type_k / type_v, one for both
        activations=engine.activations,
        load_s=engine.load_seconds,
        **drafting,
    )
    records = []
    for test in tests:
        if test.threads is not None:
            torch.set_num_threads(test.threads)
        threads = torch.get_num_threads()
        stats = Stats()
        seconds, firsts = run_test(
            engine,
            test,
            options.repetitions,
            lambda what, done: progress(f"{name} {what}", done),
            stats,
        )
        peak = peak_memory(engine.device)
        record = _record(common, test, threads, seconds, firsts, peak, roofline.get(threads))
        if test.n_batch is None:
            record["n_batch"] = prefill_chunk(engine.model, engine.device)
        if drafting:
            record.update(drafted=stats.drafted, accepted=stats.accepted)
            # A verify forward reads the weights once for several tokens: no GB/s per token.
            record.update(acceptance=stats.acceptance, gbps=None, roofline_pct=None)
        kv = kv_cache_bytes(checkpoint.config, test.positions, BYTES_PER_VALUE[cache_type])
        record.update(kv_cache_bytes=kv, kv_bytes_per_token=kv / test.positions)
        records.append(record)
    return records


def _record(
    common: dict[str, Any],
    test: Test,
    threads: int,
    seconds: list[float],
    firsts: list[float],
    peak: tuple[int, str],
    roofline_gbps: float | None,
) -> dict[str, Any]:
    tokens = test.n_prompt + test.n_gen
    samples = [tokens / s for s in seconds]
    avg = statistics.fmean(samples)
    # Bandwidth only for pure generation, where each token reads every weight once.
    gbps = common["weight_bytes_per_token"] * avg / 1e9 if not test.n_prompt else None
    return {
        **common,
        "threads": threads,
        "test": test.name,
        "n_prompt": test.n_prompt,
        "n_gen": test.n_gen,
        "n_depth": test.n_depth,
        "n_batch": test.n_batch,
        "repetitions": len(seconds),
        "avg_ts": avg,
        "stddev_ts": statistics.stdev(samples) if len(samples) > 1 else 0.0,
        "samples_ts": samples,
        "avg_s": statistics.fmean(seconds),
        "ttft_ms": statistics.fmean(firsts) * 1e3,
        "peak_memory_bytes": peak[0],
        "memory_source": peak[1],
        "gbps": gbps,
        "roofline_gbps": roofline_gbps,
        "roofline_pct": 100 * gbps / roofline_gbps if gbps is not None and roofline_gbps else None,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def total_runs(options: BenchOptions, n_models: int) -> int:
    return n_models * len(options.tests()) * (options.repetitions + 1)


def measure_rooflines(options: BenchOptions) -> dict[int, float]:
    """Read bandwidth per thread count, measured before any model is loaded, so
    its buffer never counts in a model's peak memory."""
    device = api.pick_device(options.device)
    counts = sorted({t if t is not None else torch.get_num_threads() for t in options.threads})
    default = torch.get_num_threads()
    result = {}
    for threads in counts:
        torch.set_num_threads(threads)
        result[threads] = read_bandwidth(device)
    torch.set_num_threads(default)
    return result


def benchmark(
    models: list[str | None], options: BenchOptions, progress: Progress | None = None
) -> list[dict[str, Any]]:
    """Run every test on every model, one model loaded at a time."""
    options.validate()
    report = progress or (lambda description, done: None)
    if options.roofline:
        report("measuring read bandwidth", 0)
    roofline = measure_rooflines(options) if options.roofline else {}
    # Every model found (or pulled) first: a missing last one costs nothing, not the runs
    # of those before it.
    paths = [api.resolve(spec) for spec in models]
    records = []
    for index, (spec, path) in enumerate(zip(models, paths, strict=True)):
        if index:
            gc.collect()  # the last model freed before this one's peak memory is measured
        records += bench_model(spec, options, roofline, report, path)
    return records
