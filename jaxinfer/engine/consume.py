"""Reading a dispatched step back into rows: the one path for plain and verification steps,
over the replica axis (one replica or several: ``engine.replicas``).

A plain step gives each decode row one token, a verification step its accepted drafts and
then a new token (both ``step.StepOutput``); both are read as tokens [D, R, q]
with the number accepted per row (0 for a plain step), so every row takes its tokens through
``rows.record_token`` the same way, and its pages are registered for prefix caching or
released when it finishes.
"""

from __future__ import annotations

import dataclasses
import enum
import time

import jax
import numpy as np

from jaxinfer.engine import replicas
from jaxinfer.engine.rows import Row, position_logprobs, record_token
from jaxinfer.engine.scheduler import Seq


class StepKind(enum.Enum):
    """What a dispatched step is, which says how it is read and whether the next step may be
    dispatched before it is."""

    PLAIN = "plain"  # one token per decode row
    GUIDED = "guided"  # plain, with a constrained row, whose next mask needs this step's token
    VERIFY = "verify"  # decode rows carry drafts the host made (InFlight.drafted)
    VERIFY_CHAINED = "verify_chained"  # drafts from the unread step before it, on device (engine.drafting)
    CHAIN = "chain"  # up to InFlight.steps decode steps in one call (engine.chaining)

    @property
    def verifies(self) -> bool:
        return self in (StepKind.VERIFY, StepKind.VERIFY_CHAINED)

    @property
    def read_first(self) -> bool:
        """Whether the host reads this step before dispatching the next."""
        return self in (StepKind.GUIDED, StepKind.CHAIN)


@dataclasses.dataclass
class InFlight:
    """A dispatched step the host has not read yet (lists per replica)."""

    decode: list[list[Seq]]  # each replica's decode rows
    segments: list[list]  # (seq, start, n, offset in the prefill row) whose prompt logprobs come back
    out: object  # step.StepOutput or chaining.ChainOutput (device arrays)
    kind: StepKind = StepKind.PLAIN
    drafted: dict | None = None  # VERIFY: slot -> the drafts its row verifies
    steps: int = 1  # CHAIN: the most steps it may run
    exit_on_finish: bool = False  # CHAIN: it ends after the first step in which a row finishes


def consume(eng, fl: InFlight) -> list[Row]:
    """Read a step: each decode row's tokens (a plain step's one, or a verification step's
    accepted drafts and new token) and logprobs, each prompt segment's prompt logprobs."""
    if fl.kind == StepKind.CHAIN:
        return consume_chain(eng, fl)
    live = any(s.slot >= 0 and not s.row.checker.finished for dec in fl.decode for s in dec)
    if not live and not any(fl.segments):
        return []  # e.g. a chained block after its rows ended: nothing to read, no need to wait
    out = replicas.host_readable(fl.out)  # every array [D, ...]
    if any(fl.segments):
        plp = tuple(np.asarray(x) for x in jax.device_get(out.prompt_logprobs))
        for d, segs in enumerate(fl.segments):
            record_prompt_logprobs(segs, tuple(x[d] for x in plp), eng.tokenizer)
    if not live:
        return []
    spec = fl.kind.verifies
    per_query = (lambda x: x) if spec else (lambda x: x[:, :, None])  # [D, R, q, ...]
    toks = per_query(np.asarray(out.tokens))
    accepted = np.asarray(out.accepted) if spec else np.zeros(toks.shape[:2], np.int32)
    lp = None if out.logprobs is None else tuple(per_query(np.asarray(x)) for x in jax.device_get(out.logprobs))
    nxt = np.asarray(out.next_drafts) if spec and out.next_drafts is not None else None
    carried = np.asarray(out.drafted) if spec and out.drafted is not None else None
    now = time.perf_counter()
    done = []
    for d, (decode, sched) in enumerate(zip(fl.decode, eng.scheds)):
        for seq in decode:
            if seq.slot < 0 or seq.row.checker.finished:
                continue  # preempted or aborted (recomputed later, or dropped), or finished already
            r, b = seq.row, seq.slot
            a = int(accepted[d, b])
            if spec:
                eng.drafter.took(seq, fl.drafted, a, None if nxt is None else nxt[d, b],
                                 None if carried is None else int(carried[d, b]))
            else:
                seq.inflight -= 1
            finished = False
            for j in range(a + 1):
                seq.computed = len(seq.tokens)  # the input of query j is in the pages now
                lp_j = None if lp is None else tuple(x[d, :, j] for x in lp)
                if record_token(r, int(toks[d, b, j]), lp_j, b, now, eng.tokenizer):
                    finished = True
                    break
            sched.register_full_pages(seq)
            if finished:
                sched.release(seq)
                eng._seqs.pop(id(r), None)
                done.append(r)
    return done

def consume_chain(eng, fl: InFlight) -> list[Row]:
    """Read a chain of decode steps (one replica): each row's tokens, up to the step in which
    the device stopped it; the host's own stop checks finish it on the same token."""
    (decode,) = fl.decode
    sched, out = eng.sched, fl.out
    steps = int(out.steps)
    sched.stats["decode_steps"] += steps
    eng.chainer.stats["chained_steps"] += steps
    toks = np.asarray(out.tokens)  # [N, R]
    lp = None if out.logprobs is None else tuple(np.asarray(x) for x in jax.device_get(out.logprobs))
    now = time.perf_counter()
    done, running = [], False
    for seq in decode:
        if seq.slot < 0 or seq.row.checker.finished:
            continue  # finished by the step read before this chain, or aborted
        r, b = seq.row, seq.slot
        finished = False
        for j in range(steps):
            tok = int(toks[j, b])
            if tok < 0:
                break  # the device stopped the row
            seq.computed = len(seq.tokens)  # the input of step j is in the pages now
            if record_token(r, tok, None if lp is None else tuple(x[j] for x in lp), b, now, eng.tokenizer):
                finished = True
                break
        sched.register_full_pages(seq)
        if finished:
            sched.release(seq)  # with the pages reserved for steps it did not take
            eng._seqs.pop(id(r), None)
            done.append(r)
        else:
            running = True
    if fl.exit_on_finish and running and steps < fl.steps:
        eng.chainer.stats["chain_cut_arrivals"] += 1
    return done


def record_prompt_logprobs(segments, plp, tokenizer) -> None:
    """Each prompt-logprob segment's query at position p scores prompt token p + 1."""
    chosen, ranks, top_ids, top_lp = plp
    for seq, start, n, at in segments:
        r = seq.row
        for t in range(n):
            target = start + t + 1
            if target >= len(r.prompt_ids) or len(r.prompt_logprobs) != target:
                continue  # past the prompt, or recorded before a preemption
            k = r.params.prompt_logprobs
            r.prompt_logprobs.append(position_logprobs(
                tokenizer, r.prompt_ids[target], float(chosen[at + t]), int(ranks[at + t]),
                top_ids[at + t][:k], top_lp[at + t][:k]))


def prompt_logprob_segments(plan) -> list:
    """(seq, start, n, offset in the prefill row) of each segment whose prompt logprobs come back."""
    out, at = [], 0
    for g in plan.prefill:
        if g.seq.wants_prompt_logprobs:
            out.append((g.seq, g.start, g.n, at))
        at += g.n
    return out
