"""Offline Python API over the same engine: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from ..config import EngineConfig
from ..engine.llm_engine import LLMEngine
from ..sample.token_logprobs import TokenLogprobs
from ..sampling_params import SamplingParams


@dataclass(slots=True)
class Completion:
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs]
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprobs] | None = None  # for prompt tokens 1.., when asked


class LLM:
    def __init__(self, model: str | None = None, **engine_kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: str | list[str] | list[list[int]],
                 params: SamplingParams | None = None, lora: str | list[str | None] | None = None) -> list[Completion]:
        """Runs all prompts through continuous batching; returns completions in prompt order
        (with n > 1, the n completions of each prompt in a row). lora: the LoRA adapter (a name from
        lora_modules) for every prompt, or one per prompt (None: the base model)."""
        params = params or SamplingParams()
        if isinstance(prompts, str):
            prompts = [prompts]
        encoded = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]
        for toks in encoded:  # refuse the whole call before any request enters the engine
            self.engine.check_prompt(toks, params)
        loras = lora if isinstance(lora, list) else [lora] * len(encoded)
        if len(loras) != len(encoded):
            raise ValueError(f"lora: {len(loras)} adapters for {len(encoded)} prompts")
        ids = []
        results: dict[str, Completion] = {}
        for toks, adapter in zip(encoded, loras, strict=True):
            for i in range(params.n):
                rid = f"offline-{next(self._ids)}"
                seed = None if params.seed is None else params.seed + i  # choices differ, yet repeat
                self.engine.add_request(rid, toks, dataclasses.replace(params, seed=seed, n=1), lora_name=adapter)
                ids.append(rid)
                results[rid] = Completion(toks, "", [], None, [], 0)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                c = results[out.request_id]
                c.text += out.new_text
                c.token_ids.extend(out.new_token_ids)
                c.logprobs.extend(out.logprobs)
                c.num_cached_tokens = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    c.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    c.finish_reason = out.finish_reason
        return [results[r] for r in ids]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Completion:
        return self.generate([self.tokenizer.encode_chat(messages)], params)[0]
