"""A transcoder latent clamped per request: every request sets a different latent of a 16k-latent transcoder
(blocks.10.ln2.hook_out -> blocks.10.hook_mlp_out) to a value at all its positions, against the same batch
clamping nothing, in one run; and the peer, HF `generate` with hooks on that MLP doing the same for the
batch (its input's latent of each row's feature, then (value - latent) * W_dec[feature] added to its output).

    .venv/bin/python benchmarks/bench_transcoder_clamp.py [--prompts 64] [--tokens 64] [--d-sae 16384] [--repeats 1]

SmolLM2-135M float32 on this CPU, greedy, ignore_eos (HF: min_new_tokens) so every run does the same work; the
prefix cache is off (a clamp at every position changes every key and value, so clamped requests share none, where
plain ones would share their common prefixes: work of another kind than the clamp's).
vlens computes each clamp's coefficient where the transcoder reads, from the encoder column of the request's
latent alone (nothing of size d_sae in the step), and adds the decoder row where it writes. Timings are the best
of --repeats runs after a warm-up, the cases taking turns.
"""

from __future__ import annotations

import argparse

import torch
from bench_generate import HFGreedy, best_alternating, print_versus, prompts
from bench_sae import LAYER, random_sae

from vlens import LLM, Clamp, SamplingParams
from vlens.loader import resolve_model_path

VALUE = 10.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--d-sae", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    path = resolve_model_path(None)
    llm = LLM(model=str(path), dtype="float32", device="cpu", enable_prefix_caching=False)
    tc = random_sae(llm.config.hidden_size, args.d_sae, hook=f"blocks.{LAYER}.ln2.hook_out",
                    hook_out=f"blocks.{LAYER}.hook_mlp_out", apply_b_dec_to_input=False)  # fmt: skip
    texts = prompts(args.prompts)
    features = [(37 * i) % args.d_sae for i in range(args.prompts)]  # one latent per request

    def sp(interventions=()):
        return SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, interventions=list(interventions))

    plain, clamped = sp(), [sp([Clamp(tc.writes, tc, f, VALUE)]) for f in features]

    hf = HFGreedy(path, texts, args.tokens)
    index = torch.tensor(features)
    encoder, bias, decoder = tc.W_enc[:, index].T.contiguous(), tc.b_enc[index], tc.W_dec[index]  # [batch, ...]
    coefficient: list[torch.Tensor] = []

    def read(module, inputs):  # the MLP's input [batch, positions, d]: each row's own latent
        latent = torch.relu(torch.einsum("bpd,bd->bp", inputs[0], encoder) + bias[:, None])
        coefficient[:] = [VALUE - latent]

    def write(module, inputs, output):
        return output + coefficient[0][..., None] * decoder[:, None, :]

    def mlp(model):
        return model.model.layers[LAYER].mlp

    t_plain, t_clamp, t_hf, t_hf_clamp = best_alternating([
        lambda: llm.generate(texts, plain, use_tqdm=False), lambda: llm.generate(texts, clamped, use_tqdm=False),
        hf, lambda: hf(lambda m: mlp(m).register_forward_pre_hook(read), lambda m: mlp(m).register_forward_hook(write)),
    ], args.repeats)  # fmt: skip
    print(f"\nSmolLM2-135M float32, CPU ({torch.get_num_threads()} threads), {args.prompts} prompts x {args.tokens} "
          f"new tokens; transcoder d_sae={args.d_sae} at layer {LAYER}, a different latent clamped per request")  # fmt: skip
    cases = ("vlens, nothing clamped", "vlens, a latent clamped per request (time)", "HF generate, no hook",
             "HF generate + clamping hooks on the MLP (time)", "vlens clamping vs HF clamping (speed)")  # fmt: skip
    print_versus(args.prompts * args.tokens, (t_plain, t_clamp, t_hf, t_hf_clamp), cases, "<= 1.15x")


if __name__ == "__main__":
    main()
