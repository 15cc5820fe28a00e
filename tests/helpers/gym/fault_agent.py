"""A misbehaving Gym agent server for tests of the NeMo-Gym path (started by examples/gym/launch.py from
tests/helpers/gym/faults.yaml). ``POST /run`` calls the policy once, as a Gym agent does (the run's endpoint, with the
policy keys of the global config), and answers a result built from that call, spoilt by the row's ``fault``:

- ``noncontiguous``: a second model call on a prompt that does not continue the first (NeMo-RL's assertion);
- ``bad_sum``: ``reward_components`` that do not sum to ``reward``;
- ``die``: the server process exits mid-request (a server killed mid-rollout);
- ``status_<n>``: answers HTTP n;
- ``slow_<s>``: the result after s seconds;
- ``forged``: tokens the policy never generated (what a decoy or another run's server answers);
- ``token_<field>_<id>``: the call's ``prompt`` or ``generation`` token ids with their first one replaced by ``<id>``;
- ``logprob_<x>``: the first generation logprob replaced by ``float(x)`` (``inf``, ``nan``, ``0.5``: JSON's
  ``Infinity`` / ``NaN`` as Python writes them);
- ``replay``: the result this server answered for an earlier row with the same ``tag`` (waits for it): a result that
  another sample already claimed.

A row with a ``tag`` and no fault keeps its result for a later ``replay``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import openai
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "examples", "gym"))
from agent_server import chat_messages, output_items  # noqa: E402
from serve import args, serve  # noqa: E402

FORGED = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}],
          "prompt_token_ids": [1, 5], "generation_token_ids": [6, 2], "generation_log_probs": [-0.25, -0.25]}


def build(config: dict) -> FastAPI:
    base = config["policy_base_url"]
    policy = openai.AsyncOpenAI(base_url=base[0] if isinstance(base, list) else base, api_key=config["policy_api_key"],
                                max_retries=0, timeout=120)
    kept: dict[str, dict] = {}  # tag -> result

    async def call(params: dict, messages: list[dict]) -> list[dict]:
        answer = await policy.chat.completions.create(
            model=config["policy_model_name"], messages=messages, temperature=params["temperature"],
            top_p=params["top_p"], max_tokens=params.get("max_output_tokens"), logprobs=True)
        return output_items(answer.choices[0].message.model_dump(exclude_none=True))

    app = FastAPI()

    @app.post("/run")
    async def run(request: Request):
        row = await request.json()
        fault, params = row.get("fault", ""), row["responses_create_params"]
        if fault == "die":
            os._exit(3)
        if fault.startswith("status_"):
            return JSONResponse({"error": fault}, status_code=int(fault.split("_")[1]))
        if fault == "forged":
            return {**row, "response": {"output": [dict(FORGED)]}, "reward": 1.0}
        if fault == "replay":
            for _ in range(600):
                if row["tag"] in kept:
                    return kept[row["tag"]]
                await asyncio.sleep(0.05)
            return JSONResponse({"error": f"nothing kept for tag {row['tag']}"}, status_code=500)
        output = await call(params, chat_messages(params))
        if fault == "noncontiguous":
            output += await call(params, [{"role": "user", "content": "2+2="}])
        result = {**row, "response": {"output": output}, "reward": 1.0}
        last = output[-1]
        if fault == "bad_sum":
            result["reward_components"] = {"a": 0.25}
        elif fault.startswith("slow_"):
            await asyncio.sleep(float(fault.split("_")[1]))
        elif fault.startswith("token_"):
            _, field, token = fault.split("_", 2)
            last[f"{field}_token_ids"][0] = int(token)
        elif fault.startswith("logprob_"):
            last["generation_log_probs"][0] = float(fault.split("_", 1)[1])
        if row.get("tag") and not fault:
            kept[row["tag"]] = result
        return Response(json.dumps(result), media_type="application/json")  # Infinity / NaN written as Python does

    return app


if __name__ == "__main__":
    name, global_config = args()
    serve(build(global_config), name, global_config)
