"""A misbehaving Gym agent server for tests of the NeMo-Gym path (started by examples/gym/launch.py from
tests/helpers/gym/faults.yaml): ``POST /run`` answers by the row's ``fault``:

- ``noncontiguous``: a result whose second model call does not continue the first (NeMo-RL's assertion);
- ``bad_sum``: ``reward_components`` that do not sum to ``reward``;
- ``die``: the server process exits mid-request (a server killed mid-rollout);
- ``status_<n>``: answers HTTP n;
- ``slow_<s>``: a good result after s seconds.
"""

from __future__ import annotations

import asyncio
import os
import sys

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "gym"))
from serve import serve  # noqa: E402


def item(prompt, generated):
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}],
            "prompt_token_ids": prompt, "generation_token_ids": generated,
            "generation_log_probs": [-0.25] * len(generated)}


app = FastAPI()


@app.post("/run")
async def run(request: Request):
    row = await request.json()
    fault = row.get("fault", "")
    good = {**row, "response": {"output": [item([1, 5], [6, 2])]}, "reward": 1.0}
    if fault == "noncontiguous":
        return {**good, "response": {"output": [item([1, 5], [6, 2]), item([1, 7, 7, 7], [6, 2])]}}
    if fault == "bad_sum":
        return {**good, "reward_components": {"a": 0.25}}
    if fault == "die":
        os._exit(3)
    if fault.startswith("status_"):
        return JSONResponse({"error": fault}, status_code=int(fault.split("_")[1]))
    if fault.startswith("slow_"):
        await asyncio.sleep(float(fault.split("_")[1]))
    return good


if __name__ == "__main__":
    serve(app)
