"""A structured-output request keeps its grammar when it moves (docs/architecture.md#structured-outputs,
docs/architecture.md#elastic-migration): on a DP=2 elastic deployment a JSON-schema request
streaming on rank 1 moves to rank 0 -- by a scale-down to 1, or because rank 1 is killed --
and the new rank rebuilds its matcher by replaying the outputs it carried over. The output
is the one an unmoved request produces, and it parses and validates against the schema."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import jsonschema
import msgspec
import pytest

from tests.distributed.test_elastic_scale import _llm
from tests.waiting import wait_until_async
from tidal import LLM
from tidal.frontend.processor import ProcessedPrompt
from tidal.sampling_params import SamplingParams, StructuredOutputs

pytestmark = pytest.mark.timeout(600)

# A long string: hundreds of tokens, so the request is still running when it moves.
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "text": {"type": "string", "minLength": 250, "maxLength": 250},
    },
    "required": ["id", "text"],
    "additionalProperties": False,
}
PROMPT = [5, 6, 7, 8]
PARAMS = SamplingParams(
    temperature=0.0, max_tokens=500, structured_outputs=StructuredOutputs(json=SCHEMA)
)
# Seeded: the noise is a function of (seed, output position), the mask of the outputs.
SEEDED = msgspec.structs.replace(PARAMS, temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def reference(qwen3_ckpt) -> dict[str, list[int]]:
    llm = LLM(qwen3_ckpt, dtype="float32")
    try:
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * 2, [PARAMS, SEEDED], use_tqdm=False)
    finally:
        llm.shutdown()
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    return {
        "greedy": list(outs[0].outputs[0].token_ids),
        "seeded": list(outs[1].outputs[0].token_ids),
    }


@pytest.mark.parametrize(
    ("how", "sampling"), [("scale_down", "greedy"), ("kill", "greedy"), ("scale_down", "seeded")]
)
def test_structured_request_moves_and_still_validates(qwen3_ckpt, reference, how, sampling):
    params = PARAMS if sampling == "greedy" else SEEDED

    async def main() -> None:
        llm = _llm(qwen3_ckpt, 2)
        try:
            tokens: list[int] = []
            text: list[str] = []
            streamed = asyncio.Event()

            async def run() -> None:
                gen = llm.generate(ProcessedPrompt(None, PROMPT), params, "s", data_parallel_rank=1)
                async for out in gen:
                    tokens.extend(out.outputs[0].token_ids)
                    text.append(out.outputs[0].text)
                    if len(tokens) >= 8:
                        streamed.set()

            task = asyncio.create_task(run())
            await asyncio.wait_for(streamed.wait(), 120)
            leaving = llm.client.topology.engine_ids[1]
            if how == "scale_down":
                code, rec = await llm.scale_elastic_ep(1)
                assert (code, rec["result"]) == (200, "succeeded"), rec
                assert rec["requests_migrated"] >= 1, rec
            else:
                os.kill(llm.client.manager.procs[leaving].pid, signal.SIGKILL)
                assert await wait_until_async(
                    lambda: llm.fault_status()["recovered"] == 1, timeout_s=300
                )
                (death,) = llm.fault_status()["deaths"]
                assert death["engine_id"] == leaving and death["requests_migrated"] >= 1
            await asyncio.wait_for(task, 300)
            assert len(tokens) > 8 + 1  # it moved mid-generation, then went on
            assert tokens == reference[sampling]
            jsonschema.validate(json.loads("".join(text)), SCHEMA)
            assert leaving not in llm.client.topology.engine_ids
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_tp_driver_samples_with_the_bitmask(qwen3_ckpt, reference):
    """With TP the driver worker samples in a process of its own: the bitmask crosses the
    step's wire to it, and the output is the one-process engine's."""
    from tidal.engine_core.core import EngineCore
    from tidal.launch.engine_args import EngineArgs
    from tidal.protocol.messages import EngineCoreRequest

    args = EngineArgs(model=qwen3_ckpt, dtype="float32", device="cpu", tensor_parallel_size=2)
    core = EngineCore(args.create_engine_config())
    try:
        # As the frontend sends it: the model's other EOS ids are stop ids (they end the
        # output, so the grammar may end with any of them).
        eos, *others = core.config.model.eos_token_ids
        params = msgspec.structs.replace(PARAMS, stop_token_ids=others)
        core.add_request(EngineCoreRequest("s", PROMPT, params, eos_token_id=eos))
        # Steps while the grammar compiles schedule nothing: counted ones could run out first.
        (waiting,) = core.scheduler.waiting
        assert waiting.grammar is not None and waiting.grammar.wait_ready(120)
        tokens: list[int] = []
        finished = False
        for _ in range(5000):
            outputs, _ = core.step()
            for outs in outputs.values():
                for o in outs.outputs:
                    tokens += o.new_token_ids
                    finished |= o.finished
            if finished:
                break
        assert finished
    finally:
        core.shutdown()
    assert tokens == reference["greedy"]
