"""Stateless process groups on real processes (gloo over TCP on 127.0.0.1)."""

from __future__ import annotations

import datetime
import ipaddress
import re
import socket
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from tests.waiting import wait_until
from tidal.distributed.collectives import CollectiveControl
from tidal.distributed.groups import GroupFailure, StatelessGroup, create_store


def _tcp_connections() -> int:
    return len(psutil.Process().net_connections(kind="tcp"))


def _check_collectives(g: StatelessGroup, tag: float) -> None:
    """Every collective with rank-encoded data; ``tag`` tells coexisting groups apart."""
    r, w = g.rank, g.world_size
    t = torch.tensor([r + tag, -r])
    g.all_reduce(t)
    assert t.tolist() == [sum(range(w)) + w * tag, -sum(range(w))]
    t = torch.tensor([float(r)])
    g.all_reduce(t, dist.ReduceOp.MAX)
    assert t.item() == w - 1

    gathered = g.all_gather(torch.full((2, 3), r + tag))
    assert gathered.shape == (2 * w, 3)
    assert gathered[:, 0].tolist() == [q + tag for q in range(w) for _ in range(2)]

    sizes = [q % 3 for q in range(w)]  # uneven, rank 0 contributes 0 rows
    rows = torch.arange(sizes[r], dtype=torch.float32)[:, None] + 100 * r
    gv = g.all_gather_v(rows.expand(-1, 2), sizes)
    assert gv[:, 0].tolist() == [100.0 * q + i for q in range(w) for i in range(sizes[q])]

    # reduce_scatter: rank r contributes (r+1) * [0..W*2); rank q keeps rows [2q, 2q+2)
    inp = (r + 1) * torch.arange(2 * w, dtype=torch.float32)
    scale = sum(q + 1 for q in range(w))
    rs = g.reduce_scatter(inp)
    assert rs.tolist() == [scale * (2 * r + i) for i in range(2)]
    ref = g._reduce_scatter_via_all_reduce(torch.empty(2), inp)  # the slow reference
    assert torch.equal(rs, ref)
    rsv = g.reduce_scatter_v(inp[: sum(sizes)], sizes)
    offset = sum(sizes[:r])
    assert rsv.tolist() == [scale * (offset + i) for i in range(sizes[r])]

    # all_to_all_single with uneven splits: rank r sends (r + d) % 3 rows to rank d,
    # each row carrying value 1000*r + d so the receiver can check its origin.
    in_splits = [(r + d) % 3 for d in range(w)]
    out_splits = [(s + r) % 3 for s in range(w)]
    inp = torch.cat([torch.full((in_splits[d], 2), 1000.0 * r + d) for d in range(w)])
    out = torch.empty(sum(out_splits), 2)
    g.all_to_all_single(out, inp, out_splits, in_splits)
    expect = [1000.0 * s + r for s in range(w) for _ in range(out_splits[s])]
    assert out[:, 0].tolist() == expect

    b = torch.full((3,), float(r))
    g.broadcast(b, src=w - 1)
    assert b.tolist() == [w - 1.0] * 3

    # ring send/recv (even ranks send first so gloo's blocking send cannot deadlock)
    nxt, prv = (r + 1) % w, (r - 1) % w
    got = torch.empty(2)
    if r % 2 == 0:
        g.send(torch.tensor([r, tag]), nxt)
        g.recv(got, prv)
    else:
        g.recv(got, prv)
        g.send(torch.tensor([r, tag]), nxt)
    assert got.tolist() == [prv, tag]

    assert g.all_gather_object({"rank": r, "tag": tag}) == [
        {"rank": q, "tag": tag} for q in range(w)
    ]
    g.barrier()


