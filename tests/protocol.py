"""A CPU backend that checks every call the engine makes against what CUDA would need.

On CUDA an operation's device work is ordered by events: a stream that waits for an event
that was never recorded does not wait at all, memory released before its copy has finished
is corrupted, and a collective whose stream was never ordered after the gradients' event
all-reduces whatever the buffer held. All of it silently. `CheckingBackend` runs a schedule
on the CPU and records the first call that would be wrong on CUDA, against the rules of the
`Backend` protocol (karma/runtime/backends/backend.py):

- `order_after(deps, ...)`: every dependency has been issued (its event recorded);
- `release_after(op, ...)`: the op has been issued; the release is then held, as on a GPU
  that is behind, until the engine says the schedule frees it (`release_due`) or the
  replay ends, and a compute op that starts while a release of an earlier stage's op on a
  barrier stream is still held is a violation (runtime/backends/backend.py, [Note:
  released where the schedule frees]);
- `allocated(op)`: called once, before the op's stream orders itself after it;
- `issued(op)`: once per op per replay, and every op by the end of the replay, or of the
  next one for the updates that the engine leaves running into it (runtime/replay/update.py,
  [Note: updates overlapped with the next forward]); ops are known by the engine's ids,
  unique across replays;
- the `net` stream (several ranks, runtime/distributed/exchange.py): each collective runs on
  a net stream already ordered after the event of the op that made its block's gradients final (the
  block's backward, or its gradients' copy to the host where they are all-reduced there)
  and after its flat buffer's allocation; and every all-reduce that ran a collective hands
  its buffer's release to `release_after`, after its issue.

Give it the schedule it runs (op kinds and stages are looked up by id); `collective` may be
replaced to run several ranks' schedules in one process (no real ranks: protocol only).
"""

from __future__ import annotations

import threading

import torch

from karma.runtime.backends.backend import CpuBackend
from karma.schedule import BARRIER_STREAMS, EXCHANGE_KINDS, Schedule


class CheckingBackend(CpuBackend):
    def __init__(self, schedule: Schedule, fake_collective: bool = False):
        super().__init__()
        self.schedule = schedule
        self._fake_collective = fake_collective
        self._n = len(schedule.ops)
        self._lock = threading.Lock()
        self.violations: list[str] = []
        self.calls = 0
        self.collectives = 0
        self._issued: set = set()  # every op issued so far, of every replay
        self._allocated: set = set()
        self._owed: set = set()  # ops of the previous replay not yet issued at its end
        self._waited: dict[str, set] = {}  # stream -> every op it was ordered after so far
        self._running: dict[str, int | None] = {}  # stream -> the op its worker runs now
        self._ran_collective: set = set()  # net ops that ran a collective
        self._held: dict = {}  # op id -> its releases, held until due (see the docstring)
        self._owed_release: int | None = None  # a net op whose collective awaits its release

    def op(self, gid):
        return self.schedule.ops[gid % self._n] if isinstance(gid, int) else None

    def _flag(self, text: str) -> None:
        self.violations.append(text)

    def begin_replay(self, op_ids) -> None:
        self._ops = set(op_ids)

    def issued(self, op_id: int, stream: str) -> None:
        with self._lock:
            self.calls += 1
            if op_id in self._issued:
                self._flag(f"op {op_id} issued twice")
            self._issued.add(op_id)
            if stream == "net" and op_id in self._ran_collective:
                self._owed_release = op_id  # its release_after must follow

    def order_after(self, deps, stream: str, op_id: int | None = None) -> None:
        with self._lock:
            self.calls += 1
            early = [d for d in deps if d not in self._issued]
            if early:
                self._flag(f"{stream} ordered after unissued ops {early}")
            self._waited.setdefault(stream, set()).update(deps)
            if op_id in self._allocated:
                self._waited[stream].add(("allocated", op_id))
            self._running[stream] = op_id
            op = self.op(op_id)
            if stream == "compute" and op is not None:
                late = [h for h in self._held if isinstance(h, int)
                        and h // self._n == op_id // self._n  # this replay's
                        and self.op(h).stream in BARRIER_STREAMS
                        and self.op(h).stage < op.stage]
                if late:
                    self._flag(f"compute op {op_id} (stage {op.stage}) starts while the "
                               f"releases of ops {sorted(late)[:5]} of earlier stages are "
                               "still held")

    def allocated(self, op_id: int) -> None:
        with self._lock:
            if op_id in self._allocated or op_id in self._issued:
                self._flag(f"op {op_id} allocated twice or after its issue")
            self._allocated.add(op_id)

    def release_after(self, op_id: int, release) -> None:
        with self._lock:
            if op_id not in self._issued:
                self._flag(f"release of op {op_id} before its issue")
            self._held.setdefault(op_id, []).append(release)
            if self._owed_release == op_id:
                self._owed_release = None

    def release_due(self, op_ids) -> None:
        with self._lock:
            ready = [r for gid in op_ids for r in self._held.pop(gid, [])]
        for release in ready:
            release()

    def collective(self, tensor: torch.Tensor, group, out: torch.Tensor | None = None) -> None:
        with self._lock:
            self.collectives += 1
            gid = self._running.get("net")
            op = self.op(gid)
            if op is None or op.kind not in EXCHANGE_KINDS:
                self._flag(f"a collective outside an all-reduce op (net runs {gid})")
            else:
                final = self._gradients_final(op, gid)
                if not self._covers(self._waited.get("net", set()), final):
                    self._flag(f"collective of op {gid} (all-reduce of block {op.block}) "
                               f"before its gradients' event (op {final}, "
                               f"{self.op(final).kind}): the net stream never waited for it")
                if ("allocated", gid) not in self._waited.get("net", set()):
                    self._flag(f"collective of op {gid} on a buffer the net stream was not "
                               "ordered after the allocation of")
                self._ran_collective.add(gid)
            owed = self._owed_release
            if owed is not None and owed != gid:
                self._flag(f"all-reduce op {owed} ran a collective but handed no release of "
                           "its buffer to release_after")
        if not self._fake_collective:
            super().collective(tensor, group, out)

    def _gradients_final(self, op, gid: int) -> int:
        """The gid of the op after which the all-reduce's gradients are final: the block's
        gradients' copy to the host when the all-reduce follows it, else its backward."""
        base = gid - gid % self._n
        kinds = {(o.kind, o.block): o.id for o in self.schedule.ops}
        to_host = kinds.get(("grads_to_host", op.block))
        if to_host is not None and to_host < op.id:
            return base + to_host
        return base + kinds["backward", op.block]

    def _covers(self, waited: set, target: int) -> bool:
        """Whether waiting for `waited` includes waiting for `target`: it or a later op of its
        stream (a stream runs its ops in order)."""
        stream = self.op(target).stream
        return any(isinstance(d, int) and d >= target and self.op(d).stream == stream
                   for d in waited)

    def end_replay(self) -> None:
        with self._lock:
            missing = sorted(self._owed - self._issued)
            if missing:
                self._flag(f"ops {missing[:5]} never issued by the end of the replay after "
                           "theirs")
            self._owed = self._ops - self._issued
            owed = self._owed_release
            if owed is not None:
                self._flag(f"all-reduce op {owed} ran a collective but handed no release of "
                           "its buffer to release_after")
                self._owed_release = None
            held, self._held = self._held, {}
        for releases in held.values():
            for release in releases:
                release()
