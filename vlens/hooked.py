"""TransformerLens's calls over a vlens model, so a notebook moves to vlens by changing its import and
its loading line:

    model = HookedLM("path/or/hub-id", dtype="float32")        # was HookedTransformer.from_pretrained(...)
    logits, cache = model.run_with_cache(texts, names_filter="blocks.*.hook_resid_post")
    cache["resid_post", 5], cache.accumulated_resid(apply_ln=True)
    model.run_with_hooks(tokens, fwd_hooks=[("blocks.3.attn.hook_z", ablate_head)])

What differs from TransformerLens: the values are HF's own (no LayerNorm folding, no weight
centring), and texts of different lengths run packed, never padded: every tensor comes back
right-padded to [batch, positions, ...] with zeros past each text's end (attention scores and patterns
[batch, heads, query_pos, key_pos], as in TransformerLens), and `cache.mask` says which positions are
real. A [batch, positions] token tensor is taken whole unless `attention_mask` says which tokens are real;
then the outputs keep its layout (left-padded in, left-padded out).
Hook functions are the one place vlens runs user Python inside a forward: an eager path over one packed
forward (or, in generate, over steps of the engine's KV cache), for notebooks, not the engine; backward hooks
and `run_with_cache(incl_bwd=True)` give gradients at hooks (vlens.hook_points says how). The cache and
TransformerLens's short names are in vlens.activation_cache, activation patching in vlens.patching, SAELens's
HookedSAETransformer calls (SAEs spliced in at their hooks) in vlens.hooked_saes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from vlens.activation_cache import ActivationCache, Padding, get_act_name, keep_positions, one_text
from vlens.capture.names import (
    LOGITS,
    OPTIONAL_HOOKS,
    HookSpecError,
    canonical,
    hook_shapes,
    is_pattern,
    layers_needed,
    resolve_hooks,
)
from vlens.capture.rows import widen
from vlens.config import ModelConfig
from vlens.engine.sampler import SamplingBatch, sample
from vlens.hook_points import DIRECTIONS, Hook, HookFn, HookPoint, PatternGrads, TapHooks
from vlens.hooked_saes import SAEMethods, Splice
from vlens.hooked_weights import HookTree, ModelWeights
from vlens.images import PromptImages
from vlens.inputs import ImagePrompt, prompt_list, to_token_lists
from vlens.llm import LLM
from vlens.sampling_params import SamplingParams

__all__ = ["ActivationCache", "HookPoint", "HookedLM", "get_act_name", "test_prompt"]  # (a notebook's `utils` too)

NamesFilter = "str | Sequence[str] | Callable[[str], bool] | None"
Images = list[PromptImages | None] | None  # the rows each text's images give (vlens.images), None: no images


def test_prompt(
    prompt: str, answer: str | Sequence[str], model: HookedLM, prepend_space_to_answer: bool = True,
    print_details: bool = True, prepend_bos: bool | None = None, top_k: int = 10,
) -> None:  # fmt: skip
    """TransformerLens's utils.test_prompt, line for line: prints the prompt's and the answer's tokens, how the
    model ranks each answer token after what comes before it (rank, logit, probability), its top_k tokens
    there, and the ranks. Several answers: the first token of each, side by side."""
    answers = [answer] if isinstance(answer, str) else list(answer)
    if prepend_space_to_answer:
        answers = [a if a.startswith(" ") else " " + a for a in answers]
    several = len(answers) > 1
    prompt_ids = model._token_lists([prompt], prepend_bos)[0]
    answer_ids = [ids[:1] if several else ids for ids in model._token_lists(answers, False)]
    tokens = torch.tensor([prompt_ids + ids for ids in answer_ids])
    prompt_tokens = model.to_str_tokens(prompt, prepend_bos=prepend_bos)
    answer_tokens = [model.to_str_tokens(a, prepend_bos=False) for a in answers]
    if print_details:
        print("Tokenized prompt:", prompt_tokens)
        print("Tokenized answers:" if several else "Tokenized answer:", answer_tokens if several else answer_tokens[0])
    logits = model(tokens)
    probs = logits.softmax(-1)
    ranks = []
    for at in range(len(prompt_ids), tokens.shape[1]):
        ids, texts = tokens[:, at], [a[at - len(prompt_ids)] for a in answer_tokens]
        sorted_probs, order = probs[:, at - 1].sort(descending=True)
        rank = order.argsort(-1)[range(len(answers)), ids].tolist()
        ranks.append(list(zip(texts, rank)))
        if print_details:
            print(f"Performance on answer token{'s' if several else ''}:")
            for i in range(len(answers)):
                print(f"Rank: {rank[i]: <8} Logit: {logits[i, at - 1, ids[i]].item():5.2f} "
                      f"Prob: {probs[i, at - 1, ids[i]].item():6.2%} Token: |{texts[i]}|")  # fmt: skip
            for i in range(top_k):
                print(f"Top {i}th token. Logit: {logits[0, at - 1, order[0, i]].item():5.2f} "
                      f"Prob: {sorted_probs[0, i].item():6.2%} Token: |{model.to_string(order[0, i])}|")  # fmt: skip
    print("Ranks of the answer tokens:", ranks if several else [r[0] for r in ranks])


test_prompt.__test__ = False  # (a function of this module, not a test for pytest to collect)


@dataclass(frozen=True)
class HookedConfig(ModelConfig):
    """The model's config with TransformerLens's `cfg.device` (`tokens.to(model.cfg.device)`; its patching
    module puts its results there), `cfg.dtype`, and `cfg.default_prepend_bos` (whether texts get BOS first
    when prepend_bos is not given: here, whether the tokenizer puts it there), which its evals and head
    detector read; and the flags of its optional hooks (OPTIONAL_HOOKS), which HookedLM's set_use_* set."""

    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    default_prepend_bos: bool = False
    use_attn_in: bool = False
    use_split_qkv_input: bool = False
    use_attn_result: bool = False
    use_hook_mlp_in: bool = False

    @classmethod
    def of(cls, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tokenizer: Any) -> HookedConfig:
        bos = getattr(tokenizer, "bos_token_id", None)
        adds_bos = bos is not None and tokenizer("x")["input_ids"][:1] == [bos]
        values = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
        return cls(**values, device=device, dtype=dtype, default_prepend_bos=adds_bos)


def hub_id(model: str | None) -> str | None:
    """The hub id a TransformerLens model name stands for ("gpt2-small": "gpt2", "pythia-70m":
    "EleutherAI/pythia-70m"), by TransformerLens's own table where it is installed; a path, an org/name id or a
    name it does not know, as it is."""
    if model is None or "/" in model or Path(model).exists():
        return model
    try:
        from transformer_lens.loading_from_pretrained import get_official_model_name
    except ImportError:
        return model
    try:
        return get_official_model_name(model)
    except ValueError:
        return model


