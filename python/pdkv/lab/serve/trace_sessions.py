"""Session workloads for prefix-reuse benchmarks: ``--workload multi-turn`` and ``agentic``.

A request trace (:mod:`pdkv.lab.serve.trace`) fixes every prompt in advance. The
workloads where a prefix cache pays do not: a chat turn's prompt is the conversation
so far, *including the answer the server gave*, plus the user's new message, and an
agent's next call is its context so far plus the last call's answer plus a tool's
output. A :class:`SessionTrace` therefore fixes everything **but** the answers:

* a prefix shared by every session (a system prompt; an agent's tools and documents),
  ``shared_len`` tokens;
* per session: its start time (sessions arrive as a Poisson process at
  ``session_rate`` per second), its first message (``first_len`` tokens), and its
  turns: per turn the new tokens appended after the previous answer (a user message
  or a tool output, ``turn_len``), the answer's length (``output_len``, sent as
  ``max_tokens`` with ``ignore_eos``, so every prompt *length* is known in advance)
  and the think time between the previous answer and this turn (exponential with
  mean ``think_s``: a user reading and typing, or a tool running).

Turn ``k + 1``'s prompt is turn ``k``'s prompt + the token ids turn ``k``'s answer
actually had + the new tokens; :func:`pdkv.lab.serve.client_sessions.run_sessions`
sends it ``think_s`` after turn ``k``'s answer ended. A session stops early when its
next prompt plus answer would pass ``max_context`` tokens.

Presets (:data:`SESSION_PRESETS`):

``multi-turn``
    Chat: a 256-token system prompt shared by all sessions, a first user message of
    median 64 tokens, 3 to 6 turns, new user messages of median 48 tokens, answers of
    median 32 tokens, 2 s think time; 0.25 new sessions/s.
``agentic``
    Agents: a 768-token shared context (tool definitions and documents), a first
    request of median 64 tokens, 6 to 12 calls, each appending a tool output of median
    48 tokens, short answers (median 16 tokens: a tool call), 0.2 s between an answer
    and the next call (the tool's latency); 0.1 new sessions/s.

Determinism: like request traces, every draw is a pure function of the seed, from its
own random stream (:mod:`pdkv.lab.serve.trace_rng`), per session, so the first ``k``
sessions do not depend on how many are generated, and the session trace at session
rate ``r2`` is the one at ``r1`` with start times multiplied by ``r1 / r2``.

Example
-------
>>> t = get_session_preset("multi-turn").generate(seed=0, num_sessions=2)
>>> s = t.sessions[0]
>>> t.shared_prompt()[:3] == t.shared_prompt()[:3], len(s.turns) >= 1, s.turns[0].think_s
(True, True, 0.0)
>>> first = t.first_prompt(s)
>>> first[: len(t.shared_prompt())] == t.shared_prompt(), len(first) == s.turns[0].prompt_len
(True, True)
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import numpy as np

from pdkv.lab.serve.trace_dist import (
    LengthDist,
    LogNormal,
    Uniform,
    check_rate,
    length_dist_from_dict,
)
from pdkv.lab.serve.trace_rng import stream_rng

__all__ = [
    "SESSION_PRESETS",
    "WORKLOADS",
    "Session",
    "SessionSpec",
    "SessionTrace",
    "Turn",
    "generate_sessions",
    "get_session_preset",
    "load_session_trace",
]

#: Streams of the session draws (the request traces use 1-4).
STREAM_SESSION_START = 11
STREAM_SESSION_SHAPE = 12
STREAM_SESSION_CONTENT = 13
STREAM_SHARED_CONTENT = 14

#: Turns per session are at most this (a bound on the content key space, not a limit users meet).
MAX_TURNS = 4096


@dataclass(frozen=True)
class Turn:
    """One turn of a session (one request).

    Attributes
    ----------
    new_len : int
        Tokens appended after the previous answer (the first turn: the first message,
        after the shared prefix).
    output_len : int
        Answer tokens (``max_tokens``).
    think_s : float
        Seconds between the previous answer's end and this turn (0 for the first turn).
    prompt_len : int
        Length of this turn's prompt (shared prefix + history + new tokens), known in
        advance because every answer has exactly ``output_len`` tokens.
    """

    new_len: int
    output_len: int
    think_s: float
    prompt_len: int

    def to_dict(self) -> Dict[str, Any]:
        """JSON form."""
        return {"new_len": self.new_len, "output_len": self.output_len, "think_s": self.think_s,
                "prompt_len": self.prompt_len}


@dataclass(frozen=True)
class Session:
    """One conversation or agent run.

    Attributes
    ----------
    index : int
        Position in the trace (0-based, by start time); keys its content.
    start_s : float
        When its first turn is sent, seconds after the start of the run.
    turns : tuple of Turn
        At least one.
    first_index : int
        Request index of its first turn: turn ``k`` is request ``first_index + k`` (pairs
        requests across runs of the same trace).
    """

    index: int
    start_s: float
    turns: Tuple[Turn, ...]
    first_index: int

    def to_dict(self) -> Dict[str, Any]:
        """JSON form."""
        return {"index": self.index, "start_s": self.start_s, "first_index": self.first_index,
                "turns": [t.to_dict() for t in self.turns]}


@dataclass(frozen=True)
class SessionSpec:
    """How to generate a session trace (see the module docstring).

    Attributes
    ----------
    name, description : str
        Workload name (``"multi-turn"``, ``"agentic"``) and one line for humans.
    session_rate : float
        New sessions per second (Poisson).
    shared_len : int
        Tokens of the prefix every session starts with (>= 0).
    first_len, turn_len, output_len : LengthDist
        First message, later new tokens, answer lengths.
    turns : LengthDist
        Turns per session (>= 1).
    think_s : float
        Mean think time (exponential), seconds (>= 0; 0: the next turn right after the answer).
    max_context : int
        A session ends before a turn whose prompt plus answer would pass this.
    """

    name: str
    description: str
    session_rate: float
    shared_len: int
    first_len: LengthDist
    turn_len: LengthDist
    output_len: LengthDist
    turns: LengthDist
    think_s: float
    max_context: int = 2000

    def __post_init__(self) -> None:
        check_rate(self.session_rate)
        if self.shared_len < 0:
            raise ValueError(f"shared_len must be >= 0, got {self.shared_len}")
        if not (math.isfinite(self.think_s) and self.think_s >= 0):
            raise ValueError(f"think time must be >= 0 s, got {self.think_s}")
        if self.max_context < 2:
            raise ValueError(f"max_context must be >= 2 tokens, got {self.max_context}")

    @property
    def rate(self) -> float:
        """Default session rate (sessions/s): what ``--rates`` sets for a session workload."""
        return self.session_rate

    def with_rate(self, rate: float) -> "SessionSpec":
        """The same spec at another session rate."""
        return replace(self, session_rate=rate)

    def generate(self, *, seed: int = 0, duration_s: Optional[float] = None,
                 num_sessions: Optional[int] = None) -> "SessionTrace":
        """Shorthand for :func:`generate_sessions`."""
        return generate_sessions(self, seed=seed, duration_s=duration_s, num_sessions=num_sessions)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable form."""
        return {"name": self.name, "description": self.description, "session_rate": self.session_rate,
                "shared_len": self.shared_len, "first_len": self.first_len.to_dict(),
                "turn_len": self.turn_len.to_dict(), "output_len": self.output_len.to_dict(),
                "turns": self.turns.to_dict(), "think_s": self.think_s, "max_context": self.max_context}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SessionSpec":
        """Inverse of :meth:`to_dict`."""
        return cls(str(d["name"]), str(d.get("description", "")), float(d["session_rate"]), int(d["shared_len"]),
                   length_dist_from_dict(d["first_len"]), length_dist_from_dict(d["turn_len"]),
                   length_dist_from_dict(d["output_len"]), length_dist_from_dict(d["turns"]), float(d["think_s"]),
                   int(d.get("max_context", 2000)))


