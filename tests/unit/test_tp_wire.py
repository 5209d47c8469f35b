"""A tensor-parallel group's wire (issue 47): rank 0's control messages are JSON checked
field by field (a worker never unpickles bytes), and the rendezvous store listens on the
master's host only."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from tandem.engine.model_runner import SeqChunk
from tandem.engine.tp import init_group
from tandem.engine.tp_wire import ControlMessageError, decode, encode
from tandem.netaddr import free_port

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [("ping",), ("stop",), ("setup", 120, 16),
            ("forward", [SeqChunk([5, 6, 7], 0, [3, 1], num_logits=3),
                         SeqChunk([9, 8, 2], 11, [4], parents=(-1, 0, 0))], True),
            ("forward", [SeqChunk([1], 40, [0, 2, 5])], False),
            ("move_kv", [7, 6, 5], [25, 27], [25, 26])]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: m[0])
def test_every_control_message_round_trips(message):
    assert decode(encode(message)) == message


class _Payload:
    def __reduce__(self):
        return os.getcwd, ()


GARBAGE = {
    "random bytes": bytes(range(256)),
    "a pickle": pickle.dumps(("forward", _Payload())),
    "not a list": b'{"kind": "ping"}',
    "unknown kind": b'["exec", "rm -rf /"]',
    "too many fields": b'["ping", 1]',
    "a bool for an int": b'["setup", true, 16]',
    "a float in a list": b'["move_kv", [1.5], [2], [3]]',
    "a string chunk": b'["forward", ["abc"], false]',
    "an extra chunk field": json.dumps(["forward", [
        {"token_ids": [1], "start_pos": 0, "block_table": [0], "num_logits": 1,
         "parents": None, "code": "x"}], False]).encode(),
    "an empty chunk": json.dumps(["forward", [
        {"token_ids": [], "start_pos": 0, "block_table": [0], "num_logits": 0,
         "parents": None}], False]).encode(),
}


@pytest.mark.parametrize("name", list(GARBAGE))
def test_garbage_is_refused(name):
    with pytest.raises(ControlMessageError):
        decode(GARBAGE[name])


# Rank 1: join the group and take one message, reporting what it got.
CHILD = """
import json, sys
from tandem.engine.tp import Control, init_group
group, pg, _ = init_group(1, 2, sys.argv[1], "gloo", 20.0)
try:
    out = {"message": repr(Control(group, pg).recv())}
except Exception as exc:
    out = {"error": type(exc).__name__}
print(json.dumps(out), flush=True)
"""


@pytest.mark.parametrize("host, bound_to", [("127.0.0.1", {"127.0.0.1"}),
                                             ("[::]", {"::", "0.0.0.0"})])
def test_rendezvous_on_the_host_only_and_no_pickle_reaches_a_rank(host, bound_to, tmp_path):
    """Rank 0 here, rank 1 a subprocess. The store's socket is bound to the master's host
    (torch's own binds "::" whatever it is; a wildcard is an explicit choice, dialed on
    loopback); a pickled payload broadcast as broadcast_object_list frames it (a length,
    then the bytes) is refused by the worker, not run."""
    port, marker = free_port(), tmp_path / "ran"
    init = f"tcp://{host}:{port}"
    child = subprocess.Popen([sys.executable, "-c", CHILD, init], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        _, pg, _ = init_group(0, 2, init, "gloo", 20.0)
        bound = {c.laddr.ip for c in psutil.Process().net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert len(bound) == 1 and bound <= bound_to
        payload = pickle.dumps([_Mkdir(str(marker))])
        dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=0, group=pg)
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0,
                       group=pg)
        out, _ = child.communicate(timeout=60)
    finally:
        child.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert json.loads(out.strip().splitlines()[-1]) == {"error": "ControlMessageError"}
    assert not marker.exists()


class _Mkdir:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)