# Pythia's training checkpoints as TransformerLens lists them (its checkpoint_index counts in this list).
PYTHIA_CHECKPOINTS = (0, *(2**i for i in range(10)), *range(1000, 143001, 1000))


def _pythia_revision(model: str | None, index: int | None, value: int | None, settings: dict[str, Any]) -> str:
    if not str(model).startswith("EleutherAI/pythia"):
        raise ValueError(f"checkpoint_index / checkpoint_value: training checkpoints by number are Pythia's "
                         f"(EleutherAI/pythia-*); for {model!r} name the hub revision: revision='...'")  # fmt: skip
    if (index is not None and value is not None) or "revision" in settings:
        raise ValueError("checkpoint_index, checkpoint_value, revision: give one of them")
    if index is not None:
        if not -len(PYTHIA_CHECKPOINTS) <= index < len(PYTHIA_CHECKPOINTS):
            raise ValueError(f"checkpoint_index: {index} is not in 0..{len(PYTHIA_CHECKPOINTS) - 1}")
        value = PYTHIA_CHECKPOINTS[index]
    if value not in PYTHIA_CHECKPOINTS:
        raise ValueError(f"checkpoint_value: {value} is not one of Pythia's checkpoints (0, 1, 2, 4, ..., 512, then "
                         "every 1000 steps to 143000)")  # fmt: skip
    return f"step{value}"


