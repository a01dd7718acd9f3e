"""The child of ``test_multiproc_executor.py``'s shutdown test (``python -m
tests.distributed.heartbeat_shutdown_child CKPT``): a TP=2 ``MultiprocExecutor`` asked
``worker.waiting_on_peers`` over and over from a thread of its own, as the engine's output
thread does for its heartbeats, while the main thread shuts it down; the thread asks on
after the shutdown returned. Prints a JSON report; a crash (the ring unmapped under a
send) is its exit code. Its own process: such a crash must not take pytest down."""

from __future__ import annotations

import json
import sys
import threading

from tests.waiting import wait_until

if __name__ == "__main__":
    from tidal.executor.multiproc import MultiprocExecutor
    from tidal.launch.engine_args import EngineArgs

    config = EngineArgs(
        model=sys.argv[1], dtype="float32", device="cpu", tensor_parallel_size=2,
        num_gpu_blocks_override=32, block_size=4, max_model_len=64,
    ).create_engine_config()  # fmt: skip
    ex = MultiprocExecutor(config)
    answers: list[bool] = []
    errors: list[str] = []
    after_shutdown = [0]
    shut_down = threading.Event()
    done = threading.Event()

    def beat() -> None:
        while not done.is_set():
            finished = shut_down.is_set()
            try:
                answers.append(ex.call("worker.waiting_on_peers"))
            except BaseException as e:  # noqa: BLE001 - reported, the test judges
                errors.append(f"{type(e).__name__}: {e}")
            if finished:
                after_shutdown[0] += 1

    t = threading.Thread(target=beat, name="heartbeats", daemon=True)
    t.start()
    started = wait_until(lambda: len(answers) >= 3, 120)
    ex.shutdown()
    shut_down.set()
    asked_after = wait_until(lambda: after_shutdown[0] >= 3, 120)
    done.set()
    t.join(120)
    report = {
        "started": started,
        "asked_after": asked_after,
        "errors": errors[:5],
        "waiting": any(answers),
    }
    print(json.dumps(report), flush=True)
