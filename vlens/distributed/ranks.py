"""Ranks 1.. of a tensor-parallel group as processes started on this machine (the default
`distributed_executor_backend`, "mp"), each fed over its own pipe, which only it reads, so a dead worker's
pipe breaks at the next send. `ray_ranks.RayRanks` offers the same four calls with Ray actors, which may run
on other machines.

On the CPU the workers fork from multiprocessing's fork server, which has imported what a worker runs (torch,
vlens, transformers' configs: seconds a worker would spend importing each time) once per process; each takes
the caller's working directory and environment as they are when it starts, as a spawned one does (a variable
read at import is the fork server's). CUDA workers are spawned: fresh interpreters, whatever the fork server's
torch may have touched of the driver."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time

from vlens.distributed import worker
from vlens.distributed.parallel import GroupError

PRELOAD = ["vlens.distributed.worker", "transformers.models.auto.configuration_auto"]  # (the fork server's)


class ProcessRanks:
    def __init__(self, size: int, init: str, spec: dict):
        spec = spec | {"device_per_rank": True}
        if spec["device"] == "cuda" or "forkserver" not in mp.get_all_start_methods():  # (Windows has none)
            context = mp.get_context("spawn")
        else:
            context = mp.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            spec["environ"] = dict(os.environ)
        self.init, self.procs, self.conns = init, [], []
        for rank in range(1, size):
            parent, child = context.Pipe()
            proc = context.Process(target=worker.main, args=(rank, size, init, spec, child), daemon=True)
            proc.start()
            child.close()  # only the worker holds its end: a dead worker's pipe breaks
            self.procs.append(proc)
            self.conns.append(parent)

    def wait_ready(self, deadline: float) -> None:
        for rank, conn in enumerate(self.conns, start=1):
            while not conn.poll(0.1):
                if not self.procs[rank - 1].is_alive() or time.monotonic() > deadline:
                    raise self._not_started(rank)
            try:
                status, detail = conn.recv()
            except EOFError:  # it died without a word: its end of the pipe closed
                self.procs[rank - 1].join(timeout=5)  # for its exit code
                raise self._not_started(rank) from None
            if status != "ready":
                raise GroupError(f"tensor parallel rank {rank} failed to load its shard:\n{detail}")

    def _not_started(self, rank: int) -> GroupError:
        return GroupError(f"tensor parallel rank {rank} did not start: {self.dead() or 'no answer'}")

    def send(self, work) -> None:
        """To every worker, in rank order; OSError (a broken pipe) when one is gone."""
        for conn in self.conns:
            conn.send(work)

    def dead(self) -> str | None:
        """Which workers have exited, and how; None while all run."""
        gone = [f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(self.procs, 1) if not p.is_alive()]
        return "; ".join(gone) or None

    def stop(self) -> None:
        """Ask every worker to stop, then kill the ones that do not within 5 s."""
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a worker already gone is stopped below all the same
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
