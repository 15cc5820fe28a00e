"""What the example Gym servers share: ``--name NAME --config FILE`` (the global config the stand-in launcher wrote,
examples/gym/launch.py) -> this server's entry, the policy keys, the other servers' URLs; `serve` runs an app on the
server's host and port."""

from __future__ import annotations

import argparse
import json

KINDS = ("responses_api_agents", "resources_servers", "responses_api_models")


def server_entry(global_config: dict, name: str) -> dict:
    """A server's own config: ``global_config[name][<kind>][<type>]`` (Gym's get_first_server_config_dict)."""
    return next(iter(next(iter(global_config[name].values())).values()))


def url_of(global_config: dict, name: str) -> str:
    entry = server_entry(global_config, name)
    return f"http://{entry['host']}:{entry['port']}"


def args() -> tuple[str, dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--config", required=True)
    a = parser.parse_args()
    with open(a.config) as f:
        return a.name, json.load(f)


def serve(app, name: str | None = None, global_config: dict | None = None) -> None:
    import uvicorn

    if name is None:
        name, global_config = args()
    entry = server_entry(global_config, name)
    uvicorn.run(app, host=entry["host"], port=int(entry["port"]), log_level="warning", access_log=False)
