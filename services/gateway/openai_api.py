"""OpenAI request models: parse and validate JSON bodies into frozen dataclasses, errors in OpenAI's shape.

Bad input always becomes an `ApiError` with a 4xx status naming the offending field (`param`);
nothing here raises anything else on client data. Unknown fields are ignored, as vLLM does; known
ones whose meaning this server cannot honour (tool calls, JSON or guided output) are refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

MAX_N = 128
INT32_MAX = 2**31 - 1  # the wire's integer fields and token ids are int32: larger is the client's 400
MAX_TOP_LOGPROBS = 20
# Every stop string is searched for at every token of the request, in the engine's step loop that
# all its sequences share: 10,000 of 64 characters took 2.4 ms a token (OpenAI allows 4).
MAX_STOP_STRINGS = 256
MAX_STOP_CHARS = 1024  # a stream holds back this much text less one while it may start a stop string
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error the client sees as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad(param: str, message: str, code: Optional[str] = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Sampling:
    """Sampling fields in vLLM's names; `max_tokens` None = up to --max-model-len."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None
    """Top logprobs per generated token (0 = only the sampled token's); None = no logprobs."""
    prompt_logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias in [-100, 100]) pairs, as OpenAI's {"<id>": bias}."""


@dataclass(frozen=True)
class CommonRequest:
    model: str
    n: int
    stream: bool
    include_usage: bool
    cache_salt: str
    sampling: Sampling


@dataclass(frozen=True)
class ChatRequest:
    common: CommonRequest
    messages: tuple[dict, ...]
    """Each {"role", "content": str} (content parts already joined)."""
    add_generation_prompt: bool = True


@dataclass(frozen=True)
class CompletionRequest:
    common: CommonRequest
    prompts: tuple  # of str or tuple[int, ...]
    echo: bool = False


# ---------------------------------------------------------------------------------------------
# field readers: each names its field in the error
# ---------------------------------------------------------------------------------------------
def _num(body: dict, name: str, default: Optional[float], lo: float | None = None,
         hi: float | None = None, lo_open: bool = False) -> Optional[float]:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"{name} must be a number, got {type(v).__name__}")
    v = float(v)
    if v != v:
        raise bad(name, f"{name} must be a number, got NaN")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise bad(name, f"{name} must be {'>' if lo_open else '>='} {lo:g}, got {v:g}")
    if hi is not None and v > hi:
        raise bad(name, f"{name} must be <= {hi:g}, got {v:g}")
    return v


def _int(body: dict, name: str, default: Optional[int], lo: int | None = None,
         hi: int = INT32_MAX) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(name, f"{name} must be an integer, got {type(v).__name__}")
    if lo is not None and v < lo:
        raise bad(name, f"{name} must be >= {lo}, got {v}")
    if v > hi:
        raise bad(name, f"{name} must be <= {hi}, got {v}")
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"{name} must be a boolean, got {type(v).__name__}")
    return v


def _str(body: dict, name: str, default: str) -> str:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad(name, f"{name} must be a string, got {type(v).__name__}")
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop", "stop must be a string or a list of strings")
    if any(s == "" for s in v):
        raise bad("stop", "stop strings must not be empty")
    if len(v) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in v):
        raise bad("stop", f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} "
                          "characters each")
    return tuple(v)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise bad("logit_bias", "logit_bias must be an object mapping token ids to biases")
    out = []
    for k, b in v.items():
        if not (isinstance(k, str) and k.isascii() and k.isdigit() and int(k) <= INT32_MAX):
            raise bad("logit_bias", f"logit_bias keys must be token ids (decimal strings), got {k!r}")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100.0 <= b <= 100.0:
            raise bad("logit_bias", f"logit_bias[{k!r}] must be a number in [-100, 100], got {b!r}")
        out.append((int(k), float(b)))
    return tuple(out)


def _int_list(body: dict, name: str) -> tuple[int, ...]:
    v = body.get(name)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(_token_id(t) for t in v):
        raise bad(name, f"{name} must be a list of token ids (integers in [0, {INT32_MAX}])")
    return tuple(v)


def _token_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT32_MAX


