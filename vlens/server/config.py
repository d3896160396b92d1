"""What the operator chose at start-up: where to listen, who may call, and how much a request may take.

Declared once, as settings (see vlens.settings): the flags of `vlens serve` come from these fields."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

from vlens.reasoning import PARSERS as REASONING_PARSERS
from vlens.reasoning import ThinkTags
from vlens.server.tool_parsers import PARSERS, ToolParser
from vlens.settings import positive, setting, validate

API_KEY_ENV = "VLENS_API_KEY"  # where `vlens serve` finds the key when --api-key is not given


def _key(value: str | None) -> str | None:
    return None if value != "" else "must be a non-empty key, or none for no authentication, got ''"


def _port(value: int) -> str | None:
    """A TCP port: beyond 65535 the bind fails only after the model has loaded, with a traceback."""
    return None if value <= 65535 else f"must be an integer in 0..65535, got {value}"


def split_named_sae(spec: str) -> tuple[str, str, str | None]:
    """`NAME=PATH` or `NAME=PATH@HOOK` -> (name, path, hook or None); ValueError naming the form."""
    name, equals, rest = spec.partition("=")
    path, at, hook = rest.rpartition("@") if "@" in rest else (rest, "", "")
    if not (name and equals and path) or (at and not hook):
        raise ValueError(f"saes: {spec!r} is not NAME=PATH or NAME=PATH@HOOK")
    return name, path, hook or None


def _named_saes(specs: tuple[str, ...] | None) -> str | None:
    """Form, names and paths, checked before the model loads (the files themselves are read after it)."""
    try:
        named = [split_named_sae(spec)[:2] for spec in specs or ()]
    except ValueError as e:
        return str(e).removeprefix("saes: ")
    return _names_and_paths(named, "SAE")


def split_named_file(spec: str) -> tuple[str, str]:
    """`NAME=PATH` -> (name, path); ValueError naming the form."""
    name, equals, path = spec.partition("=")
    if not (name and equals and path):
        raise ValueError(f"{spec!r} is not NAME=PATH")
    return name, path


def _named_files(specs: tuple[str, ...] | None, what: str = "vector") -> str | None:
    """Form, names and paths of `--steering-vector`s (or `--lora-modules`), checked before the model loads."""
    try:
        named = [split_named_file(spec) for spec in specs or ()]
    except ValueError as e:
        return str(e)
    return _names_and_paths(named, what)


def _names_and_paths(named: list[tuple[str, str]], what: str) -> str | None:
    """What is wrong with (name, path) pairs: a name given twice, a path that does not exist."""
    names = [name for name, _ in named]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        return f"names {', '.join(twice)} more than once; each {what} needs its own name"
    missing = [f"{name}={path}" for name, path in named if not Path(path).expanduser().exists()]
    return f"{', '.join(missing)}: no such file or directory" if missing else None


def _template(value: str | None) -> str | None:
    """vLLM's --chat-template: a file's path, or the template's own text (a Jinja tag in it tells them apart)."""
    if value is None or "{{" in value or "{%" in value or Path(value).expanduser().is_file():
        return None
    return f"{value}: no such file, and no Jinja template ({{{{ ... }}}} or {{% ... %}} in it)"


def _directory(path: str | None) -> str | None:
    return None if path is None or Path(path).expanduser().is_dir() else f"{path}: no such directory"


