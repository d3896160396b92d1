"""Ranks 1.. of a tensor-parallel group as Ray actors (`distributed_executor_backend="ray"`), which is how a
model spans several machines: each actor holds one device (a GPU on CUDA, `threads` CPUs otherwise) and
joins rank 0's group over TCP at this node's address. A forward is put in the object store once and each
actor's `run` reads it; Ray runs one caller's calls on an actor in the order they were made, as the pipe
of a local worker does. Imported only when that backend is asked for (ray is an optional extra)."""

from __future__ import annotations

import time

import ray
import torch.distributed as dist

from vlens.distributed import worker
from vlens.distributed.parallel import GroupError


def node_address() -> str:
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    return ray.util.get_node_ip_address()


class RayRank:
    """One rank as a Ray actor (wrapped by `ray.remote` with its resources in `RayRanks`)."""

    def __init__(self, rank: int, size: int, init: str, spec: dict):
        self.worker = worker.start(rank, size, init, spec)

    def ready(self) -> bool:
        return True

    def run(self, work) -> None:
        self.worker.run(work)

    def stop(self) -> None:
        dist.destroy_process_group()


class RayRanks:
    def __init__(self, size: int, init: str, spec: dict):
        self.init = init
        resources = {"num_gpus": 1} if spec["device"] == "cuda" else {"num_cpus": spec["threads"]}
        kind, each = ("GPU", 1) if spec["device"] == "cuda" else ("CPU", spec["threads"])
        free = ray.available_resources().get(kind, 0)
        if free < each * (size - 1):  # else the actors would wait for resources that never come
            raise ValueError(
                f"tensor_parallel_size: {size - 1} Ray actors need {each * (size - 1)} {kind}s; "
                f"the cluster has {free:g} free"
            )
        actor = ray.remote(**resources)(RayRank)
        self.actors = [actor.remote(rank, size, init, spec | {"device_per_rank": False}) for rank in range(1, size)]
        self.pending: list = [actor.ready.remote() for actor in self.actors]  # each actor's last call

    def wait_ready(self, deadline: float) -> None:
        for rank, ref in enumerate(self.pending, start=1):
            try:
                ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except Exception as e:
                raise GroupError(f"tensor parallel rank {rank} (a Ray actor) did not start: {e}") from e

    def send(self, work) -> None:
        ref = ray.put(work)
        self.pending = [actor.run.remote(ref) for actor in self.actors]

    def dead(self) -> str | None:
        """Which actors' last call failed (a dead actor's does), and why; None while all answer."""
        gone = []
        for rank, ref in enumerate(self.pending, start=1):
            done, _ = ray.wait([ref], timeout=0)
            if done:
                try:
                    ray.get(ref)
                # RayActorError, or the worker's own exception: either way the rank is gone
                except Exception as e:  # noqa: BLE001
                    gone.append(f"rank {rank} (a Ray actor) failed: {type(e).__name__}")
        return "; ".join(gone) or None

    def stop(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
