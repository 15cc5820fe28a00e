"""Where the NeMo-Gym servers come from (``env.nemo_gym``). The ``nemo-gym`` package needs Python >= 3.13 and Ray,
so its servers never live in grpo-ds's environment; the run reaches them over HTTP, found one of two ways:

1. **Servers you started** (``ng_run`` / ``gym env start`` in Gym's own environment): ``agent_urls`` names each agent
   server's base URL, or ``head_server_url`` names Gym's head server, whose ``/global_config_dict_yaml`` lists every
   server's host and port (Gym's ``ServerClient`` reads it the same way). Your servers must call the run's endpoint:
   once it is up, the run writes its ``policy_base_url``, ``policy_api_key`` and ``policy_model_name`` (the keys
   NeMo-RL hands Gym) to ``<log_dir>/nemo_gym_env.yaml``, Gym's ``env.yaml`` format, and waits up to
   ``startup_timeout_s`` for the servers to answer.
2. **Servers grpo-ds starts**: ``config_paths`` and a ``launcher`` command (default ``ng_run
   +config_paths=[{config_paths}]``; e.g. ``uv run --python 3.13 ng_run ...`` or a path into Gym's venv). The run
   writes ``<log_dir>/nemo_gym/global_config.yaml`` (Gym's other keys of ``env.nemo_gym``, the policy keys, the
   head server on the first free port of ``port_range_low..high``, the port range) and appends it to the config
   paths (``{config_paths}``; ``{config_file}`` is that file alone; ``{python}`` is the trainer's Python), runs the
   launcher in ``launcher_cwd`` in a process group of its own (its output in ``<log_dir>/nemo_gym/launcher.log``),
   waits for the head server and every server it lists, and stops the group at the end of the run, on a crash, on a
   signal, and when the trainer dies (the parent-death signal). A launcher that exits or never answers stops the run with one ``error:`` line
   and the log's tail; a server that dies later costs the samples it held (`grpo.wings.gym.rollout`).

   The head server is trusted only when it is this launch's: the global config it answers must hold the secret
   ``grpo_ds_launch_key`` the run wrote into its file (Gym's head server answers the merged config, every key
   kept). The port was free when picked, but another process (another run's Gym, another user's, a decoy) may bind
   it before the launcher does; a head server without the key is never read further: the launcher is stopped and
   started again on another free port, up to `LAUNCH_ATTEMPTS` times, then the run stops with one line.

Either way the servers call the endpoint with a key of their own (`grpo.wings.gym.rollout.GymLedger`: only
results made of its generations are trained), their agents must include every ``agent_ref.name`` of the data
(checked at startup: one line naming the unknown agents, the known ones and the row), and a launch or head server
that lists no agent server at all (``config_paths`` naming files that are not Gym server configs) stops the run.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx
import yaml

from grpo.tasks.pool import set_parent_death_signal

SERVER_KINDS = ("responses_api_agents", "resources_servers", "responses_api_models")
AGENT_KIND = "responses_api_agents"
LAUNCH_KEY = "grpo_ds_launch_key"  # the secret of one launch, in the global config grpo-ds writes (module docstring)
LAUNCH_ATTEMPTS = 3  # launches tried, each on a new port, while another server answers on the head server's port


class GymServerError(RuntimeError):
    """The Gym servers could not be started or reached; the message says what to change."""


def server_kinds(global_config: dict) -> dict[str, tuple[str, str]]:
    """Server name -> ``(kind, base URL)`` from Gym's global config (Gym's ``get_first_server_config_dict``: a
    top-level entry ``{name: {<kind>: {<type>: {host, port, ...}}}}``).

        >>> server_kinds({"calc_agent": {"responses_api_agents": {"simple_agent": {"host": "127.0.0.1", "port": 5001}}},
        ...               "head_server": {"host": "127.0.0.1", "port": 5000}, "policy_model_name": "m"})
        {'calc_agent': ('responses_api_agents', 'http://127.0.0.1:5001')}
    """
    found = {}
    for name, entry in (global_config.items() if isinstance(global_config, dict) else ()):
        if not isinstance(entry, dict) or len(entry) != 1 or next(iter(entry)) not in SERVER_KINDS:
            continue
        inner = next(iter(entry.values()))
        server = next(iter(inner.values()), None) if isinstance(inner, dict) else None
        if isinstance(server, dict) and server.get("host") and server.get("port"):
            found[name] = (next(iter(entry)), f"http://{server['host']}:{server['port']}")
    return found


def server_urls(global_config: dict) -> dict[str, str]:
    """Server name -> base URL of every server of Gym's global config (`server_kinds`)."""
    return {name: url for name, (_, url) in server_kinds(global_config).items()}