def _token_ids(rng: np.random.Generator, n: int, vocab_size: int, first_id: int) -> List[int]:
    if not 0 <= first_id < vocab_size:
        raise ValueError(f"need 0 <= first_id < vocab_size, got {first_id}, {vocab_size}")
    return rng.integers(first_id, vocab_size, size=n).tolist()


@dataclass(frozen=True)
class SessionTrace:
    """Sessions plus the seed of their content and how they were made.

    Attributes
    ----------
    sessions : tuple of Session
        Sorted by start time.
    shared_len : int
        Tokens of the shared prefix.
    seed : int
        Seed of the content (and of the draws).
    info : dict
        JSON-serialisable provenance (workload, spec, rate, ...).
    """

    sessions: Tuple[Session, ...]
    shared_len: int
    seed: int = 0
    info: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        """Turns over all sessions."""
        return sum(len(s.turns) for s in self.sessions)

    def __len__(self) -> int:
        return self.num_requests

    @property
    def duration_s(self) -> float:
        """Start of the last session (s)."""
        return self.sessions[-1].start_s if self.sessions else 0.0

    def shared_prompt(self, *, vocab_size: int = 1000, first_id: int = 100) -> List[int]:
        """Token ids of the prefix every session starts with."""
        return _token_ids(stream_rng(self.seed, STREAM_SHARED_CONTENT, 0), self.shared_len, vocab_size, first_id)

    def new_tokens(self, session: Session, turn: int, *, vocab_size: int = 1000, first_id: int = 100) -> List[int]:
        """Token ids appended by ``turn`` of ``session`` (its message or tool output)."""
        key = session.index * MAX_TURNS + turn
        return _token_ids(stream_rng(self.seed, STREAM_SESSION_CONTENT, key), session.turns[turn].new_len,
                          vocab_size, first_id)

    def first_prompt(self, session: Session, *, vocab_size: int = 1000, first_id: int = 100) -> List[int]:
        """Turn 0's prompt: the shared prefix, then the session's first message."""
        kw = dict(vocab_size=vocab_size, first_id=first_id)
        return self.shared_prompt(**kw) + self.new_tokens(session, 0, **kw)

    def scaled_to_rate(self, rate: float) -> "SessionTrace":
        """Session start times rescaled so that sessions arrive at ``rate`` per second."""
        check_rate(rate)
        old = float(self.info.get("session_rate") or 0)
        if not old > 0:
            raise ValueError("this session trace does not record its session rate; cannot rescale it")
        f = old / rate
        sessions = tuple(replace(s, start_s=s.start_s * f) for s in self.sessions)
        return SessionTrace(sessions, self.shared_len, self.seed, {**self.info, "session_rate": rate})

    def to_dict(self) -> Dict[str, Any]:
        """JSON form (what :func:`load_session_trace` reads)."""
        return {"kind": "sessions", "shared_len": self.shared_len, "seed": self.seed, "info": dict(self.info),
                "sessions": [s.to_dict() for s in self.sessions]}

    def save(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Write :meth:`to_dict` as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f)
            f.write("\n")


