"""The job's rendezvous port is chosen on rank 0's node, not on the server's machine: the server
starts rank 0's node with ``master_port=0`` and the other nodes once that node announced its port
(backend/server/scheduling.py, backend/agent/agent.py). A real Service on a real SQLite file; the
agents are links that record what the server sends them."""
from __future__ import annotations

import time

import pytest

from backend.agent.agent import free_port
from backend.server.service import Service
from backend.server.store import Store
from singularity_sdk.protocol import AgentEvent, AgentHello, DeviceInfo, EventType, StartJob, SubmitRequest


class Link:
    def __init__(self, node: str) -> None:
        self.node = node
        self.sent: list = []

    def send(self, message) -> None:
        self.sent.append(message)

    def close(self, code=None, reason=None) -> None:
        pass

    def starts(self) -> list[StartJob]:
        return [m for m in self.sent if isinstance(m, StartJob)]


@pytest.fixture
def service(tmp_path):
    svc = Service(Store(tmp_path / "state.db"))
    links = {}
    for node in ("node-1", "node-2"):
        links[node] = link = Link(node)
        svc.agent_hello(link, AgentHello(node=node, instance=f"{node}-i", address="127.0.0.1",
                                         devices=[DeviceInfo(index=0, kind="cpu", name="cpu slot")]))
    svc.create_user("admin", "alice")
    return svc, links


def rendezvous(job, node_seq: int, port: int) -> AgentEvent:
    return AgentEvent(agent_seq=node_seq, job_id=job.id, attempt=job.attempt, type=EventType.RENDEZVOUS,
                      time=time.time(), data={"port": port})


def placed_on_two_nodes(svc):
    """A job of two ranks, placed on both nodes; and rank 0's node."""
    job = svc.submit("alice", SubmitRequest(source="pass", gpus=2))
    svc.schedule_now()
    job = svc.job("alice", job.id)
    return job, next(p.node for p in job.placement if 0 in p.ranks)


def test_the_other_nodes_start_only_once_rank_0s_node_named_its_port(service):
    svc, links = service
    job, host = placed_on_two_nodes(svc)
    other = next(n for n in links if n != host)
    [first] = links[host].starts()
    assert first.master_port == 0 and [r.rank for r in first.ranks] == [0]
    assert links[other].starts() == []

    # the other node may not choose: refused, nothing started
    refused: list[str] = []
    svc.agent_events(other, [rendezvous(job, 1, 41234)], reject=lambda seq, why: refused.append(why))
    assert refused and "only rank 0's node" in refused[0]
    assert links[other].starts() == []

    svc.agent_events(host, [rendezvous(job, 1, 41234)])
    [second] = links[other].starts()
    assert (second.master_port, second.master_addr, [r.rank for r in second.ranks]) == (41234, "127.0.0.1", [1])
    # the same start the host got, but for its own ranks and with the port filled in
    assert second.model_dump(exclude={"ranks", "master_port"}) == first.model_dump(exclude={"ranks", "master_port"})
    events = [e for e in svc.store.events(job.id, 0) if e.type == EventType.RENDEZVOUS]
    assert [e.data for e in events] == [{"node": host, "port": 41234}]


def test_a_port_out_of_range_is_refused_and_nothing_starts(service):
    svc, links = service
    job, host = placed_on_two_nodes(svc)
    refused: list[str] = []
    svc.agent_events(host, [rendezvous(job, 1, 70000)], reject=lambda seq, why: refused.append(why))
    assert refused and "1-65535" in refused[0]
    assert sum(len(link.starts()) for link in links.values()) == 1


def test_a_job_on_one_node_is_started_at_once_and_its_node_picks_the_port(service):
    svc, links = service
    job = svc.submit("alice", SubmitRequest(source="pass", gpus=1, ranks=2))
    svc.schedule_now()
    [start] = [s for link in links.values() for s in link.starts()]
    assert start.master_port == 0 and [r.rank for r in start.ranks] == [0, 1]


def test_free_port_is_bindable_on_every_interface():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("", port))
