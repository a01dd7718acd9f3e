"""The offline ``LLM``'s chat and logprobs against transformers on the same checkpoint
(float32): ``LLM.chat`` prompts with exactly the token ids of the tokenizer's own
``apply_chat_template`` and continues them greedily as transformers does; every logprob it
reports (sampled and top-k, prompt and output) is transformers' ``log_softmax`` of the
logits at that position."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tidal import LLM, SamplingParams

CONVERSATIONS = [
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "The tide comes in"}],
    [
        {"role": "user", "content": "Mixture of experts"},
        {"role": "assistant", "content": "route tokens"},
        {"role": "user", "content": "to whom?"},
    ],
]
MAX_TOKENS = 8
TOP = 5
# float32 on both sides; the engine's kernels sum in another order than transformers'.
ATOL = 1e-4


@pytest.fixture(scope="module")
def llm(qwen3_ckpt: str) -> Iterator[LLM]:
    engine = LLM(qwen3_ckpt, dtype="float32", multiprocess=False)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf(qwen3_ckpt: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(qwen3_ckpt, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(qwen3_ckpt)


def _hf_greedy(model, ids: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        x = torch.tensor([ids])
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_prompts_with_the_tokenizers_chat_template(llm, hf, add_generation_prompt):
    model, tok = hf
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    outs = llm.chat(
        CONVERSATIONS, params, use_tqdm=False, add_generation_prompt=add_generation_prompt
    )
    assert len(outs) == len(CONVERSATIONS)
    for conv, out in zip(CONVERSATIONS, outs):
        want = tok.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
        assert out.prompt_token_ids == want
        assert out.prompt == tok.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert out.outputs[0].token_ids == _hf_greedy(model, want, MAX_TOKENS)


def _hf_log_softmax(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float32: row t is the distribution of the token after ids[: t + 1]."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _assert_position(got: dict, dist: torch.Tensor, token: int, where: str) -> None:
    """One position's logprobs: the top ``TOP`` (with their ranks) and the token itself,
    nothing else, each transformers' value."""
    top = torch.topk(dist, TOP).indices.tolist()
    assert set(got) == {*top, token}, where
    for rank, t in enumerate(top, start=1):
        assert got[t].rank == rank, (where, t)
    assert got[token].rank == int((dist > dist[token]).sum()) + 1, where
    for t, lp in got.items():
        assert lp.logprob == pytest.approx(dist[t].item(), abs=ATOL), (where, t)


def test_logprobs_are_transformers_log_softmax(llm, hf):
    model, _ = hf
    prompt = [3, 17, 42, 99, 7, 256, 11]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        min_tokens=MAX_TOKENS,
        logprobs=TOP,
        prompt_logprobs=TOP,
    )
    (out,) = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    c = out.outputs[0]
    ids = prompt + c.token_ids
    dist = _hf_log_softmax(model, ids)
    assert len(c.logprobs) == MAX_TOKENS
    for k, (token, got) in enumerate(zip(c.token_ids, c.logprobs)):
        pos = len(prompt) - 1 + k  # the logits that chose output token k
        assert token == int(dist[pos].argmax())  # greedy
        _assert_position(got, dist[pos], token, f"output {k}")
    assert c.cumulative_logprob == pytest.approx(
        sum(dist[len(prompt) - 1 + k, t].item() for k, t in enumerate(c.token_ids)),
        abs=ATOL * MAX_TOKENS,
    )
    # Prompt logprobs: none for the first token, then each token given the ones before.
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        _assert_position(out.prompt_logprobs[i], dist[i - 1], prompt[i], f"prompt {i}")