def _common(body: dict, *, max_tokens: Optional[int], logprobs: Optional[int],
            prompt_logprobs: Optional[int], min_max_tokens: int) -> CommonRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "model is required and must be a string")
    _no_guided_output(body)
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options", "stream_options must be an object")
        if not stream:
            raise bad("stream_options", "stream_options is only allowed when stream is true")
        include_usage = _bool(opts, "include_usage", False)
    if max_tokens is not None and max_tokens < min_max_tokens:
        raise bad("max_tokens", f"max_tokens must be >= {min_max_tokens}, got {max_tokens}")
    top_k = _int(body, "top_k", -1, lo=-1)
    min_tokens = _int(body, "min_tokens", 0, lo=0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad("min_tokens", f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})")
    sampling = Sampling(
        temperature=_num(body, "temperature", 1.0, lo=0.0, hi=2.0),
        top_p=_num(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=-1 if top_k == 0 else top_k,
        min_p=_num(body, "min_p", 0.0, lo=0.0, hi=1.0),
        seed=_int(body, "seed", None, lo=-(2**63), hi=2**63 - 1),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=_stop(body),
        stop_token_ids=_int_list(body, "stop_token_ids"),
        ignore_eos=_bool(body, "ignore_eos", False),
        presence_penalty=_num(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=_num(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=_num(body, "repetition_penalty", 1.0, lo=0.0, hi=None, lo_open=True),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        logit_bias=_logit_bias(body),
    )
    return CommonRequest(model=model, n=_int(body, "n", 1, lo=1, hi=MAX_N), stream=stream,
                         include_usage=include_usage, cache_salt=_str(body, "cache_salt", ""),
                         sampling=sampling)


def _content_text(content: Any, i: int) -> str:
    param = f"messages[{i}].content"
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{param}[{j}]", f"{param}[{j}] must be {{\"type\": \"text\", \"text\": str}} "
                                           "(only text content is supported)")
            parts.append(part["text"])
        return "\n".join(parts)
    raise bad(param, f"{param} must be a string or a list of text parts")


GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")  # vLLM's


def _no_guided_output(body: dict) -> None:
    """Constrained output this server cannot produce (no guided decoding) is refused, not ignored:
    response_format other than text, and vLLM's guided_* / structured_outputs."""
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise bad("response_format", f"response_format {kind!r} is not supported by this server (no guided "
                                     "decoding); only {\"type\": \"text\"}")
    for name in GUIDED:
        if body.get(name) is not None:
            raise bad(name, f"{name} is not supported by this server (no guided decoding)")


def _no_tools(body: dict) -> None:
    """Tool calls are refused, not ignored (no tool-call parser); tool_choice "none" says to run without
    the tools."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "none") and (choice != "auto" or tools):
        raise bad("tool_choice", "tool calling is not supported by this server (no tool-call parser); "
                                 "omit tools or send tool_choice: \"none\"")
    if tools and choice is None:
        raise bad("tools", "tool calling is not supported by this server (no tool-call parser); "
                           "omit tools or send tool_choice: \"none\" to run without them")


def parse_chat(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad(None, "request body must be a JSON object")
    _no_tools(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"messages[{i}] must be an object")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"messages[{i}].role", f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                                              f"got {role!r}")
        if role != "assistant" and m.get("content") is None:
            raise bad(f"messages[{i}].content", f"messages[{i}].content is required for role {role}")
        out.append({"role": role, "content": _content_text(m.get("content"), i)})
    max_tokens = _int(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None)
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if top is not None and not want_logprobs and top > 0:
        raise bad("top_logprobs", "top_logprobs needs logprobs: true")
    common = _common(body, max_tokens=max_tokens, logprobs=(top or 0) if want_logprobs else None,
                     prompt_logprobs=None, min_max_tokens=1)
    return ChatRequest(common=common, messages=tuple(out),
                       add_generation_prompt=_bool(body, "add_generation_prompt", True))


def _prompts(v: Any) -> tuple:
    """prompt: str | list[str] | list[int] | list[list[int]] -> tuple of str or tuple[int, ...]."""
    def ids(x: list, param: str) -> tuple[int, ...]:
        if not x or not all(_token_id(t) for t in x):
            raise bad(param, f"{param} must be a non-empty list of token ids (integers in [0, {INT32_MAX}])")
        return tuple(x)

    if isinstance(v, str):
        return (v,)
    if isinstance(v, list) and v:
        if all(isinstance(p, str) for p in v):
            return tuple(v)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in v):
            return (ids(v, "prompt"),)
        if all(isinstance(p, list) for p in v):
            return tuple(ids(p, f"prompt[{i}]") for i, p in enumerate(v))
    raise bad("prompt", "prompt must be a string, a list of strings, a list of token ids, "
                        "or a list of token id lists (non-empty)")


def parse_completion(body: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        raise bad(None, "request body must be a JSON object")
    if "prompt" not in body:
        raise bad("prompt", "prompt is required")
    prompts = _prompts(body["prompt"])
    if any(p == "" for p in prompts):
        raise bad("prompt", "prompt must not be empty")
    echo = _bool(body, "echo", False)
    logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    max_tokens = _int(body, "max_tokens", 16)
    # max_tokens 0 only makes sense to score the prompt (echo), as loglikelihood evaluators do.
    min_max = 0 if echo else 1
    common = _common(body, max_tokens=max_tokens, logprobs=logprobs,
                     prompt_logprobs=logprobs if (echo and logprobs is not None) else None,
                     min_max_tokens=min_max)
    if common.stream and echo and max_tokens == 0:
        raise bad("stream", "stream with echo and max_tokens 0 is not supported; use stream: false")
    return CompletionRequest(common=common, prompts=prompts, echo=echo)


def parse_tokenize(body: Any) -> dict:
    """vLLM /tokenize: {"model"?, "prompt": str} or {"model"?, "messages": [...]}, add_special_tokens."""
    if not isinstance(body, dict):
        raise bad(None, "request body must be a JSON object")
    out: dict = {"model": body.get("model"),
                 "add_special_tokens": _bool(body, "add_special_tokens", True),
                 "add_generation_prompt": _bool(body, "add_generation_prompt", True),
                 "return_token_strs": _bool(body, "return_token_strs", False)}
    if "messages" in body:
        out["chat"] = parse_chat({**body, "model": body.get("model") or "-"}).messages
        out["add_special_tokens"] = _bool(body, "add_special_tokens", False)
    else:
        p = body.get("prompt")
        if not isinstance(p, str):
            raise bad("prompt", "prompt is required and must be a string (or give messages)")
        out["prompt"] = p
    return out


def parse_detokenize(body: Any) -> tuple[int, ...]:
    if not isinstance(body, dict):
        raise bad(None, "request body must be a JSON object")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                               for t in tokens):
        raise bad("tokens", "tokens must be a list of non-negative integers")
    return tuple(tokens)
