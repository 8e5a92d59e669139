"""Per-request sampling settings, named and defaulted as vLLM's `SamplingParams` (no torch)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class SamplingParams:
    n: int = 1
    """Completions per prompt; they share the prompt's KV blocks."""
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """0 or -1 = off."""
    min_p: float = 0.0
    seed: Optional[int] = None
    """Per-request generator seed: the same seed gives the same tokens."""
    max_tokens: Optional[int] = 16
    """None = up to --max-model-len."""
    min_tokens: int = 0
    stop: Optional[list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None
    """Top log-probabilities to return per generated token (0 = only the sampled one)."""
    prompt_logprobs: Optional[int] = None
    """Top log-probabilities per prompt token; forces recomputing the whole prompt."""
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: Optional[dict[int, float]] = None
    """Added to the logits of these token ids before penalties and sampling, each in [-100, 100]."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        def bad(name: str, rule: str) -> None:
            raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", ">= 1")
        if not self.temperature >= 0.0:
            bad("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "-1, 0 (off) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "an int or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", ">= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "a list of non-empty strings")
        if self.stop_token_ids is not None and not all(
                isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of non-negative ints")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", "> 0")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", "in [0, 20]")
        if self.prompt_logprobs is not None and (
                not isinstance(self.prompt_logprobs, int) or not 0 <= self.prompt_logprobs <= 20):
            bad("prompt_logprobs", "in [0, 20]")
        if self.logit_bias is not None and not (isinstance(self.logit_bias, dict) and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 and isinstance(b, (int, float))
                and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items())):
            bad("logit_bias", "a map of token ids >= 0 to biases in [-100, 100]")

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
