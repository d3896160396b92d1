"""Rank 0 of a tensor-parallel group: it starts one worker process per other rank, loads its own shard,
and before each forward it runs itself (the engine step, a trace or harvest batch, a logit-lens
readout) sends the other ranks what that forward needs (`launch`, `lens`). Scheduling, sampling and
collecting captured rows stay on rank 0, as in one process; the layers' collectives pair the ranks up
inside the forward.

A worker that dies is noticed by the collective it leaves (its sockets close) or by the pipe it no
longer reads: the engine gets a `GroupError` naming the rank and its exit code, and every other worker
is stopped, so no process is left behind and nothing waits on a rank that will not come.
"""

from __future__ import annotations

import socket
import threading
import time

import torch
import torch.distributed as dist

from vlens.capture.names import LOGITS
from vlens.capture.runtime import Tap
from vlens.config import ModelConfig
from vlens.distributed import worker
from vlens.distributed.parallel import GroupError, Parallel, on_failure
from vlens.distributed.ranks import ProcessRanks
from vlens.distributed.taps import sharded_units
from vlens.loader import check_latent_kv_cache, load_model, read_config, resolve_model_path

STARTUP_S = 600  # loading a shard of a large model takes minutes; a worker that says nothing longer is stuck


def check_parallel(cfg: ModelConfig, size: int, device: torch.device, local: bool = True) -> None:
    """Refuse, before any weights load, a split the model or the machine cannot take (`local`: every rank
    on this machine's devices; Ray checks its cluster's itself)."""
    if local and device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size: {size} ranks need {size} CUDA devices; this machine has {torch.cuda.device_count()}"
        )
    problem = _split_problem(cfg, size)
    if problem:
        most = min(128, max(cfg.num_heads, cfg.ssm_heads, cfg.ssm_inner, 1))  # (more ranks than that: no model here)
        allowed = [n for n in range(1, most + 1) if _split_problem(cfg, n) is None]
        raise ValueError(f"tensor_parallel_size: {size} {problem}; allowed for this model: {allowed}")


