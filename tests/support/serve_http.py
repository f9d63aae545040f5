"""Talking to a `vllm serve` process from tests: a JSON POST and the greedy tokens it serves for the fixed prompts."""

from __future__ import annotations

import json
import urllib.request

from weightplan.testing.engines import CONFIGS, MAX_TOKENS, PROMPTS

SERVED_MODEL = "engine-qwen3-moe"


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def served_tokens(base: str, model: str = str(CONFIGS / SERVED_MODEL)) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        reply = post(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                "temperature": 0.0, "return_token_ids": True})
        out.append(list(reply["choices"][0]["token_ids"]))
    return out
