"""A stand-in for NeMo-Gym's ``ng_run``, enough to run the example servers without installing Gym:

    python examples/gym/launch.py "+config_paths=[examples/gym/configs/calculator.yaml,env.yaml]"

It reads the config files (Gym's layout: ``{server name: {<kind>: {<type>: {entrypoint, ...}}}}``, plus top-level
keys such as ``policy_base_url``, ``head_server``, ``port_range_low/high``; ``${...}`` interpolations resolved by
OmegaConf as Gym does), gives every server a host and a free port of the port range, starts each one
(``python <entrypoint> --name NAME --config <the resolved global config, as JSON>``; an entrypoint is relative to its
config file) and serves Gym's head server (``GET /global_config_dict_yaml``: the global config as a YAML string in
JSON, which grpo-ds reads to find the agents) on ``head_server.port`` (11000 by default). SIGTERM / SIGINT stop the
servers; each server also dies with the launcher (the parent-death signal).

grpo-ds runs it as the launcher of ``configs/cpu_demo_gym.yaml`` (``env.nemo_gym.launcher``); the tests run it
the same way (a stand-in of Gym's launcher).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile

from omegaconf import OmegaConf

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # grpo-ds's checkout
from grpo.wings.gym.servers import free_port  # noqa: E402

KINDS = ("responses_api_agents", "resources_servers", "responses_api_models")


def config_paths(argv: list[str]) -> tuple[list[str], dict]:
    """``+config_paths=[a,b]`` and ``+key=value`` / ``++key=value`` overrides from the command line."""
    paths, overrides = [], {}
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key == "config_paths":
            paths = [p.strip() for p in value.strip("[]").split(",") if p.strip()]
        elif key:
            overrides[key] = OmegaConf.create({"v": value}).v if value else value
    return paths, overrides


def is_server(entry) -> bool:
    """``{<kind>: {<type>: {entrypoint, ...}}}``: a server to start. Without an entrypoint it only configures one that
    another file defines (NeMo-RL's recipes set ``policy_model`` and ``code_gen`` keys so), as Gym's
    ``is_almost_server`` decides."""
    return (OmegaConf.is_dict(entry) and len(entry) == 1 and next(iter(entry)) in KINDS
            and OmegaConf.is_dict(next(iter(entry.values())))
            and any(OmegaConf.is_dict(c) and "entrypoint" in c for c in next(iter(entry.values())).values()))


def die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


def main(argv: list[str]) -> None:
    paths, overrides = config_paths(argv)
    configs, where = [], {}
    for path in paths:
        loaded = OmegaConf.load(path)
        for name, entry in loaded.items():
            if is_server(entry):
                where[name] = os.path.dirname(os.path.abspath(path))
        configs.append(loaded)
    merged = OmegaConf.to_container(OmegaConf.merge(*configs, OmegaConf.create(overrides)), resolve=True)
    host = merged.setdefault("default_host", "127.0.0.1")
    head = merged.setdefault("head_server", {})
    head.setdefault("host", host)
    head.setdefault("port", 11000)
    low, high = int(merged.setdefault("port_range_low", 10001)), int(merged.setdefault("port_range_high", 20000))
    taken = {int(head["port"])}
    servers = []
    for name in where:
        entry = next(iter(next(iter(merged[name].values())).values()))
        entry.setdefault("host", host)
        entry["port"] = entry.get("port") or free_port(entry["host"], low, high, taken)
        taken.add(int(entry["port"]))
        servers.append((name, os.path.join(where[name], entry["entrypoint"])))
    fd, config_file = tempfile.mkstemp(prefix="gym_global_config_", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(merged, f)
    children = [subprocess.Popen([sys.executable, entrypoint, "--name", name, "--config", config_file],
                                 preexec_fn=die_with_parent) for name, entrypoint in servers]

    def stop(signum, frame):
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
        os.unlink(config_file)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    addresses = {}
    for name, _ in servers:
        entry = next(iter(next(iter(merged[name].values())).values()))
        addresses[name] = f"http://{entry['host']}:{entry['port']}"
    print(f"launch.py: head server http://{head['host']}:{head['port']}; servers {addresses}", flush=True)
    serve_head(merged, head["host"], int(head["port"]))


def serve_head(merged: dict, host: str, port: int) -> None:
    import uvicorn
    from fastapi import FastAPI

    app = FastAPI(title="head server")

    @app.get("/global_config_dict_yaml")
    async def global_config_dict_yaml() -> str:
        return OmegaConf.to_yaml(OmegaConf.create(merged))

    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main(sys.argv[1:])
