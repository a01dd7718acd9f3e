"""Prompt -> engine request: tokenization, chat templates, length checks, fan-out for n."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from tidal.config import ModelConfig
from tidal.engine_core.messages import EngineCoreRequest, SamplingParamsMsg
from tidal.sampling_params import SamplingParams

PromptType = str | dict[str, Any] | list[int]


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def eos_token_id_for(model_config: ModelConfig, tokenizer: Any) -> int | None:
    ids = model_config.eos_token_ids
    if ids:
        return ids[0]
    return getattr(tokenizer, "eos_token_id", None)


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer: Any) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id_for(model_config, tokenizer)
        # Other EOS ids (generation_config.json) act as stop tokens, as in transformers.
        self.extra_eos_ids = [i for i in model_config.eos_token_ids if i != self.eos_token_id]
        self.vocab_size = int(model_config.hf_config.vocab_size)

    def tokenize(self, prompt: PromptType) -> ProcessedPrompt:
        if isinstance(prompt, str):
            return ProcessedPrompt(prompt, self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return ProcessedPrompt(prompt.get("prompt"), list(prompt["prompt_token_ids"]))
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return ProcessedPrompt(None, list(prompt))
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}")

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> ProcessedPrompt:
        if not messages:
            raise ValueError("messages must not be empty")
        text = self.tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            **kwargs,
        )
        return ProcessedPrompt(text, self.tokenizer.encode(text, add_special_tokens=False))

    def check(self, prompt: ProcessedPrompt, params: SamplingParams) -> None:
        """User-facing length and vocabulary checks (ValueError -> HTTP 400)."""
        n, limit = len(prompt.prompt_token_ids), self.model_config.max_model_len
        if n == 0:
            raise ValueError("prompt must not be empty")
        if n >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens, but the prompt has {n} tokens"
            )
        if params.max_tokens is not None and n + params.max_tokens > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the "
                "completion). Please reduce the prompt or max_tokens."
            )
        bad = next((t for t in prompt.prompt_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(
                f"prompt token id {bad} is out of range for vocab size {self.vocab_size}"
            )

    def make_requests(
        self,
        child_ids: list[str],
        prompt: ProcessedPrompt,
        params: SamplingParams,
        data_parallel_rank: int | None = None,
    ) -> list[EngineCoreRequest]:
        """One engine request per child; child i of a seeded request uses seed + i."""
        now = time.time()
        reqs = []
        for i, cid in enumerate(child_ids):
            msg = to_params_msg(params)
            msg.n = 1
            if not params.ignore_eos:
                msg.stop_token_ids = msg.stop_token_ids + [
                    i for i in self.extra_eos_ids if i not in msg.stop_token_ids
                ]
            if params.seed is not None:
                msg.seed = params.seed + i
            reqs.append(
                EngineCoreRequest(
                    request_id=cid,
                    prompt_token_ids=prompt.prompt_token_ids,
                    sampling_params=msg,
                    eos_token_id=self.eos_token_id,
                    arrival_time=now,
                    data_parallel_rank=data_parallel_rank,
                )
            )
        return reqs


def to_params_msg(params: SamplingParams) -> SamplingParamsMsg:
    fields = {f: getattr(params, f) for f in SamplingParamsMsg.__struct_fields__}
    return msgspec.structs.replace(SamplingParamsMsg(), **fields)
