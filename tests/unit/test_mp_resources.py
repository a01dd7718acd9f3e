"""Releasing the engine client's resources (``_MPResources.close``, also the path of a failed
start) never waits for good: a socket still open on its context -- one no list names,
such as the socket of a call that failed, which only the exception's traceback holds --
is closed with linger 0 before the context is terminated (``term()`` waits for every
socket of its context). Both the plain context and the asyncio one, whose startup
sockets are made through a sync shadow."""

from __future__ import annotations

import threading

import pytest
import zmq
import zmq.asyncio

from tidal.frontend.async_client import _MPResources


@pytest.mark.parametrize("asyncio_mode", [False, True], ids=["sync", "asyncio"])
def test_close_with_a_socket_still_open_returns(tmp_path, asyncio_mode):
    ctx = zmq.asyncio.Context() if asyncio_mode else zmq.Context()
    sync_ctx = zmq.Context.shadow(ctx.underlying) if asyncio_mode else ctx
    ipc_dir = tmp_path / "ipc"
    ipc_dir.mkdir()
    listed = sync_ctx.socket(zmq.PULL)
    listed.bind(f"ipc://{ipc_dir}/out")
    # Not listed, and with a message that can never go out (no peer listens there):
    # with the default linger even closing it would not let term() return.
    stray = sync_ctx.socket(zmq.PUSH)
    stray.setsockopt(zmq.LINGER, -1)
    stray.connect(f"ipc://{ipc_dir}/nobody")
    stray.send(b"never delivered")
    kwargs = {"sync_ctx": sync_ctx} if asyncio_mode else {}
    resources = _MPResources(ctx, str(ipc_dir), None, None, [listed], **kwargs)
    closer = threading.Thread(target=resources.close, name="close-resources", daemon=True)
    closer.start()
    closer.join(60)  # generous: it returns at once unless term() waits for good
    assert not closer.is_alive(), "closing the client's resources blocked in Context.term()"
    assert listed.closed and stray.closed and ctx.closed
    assert not ipc_dir.exists()
