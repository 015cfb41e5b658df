"""OpenAI API requests and responses: validation, errors, prompts, incremental text.

Torch-free; the tokenizer (a Hugging Face tokenizer) is only called through
:class:`TextCodec`, which may be absent (token-id prompts only).

Supported request fields
------------------------
Both endpoints: ``model``, ``max_tokens`` (chat also ``max_completion_tokens``),
``temperature`` (0 to 2; 0 is greedy), ``top_p``, ``seed``, ``stop`` (a string or up
to 4), ``stream``, ``stream_options`` (``include_usage``, and vLLM's
``continuous_usage_stats``), ``n`` (1 only), and the vLLM extensions ``ignore_eos``,
``stop_token_ids`` and ``return_token_ids`` (token ids in every choice). ``prompt`` is
a string, a list of token ids, or a one-element list of either. Unsupported features
with a non-default value (``logprobs``, ``echo``, ``best_of``, penalties, ``logit_bias``,
``suffix``, ``tools``, ``n > 1``, batched prompts) are refused with 400; unknown fields
are ignored. ``user`` (at most :data:`MAX_SESSION_CHARS` characters) names the
client's session: KV-aware routing keeps a session on the same workers while the fleet
index is cold (the ``X-Session-Id`` header does the same). ``pdkv_stats: true`` adds a
``pdkv`` object (routing and KV transfer figures) to the response (non-standard).

Errors are :class:`APIError` and render as OpenAI does:
``{"error": {"message", "type", "param", "code"}}``. Bodies that are not UTF-8 JSON
objects, nest deeper than Python's recursion limit, or hold text with a lone surrogate
(``"\\ud800"``, which no tokenizer can encode) are refused with 400; bodies over
:func:`body_limit` with 413.
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .protocol import GenParams

__all__ = ["APIError", "Endpoint", "IncrementalDetokenizer", "ModelInfo", "OpenAIRequest", "StopMatcher",
           "TextCodec", "body_limit", "decode_body", "parse_request", "resolve_prompt", "session_id"]

MAX_STOP_STRINGS = 4
#: Longest session id (``user`` field, ``X-Session-Id`` header).
MAX_SESSION_CHARS = 256
#: The default request body limit, whatever the model's context (was 64 bytes per token
#: of context: 8 MiB at 128k, and a prompt that size cost the proxy ~1.8 GiB to
#: tokenize). 4 MiB holds a 128k-token prompt as token ids (~7 bytes each) or as text.
#: ``--max-body-bytes`` raises it for longer contexts.
DEFAULT_BODY_BYTES = 4 << 20
#: Kept for compatibility: the smallest default limit (now the same as the default).
MIN_BODY_BYTES = DEFAULT_BODY_BYTES
#: Text longer than this is counted in pieces of this many characters before it is
#: tokenized whole, so a prompt far past the context is refused after tokenizing a
#: context's worth of it, not all of it (see :meth:`TextCodec.encode`).
COUNT_CHUNK_CHARS = 1 << 15
_SEED_MASK = (1 << 63) - 1


class Endpoint(str, enum.Enum):
    """The two generation endpoints."""

    COMPLETIONS = "completions"
    CHAT = "chat"


class APIError(Exception):
    """An error answered to the client in OpenAI's format.

    Parameters
    ----------
    status : int
        HTTP status.
    message : str
    type : str
        ``"invalid_request_error"`` for 4xx, ``"server_error"`` for 5xx by default.
    param : str, optional
        The request field at fault.
    code : str, optional
        A machine-readable code (``"model_not_found"``, ``"context_length_exceeded"``...).
    """

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code

    def to_json(self) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def bad(cls, message: str, param: str | None = None, code: str | None = None) -> "APIError":
        """A 400 ``invalid_request_error``."""
        return cls(400, message, param=param, code=code)


def body_limit(info: "ModelInfo | None", configured: int | None = None) -> int:
    """Most request body bytes accepted: ``configured`` if given, else
    :data:`DEFAULT_BODY_BYTES`, independent of the model's context (``info`` is ignored:
    kept for callers)."""
    if configured is not None:
        return int(configured)
    return DEFAULT_BODY_BYTES


def decode_body(raw: bytes) -> Any:
    """The JSON value of a request body.

    Raises
    ------
    APIError
        400 for bytes that are not UTF-8, text that is not JSON, or JSON nested too deeply
        to decode (Python's recursion limit).
    """
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise APIError.bad("the request body is not UTF-8 text") from None
    except RecursionError:
        raise APIError.bad("the request body nests JSON too deeply") from None
    except ValueError as e:
        raise APIError.bad(f"the request body is not valid JSON: {e}") from None


def _text(s: str, param: str) -> str:
    """``s`` if it is valid Unicode text (no lone surrogate); tokenizers reject the rest."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError.bad(f"'{param}' holds a lone surrogate (\\u{ord(s[e.start]):04x}) at character {e.start}: "
                           "it is not valid Unicode text", param) from None
    return s


