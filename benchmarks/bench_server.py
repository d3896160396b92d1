"""`vlens serve` against the same engine called offline: what HTTP, JSON, tokenization, streaming the
results back and encoding activations cost, as ratios.

    .venv/bin/python benchmarks/bench_server.py [--tokens 32] [--requests-per-client 4] [--clients 1 8 32]
                                                [--threads N] [--workload generate loglikelihood]
                                                [--ll-requests 200] [--ll-clients 8]

SmolLM2-135M (the embedded default), float32, this machine's CPU. The server runs as a subprocess
(`vlens serve --enable-capture`, the engine options below); the clients are asyncio tasks on httpx in
this process, each sending its requests one after another (a closed loop), so C clients keep C
requests in flight. Offline, the same prompts go through `LLM.generate` C at a time, which is the
batch the server's engine sees. Every request generates exactly --tokens tokens (ignore_eos, greedy).
With capture, each request asks for blocks.{9,19,29}.hook_resid_post at its generated positions;
the server returns them inline as base64 safetensors, offline they stay tensors.
Columns: requests/s and output tokens/s of each side, and server / offline (1.00 = no overhead).
On a CPU shared with other work, give --threads 1: torch's spinning intra-op threads then slow the
process's main thread (where LLM.generate runs) far more than the server's engine thread, which
would flatter the server.

The loglikelihood workload is what lm-evaluation-harness's local-completions sends for a multiple-choice
task: per question one request holding its 2-4 choices as token-id prompts (context + choice), with
echo, logprobs=1, max_tokens=1, temperature 0; --ll-clients clients send them. Against it, an HF
forward loop over the same requests: per request one right-padded float32 forward of its choices and a
log_softmax. Columns: requests/s of each and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx
import torch

from vlens import LLM, Capture, SamplingParams
from vlens.loader import resolve_model_path

ENGINE = {"dtype": "float32", "max_num_seqs": 64, "max_model_len": 512, "kv_cache_memory": 256 << 20}
HOOKS = "blocks.{9,19,29}.hook_resid_post"
SUBJECTS = [
    "the printing press",
    "photosynthesis",
    "bridges",
    "chess",
    "the blue sky",
    "bread",
    "honey bees",
    "volcanoes",
    "the first computers",
    "vaccines",
    "ocean currents",
    "Roman roads",
    "second languages",
    "jet engines",
    "the water cycle",
    "black holes",
]
STYLES = ["Explain briefly:", "Write a short story about", "Give three facts about", "Describe, for a child,"]


def prompts(n: int) -> list[str]:
    return [f"{STYLES[i % len(STYLES)]} {SUBJECTS[(i // len(STYLES)) % len(SUBJECTS)]} ({i})." for i in range(n)]


def start_server(path: str, threads: int | None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    options = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    command = [
        sys.executable,
        "-c",
        "import sys; from vlens.cli import main; sys.exit(main(sys.argv[1:]))",
        "serve",
        "--model",
        path,
        "--port",
        str(port),
        "--enable-capture",
        *options,
    ]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("vlens serve did not start")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)


def body(prompt: str, tokens: int, capture: bool) -> dict:
    out = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    if capture:
        out["vlens"] = {"capture": {"hooks": HOOKS, "positions": "generated"}}
    return out


async def served(url: str, texts: list[str], clients: int, tokens: int, capture: bool) -> tuple[float, int]:
    """Seconds and output tokens for all texts sent by `clients` closed-loop clients."""
    pending = list(reversed(texts))
    generated = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal generated
        while pending:
            r = await http.post("/v1/completions", json=body(pending.pop(), tokens, capture))
            r.raise_for_status()
            generated += r.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        (await http.post("/v1/completions", json=body(texts[0], tokens, capture))).raise_for_status()  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return time.perf_counter() - start, generated


def offline(llm: LLM, texts: list[str], clients: int, tokens: int, capture: bool) -> tuple[float, int]:
    params = SamplingParams(
        max_tokens=tokens,
        temperature=0,
        ignore_eos=True,
        capture=Capture(hooks=HOOKS, positions="generated") if capture else None,
    )
    llm.generate(texts[:1], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = []
    for i in range(0, len(texts), clients):
        outputs += llm.generate(texts[i : i + clients], params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


CHOICES = ["yes", "no", "maybe so", "it depends on the weather", "never", "the sea", "forty-two", "a small red bird"]


def loglikelihood_requests(tokenizer, n: int) -> list[list[list[int]]]:
    """n requests of 2-4 choices each: context + choice token ids, as lm-eval builds them."""
    out = []
    for i, text in enumerate(prompts(n)):
        context = tokenizer(f"Question: {text}\nAnswer:", add_special_tokens=False)["input_ids"]
        k = 2 + i % 3
        out.append([context + tokenizer(" " + CHOICES[(i + j) % len(CHOICES)], add_special_tokens=False)["input_ids"]
                    for j in range(k)])  # fmt: skip
    return out


async def served_loglikelihood(url: str, requests: list[list[list[int]]], clients: int) -> float:
    """Seconds for every request, sent by `clients` closed-loop clients."""
    pending = list(reversed(requests))

    def body(choices: list[list[int]]) -> dict:
        return {"prompt": choices, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234}

    async def client(http: httpx.AsyncClient) -> None:
        while pending:
            r = await http.post("/v1/completions", json=body(pending.pop()))
            r.raise_for_status()

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        (await http.post("/v1/completions", json=body(requests[0]))).raise_for_status()  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return time.perf_counter() - start


@torch.inference_mode()
def hf_loglikelihood(hf, requests: list[list[list[int]]]) -> float:
    """Seconds for an HF loop: one right-padded forward per request, log-probabilities of every token."""
    start = time.perf_counter()
    for choices in requests:
        width = max(map(len, choices))
        ids = torch.zeros(len(choices), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, c in enumerate(choices):
            ids[i, : len(c)], mask[i, : len(c)] = torch.tensor(c), 1
        logp = hf(ids, attention_mask=mask).logits.float().log_softmax(-1)
        logp[:, :-1].gather(-1, ids[:, 1:, None])
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, help="torch intra-op threads on both sides (default: torch's choice)")
    ap.add_argument("--workload", nargs="+", choices=["generate", "loglikelihood"], default=["generate", "loglikelihood"])
    ap.add_argument("--ll-requests", type=int, default=200, help="loglikelihood requests (2-4 choices each)")
    ap.add_argument("--ll-clients", type=int, default=8, help="clients sending the loglikelihood requests")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(resolve_model_path(None))
    llm = LLM(model=path, device="cpu", **ENGINE)
    proc, url = start_server(path, args.threads)
    rows, ll = [], None
    try:
        if "loglikelihood" in args.workload:
            from transformers import AutoModelForCausalLM

            requests = loglikelihood_requests(llm.tokenizer, args.ll_requests)
            s_time = asyncio.run(served_loglikelihood(url, requests, args.ll_clients))
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            hf_loglikelihood(hf, requests[:2])  # warm-up
            ll = (len(requests), s_time, hf_loglikelihood(hf, requests))
            print("  done: loglikelihood", file=sys.stderr)
        for capture in (False, True) if "generate" in args.workload else ():
            for clients in args.clients:
                texts = prompts(clients * args.requests_per_client)
                s_time, s_tokens = asyncio.run(served(url, texts, clients, args.tokens, capture))
                o_time, o_tokens = offline(llm, texts, clients, args.tokens, capture)
                rows.append((capture, clients, len(texts), s_time, s_tokens, o_time, o_tokens))
                print(f"  done: capture={capture} clients={clients}", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    threads = torch.get_num_threads()
    if ll is not None:
        n, s_time, h_time = ll
        print(f"SmolLM2-135M float32, {os.cpu_count()} CPUs, {threads} torch threads: lm-eval loglikelihood workload")
        print(f"  {n} requests of 2-4 choices, {args.ll_clients} clients: server {n / s_time:.2f} req/s, "
              f"HF forward loop {n / h_time:.2f} req/s, server/HF {h_time / s_time:.2f}x")  # fmt: skip
    if not rows:
        return
    print(
        f"SmolLM2-135M float32, {os.cpu_count()} CPUs, {threads} torch threads, {args.tokens} output tokens per request"
    )
    header = (
        "capture",
        "clients",
        "requests",
        "server req/s",
        "offline req/s",
        "server tok/s",
        "offline tok/s",
        "server/offline",
    )
    print("  ".join(f"{h:>14}" for h in header))
    for capture, clients, n, s_time, s_tokens, o_time, o_tokens in rows:
        cells = (
            "3 layers" if capture else "none",
            clients,
            n,
            f"{n / s_time:.2f}",
            f"{n / o_time:.2f}",
            f"{s_tokens / s_time:.1f}",
            f"{o_tokens / o_time:.1f}",
            f"{o_time / s_time:.2f}x",
        )
        print("  ".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    main()