def load_session_trace(path: Union[str, "os.PathLike[str]"]) -> SessionTrace:
    """Read a session trace that :meth:`SessionTrace.save` wrote.

    Raises
    ------
    ValueError
        Not a session trace, or a malformed one (the message names the field).
    """
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    if not isinstance(d, dict) or d.get("kind") != "sessions":
        raise ValueError(f"{path}: not a session trace (no \"kind\": \"sessions\")")
    try:
        sessions = tuple(
            Session(int(s["index"]), float(s["start_s"]),
                    tuple(Turn(int(t["new_len"]), int(t["output_len"]), float(t["think_s"]), int(t["prompt_len"]))
                          for t in s["turns"]), int(s["first_index"]))
            for s in d["sessions"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: malformed session: {type(exc).__name__}: {exc}") from None
    return SessionTrace(sessions, int(d["shared_len"]), int(d.get("seed", 0)), dict(d.get("info", {})))


def _draw_one(dist: LengthDist, rng: np.random.Generator) -> int:
    return int(dist.sample(rng, 1)[0])


def generate_sessions(spec: SessionSpec, *, seed: int = 0, duration_s: Optional[float] = None,
                      num_sessions: Optional[int] = None) -> SessionTrace:
    """Generate a deterministic session trace.

    Parameters
    ----------
    spec : SessionSpec
        Shape of the sessions and their arrival rate.
    seed : int
        Seed; the same ``(spec, seed, limits)`` gives the same trace.
    duration_s : float, optional
        Keep the sessions starting in ``[0, duration_s)``.
    num_sessions : int, optional
        Keep at most this many sessions. At least one of the two limits is required.

    Returns
    -------
    SessionTrace
        Sessions sorted by start time, the first at t = 0.

    Raises
    ------
    ValueError
        No limit, a negative limit, or a spec whose first turn cannot fit ``max_context``.
    """
    if duration_s is None and num_sessions is None:
        raise ValueError("give duration_s, num_sessions or both")
    if (duration_s is not None and not duration_s >= 0) or (num_sessions is not None and num_sessions < 0):
        raise ValueError("duration_s and num_sessions must be >= 0")
    sessions: List[Session] = []
    t, first_index, i = 0.0, 0, 0
    while (num_sessions is None or i < num_sessions) and (duration_s is None or t < duration_s):
        rng = stream_rng(seed, STREAM_SESSION_SHAPE, i)
        n_turns = min(max(_draw_one(spec.turns, rng), 1), MAX_TURNS)
        turns: List[Turn] = []
        context = spec.shared_len
        for k in range(n_turns):
            new = _draw_one(spec.first_len if k == 0 else spec.turn_len, rng)
            out = _draw_one(spec.output_len, rng)
            think = 0.0 if k == 0 else float(rng.exponential(spec.think_s)) if spec.think_s > 0 else 0.0
            prompt = context + new
            if prompt + out > spec.max_context:
                break
            turns.append(Turn(new, out, round(think, 6), prompt))
            context = prompt + out
        if not turns:
            raise ValueError(f"session {i}'s first turn ({context} shared + first message + answer tokens) does not "
                             f"fit max_context={spec.max_context}: raise it or shorten the shared prefix")
        sessions.append(Session(i, round(t, 6), tuple(turns), first_index))
        first_index += len(turns)
        t += float(stream_rng(seed, STREAM_SESSION_START, i).exponential(1.0)) / spec.session_rate
        i += 1
    info = {"workload": spec.name, "spec": spec.to_dict(), "seed": seed, "session_rate": spec.session_rate,
            "duration_s": duration_s, "num_sessions": num_sessions}
    return SessionTrace(tuple(sessions), spec.shared_len, seed, info)


SESSION_PRESETS: Dict[str, SessionSpec] = {
    "multi-turn": SessionSpec(
        "multi-turn",
        "chat sessions: 256-token system prompt shared by all, 3-6 turns, user messages of median 48 tokens, "
        "answers of median 32, 2 s think time",
        session_rate=0.25, shared_len=256, first_len=LogNormal(64, 0.5, 16, 256),
        turn_len=LogNormal(48, 0.5, 8, 256), output_len=LogNormal(32, 0.3, 8, 64), turns=Uniform(3, 6),
        think_s=2.0),
    "agentic": SessionSpec(
        "agentic",
        "agents: 768-token shared context (tools, documents), 6-12 short calls each appending a tool output of "
        "median 48 tokens, answers of median 16, 0.2 s tool latency",
        session_rate=0.1, shared_len=768, first_len=LogNormal(64, 0.4, 16, 256),
        turn_len=LogNormal(48, 0.5, 8, 256), output_len=LogNormal(16, 0.3, 4, 32), turns=Uniform(6, 12),
        think_s=0.2),
}

#: ``--workload`` values: ``requests`` (the request presets) and the session workloads.
WORKLOADS = ("requests", *SESSION_PRESETS)


def get_session_preset(name: str) -> SessionSpec:
    """The session workload ``name`` (:data:`SESSION_PRESETS`); ValueError naming the choices."""
    try:
        return SESSION_PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown session workload {name!r}; choose from {', '.join(SESSION_PRESETS)}") from None

