"""Sleep mode on the offline ``LLM`` (docs/operations.md#sleep-mode), in process and with
the engine in its own process: the KV cache is freed, ``generate`` fails while asleep,
and after ``wake_up`` greedy outputs equal those before the sleep."""

from __future__ import annotations

import pytest

from tidal import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The tide comes in", "Mixture of experts", "Hello"]


# The multiprocess case starts an engine process: not the fast tier.
@pytest.mark.parametrize("multiprocess", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_sleep_wake_up_keeps_greedy_outputs(qwen3_ckpt, multiprocess) -> None:
    with LLM(qwen3_ckpt, dtype="float32", multiprocess=multiprocess) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        kv = llm._call_all("get_kv_cache_info")[0]
        assert llm.sleep(level=1) == kv["bytes"] > 0
        assert llm.sleep(level=1) == 0  # already asleep
        assert llm._call_all("is_sleeping") == [True]
        with pytest.raises(Exception, match="asleep"):
            llm.generate(PROMPTS[:1], PARAMS)
        llm.wake_up()
        assert llm._call_all("is_sleeping") == [False]
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == before


# The multiprocess case starts an engine process: not the fast tier.
@pytest.mark.parametrize("multiprocess", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_sleep_level_2_drops_the_weights_and_wake_up_reloads_them(qwen3_ckpt, multiprocess):
    with LLM(qwen3_ckpt, dtype="float32", multiprocess=multiprocess) as llm:
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        kv = llm._call_all("get_kv_cache_info")[0]
        weights = llm._call_all("sleep", 2)[0] - kv["bytes"]
        assert weights > 0  # the resident memory the weights held, measured
        assert llm._call_all("echo", 1) == [1]  # the engine still answers while asleep
        # /stats' parts answer without the model: the kept layout, no kernel paths
        assert llm._call_all("get_kv_cache_info")[0] == kv
        assert llm.cpu_kernels() == [None]
        with pytest.raises(Exception, match="asleep"):
            llm.generate(PROMPTS[:1], PARAMS)
        llm.wake_up()  # reads the checkpoint again and packs the weights as at start
        assert llm.cpu_kernels()[0] is not None
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == before
        # and again: a second level-2 cycle (the reloaded model is as freeable)
        assert llm.sleep(level=2) > kv["bytes"]
        llm.wake_up()
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)] == before
