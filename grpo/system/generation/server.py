"""The generation ranks' side of ``policy.generation.colocated.enabled=false``: `serve` is a generation rank's whole
run (`grpo.system.generation.remote` is the trainers' side; `grpo.system.bridge` the wire between them).

    trainer 0: hello -> [generate | load (bucket, broadcast, acknowledged)* end | reset_cache]* -> close

Each command gets one answer, ``("ok", result)`` or ``("error", message)``; a failing engine never leaves trainer 0
waiting (a weight load that fails still drains the broadcast).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from grpo.system.bridge import Bridge, BridgeError
from grpo.system.media import unpack_media

logger = logging.getLogger(__name__)

# Generation ranks wait this long for trainer 0's next command (a training step may take long); a dead trainer 0
# still ends the wait at once (connection closed).
SERVER_TIMEOUT_S = 7 * 24 * 3600.0


def serve(cfg, layout, device: torch.device) -> None:
    """A generation rank's life: join the bridge, build its engine on trainer 0's hello, then run commands until
    ``close``. Raises `BridgeError` when trainer 0 is gone.

    SIGTERM / SIGINT are ignored here: a launcher sends them to every rank, and the trainers' answer (finish the
    phase, save, exit 143 / 130) needs the generation ranks until trainer 0 closes the bridge; a generation rank
    ends with it (or when trainer 0's process is gone)."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    from grpo.system import dist as grpo_dist

    bridge = Bridge(layout.store, layout.bridge_rank, 1 + layout.num_generation, SERVER_TIMEOUT_S,
                    grpo_dist.comm_device())
    kind, hello = bridge.recv(0)
    if kind != "hello":
        raise BridgeError(f"expected trainer 0's hello, got {kind!r}")
    try:
        backend = build_server_backend(cfg, hello["model"], device)
    except Exception as err:  # noqa: BLE001 - said to trainer 0, which stops the run with it
        logger.exception("generation rank %d could not start its engine", layout.rank)
        bridge.send(("error", f"{type(err).__name__}: {err}"), 0)
        raise
    bridge.send(("ready", None), 0)
    try:
        while True:
            kind, arg = bridge.recv(0)
            if kind == "close":
                return
            if kind == "generate":
                bridge.send(_run_generate(backend, arg), 0)
            elif kind == "load":
                bridge.send(_run_load(backend, bridge, arg), 0)
            elif kind == "reset_cache":
                bridge.send(_run_reset(backend), 0)
            else:
                raise BridgeError(f"unknown command {kind!r} from trainer 0")
    finally:
        backend.close()


def build_server_backend(cfg, model_path: str, device: torch.device):
    """This generation rank's engine: vLLM (never sleeping) or a transformers copy; both receive their weights
    from trainer 0 before the first generation."""
    cfg.policy.model_name = model_path
    from grpo.system.chat import load_tokenizer

    tokenizer = load_tokenizer(cfg.policy)
    if cfg.policy.generation.backend == "vllm":
        from grpo.system.generation.vllm import VllmGeneration

        return VllmGeneration(cfg, tokenizer, None, device, colocated=False)
    from grpo.system.generation.hf import HFGeneration
    from grpo.system.model_config import load_model_config

    return HFGeneration(cfg.policy, tokenizer, load_model_config(cfg.policy, model_path), device)


def _run_generate(backend, arg: dict) -> tuple[str, object]:
    """One generate command: ``("ok", outputs)`` or ``("error", message)``. Validation's sampling comes with the
    command (``sampling``, a `grpo.config.Sampling`); image prompts' ``media`` too, packed
    (`grpo.system.generation.remote.generate_command`), given to the backend one dict per prompt."""
    try:
        media = unpack_media(arg.get("media"), len(arg["prompts"]))
        outputs = backend.generate(arg["prompts"], arg["seeds"], greedy=arg["greedy"], max_new_tokens=arg["caps"],
                                   stop_strings=arg["stops"], sampling=arg["sampling"],
                                   **({"media": media} if media is not None else {}))
        return "ok", outputs
    except Exception as err:  # noqa: BLE001 - the trainers stop the run with it
        logger.exception("generation failed")
        return "error", f"{type(err).__name__}: {err}"


def _received_buckets(bridge: Bridge, device: torch.device) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The buckets trainer 0 broadcasts, until its ``end``."""
    dtypes = {}
    while True:
        kind, specs = bridge.recv(0)
        if kind == "end":
            return
        bucket = []
        for name, shape, dtype in specs:
            dt = dtypes.setdefault(dtype, getattr(torch, dtype))
            bucket.append((name, bridge.broadcast(torch.empty(shape, dtype=dt, device=bridge.device))))
        bridge.acknowledge()
        yield [(n, t.to(device)) for n, t in bucket]


def _run_load(backend, bridge: Bridge, arg: dict) -> tuple[str, object]:
    """One weight load: ``("ok", None)`` or ``("error", message)``. A backend that fails mid-way still drains
    the broadcast (trainer 0 sends every bucket)."""
    buckets = _received_buckets(bridge, backend.device)
    try:
        backend.load_buckets(buckets, arg["expected"], reset_cache=arg.get("reset_cache", True))
        return "ok", None
    except BridgeError:
        raise
    except Exception as err:  # noqa: BLE001
        logger.exception("loading weights failed")
        for _ in buckets:
            pass
        return "error", f"{type(err).__name__}: {err}"


def _run_reset(backend) -> tuple[str, object]:
    """Drop the prefix cache (the backend's `reset_prefix_cache`: vLLM's, checked; an hf copy keeps no cache between
    calls)."""
    try:
        backend.reset_prefix_cache()
        return "ok", None
    except Exception as err:  # noqa: BLE001
        return "error", f"{type(err).__name__}: {err}"
