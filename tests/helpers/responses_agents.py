"""Agents for tests of /v1/responses (grpo/wings/agents/openai_responses.py): each plays a sample with the official
openai client's Responses API at the base URL it is given (its rollout's own)."""

from __future__ import annotations

import openai

# The key a harness sends for all its conversations (the run's, set by the test): the rollout's base URL attributes
# its calls to the sample; None: the sample's own key.
HARNESS_KEY: list[str] = []


async def three_turn_agent(row, base_url, api_key, model):
    """Three calls: the row's messages, a follow-up by ``previous_response_id``, another by the full ``input`` list
    (the earlier items handed back as the client gave them)."""
    key = HARNESS_KEY[0] if HARNESS_KEY else api_key
    async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0) as client:
        first = await client.responses.create(model=model, input=row["messages"], instructions="Be brief.",
                                              max_output_tokens=6, **row["sampling"])
        second = await client.responses.create(model=model, input="more", instructions="Be brief.",
                                               previous_response_id=first.id, max_output_tokens=6,
                                               **row["sampling"])
        history = [*row["messages"], *first.output, {"role": "user", "content": "more"}, *second.output,
                   {"role": "user", "content": "again"}]
        await client.responses.create(model=model, input=history, instructions="Be brief.", max_output_tokens=6,
                                      store=False, **row["sampling"])
    return 1.0