def _groups_worker(rank: int, world_size: int, ports: list[int]) -> dict:
    assert not dist.is_initialized()
    base_conns = _tcp_connections()
    # A: all 3 ranks; B: ranks 0 and 1 only, on another port; C shares A's store.
    a = StatelessGroup.create(host="127.0.0.1", port=ports[0], rank=rank, world_size=3, prefix="a")
    b = None
    if rank < 2:
        b = StatelessGroup.create(
            host="127.0.0.1", port=ports[1], rank=rank, world_size=2, prefix="b"
        )
    c = StatelessGroup.create(
        host="127.0.0.1", port=0, rank=rank, world_size=3, store=a.store, prefix="c"
    )
    assert _tcp_connections() > base_conns  # the groups hold connections
    for _ in range(2):  # interleave: the groups are independent
        _check_collectives(a, 0.5)
        if b is not None:
            _check_collectives(b, 0.25)
        _check_collectives(c, 0.75)
    c.destroy()
    _check_collectives(a, 0.5)  # destroying C (sharing A's store) leaves A working
    # D: abortable (a control and an epoch): its own reduce-scatter and in-place paths.
    d = StatelessGroup.create(
        host="127.0.0.1",
        port=0,
        rank=rank,
        world_size=3,
        store=a.store,
        prefix="d",
        control=CollectiveControl(),
        epoch=0,
    )
    assert d.abortable
    _check_collectives(d, 0.125)
    d.destroy()

    for g in (a, b):
        if g is not None:
            g.barrier()
            g.destroy()
            g.destroy()  # idempotent
            with pytest.raises(RuntimeError, match="destroyed"):
                g.all_reduce(torch.zeros(1))
    # Peers close their ends on their own schedule: wait until ours are all gone.
    deadline = time.monotonic() + 60
    while (conns_after_destroy := _tcp_connections()) != base_conns:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)

    # Re-create on the same ranks and the same port (A's store server was closed).
    a2 = StatelessGroup.create(host="127.0.0.1", port=ports[0], rank=rank, world_size=3, prefix="a")
    _check_collectives(a2, 0.5)
    a2.barrier()
    a2.destroy()
    return {
        "initialized": dist.is_initialized(),
        "base": base_conns,
        "after_destroy": conns_after_destroy,
    }


def test_groups_coexist_destroy_recreate(run_ranks_on_ports):
    results = run_ranks_on_ports(_groups_worker, 3, num_ports=2, timeout_s=240)
    for res in results:
        assert res["initialized"] is False  # torch's default group never touched
        assert res["after_destroy"] == res["base"]  # no socket leaked by destroy


# The group's timeout in the test below: every collective, and the rendezvous, must finish
# within it. The rendezvous starts once both ranks are known to be up, so it takes
# milliseconds; the missing peer's all-reduce then fails after exactly this long.
COLLECTIVE_TIMEOUT_S = 2.0
DONE, ACK = "rank0-timed-out", "rank1-saw-it"


def _timeout_worker(rank: int, world_size: int, port: int) -> str:
    # Rendezvous on a store with a generous timeout first: the ranks' processes start
    # seconds apart on a loaded machine, which the short timeout must not have to cover.
    store = create_store("127.0.0.1", port, rank=rank, world_size=world_size, timeout_s=120)
    store.set(f"up{rank}", "1")  # then wait for the others: every process is running
    store.wait([f"up{r}" for r in range(world_size)], datetime.timedelta(seconds=120))
    g = StatelessGroup.create(
        host="127.0.0.1",
        port=0,
        rank=rank,
        world_size=world_size,
        store=store,
        prefix="t",
        timeout_s=COLLECTIVE_TIMEOUT_S,
    )
    g.barrier()
    message = ""
    if rank == 0:  # rank 1 never joins this all-reduce: rank 0 must fail, not hang
        with pytest.raises(RuntimeError) as err:
            g.all_reduce(torch.ones(1))
        message = str(err.value)
        store.set(DONE, "1")
        store.wait([ACK], datetime.timedelta(seconds=120))  # rank 0 hosts the store
    else:  # stay in the group (not destroyed, not exited) until rank 0 has timed out
        store.wait([DONE], datetime.timedelta(seconds=120))
        store.set(ACK, "1")
    g.destroy()
    return message


def test_collective_times_out_when_a_peer_is_missing(run_ranks_on_ports):
    messages = run_ranks_on_ports(_timeout_worker, 2, timeout_s=240)
    # A timeout (of the group's timeout_s), not another failure such as a closed peer.
    assert re.search(r"timed out", messages[0], re.I), messages[0]


# A peer that froze: the group's own timeout is far away; only the abort ends the wait.
FROZEN_PEER_TIMEOUT_S = 120.0
RELEASED = "rank0-released"