class HookedLM(ModelWeights, SAEMethods):
    """A vlens model with TransformerLens's calls (see the module doc). `model` and `settings` are
    those of `vlens.LLM`. Weight attributes (W_U, W_O, W_in, blocks[L].attn.W_Q, accumulated_bias, ...) are
    in vlens.hooked_weights."""

    def __init__(self, model: str | None = None, **settings: Any):
        self.llm = LLM(model, **settings)
        self.tokenizer = self.llm.tokenizer
        self.cfg = HookedConfig.of(self.llm.config, self.llm.runner.device, self.llm.runner.dtype, self.tokenizer)
        # in the order they run: until reset_hooks or the end of their `with`, the permanent ones until
        # reset_hooks(including_permanent=True)
        self._hooks: list[Hook] = []
        self._points: dict[str, HookPoint] = {}  # by name, made when first named: what hooks get as `hook`
        self._saes: dict[str, Splice] = {}  # the SAEs spliced in, by hook (vlens.hooked_saes)
        self._name_tables()

    def _name_tables(self) -> None:
        """The hook names of the model as configured (the optional ones turned on among them, the steps of the
        SAEs attached), and every one of them but the hidden_states.i aliases, which only a name asks for (the
        aliases that are TransformerLens's names are in it, as in its caches)."""
        self._shapes = {}
        writing = {splice.at: splice for splice in self._saes.values()}
        for name, shape in hook_shapes(self.cfg, [flag for flag in OPTIONAL_HOOKS if getattr(self.cfg, flag)]).items():
            self._shapes[name] = shape
            if name in writing:  # an attached SAE's steps, after the hook it writes (vlens.hooked_saes)
                self._shapes |= writing[name].shapes(shape)
        self._names_in_order = [n for n in self._shapes if not n.startswith("hidden_states.")]

    @classmethod
    def from_pretrained(
        cls, model: str | None = None, checkpoint_index: int | None = None, checkpoint_value: int | None = None,
        **settings: Any,
    ) -> HookedLM:  # fmt: skip
        """TransformerLens's: `model` may be one of its names ("gpt2-small", "pythia-70m", "tiny-stories-33M",
        "gemma-2-2b"; read where TransformerLens is installed, from its own table), a Pythia training checkpoint by
        `checkpoint_value` (its step) or `checkpoint_index` (its place in TransformerLens's list of them) is the
        hub revision `step{value}`; any model's other versions are `revision=` (HF's and vLLM's setting)."""
        model = hub_id(model)
        if checkpoint_index is not None or checkpoint_value is not None:
            settings["revision"] = _pythia_revision(model, checkpoint_index, checkpoint_value, settings)
        return cls(model, **settings)

    from_pretrained_no_processing = from_pretrained  # (vlens never folds or centres: the values are HF's)

    # -- tokens ---------------------------------------------------------------------------------------

    def to_tokens(
        self, text: str | Sequence[str], prepend_bos: bool | None = None, padding_side: str | None = None
    ) -> torch.Tensor:
        """[batch, positions] token ids, padded with the pad (else EOS) token on the right (padding_side
        "left": on the left). prepend_bos: None keeps the tokenizer's default, True puts the BOS token first,
        False takes it off."""
        if padding_side not in (None, "right", "left"):
            raise ValueError(f"padding_side: {padding_side!r} is not one of right, left")
        lists = self._token_lists([text] if isinstance(text, str) else list(text), prepend_bos)
        width = max(map(len, lists))
        out = torch.full((len(lists), width), self._pad_id(), dtype=torch.long)
        for i, ids in enumerate(lists):
            at = width - len(ids) if padding_side == "left" else 0
            out[i, at : at + len(ids)] = torch.tensor(ids)
        return out

    def to_single_token(self, string: str) -> int:
        """The id of a text that is one token (tokenized without BOS), else a ValueError."""
        ids = self._token_lists([string], prepend_bos=False)[0]
        if len(ids) != 1:
            raise ValueError(f"string: {string!r} is {len(ids)} tokens ({ids}), not one; use to_tokens")
        return ids[0]

    def to_single_str_token(self, int_token: int) -> str:
        """The text of one token id."""
        return self.to_str_tokens(torch.tensor([int_token]))[0]

    def get_token_position(
        self, single_token: str | int | torch.Tensor, input: str | torch.Tensor, mode: str = "first",
        prepend_bos: bool | None = None,
    ) -> int:  # fmt: skip
        """Where `single_token` (a one-token text or an id) occurs in `input` (a text, tokenized as to_tokens
        does, or the token ids of one text), its first occurrence or (mode "last") its last."""
        if mode not in ("first", "last"):
            raise ValueError(f"mode: {mode!r} is not one of first, last")
        tokens = self.to_tokens(input, prepend_bos=prepend_bos) if isinstance(input, str) else torch.as_tensor(input)
        if tokens.dim() == 2 and tokens.shape[0] != 1:
            raise ValueError(f"input: token ids of one text, [positions] or [1, positions]; got {tuple(tokens.shape)}")
        token = self.to_single_token(single_token) if isinstance(single_token, str) else int(single_token)
        at = (tokens.reshape(-1) == token).nonzero().squeeze(1).tolist()
        if not at:
            raise ValueError(f"single_token: {single_token!r} (id {token}) does not occur in the input")
        return at[0] if mode == "first" else at[-1]

    # TransformerLens's model-level hook points as attributes (the layers' are under `model.blocks[L]`)
    hook_embed = property(lambda self: HookTree(self, "").hook_embed)
    hook_pos_embed = property(lambda self: HookTree(self, "").hook_pos_embed)

    @property
    def hook_dict(self) -> dict[str, HookPoint]:
        """Every hook of this model by name (TransformerLens's `model.hook_dict`: what filters and hooks name)."""
        return {name: self._point(name) for name in self._names_in_order}

    def _point(self, name: str) -> HookPoint:
        if name not in self._points:
            self._points[name] = HookPoint(name, self)
        return self._points[name]

    def _pad_id(self) -> int:
        """What fills a row past its text: the pad token, else EOS, else 0."""
        tokenizer = self.tokenizer
        for token in (tokenizer.pad_token_id, tokenizer.eos_token_id) if tokenizer is not None else ():
            if token is not None:
                return token
        return 0

    def to_string(self, tokens: torch.Tensor | Sequence[int]) -> str | list[str]:
        tokens = torch.as_tensor(tokens)
        if tokens.dim() == 2:
            return [self.tokenizer.decode(row) for row in tokens.tolist()]
        return self.tokenizer.decode(tokens.tolist())

    def to_str_tokens(self, input: Any, prepend_bos: bool | None = None) -> list[str] | list[list[str]]:
        """Each token as text, of a text (tokenized as to_tokens does), a list of token ids, a token tensor
        ([positions], or [batch, positions]: a list per row, one row squeezed away as TransformerLens does), or a
        prompt with images (its placeholders expanded as the processor expands them, so the list's places are
        the cache's positions); a list of texts gives a list per text."""
        if isinstance(input, torch.Tensor):
            tokens = input.squeeze(0) if input.dim() == 2 and input.shape[0] == 1 else input
            if tokens.dim() > 1:
                return [self.to_str_tokens(row) for row in tokens]
            ids = tokens.reshape(-1).tolist()
        elif not isinstance(input, str) and isinstance(input, Sequence) and input and all(
            isinstance(t, (str, Mapping)) for t in input
        ):  # fmt: skip
            return [self.to_str_tokens(text, prepend_bos) for text in input]
        elif isinstance(input, Mapping) and "multi_modal_data" in input:
            [prompt] = prompt_list(input, "input")
            ids = self.llm.image_encoder("input").prepare(prompt, "input").ids.tolist()
        else:
            ids = self._token_lists([input], prepend_bos)[0]
        return [self.tokenizer.decode([t]) for t in ids]

    def _token_lists(self, texts: list[str], prepend_bos: bool | None) -> list[list[int]]:
        lists = to_token_lists(texts, self.tokenizer, self.cfg.vocab_size, field="input")
        bos = self.tokenizer.bos_token_id
        if prepend_bos is True and bos is not None:
            lists = [ids if ids[0] == bos else [bos] + ids for ids in lists]
        elif prepend_bos is False and bos is not None:
            lists = [ids[1:] if ids[0] == bos and len(ids) > 1 else ids for ids in lists]
        return lists

    def _sequences(
        self, input: Any, attention_mask: torch.Tensor | None, prepend_bos: bool | None = None
    ) -> tuple[list[list[int]], Padding, Images]:
        """The token ids of each text (tokenized as to_tokens does; a prompt with images, vLLM's {"prompt",
        "multi_modal_data"}, by the checkpoint's processor, as LLM.generate takes it), where its rows go in the
        output (from position 0 for texts and a token tensor taken whole, at the positions `attention_mask`
        marks when it comes with one: a left-padded batch comes back left-padded, each text's last position
        last), and the rows its images give (vlens.images; None where no text has any)."""
        if not isinstance(input, torch.Tensor):
            if attention_mask is not None:
                raise ValueError("attention_mask: goes with a [batch, positions] token tensor; texts are run packed, "
                                 "never padded, so they need none")  # fmt: skip
            seqs, images = self._with_images(input, prepend_bos)
            if images is None:
                seqs = self._token_lists(seqs, prepend_bos)
            return seqs, Padding.right([len(s) for s in seqs]), images
        rows = (input[None] if input.dim() == 1 else input).cpu()
        if attention_mask is None:
            padding = Padding.right([rows.shape[1]] * rows.shape[0])
        else:
            mask = torch.as_tensor(attention_mask).cpu()
            mask = mask[None] if mask.dim() == 1 else mask
            if mask.shape != rows.shape:
                raise ValueError(f"attention_mask: shape {tuple(mask.shape)} differs from the tokens' {tuple(rows.shape)}")
            padding = Padding(mask)
        seqs = [r[m].tolist() for r, m in zip(rows, padding.mask)]
        return to_token_lists(seqs, None, self.cfg.vocab_size, field="input"), padding, None

    def _with_images(self, input: Any, prepend_bos: bool | None) -> tuple[list[Any], Images]:
        """The prompts of `input` (texts, token-id lists), or where some have images the token ids of each (its
        images' placeholders expanded) and their images' rows, encoded before anything runs."""
        prompts = prompt_list(input, "input")
        if not any(isinstance(p, ImagePrompt) for p in prompts):
            return prompts, None
        if prepend_bos is not None:
            raise ValueError(f"prepend_bos: {prepend_bos!r} is for texts; prompts with images are tokenized by the "
                             "checkpoint's processor as HF's model takes them, so leave it None")  # fmt: skip
        return self.llm._tokens(prompts, "input")

    # -- forwards -------------------------------------------------------------------------------------

    def __call__(
        self,
        input: Any,
        return_type: str | None = "logits",
        loss_per_token: bool = False,
        attention_mask: torch.Tensor | None = None,
        stop_at_layer: int | None = None,
        prepend_bos: bool | None = None,
    ):
        """The forward, as run_with_hooks without hook functions of its own."""
        return self.run_with_hooks(input, return_type=return_type, loss_per_token=loss_per_token,
                                   attention_mask=attention_mask, stop_at_layer=stop_at_layer, prepend_bos=prepend_bos)  # fmt: skip

    forward = __call__  # (TransformerLens's model.forward(tokens))

    def loss_fn(
        self, logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
        per_token: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """TransformerLens's: the next-token cross-entropy of [batch, positions, vocab] logits for `tokens`, per
        token [batch, positions - 1] or the mean, counting only positions whose token and next token
        `attention_mask` keeps (log-probabilities in float32)."""
        tokens = torch.as_tensor(tokens).to(logits.device)
        logp = logits[:, :-1].float().log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
        if attention_mask is None:
            kept = torch.ones_like(logp, dtype=torch.bool)
        else:
            mask = torch.as_tensor(attention_mask).to(logits.device).bool()
            if mask.shape != tokens.shape:
                raise ValueError(f"attention_mask: shape {tuple(mask.shape)} differs from the tokens' {tuple(tokens.shape)}")
            kept = mask[:, :-1] & mask[:, 1:]
        losses = -logp.masked_fill(~kept, 0.0)
        return losses if per_token else losses.sum() / kept.sum()

    def to(self, device: str | torch.device) -> HookedLM:
        """TransformerLens's `model.to(device)`, where the model already is (vlens loads a model onto one device:
        HookedLM(..., device=...)); elsewhere a ValueError saying so."""
        if torch.device(device).type != self.cfg.device.type:
            raise ValueError(f"device: this model is on {self.cfg.device}; vlens loads a model onto one device, so "
                             f"load it onto {device} instead: HookedLM(..., device={str(device)!r})")  # fmt: skip
        return self

    def cuda(self, device: int | str | torch.device | None = None) -> HookedLM:
        return self.to("cuda" if device is None else torch.device("cuda", device) if isinstance(device, int) else device)

    def cpu(self) -> HookedLM:
        return self.to("cpu")

    # -- TransformerLens's optional hooks (vlens.capture.names.OPTIONAL_HOOKS) --------------------------------

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """blocks.L.attn.hook_result [batch, pos, n_heads, d_model]: each head's output, z_h @ W_O[h], before the
        heads are summed (b_O is added after); an edit there changes the layer's attention output."""
        self._use("use_attn_result", use_attn_result)

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """blocks.L.hook_q_input [batch, pos, n_heads, d_model], hook_k_input and hook_v_input [..., n_kv_heads,
        d_model]: each head's own copy of the layer input, normalised by ln1 and projected for that head alone, so
        an edit reaches one head's queries (or one key-value head's keys or values) only: path patching."""
        self._use("use_split_qkv_input", use_split_qkv_input)

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """blocks.L.hook_attn_in [batch, pos, n_heads, d_model]: each head's input to all three projections."""
        self._use("use_attn_in", use_attn_in)

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """blocks.L.hook_mlp_in [batch, pos, d_model]: the MLP's input before ln2 (an edit leaves the residual
        stream as it is)."""
        self._use("use_hook_mlp_in", use_hook_mlp_in)

    def _use(self, flag: str, on: bool) -> None:
        """Turn a set of optional hooks on or off: names, filters and run_with_cache() then include them. A
        forward computes one only where a hook or the cache asks for it, and reading it changes no number."""
        if not isinstance(on, bool):
            raise TypeError(f"{flag}: expected True or False, got {on!r}")
        cfg = self.cfg
        if on and flag == "use_attn_in" and cfg.num_kv_heads != cfg.num_heads:
            raise ValueError(
                f"use_attn_in: hook_attn_in is one input per query head for its queries, keys and values alike, and "
                f"this model's {cfg.num_heads} query heads share {cfg.num_kv_heads} key-value heads (grouped-query "
                "attention); set_use_split_qkv_input(True) gives hook_q_input per query head and hook_k_input / "
                "hook_v_input per key-value head"
            )
        if on and flag in ("use_attn_in", "use_split_qkv_input") and cfg.kv_lora_rank:
            raise ValueError(
                f"{flag}: {cfg.architecture}'s latent attention makes every head's keys and values from one latent of "
                "the layer's input, their rotating part one for all heads (kv_a_proj_with_mqa), so no input is one "
                "head's; blocks.L.ln1.hook_out is what the attention reads"
            )
        self.cfg = replace(cfg, **{flag: on})
        self._name_tables()

    def run_with_cache(
        self,
        input: Any,
        names_filter: NamesFilter = None,
        stop_at_layer: int | None = None,
        pos_slice: int | slice | Sequence[int] | None = None,
        return_type: str | None = "logits",
        attention_mask: torch.Tensor | None = None,
        loss_per_token: bool = False,
        remove_batch_dim: bool = False,
        prepend_bos: bool | None = None,
        incl_bwd: bool = False,
        device: str | torch.device | None = None,
        return_cache_object: bool = True,
    ) -> tuple[Any, ActivationCache | dict[str, torch.Tensor]]:
        """(output, cache), both on the model's device (`device`: the cache on that one instead, as
        TransformerLens's; return_cache_object=False: the cache as a plain dict of its tensors). names_filter: a
        name, glob, list of them, or a function of the name (None: every hook); stop_at_layer: run only the layers below it and return the residual entering it
        ([batch, positions, d]; negative counts from the last layer); pos_slice: keep these positions of
        each text, counted from its own start (negative: from its own end); remove_batch_dim: a cache of
        one text without the batch dimension (the output keeps it, as in TransformerLens); prepend_bos: as
        to_tokens's, for texts. incl_bwd: backpropagate the loss (return_type "loss") and cache each
        hook's gradient too, as "<name>_grad" (attention scores and patterns have none: see add_hook)."""
        if incl_bwd and (return_type != "loss" or loss_per_token or stop_at_layer is not None):
            raise ValueError("incl_bwd: backpropagates a scalar, so it needs return_type='loss' (got "
                             f"{return_type!r}), loss_per_token=False and no stop_at_layer")  # fmt: skip
        if incl_bwd and not torch.is_grad_enabled():
            raise ValueError("incl_bwd: gradients are off here (torch.no_grad or inference_mode); run it outside them")
        names = self._names(names_filter)
        stop_at_layer = self._stop_layer(stop_at_layer)
        if stop_at_layer is not None:
            names = {n: t for n, t in names.items() if layers_needed(t, self.cfg) <= stop_at_layer}
        out, cache = self._run(input, attention_mask, names, stop_at_layer=stop_at_layer, pos_slice=pos_slice,
                               return_type=return_type, loss_per_token=loss_per_token,
                               remove_batch_dim=remove_batch_dim, prepend_bos=prepend_bos, incl_bwd=incl_bwd,
                               device=device)  # fmt: skip
        return out, cache if return_cache_object else {name: cache[name] for name in cache}

    def run_with_hooks(
        self,
        input: Any,
        fwd_hooks: Sequence[tuple[Any, HookFn]] = (),
        bwd_hooks: Sequence[tuple[Any, HookFn]] = (),
        return_type: str | None = "logits",
        stop_at_layer: int | None = None,
        attention_mask: torch.Tensor | None = None,
        loss_per_token: bool = False,
        prepend_bos: bool | None = None,
        reset_hooks_end: bool = True,
        clear_contexts: bool = False,
    ):
        """The forward with `fn(value, hook)` run at each named tap (a name, glob or a function of the
        name); a hook that returns a tensor of the shape it got replaces the value. `bwd_hooks` run on the
        gradients when the output (or anything computed from it) is backpropagated, after this returns;
        reset_hooks_end=False leaves all of them in force for later forwards (until reset_hooks)."""
        with self.hooks(fwd_hooks, bwd_hooks, reset_hooks_end, clear_contexts):
            output, _ = self._run(input, attention_mask, {}, stop_at_layer=self._stop_layer(stop_at_layer),
                                  return_type=return_type, loss_per_token=loss_per_token, prepend_bos=prepend_bos)  # fmt: skip
        return output

    def _stop_layer(self, stop_at_layer: int | None) -> int | None:
        """TransformerLens's stop_at_layer, a bound on the layers as in `blocks[:stop_at_layer]`: negative counts
        from the last layer (-1 runs all but it), past the last runs them all."""
        n = self.cfg.num_layers
        if stop_at_layer is None:
            return None
        if not isinstance(stop_at_layer, int) or isinstance(stop_at_layer, bool) or stop_at_layer < -n:
            raise ValueError(f"stop_at_layer: {stop_at_layer!r} is not an int in -{n}..{n} (this model has {n} layers)")
        return stop_at_layer + n if stop_at_layer < 0 else min(stop_at_layer, n)

    @contextlib.contextmanager
    def hooks(
        self, fwd_hooks: Sequence[tuple[Any, HookFn]] = (), bwd_hooks: Sequence[tuple[Any, HookFn]] = (),
        reset_hooks_end: bool = True, clear_contexts: bool = False,
    ):  # fmt: skip
        """Hooks that apply to every forward inside the `with` block (and those add_hook adds there, but for
        the permanent ones, end with it, unless reset_hooks_end is False; clear_contexts: the hooks' `ctx`
        dicts are emptied then too)."""
        before = list(self._hooks)
        added = [self._hook(where, fn, "fwd", False, "fwd_hooks") for where, fn in fwd_hooks]
        self._hooks += added + [self._hook(where, fn, "bwd", False, "bwd_hooks") for where, fn in bwd_hooks]
        try:
            yield self
        finally:
            if reset_hooks_end:
                self._hooks = [h for h in self._hooks if h.permanent or h in before]
                if clear_contexts:
                    self.clear_contexts()

    def add_hook(
        self, name: Any, hook: HookFn, dir: str = "fwd", is_permanent: bool = False, prepend: bool = False
    ) -> None:
        """TransformerLens's add_hook: `hook(value, hook)` runs at `name` (a hook name, glob, or a function of
        the name) in every forward from now until reset_hooks (is_permanent: reset_hooks(including_permanent=
        True)), after the hooks already there (prepend: before them). dir "bwd": on the gradient at `name`
        when something computed from a later forward is backpropagated (with gradients on; not at attention
        scores and patterns, which vlens computes beside the fused attention, off the gradient's path)."""
        if dir not in DIRECTIONS:
            raise ValueError(f"dir: {dir!r} is not one of {', '.join(DIRECTIONS)}")
        self._hooks.insert(0 if prepend else len(self._hooks), self._hook(name, hook, dir, is_permanent, "name"))

    def _hook(self, where: Any, fn: HookFn, dir: str, permanent: bool, field: str) -> Hook:
        """A hook to put in force, checked now: a name that matches no hook is an error here, not at every
        forward after it."""
        if not callable(fn):
            raise ValueError(f"{field}: the hook at {where!r} is {type(fn).__name__}, not a function of (value, hook)")
        if not callable(where):
            try:
                self._names(where)
            except HookSpecError as e:
                raise HookSpecError(f"{field}: {str(e).removeprefix('hooks: ')}") from None
        return Hook(where, fn, dir, permanent)

    def reset_hooks(self, clear_contexts: bool = True, direction: str = "both", including_permanent: bool = False) -> None:
        """Remove the hooks in place (but the permanent ones, unless asked; direction "fwd" or "bwd": only those),
        and empty the hooks' `ctx` dicts (unless clear_contexts is False), as TransformerLens's does."""
        self._remove_hooks(direction, including_permanent)
        if clear_contexts:
            self.clear_contexts()

    def _remove_hooks(self, direction: str = "both", including_permanent: bool = False, at: str | None = None) -> None:
        """The hooks in force in `direction` ("fwd", "bwd" or "both"), but the permanent ones unless asked; `at`:
        only those added at that very name (HookPoint.remove_hooks)."""
        if direction not in (*DIRECTIONS, "both"):
            raise ValueError(f"direction: {direction!r} is not one of fwd, bwd, both")
        self._hooks = [
            h for h in self._hooks
            if (h.permanent and not including_permanent) or direction not in ("both", h.dir) or at not in (None, h.where)
        ]  # fmt: skip

    def remove_all_hook_fns(self, direction: str = "both", including_permanent: bool = False) -> None:
        """TransformerLens's: reset_hooks without touching the hooks' `ctx`."""
        self._remove_hooks(direction, including_permanent)

    def clear_contexts(self) -> None:
        """Empty every hook point's `ctx` dict."""
        for point in self._points.values():
            point.clear_context()

    def add_perma_hook(self, name: Any, hook: HookFn, dir: str = "fwd") -> None:
        self.add_hook(name, hook, dir, is_permanent=True)

    def add_caching_hooks(
        self, names_filter: NamesFilter = None, incl_bwd: bool = False, device: str | torch.device | None = None,
        remove_batch_dim: bool = False, cache: dict | None = None,
    ) -> dict:  # fmt: skip
        """TransformerLens's: hooks (until reset_hooks) that put each named hook's value, and with incl_bwd its
        gradient as "<name>_grad", into `cache` (a new dict unless given), which it returns for the forwards
        (and backward passes) after it to fill."""
        cache = {} if cache is None else cache

        def save(tensor: torch.Tensor, hook: HookPoint, suffix: str) -> None:
            value = tensor.detach() if device is None else tensor.detach().to(device)
            cache[hook.name + suffix] = value[0] if remove_batch_dim else value

        names = list(self._names(names_filter))
        self.add_hook(names, partial(save, suffix=""))
        if incl_bwd:
            self.add_hook(names, partial(save, suffix="_grad"), "bwd")
        return cache

    def all_head_labels(self) -> list[str]:
        """"L{layer}H{head}" of every head, in order (the labels of stack_head_results)."""
        return [f"L{layer}H{head}" for layer in range(self.cfg.num_layers) for head in range(self.cfg.num_heads)]

    def _names(self, names_filter: NamesFilter) -> dict[str, str]:
        """Requested name -> tap, for a filter in any TransformerLens form (aliases like hidden_states.i
        only when asked for by name)."""
        if isinstance(names_filter, HookPoint):  # (`model.blocks[3].attn.hook_z` itself)
            names_filter = names_filter.name
        if names_filter is None:
            return {n: canonical(n, self.cfg) for n in self._names_in_order}
        if callable(names_filter):
            return {n: canonical(n, self.cfg) for n in self._names_in_order if names_filter(n)}
        return resolve_hooks(names_filter, self.cfg, self._shapes, optional_by_glob=True)

    def _tap_hooks(
        self, padding: Padding, fed: list[list[int]], keep: str | None = None,
        grads: dict[str, torch.Tensor] | None = None, saved: Sequence[str] = (),
        values: dict[str, torch.Tensor] | None = None, readers: dict[str, list[HookFn]] | None = None,
    ) -> dict[str, TapHooks]:  # fmt: skip
        """The hooks in force, by tap, for a forward of the token ids `fed` (each text's, laid out by `padding`);
        `keep`: that tap's value is kept; `saved` taps put their gradient in
        `grads` after the hooks' own have run (run_with_cache's incl_bwd). Backward hooks at attention scores
        and patterns (and saved ones) become a PatternGrads at their layer's hook_z, reading the layer's
        values from `values`, which the caller fills after the forward (`_values_needed`). Forward hooks there
        go to `readers`, which the caller runs on the captured values after the forward (generate has none)."""
        fwd: dict[str, list[HookFn]] = {}
        bwd: dict[str, list[HookFn]] = {}
        at_patterns: dict[int, dict[str, list[HookFn]]] = {}
        steps = self._sae_steps()
        def tokens() -> torch.Tensor:  # (made only for an SAE that excludes some)
            return padding.pad(torch.tensor([t for ids in fed for t in ids]))

        for splice in self._saes.values():
            splice.fns, splice.bwd, splice.input = {}, {}, None
            splice.bypassing(tokens)
        for h in self._hooks:
            chosen = list(self._names(h.where).values())
            for step in (t for t in chosen if t in steps):  # an attached SAE's: its splice runs them
                (steps[step].fns if h.dir == "fwd" else steps[step].bwd).setdefault(step, []).append(h.fn)
            chosen = [t for t in chosen if t not in steps]
            off_path = [t for t in chosen if is_pattern(t)]
            if off_path and h.dir == "fwd" and readers is None:
                raise ValueError(
                    f"fwd_hooks: {', '.join(off_path)} cannot be hooked in generate: vlens computes attention scores "
                    "and patterns beside the fused attention, not inside it, so a hook there only reads them, after "
                    "a forward (run_with_hooks, run_with_cache); edit attn.hook_q / hook_k / hook_v / hook_z"
                )
            for tap in chosen:
                if is_pattern(tap) and h.dir == "fwd":
                    readers.setdefault(tap, []).append(h.fn)
                elif is_pattern(tap):
                    at_patterns.setdefault(_layer(tap), {}).setdefault(tap, []).append(h.fn)
                else:
                    (fwd if h.dir == "fwd" else bwd).setdefault(tap, []).append(h.fn)
        for step in (t for t in saved if t in steps):
            steps[step].bwd.setdefault(step, []).append(partial(_save_grad, grads))
        for tap in (t for t in saved if t not in steps):
            if is_pattern(tap):
                at_patterns.setdefault(_layer(tap), {})
            else:
                bwd.setdefault(tap, []).append(partial(_save_grad, grads))
        for layer, fns in at_patterns.items():
            mine = {t for t in saved if is_pattern(t) and _layer(t) == layer}
            points = {t: self._point(t) for t in fns.keys() | mine}
            bwd.setdefault(f"blocks.{layer}.attn.hook_z", []).append(PatternGrads(layer, fns, values, grads, mine, points))
        for splice in self._saes.values():  # after the hooks at its hooks, which see the model's own values
            if splice.reads != splice.at:
                fwd.setdefault(splice.reads, []).append(splice.take)
            fwd.setdefault(splice.at, []).append(splice)
        taps = [*fwd, *(t for t in bwd if t not in fwd), *([keep] if keep is not None and keep not in fwd | bwd else [])]
        return {t: TapHooks(self._point(t), fwd.get(t, []), bwd.get(t, []), padding, keep=t == keep) for t in taps}

    def _sae_steps(self) -> dict[str, Splice]:
        """The attached SAEs' steps (hook names that are no tap of the model) and whose they are."""
        return {name: splice for splice in self._saes.values() for name in splice.names.values()}

    def _run(
        self, input: Any, attention_mask: torch.Tensor | None, names: dict[str, str], *, stop_at_layer: int | None = None,
        pos_slice=None, return_type: str | None = "logits", loss_per_token: bool = False, remove_batch_dim: bool = False,
        prepend_bos: bool | None = None, incl_bwd: bool = False, device: str | torch.device | None = None,
    ) -> tuple[Any, ActivationCache]:  # fmt: skip
        if return_type not in ("logits", "loss", "both", None):
            raise ValueError(f"return_type: {return_type!r} is not one of logits, loss, both, None")
        seqs, padding, images = self._sequences(input, attention_mask, prepend_bos)
        self.llm.check_fits(seqs, "input")
        if remove_batch_dim:
            one_text(len(seqs))
        n = self.cfg.num_layers
        if stop_at_layer is not None:
            output = f"blocks.{stop_at_layer}.hook_resid_pre" if stop_at_layer < n else f"blocks.{n - 1}.hook_resid_post"
        else:
            output = LOGITS if return_type is not None else None
        if output == LOGITS:
            self._check_token_logits("return_type")
        # A forward that keeps a graph returns the value leaving the output's tap; else it is captured like any tap.
        grad = self._keeps_graph(incl_bwd)
        steps = self._sae_steps()
        for splice in self._saes.values():  # the SAEs' steps asked for: their splices keep them
            splice.record = dict.fromkeys(t for t in names.values() if steps.get(t) is splice)
        tapped = {t for t in names.values() if t not in steps}
        taps = tapped | ({output} if output is not None and not grad else set())
        grads: dict[str, torch.Tensor] = {}
        values: dict[str, torch.Tensor] = {}
        saved = sorted(set(names.values())) if incl_bwd else []
        readers: dict[str, list[HookFn]] = {}
        hooks = self._tap_hooks(padding, seqs, output if grad else None, grads, saved, values, readers)
        needed = (_values_needed(hooks) if grad else set()) | readers.keys()
        taps |= needed
        captured = self.llm.runner.packed(seqs, sorted(taps), hooks=hooks, grad=grad, images=images)
        rows: dict[str, list[torch.Tensor]] = {t: [None] * len(seqs) for t in taps}
        for i, tap, value in captured.pieces():
            rows[tap][i] = value
        # Captures reach the host (the engine's way); a notebook's values are where the model is, as in
        # TransformerLens (`cache[...] @ model.W_U`; the gradients, and what PatternGrads reads, are there too).
        on = self.cfg.device
        laid_out = tapped | needed  # (the output is read apart)
        padded = {t: padding.pad(torch.cat(_keys_in_layout(t, rows[t], padding))).to(on) for t in laid_out}
        for splice in self._saes.values():
            padded |= splice.record
            splice.record = {}
        values.update({t: _heads_first(t, padded[t]) for t in needed})
        for tap in sorted(readers, key=_layer):  # in the order the forward reached them
            for fn in readers[tap]:
                if fn(values[tap].clone(), hook=self._point(tap)) is not None:  # (a copy: the cache's stays as it is)
                    raise ValueError(
                        f"fwd_hooks: the function at {tap} returned a tensor; attention scores and patterns are read, "
                        "not replaced (vlens computes them beside the fused attention): edit attn.hook_q / hook_k / "
                        "hook_v / hook_z"
                    )
        out = None
        if output is not None:  # (the output's packed rows: the loss needs no padded logits)
            rows_out = hooks[output].kept if grad else torch.cat(rows[output]).to(on)
            out = padding.pad(rows_out) if return_type != "loss" or output != LOGITS else None
        if output == LOGITS and return_type != "logits":
            loss = _loss(rows_out, seqs, padding, loss_per_token)
            out = loss if return_type == "loss" else (out, loss)
        if incl_bwd:
            out.backward()
        cached = {n: _heads_first(t, keep_positions(padded[t], padding, pos_slice)) for n, t in names.items()}
        # (a pattern's gradient comes heads first, as the cache has it: positions are kept with queries first)
        cached |= {f"{n}_grad": _heads_first(t, keep_positions(_heads_first(t, grads[t]), padding, pos_slice))
                   for n, t in names.items() if t in grads}  # fmt: skip
        if device is not None:
            cached = {n: v.to(device) for n, v in cached.items()}
        return out, ActivationCache(cached, self, not remove_batch_dim, mask=padding.mask, pos_slice=pos_slice)

    def _keeps_graph(self, incl_bwd: bool) -> bool:
        """Whether a forward runs outside inference mode, keeping an autograd graph: with gradients on, when a
        gradient is asked for (incl_bwd, a backward hook; one process only: the forward says so), or may be,
        from a tensor a forward hook puts in that requires grad (a steering vector being learnt)."""
        if not torch.is_grad_enabled():
            return False
        if incl_bwd or any(h.dir == "bwd" for h in self._hooks):
            return True
        return bool(self._hooks) and self.llm.runner.model.executor is None

    def _check_token_logits(self, field: str) -> None:
        if self.cfg.no_token_logits:
            raise ValueError(f"{field}: {self.cfg.no_token_logits}; HookedLM runs its forward with return_type=None")

    def _last_logits(self, seqs: list[list[int]], images: Images = None) -> torch.Tensor:
        """[batch, vocab]: each sequence's logits at its last position, with the hook functions in force run over
        the batch left-padded, as TransformerLens lays out a batch it generates for (`value[:, -1]` is each
        sequence's last token)."""
        self._check_token_logits("generate")
        last = [torch.tensor([len(s) - 1]) for s in seqs]
        hooks = self._tap_hooks(Padding.left(list(map(len, seqs))), seqs)
        captured = self.llm.runner.packed(seqs, [LOGITS], rows=last, hooks=hooks, images=images)
        logits: list[torch.Tensor] = [None] * len(seqs)
        for i, _, value in captured.pieces():
            logits[i] = value[0]
        return torch.stack(logits)

    # -- generation -----------------------------------------------------------------------------------

    def generate(
        self,
        input: Any = "",
        max_new_tokens: int = 10,
        stop_at_eos: bool = True,
        eos_token_id: int | Sequence[int] | None = None,
        do_sample: bool = True,
        top_k: int | None = None,
        top_p: float | None = None,
        temperature: float = 1.0,
        freq_penalty: float = 0.0,
        use_past_kv_cache: bool = True,
        prepend_bos: bool | None = None,
        return_type: str = "input",
        verbose: bool = True,
    ) -> str | list[str] | torch.Tensor:
        """TransformerLens's generate: up to max_new_tokens after each input (a text, texts, or a [batch,
        positions] token tensor, taken whole), a text stopping at EOS (or at `eos_token_id`'s ids) unless
        stop_at_eos is False. Returns the inputs with their continuations, as text (return_type "str", or
        "input" for text input) or as tokens [batch, positions + steps] ("tokens", or "input" for a tensor):
        prompts left-padded with the pad token and a text that stopped early filled with the EOS token, as in
        TransformerLens.

        Without hook functions it runs on the engine (paged KV cache, continuous batching). Inside `with
        model.hooks(...)` each step is one forward of the whole batch, texts that stopped included (so a hook's
        batch index always means the same text), as TransformerLens runs it: with use_past_kv_cache (the
        default) the first step runs the prompts left-padded and each later one only the new tokens, [batch,
        1, ...] at the hooks, over the engine's KV cache (what a hook changed stays in the keys and values the
        later steps read); without it every step runs every position again. Sampling draws its seed from
        torch's generator (torch.manual_seed repeats a run) and is the engine's in every way, whose noise
        depends only on the seed, the text and the position: a hook that changes nothing changes no sample."""
        if freq_penalty != 0:
            raise ValueError(f"freq_penalty: {freq_penalty!r} is not supported (only 0.0); TransformerLens's penalty "
                             "also counts the prompt's tokens, which vlens's frequency_penalty (OpenAI's, in "
                             "LLM.generate's SamplingParams) does not")  # fmt: skip
        if return_type not in ("input", "str", "tokens"):
            raise ValueError(f"return_type: {return_type!r} is not one of input, str, tokens")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: {max_new_tokens!r} is not allowed; expected an int >= 1")
        seqs, _, images = self._sequences(input, None, prepend_bos)
        self.llm.check_fits(seqs, "input")
        stops = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or ())
        seed = int(torch.randint(2**31, ())) if do_sample and temperature > 0 else None
        params = [
            SamplingParams(
                max_tokens=max_new_tokens, temperature=temperature if do_sample else 0.0, top_k=top_k or 0,
                top_p=1.0 if top_p is None else top_p, seed=None if seed is None else seed + i,
                ignore_eos=not stop_at_eos or bool(stops), stop_token_ids=stops if stop_at_eos else [],
            )  # fmt: skip
            for i in range(len(seqs))
        ]
        eos = self.tokenizer.eos_token_id if self.tokenizer is not None else None
        fill = stops[0] if stops else eos if eos is not None else min(self.llm.engine.eos_ids, default=self._pad_id())
        if self._saes or any(h.dir == "fwd" for h in self._hooks):
            new = self._generate_with_hooks(seqs, params, fill, verbose, use_past_kv_cache, images)
        else:
            outs = self.llm._run(seqs, [None] * len(seqs), params, verbose, images)
            new = [list(o.outputs[0].token_ids) for o in outs]
        return self._generated(input, seqs, new, return_type, fill)

    def _generate_with_hooks(
        self, seqs: list[list[int]], params: list[SamplingParams], fill: int, verbose: bool, cached: bool,
        images: Images = None,
    ) -> list[list[int]]:  # fmt: skip
        """The tokens generated after each sequence, one forward of the whole batch a step with the hooks in force
        (a sequence that stopped goes on with `fill`, as in TransformerLens, until every one has stopped);
        `cached`: over blocks of the engine's KV cache, lent for the call."""
        engine = self.llm.engine
        limit, steps = engine.max_model_len, params[0].max_tokens
        stops = [set(p.stop_token_ids) | (set() if p.ignore_eos else set(engine.eos_ids)) for p in params]
        new: list[list[int]] = [[] for _ in seqs]
        done = [False] * len(seqs)
        tables = self._lend_cache([min(len(s) + steps, limit) for s in seqs]) if cached else None
        computed = [0] * len(seqs)  # tokens of each sequence whose keys and values are in its blocks
        try:
            for step in tqdm(range(steps), disable=not verbose, desc="generate"):
                fed = [(s + n + [fill] * (step - len(n)))[:limit] for s, n in zip(seqs, new)]
                if tables is None:
                    logits = self._last_logits(fed, images)
                else:  # (a sequence at the length limit feeds its last token again, at the same position)
                    starts = [min(c, len(f) - 1) for c, f in zip(computed, fed)]
                    rows = [f[b:] for f, b in zip(fed, starts)]
                    hooks = self._tap_hooks(Padding.left(list(map(len, rows))), rows)
                    # (sampled as _last_logits's)
                    logits = self.llm.runner.extend(fed, starts, tables, hooks, images=images).cpu()
                    computed = list(map(len, fed))
                sampled = sample(logits, _sampling(params, fed)).tolist()
                for i, token in enumerate(sampled):
                    if not done[i]:
                        new[i].append(token)
                        done[i] = token in stops[i] or len(seqs[i]) + len(new[i]) >= limit
                if all(done):
                    break
        finally:
            for table in tables or ():
                engine.blocks.give_back(table)
        return new

    def _lend_cache(self, lengths: list[int]) -> list[list[int]]:
        blocks = self.llm.engine.blocks
        tables = blocks.lend(lengths)
        if tables is None:
            need = sum(-(-n // blocks.block_size) for n in lengths)
            free = blocks.states_free()
            states = f", and state slots for {len(lengths)} ({free} free)" if blocks.num_states else ""
            raise ValueError(
                f"use_past_kv_cache: {len(lengths)} texts of up to {max(lengths)} tokens need {need} KV cache blocks "
                f"of {blocks.block_size} tokens and {len(blocks.free)} are free{states}; generate fewer texts or tokens "
                "at once, or pass use_past_kv_cache=False (every step runs every position again, needing no cache)"
            )
        return tables

    def _generated(self, input: Any, seqs: list[list[int]], new: list[list[int]], return_type: str, fill: int):
        """generate's result in TransformerLens's forms (see generate)."""
        if return_type == "str" or (return_type == "input" and not isinstance(input, torch.Tensor)):
            texts = [self.tokenizer.decode(s + n) for s, n in zip(seqs, new)]
            return texts[0] if isinstance(input, (str, Mapping)) else texts
        steps = max(map(len, new))
        rows = [s + n + [fill] * (steps - len(n)) for s, n in zip(seqs, new)]
        out = torch.full((len(rows), max(map(len, rows))), self._pad_id(), dtype=torch.long)
        for i, row in enumerate(rows):
            out[i, out.shape[1] - len(row) :] = torch.tensor(row)
        return out


def _sampling(params: list[SamplingParams], fed: list[list[int]]) -> SamplingBatch:
    """The engine's sampling settings of generate's sequences for one step: each seeded as the engine seeds it,
    its noise at the position it samples."""
    p = params[0]
    greedy = p.temperature == 0
    rows = len(params)
    return SamplingBatch(
        temperature=torch.full((rows,), p.temperature), top_k=torch.full((rows,), p.top_k),
        top_p=torch.full((rows,), p.top_p), min_p=None,
        seeds=None if greedy else torch.tensor([x.seed for x in params]),
        offsets=torch.tensor([len(f) for f in fed]), all_greedy=greedy,
        any_top_k_or_p=not greedy and (p.top_k > 0 or p.top_p < 1), any_min_p=False,
    )  # fmt: skip


def _keys_in_layout(tap: str, parts: list[torch.Tensor], padding: Padding) -> list[torch.Tensor]:
    """Attention scores and patterns of each text have one key per token of the text: put them at the text's
    positions in the layout, the rest no key (-inf scores, zero probabilities)."""
    if not is_pattern(tap):
        return parts
    out = []
    for i, part in enumerate(parts):
        wide = widen(tap, part[..., :0], padding.width)
        wide[..., padding.positions(i)] = part[..., : padding.lengths[i]]
        out.append(wide)
    return out


def _layer(tap: str) -> int:
    return int(tap.split(".")[1])


def _values_needed(hooks: dict[str, TapHooks]) -> set[str]:
    """Taps whose values the hooks' PatternGrads read."""
    return {t for h in hooks.values() for fn in h.bwd if isinstance(fn, PatternGrads) for t in fn.needs}


def _save_grad(grads: dict[str, torch.Tensor], grad: torch.Tensor, hook: HookPoint) -> None:
    grads[hook.name] = grad.detach()


def _heads_first(tap: str, value: torch.Tensor) -> torch.Tensor:
    """Attention scores and patterns in TransformerLens's layout, [batch, heads, query_pos, key_pos]: a ported
    `cache["pattern", L][b, h]` must read head h, not position h (vlens's rows are per query position)."""
    return value.transpose(1, 2) if is_pattern(tap) and value.dim() == 4 else value


def _loss(rows: torch.Tensor, seqs: list[list[int]], padding: Padding, per_token: bool) -> torch.Tensor:
    """Next-token cross-entropy over every predicted position of every text (never a pad), from the logits' packed
    rows [tokens, vocab]: the mean, or per token [batch, positions - 1] as TransformerLens gives it, entry p the
    loss of the token after position p (zero where that is not a token of the text). One gather for the batch (a
    backward through a select per text would make a zero tensor of every logit for each)."""
    starts = np.cumsum([0] + [len(ids) for ids in seqs[:-1]])
    predicting = torch.from_numpy(np.concatenate([s + np.arange(len(ids) - 1) for s, ids in zip(starts, seqs)]))
    targets = torch.tensor([t for ids in seqs for t in ids[1:]], dtype=torch.long)
    picked = rows.index_select(0, predicting.to(rows.device)).float().log_softmax(-1)
    losses = -picked.gather(-1, targets[:, None].to(rows.device))[:, 0]
    if not per_token:
        return losses.sum() / max(len(losses), 1)
    text = torch.tensor([i for i, ids in enumerate(seqs) for _ in ids[1:]], dtype=torch.long)
    at = torch.cat([padding.positions(i)[:-1] for i in range(len(seqs))])
    out = torch.zeros(len(seqs), max(padding.width - 1, 0), device=rows.device, dtype=losses.dtype)
    return out.index_put((text.to(rows.device), at.to(rows.device)), losses)
