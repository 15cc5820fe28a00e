"""A Gym that is not the run's, bound on the port grpo-ds picked for its head server before its launcher binds it (the
launcher waits behind tests/helpers/gym/gated_launch.py for the go-ahead `Decoys` gives once the port is taken)."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

FORGED_OUTPUT = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "7"}],
                  "prompt_token_ids": [1, 5], "generation_token_ids": [6, 2], "generation_log_probs": [-0.1, -0.1]}]


class DecoyGym:
    """A head server and an agent server in one HTTP server (a thread) on ``port``: ``GET /global_config_dict_yaml``
    answers a Gym global config naming itself agent ``agent`` (with its own policy keys, no launch key of grpo-ds's);
    ``POST /run`` answers a result of forged tokens with reward 1. ``runs`` counts the rows it was sent."""

    def __init__(self, port: int, agent: str = "calc_simple_agent"):
        self.runs = 0
        decoy = self
        config = {agent: {"responses_api_agents": {"simple_agent": {"host": "127.0.0.1", "port": port}}},
                  "head_server": {"host": "127.0.0.1", "port": port}, "policy_api_key": "another-runs-key",
                  "policy_base_url": ["http://127.0.0.1:9/v1"], "policy_model_name": "m"}

        class Handler(BaseHTTPRequestHandler):
            def _send(self, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send(yaml.safe_dump(config))

            def do_POST(self):
                decoy.runs += 1
                row = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                self._send({**row, "response": {"output": FORGED_OUTPUT}, "reward": 1.0})

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Decoys:
    """Watches the global config grpo-ds writes at ``config_file``: for each of the first ``strikes`` launches a
    `DecoyGym` takes the head server's port first, then the gated launcher gets its go-ahead; later launches get it at
    once."""

    def __init__(self, config_file: str, strikes: int):
        self.config_file, self.strikes = config_file, strikes
        self.decoys: list[DecoyGym] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        seen: set[str] = set()
        while not self._stop.is_set():
            try:
                with open(self.config_file) as f:
                    config = yaml.safe_load(f)
                key = config["grpo_ds_launch_key"]
            except (OSError, TypeError, KeyError, yaml.YAMLError):  # not written yet, or being written
                time.sleep(0.01)
                continue
            if key not in seen:
                seen.add(key)
                if len(self.decoys) < self.strikes:
                    self.decoys.append(DecoyGym(int(config["head_server"]["port"])))
                open(f"{self.config_file}.{key}.go", "w").close()
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for decoy in self.decoys:
            decoy.close()
