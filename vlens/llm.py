"""`LLM`: the user-facing entry point, shaped like vLLM's so that porting code means changing an import.

generate() and chat() go through the continuous-batching engine (built on first use, since it owns
the KV cache); trace() runs one cache-less packed forward per batch of texts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from vlens.attention import check_backend, make_backend
from vlens.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from vlens.capture.interventions import Intervention
from vlens.capture.names import hook_shapes, resolve_hooks
from vlens.chat import ChatOptions
from vlens.classify import (
    ClassifierHead,
    check_cross_encoder,
    check_sequence_classifier,
    classification_params,
    last_rows,
    pair_tokens,
    pairs,
)
from vlens.distributed.executor import Executor
from vlens.embedding import DEFAULT_HOOK, EmbeddingDefaults, embedding_of, embedding_params
from vlens.encode import PoolingParams, bi_encoder, check_task, cosine, pooled, pooling_request
from vlens.engine.config import EngineConfig
from vlens.engine.llm_engine import EngineStats, LLMEngine, NewRequest
from vlens.engine.lora import LoRARequest
from vlens.engine.model_runner import ModelRunner
from vlens.engine.packed import token_batches
from vlens.generation_config import sampling_defaults
from vlens.images import ImageEncoder, PromptImages, chat_images
from vlens.inputs import ImagePrompt, cache_salts, prompt_list, to_token_lists
from vlens.loader import load_model, resolve_device
from vlens.outputs import (
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from vlens.sampling_params import SamplingParams

log = logging.getLogger("vlens")


class LLM:
    def __init__(self, model: str | os.PathLike | None = None, **settings):
        """`settings` are those of `EngineConfig` (dtype, device, max_num_seqs, block_size, ...); an unknown
        or invalid one is a ValueError naming it, raised before the model is loaded."""
        config = self.engine_config = EngineConfig.from_kwargs({"model": None if model is None else str(model), **settings})
        device = resolve_device(config.device)
        check_backend(config.attention_backend, device)  # FlashInfer on a CPU: before loading
        if config.compile_decode and device.type != "cpu":
            raise ValueError(f"compile_decode: True is for the CPU; on {device.type} decode steps replay CUDA graphs "
                             "(enforce_eager=False)")  # fmt: skip
        if config.tensor_parallel_size > 1:  # ranks 1.. in worker processes; this one is rank 0
            loaded = Executor(
                model, config.dtype, device, config.tensor_parallel_size,
                config.attention_backend, config.distributed_executor_backend, compiled=not config.enforce_eager,
                block_size=config.block_size, revision=config.revision, latent_kv_cache=config.latent_kv_cache,
                hf_overrides=config.hf_overrides,
            ).loaded  # fmt: skip
        else:
            loaded = load_model(model, dtype=config.dtype, device=config.device, revision=config.revision,
                                latent_kv_cache=config.latent_kv_cache, hf_overrides=config.hf_overrides)  # fmt: skip
        self.model, self.config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.model_path, self.model_name = loaded.path, loaded.name
        self.sampling_defaults = sampling_defaults(config.generation_config, loaded.path)  # (vlens.generation_config)
        if self.sampling_defaults:
            try:
                SamplingParams(**self.sampling_defaults)
            except ValueError as e:
                raise ValueError(f"generation_config: its sampling defaults are refused: {e}") from None
            log.info("sampling defaults from the generation config: %s (generation_config='vllm' for none)",
                     self.sampling_defaults)  # fmt: skip
        self.adapter_path = loaded.adapter  # (a LoRA adapter's directory as the model: the adapter merged in)
        self.device = loaded.model.lm_head.weight.device
        self.dtype = loaded.model.lm_head.weight.dtype
        self.classifier = ClassifierHead.load(loaded) if self.config.classifier_labels else None
        self.embedding_defaults = EmbeddingDefaults.of(self.model_path)
        kinds = {attn.kind for attn in self.model.attention_layers()}
        self.backend = make_backend(
            config.attention_backend, self.device, not config.enforce_eager, kinds, self.dtype, config.block_size
        )
        self.runner = ModelRunner(
            self.model, self.backend, config.max_num_batched_tokens, config.max_num_seqs,
            graphs=not config.enforce_eager and config.tensor_parallel_size == 1,  # no collectives in a graph yet
            kernels=not config.enforce_eager, compile_decode=config.compile_decode,
        )
        self._engine: LLMEngine | None = None
        self._images_encoder: ImageEncoder | None = None  # (see image_encoder)
        self._images_lock = threading.Lock()

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            self._engine = LLMEngine(self.runner, self.tokenizer, self.engine_config)
        return self._engine

    def stats(self) -> EngineStats:
        """The engine's gauges and counters now (its attention backend among them)."""
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (as vLLM's): later prompts are computed anew, whatever earlier ones left.
        False, and nothing forgotten, while requests run."""
        return self.engine.reset_prefix_cache()

    def hook_names(self) -> dict[str, tuple[int, ...]]:
        """Every hook name this model has, in forward order, with its per-token shape."""
        return hook_shapes(self.config)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what a request without sampling params runs with, the generation config's defaults among them."""
        return SamplingParams(**self.sampling_defaults)

    def get_tokenizer(self):
        """The model's HF tokenizer (None for a checkpoint without tokenizer files), as vLLM's LLM gives it."""
        return self.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]] | dict | Sequence[dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt in one continuous batch; outputs come back in prompt order. `lora_request`: the
        LoRA adapter they run under, or one per prompt (None: the base model; enable_lora, vlens.engine.lora).
        `priority`: one per prompt, lower first (vLLM's; an engine made with scheduling_policy="priority").

        Every request is validated before any runs, so a bad one fails the call without side effects."""
        listed = prompt_list(prompts)  # (checks them first)
        salts, prompts = cache_salts(prompts), listed
        token_lists, images = self._tokens(prompts, "prompts")
        texts = [p.text if isinstance(p, ImagePrompt) else p if isinstance(p, str) else None for p in prompts]
        return self._run(token_lists, texts, sampling_params, use_tqdm, images, lora_request, priority, salts)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the tokenizer's chat template; one whose contents hold
        images (vLLM's image_url or image_pil parts) through the processor's, its images read as generate() reads
        multi_modal_data. `lora_request`, `priority`: as generate's. The rest are vLLM's (vlens.chat.ChatOptions):
        another template, the template's variables, OpenAI's function `tools` for the template to render, and
        `continue_final_message=True, add_generation_prompt=False` to have the reply continue a last assistant
        message (an answer's start written for the model)."""
        options = ChatOptions(add_generation_prompt, continue_final_message, chat_template, chat_template_kwargs, tools)
        prompts = self._rendered(messages, options)
        token_lists, images = self._tokens(prompts, "messages", add_special_tokens=False)  # (the template holds them)
        texts = [p.text if isinstance(p, ImagePrompt) else p for p in prompts]
        return self._run(token_lists, texts, sampling_params, use_tqdm, images, lora_request, priority)

    def _rendered(self, messages: Sequence[dict] | Sequence[Sequence[dict]], options: ChatOptions) -> list:
        """Each conversation as the text its template renders (an ImagePrompt where its contents hold images)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not conversations:
            raise ValueError("messages: expected a conversation (list of {'role', 'content'} dicts) or a list of them")
        prompts = []
        for i, conversation in enumerate(conversations):
            field = "messages" if len(conversations) == 1 else f"messages[{i}]"
            found = chat_images(list(conversation), field, local_files=True)
            if found is None:
                if self.tokenizer is None:
                    raise ValueError(f"{field}: this checkpoint has no tokenizer files to render it; use generate()")
                prompts.append(options.render(self.tokenizer, conversation, field))
            else:
                prompts.append(ImagePrompt(self.image_encoder(field).render_chat(found[0], field, options), found[1]))
        return prompts

    def _tokens(
        self, prompts, field: str, add_special_tokens: bool = True
    ) -> tuple[list[list[int]], list[PromptImages | None] | None]:
        """Each prompt's token ids, and the rows of its images (an ImagePrompt's: vlens.images) or None (all None:
        no prompt has images). Every image is encoded before anything runs, so a bad one fails the call without
        side effects."""
        prompts = prompt_list(prompts, field)
        at = [i for i, p in enumerate(prompts) if isinstance(p, ImagePrompt)]
        if not at:
            return to_token_lists(prompts, self.tokenizer, self.config.vocab_size, field, add_special_tokens), None
        fields = [f"{field}[{i}]" for i in at]
        pieces = self.image_encoder().encode([prompts[i] for i in at], fields, add_special_tokens)
        encoded = dict(zip(at, pieces))
        token_lists = to_token_lists([encoded[i][0] if i in encoded else p for i, p in enumerate(prompts)],
                                     self.tokenizer, self.config.vocab_size, field, add_special_tokens)  # fmt: skip
        return token_lists, [encoded[i][1] if i in encoded else None for i in range(len(prompts))]

    def image_encoder(self, field: str = "multi_modal_data") -> ImageEncoder:
        """The checkpoint's processor and vision tower, built for the first prompt with images (vlens.images; the
        server's requests may ask for it at once, from threads). `field`: what the asking request's errors name.
        Under tensor parallelism rank 0 alone runs the tower, and its rows go to the other ranks with each forward."""
        with self._images_lock:
            if self._images_encoder is None:
                self._images_encoder = ImageEncoder(self.model_path, self.dtype, self.device, field)
        return self._images_encoder

    def _run(
        self, token_lists, texts, sampling_params, use_tqdm: bool, images=None, lora_request=None, priority=None,
        salts=None,
    ) -> list[RequestOutput]:  # fmt: skip
        engine = self.engine
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = [sampling_params] * len(token_lists) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(token_lists):
            raise ValueError(f"sampling_params: got {len(params)} for {len(token_lists)} prompts; give one, or one per prompt")
        loras = [lora_request] * len(token_lists) if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)  # fmt: skip
        if len(loras) != len(token_lists):
            raise ValueError(f"lora_request: got {len(loras)} for {len(token_lists)} prompts; give one, or one per "
                             "prompt")  # fmt: skip
        priorities = [0] * len(token_lists) if priority is None else list(priority)
        if len(priorities) != len(token_lists) or not all(isinstance(p, int) and not isinstance(p, bool)
                                                         for p in priorities):  # fmt: skip
            raise ValueError(f"priority: got {priority!r} for {len(token_lists)} prompts; give one int per prompt")
        images, salts = images or [None] * len(token_lists), salts or [None] * len(token_lists)
        requests = zip(token_lists, params, texts, images, loras, priorities, salts)
        ids = engine.add_requests([NewRequest(t, p, text, images=i, lora=lora, priority=rank, cache_salt=salt)
                                   for t, p, text, i, lora, rank, salt in requests])  # fmt: skip
        index = {request_id: i for i, request_id in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        try:
            with tqdm(total=len(ids), desc="vlens generate", unit="req", disable=not use_tqdm) as bar:
                while engine.has_work():
                    for delta in engine.step():
                        if delta.finished:
                            results[index[delta.request_id]] = delta.output
                            bar.update(1)
        except BaseException:  # (Ctrl-C in a notebook) left running, they would end in the next call, unknown to it
            for request_id in ids:
                engine.abort(request_id)
            raise
        return results

    def beam_search(
        self, prompts: str | Sequence[str] | Sequence[Sequence[int]] | dict | Sequence[dict], params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
    ) -> list[BeamSearchOutput]:  # fmt: skip
        """vLLM's beam search: per prompt, the params.beam_width likeliest continuations (vlens.beam_search)."""
        token_lists, images = self._tokens(prompt_list(prompts), "prompts")
        if images is not None:
            raise ValueError("prompts: beam search takes texts and token ids; a prompt with images goes to generate()")

        def generate(ids: list[list[int]], step: SamplingParams) -> list[RequestOutput]:
            return self.generate(ids, step, use_tqdm=False, lora_request=lora_request)

        return beam_search(generate, token_lists, params, self.engine.eos_ids, self.tokenizer)

    def embed(
        self, prompts: str | Sequence[str] | Sequence[Sequence[int]] | dict | Sequence[dict], hook: str = DEFAULT_HOOK,
        pooling: str | None = None, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, normalize: bool | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> list[EmbeddingRequestOutput]:  # fmt: skip
        """vLLM's embed, for any model: one vector per prompt, `hook`'s rows pooled on the device ("mean" over the
        prompt, or the "last" row), as vlens serve's /v1/embeddings gives them (vlens.embedding); `normalize` (or
        vLLM's pooling_params.normalize): of unit length. Unset, both are what the checkpoint's sentence-transformers
        modules say (an embedding model's), else the mean, as the hook has it. Prefill-only requests: a batch of them
        stops after the hook's layer."""
        if normalize is not None and not isinstance(normalize, bool):
            raise ValueError(f"normalize: {normalize!r} is not allowed; expected a bool")
        dimensions = None
        if pooling_params is not None:
            self._check_pooling_params(pooling_params, "embed", hook)
            if normalize is not None and pooling_params.normalize is not None:
                raise ValueError("normalize: give it once, here or in pooling_params")
            normalize = pooling_params.normalize if normalize is None else normalize
            dimensions = pooling_params.dimensions
        defaults = self.embedding_defaults
        pooling = pooling or defaults.pooling or "mean"
        normalize = bool(defaults.normalize) if normalize is None else normalize
        params = embedding_params(hook, pooling, self.config, truncate_prompt_tokens=truncate_prompt_tokens)
        outputs = self.generate(prompts, params, use_tqdm, lora_request)
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(embedding_of(o, hook, normalize, dimensions)),
                                       o.prompt_token_ids) for o in outputs]  # fmt: skip

    def classify(
        self, prompts: str | Sequence[str] | Sequence[Sequence[int]] | dict | Sequence[dict], use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        truncate_prompt_tokens: int | None = None, interventions: Sequence[Intervention] = (),
        pooling_params: PoolingParams | None = None,
    ) -> list[ClassificationRequestOutput]:  # fmt: skip
        """vLLM's classify, for a sequence classifier's checkpoint (HF's ...ForSequenceClassification): each prompt's
        class probabilities, from its head over the final norm's last row (vlens.classify; vLLM's
        pooling_params.use_activation=False: the logits themselves); `interventions`: the classes of the model they
        steer (a reward model's score under a steer, say)."""
        check_sequence_classifier(self.config, "classify")
        if pooling_params is not None:
            self._check_pooling_params(pooling_params, "classify")
        params = classification_params(self.config, interventions, truncate_prompt_tokens)
        outputs = self.generate(prompts, params, use_tqdm, lora_request)
        classes = self.classifier.classify(last_rows(outputs))
        if pooling_params is not None and pooling_params.use_activation is False:
            classes = [dataclasses.replace(c, probs=c.logits) for c in classes]
        return [ClassificationRequestOutput(o.request_id, c, o.prompt_token_ids) for o, c in zip(outputs, classes)]

    def classify_chat(
        self, messages: Sequence[dict] | Sequence[Sequence[dict]], use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, chat_template: str | None = None,
        add_generation_prompt: bool = False, continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None, interventions: Sequence[Intervention] = (),
    ) -> list[ClassificationRequestOutput]:  # fmt: skip
        """A reward model's reading of whole conversations (the server's /classify chat form, offline): each rendered
        with the chat template, with no generation prompt unless asked, then classified as classify() does."""
        options = ChatOptions(add_generation_prompt, continue_final_message, chat_template, chat_template_kwargs)
        prompts = self._rendered(messages, options)
        if any(isinstance(p, ImagePrompt) for p in prompts):
            raise ValueError("messages: classify_chat reads texts; a conversation with images goes to chat()")
        token_lists = to_token_lists(prompts, self.tokenizer, self.config.vocab_size, "messages",
                                     add_special_tokens=False)  # fmt: skip
        return self.classify(token_lists, use_tqdm, lora_request, interventions=interventions)

    def score(
        self, data_1: str | Sequence[str], data_2: str | Sequence[str], use_tqdm: bool = True,
        lora_request: LoRARequest | None = None, truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:  # fmt: skip
        """vLLM's score, for a cross-encoder (a sequence classifier of one class: a reranker): each pair's relevance,
        the pair tokenized as the tokenizer joins two texts (vlens.classify.pairs: one text with each of the others,
        or two lists item by item); for an embedding model (vlens.encode.bi_encoder), the cosine of the pair's two
        embeddings, each text embedded once."""
        if bi_encoder(self.config, self.embedding_defaults):
            joined = pairs(data_1, data_2)
            texts = list(dict.fromkeys(text for pair in joined for text in pair))
            embedded = dict(zip(texts, self.encode(texts, pooling_task="embed", use_tqdm=use_tqdm,
                                                   lora_request=lora_request,
                                                   truncate_prompt_tokens=truncate_prompt_tokens)))  # fmt: skip
            return [ScoringRequestOutput(f"{embedded[a].request_id}-{embedded[b].request_id}",
                                         ScoringOutput(cosine(embedded[a].outputs.data, embedded[b].outputs.data)),
                                         embedded[a].prompt_token_ids + embedded[b].prompt_token_ids)
                    for a, b in joined]  # fmt: skip
        check_cross_encoder(self.config, "score")
        if self.tokenizer is None:
            raise ValueError("score: this checkpoint has no tokenizer files to join the texts with")
        token_lists = [pair_tokens(self.tokenizer, self.config, a, b) for a, b in pairs(data_1, data_2)]
        outputs = self.classify(token_lists, use_tqdm, lora_request, truncate_prompt_tokens)
        return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.probs[0]), o.prompt_token_ids)
                for o in outputs]  # fmt: skip

    def encode(
        self, prompts: str | Sequence[str] | Sequence[Sequence[int]] | dict | Sequence[dict],
        pooling_params: PoolingParams | None = None, *, pooling_task: str | None = None,
        truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        interventions: Sequence[Intervention] = (),
    ) -> list[PoolingRequestOutput]:  # fmt: skip
        """vLLM's encode: each prompt's tensor for `pooling_task` (required, as vLLM's: "token_embed",
        "token_classify", "embed" or "classify"; vlens.encode says what each reads), under `interventions` where
        given."""
        task = check_task(pooling_task, self.config)
        params = PoolingParams() if pooling_params is None else pooling_params
        self._check_pooling_params(params, task)
        request = pooling_request(task, self.embedding_defaults, interventions, truncate_prompt_tokens)
        outputs = self.generate(prompts, request, use_tqdm, lora_request)
        params = params.resolved(task, self.embedding_defaults)
        return [PoolingRequestOutput(o.request_id, PoolingOutput(pooled(task, o, params, self.classifier)),
                                     o.prompt_token_ids) for o in outputs]  # fmt: skip

    def reward(
        self, prompts: str | Sequence[str] | Sequence[Sequence[int]] | dict | Sequence[dict], *,
        pooling_params: PoolingParams | None = None, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        interventions: Sequence[Intervention] = (),
    ) -> list[PoolingRequestOutput]:  # fmt: skip
        """vLLM's reward: a reward model's (a classifier's) output at every prompt token, [tokens, classes]:
        encode's "token_classify"."""
        return self.encode(prompts, pooling_params, pooling_task="token_classify", use_tqdm=use_tqdm,
                           truncate_prompt_tokens=truncate_prompt_tokens, lora_request=lora_request,
                           interventions=interventions)  # fmt: skip

    @torch.inference_mode()
    def trace(
        self, texts: str | Sequence[str] | Sequence[Sequence[int]] | dict | Sequence[dict], hooks: str | Sequence[str],
        lora_request: LoRARequest | None = None,
    ) -> list[dict[str, torch.Tensor]]:
        """One forward per text (packed together), every position: per text a dict hook -> CPU [tokens, ...]; under
        `lora_request`'s adapter where given (as generate's).

        Texts are tokenized as the model's HF tokenizer does by default (special tokens included);
        token-id lists are taken as they are, and prompts with images as generate() takes them. The forward stops
        after the deepest requested layer."""
        wanted = resolve_hooks(hooks, self.config)
        taps = sorted(set(wanted.values()))
        token_lists, images = self._tokens(texts, "texts")
        self.check_fits(token_lists, "texts")
        slot = None if lora_request is None else self.engine.hold_lora(lora_request)
        captured: list[dict[str, torch.Tensor]] = [{} for _ in token_lists]
        try:
            for batch in token_batches([len(t) for t in token_lists], self.engine_config.max_num_batched_tokens):
                given = None if images is None else [images[i] for i in batch]
                plan = self.runner.packed([token_lists[i] for i in batch], taps, images=given, lora_slot=slot)
                for owner, tap, rows in plan.pieces():
                    captured[batch[owner]][tap] = rows.clone()
        finally:
            if slot is not None:
                self.engine.loras.release(slot)
        return [{name: c[tap] for name, tap in wanted.items()} for c in captured]

    def close(self) -> None:
        """End the tensor-parallel group this LLM leads (its worker processes or Ray actors), so that another
        can start in this process, as a notebook's re-run cell does; idempotent, and a no-op in one process.
        `with LLM(...) as llm:` closes on the way out."""
        if self.model.executor is not None:
            self.model.executor.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_pooling_params(self, params: object, task: str, hook: str = DEFAULT_HOOK) -> None:
        """Raise naming pooling_params unless it is one `task` reads on this model, of `hook` (vlens.encode)."""
        if not isinstance(params, PoolingParams):
            raise ValueError(f"pooling_params: expected a PoolingParams, got {type(params).__name__}")
        params.check(task, self.config, hook=hook)

    def check_fits(self, token_lists: list[list[int]], field: str) -> None:
        """A cache-less forward (trace, HookedLM) of texts within the model's length, as a prompt must be: past
        it a learned position embedding has no row (an IndexError inside the forward), and rotary positions
        are ones the model never saw."""
        limit = self.engine_config.max_model_len or self.config.max_position_embeddings
        for i, ids in enumerate(token_lists):
            if len(ids) > limit:
                raise ValueError(f"{field}[{i}]: {len(ids)} tokens exceed this model's length, max_model_len={limit}")
