"""OPT (125M to 66B but 350M; the model of much outlier and "massive activation" work): GPT-2's layer under its own
names — LayerNorms before attention and before the MLP (`self_attn_layer_norm`, `final_layer_norm`, the latter
the MLP's), q, k and v projected apart with biases, a ReLU MLP whose `fc1` and `fc2` sit on the layer itself — with
learned positions read two rows down their table (HF's offset), and queries scaled by 1/sqrt(d_head) after their
projection, as HF scales them (hook_q is the projection, TransformerLens's q; the scores are the same numbers).

XGLM (Meta's multilingual models, 564M to 7.5B) and BioGPT (Microsoft's biomedical GPT, 347M and 1.5B) come from the
same fairseq decoder: OPT's layer, their embedding scaled by sqrt(d) (`scale_embedding`), positions two rows down
their table, learned (BioGPT) or fairseq's sines and cosines, computed (XGLM; no checkpoint stores them). BioGPT
scales its scores rather than its queries, as Llama does."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from vlens.config import ModelConfig
from vlens.context import ForwardContext, tap
from vlens.layers.checkpoint import Slot, checkpoint_slots
from vlens.layers.mlp import DenseMLP
from vlens.layers.norm import make_norm
from vlens.layers.vocab import LMHead, VocabEmbedding
from vlens.models.base import DecoderLM, ResidualBlock
from vlens.models.llama import OutProjAttention

POSITION_OFFSET = 2  # (OPT's table has two rows before position 0's)


class LayerMLP(DenseMLP):
    """The MLP whose projections the checkpoint keeps on the layer itself (`layers.L.fc1`, not `layers.L.mlp.fc1`)."""

    def checkpoint_slots(self, path: str) -> dict[str, Slot]:
        layer = path.rpartition(".")[0]
        return {name: slot for child, module in self.named_children()
                for name, slot in checkpoint_slots(module, f"{layer}.{child}").items()}  # fmt: skip


class OPTDecoderLayer(ResidualBlock):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(layer)
        self.self_attn_layer_norm = make_norm(cfg)
        self.self_attn = OutProjAttention(cfg, layer)
        self.final_layer_norm = make_norm(cfg)
        self.mlp = LayerMLP(cfg, layer, ("fc1", "fc2"))

    ln1 = property(lambda self: self.self_attn_layer_norm)
    ln2 = property(lambda self: self.final_layer_norm)
    attn_heads = property(lambda self: self.self_attn)


class OPTDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.parallel)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size)
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.final_layer_norm = make_norm(cfg)


class OPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.decoder = OPTDecoder(cfg)


class OffsetPositionsLM(DecoderLM):
    """A fairseq decoder's model: its token embedding, then its position's row two rows down the table."""

    position_rows: Callable[[torch.Tensor], torch.Tensor]  # the table's rows at these indices (each family's own)

    def embed(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = tap("hook_embed", self.embedding(input_ids))
        pos = tap("hook_pos_embed", self.position_rows(ctx.positions + POSITION_OFFSET).to(x.dtype))
        return x + pos


class OPTForCausalLM(OffsetPositionsLM):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.model = OPTModel(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel)

    embed_tokens = property(lambda self: self.model.decoder.embed_tokens)
    layers = property(lambda self: self.model.decoder.layers)
    final_norm = property(lambda self: self.model.decoder.final_layer_norm)
    # (the learned positions from position 0 on: TransformerLens's W_pos)
    position_embeddings = property(lambda self: self.model.decoder.embed_positions.weight[POSITION_OFFSET:])

    def position_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.model.decoder.embed_positions(rows)


def sinusoidal_positions(rows: int, dim: int) -> torch.Tensor:
    """fairseq's table (XGLM's), as HF computes it on the host in float32: each row the sines, then the cosines, of
    its position times dim // 2 frequencies from 1 down to 1/10,000 (a zero column more for an odd `dim`)."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    frequencies = torch.exp(torch.arange(half, dtype=torch.int64, device="cpu").float() * -step)
    angles = torch.arange(rows, dtype=torch.int64, device="cpu").float().unsqueeze(1) * frequencies.unsqueeze(0)
    table = torch.cat([torch.sin(angles), torch.cos(angles)], dim=1)
    return torch.cat([table, torch.zeros(rows, 1)], dim=1) if dim % 2 else table


class XGLMModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, cfg.parallel)
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.layer_norm = make_norm(cfg)


class XGLMForCausalLM(OffsetPositionsLM):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.model = XGLMModel(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel)
        # (float32, cast to the stream's dtype as its rows are read: HF's table, cast once, holds the same numbers)
        self.positions = sinusoidal_positions(cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size).to(device)

    embed_tokens = property(lambda self: self.model.embed_tokens)
    layers = property(lambda self: self.model.layers)
    final_norm = property(lambda self: self.model.layer_norm)
    position_embeddings = property(lambda self: self.positions[POSITION_OFFSET:].to(self.lm_head.weight.dtype))

    def position_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.positions[rows]


class BioGptModel(XGLMModel):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size)


class BioGptForCausalLM(OffsetPositionsLM):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.biogpt = BioGptModel(cfg)
        self.output_projection = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel)

    embed_tokens = property(lambda self: self.biogpt.embed_tokens)
    layers = property(lambda self: self.biogpt.layers)
    final_norm = property(lambda self: self.biogpt.layer_norm)
    lm_head = property(lambda self: self.output_projection)  # HF's name for the unembedding here
    position_embeddings = property(lambda self: self.biogpt.embed_positions.weight[POSITION_OFFSET:])

    def position_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.biogpt.embed_positions(rows)