def agent_names(global_config: dict) -> list[str]:
    """The agent servers (kind ``responses_api_agents``: those a row's ``agent_ref.name`` can name) of a global
    config."""
    return sorted(name for name, (kind, _) in server_kinds(global_config).items() if kind == AGENT_KIND)


def launched_by(global_config, key: str) -> bool:
    """Whether a head server's global config is the one of the launch whose secret is ``key`` (`LAUNCH_KEY`).

        >>> launched_by({"grpo_ds_launch_key": "s3cret", "head_server": {}}, "s3cret"), launched_by({}, "s3cret")
        (True, False)
    """
    return isinstance(global_config, dict) and global_config.get(LAUNCH_KEY) == key


def read_global_config(head_url: str, timeout_s: float = 5.0) -> dict:
    """Gym's head server's global config (``GET /global_config_dict_yaml``: a JSON string holding YAML)."""
    response = httpx.get(head_url.rstrip("/") + "/global_config_dict_yaml", timeout=timeout_s)
    response.raise_for_status()
    body = response.json()
    return yaml.safe_load(body) if isinstance(body, str) else body


def answers(url: str, timeout_s: float = 2.0) -> bool:
    """Whether a server answers HTTP at ``url`` (any status: Gym's ``poll_for_status`` does not check it)."""
    try:
        httpx.get(url, timeout=timeout_s)
        return True
    except httpx.HTTPError:
        return False


def free_port(host: str, low: int, high: int, taken: frozenset[int] | set[int] = frozenset()) -> int:
    """The first port of ``low..high`` free on ``host`` and not in ``taken`` (NeMo-RL's ``_get_free_port_local``)."""
    for port in range(low, high + 1):
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise GymServerError(f"no free port in env.nemo_gym.port_range_low..high = {low}..{high} on {host}")


def policy_keys(base_url: str, api_key: str, model: str) -> dict:
    """What NeMo-RL hands Gym about the policy (``policy_base_url`` a list: one URL per data-parallel server)."""
    return {"policy_base_url": [base_url], "policy_api_key": api_key, "policy_model_name": model}


