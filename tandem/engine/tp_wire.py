"""What crosses the network between a tensor-parallel group's ranks, made safe (issue 47).

The rendezvous store listens on the host of the master address only (loopback unless told
otherwise; a wildcard host "::" or "0.0.0.0" is an explicit choice), not torch's default of
every interface. Rank 0's control messages are JSON of ints, bools and lists, checked field by
field before a worker acts on them, broadcast as a length and a uint8 tensor: a worker never
unpickles bytes from the network (torch's broadcast_object_list would).
"""
from __future__ import annotations

import datetime
import json
import socket

import torch
import torch.distributed as dist

from tandem.engine.model_runner import SeqChunk
from tandem.netaddr import split_host_port

MAX_MESSAGE_BYTES = 64 << 20  # a step's chunks are kilobytes; a bigger length is garbage
WILDCARDS = ("::", "0.0.0.0")
# Each kind's fields after the kind, in order; "chunks" is a list of SeqChunk dicts.
FIELDS = {"ping": (), "stop": (), "setup": ("int", "int"), "forward": ("chunks", "bool"),
          "move_kv": ("ints", "ints", "ints")}
CHUNK_FIELDS = ("token_ids", "start_pos", "block_table", "num_logits", "parents")


class ControlMessageError(ValueError):
    """Bytes that are not a control message rank 0 could have sent."""


def encode(message: tuple) -> bytes:
    """Rank 0's message (kind, *fields) as JSON bytes."""
    kind, *fields = message
    if FIELDS.get(kind) is None or len(fields) != len(FIELDS[kind]):
        raise ControlMessageError(f"not a control message: {kind!r} with {len(fields)} fields")
    out = [kind]
    for shape, value in zip(FIELDS[kind], fields):
        out.append([_chunk_dict(c) for c in value] if shape == "chunks" else value)
    return json.dumps(out, separators=(",", ":")).encode()


def decode(data: bytes) -> tuple:
    """The message encode wrote; anything else is a ControlMessageError."""
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ControlMessageError(f"not JSON: {exc}") from None
    if not isinstance(raw, list) or not raw or raw[0] not in FIELDS:
        raise ControlMessageError("not a [kind, ...] list of a known kind")
    kind, fields = raw[0], raw[1:]
    if len(fields) != len(FIELDS[kind]):
        raise ControlMessageError(f"{kind}: {len(fields)} fields, expected {len(FIELDS[kind])}")
    return (kind, *(_check(shape, value, kind) for shape, value in zip(FIELDS[kind], fields)))


def _chunk_dict(chunk: SeqChunk) -> dict:
    out = {name: getattr(chunk, name) for name in CHUNK_FIELDS}
    out["parents"] = None if chunk.parents is None else list(chunk.parents)
    return out


def _is_int(value) -> bool:
    return type(value) is int  # not bool, which is an int to isinstance


def _check(shape: str, value, kind: str):
    if shape == "int" and _is_int(value) or shape == "bool" and type(value) is bool:
        return value
    if shape == "ints" and isinstance(value, list) and all(map(_is_int, value)):
        return value
    if shape == "chunks" and isinstance(value, list):
        return [_chunk(c, kind) for c in value]
    raise ControlMessageError(f"{kind}: expected {shape}, got {type(value).__name__}")


def _chunk(raw, kind: str) -> SeqChunk:
    if not isinstance(raw, dict) or set(raw) != set(CHUNK_FIELDS):
        raise ControlMessageError(f"{kind}: a chunk must have exactly {CHUNK_FIELDS}")
    ints = [raw["token_ids"], raw["block_table"], raw["parents"] or []]
    if not all(isinstance(v, list) and all(map(_is_int, v)) for v in ints) or not (
            _is_int(raw["start_pos"]) and _is_int(raw["num_logits"])):
        raise ControlMessageError(f"{kind}: a chunk's fields must be ints and lists of ints")
    parents = None if raw["parents"] is None else tuple(raw["parents"])
    try:
        return SeqChunk(raw["token_ids"], raw["start_pos"], raw["block_table"],
                        raw["num_logits"], parents)
    except ValueError as exc:  # SeqChunk's own checks
        raise ControlMessageError(f"{kind}: {exc}") from None


def broadcast_message(message: tuple, pg) -> None:
    """Rank 0: send `message` to every rank of the (gloo) group `pg`."""
    data = encode(message)
    dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=pg)
    dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=pg)


def receive_message(pg) -> tuple:
    """Another rank: the next message rank 0 broadcasts (checked; never unpickled)."""
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=pg)
    n = int(size.item())
    if not 0 < n <= MAX_MESSAGE_BYTES:
        raise ControlMessageError(f"a control message of {n} bytes")
    buf = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src=0, group=pg)
    return decode(buf.numpy().tobytes())


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host` only (a wildcard: every address, IPv4 too)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if host not in WILDCARDS:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def rendezvous_store(rank: int, world_size: int, init_method: str, timeout_s: float):
    """The group's TCPStore for a tcp://host:port init method: rank 0 serves it on `host`
    only, every rank dials it there (a wildcard's own ranks dial loopback)."""
    host, port = split_host_port(init_method.removeprefix("tcp://"))
    dial = "localhost" if host in WILDCARDS else host
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank != 0:
        return dist.TCPStore(dial, port, world_size, False, timeout)
    try:
        try:
            sock = listen(host, port)
        except OSError:
            if host != "::":
                raise
            sock = listen("0.0.0.0", port)  # a host without IPv6: every IPv4 address
    except OSError as exc:
        raise OSError(f"the tensor-parallel rendezvous cannot listen on {host} port {port}: "
                      f"{exc}") from exc
    # The store owns the descriptor from here (detach: Python never closes it under it).
    return dist.TCPStore(dial, port, world_size, True, timeout, master_listen_fd=sock.detach(),
                         use_libuv=True)
