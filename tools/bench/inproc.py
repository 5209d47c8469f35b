"""A verifier Engine's draft link straight into a DraftWorker's stream, in one process (no
gRPC): engine tests and benchmarks/eagle_tree.py run the real proposers for the real engine
this way. It counts what went over it (proposals, tree nodes, features)."""
import asyncio

from tandem.spec import Proposal


class WorkerLink:
    """A verifier's draft link straight into a DraftWorker's stream."""

    def __init__(self, engine, worker, die_after=None):
        self.engine, self.worker, self.address = engine, worker, "inproc"
        self.stream = worker.open_stream()
        self.alive, self.proposals, self.die_after = True, 0, die_after
        self.features_rows = 0
        self.features: dict[str, dict[int, bytes]] = {}  # session -> position -> its row
        self.tree_nodes = 0  # proposals that are nodes of a token tree
        self.siblings = 0  # ... whose parent already had a child (a real tree, not a chain)
        self._parents: set[tuple[str, int, int]] = set()
        self._pump = asyncio.get_running_loop().create_task(self._run())

    def send(self, msg):
        if self.alive:
            f = getattr(msg, "features", None)
            if f is not None:
                self.features_rows += f.rows
                rows = self.features.setdefault(msg.session_id, {})
                width = 2 * f.hidden_size
                for i in range(f.rows):
                    rows[f.start_position + i] = f.data[i * width:(i + 1) * width]
            self.worker.handle(self.stream, msg)

    async def _run(self):
        while self.alive:
            item = await self.stream.get()
            if item is None:
                return
            self.engine.drafts.on_reply(self, item)
            self.proposals += isinstance(item, Proposal)
            node = getattr(item, "tree", None)
            if node is not None:
                self.tree_nodes += 1
                key = (item.session_id, item.epoch, node.parent)
                self.siblings += key in self._parents
                self._parents.add(key)
            if self.die_after is not None and self.proposals >= self.die_after:
                self.alive = False  # the worker vanishes mid-stream
                self.engine.drafts.on_link_broken(self)


class OnePool:
    def __init__(self, link):
        self.link = link

    async def get(self, hint="", avoid=()):  # DraftPool.get: none when its one is avoided
        alive = self.link.alive and getattr(self.link, "address", None) not in avoid
        return self.link if alive else None

    def mark_failed(self, address, link=None):  # DraftPool's signature: nothing to mark
        pass

    async def close(self):
        pass
