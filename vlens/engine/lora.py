"""LoRA adapters served beside the base model, as vLLM serves them: a request names a PEFT adapter (`LoRARequest`)
and runs under it, in the same batch as requests under other adapters or none (`LLM(enable_lora=True)`).

The engine holds up to `max_loras` adapters at once, each in a slot of the stacks of every projection it adapts
(vlens.layers.lora); an adapter is read (and checked) when a request first names it, and put in a slot when the
scheduler admits a sequence under it, kept there while sequences under it run, least recently used first out after:
a sequence whose adapter finds every slot held by others waits, as vLLM's scheduler has it. Its blocks in the prefix
cache are its own (a sequence's cache salt names the adapter: every key differs from the base model's from the first
token).
A decode step with requests under adapters takes the static path as any other: its graph (or compiled forward)
reads each row's slot from the step's buffers, and is one of its own, captured over the stacks the adapters have.

What vlens reads of an adapter is PEFT's LoRA (vlens.lora_files); here, the projections it updates must be
vlens's StoredLinear modules (q/k/v, o, gate/up and down in most families), whose forward adds the update."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from vlens.layers.linear import FusedLinear, StoredLinear
from vlens.layers.lora import LoraWeights
from vlens.loader import checkpoint_layout, stored_name
from vlens.lora_files import read_lora
from vlens.models.base import DecoderLM

Update = tuple[slice | None, torch.Tensor, torch.Tensor]  # (rows of the projection's output, None: all; A; scaled B)


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's: the adapter's name, an integer id unique to it (> 0), and its directory (PEFT's save_pretrained)."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class Adapter:
    request: LoRARequest
    updates: dict[StoredLinear, list[Update]]


def read_adapter(request: LoRARequest, model: DecoderLM, max_rank: int) -> Adapter:
    """`request`'s adapter, checked against the model: a ValueError naming what vlens cannot run."""
    where = f"lora_request {request.lora_name!r}"
    if not isinstance(request.lora_int_id, int) or request.lora_int_id < 1:
        raise ValueError(f"{where}: lora_int_id {request.lora_int_id!r} is not a positive integer")
    layout = {stored_name(key, model.cfg): slot for key, slot in checkpoint_layout(model).items()}
    owners = {id(p): m for m in model.modules() for p in m.parameters(recurse=False)}
    updates: dict[StoredLinear, list[Update]] = {}
    for module_path, (a, b) in read_lora(Path(request.lora_path), f"{where}: lora_path", max_rank).items():
        slot = layout.get(f"{module_path}.weight")
        linear = None if slot is None else owners[id(slot.param)]
        if not isinstance(linear, StoredLinear) or slot.transform is not None:
            raise ValueError(f"{where}: adapts {module_path}, which is not a projection vlens can adapt in "
                             f"{model.cfg.architecture} (the attention's and MLP's projections are)")  # fmt: skip
        if model.cfg.latent_kv_cache and module_path.endswith(".kv_b_proj"):  # (its weight is read whole there)
            raise ValueError(f"{where}: adapts {module_path}, which the heads read through the latent KV cache "
                             "(latent_kv_cache=True) as one matrix; load the model without latent_kv_cache")
        if slot.source is not None:  # (tensor parallelism: this rank's output rows of B, or input columns of A)
            rows, *columns = slot.source
            a, b = (a[:, columns[0]], b) if columns else (a, b[rows])
        updates.setdefault(linear, []).append((slot.index, a, b))
    return Adapter(request, updates)


class LoraSlots:
    """The adapters the engine holds (by lora_int_id) and which slot each takes, and how many live sequences hold
    each slot: a slot no sequence holds is given to a new adapter, least recently used first."""

    def __init__(self, model: DecoderLM, max_loras: int, max_rank: int):
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.read: dict[int, Adapter] = {}
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first
        self.holders = [0] * max_loras
        self.stacks: dict[StoredLinear, LoraWeights] = {}

    def read_one(self, request: LoRARequest) -> None:
        """Read `request`'s adapter and check it against the model (once an id)."""
        known = self.read.get(request.lora_int_id)
        if known is None:
            self.read[request.lora_int_id] = read_adapter(request, self.model, self.max_rank)
        elif known.request != request:
            raise ValueError(f"lora_request {request.lora_name!r}: lora_int_id {request.lora_int_id} is already "
                             f"{known.request.lora_name!r} ({known.request.lora_path!r}); give each adapter its own "
                             "id")  # fmt: skip

    def check_taps(self, request: LoRARequest, taps: set[str]) -> None:
        """Refuse a request's `taps` that its adapter would leave out of what they show: attn.hook_result splits the
        output projection's product by head, which an adapter's update of that projection is not."""
        adapted = self.read[request.lora_int_id].updates
        for layer, block in enumerate(self.model.layers):
            hook = f"blocks.{layer}.attn.hook_result"
            if hook in taps and getattr(getattr(block, "attn_heads", None), "out", None) in adapted:
                raise ValueError(f"lora_request {request.lora_name!r}: adapts layer {layer}'s output projection, "
                                 f"which {hook} splits by head without the adapter's update; capture or edit "
                                 f"blocks.{layer}.attn.hook_z instead")  # fmt: skip

    def acquire(self, adapter_id: int) -> int | None:
        """The slot of adapter `adapter_id` (read), loaded there if it is not, held once more; None while every slot
        holds another adapter that sequences hold."""
        slot = self.slot_of.get(adapter_id)
        if slot is None:
            taken = set(self.slot_of.values())
            free = [s for s in range(self.max_loras) if s not in taken]
            if free:
                slot = free[0]
            else:
                evicted = next((i for i, s in self.slot_of.items() if not self.holders[s]), None)
                if evicted is None:
                    return None
                slot = self.slot_of.pop(evicted)
            self.load(self.read[adapter_id].request, slot)
            if self.model.executor is not None:  # (every rank its shard of it, in the same slot)
                self.model.executor.load_lora(self.read[adapter_id].request, slot, self.max_loras, self.max_rank)
        self.slot_of[adapter_id] = slot
        self.slot_of.move_to_end(adapter_id)
        self.holders[slot] += 1
        return slot

    def release(self, slot: int) -> None:
        self.holders[slot] -= 1

    @torch.no_grad()
    def load(self, request: LoRARequest, slot: int) -> None:
        """Put `request`'s adapter (read here if it was not) in `slot` of every projection's stacks."""
        self.read_one(request)
        adapter = self.read[request.lora_int_id]
        for linear in adapter.updates.keys() - self.stacks.keys():  # (projections no adapter adapted before)
            parts = len(linear.parts) if isinstance(linear, FusedLinear) and not linear.stored_fused else 1
            stacks = LoraWeights(linear.in_features, linear.out_features, self.max_loras, parts, self.max_rank,
                                 linear.weight)  # fmt: skip
            self.stacks[linear] = linear.lora = stacks
        for linear, stacks in self.stacks.items():
            stacks.put(slot, adapter.updates.get(linear, []))

