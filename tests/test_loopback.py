"""A notebook's world can be joined from this machine only: everything it listens on is a loopback address.

The notebook hosts the rendezvous store and each rank listens for its peers (gloo). Any of these on a network
address would let another machine read the store's keys or connect to a rank, so while a real ``World`` runs
we list the listening TCP sockets of this process and of every process below it (forkserver, ranks).
"""

import ipaddress

import psutil
import pytest

from conftest import gone
from course_lib import World

pytestmark = pytest.mark.ranks   # run apart with: pytest -m ranks


def listening(process: psutil.Process) -> list:
    """The local addresses on which ``process`` listens for TCP connections (IPv4 and IPv6)."""
    connections = getattr(process, "net_connections", None) or process.connections  # psutil < 6: connections
    try:
        return [c.laddr for c in connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    except psutil.NoSuchProcess:
        return []


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])  # an IPv6 address may carry a zone: fe80::1%eth0
    if address.version == 6 and address.ipv4_mapped:  # ::ffff:127.0.0.1
        address = address.ipv4_mapped
    return address.is_loopback


def sockets_of_this_process_tree() -> dict[int, list]:
    me = psutil.Process()
    return {p.pid: listening(p) for p in [me, *me.children(recursive=True)]}


def assert_loopback_only(world: World) -> None:
    pids = world.status()["pids"]
    sockets = sockets_of_this_process_tree()
    assert set(pids) <= set(sockets), "the ranks should be among this process's descendants"
    # The scan finds what it should, so that an empty result cannot pass for a safe one:
    assert world.group.store_port in [a.port for a in sockets[psutil.Process().pid]], "the store was not found"
    assert all(sockets[pid] for pid in pids), f"a rank listens on nothing (gloo's listener expected): {sockets}"
    exposed = {pid: [f"{a.ip} port {a.port}" for a in addresses if not is_loopback(a.ip)]
               for pid, addresses in sockets.items()}
    assert not any(exposed.values()), f"listening on a network address: {exposed}"


def test_the_store_and_the_ranks_listen_on_loopback_only_also_after_the_group_is_rebuilt():
    with World(2) as world:
        pids = world.status()["pids"]
        assert [r.value for r in world.exec("dist.barrier()\nrank").results] == ["0", "1"]  # the group is up
        assert_loopback_only(world)

        # A rank fails while its peer waits in a collective: every rank joins a new group, made afresh.
        outcome = world.exec("if rank == 1:\n    raise ValueError('rank one fails')\ndist.all_reduce(torch.ones(1))")
        assert outcome.world == "recovered" and world.status()["generation"] == 1, outcome.note
        assert world.status()["pids"] == pids
        assert_loopback_only(world)
    assert gone(pids), "rank processes left behind"


def test_every_store_key_of_a_world_starts_with_a_random_word_of_its_own():
    """The store has no authentication, so its keys are not guessable: each world's start with 128 random bits
    (WorkerGroup.store_key). A local process that writes the plain names ("generation0/arrived/0") touches none
    of them, and a rebuild (a new generation) still finds its ranks."""
    import torch.distributed as dist

    from course_lib.runtime.rank_process import arrival_key

    with World(2) as first, World(2) as second:
        keys = first.group.store_key, second.group.store_key
        assert len(keys[0]) == 32 and keys[0] != keys[1]
        store = first.group._store
        assert store.check([arrival_key(0, 0, keys[0])]) and not store.check(["generation0/arrived/0"])
        intruder = dist.TCPStore("127.0.0.1", first.group.store_port, is_master=False)
        intruder.set("generation1/arrived/0", "")                     # the next generation's plain name
        assert first._rejoin() == [] and first.run(lambda rank, world_size: rank) == [0, 1]
