"""Soak `vlens serve --enable-capture`: many client threads, a random mix of requests, clients that vanish.

    .venv/bin/python benchmarks/soak_server.py [--threads 64] [--requests 1000] [--max-tokens 8] [--seed 0]

The server runs as a subprocess on a loopback port (SmolLM2-135M, float32, a small KV cache so that
requests queue and get preempted). Each client thread takes requests from one shared list drawn at random
(`draw`): completions and chat, streamed and not, prompts from one token to the model's length (text and
token ids), greedy or seeded sampling, `n` up to 3, penalties, logprobs, steering, capture of random
hooks / positions / dtypes (inline or as a download handle), embeddings. About one request in ten
misbehaves: it disconnects mid-stream, gives up before the answer (a short read timeout), or leaves its
activation handle undownloaded. The same list is sent twice (two rounds).

Then: every answered request must equal the same request replayed alone (text and finish reasons exactly;
activations within 1e-4 per row, relative, or the dtype's epsilon for 16-bit captures); /metrics must show
nothing running, waiting or admitted, no KV block in use and no capture byte reserved; the handles left are
at most those of misbehaving clients, and none is left once --activation-ttl has passed; and the server's
resident memory after round two must be within 5% of after round one. Prints requests/s, p50/p99 latency,
and the memory figures; exits 1 on any failure. tests/test_server_soak.py runs the same with small numbers.

The defaults take about 13 minutes on a 2-core CPU (two rounds of 3 minutes, then 1000 replays one at a
time); keep them: the server's output fills a 64 KiB pipe only after ~900 requests, which is how the
harness's unread pipe was found. `--requests 200` takes about 3 minutes.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import re
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from safetensors.torch import load

WORDS = ["the", "river", "city", "light", "music", "north", "paper", "stone", "garden", "winter", "machine", "story",
         "people", "bright", "quiet", "history", "number", "open", "world", "small", "ancient", "market", "language",
         "road", "sea", "theory"]  # fmt: skip
HOOKS = ["hook_embed", "blocks.{L}.hook_resid_post", "blocks.{L}.attn.hook_z", "blocks.{L}.mlp.hook_post",
         "blocks.{L}.ln1.hook_normalized", "hidden_states.{L}", "ln_final.hook_out"]  # fmt: skip
POSITIONS = ["all", "last", "prompt", "generated", [0, -1], {"start": 1, "stop": -1}, 0]
DTYPES = [None, "float32", "bfloat16", "float16"]
TOLERANCE = 1e-4  # relative, per row, float32 (batch-order noise is ~1e-6)
ENGINE = ["--dtype", "float32", "--max-num-seqs", "32", "--max-model-len", "256", "--kv-cache-memory", str(48 << 20)]


@dataclass(frozen=True)
class Call:
    """One request of the mix and how its client behaves."""

    path: str
    body: dict
    misbehave: str | None = None  # "disconnect" (mid-stream), "timeout" (gives up early), "unfetched" (handle)

    @property
    def capture(self) -> bool:
        return "capture" in self.body.get("vlens", {})


@dataclass
class Outcome:
    call: Call
    latency: float
    answer: dict | None = None  # what must equal the replay; None when the client left or was refused
    status: int | None = None
    error: str | None = None  # a failure: an unexpected status or body


def draw(n: int, seed: int, layers: int, hidden: int, vocab: int, max_model_len: int, max_tokens: int) -> list[Call]:
    """n requests drawn at random (reproducible from the seed)."""
    rng = random.Random(seed)
    calls = []
    for i in range(n):
        kind = rng.choices(["completion", "chat", "embedding"], [5, 3, 1])[0]
        long = rng.random() < 0.2
        room = max_model_len - max_tokens - 16  # the chat template adds a few tokens
        size = rng.randint(room // 2, room) if long else rng.randint(1, 12)
        text = " ".join(rng.choice(WORDS) for _ in range(max(1, size * 3 // 4)))  # ~1.3 tokens per word
        prompt = [rng.randrange(vocab) for _ in range(size)] if kind == "completion" and rng.random() < 0.3 else text
        if kind == "embedding":
            hook = rng.choice(HOOKS[:2]).format(L=rng.randrange(layers))
            body = {"input": [prompt, "short one"], "vlens": {"hook": hook, "pooling": rng.choice(["mean", "last"])}}
            calls.append(Call("/v1/embeddings", body))
            continue
        body: dict = {"max_tokens": rng.randint(1, max_tokens), "stream": rng.random() < 0.4}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = prompt
        body.update({"temperature": 0} if rng.random() < 0.5 else {"temperature": 0.8, "seed": rng.randrange(1 << 30)})
        extension: dict = {}
        if rng.random() < 0.4:
            hooks = sorted({rng.choice(HOOKS).format(L=rng.randrange(layers)) for _ in range(rng.randint(1, 3))})
            capture = {"hooks": hooks, "positions": rng.choice(POSITIONS)}
            if dtype := rng.choice(DTYPES):
                capture["dtype"] = dtype
            extension["capture"] = capture
        elif body["temperature"] and rng.random() < 0.3:
            body["n"] = rng.randint(2, 3)
        if rng.random() < 0.15:
            vector = [round(rng.gauss(0, 1), 3) for _ in range(hidden)]
            hook = f"blocks.{rng.randrange(layers)}.hook_resid_post"
            extension["interventions"] = [{"type": "steer", "hook": hook, "vector": vector, "scale": 2.0}]
        if rng.random() < 0.15:
            body.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
        if rng.random() < 0.1 and kind == "completion":
            body["logprobs"] = 2
        if extension:
            body["vlens"] = extension
        misbehave = None
        if rng.random() < 0.1:
            options = ["disconnect"] if body["stream"] else ["timeout"]
            misbehave = rng.choice(options + ["unfetched"] * ("capture" in extension))
        calls.append(Call("/v1/chat/completions" if kind == "chat" else "/v1/completions", body, misbehave))
    return calls


def _tensors(obj: dict, http: httpx.Client) -> dict[str, torch.Tensor]:
    if "data" in obj:
        return load(base64.b64decode(obj["data"]))
    r = http.get(obj["url"])
    r.raise_for_status()
    return load(r.content)


def _answer(path: str, chunks: list[dict], http: httpx.Client, fetch: bool) -> dict:
    """What a replay must reproduce (texts and finish reasons per choice, activations, embeddings) from the
    response or its stream chunks; an activation handle is downloaded only if `fetch`."""
    if path == "/v1/embeddings":
        [body] = chunks
        return {"embeddings": torch.tensor([d["embedding"] for d in body["data"]])}
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    activations = None
    for chunk in chunks:
        for c in chunk["choices"]:
            piece = c.get("text") if "text" in c else (c.get("message") or c.get("delta") or {}).get("content")
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
            if c.get("finish_reason"):
                finish[c["index"]] = c["finish_reason"]
        activations = chunk.get("vlens", {}).get("activations", activations)
    answer: dict = {"texts": texts, "finish": finish}
    if activations is not None and (fetch or "data" in activations):
        answer["activations"] = _tensors(activations, http)
    return answer


def send(http: httpx.Client, call: Call, obey: bool = True) -> Outcome:
    """One request as its client sends it (misbehaving unless obey=False, as the replays are sent)."""
    start = time.perf_counter()
    misbehave = call.misbehave if obey else None
    timeout = httpx.Timeout(120, read=0.05 + random.random() / 4) if misbehave == "timeout" else 120
    out = Outcome(call, 0.0)
    try:
        with http.stream("POST", call.path, json=call.body, timeout=timeout) as r:
            out.status = r.status_code
            if call.body.get("stream") and r.status_code == 200:
                chunks = []
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        if misbehave == "disconnect":
                            break  # leaving the block closes the connection mid-stream
                if misbehave != "disconnect":
                    if "error" in chunks[-1]:
                        out.error = f"stream ended with {chunks[-1]}"
                    else:
                        out.answer = _answer(call.path, chunks, http, misbehave != "unfetched")
            else:
                body = json.loads(r.read())
                if r.status_code != 200:
                    out.error = f"{r.status_code}: {body}"
                elif misbehave != "timeout":  # the answer beat the timeout: still a whole answer to compare
                    out.answer = _answer(call.path, [body], http, misbehave != "unfetched")
    except httpx.TimeoutException:
        if misbehave != "timeout":
            out.error = "timed out"
    out.latency = time.perf_counter() - start
    if out.status == 429:  # refused under load, as documented: not a failure, and nothing to compare
        out.error = None
    return out


def soak_round(url: str, calls: list[Call], threads: int) -> list[Outcome]:
    """Send every call from `threads` client threads (each with its own connection pool)."""
    local = threading.local()

    def one(call: Call) -> Outcome:
        if not hasattr(local, "http"):
            local.http = httpx.Client(base_url=url)
        return send(local.http, call)

    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(one, calls))


def differences(a: dict, b: dict) -> list[str]:
    """How a concurrent answer differs from the same request alone."""
    found = [f"{k}: {a[k]!r} != {b[k]!r}" for k in ("texts", "finish") if a.get(k) != b.get(k)]
    key = "embeddings" if "embeddings" in a else "activations"
    if key not in a:  # a handle its client left undownloaded
        return found
    ta, tb = (x if key == "activations" else {key: x} for x in (a[key], b[key]))
    if set(ta) != set(tb):
        return [*found, f"tensors {sorted(ta)} != {sorted(tb)}"]
    for name, x in ta.items():
        y = tb[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            found.append(f"{name}: {x.dtype}{list(x.shape)} != {y.dtype}{list(y.shape)}")
        elif not x.is_floating_point():
            if not torch.equal(x, y):
                found.append(f"{name} differs")
        elif x.numel():
            tol = max(TOLERANCE, torch.finfo(x.dtype).eps)
            x, y = (t.double().reshape(len(t), -1) if t.dim() > 1 else t.double()[None] for t in (x, y))
            err = ((x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-30)).max().item()
            if err > tol:
                found.append(f"{name}: row error {err:.2e} > {tol:.0e}")
    return found


def gauges(url: str) -> dict[str, float]:
    """The unlabelled samples of /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+) (\S+)$", text, re.MULTILINE)}


