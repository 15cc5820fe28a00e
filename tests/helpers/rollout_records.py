"""A valid rollout dump record (grpo.system.dumps schema) for the dump and inspect tests."""


def make_record(step=3, split="train", reward=1.0, group_id=0, **over) -> dict:
    rec = {
        "step": step, "split": split, "task_name": "arithmetic", "group_id": group_id, "prompt_index": 7,
        "messages": [
            {"role": "user", "content": "7+5=", "trained": False, "flags": [], "num_tokens": 4},
            {"role": "assistant", "content": "12", "trained": True, "flags": [], "num_tokens": 3},
        ],
        "question": "7+5=", "answer": "12", "reward": reward, "reward_components": {"correct": reward},
        "advantage": None if split == "val" else 0.5, "masked": False, "mask_reason": None,
        "finish_reason": "stop", "truncated": False, "turns": 1, "response_length": 3, "logprob_error": 1.0,
        "error": None, "failure_kind": None, "error_detail": None, "retries": 0,
    }
    rec.update(over)
    return rec
