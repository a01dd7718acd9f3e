"""Free-port picking: outside the kernel's ephemeral range, so that the local end of an
outgoing connection cannot take a picked port before its owner binds it."""

from __future__ import annotations

import socket

from tidal.distributed import ports


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_picked_port_is_free_and_below_the_ephemeral_range():
    low, _ = ports._ephemeral_range()
    picked = {ports.get_open_port() for _ in range(20)}
    assert all(ports._FIRST_PICKED_PORT <= p < low for p in picked), (picked, low)
    assert all(_bindable(p) for p in picked)
    assert len(picked) > 1  # random, not the same port for every caller


def test_a_port_in_use_is_not_picked(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        free = next(p for p in range(ports._FIRST_PICKED_PORT, 30000) if _bindable(p))

        class Draws:  # the taken port is drawn first, then a free one
            def __init__(self):
                self.draws = [taken, free]

            def choice(self, pool):
                return self.draws.pop(0)

        monkeypatch.setattr(ports.random, "SystemRandom", Draws)
        assert ports.get_open_port() == free


def test_with_no_room_outside_the_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (1024, 65535))
    port = ports.get_open_port()
    assert _bindable(port)