def _split_problem(cfg: ModelConfig, size: int) -> str | None:
    """What in the model a split in `size` ranks cannot cut evenly, or None."""
    if cfg.per_layer_input_size and size > 1:  # (a second embedding as wide as every layer's inputs together)
        return "is more than one process, and Gemma 4's per-layer embeddings run in one"
    dense = not cfg.moe_layers or not all(cfg.moe_layers) or cfg.experts_beside_mlp
    sizes = {
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.intermediate_size if dense else 0,
        **{f"intermediate_size (layer {i})": n for i, n in enumerate(cfg.layer_intermediate_sizes)},
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
        "linear_num_key_heads": cfg.linear_key_heads,  # (each rank the value heads its key heads serve)
        "hidden_size (short convolutions' channels)": cfg.hidden_size if any(cfg.conv_layers) else 0,
        "mamba_n_heads": cfg.ssm_heads,
        "the Mamba mixers' channels (intermediate_size)": cfg.ssm_inner,
    }
    for name, n in sizes.items():
        if n and n % size:
            return f"does not divide {name}={n}"
    for kv in sorted({cfg.kv_heads_at(layer) for layer in range(cfg.num_layers)}):
        if kv % size and size % kv:  # fewer KV heads than ranks: each is replicated on size / kv ranks
            return f"neither divides nor is a multiple of num_key_value_heads={kv}"
    if cfg.ssm_groups and cfg.ssm_groups % size and size % cfg.ssm_groups:  # (the same of B and C's groups)
        return f"neither divides nor is a multiple of mamba_n_groups={cfg.ssm_groups}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Executor:
    """Rank 0's handle on the group: `launch` a forward on the other ranks, `close` them. `backend`: "mp"
    (worker processes on this machine) or "ray" (Ray actors, one device each, on any machine of the cluster).
    `hf_overrides`: EngineConfig's, read on every rank; `attention_backend`, `compiled`, `block_size`: what every
    rank makes its attention backend of, as rank 0 does (vlens.attention.make_backend), so that "auto" picks the same
    one everywhere."""

    def __init__(
        self, model, dtype, device: torch.device, size: int, attention_backend: str, backend: str = "mp",
        compiled: bool = False, block_size: int = 16, revision: str | None = None, latent_kv_cache: bool = False,
        hf_overrides: dict | None = None,
    ):  # fmt: skip
        path = resolve_model_path(model, revision)  # converted or downloaded once, here, for every rank
        cfg = read_config(path, hf_overrides)
        check_parallel(cfg, size, device, local=backend != "ray")
        check_latent_kv_cache(cfg, latent_kv_cache)
        if dist.is_initialized():  # torch.distributed has one default group per process
            raise ValueError(
                "tensor_parallel_size: this process already leads a tensor-parallel group; close it first "
                "(llm.close() on the LLM that leads it, or create that LLM in a `with` block)"
            )
        self.size, self.closed = size, False
        if device.type == "cuda":
            device = torch.device("cuda", 0)
        spec = {
            "model": str(path), "dtype": dtype, "device": device.type, "backend": attention_backend, "compiled": compiled,
            "block_size": block_size, "latent_kv_cache": latent_kv_cache, "hf_overrides": hf_overrides,
            "group": "nccl" if device.type == "cuda" else "gloo", "threads": torch.get_num_threads(),
        }  # fmt: skip
        if backend == "ray":
            from vlens.distributed.ray_ranks import RayRanks, node_address  # ray is an optional extra

            self.ranks = RayRanks(size, f"tcp://{node_address()}:{_free_port()}", spec)
        else:
            self.ranks = ProcessRanks(size, f"tcp://127.0.0.1:{_free_port()}", spec)
        try:
            self._join(spec["group"], size)
            parallel = Parallel(0, size)
            self.loaded = load_model(model, dtype=dtype, device=str(device), parallel=parallel, revision=revision,
                                     latent_kv_cache=latent_kv_cache, hf_overrides=hf_overrides)  # fmt: skip
            self.ranks.wait_ready(time.monotonic() + STARTUP_S)
        except BaseException:
            self.close()
            raise
        on_failure(self._fail)
        self.loaded.model.executor = self

    def _join(self, group: str, size: int) -> None:
        """Join the group as rank 0 while watching the workers: the rendezvous waits for every rank until
        worker.TIMEOUT, so a worker that dies before it joins (an import that fails, a script without an
        `if __name__ == "__main__":` guard, which each worker re-runs) fails the start here, by name."""
        failed: list[BaseException] = []

        def join() -> None:
            try:
                dist.init_process_group(group, init_method=self.ranks.init, rank=0, world_size=size,
                                        timeout=worker.TIMEOUT)  # fmt: skip
            except BaseException as e:  # noqa: BLE001 - raised below, in the caller's thread
                failed.append(e)

        thread = threading.Thread(target=join, daemon=True)  # left waiting out the timeout if a worker died
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if thread.is_alive() and self.ranks.dead() is not None:
                self.ranks.wait_ready(time.monotonic())  # raises: what the dead worker said, or how it exited
        if failed:
            raise failed[0]

    @property
    def model(self):
        return self.loaded.model

    def _fail(self) -> str:
        """A collective failed: name the dead rank (waiting a moment for the OS to report the exit), end the group."""
        deadline = time.monotonic() + 5
        while self.ranks.dead() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        why = self.ranks.dead() or "a rank stopped answering"
        self.close()
        return why

    def _send(self, work) -> None:
        if self.closed:
            raise GroupError("tensor parallel group is closed; create a new LLM")
        try:
            self.ranks.send(work)
        except OSError as e:  # BrokenPipeError: a worker is gone
            raise GroupError(f"tensor parallel group failed: {self._fail()}") from e

    def launch(
        self, meta, ids: torch.Tensor, taps: dict, num_layers: int | None, logit_rows: torch.Tensor | slice | None,
        decode: bool, embeds: tuple[torch.Tensor, torch.Tensor] | None = None, lora: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """Run on the other ranks the forward rank 0 is about to run (`ModelRunner._forward`'s arguments):
        the armed taps go along where they edit (every rank edits) or gather at a sharded site; a gather
        of a tap every rank holds whole is read on rank 0 alone."""
        cfg, armed, hooks = self.model.cfg, {}, []
        names = {id(t): name for name, t in taps.items()}
        for name, t in taps.items():
            if name == LOGITS:  # the whole logits are rank 0's alone: so are their taps
                continue
            if not isinstance(t, Tap):  # a Python function: it runs here, the other ranks take part
                hooks.append(name)
                continue
            sharded = sharded_units(name, cfg) is not None
            if sharded or t.edit_rows is not None or t.feeds:
                armed[name] = worker.ArmedTap.of(t, sharded, names)
        rows = logit_rows.clone() if isinstance(logit_rows, torch.Tensor) else logit_rows
        plain = {name: t for name, t in taps.items() if isinstance(t, Tap)}
        vectors = worker.table_rows(plain)
        # (copies, as of ids: a tensor sent moves its storage to shared memory, and these are views of rank 0's buffers)
        given = None if embeds is None else tuple(t.to("cpu", copy=True) for t in embeds)
        meta = worker.portable(meta)
        work = worker.Forward(ids.clone(), meta, armed, hooks, vectors, num_layers, rows, decode, given,
                              None if lora is None else lora.clone())  # fmt: skip
        self._send(work)

    def load_lora(self, request, slot: int, max_loras: int, max_rank: int) -> None:
        """The other ranks put their shards of `request`'s adapter in `slot`, as rank 0 does (vlens.engine.lora)."""
        self._send(worker.LoadLora(request, slot, max_loras, max_rank))

    def lens(self, residual: torch.Tensor) -> None:
        """The other ranks' part of a logit-lens readout of `residual` on rank 0."""
        self._send(worker.Lens(residual.cpu()))

    def close(self) -> None:
        """Stop the workers (at once, if they do not stop by themselves) and leave the group: when done, and
        when a forward failed on any rank, since the others may be waiting in a collective it left."""
        if self.closed:
            return
        self.closed = True
        on_failure(None)
        if dist.is_initialized():  # first: a rank waiting in a collective of this group fails out of it at once
            dist.destroy_process_group()
        self.ranks.stop()
