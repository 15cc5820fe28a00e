"""A stub OpenAI-compatible judge for tests, run as its own process on loopback:
``python -m tests.helpers.judge_server PORT``. Its answer to /v1/chat/completions depends on the prompt:

- contains ``GOOD`` -> "Score: 8"; ``BAD`` -> "Score: 2";
- ``MALFORMED`` -> an answer with no score;
- ``SLOW`` -> sleeps 5 s first (past the tests' timeout), then "Score: 5";
- ``ERR500`` -> HTTP 500; ``ERR404`` -> HTTP 404;
- ``FLAKY`` -> HTTP 503 the first time this prompt is seen, then "Score: 6";
- ``NAN`` -> "Score: nan"; ``HUGE`` -> a 300-digit score (finite in float64, inf in float32); ``INF`` -> a 400-digit
  one (inf in float64 too).

Every request is counted per prompt (GET /counts returns them).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

app = FastAPI()
counts: Counter = Counter()


def reply(content: str) -> dict:
    return {"id": "j", "object": "chat.completion", "created": int(time.time()), "model": "stub-judge",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


@app.post("/v1/chat/completions")
async def chat(request: Request):
    body = await request.json()
    prompt = body["messages"][-1]["content"]
    counts[prompt] += 1
    if "ERR500" in prompt:
        return JSONResponse({"error": {"message": "boom"}}, status_code=500)
    if "ERR404" in prompt:
        return JSONResponse({"error": {"message": "no such model"}}, status_code=404)
    if "FLAKY" in prompt and counts[prompt] == 1:
        return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
    if "SLOW" in prompt:
        await asyncio.sleep(5)
        return reply("Score: 5")
    if "MALFORMED" in prompt:
        return reply("I would rather not say.")
    if "FLAKY" in prompt:
        return reply("Score: 6")
    for word, score in (("NAN", "nan"), ("HUGE", "9" * 300), ("INF", "1" + "0" * 400)):
        if word in prompt:
            return reply(f"Score: {score}")
    return reply("Reasoning... Score: 8" if "GOOD" in prompt else "Score: 2")


@app.get("/counts")
async def get_counts():
    return dict(counts)


@app.get("/health")
async def health():
    return {"ok": True}


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
