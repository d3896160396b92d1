"""Tensor parallelism on the CPU in more layouts (test_tensor_parallel.py's two ranks, gloo, one thread each): a
family's every hook of a packed trace, and a greedy generation's tokens and rows, as in one process. Apart from
test_tensor_parallel.py so the suite's two workers share them."""

from __future__ import annotations

import pytest
from family_parity import build, sequences
from test_parity_afmoe import CONFIGS as AFMOE_CONFIGS
from test_parity_cohere import CONFIGS as COHERE_CONFIGS
from test_parity_dbrx import CONFIGS as DBRX_CONFIGS
from test_parity_deepseek import CONFIGS as DEEPSEEK_CONFIGS
from test_parity_falcon import CONFIGS as FALCON_CONFIGS
from test_parity_falcon_h1 import falcon_h1_config
from test_parity_glm import CONFIGS as GLM_CONFIGS
from test_parity_gpt_bigcode import CONFIGS as BIGCODE_CONFIGS
from test_parity_gptj import CONFIGS as GPTJ_CONFIGS
from test_parity_jamba import jamba_config
from test_parity_latent_families import CONFIGS as LATENT_CONFIGS
from test_parity_lfm3 import CONFIGS as LFM3_CONFIGS
from test_parity_llama4 import CONFIGS as LLAMA4_CONFIGS
from test_parity_mamba import mamba2_config, mamba_config
from test_parity_minimax_m2 import CONFIGS as MINIMAX_CONFIGS
from test_parity_mpt import CONFIGS as MPT_CONFIGS
from test_parity_nemotron_h import nemotron_3_config
from test_parity_olmo_hybrid import SQUARE as olmo_hybrid_config
from test_parity_opt import CONFIGS as OPT_CONFIGS
from test_parity_persimmon import CONFIGS as PERSIMMON_CONFIGS
from test_parity_phimoe import CONFIGS as PHIMOE_CONFIGS
from test_tensor_parallel import N, _check_outputs, _equal, _generate, _open, one_thread  # noqa: F401 - (autouse)

from vlens import Capture, SamplingParams

# Layouts test_more_layouts runs (name -> config), and those whose layer 0 is a Mamba mixer and have no MLP
MORE_LAYOUTS = {"mamba": mamba_config, "mamba2": mamba2_config, "nemotron_3": nemotron_3_config,
                "falcon_h1": falcon_h1_config, "jamba": jamba_config, "glm4": GLM_CONFIGS["glm4"],
                "glm4_moe": GLM_CONFIGS["glm4_moe"], "deepseek_v3": DEEPSEEK_CONFIGS["deepseek_v3"],
                "deepseek_v2": DEEPSEEK_CONFIGS["deepseek_v2_grouped"],
                "minimax_m2": MINIMAX_CONFIGS["minimax_m2"], "llama4": LLAMA4_CONFIGS["llama4"],
                "gpt_bigcode": BIGCODE_CONFIGS["multi_query"], "falcon_40b": FALCON_CONFIGS["falcon_40b"],
                "falcon_rw": FALCON_CONFIGS["falcon_rw"], "mpt": MPT_CONFIGS["mpt_six_heads_clipped"],
                "phimoe": PHIMOE_CONFIGS["phimoe_longrope"], "mistral4": LATENT_CONFIGS["mistral4"],
                "afmoe": AFMOE_CONFIGS["afmoe"], "olmo_hybrid": olmo_hybrid_config,
                "lfm3": LFM3_CONFIGS["lfm3"], "codegen": GPTJ_CONFIGS["codegen"],
                "xglm": OPT_CONFIGS["xglm"], "persimmon": PERSIMMON_CONFIGS["persimmon"],
                "cohere2_moe": COHERE_CONFIGS["cohere2_moe"], "dbrx": DBRX_CONFIGS["dbrx"]}  # fmt: skip
MAMBA_FIRST, NO_MLP = ("mamba", "mamba2", "nemotron_3", "falcon_h1", "jamba"), ("mamba", "mamba2")
# (layer 0's hooks a generation captures: its token mixer's)
FIRST_HOOKS = dict.fromkeys(MAMBA_FIRST, "blocks.0.mamba.hook_*") | {"olmo_hybrid": "blocks.0.linear_attn.hook_*",
                                                                     "lfm3": "blocks.0.conv.hook_*"}


@pytest.mark.parametrize("name", list(MORE_LAYOUTS))
def test_more_layouts(tmp_path, name):
    """Mamba and Mamba 2 (no attention, no MLP, no KV cache: their blocks hold state slots alone), Nemotron 3
    (layers of a Mamba 2 mixer, attention, an MLP or experts beside a shared one, each alone), Falcon-H1 (attention
    and a Mamba 2 mixer side by side, µP multipliers: the projections' per part), Jamba (Mamba's mixers, experts)
    and GLM-4 (its sandwich of norms, rotary by pairs, gate and up stored as one tensor), GLM-4.5 (DeepSeek-V3's
    experts, the float32 router whole on each rank), DeepSeek-V3 and V2 (latent attention: the latents whole on each
    rank, the heads' projections from them split; groups of experts), MiniMax-M2 (q/k norms over whole projections,
    their sums of squares added over the ranks), Llama 4 (experts that read their input weighed), GPTBigCode (one
    key-value head, on every rank), Falcon 40B (query_key_value's groups), Falcon-RW (ALiBi's rounded slopes, three
    heads a rank), MPT (its own slopes, three heads a rank), Phi-3.5-MoE (SparseMixer's choice on every rank),
    Mistral 4 (its router in the model's dtype, its experts fused in the checkpoint) AFMoE (its output gate's
    projection split by heads) OLMo Hybrid (each rank its key heads' rows of q, k, v and of their convolutions,
    stored apart) and LFM3 (a gate a head, each rank its heads'), CodeGen (qkv_proj's shards of rows put in order,
    then split by heads), XGLM (its computed positions on every rank), Persimmon (a LayerNorm a head, with its
    head), Cohere 2's MoE (its shared experts averaged in, each rank its columns) and DBRX (its experts' one tensor
    a projection cut into each rank's columns) on two ranks, each its heads,
    one of the two groups of B and C, its half of a Mamba mixer's channels (x_proj's partial sums added up: B, C and
    the time step whole), its columns of every MLP and expert: every hook of a packed trace, and a greedy generation's
    tokens and rows, as in one process."""
    path = build(MORE_LAYOUTS[name](), tmp_path, name)
    one, two = _open(path), _open(path, tensor_parallel_size=N)
    try:
        every, seqs = list(one.hook_names()), sequences()
        for a, b in zip(one.trace(seqs, every), two.trace(seqs, every)):
            assert [hook for hook in every if not _equal(b[hook], a[hook], hook)] == []
        hooks = [FIRST_HOOKS.get(name, "blocks.0.attn.hook_z"),
                 "blocks.1.hook_attn_out" if name in NO_MLP else "blocks.1.mlp.*",
                 "blocks.2.hook_resid_post"]  # fmt: skip
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, capture=Capture(hooks=hooks))
        prompts = sequences((20, 9, 3))
        _check_outputs(_generate(one, prompts, params), _generate(two, prompts, params))
    finally:
        two.close()
