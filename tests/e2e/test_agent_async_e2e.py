

@pytest.mark.slow
def test_an_async_agent_run_on_a_generation_rank_with_in_flight_updates(tmp_path):
    """One trainer and one hf generation rank (colocated.enabled=false): the endpoint serves the generation rank's
    backend, which the thread also loads new weights into between rounds of unfinished requests (in-flight
    updates): an answer is labelled with the version its batch started with, the oldest."""
    from tests.e2e.test_noncolocated_e2e import torchrun

    torchrun("train_async_grpo.py", CONFIG, tmp_path, *SMALL, *ASYNC, "grpo.max_num_steps=3",
             "grpo.async_grpo.in_flight_weight_updates=true", timeout=1200)
    rows = train_rows(tmp_path)
    assert sorted(rows) == [1, 2, 3]
    for r in rows.values():
        assert r["train/env/agent/failed_samples"] == 0 and r["train/env/agent/noncontiguous_samples"] == 0
        assert r["async/trajectory_age_max"] <= 1 and r["async/evicted_groups"] == 0
        if r["async/trajectory_age_max"] == 0:
            assert abs(r["train/token_mult_prob_error"] - 1.0) < 1e-3, r["step"]