IDLE = ("vlens_requests_running", "vlens_requests_waiting", "vlens_kv_cache_usage", "vlens_requests_admitted",
        "vlens_capture_bytes_reserved")  # fmt: skip


def settle(url: str, timeout: float = 60) -> dict[str, float]:
    """/metrics once the server is idle (every gauge in IDLE at zero); raises if it never gets there."""
    deadline = time.monotonic() + timeout
    while True:
        now = gauges(url)
        if not any(now[m] for m in IDLE):
            return now
        if time.monotonic() > deadline:
            raise AssertionError(f"server never idle: { ({m: now[m] for m in IDLE}) }")
        time.sleep(0.1)


@dataclass
class Report:
    requests: int
    threads: int
    rounds: list[list[Outcome]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    rss: list[float] = field(default_factory=list)  # after each round, once idle
    failures: list[str] = field(default_factory=list)
    handles_left: int = 0

    def lines(self) -> list[str]:
        out = []
        for i, (outcomes, seconds, rss) in enumerate(zip(self.rounds, self.seconds, self.rss)):
            lat = sorted(o.latency for o in outcomes if o.answer is not None)
            count = {
                k: sum(1 for o in outcomes if o.call.misbehave == k) for k in ("disconnect", "timeout", "unfetched")
            }
            refused = sum(1 for o in outcomes if o.status == 429)
            out.append(
                f"round {i + 1}: {len(outcomes)} requests from {self.threads} clients in {seconds:.1f} s "
                f"({len(outcomes) / seconds:.1f} req/s); answered {len(lat)}, misbehaving {count}, 429 {refused}; "
                f"latency p50 {lat[len(lat) // 2]:.2f} s p99 {lat[min(len(lat) - 1, len(lat) * 99 // 100)]:.2f} s; "
                f"server RSS {rss / 2**20:.0f} MiB"
            )
        if len(self.rss) == 2:
            out.append(f"RSS round 2 / round 1: {self.rss[1] / self.rss[0]:.3f}")
        out.append(f"handles left by misbehaving clients: {self.handles_left}, all expired after the TTL")
        out.append(f"failures: {len(self.failures)}")
        return out + self.failures[:20]


def soak(url: str, calls: list[Call], threads: int, ttl_s: float) -> Report:
    """Two identical rounds, the replays and every check; failures are collected in the report."""
    report = Report(len(calls), threads)
    for _ in range(2):
        start = time.perf_counter()
        outcomes = soak_round(url, calls, threads)
        report.seconds.append(time.perf_counter() - start)
        report.rounds.append(outcomes)
        report.rss.append(settle(url)["process_resident_memory_bytes"])
        report.failures += [f"{o.call.path} {o.call.misbehave}: {o.error}" for o in outcomes if o.error]
    with httpx.Client(base_url=url) as http:
        for i, call in enumerate(calls):
            answered = [r[i].answer for r in report.rounds if r[i].answer is not None]
            if not answered:
                continue
            alone = send(http, call, obey=False)
            if alone.answer is None:
                report.failures.append(f"replay of {call.path} failed: {alone.error}")
                continue
            for answer in answered:
                report.failures += [f"request {i} ({call.path}): {d}" for d in differences(answer, alone.answer)]
    idle = settle(url)
    report.handles_left = int(idle["vlens_activation_handles"])
    may_leave = sum(2 for c in calls if c.capture and c.misbehave in ("unfetched", "timeout"))
    if report.handles_left > may_leave:
        report.failures.append(f"{report.handles_left} handles left, but only {may_leave} requests could leave one")
    time.sleep(ttl_s)
    if left := gauges(url)["vlens_activation_handles"]:
        report.failures.append(f"{left:.0f} handles still held after --activation-ttl {ttl_s} s")
    if report.rss[1] > 1.05 * report.rss[0]:
        report.failures.append(f"resident memory grew from {report.rss[0]:.0f} to {report.rss[1]:.0f} bytes")
    return report


def server_args(model: str, ttl_s: float) -> list[str]:
    """`vlens serve` options of the soak: capture on, small inline limit (so handles are used), short TTL."""
    return ["--model", model, *ENGINE, "--enable-capture", "--inline-activation-bytes", str(16 << 10),
            "--activation-ttl", str(ttl_s)]  # fmt: skip


@contextmanager
def served(model: str, ttl_s: float) -> Iterator[str]:
    """`vlens serve` as the tests start it (tests/server_helpers.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from server_helpers import vlens_serve

    with vlens_serve(server_args(model, ttl_s)) as (url, _):
        yield url


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=64, help="client threads (default 64)")
    p.add_argument("--requests", type=int, default=1000, help="requests per round (default 1000)")
    p.add_argument("--max-tokens", type=int, default=8, help="most tokens a request generates (default 8)")
    p.add_argument("--ttl", type=float, default=20.0, help="the server's --activation-ttl in seconds (default 20)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from vlens.loader import resolve_model_path

    model = str(resolve_model_path(None))
    calls = draw(
        args.requests, args.seed, layers=30, hidden=576, vocab=49152, max_model_len=256, max_tokens=args.max_tokens
    )
    with served(model, args.ttl) as url:
        report = soak(url, calls, args.threads, args.ttl)
    print("\n".join(report.lines()))
    sys.exit(1 if report.failures else 0)


if __name__ == "__main__":
    main()
