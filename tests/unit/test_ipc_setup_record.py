"""The CUDA IPC set-up's record in the job's store: every rank states its operand bytes, collective,
root and rank count beside its handle, and a peer that differs fails the set-up with an error naming
both (issue 31: a process whose operand had another shape hung the 4-process job on 4 x H200)."""
from __future__ import annotations

import numpy as np
import pytest

from jax_blink.lowering import processes


def test_a_record_round_trips_its_payload():
    payload = bytes(np.random.default_rng(3).integers(0, 256, 97, dtype=np.uint8))
    rec = processes.ipc_record(4096, "allreduce", None, 4, payload)
    assert processes.ipc_unpack(rec, 4096, "allreduce", 0, 4, comm_id=7, rank=0, peer=1, peer_process=1) == payload


@pytest.mark.parametrize("theirs,what", [
    (dict(nbytes=8192), "8192 bytes per rank"),
    (dict(collective="allgather"), "allgather"),
    (dict(collective="broadcast", root=2), "root 2"),
    (dict(n=3), "among 3 ranks"),
])
def test_a_peer_with_another_operand_fails_with_both_named(theirs, what):
    mine = dict(nbytes=4096, collective="allreduce" if "collective" not in theirs else "broadcast", root=0, n=4)
    if theirs.get("collective") == "allgather":
        mine["collective"] = "allreduce"
    peer = {**mine, **theirs}
    rec = processes.ipc_record(peer["nbytes"], peer["collective"], peer["root"], peer["n"], b"handle")
    with pytest.raises(RuntimeError) as e:
        processes.ipc_unpack(rec, mine["nbytes"], mine["collective"], mine["root"], mine["n"], comm_id=11, rank=0,
                             peer=3, peer_process=3)
    text = str(e.value)
    assert "rank 3 (process 3)" in text and what in text and "4096 bytes per rank" in text
    assert "same shape and dtype" in text


def test_a_record_of_another_format_is_refused():
    with pytest.raises(RuntimeError, match="another format"):
        processes.ipc_unpack(b"xy", 16, "allreduce", 0, 2, comm_id=1, rank=0, peer=1, peer_process=1)


def test_ipc_setup_fails_every_process_before_opening_a_mismatched_peer(monkeypatch):
    """Two processes' ranks of one call site, through a fake store and a fake CUDA module: the
    process whose peer brings twice the bytes raises before any handle is opened."""
    store, opened = {}, []

    class Client:
        def key_value_set_bytes(self, key, value):
            store[key] = value

        def blocking_key_value_get_bytes(self, key, timeout_ms):
            return store[key]

    class Module:
        def ipc_create(self, comm_id, g, r, n, nbytes, dev, kind, root, procs):
            return f"handle-{r}".encode()

        def ipc_open(self, comm_id, g, r, q, payload):
            opened.append((r, q, payload))

    class Dev:
        def __init__(self, i):
            self.id, self.local_hardware_id = i, i

    monkeypatch.setattr(processes, "_client", lambda: Client())
    monkeypatch.setattr(processes._backends, "module", lambda platform: Module())
    monkeypatch.setattr(processes.jax, "local_devices", lambda: [Dev(0), Dev(1)])
    rank_process, rank_device = np.array([0, 1]), np.array([0, 1])
    # Process 1 (rank 1) published its record of 8192 bytes; process 0 (rank 0) sets up with 4096.
    store[processes._IPC_KEY.format(5, 0, 1)] = processes.ipc_record(8192, "allreduce", None, 2, b"handle-1")
    monkeypatch.setattr(processes.jax, "process_index", lambda: 0)
    with pytest.raises(RuntimeError, match=r"rank 1 \(process 1\) calls this collective with 8192 bytes"):
        processes.ipc_setup(5, 2, 4096, rank_process, rank_device)
    assert opened == []
    # The same sizes: the peer's handle is opened, without the header.
    store[processes._IPC_KEY.format(6, 0, 1)] = processes.ipc_record(4096, "allreduce", None, 2, b"handle-1")
    processes.ipc_setup(6, 2, 4096, rank_process, rank_device)
    assert opened == [(0, 1, b"handle-1")]
    log = processes.ipc_setup_log()[-2:]  # both set-ups, how each ended
    assert [(e["comm_id"], e["n"], e["bytes"]) for e in log] == [(5, 2, 4096), (6, 2, 4096)]
    assert log[0]["outcome"].startswith("RuntimeError: ") and "8192 bytes" in log[0]["outcome"]
    assert log[1]["outcome"] == "ok"
