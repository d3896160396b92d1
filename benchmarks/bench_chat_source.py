"""Benchmark: reading conversations for a harvest, SmolLM2's chat template, on one core of this CPU.

A harvest of conversations renders each through the chat template and tokenizes it in the source thread
(or in Ray Data tasks), ahead of the forwards; with `roles` it also finds each message's content (a second
rendering with markers) and marks the tokens that render a content of those roles. This times that path
against what a user would write with HF alone, in the same run:
  HF                  tokenizer.apply_chat_template(conversation, tokenize=True), one conversation at a time
  vlens               vlens.harvest.windows.token_documents of the conversations (rendered, tokenized in batches)
  vlens roles         the same with roles=("assistant",): marks included
Conversations: English-like documents cut into a user question and an assistant answer (every third with a
system message), `--words` scaling their length. Tokens per second count every token of the conversations.

Run:  .venv/bin/python benchmarks/bench_chat_source.py [--conversations 2000] [--words 1 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from vlens import LLM
from vlens.harvest.windows import token_documents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--words", type=int, nargs="+", default=[1, 4], help="documents repeated this many times")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from harvest_helpers import conversations, documents  # the tests' own conversations
    torch.set_num_threads(1)
    tok = LLM(dtype="float32", device="cpu").tokenizer
    for words in args.words:
        docs = [" ".join([d] * words) for d in documents(args.conversations, seed=1)]
        convs = conversations(docs)
        seconds, tokens = {}, {}
        for name, run in (
            ("HF", lambda: [tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in convs]),
            ("vlens", lambda: list(token_documents(convs, tok, len(tok)))),
            ("vlens roles", lambda: [d.tokens for d in token_documents(convs, tok, len(tok), ("assistant",))]),
        ):
            started = time.perf_counter()
            out = run()
            seconds[name], tokens[name] = time.perf_counter() - started, sum(map(len, out))
        assert len(set(tokens.values())) == 1, tokens  # the same tokens every way
        n = tokens["HF"]
        print(f"{len(convs)} conversations of {n / len(convs):.0f} tokens on average:")
        for name, s in seconds.items():
            print(f"  {name:<12} {s:6.2f} s  {n / s:>10,.0f} tokens/s  {seconds['HF'] / s:5.2f}x HF's speed")


if __name__ == "__main__":
    main()