class GymServers:
    """The Gym servers of ``cfg`` (`grpo.config.NemoGymConfig`) for a run logging to ``log_dir``."""

    def __init__(self, cfg, log_dir: str):
        self.cfg, self.log_dir = cfg, log_dir
        self.proc: subprocess.Popen | None = None
        self.head_url: str | None = None
        self.agents: list[str] = []  # the agent servers' names (what a row's agent_ref.name may be)
        self.foreign_ports: list[int] = []  # head server ports where a server not launched by this run answered
        self.log_path = os.path.join(log_dir, "nemo_gym", "launcher.log")

    def start(self, base_url: str, api_key: str, model: str) -> dict[str, str]:
        """Find (or launch) the servers; returns server name -> base URL (``agents``: the agent servers among them).
        Raises `GymServerError`."""
        policy = policy_keys(base_url, api_key, model)
        if self.cfg.config_paths:
            urls = self._launch(policy)
            where = f"the servers launched from env.nemo_gym.config_paths={list(self.cfg.config_paths)}"
        else:
            os.makedirs(self.log_dir, exist_ok=True)
            path = os.path.join(self.log_dir, "nemo_gym_env.yaml")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                yaml.safe_dump(policy, f)
            urls = self._wait_for_started(path, api_key)
            where = f"the head server env.nemo_gym.head_server_url={self.head_url}"
        if not self.agents:
            self.close()
            raise GymServerError(f"{where} include no agent server (no entry of kind {AGENT_KIND}; servers: "
                                 f"{sorted(urls)}): give Gym's server configs (e.g. resources_servers/<name>/configs/"
                                 "<name>.yaml, which pair a resources server with its agent), not other files")
        return urls

    # ---------------------------------------------------------------- servers you started
    def _wait_for_started(self, env_yaml: str, api_key: str) -> dict[str, str]:
        """The servers of ``head_server_url`` (once its global config carries no other ``policy_api_key`` than
        ``api_key``: servers started for an earlier run are waited on until restarted) or ``agent_urls``, up."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        if self.cfg.head_server_url:
            self.head_url = self.cfg.head_server_url.rstrip("/")
            while True:
                try:
                    config = read_global_config(self.head_url)
                    if isinstance(config, dict) and config.get("policy_api_key", api_key) != api_key:
                        raise ValueError("its servers call the policy with another policy_api_key than this run's")
                    urls, self.agents = server_urls(config), agent_names(config)
                    break
                except (httpx.HTTPError, ValueError, yaml.YAMLError) as err:
                    if time.monotonic() > deadline:
                        raise GymServerError(
                            f"env.nemo_gym.head_server_url={self.head_url}: no Gym head server of this run answered "
                            f"within env.nemo_gym.startup_timeout_s={self.cfg.startup_timeout_s} "
                            f"({type(err).__name__}: {err}); start the servers with the run's endpoint and key from "
                            f"{env_yaml}") from None
                    time.sleep(1.0)
        else:
            urls = dict(self.cfg.agent_urls)
            self.agents = sorted(urls)
        self._wait_until_up(urls, deadline, f"start them with the run's endpoint from {env_yaml}")
        return urls

    def _wait_until_up(self, urls: dict[str, str], deadline: float, hint: str) -> None:
        waiting = dict(urls)
        while waiting:
            waiting = {n: u for n, u in waiting.items() if not answers(u)}
            if not waiting:
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise GymServerError(f"the NeMo-Gym launcher exited with status {self.proc.returncode} before its "
                                     f"servers {sorted(waiting)} answered; {self._log_tail()}")
            if time.monotonic() > deadline:
                raise GymServerError(f"the NeMo-Gym servers {waiting} did not answer within "
                                     f"env.nemo_gym.startup_timeout_s={self.cfg.startup_timeout_s}; {hint}")
            time.sleep(0.5)

    # ---------------------------------------------------------------- servers grpo-ds starts
    def _launch(self, policy: dict) -> dict[str, str]:
        cfg = self.cfg
        exe = cfg.launcher[0].replace("{python}", sys.executable)
        if shutil.which(exe, path=os.environ.get("PATH")) is None and not os.path.isfile(exe):
            raise GymServerError(
                f"env.nemo_gym.launcher={cfg.launcher}: {exe!r} is not a program on PATH. The nemo-gym package needs "
                "Python >= 3.13 and Ray, so it lives in an environment of its own: set env.nemo_gym.launcher to its "
                "command (e.g. [uv, run, --python, '3.13', ng_run, '+config_paths=[{config_paths}]'] run in Gym's "
                "checkout, env.nemo_gym.launcher_cwd) or start the servers yourself and give "
                "env.nemo_gym.head_server_url or agent_urls")
        host = "127.0.0.1"
        deadline = time.monotonic() + cfg.startup_timeout_s
        for _ in range(LAUNCH_ATTEMPTS):
            port = free_port(host, cfg.port_range_low, cfg.port_range_high, taken=set(self.foreign_ports))
            config = self._launch_on(policy, host, port, deadline)
            if config is not None:
                urls, self.agents = server_urls(config), agent_names(config)
                try:
                    self._wait_until_up(urls, deadline, self._log_tail())
                except GymServerError:
                    self.close()
                    raise
                return urls
            self.foreign_ports.append(port)
        raise GymServerError(
            f"env.nemo_gym: on each of the ports {self.foreign_ports} picked for the NeMo-Gym head server, a server "
            f"this run did not launch answered first (its global config lacks this launch's {LAUNCH_KEY}): another "
            "run's or another user's Gym, or something else, took the port; give this run a port range of its own "
            f"(env.nemo_gym.port_range_low..high = {cfg.port_range_low}..{cfg.port_range_high})")

    def _launch_on(self, policy: dict, host: str, port: int, deadline: float) -> dict | None:
        """Start the launcher with its head server on ``port``; returns the global config its head server answers,
        or None (the launcher stopped) when a server this launch did not start answers there (`launched_by`)."""
        cfg = self.cfg
        key = secrets.token_hex(16)
        gym_config = {**cfg.gym_keys(), **policy, "head_server": {"host": host, "port": port},
                      "port_range_low": cfg.port_range_low, "port_range_high": cfg.port_range_high, LAUNCH_KEY: key}
        directory = os.path.join(self.log_dir, "nemo_gym")
        os.makedirs(directory, exist_ok=True)
        config_file = os.path.abspath(os.path.join(directory, "global_config.yaml"))
        fd = os.open(config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the endpoint's key
        with os.fdopen(fd, "w") as f:
            yaml.safe_dump(gym_config, f)
        paths = ",".join([*cfg.config_paths, config_file])
        argv = [a.replace("{config_paths}", paths).replace("{config_file}", config_file)
                .replace("{python}", sys.executable) for a in cfg.launcher]
        parent = os.getpid()
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(argv, cwd=cfg.launcher_cwd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=lambda: set_parent_death_signal(signal.SIGTERM, parent))
        except OSError as err:
            raise GymServerError(f"env.nemo_gym.launcher={argv}: cannot start it ({err})") from None
        finally:
            log.close()
        self.head_url = f"http://{host}:{port}"
        while True:
            try:
                config = read_global_config(self.head_url)
            except httpx.TransportError:  # nothing answers yet (refused, reset, timed out)
                config = None
            except (httpx.HTTPError, ValueError, yaml.YAMLError):
                config = {}  # something answered, not a Gym head server: not this launch's either
            if config is not None:
                if launched_by(config, key):
                    return config
                self.close()
                return None
            if self.proc.poll() is not None:
                raise GymServerError(f"the NeMo-Gym launcher {argv} exited with status {self.proc.returncode} "
                                     f"before its head server answered; {self._log_tail()}")
            if time.monotonic() > deadline:
                self.close()
                raise GymServerError(f"the NeMo-Gym head server {self.head_url} did not answer within "
                                     f"env.nemo_gym.startup_timeout_s={cfg.startup_timeout_s}; {self._log_tail()}")
            time.sleep(0.5)

    def _log_tail(self, chars: int = 1500) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - chars))
                tail = f.read().decode(errors="replace").strip()
        except OSError:
            return f"no launcher log at {self.log_path}"
        return f"the launcher's log ({self.log_path}) ends: {json.dumps(tail)}"

    def alive(self) -> bool:
        """Whether the launcher still runs (True for servers you started: the run cannot know)."""
        return self.proc is None or self.proc.poll() is None

    def close(self) -> None:
        """Stop the launcher's process group (SIGTERM, then SIGKILL after 10 s); nothing for servers you started."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # the group's stragglers (a server that outlived the launcher)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_gym_servers(cfg, envs_list, endpoint, log_dir: str, closables: list, logger) -> None:
    """The run's side: when an environment of ``envs_list`` is NeMo-Gym's, find or launch its servers
    (`GymServers`) with ``endpoint``'s URL and model and a key of their own (`GymLedger`), check that they serve
    every agent the data names (`grpo.tasks.nemo_gym.check_data_agents` over the rows of ``cfg.data``), give the
    environment their URLs and ledger, and close them with the run (``closables``). Raises `GymServerError`."""
    from grpo.system.data import load_rows
    from grpo.wings.gym.rollout import GymLedger
    from grpo.tasks.nemo_gym import NemoGymEnvironment, check_data_agents, data_agents

    gyms = [env for envs in envs_list for env in getattr(envs, "envs", {}).values()
            if isinstance(env, NemoGymEnvironment)]
    if not gyms:
        return
    servers = GymServers(cfg.env.nemo_gym, log_dir)
    closables.insert(0, servers)  # closed first: no agent calls a closed endpoint
    ledger = GymLedger.of(endpoint, cfg.grpo.seed)
    urls = servers.start(endpoint.base_url, ledger.key, endpoint.model_name)
    rows = [row for split in ("train", "val") for row in load_rows(cfg.data, split, seed=cfg.grpo.seed)]
    problem = check_data_agents(data_agents(rows), servers.agents)
    if problem is not None:
        servers.close()
        raise GymServerError(problem)
    responses_dir = os.path.join(log_dir, "nemo_gym_responses")
    for env in gyms:
        env.agent_urls.update(urls)
        env.responses_dir, env.ledger = responses_dir, ledger
    how = f"launched ({servers.log_path})" if servers.proc is not None else "started by you"
    for port in servers.foreign_ports:
        logger.write(f"nemo_gym: a server this run did not launch answered on the head server's port {port} "
                     "(another Gym took it first): not used, launched again on another port")
    logger.write(f"nemo_gym: servers {how}: {urls}")
