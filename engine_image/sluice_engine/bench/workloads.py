"""Seeded request lists: what each benchmark request asks for, as text with known token lengths.

Lengths come from one seeded stream and prompt text from another keyed by `variant`, so a sweep or a repeat
can send fresh text (no prefix-cache hits carried over from the previous run) with exactly the same lengths.
Every length is counted with the model's own tokenizer, without special tokens or a chat template (the
server's usage.prompt_tokens, reported beside it, includes those).

- conversational: prompt and output lengths lognormal around their medians (skewed, a long tail), clipped.
- fixed: every prompt exactly --input-len tokens, every output exactly --output-len.
- shared-prefix: P prefixes of --prefix-len tokens, each request = prefix (i mod P) + a unique suffix of
  --suffix-len tokens, shuffled; N requests make S = N / P suffixes per prefix. For prefix caching.
- echo: "repeat this text exactly" with max_tokens = the text's length: the output is in the prompt, which
  is what n-gram (prompt lookup) speculative decoding exploits. The text starts at a paragraph and ends at
  a sentence (about --input-len tokens, lognormal): a small model copies that far more faithfully.
- jsonl: one request per line: {"prompt": str} or {"messages": [...]}, optional "max_tokens".
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from .corpus import CORPUS

WORKLOADS = ("conversational", "fixed", "shared-prefix", "echo", "jsonl")
ECHO_INSTRUCTION = "Repeat the following text exactly, without adding anything before or after it."


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(slots=True)
class BenchRequest:
    index: int
    prompt: str  # the completion prompt, or the user message on the chat endpoint
    prompt_len: int  # tokens of `prompt` (no special tokens, no chat template)
    max_tokens: int
    messages: list[dict[str, Any]] | None = None  # a jsonl line's own conversation (chat endpoint)
    group: int | None = None  # shared-prefix: which prefix
    expected_output: str | None = None  # echo: the text the model is asked to repeat


@dataclass(slots=True)
class WorkloadSpec:
    name: str = "conversational"
    num_requests: int = 64
    seed: int = 0
    input_len: int = 100  # median (conversational, echo) or exact (fixed)
    output_len: int = 64  # median (conversational) or exact (fixed, shared-prefix; jsonl default)
    input_sigma: float = 0.5
    output_sigma: float = 0.8
    input_min: int | None = None  # clip of the lognormal; None: median / 4
    input_max: int | None = None  # None: median * 4
    output_min: int | None = None
    output_max: int | None = None
    prefix_len: int = 1024
    num_prefixes: int = 4
    suffix_len: int = 32
    dataset: str | None = None  # jsonl path
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        assert self.name in WORKLOADS, f"workload must be one of {WORKLOADS}"
        assert self.num_requests >= 1 and self.input_len >= 1 and self.output_len >= 1
        assert self.num_prefixes >= 1 and self.prefix_len >= 1 and self.suffix_len >= 1
        assert self.name != "jsonl" or self.dataset, "the jsonl workload needs a dataset file"

    def clip(self, which: str) -> tuple[int, int]:
        median = self.input_len if which == "input" else self.output_len
        lo = getattr(self, f"{which}_min")
        hi = getattr(self, f"{which}_max")
        lo = max(1, median // 4) if lo is None else lo
        hi = median * 4 if hi is None else hi
        assert 1 <= lo <= hi, f"--{which}-min must be <= --{which}-max"
        return lo, hi

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"workload": self.name, "num_requests": self.num_requests, "seed": self.seed}
        if self.name == "conversational":
            d |= {"input_len_median": self.input_len, "input_sigma": self.input_sigma,
                  "input_clip": self.clip("input"), "output_len_median": self.output_len,
                  "output_sigma": self.output_sigma, "output_clip": self.clip("output")}
        elif self.name == "fixed":
            d |= {"input_len": self.input_len, "output_len": self.output_len}
        elif self.name == "shared-prefix":
            d |= {"prefix_len": self.prefix_len, "num_prefixes": self.num_prefixes, "suffix_len": self.suffix_len,
                  "output_len": self.output_len}
        elif self.name == "echo":
            d |= {"input_len_median": self.input_len, "input_sigma": self.input_sigma, "input_clip": self.clip("input")}
        else:
            d |= {"dataset": self.dataset, "default_max_tokens": self.output_len}
        return d


def lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, round(rng.lognormvariate(math.log(median), sigma))))


class TextSource:
    """Cuts text of an exact token length out of a seeded, shuffled stream of CORPUS paragraphs."""

    def __init__(self, tokenizer: TextTokenizer, rng: random.Random):
        self.tok = tokenizer
        self.rng = rng
        self._paragraphs = [self.count_ids(p) for p in CORPUS]
        self._sep = self.count_ids("\n\n")
        self._stream: list[int] = []
        self._starts: list[int] = []  # where each paragraph begins in the stream

    def count_ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def _ensure(self, n: int) -> None:
        while len(self._stream) < n:
            order = self._paragraphs[:]
            self.rng.shuffle(order)
            for p in order:
                self._starts.append(len(self._stream))
                self._stream += p + self._sep

    def text(self, n_tokens: int) -> tuple[str, int]:
        """Text whose re-encoding is n_tokens long (nearest found if a window cannot hit it exactly: the
        cut points can merge or split tokens), and its actual length."""
        self._ensure(max(4 * n_tokens, 4096))
        start = self.rng.randrange(len(self._stream) - 2 * n_tokens - 16)
        best: tuple[int, str, int] | None = None
        for shift in range(4):  # a window that cannot hit the length exactly: try the next start
            want = n_tokens
            for _ in range(4):
                text = self.tok.decode(self._stream[start + shift : start + shift + want]).strip()
                n = len(self.count_ids(text))
                if best is None or abs(n - n_tokens) < best[0]:
                    best = (abs(n - n_tokens), text, n)
                if n == n_tokens:
                    return text, n
                want = max(1, want + n_tokens - n)
        assert best is not None
        return best[1], best[2]


    def sentences(self, n_tokens: int) -> tuple[str, int]:
        """About n_tokens of text that starts at a paragraph and ends at a sentence end (when one lies in
        the second half of the window): text a small model can repeat verbatim."""
        self._ensure(max(4 * n_tokens, 4096))
        start = self.rng.choice([s for s in self._starts if s + n_tokens < len(self._stream)])
        text = self.tok.decode(self._stream[start : start + n_tokens]).strip()
        end = max(text.rfind(". "), text.rfind("? "), text.rfind("! "), text.rfind(".\n"))
        if text[-1:] not in ".?!" and end >= len(text) // 2:
            text = text[: end + 1]
        return text, len(self.count_ids(text))


def build_workload(spec: WorkloadSpec, tokenizer: TextTokenizer, variant: int | str = 0) -> list[BenchRequest]:
    """The request list. Same (spec, variant): the same list; another variant: the same lengths, new text."""
    if spec.name == "jsonl":
        return load_jsonl(spec, tokenizer)
    lengths = random.Random(f"sluice-bench-{spec.seed}-lengths")
    src = TextSource(tokenizer, random.Random(f"sluice-bench-{spec.seed}-text-{variant}"))
    if spec.name == "shared-prefix":
        return _shared_prefix(spec, src, lengths)
    reqs = []
    for i in range(spec.num_requests):
        if spec.name == "fixed":
            plen, olen = spec.input_len, spec.output_len
        else:
            plen = lognormal_int(lengths, spec.input_len, spec.input_sigma, *spec.clip("input"))
            olen = lognormal_int(lengths, spec.output_len, spec.output_sigma, *spec.clip("output"))
        text, n = src.sentences(plen) if spec.name == "echo" else src.text(plen)
        if spec.name == "echo":
            prompt = f"{ECHO_INSTRUCTION}\n\n{text}"
            reqs.append(BenchRequest(i, prompt, len(src.count_ids(prompt)), n, expected_output=text))
        else:
            reqs.append(BenchRequest(i, text, n, olen))
    return reqs


def _shared_prefix(spec: WorkloadSpec, src: TextSource, lengths: random.Random) -> list[BenchRequest]:
    # The "\n\n" joint: the pre-tokenizer splits at whitespace, so every prompt starts with the prefix's
    # exact token ids and the prefix cache can match all of it (up to the last full block).
    prefixes = [src.text(spec.prefix_len)[0] for _ in range(spec.num_prefixes)]
    reqs = []
    for i in range(spec.num_requests):
        g = i % spec.num_prefixes
        suffix, _ = src.text(spec.suffix_len)
        prompt = f"{prefixes[g]}\n\n{suffix}"
        reqs.append(BenchRequest(i, prompt, len(src.count_ids(prompt)), spec.output_len, group=g))
    order = list(range(len(reqs)))
    lengths.shuffle(order)
    out = []
    for new_index, old in enumerate(order):
        r = reqs[old]
        r.index = new_index
        out.append(r)
    return out


def load_jsonl(spec: WorkloadSpec, tokenizer: TextTokenizer) -> list[BenchRequest]:
    """The file's lines in order, cycled when it has fewer than --num-requests."""
    lines = []
    for lineno, line in enumerate(Path(spec.dataset).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{spec.dataset}:{lineno}: not JSON: {e}") from e
        if not isinstance(item, dict) or not (isinstance(item.get("prompt"), str) or item.get("messages")):
            raise ValueError(f"{spec.dataset}:{lineno}: need a \"prompt\" string or a \"messages\" list")
        lines.append(item)
    if not lines:
        raise ValueError(f"{spec.dataset}: no prompts")
    reqs = []
    for i in range(spec.num_requests):
        item = lines[i % len(lines)]
        messages = item.get("messages")
        prompt = item["prompt"] if isinstance(item.get("prompt"), str) else \
            "\n".join(str(m.get("content") or "") for m in messages)
        max_tokens = int(item.get("max_tokens") or item.get("output_len") or spec.output_len)
        reqs.append(BenchRequest(i, prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), max_tokens,
                                 messages=messages))
    return reqs


def warmup_requests(spec: WorkloadSpec, tokenizer: TextTokenizer, n: int) -> list[BenchRequest]:
    """Short requests with their own text (they must not warm the prefix cache for the measured run):
    prompts of min(--input-len, 64) tokens, 8 output tokens. For jsonl: the file's first prompts."""
    if n <= 0:
        return []
    if spec.name == "jsonl":
        reqs = load_jsonl(replace(spec, num_requests=n), tokenizer)
    else:
        warm = WorkloadSpec("fixed", num_requests=n, seed=spec.seed, input_len=min(spec.input_len, 64), output_len=8)
        reqs = build_workload(warm, tokenizer, variant="warmup")
    for r in reqs:
        r.max_tokens = min(r.max_tokens, 8)
    return reqs


def default_ignore_eos(workload: str) -> bool:
    """Synthetic workloads fix their output lengths: every server must generate exactly max_tokens, or the
    comparison is of different work. Echo and jsonl end where the model ends (EOS)."""
    return workload in ("conversational", "fixed", "shared-prefix")