@dataclass(frozen=True)
class ModelInfo:
    """What the API needs to know about the served model.

    Attributes
    ----------
    name : str
        The model id clients send.
    vocab_size : int
    max_model_len : int
        Most prompt + output tokens.
    max_prompt_tokens : int
        Longest prompt the deployment can hold (KV pool capacity).
    max_total_tokens : int
        Longest prompt + output the decode side can hold.
    aliases : tuple of str
        Other names accepted for the model (e.g. the ``--model`` argument as given, like
        vLLM, besides the directory's short name).
    """

    name: str
    vocab_size: int
    max_model_len: int
    max_prompt_tokens: int
    max_total_tokens: int
    aliases: tuple[str, ...] = ()

    def serves(self, model: str) -> bool:
        """True if clients may ask for ``model`` by that name."""
        return model == self.name or model in self.aliases

    def to_model_card(self, created: int) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": created, "owned_by": "pdkv",
                "max_model_len": self.max_model_len}


class TextCodec:
    """Text <-> token ids with a Hugging Face tokenizer (encode, chat template, decode).

    Parameters
    ----------
    tokenizer : transformers.PreTrainedTokenizerBase
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TextCodec":
        """Loads the tokenizer saved in a model directory (imports transformers)."""
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Token ids of a completion prompt (with the tokenizer's special tokens, as vLLM does).

        With ``max_tokens``, a long text is first counted piece by piece (pieces of
        :data:`COUNT_CHUNK_CHARS` characters cut at whitespace, each freed before the
        next); once the count is certainly past ``max_tokens`` (allowing a few tokens per
        cut), :class:`APIError` 400 is raised without tokenizing the rest. The memory a
        prompt costs is then bounded by the context, not by its length.
        """
        if max_tokens is not None and len(text) > COUNT_CHUNK_CHARS:
            self.check_length(text, max_tokens)
        ids = self.tokenizer(text, add_special_tokens=True, return_attention_mask=False)["input_ids"]
        return ids if isinstance(ids, list) else list(ids)

    def check_length(self, text: str, max_tokens: int, param: str = "prompt") -> None:
        """Raises :class:`APIError` 400 once ``text`` certainly has more than ``max_tokens``
        tokens (see :meth:`encode`); returns if it may not."""
        total, cuts, start, n = 0, 0, 0, len(text)
        while start < n:
            end = min(start + COUNT_CHUNK_CHARS, n)
            if end < n:  # cut before whitespace, so words stay whole
                ws = max(text.rfind(" ", start + COUNT_CHUNK_CHARS // 2, end),
                         text.rfind("\n", start + COUNT_CHUNK_CHARS // 2, end))
                end = ws if ws > start else end
                cuts += 1
            total += len(self.tokenizer(text[start:end], add_special_tokens=False,
                                        return_attention_mask=False)["input_ids"])
            start = end
            if total > max_tokens + 16 * cuts:
                raise APIError.bad(f"This model's maximum context length allows prompts of up to {max_tokens} "
                                   f"tokens; your {param} has more (over {total - 16 * cuts} in its first "
                                   f"{start} characters). Please shorten it.", param,
                                   code="context_length_exceeded")

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of a chat, rendered with the model's chat template plus the
        assistant generation prompt."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        return [int(t) for t in out]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns streamed token ids into text deltas without re-decoding the whole output.

    It decodes a short window (a few tokens of context plus the new ones) and emits the
    text past the context once it no longer ends in an incomplete UTF-8 sequence
    (``"\\ufffd"``), so multi-byte characters split over tokens come out whole and
    tokenizers that drop a leading space when decoding a lone token keep it.

    Parameters
    ----------
    codec : TextCodec
    prompt_ids : sequence of int
        The prompt (its last tokens are the first context).
    """

    CONTEXT = 5

    def __init__(self, codec: TextCodec, prompt_ids: Sequence[int]) -> None:
        self.codec = codec
        self.ids = list(prompt_ids[-self.CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)

    def add(self, token_id: int) -> str:
        """Adds one token; returns the new text (possibly empty)."""
        self.ids.append(int(token_id))
        prefix_text = self.codec.decode(self.ids[self.prefix:self.read])
        text = self.codec.decode(self.ids[self.prefix:])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            delta = text[len(prefix_text):]
            self.prefix = self.read
            self.read = len(self.ids)
            if len(self.ids) > 8 * self.CONTEXT:  # keep the window small
                cut = self.prefix
                self.ids = self.ids[cut:]
                self.prefix -= cut
                self.read -= cut
            return delta
        return ""

    def flush(self) -> str:
        """Text still held back at the end of the stream (an incomplete character)."""
        prefix_text = self.codec.decode(self.ids[self.prefix:self.read])
        text = self.codec.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(prefix_text):] if len(text) > len(prefix_text) else ""


class StopMatcher:
    """Finds stop strings in streamed text.

    While streaming it holds back the last ``len(longest stop) - 1`` characters, which
    could be the start of a stop string, so a stop string is never sent.

    Parameters
    ----------
    stops : sequence of str
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Adds text; returns ``(text safe to send, stopped)``. After a stop, the text
        up to the stop string is returned and the rest is dropped."""
        if not self.stops:
            return delta, False
        text = self.pending + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return text[:min(hits)], True
        keep = min(self.hold, len(text))
        self.pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The held-back text at the end of the stream."""
        out, self.pending = self.pending, ""
        return out


@dataclass(frozen=True)
class OpenAIRequest:
    """A validated ``/v1/completions`` or ``/v1/chat/completions`` request.

    Attributes
    ----------
    endpoint : Endpoint
    model : str
    prompt : str or tuple of int or None
        Completions: text or token ids.
    messages : tuple of dict or None
        Chat: ``{"role", "content"}`` with text content.
    max_tokens : int or None
        None: the endpoint's default (16 for completions; the rest of the context for chat).
    temperature, top_p : float
    seed : int or None
    stop : tuple of str
    stop_token_ids : tuple of int
    ignore_eos, stream, include_usage, continuous_usage, return_token_ids, pdkv_stats : bool
    user : str
        The client's session ('' for none; see :func:`session_id`).
    """

    endpoint: Endpoint
    model: str
    prompt: str | tuple[int, ...] | None
    messages: tuple[dict[str, str], ...] | None
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    continuous_usage: bool
    return_token_ids: bool
    pdkv_stats: bool
    user: str = ""

    def gen_params(self, num_prompt_tokens: int, max_model_len: int, seed: int) -> GenParams:
        """The sampling parameters, with the default ``max_tokens`` resolved and ``seed``
        used when the request has none."""
        if self.max_tokens is not None:
            mt = self.max_tokens
        elif self.endpoint is Endpoint.COMPLETIONS:
            mt = 16
        else:
            mt = max(max_model_len - num_prompt_tokens, 1)
        return GenParams(max_tokens=mt, temperature=self.temperature, top_p=self.top_p,
                         seed=(self.seed & _SEED_MASK) if self.seed is not None else seed,
                         stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float, *, lo_open: bool = False
            ) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise APIError.bad(f"'{key}' must be a number, got {json.dumps(v)}", key)
    v = float(v)
    if not (lo < v <= hi if lo_open else lo <= v <= hi) or v != v:
        lo_s = f"> {lo:g}" if lo_open else f">= {lo:g}"
        raise APIError.bad(f"'{key}' must be {lo_s} and <= {hi:g}, got {v:g}", key)
    return v


def _flag(body: Mapping[str, Any], key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError.bad(f"'{key}' must be a boolean, got {json.dumps(v)}", key)
    return v


def _refuse_unsupported(body: Mapping[str, Any], endpoint: Endpoint) -> None:
    def off(key: str, *defaults: Any) -> None:
        if key in body and body[key] is not None and body[key] not in defaults:
            raise APIError.bad(f"'{key}' is not supported by this server", key)

    off("logprobs", False, 0)
    off("top_logprobs", 0)
    off("echo", False)
    off("best_of", 1)
    off("presence_penalty", 0, 0.0)
    off("frequency_penalty", 0, 0.0)
    off("logit_bias", {})
    off("suffix", "")
    off("tools", [])
    off("functions", [])
    off("n", 1)
    if endpoint is Endpoint.CHAT:
        rf = body.get("response_format")
        if rf is not None and not (isinstance(rf, Mapping) and rf.get("type") == "text"):
            raise APIError.bad("'response_format' other than {\"type\": \"text\"} is not supported",
                               "response_format")


def _messages(v: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(v, list) or not v:
        raise APIError.bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, Mapping):
            raise APIError.bad(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise APIError.bad(f"messages[{i}].role must be system, developer, user, assistant or tool, "
                               f"got {json.dumps(role)}", "messages")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for p in content:
                if not isinstance(p, Mapping) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise APIError.bad(f"messages[{i}].content: only text parts are supported", "messages")
                parts.append(p["text"])
            content = "".join(parts)
        if content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise APIError.bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        _text(content, "messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return tuple(out)


def _prompt(v: Any) -> str | tuple[int, ...]:
    if isinstance(v, list) and len(v) == 1 and (isinstance(v[0], str) or isinstance(v[0], list)):
        v = v[0]  # a batch of one
    if isinstance(v, str):
        if not v:
            raise APIError.bad("'prompt' is empty", "prompt")
        return _text(v, "prompt")
    if isinstance(v, list):
        if not v:
            raise APIError.bad("'prompt' is empty", "prompt")
        if all(_is_int(t) for t in v):
            return tuple(v)
        if all(isinstance(t, (str, list)) for t in v):
            raise APIError.bad("batched prompts are not supported: send one prompt per request", "prompt")
    raise APIError.bad("'prompt' must be a string or a list of token ids", "prompt")


def parse_request(body: Any, endpoint: Endpoint) -> OpenAIRequest:
    """Validates a request body.

    Parameters
    ----------
    body : Any
        The decoded JSON.
    endpoint : Endpoint

    Returns
    -------
    OpenAIRequest

    Raises
    ------
    APIError
        400 with the offending ``param`` for anything malformed or unsupported.
    """
    if not isinstance(body, Mapping):
        raise APIError.bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError.bad("'model' is required and must be a string", "model")
    _refuse_unsupported(body, endpoint)
    prompt: str | tuple[int, ...] | None = None
    messages = None
    if endpoint is Endpoint.COMPLETIONS:
        if "prompt" not in body:
            raise APIError.bad("'prompt' is required", "prompt")
        prompt = _prompt(body["prompt"])
    else:
        messages = _messages(body.get("messages"))
    mt_key = "max_tokens"
    mt = body.get("max_tokens")
    if endpoint is Endpoint.CHAT and body.get("max_completion_tokens") is not None:
        mt_key, mt = "max_completion_tokens", body["max_completion_tokens"]
    if mt is not None and (not _is_int(mt) or mt < 1):
        raise APIError.bad(f"'{mt_key}' must be an integer >= 1, got {json.dumps(mt)}", mt_key)
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise APIError.bad(f"'seed' must be an integer, got {json.dumps(seed)}", "seed")
    stop_v = body.get("stop")
    if stop_v is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_v, str):
        stop = (_text(stop_v, "stop"),) if stop_v else ()
    elif isinstance(stop_v, list) and all(isinstance(s, str) for s in stop_v):
        if len(stop_v) > MAX_STOP_STRINGS:
            raise APIError.bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings", "stop")
        stop = tuple(_text(s, "stop") for s in stop_v if s)
    else:
        raise APIError.bad("'stop' must be a string or a list of strings", "stop")
    sti = body.get("stop_token_ids")
    if sti is None:
        stop_ids: tuple[int, ...] = ()
    elif isinstance(sti, list) and all(_is_int(t) and t >= 0 for t in sti):
        stop_ids = tuple(sti)
    else:
        raise APIError.bad("'stop_token_ids' must be a list of token ids", "stop_token_ids")
    stream = _flag(body, "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, Mapping):
        raise APIError.bad("'stream_options' must be an object", "stream_options")
    so = so or {}
    for k in ("include_usage", "continuous_usage_stats"):
        if k in so and not isinstance(so[k], bool):
            raise APIError.bad(f"'stream_options.{k}' must be a boolean", "stream_options")
    return OpenAIRequest(
        endpoint=endpoint, model=model, prompt=prompt, messages=messages, max_tokens=mt, temperature=temperature,
        top_p=top_p, seed=seed, stop=stop, stop_token_ids=stop_ids, ignore_eos=_flag(body, "ignore_eos"),
        stream=stream, include_usage=bool(so.get("include_usage", False)),
        continuous_usage=bool(so.get("continuous_usage_stats", False)),
        return_token_ids=_flag(body, "return_token_ids"), pdkv_stats=_flag(body, "pdkv_stats"),
        user=session_id(body.get("user"), "user"))


def session_id(v: Any, param: str) -> str:
    """A client's session id (the ``user`` field or the ``X-Session-Id`` header): ''
    for None, else a string of at most :data:`MAX_SESSION_CHARS` characters.

    Raises
    ------
    APIError
        400 naming ``param`` for anything else.
    """
    if v is None:
        return ""
    if not isinstance(v, str) or len(v) > MAX_SESSION_CHARS:
        raise APIError.bad(f"'{param}' must be a string of at most {MAX_SESSION_CHARS} characters", param)
    return _text(v, param)


def resolve_prompt(req: OpenAIRequest, info: ModelInfo, codec: TextCodec | None) -> tuple[list[int], GenParams]:
    """Tokenizes the prompt and checks it against the model and the deployment.

    Parameters
    ----------
    req : OpenAIRequest
    info : ModelInfo
    codec : TextCodec or None
        Needed for text prompts and chat.

    Returns
    -------
    tuple
        The prompt token ids and the generation parameters (``seed`` drawn here when
        the request has none).

    Raises
    ------
    APIError
        404 for an unknown model; 400 for an empty, over-long or out-of-vocabulary
        prompt, or ``max_tokens`` beyond the context.
    """
    if not info.serves(req.model):
        raise APIError(404, f"The model '{req.model}' does not exist; this server serves '{info.name}'",
                       param="model", code="model_not_found")
    param = "prompt"
    if req.endpoint is Endpoint.CHAT:
        param = "messages"
        if codec is None or not codec.has_chat_template:
            raise APIError.bad("this model has no chat template; use /v1/completions", "messages")
        limit = min(info.max_prompt_tokens, info.max_model_len - 1)
        contents = "\n".join(m.get("content") or "" for m in req.messages or () if isinstance(m.get("content"), str))
        if len(contents) > COUNT_CHUNK_CHARS:  # the contents alone are past the context: no rendering
            codec.check_length(contents, limit, "messages")
        del contents
        ids = codec.chat([dict(m) for m in req.messages or ()])
    elif isinstance(req.prompt, str):
        if codec is None:
            raise APIError.bad("this server has no tokenizer: send the prompt as token ids", "prompt")
        ids = codec.encode(req.prompt, min(info.max_prompt_tokens, info.max_model_len - 1))
    else:
        ids = list(req.prompt or ())
        bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise APIError.bad(f"token id {bad} is outside the vocabulary [0, {info.vocab_size})", "prompt")
    if not ids:
        raise APIError.bad(f"the {param} is empty after tokenization", param)
    if req.stop_token_ids and max(req.stop_token_ids) >= info.vocab_size:
        raise APIError.bad(f"stop_token_ids must be < {info.vocab_size}", "stop_token_ids")
    n = len(ids)
    params = req.gen_params(n, min(info.max_model_len, info.max_total_tokens + 1),
                            int.from_bytes(os.urandom(8), "little") & _SEED_MASK)
    if n > info.max_prompt_tokens or n >= info.max_model_len:
        raise APIError.bad(f"This model's maximum context length is {info.max_model_len} tokens and this "
                           f"deployment holds prompts of up to {min(info.max_prompt_tokens, info.max_model_len - 1)}"
                           f" tokens; your prompt has {n} tokens. Please shorten it.", param,
                           code="context_length_exceeded")
    if n + params.max_tokens > info.max_model_len or n + params.max_tokens - 1 > info.max_total_tokens:
        limit = min(info.max_model_len, info.max_total_tokens + 1)
        raise APIError.bad(f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{n + params.max_tokens} tokens ({n} in the {param}, {params.max_tokens} in the "
                           f"completion). Please reduce the length of the {param} or the completion.",
                           "max_tokens", code="context_length_exceeded")
    return ids, params