def _abort_worker(rank: int, world_size: int, port: int) -> list[str]:
    store = create_store("127.0.0.1", port, rank=rank, world_size=world_size, timeout_s=120)
    store.set(f"up{rank}", "1")
    store.wait([f"up{r}" for r in range(world_size)], datetime.timedelta(seconds=120))
    control = CollectiveControl()
    groups = [
        StatelessGroup.create(
            host="127.0.0.1",
            port=0,
            rank=rank,
            world_size=world_size,
            store=store,
            prefix=f"ab{i}",
            timeout_s=FROZEN_PEER_TIMEOUT_S,
            control=control,
            epoch=i,
        )
        for i in range(3)
    ]
    for g in groups:
        g.barrier()
    if rank == 1:  # the frozen peer: in the groups, in no collective, until rank 0 is done
        store.wait([RELEASED], datetime.timedelta(seconds=60))
        return []
    me, causes = threading.get_ident(), []
    calls = [  # one collective per group; the abort of each epoch ends its wait
        lambda g: g.all_reduce(torch.ones(4)),
        lambda g: g.reduce_scatter(torch.ones(4)),  # gloo's own ignores a wait timeout
        lambda g: g.all_gather(torch.ones(2)),
    ]
    for epoch, (g, call) in enumerate(zip(groups, calls)):

        def abort_once_waiting(epoch: int = epoch) -> None:
            wait_until(lambda: control.is_waiting(me), 60)
            control.abort(epoch + 1, f"recovery of epoch {epoch + 1}")

        t = threading.Thread(target=abort_once_waiting)
        t.start()
        with pytest.raises(GroupFailure, match="aborted") as err:
            call(g)
        t.join()
        causes.append(str(err.value))
        with pytest.raises(GroupFailure, match="aborted"):  # and every later one at once
            g.all_reduce(torch.ones(1))
        g.destroy()  # never waits for the abandoned operation (rank 1 is still silent)
    store.set(RELEASED, "1")  # only now: had a destroy waited, rank 1 would have given up
    return causes


def test_an_abort_ends_a_collective_a_frozen_peer_holds(run_ranks_on_ports):
    causes, _ = run_ranks_on_ports(_abort_worker, 2, timeout_s=240)
    assert [c.split("aborted: ")[1] for c in causes] == [
        "recovery of epoch 1",
        "recovery of epoch 2",
        "recovery of epoch 3",
    ]


def test_create_rejects_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        StatelessGroup.create(host="127.0.0.1", port=1, rank=0, world_size=1, backend="mpi")
    with pytest.raises(ValueError, match="rank"):
        StatelessGroup.create(host="127.0.0.1", port=1, rank=2, world_size=2)
    assert not dist.is_initialized()


def test_single_rank_group_without_peers():
    # Port 0: the single rank's store binds any free port (no peer needs to know it).
    g = StatelessGroup.create(host="127.0.0.1", port=0, rank=0, world_size=1)
    t = torch.arange(4.0)
    assert g.all_reduce(t.clone()).tolist() == t.tolist()
    assert g.all_gather(t).tolist() == t.tolist()
    assert g.reduce_scatter(t).tolist() == t.tolist()
    g.destroy()
    assert not dist.is_initialized()


def _listening() -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    }


def _addresses() -> list[str]:
    """Loopback, and this machine's first other IPv4 address if it has one (a stand-in
    for a multi-host ``--data-parallel-address``)."""
    others = [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback
    ]
    return ["127.0.0.1", *others[:1]]


@pytest.mark.parametrize("host", _addresses())
def test_store_and_gloo_listen_on_the_store_host_only(host):
    """torch's TCPStore server listens on every interface by itself; ours listens on the
    address it is given, and the gloo groups on it accept peers there only."""
    before = _listening()
    store = create_store(host, 0, rank=0, world_size=2, timeout_s=60)
    port = store.port
    results: dict[int, list[float]] = {}

    def rank(r: int) -> None:
        own = store if r == 0 else create_store(host, port, rank=1, world_size=2, timeout_s=60)
        g = StatelessGroup.create(host=host, port=0, rank=r, world_size=2, store=own, prefix="x")
        t = torch.tensor([r + 1.0])
        results[r] = g.all_reduce(t).tolist()
        g.barrier()
        results[r + 10] = sorted(_listening() - before)  # while both groups are alive
        g.barrier()
        g.destroy()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results[0] == results[1] == [3.0]
    opened = results[10]
    assert (host, port) in opened and len(opened) >= 3, opened  # the store, gloo's two ranks
    assert {ip for ip, _ in opened} == {host}, opened
