"""The run's OpenAI-compatible endpoint over the policy being trained (NeMo-RL's ``expose_http_server``).

Routes: ``POST /v1/chat/completions``, ``POST /v1/responses`` (OpenAI's Responses API, answered through chat:
`grpo.wings.agents.openai_responses`), ``POST /v1/messages`` (Anthropic's Messages API as a dialect of chat:
`grpo.wings.agents.anthropic_messages`), ``POST /tokenize`` (the same rendering and splice as chat), ``GET
/v1/models``, ``GET /health``; all but ``/health`` again under each sample's own base URL, ``/rollout/<id>/v1/...``
(`Endpoint.rollout_url`). Requests and answers and the prefix splice are `grpo.wings.agents.openai_chat`'s,
the checks `grpo.wings.agents.openai_checks`'; this module serves them and feeds the generation backend.

- **Server**: FastAPI on uvicorn, in a thread of the trainer process (NeMo-RL serves vLLM's FastAPI app the same
  way; FastAPI gives pydantic request models and OpenAI's JSON for free, and uvicorn runs on a socket we bind in
  ``policy.generation.port_range_low..high``). Binds ``policy.generation.http_server.host`` (loopback).
- **Keys**: every route but ``/health`` needs ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``):
  the run's key (`Endpoint.api_key`, random per run) or a sample's own key (`Endpoint.open_session`), under which
  every call is recorded (`CallRecord`) for the agent environment to build that sample's trajectory from. A call to
  a sample's base URL (`Endpoint.rollout_url`) is that sample's with either key (a harness that sends one key for
  all its conversations); a rollout that is unknown or finished answers 404, another sample's key 403.
- **Batching** (`grpo.wings.agents.endpoint_batching`): handlers put their prompts on a queue; one batcher thread
  takes them while they keep coming (until none has come for ``http_server.batch_window_s`` while the server reads or
  answers no other, or a full ``policy.generation_batch_size``) and generates them in one `GenerationBackend.generate` call, so concurrent
  agents generate together. It generates only while the endpoint is open (`Endpoint.serving`: the
  rollout opens it; weights change while it is closed, and requests wait); every answer carries the weight
  version that produced it (``weight_version``). A request that finds no window within ``http_server.max_wait_s``
  (the run is training or checkpointing) is answered 503 with ``Retry-After`` (the last pause's length), never left
  hanging. While the rollout's own samples generate, `Endpoint.shared` makes them and the batches take turns.
- **Limits**: ``http_server.max_concurrent_requests`` in flight once their bodies are read (429 beyond),
  ``max_body_bytes`` (413, read no further), ``read_timeout_s`` for the body (408), wrong key (401), unknown model
  (404), anything malformed, a token id that is not the model's, a prompt with no room left (400), all decided before
  the request joins a batch; parsing and rendering run off the event loop, rendering within ``render_timeout_s``
  (`grpo.wings.agents.endpoint_limits`). A failure of the backend answers 500 to the requests of that batch and
  the server goes on; a client gone mid-request is one line of log. Errors use OpenAI's body (Anthropic's on
  ``/v1/messages``).
- **Images** (a vision-language policy's): ``image_url`` parts, read and bounded by
  `grpo.wings.agents.openai_images`, rendered with the chat template and tokenised by the policy's processor as the
  data path renders a row (`prompt_and_media`); the prompt's media go to the backend with its tokens and into the
  call's record, so the trajectory carries them. A text-only policy answers an image part 400.
- **Chat templates**: the run's (a request's own ``chat_template`` only with ``http_server.trust_request_chat_template``,
  vLLM's rule); ``tools`` / ``tool_choice`` as vLLM validates them, "required" and named functions refused
  (`openai_checks.check_tools` says why).

Seeds: a sample's call k, choice i is seeded by hash(session seed key, k, i), so an agent that makes the same calls
gets the same tokens; requests under the run's key use their ``seed`` (or a random one). A session shared by many
samples whose calls arrive in no fixed order (NeMo-Gym's model server sends one key for all: ``seed_by_prompt``)
seeds the j-th call with a given prompt at a weight version by hash(seed key, sampling profile, version, prompt, j,
i): which call gets which seed depends on arrival order, but the set of generations of a play does not, since the
calls with the same prompt are interchangeable.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import hashlib
import logging
import os
import queue
import secrets
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request  # module level: FastAPI reads the handlers' annotations from these globals
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from grpo.wings.agents import anthropic_messages
from grpo.wings.agents.anthropic_messages import MessagesRequest
from grpo.wings.agents.endpoint_batching import Batching, _Pending, shutting_down
from grpo.wings.agents.endpoint_limits import TemplateTimeout, read_body, template_deadline
from grpo.wings.agents.openai_chat import (LOGPROB_FLOOR, ChatMessage, ChatRequest, RequestError,
                                                TokenizeRequest, cut_at_stop, extract_tool_calls,
                                                first_stop, image_urls, parse_message, replace_prefix_tokens,
                                                required_prefix, template_messages)
from grpo.wings.agents.openai_images import check_placeholders, request_images
from grpo.wings.agents.openai_responses import ResponsesRequest, ResponseStore, create_response
from grpo.wings.agents.openai_checks import (check_sampling, check_token_ids, check_tools, parse_request,
                                                  request_template)

logger = logging.getLogger(__name__)

# A sample's own base URL (`Endpoint.rollout_url`): the routes again under this prefix.
ROLLOUT_PREFIX = "/rollout/{rollout_id}"
# Threads that parse and render requests (`Endpoint._off_loop`), so the event loop only moves bytes; each rendering
# is bounded in time.
WORK_THREADS = 4
# /v1/messages: the answers a session keeps the tokens of, to splice a history onto (`Endpoint.messages`); an agent
# continues its latest answers, and more would hold a long-lived key's every turn.
MAX_ANSWERS = 64


@dataclass
class CallRecord:
    """One choice of one call, as generated: what a trajectory is built from."""

    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    finish_reason: str
    weight_version: int
    media: dict | None = None  # the prompt's images as the model's tensors (grpo.system.vision), None without any


@dataclass
class _Session:
    seed_key: str
    calls: int = 0
    seed_by_prompt: bool = False  # seeds by (weight version, prompt, its count), not by call order (`Endpoint.chat`)
    prompt_calls: dict[int, dict[tuple[str, str], int]] = field(default_factory=dict)  # version -> (profile, prompt) -> calls
    records: list[CallRecord] = field(default_factory=list)
    rollout_id: str = ""  # its base URL's: ``/rollout/<rollout_id>/v1`` (`Endpoint.rollout_url`)
    responses: ResponseStore = field(default_factory=ResponseStore)  # its /v1/responses (previous_response_id)
    answers: dict[str, list[int]] = field(default_factory=dict)  # /v1/messages: conversation -> its tokens



# Weight versions whose per-prompt call counts a ``seed_by_prompt`` session keeps (`Endpoint.call_seeds`): more than any
# trajectory age a run allows, so no version in play has its count restarted (which would repeat its seeds).
KEEP_VERSIONS = 64


def seed_of(*parts) -> int:
    """A 63-bit seed from its parts (sha256), as `grpo.system.rollout.sample_seed` keys its own."""
    key = ":".join(str(p) for p in parts)
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def find_port(host: str, low: int, high: int) -> socket.socket:
    """A listening socket on the first free port of ``low..high`` (NeMo-RL's port_range_low/high)."""
    for port in range(low, high + 1):
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
        except OSError:
            sock.close()
            continue
        sock.listen(2048)
        return sock
    raise RuntimeError(f"no free port in policy.generation.port_range_low..high = {low}..{high} on {host}")


def load_template(spec: str | None) -> str | None:
    """A chat template given as Jinja text or as a file path (NeMo-RL loads paths: vLLM's load_chat_template)."""
    if spec is not None and "{" not in spec and os.path.isfile(spec):
        with open(spec) as f:
            return f.read()
    return spec


class Endpoint(Batching):
    """The endpoint over ``backend`` (a `grpo.system.generation.base.GenerationBackend`).

    ``cfg``: the run's `grpo.config.MasterConfig` (policy.generation, policy.tokenizer, max_total_sequence_length).
    `start` serves it; `serving` opens it for generation; `close` stops it.
    """

    def __init__(self, cfg, backend, tokenizer, vocab_size: int = 0, processor=None):
        p, g = cfg.policy, cfg.policy.generation
        self.cfg, self.backend, self.tokenizer = cfg, backend, tokenizer
        self.processor = processor  # a vision-language policy's (grpo.system.vision.load_processor): images render
        self.image_token = getattr(processor, "image_token", None)  # the text an image part renders as (<image>)
        self.settings = g.http_server
        serving = g.vllm_cfg.http_server_serving_chat_kwargs
        self.tool_parser = serving.tool_parser if serving else None
        self.reasoning_parser = serving.reasoning_parser if serving else None
        own = p.tokenizer.chat_template if p.tokenizer.chat_template not in (None, "default") else None
        self.chat_template = load_template(serving.chat_template if serving and serving.chat_template else own)
        if self.chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise RuntimeError("the endpoint needs a chat template: the tokenizer has none; set "
                               "policy.generation.vllm_cfg.http_server_serving_chat_kwargs.chat_template")
        self.template_kwargs = {**(p.tokenizer.chat_template_kwargs or {}),
                                **(serving.template_kwargs() if serving else {})}
        self.vllm_parser = None  # vLLM's parsers of the names it registers, on the vLLM backend
        if g.backend == "vllm" and (self.tool_parser or self.reasoning_parser):
            from grpo.wings.agents.vllm_chat_parsers import vllm_chat_parser

            self.vllm_parser = vllm_chat_parser(tokenizer, self.tool_parser, self.reasoning_parser)
        self.model_name = self.settings.model_name or p.model_name
        self.max_len = p.max_total_sequence_length
        # The ids a request may carry: the tokenizer's and a padded embedding's extra rows (Qwen2.5: 151,936 rows for
        # 151,665 tokens; the policy can sample those, and vLLM takes them too). A rendering over max_render_chars
        # could not fit the context twice over.
        self.vocab_size = max(len(tokenizer), vocab_size)  # vocab_size: the policy's embedding rows
        self.max_render_chars = 2 * self.max_len * max(map(len, tokenizer.get_vocab()))
        self._work_pool = concurrent.futures.ThreadPoolExecutor(WORK_THREADS, thread_name_prefix="grpo-endpoint-work")
        self.profiles = g.profiles()  # a batch samples with its own
        self.train_pair, self.val_pair = ((s.temperature, s.top_p) for s in self.profiles.values())
        self.gen_cfg = g
        self.api_key = "sk-grpo-" + secrets.token_hex(16)
        self.weight_version = 0
        self._sessions: dict[str, _Session] = {}
        self._rollouts: dict[str, str] = {}  # a session's rollout id -> its key
        self._responses = ResponseStore()  # the /v1/responses made under the run's key
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Pending] = queue.Queue()
        self._open = threading.Event()
        self._windows, self._window_lock = 0, threading.Lock()  # open generation windows (`serving`)
        self._generating = threading.Lock()
        self._inflight = 0  # requests the server handles, from their headers on (the batcher's `_busy`)
        self._admitted = 0  # of them, those whose body is read: what max_concurrent_requests bounds
        self._closed_at: float | None = None  # when the last window closed
        self._last_pause_s: float | None = None  # how long the last pause between two windows lasted
        self._stop = threading.Event()
        self._server = self._thread = self._batcher = None
        self.base_url: str | None = None

    # ---------------------------------------------------------------- life cycle
    def start(self) -> str:
        """Serve on the first free port of the range; returns the base URL (``http://host:port/v1``)."""
        import uvicorn

        g = self.cfg.policy.generation
        sock = find_port(self.settings.host, g.port_range_low, g.port_range_high)
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="grpo-endpoint")
        self._thread.start()
        self._batcher = threading.Thread(target=self._batch_loop, daemon=True, name="grpo-endpoint-batcher")
        self._batcher.start()
        host = f"[{self.settings.host}]" if ":" in self.settings.host else self.settings.host
        self.base_url = f"http://{host}:{port}/v1"
        deadline = time.monotonic() + 30
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError(f"the endpoint did not start on {self.base_url}")
        return self.base_url

    def close(self) -> None:
        """Stop: the batch in flight is answered, every later request gets 503 ``shutting_down``, and no batch
        generates once this returns (`Batching.stop_batching`: the backend is closed after the endpoint); then the
        server stops (after the batcher, so no handler is cancelled into a bare 500)."""
        self.stop_batching()
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
        self._work_pool.shutdown(wait=False, cancel_futures=True)

    def sampling(self, profile: str) -> dict[str, float]:
        """The ``temperature`` / ``top_p`` a request sends for the run's ``"train"`` or ``"val"`` sampling."""
        temperature, top_p = self.train_pair if profile == "train" else self.val_pair
        return {"temperature": temperature, "top_p": top_p}

    # ---------------------------------------------------------------- sessions
    def open_session(self, seed_key: str, seed_by_prompt: bool = False) -> str:
        """A new key whose calls are recorded (one per sample); ``seed_key`` seeds its calls, in call order or, with
        ``seed_by_prompt`` (a key many samples share), by prompt (`call_seeds`). The session has a base URL of its
        own too (`rollout_url`)."""
        key, rollout_id = "sk-grpo-s-" + secrets.token_hex(16), secrets.token_hex(8)
        with self._lock:
            self._sessions[key] = _Session(seed_key, rollout_id=rollout_id, seed_by_prompt=seed_by_prompt)
            self._rollouts[rollout_id] = key
        return key

    def call_seeds(self, session: _Session, prompt: list[int], n: int, profile: str = "train") -> list[int]:
        """The seeds of a call's ``n`` choices under ``session``: hash(seed key, call number, i), or with
        ``session.seed_by_prompt`` hash(seed key, profile, weight version, prompt, j, i) for the j-th call with
        ``prompt`` at the endpoint's weight version under sampling ``profile`` (the module's docstring says why)."""
        if not session.seed_by_prompt:
            with self._lock:
                call, session.calls = session.calls, session.calls + 1
            return [seed_of(session.seed_key, call, i) for i in range(n)]
        digest = hashlib.sha256(",".join(map(str, prompt)).encode()).hexdigest()[:32]
        with self._lock:
            version = self.weight_version
            if version not in session.prompt_calls:  # the counts of versions long past go (a run's worth would pile up)
                session.prompt_calls = {v: c for v, c in session.prompt_calls.items() if v > version - KEEP_VERSIONS}
            counts = session.prompt_calls.setdefault(version, {})
            j = counts.get((profile, digest), 0)
            counts[(profile, digest)] = j + 1
        return [seed_of(session.seed_key, profile, version, digest, j, i) for i in range(n)]

    def restart_prompt_counts(self, key: str) -> None:
        """Session ``key``'s per-prompt call counts start again (``seed_by_prompt``: a play that opens while no other
        is open, so its seeds do not depend on what an earlier play at the same weight version asked)."""
        with self._lock:
            self._sessions[key].prompt_calls = {}

    def close_session(self, key: str) -> list[CallRecord]:
        """Forget the key and its base URL; returns its calls' records in the order they were answered."""
        with self._lock:
            session = self._sessions.pop(key)
            del self._rollouts[session.rollout_id]
        return session.records

    def rollout_url(self, key: str) -> str:
        """Session ``key``'s own base URL (``http://host:port/rollout/<id>/v1``): every call under it is recorded
        for that session, whichever key the client sends (the run's or the session's), so a harness configured with
        one key for all its conversations is still attributed per sample. Answers 404 once the session is closed."""
        with self._lock:
            rollout_id = self._sessions[key].rollout_id
        return f"{self.base_url.removesuffix('/v1')}{ROLLOUT_PREFIX.format(rollout_id=rollout_id)}/v1"

    def take_records(self, key: str) -> list[CallRecord]:
        """The calls recorded under session ``key`` since the last take, in the order they were answered; the key
        stays valid (a long-lived session: the NeMo-Gym servers', `grpo.wings.gym.rollout.GymLedger`)."""
        with self._lock:
            session = self._sessions[key]
            records, session.records = session.records, []
        return records

    # ---------------------------------------------------------------- requests
    def _authorize(self, headers, rollout_id: str | None = None) -> _Session | None:
        """The session a request is recorded under (None: the run's own). The key: ``Authorization: Bearer <key>``
        (OpenAI's clients), else ``x-api-key`` (Anthropic's); a 401 without a valid one. Its session's, or under a
        rollout's base URL (``rollout_id``) that rollout's, with the run's key or that session's own (404 for a
        rollout that is unknown or closed, 403 for another sample's key)."""
        bearer = headers.get("authorization")
        key = bearer.removeprefix("Bearer ").strip() if bearer else (headers.get("x-api-key") or "").strip()
        with self._lock:
            session = self._sessions.get(key)
            owner = self._rollouts.get(rollout_id) if rollout_id is not None else None
            rollout = self._sessions[owner] if owner is not None else None
        if session is None and key != self.api_key:
            raise RequestError(401, "a valid API key is required (Authorization: Bearer <key>, or x-api-key: <key>): "
                                    "the run's key or a sample's", kind="authentication_error",
                               code="invalid_api_key")
        if rollout_id is None:
            return session
        if rollout is None:
            raise RequestError(404, f"rollout {rollout_id!r} is unknown or finished: a rollout's base URL serves "
                                    "while its sample plays", code="rollout_not_found")
        if session is not None and session is not rollout:
            raise RequestError(403, f"this key is another sample's than rollout {rollout_id!r}'s: send the run's "
                                    "key or that sample's", kind="permission_error", code="rollout_key_mismatch")
        return rollout

    async def responses(self, req: ResponsesRequest, session: _Session | None) -> dict:
        """``POST /v1/responses`` (`grpo.wings.agents.openai_responses`): through `chat`, remembered per key."""
        return await create_response(self, req, session, self._responses if session is None else session.responses)

    def render(self, messages, tools, kwargs: dict | None, add_generation_prompt: bool,
               template: str | None = None) -> list[int]:
        """The chat template's tokens for ``messages`` (vLLM's way: render to text, encode without adding special
        tokens; an image part is its one unexpanded placeholder token here, `prompt_and_media` expands it)."""
        text = self.render_text(messages, tools, kwargs, add_generation_prompt, template)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def render_text(self, messages, tools, kwargs: dict | None, add_generation_prompt: bool,
                    template: str | None = None) -> str:
        """The chat template's text for ``messages``; ``template``: a request's own (trusted) template, else the
        run's. The template's code stops after ``http_server.render_timeout_s``; a text too long for the context is
        refused."""
        extra = {**self.template_kwargs, **(kwargs or {})}
        if template is not None or self.chat_template is not None:
            extra["chat_template"] = template if template is not None else self.chat_template
        limit_s = self.settings.render_timeout_s
        try:
            with template_deadline(limit_s):
                text = self.tokenizer.apply_chat_template(template_messages(messages), tools=tools, tokenize=False,
                                                          add_generation_prompt=add_generation_prompt, **extra)
        except RequestError:
            raise
        except TemplateTimeout:
            raise RequestError(400, f"rendering the chat template took over {limit_s:g} s "
                                    "(policy.generation.http_server.render_timeout_s)", param="messages") from None
        except Exception as err:
            raise RequestError(400, f"the chat template cannot render these messages: {type(err).__name__}: {err}",
                               param="messages") from None
        if len(text) > self.max_render_chars:
            raise RequestError(400, f"the rendered prompt has {len(text)} characters, more than "
                                    f"policy.max_total_sequence_length={self.max_len} tokens can hold",
                               param="messages", code="context_length_exceeded")
        return text

    def prompt_ids(self, req) -> list[int]:
        """The request's prompt tokens (`prompt_and_media`)."""
        return self.prompt_and_media(req)[0]

    def prompt_and_media(self, req) -> tuple[list[int], dict | None]:
        """The request's prompt tokens and its images as the model's tensors (None without images): its token ids
        checked (`openai_checks.check_token_ids`), its image parts read (`request_images`), rendered with the chat
        template and tokenised (`encode`), then spliced onto the model's own earlier tokens when the history carries
        them (`openai_chat.replace_prefix_tokens`), keeping its images' placeholders
        (`openai_images.check_placeholders`).
        Blocking: the server calls it off the event loop (`_off_loop`)."""
        check_token_ids(req, self.vocab_size)
        images = self.request_images(req)
        template = request_template(req, self.settings.trust_request_chat_template)
        kwargs = req.chat_template_kwargs
        text = self.render_text(req.messages, req.tools, kwargs, req.add_generation_prompt, template)
        ids, media = self.encode(text, images)
        prefix = required_prefix(req)
        if prefix is None:
            return ids, media
        last = max((i for i, m in enumerate(req.messages) if m.role == "assistant"), default=len(req.messages) - 1)
        template_prefix = self.render(req.messages[:last + 1], req.tools, kwargs, False, template)
        spliced = replace_prefix_tokens(self.tokenizer.eos_token_id, prefix, template_prefix, ids)
        if self.image_token is not None:
            check_placeholders(spliced, ids, self.tokenizer.convert_tokens_to_ids(self.image_token))
        return spliced, media

    def request_images(self, req) -> list:
        """The pictures of the request's image parts, in order (`openai_images.request_images`); a 400 naming the
        first part when the policy is a text model, and before any is decoded when they could not fit the context."""
        urls = image_urls(req.messages)
        if urls and self.processor is None:
            where = urls[0][0]
            raise RequestError(400, f"{where}: an image part, and this run's policy ({self.model_name}) is a text "
                                    "model (no vision_config): send text parts only", param=where)
        if len(urls) > self.max_len:  # each takes a token at least
            raise RequestError(400, f"messages: {len(urls)} image parts, more than policy.max_total_sequence_length="
                                    f"{self.max_len} tokens can hold", param="messages",
                               code="context_length_exceeded")
        return request_images(urls, self.settings)

    def encode(self, text: str, images: list) -> tuple[list[int], dict | None]:
        """``(ids, media)`` of a rendered prompt: with images, the policy's processor's as the data path makes a
        row's (`grpo.system.vision.encode_with_images`: each placeholder expanded once), else the tokenizer's ids and
        None. A vision-language policy's text must hold its image token once per picture
        (`grpo.system.vision.placeholder_problem`), else a 400."""
        from grpo.system.vision import encode_with_images, placeholder_problem

        problem = None if self.image_token is None else placeholder_problem(text, self.image_token, len(images))
        if problem is not None:
            raise RequestError(400, f"messages: the rendered prompt {problem}", param="messages")
        if not images:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), None
        return encode_with_images(self.processor, text, images)

    async def _off_loop(self, fn, *args):
        """``fn(*args)`` on a work thread: the event loop goes on serving (/health, other requests' bodies) while a
        request is parsed and rendered."""
        return await asyncio.get_running_loop().run_in_executor(self._work_pool, fn, *args)

    async def chat(self, req: ChatRequest, session: _Session | None) -> dict:
        if req.model != self.model_name:
            raise RequestError(404, f"model {req.model!r} does not exist: this endpoint serves {self.model_name!r}",
                               param="model", code="model_not_found")
        if req.stream:
            raise RequestError(400, "stream=true is not supported by this endpoint", param="stream")
        profile = check_sampling(req, self.train_pair, self.val_pair)
        check_tools(req, self.tool_parser)
        prompt, media = await self._off_loop(self.prompt_and_media, req)
        room = self.max_len - len(prompt)
        if room <= 0:
            raise RequestError(400, f"the prompt has {len(prompt)} tokens, leaving no room under "
                                    f"policy.max_total_sequence_length={self.max_len}", param="messages",
                               code="context_length_exceeded")
        max_new = min(req.wanted_tokens() or self.gen_cfg.max_new_tokens, room)
        if session is not None:
            seeds = self.call_seeds(session, prompt, req.n, profile)
        else:
            base = req.seed if req.seed is not None else secrets.randbits(62)
            seeds = [seed_of("request", base, i) for i in range(req.n)]
        stops = list(req.stop or [])
        futures = []
        for s in seeds:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            self._queue.put(_Pending(prompt, s, max_new, stops, profile, fut,
                                     time.monotonic() + self.settings.max_wait_s, media))
            futures.append(fut)
        if self._stop.is_set():  # the batcher may have ended before these were queued: nothing else answers them
            self._shut(self._drain())
        results = [await asyncio.wrap_future(f) for f in futures]
        choices = []
        for i, (out, version) in enumerate(results):
            logprobs = [max(float(x), LOGPROB_FLOOR) for x in out.logprobs]
            if session is not None:
                with self._lock:
                    session.records.append(CallRecord(list(prompt), list(out.completion_ids), logprobs,
                                                      out.finish_reason, version, media))
            choices.append(self._choice(i, req, out, logprobs, stops))
        n_gen = sum(len(out.completion_ids) for out, _ in results)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": n_gen,
                          "total_tokens": len(prompt) + n_gen},
                "weight_version": results[0][1]}

    def _choice(self, index: int, req: ChatRequest, out, logprobs: list[float], stops: list[str]) -> dict:
        text = cut_at_stop(self.tokenizer.decode(out.completion_ids, skip_special_tokens=True), stops)
        reasoning, content, calls = self.parse(text, list(out.completion_ids), req)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        if self.reasoning_parser is not None:
            message["reasoning_content"] = reasoning
        choice = {"index": index, "message": message, "logprobs": None,
                  "finish_reason": "tool_calls" if calls else out.finish_reason}
        if req.logprobs:
            message.update(prompt_token_ids=list(out.prompt_ids), generation_token_ids=list(out.completion_ids),
                           generation_log_probs=logprobs)
            choice["logprobs"] = {"content": [self._token_logprob(t, lp, req.top_logprobs)
                                              for t, lp in zip(out.completion_ids, logprobs)]}
        return choice

    def parse(self, text: str, token_ids: list[int], req: ChatRequest) -> tuple[str | None, str | None, list[dict]]:
        """``(reasoning_content, content, tool_calls)`` of a generated text: vLLM's parsers on the vLLM backend
        (`grpo.wings.agents.vllm_chat_parsers`, the names vLLM registers), else grpo-ds's
        (`grpo.wings.agents.openai_chat`: the hf backend, and ``compact`` on both)."""
        kwargs = {**self.template_kwargs, **(req.chat_template_kwargs or {})}
        tools = None if req.tool_choice == "none" else req.tools
        if self.vllm_parser is None:
            return parse_message(text, self.tool_parser, self.reasoning_parser, tools, kwargs)
        reasoning, content, calls = self.vllm_parser.parse(text, token_ids, tools, req.tool_choice, kwargs)
        if self.vllm_parser.tool_parser is None and self.tool_parser is not None and content is not None:
            content, calls = extract_tool_calls(content, self.tool_parser, tools)  # compact: grpo-ds's own
        return reasoning, content, calls

    async def messages(self, req: MessagesRequest, session: _Session | None) -> dict | Response:
        """``POST /v1/messages``: the request as a chat completion (`anthropic_messages.chat_request`), generated and
        recorded by `chat`, answered as Anthropic's Message (server-sent events with ``stream``). Under a sample's key
        a history that continues one of its answers is spliced onto that answer's tokens
        (`anthropic_messages.history_key`: the client does not send them back)."""
        chat = await self._off_loop(anthropic_messages.chat_request, req, self.train_pair[1])
        if session is not None and await self._off_loop(lambda: self.turns_end_with_eos):
            key = await self._off_loop(anthropic_messages.history_key, req)
            with self._lock:
                chat.required_prefix_token_ids = session.answers.get(key)
        completion = await self.chat(chat, session)
        said = anthropic_messages.choice_of(completion)["message"]
        text = self.tokenizer.decode(said["generation_token_ids"], skip_special_tokens=True)
        message = anthropic_messages.anthropic_message(completion, first_stop(text, chat.stop or []))
        if session is not None:
            key = await self._off_loop(anthropic_messages.answer_key, req, message)
            with self._lock:
                session.answers[key] = said["prompt_token_ids"] + said["generation_token_ids"]
                while len(session.answers) > MAX_ANSWERS:  # a long-lived key (NeMo-Gym's) keeps its latest
                    session.answers.pop(next(iter(session.answers)))
        if req.stream:
            return Response(anthropic_messages.sse_events(message), media_type="text/event-stream")
        return message

    @functools.cached_property
    def turns_end_with_eos(self) -> bool:
        """Whether the run's chat template ends an assistant turn with the end-of-sequence token: what NeMo-RL's
        prefix splice counts (`openai_chat.replace_prefix_tokens`), so what `messages` needs to splice a history onto
        its answers' tokens (without it a history is rendered as text, as chat renders one without token fields)."""
        turn = [ChatMessage(role="user", content="?"), ChatMessage(role="assistant", content="!")]
        try:
            return self.tokenizer.eos_token_id in self.render(turn, None, None, False)
        except RequestError:
            return False

    def _token_logprob(self, token_id: int, logprob: float, top: int | None) -> dict:
        """OpenAI's per-token entry. The backends return the sampled token's logprob only: ``top_logprobs`` holds
        that token (when top_logprobs >= 1), not the alternatives."""
        text = self.tokenizer.decode([token_id])
        entry = {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        entry["top_logprobs"] = [dict(entry)] if top else []
        return entry

    def tokenize(self, req: TokenizeRequest) -> dict:
        """``POST /tokenize``'s answer (blocking: the server calls it off the event loop)."""
        if req.messages is not None:
            ids = self.prompt_ids(req)
        elif req.prompt is not None:
            ids = list(self.tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
        else:
            raise RequestError(400, "expected messages or prompt", param="messages")
        return {"count": len(ids), "max_model_len": self.max_len, "tokens": ids, "token_strs": None}

    # ---------------------------------------------------------------- the app
    def app(self):
        app = FastAPI(title="grpo-ds endpoint", docs_url=None, redoc_url=None, openapi_url=None)

        def refuse(err: RequestError, shape=RequestError.body) -> JSONResponse:
            return JSONResponse(shape(err), status_code=err.status, headers=err.headers)

        async def guarded(request: Request, model_cls, handle, rollout_id: str | None = None,
                          shape=RequestError.body):
            """``handle(request as model_cls, session)`` within the limits (module docstring); its answer as JSON
            (or as the Response it returns); errors in ``shape``'s body (OpenAI's, or another dialect's)."""
            settings, admitted = self.settings, False
            self._inflight += 1
            try:
                session = self._authorize(request.headers, rollout_id)
                body = await read_body(request, settings.max_body_bytes, settings.read_timeout_s)
                if self._admitted >= settings.max_concurrent_requests:
                    raise RequestError(429, f"more than {settings.max_concurrent_requests} requests in flight "
                                            "(policy.generation.http_server.max_concurrent_requests)",
                                       kind="rate_limit_error", code="rate_limit_exceeded")
                self._admitted, admitted = self._admitted + 1, True
                answer = await handle(await self._off_loop(parse_request, model_cls, body), session)
                return answer if isinstance(answer, Response) else JSONResponse(answer)
            except RequestError as err:
                return refuse(err, shape)
            except ClientDisconnect:  # nobody to answer
                logger.warning("endpoint: a client of %s disconnected before its request body was complete",
                               request.url.path)
                return refuse(RequestError(400, "the client disconnected"), shape)
            except asyncio.CancelledError:  # the server stops (`close`) and cancels what is still being read
                if not self._stop.is_set():
                    raise
                return refuse(shutting_down(), shape)
            except Exception as err:  # a bug or a backend failure: this request fails, the run goes on
                logger.warning("endpoint: %s failed", request.url.path, exc_info=True)
                return refuse(RequestError(500, f"{type(err).__name__}: {err}", kind="server_error"), shape)
            finally:
                self._inflight -= 1
                self._admitted -= admitted

        def serve(path: str, model_cls, handle, shape=RequestError.body) -> None:
            """POST ``path`` at the run's base URL and at every rollout's (`rollout_url`), errors in ``shape``'s
            body."""
            async def shared(request: Request):
                return await guarded(request, model_cls, handle, shape=shape)

            async def per_rollout(request: Request, rollout_id: str):
                return await guarded(request, model_cls, handle, rollout_id, shape=shape)

            app.post(path)(shared)
            app.post(ROLLOUT_PREFIX + path)(per_rollout)

        async def tokenize_handler(req, session):
            return await self._off_loop(self.tokenize, req)

        serve("/v1/chat/completions", ChatRequest, self.chat)
        serve("/v1/responses", ResponsesRequest, self.responses)
        serve("/v1/messages", MessagesRequest, self.messages, anthropic_messages.error_body)
        serve("/tokenize", TokenizeRequest, tokenize_handler)

        def model_list(request: Request, rollout_id: str | None = None):
            try:
                self._authorize(request.headers, rollout_id)
            except RequestError as err:
                return refuse(err)
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                "owned_by": "grpo-ds", "max_model_len": self.max_len}]}

        @app.get("/v1/models")
        async def models(request: Request):
            return model_list(request)

        @app.get(ROLLOUT_PREFIX + "/v1/models")
        async def rollout_models(request: Request, rollout_id: str):
            return model_list(request, rollout_id)

        @app.get("/health")
        async def health():
            return {"status": "ok", "weight_version": self.weight_version}

        return app
