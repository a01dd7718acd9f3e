"""A multi-node Ray cluster on this machine (docs/architecture.md#launchers), shared by a test module.

``ray.cluster_utils.Cluster``: a head node with no CPU (nothing is placed on it; the
frontend's driver connects there) and worker nodes of one logical CPU each, so every
engine rank (one CPU bundle) needs a node of its own and a test decides where ranks can
go by adding and removing nodes. Everything listens on loopback
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, set before Ray starts). Node deaths are seen in
about a second (health checks every 500 ms, two missed), not Ray's default half minute.

Skipped when Ray is not installed (``pip install 'tidal[ray]'``; the ``test`` extra has it).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.waiting import wait_until

# Read once, when Ray is first imported: before that, in every process of these tests (the
# servers they start inherit it). Ray then takes loopback as every node's address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# Loopback only: no token authentication, so no token file is written to ~/.ray.
os.environ["RAY_AUTH_MODE"] = "disabled"
# Ray's session directories of these tests. Removed at teardown, and again when the
# process exits: Ray's own exit hook writes into a session directory once more. This hook
# is registered before Ray is imported (so it runs after Ray's: atexit runs in reverse).
_TEMP_DIRS: list[str] = []
atexit.register(lambda: [shutil.rmtree(d, ignore_errors=True) for d in _TEMP_DIRS])
LOOPBACK = "127.0.0.1"
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # per node: Ray's least is 75 MiB
SYSTEM_CONFIG = {"health_check_period_ms": 500, "health_check_failure_threshold": 2}


class RayCluster:
    """The cluster plus what tests need of it: its address, adding one-CPU nodes,
    removing one, and the resources free now."""

    def __init__(self, num_nodes: int) -> None:
        import ray
        from ray.cluster_utils import Cluster

        # Ray's session files (logs, sockets) in a directory of the test's own, removed at
        # shutdown, not in /tmp/ray.
        self.temp_dir = tempfile.mkdtemp(prefix="tidal-ray-")
        _TEMP_DIRS.append(self.temp_dir)
        # Ray's default temp directory too (its address file; the servers inherit it).
        self._tmpdir_before = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = self.temp_dir
        os.makedirs(os.path.join(self.temp_dir, "ray"))  # Ray writes it, but does not make it
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "temp_dir": self.temp_dir,
                "num_cpus": 0,
                "node_ip_address": LOOPBACK,
                "include_dashboard": False,
                "object_store_memory": OBJECT_STORE_BYTES,
                "_system_config": SYSTEM_CONFIG,
            },
        )
        self.address = self.cluster.address
        self.nodes: list = []  # worker nodes, in the order they were added
        for _ in range(num_nodes):
            self.add_node()
        ray.init(address=self.address, namespace="tidal-tests")
        self.cluster.wait_for_nodes()

    def add_node(self) -> str:
        """A node of one CPU; its Ray node id, once the cluster sees it."""
        node = self.cluster.add_node(
            num_cpus=1,
            node_ip_address=LOOPBACK,
            object_store_memory=OBJECT_STORE_BYTES,
            temp_dir=self.temp_dir,
        )
        self.cluster.wait_for_nodes()
        self.nodes.append(node)
        return node.node_id

    def remove_node(self, node_id: str) -> None:
        """Kill a node's processes (its raylet and what runs there), as a host lost."""
        (node,) = [n for n in self.nodes if n.node_id == node_id]
        self.cluster.remove_node(node, allow_graceful=False)
        self.nodes.remove(node)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        if self._tmpdir_before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = self._tmpdir_before

        def removed() -> bool:  # a Ray process still exiting may write there once more
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            return not os.path.exists(self.temp_dir)

        assert wait_until(removed, 30)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    pytest.importorskip("ray")
    cluster = RayCluster(num_nodes=2)
    try:
        yield cluster
    finally:
        cluster.shutdown()
