"""A scheduled step laid out for `ModelRunner.execute`: each sequence's new tokens and slice, which rows
get logits (sampling, prompt logprobs), and which input rows a step in flight feeds on the device."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.engine.runner import StepRows
from kvmesh.engine.scheduler import ScheduledBatch
from kvmesh.engine.sequence import Sequence
from kvmesh.kernels.metadata import SeqSlice


@dataclass
class StepPlan:
    """One scheduled step, laid out for `ModelRunner.execute`."""

    sample_seqs: list[Sequence] = field(default_factory=list)
    """The sequences that sample a token (their rows: `rows.sample_rows`)."""
    rows: StepRows = field(default_factory=lambda: StepRows([], []))
    chunks: list[list[int]] = field(default_factory=list)
    """Each sequence's new tokens (a pending one as a placeholder)."""
    slices: list[SeqSlice] = field(default_factory=list)
    fed_rows: list[int] = field(default_factory=list)
    """Flat input rows whose token a step in flight sampled, with their sequences (`fed_seqs`)."""
    fed_seqs: list[Sequence] = field(default_factory=list)


def plan_step(batch: ScheduledBatch) -> StepPlan:
    plan = StepPlan()
    row = 0
    for bi, (seq, n) in enumerate(zip(batch.seqs, batch.num_new)):
        c = seq.num_computed_tokens
        chunk = seq.token_ids[c:c + n]
        if len(chunk) < n:  # its last token is pending: a placeholder the step's feed overwrites
            plan.fed_rows.append(row + len(chunk))
            plan.fed_seqs.append(seq)
            chunk.append(0)
        plan.chunks.append(chunk)
        plan.slices.append(SeqSlice(c, n, seq.block_ids, seq.residual_slot))
        req = seq.request
        if req.prompt_logprobs is not None and seq.index == 0:
            lo = max(c, len(req.prompt_logprobs) - 1)
            hi = min(c + n, seq.num_prompt_tokens - 1)
            if hi > lo:  # positions lo..hi-1 predict prompt tokens lo+1..hi
                plan.rows.prompt_rows.append((row + lo - c, hi - lo, bi))
        if c + n == seq.num_tokens:
            plan.sample_seqs.append(seq)
            plan.rows.sample_rows.append(row + n - 1)
        row += n
    return plan
