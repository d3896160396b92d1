"""Steering vectors on the server: loaded once at start from `--steering-vector NAME=PATH` and checked against the
model (a bad file stops the server, not a request), and what GET /v1/steering_vectors says of them."""

from __future__ import annotations

from typing import Any

from vlens.config import ModelConfig
from vlens.server.config import split_named_file
from vlens.steering import SteeringVector


def load_steering_vectors(
    specs: tuple[str, ...] | None, cfg: ModelConfig, shapes: dict[str, tuple]
) -> dict[str, SteeringVector]:  # fmt: skip
    """name -> SteeringVector for each `--steering-vector`; ValueError naming the one at fault."""
    vectors = {}
    for spec in specs or ():
        name, path = split_named_file(spec)
        vector = SteeringVector.load(path)
        vector.check(cfg, shapes, f"steering_vectors: {name}")
        vectors[name] = vector
    return vectors


def describe(vectors: dict[str, SteeringVector]) -> list[dict[str, Any]]:
    """The GET /v1/steering_vectors entries: each vector's hooks with their norms."""
    return [
        {"name": name, "hooks": {hook: round(float(v.float().norm()), 6) for hook, v in vector.vectors.items()}}
        for name, vector in vectors.items()
    ]