@dataclass(frozen=True)
class ServerConfig:
    host: str = setting("127.0.0.1", "address to bind (default: 127.0.0.1, loopback only)")
    port: int = setting(8000, "port", minimum=0, check=_port)
    # Capture moves tensors out of the engine on behalf of one tenant; it is off unless asked for.
    enable_capture: bool = setting(False, "allow requests to capture activations")
    max_capture_bytes: int = setting(
        256 << 20, "refuse requests whose capture could exceed this many bytes (default: 256 MiB)", minimum=0
    )
    api_key: str | None = setting(
        None, "require `Authorization: Bearer KEY` on every route but /health and the /lens page (default: the "
        f"environment variable {API_KEY_ENV}, else no authentication, only sensible on loopback)", check=_key,
    )  # fmt: skip
    served_model_name: str | None = setting(None, "the model id clients send and /v1/models lists (default: --model)")
    inline_activation_bytes: int = setting(
        1 << 20, "activations up to this size come inline as base64, larger ones as a download handle (default: 1 MiB)",
        minimum=0,
    )  # fmt: skip
    activation_ttl_s: float = setting(
        600.0, "seconds an undownloaded activation handle is kept", flag="--activation-ttl", check=positive
    )
    max_body_bytes: int = setting(
        4 << 20, "request bodies beyond this are refused before parsing (default: 4 MiB)", minimum=0
    )
    saes: tuple[str, ...] | None = setting(
        None, "an SAE to load at start, as NAME=PATH (a SAELens directory or a Gemma Scope params.npz; "
        "NAME=PATH@HOOK names the hook it reads); repeat the flag for more; requests name them in the vlens "
        "extension and GET /v1/saes lists them", flag="--sae", repeat=True, check=_named_saes,
    )  # fmt: skip
    steering_vectors: tuple[str, ...] | None = setting(
        None, "a steering vector to load at start, as NAME=PATH (a file vlens.steering.SteeringVector.save wrote); "
        "repeat the flag for more; requests add them with the vlens extension's steering and GET "
        "/v1/steering_vectors lists them", flag="--steering-vector", repeat=True, check=_named_files,
    )  # fmt: skip
    lora_modules: tuple[str, ...] | None = setting(
        None, "a LoRA adapter served as a model of its own, as NAME=PATH (a PEFT adapter's directory; the model is "
        "built with enable_lora); repeat the flag for more; a request's model names one, and GET /v1/models lists "
        "them", flag="--lora-modules", repeat=True, check=partial(_named_files, what="adapter"),
    )  # fmt: skip
    allow_runtime_lora_updating: bool = setting(
        False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): LoRA adapters from directories "
        "on this machine, loaded while the server runs (the model is built with enable_lora)",
    )  # fmt: skip
    tuned_lens: str | None = setting(
        None, "a tuned lens to load at start (a directory as the tuned-lens package saves one); a capture with a "
        "logit_lens asks for it with tuned_lens: true", check=_directory,
    )  # fmt: skip
    # Overload: beyond these a request gets 429 with Retry-After instead of growing the server's memory.
    max_pending_requests: int = setting(
        1024, "prompts the server holds at once, running or queued in the engine; a request beyond gets 429",
        minimum=1,
    )  # fmt: skip
    max_capture_bytes_in_flight: int = setting(
        1 << 30, "activation bytes the server holds at once: the bounds of running capture requests plus handles "
        "not yet downloaded; a capture request beyond gets 429 (default: 1 GiB)", minimum=0,
    )  # fmt: skip
    shutdown_timeout_s: float = setting(
        30.0, "on SIGTERM or SIGINT, seconds running requests get to finish before they end with a 503; new ones "
        "get 503 at once", flag="--shutdown-timeout", minimum=0,
    )  # fmt: skip
    max_n: int = setting(16, "most samples of one prompt a request may ask for (n, best_of)", minimum=1)
    # /v1/embeddings: a hook read at every prompt position, pooled on the device into one vector per input.
    embedding_hook: str = setting("ln_final.hook_out", "the hook /v1/embeddings reads unless a request names another")
    embedding_pooling: str | None = setting(
        None, "how /v1/embeddings pools the hook's rows unless a request says: the mean, or the last row (unset: as "
        "the checkpoint's sentence-transformers modules say, else the mean)", choices=("mean", "last"),
    )  # fmt: skip
    # Chat templates: the server's in place of the checkpoint's, and whether a request may bring its own.
    chat_template: str | None = setting(
        None, "the chat template that renders chat requests in place of the checkpoint's: a Jinja file's path, or the "
        "template itself (vLLM's --chat-template)", check=_template,
    )  # fmt: skip
    trust_request_chat_template: bool = setting(
        False, "render a chat request with the chat_template it brings (a template is code the server runs; "
        "otherwise such a request is a 400)",
    )  # fmt: skip
    # tool_choice "auto" (vLLM's flags): the model's tool calls read out of its text (vlens.server.tool_parsers).
    enable_auto_tool_choice: bool = setting(
        False, "serve tool_choice \"auto\" (the default with tools): the model decides whether to call a tool, and "
        "the --tool-call-parser reads its calls out of the reply",
    )  # fmt: skip
    tool_call_parser: str | None = setting(
        None, "the format of the model's tool calls, as its chat template teaches it: hermes (Hermes, Qwen), "
        "llama3_json (Llama 3.1, 3.2; llama4_json the same), pythonic (Llama 3.2, 4; llama4_pythonic the same), "
        "mistral (Mistral Small 3.1 on, Ministral 3, Mistral 7B v0.3)",
        choices=tuple(PARSERS),
    )  # fmt: skip

    reasoning_parser: str | None = setting(
        None, "read chat replies as a reasoning model's: the thinking inside <think>...</think> as the message's "
        "reasoning, the answer after it as its content: deepseek_r1 (DeepSeek-R1, QwQ), qwen3 (Qwen3; its "
        "enable_thinking=false leaves the reply content), deepseek_v3 (DeepSeek-V3.1: content unless "
        "chat_template_kwargs thinking=true), openai_gptoss (gpt-oss: its analysis channel the reasoning, its final "
        "channel the content); the engine's too (a structured request thinks first)",
        choices=tuple(REASONING_PARSERS),
    )  # fmt: skip

    def __post_init__(self) -> None:
        validate(self)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(f"enable_auto_tool_choice: needs a tool_call_parser, one of {', '.join(PARSERS)}")

    def chat_template_text(self) -> str | None:
        """--chat-template's template: the file's text, or the flag's own."""
        if self.chat_template is None or "{{" in self.chat_template or "{%" in self.chat_template:
            return self.chat_template
        return Path(self.chat_template).expanduser().read_text()

    def think_tags(self) -> ThinkTags | None:
        return None if self.reasoning_parser is None else REASONING_PARSERS[self.reasoning_parser]

    def tool_parser(self) -> ToolParser | None:
        """The parser of tool_choice "auto"'s replies; None where "auto" is not served."""
        return PARSERS[self.tool_call_parser] if self.enable_auto_tool_choice else None
