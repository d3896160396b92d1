"""OPT (125M to 66B but 350M; the model of much outlier and "massive activation" work): GPT-2's layer under its own
names — LayerNorms before attention and before the MLP (`self_attn_layer_norm`, `final_layer_norm`, the latter
the MLP's), q, k and v projected apart with biases, a ReLU MLP whose `fc1` and `fc2` sit on the layer itself — with
learned positions read two rows down their table (HF's offset), and queries scaled by 1/sqrt(d_head) after their
projection, as HF scales them (hook_q is the projection, TransformerLens's q; the scores are the same numbers)."""

from __future__ import annotations

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


class OPTForCausalLM(DecoderLM):
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        super().__init__(cfg, device)
        self.model = OPTModel(cfg)
        self.lm_head = LMHead(cfg.hidden_size, cfg.vocab_size, cfg.parallel)

    embed_tokens = property(lambda self: self.model.decoder.embed_tokens)
    layers = property(lambda self: self.model.decoder.layers)
    final_norm = property(lambda self: self.model.decoder.final_layer_norm)
    # (the learned positions from position 0 on: TransformerLens's W_pos)
    position_embeddings = property(lambda self: self.model.decoder.embed_positions.weight[POSITION_OFFSET:])

    def embed(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = tap("hook_embed", self.embed_tokens(input_ids))
        pos = tap("hook_pos_embed", self.model.decoder.embed_positions(ctx.positions + POSITION_OFFSET))
        return x + pos
