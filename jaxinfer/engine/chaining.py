"""Chained decode steps (``num_scheduler_steps``): one device call runs up to N decode steps
while no running row needs the host between tokens.

``chained_decode`` is the device side: ``step.packed_step`` inside one ``lax.while_loop``, with
EOS, stop_token_ids (after min_tokens) and max_tokens checked on device and every step's token
written to a buffer the host reads once. ``Chainer`` is the engine's side: whether the next
step may chain and how far (allocating the pages the chain may write first), dispatching it,
and the counters of ``Engine.stats`` that say how often steps chained and why they did not.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.dispatch import Kernels
from jaxinfer.engine import replicas
from jaxinfer.engine.consume import InFlight, StepKind
from jaxinfer.engine.pages import SCRATCH_PAGE
from jaxinfer.engine.rows import Row
from jaxinfer.engine.scheduler import Seq
from jaxinfer.engine.slots import STOP_ID_WIDTH
from jaxinfer.engine.state import EngineState
from jaxinfer.engine.step import StepInputs, packed_step
from jaxinfer.models.packed import PackedBatch

# why a decode step ran unchained although num_scheduler_steps > 1 (``Engine.stats``:
# chain_refused_<reason>): a prompt chunk in the step (new arrivals, long prompts), a row
# whose finish the host must see token by token (stop strings, grammars, streaming to a
# client, repetition detection, more stop ids than the device checks), or an engine that
# does not chain (speculative decoding, data-parallel replicas, pipeline stages)
CHAIN_REFUSALS = ("prefill", "stop_strings", "guided", "streaming", "repetition_detection", "stop_ids",
                  "speculative", "data_parallel", "pipeline")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ChainOutput:
    """What a chain of decode steps leaves for the host to read once."""

    tokens: jax.Array  # i32[N, R] each chained step's token per decode row; -1 once the row stopped
    logprobs: tuple | None  # (chosen f32[N, R], rank i32[N, R], top ids i32[N, R, n], top logprobs f32[N, R, n])
    steps: jax.Array  # i32[] steps the chain ran


def chained_decode(weights, batch: PackedBatch, state: EngineState, remaining, n, exit_on_finish,
                   lora=None, *, cfg, windowed, num_logprobs: int, kernels: Kernels, steps: int,
                   page_size: int, keys_transposed: bool = True):
    """Up to n (i32[], at most the static ``steps``) decode steps in one ``lax.while_loop``
    -> (ChainOutput, state), the engine's device state donated.

    batch: a pure-decode batch (q = 1, no prefill row) of the chain's first step, whose page
    tables already hold every page the chain may write. Step i runs ``packed_step`` on it with
    each live row's position advanced by i and its token the one the step before sampled.
    A row stops (its later steps write to the scratch page and leave its slot state alone)
    after a token of its stop ids (EOS unless ignore_eos, and stop_token_ids; only once
    min_tokens are generated) or after remaining i32[R] tokens (max_tokens). The loop ends
    after n steps, when every row stopped, or, with exit_on_finish (bool[]: requests are
    waiting for a slot), after the first step in which a row stopped. lora: the LoRA adapters'
    stacks (``packed_step``'s), each row on the adapter ``batch.lora_index`` gives it all along."""
    R = batch.rows
    assert R and batch.q == 1 and batch.prefill_len == 0, (R, batch.q, batch.prefill_len)
    pos0 = batch.positions[:R]
    width, wwidth = batch.table.shape[1], batch.wtable.shape[1]
    rows = jnp.arange(R)
    lp_shapes = [(steps, R), (steps, R), (steps, R, max(num_logprobs, 0)), (steps, R, max(num_logprobs, 0))]
    lp0 = (None if num_logprobs < 0 else
           tuple(jnp.zeros(s, d) for s, d in zip(lp_shapes, (jnp.float32, jnp.int32, jnp.int32, jnp.float32))))

    def cond(c):
        i, done, finished_any = c[0], c[2], c[3]
        return (i < n) & ~jnp.all(done) & ~(exit_on_finish & finished_any)

    def body(c):
        i, st, done, finished_any, taken, toks, lp = c
        live = batch.active & ~done
        pos = pos0 + taken  # a stopped row stays at its last position, writing nowhere
        logical = pos // page_size
        page = batch.table[rows, jnp.minimum(logical, width - 1)]
        wpage = batch.wtable[rows, jnp.clip(logical - batch.wbase[:R], 0, wwidth - 1)]
        step_batch = dataclasses.replace(
            batch, positions=pos, write_page=jnp.where(live, page, SCRATCH_PAGE),
            write_wpage=jnp.where(live, wpage, SCRATCH_PAGE), active=live,
            use_prev=jnp.where(i == 0, batch.use_prev, batch.active))
        gen, mins, stop_ids = st.slots.generated[:R], st.slots.min_tokens[:R], st.slots.stop_ids[:R]
        out, st = packed_step(weights, StepInputs(step_batch, lora=lora), st, cfg=cfg, windowed=windowed,
                              num_logprobs=num_logprobs, prompt_logprobs=-1, kernels=kernels,
                              keys_transposed=keys_transposed)
        tok = out.tokens
        stop = (gen + 1 > mins) & jnp.any(tok[:, None] == stop_ids, axis=1)
        fin = live & (stop | (taken + 1 >= remaining))
        toks = toks.at[i].set(jnp.where(live, tok, -1))
        if lp is not None:
            lp = tuple(b.at[i].set(x) for b, x in zip(lp, out.logprobs))
        taken = taken + live.astype(jnp.int32)
        return (i + 1, st, done | fin, finished_any | jnp.any(fin), taken, toks, lp)

    with jax.named_scope("chain"):
        done0 = ~batch.active | (remaining <= 0)
        init = (jnp.int32(0), state, done0, jnp.bool_(False), jnp.zeros(R, jnp.int32),
                jnp.full((steps, R), -1, jnp.int32), lp0)
        i, state, *_, toks, lp = jax.lax.while_loop(cond, body, init)
    return ChainOutput(toks, lp, i), state


class Chainer:
    """The engine's chaining policy and its counters (``stats``). steps: num_scheduler_steps;
    off: why this engine never chains (a ``CHAIN_REFUSALS`` reason), or None."""

    def __init__(self, eng, steps: int, off: str | None):
        self.eng, self.steps, self.off = eng, steps, off
        self.stats = {"chains": 0, "chained_steps": 0, **{f"chain_refused_{r}": 0 for r in CHAIN_REFUSALS},
                      "chain_cut_pages": 0, "chain_cut_arrivals": 0}
        self._fn = eng._compiles.counted(jax.jit(
            functools.partial(chained_decode, windowed=eng.windowed, steps=steps, page_size=eng.config.block_size,
                              keys_transposed=eng.keys_transposed),
            static_argnames=("cfg", "num_logprobs", "kernels"), donate_argnames=("state",)))

    @property
    def enabled(self) -> bool:
        """Whether this engine chains decode steps at all."""
        return self.steps > 1 and self.off is None

    def window_ahead(self) -> int:
        """Positions past its next query a row may hold window pages for: those of a chain,
        which it keeps when the chain ends early, so every step's window tables are as wide."""
        return self.steps - 1 if self.enabled else 0

    def refuse(self, reason: str | None) -> None:
        if reason is not None and self.steps > 1:
            self.stats[f"chain_refused_{reason}"] += 1

    def needs_host(self, row: Row) -> str | None:
        """Why a row's finish must be seen by the host token by token (None: the device can
        tell): a reason of ``CHAIN_REFUSALS``."""
        p = row.params
        if row.guided is not None:
            return "guided"
        if p.stop:
            return "stop_strings"
        if row.stream:
            return "streaming"
        if p.repetition_detection is not None:
            return "repetition_detection"
        if len(p.stop_token_ids) + (0 if p.ignore_eos else len(self.eng.tokenizer.eos_ids)) > STOP_ID_WIDTH:
            return "stop_ids"
        return None

    @staticmethod
    def left(seq: Seq) -> int:
        """Tokens a row may still sample after those already dispatched (max_tokens)."""
        return max(seq.row.max_new - len(seq.row.token_ids) - seq.inflight, 0)

    def length(self, plans) -> int:
        """Decode steps the next dispatch chains (1: a plain step), counting why it is fewer
        than num_scheduler_steps; allocates the pages (and window pages) of the chain's
        positions when it is more than 1."""
        if self.steps < 2 or not any(p.decode for p in plans):
            return 1
        if self.off is not None:
            self.refuse(self.off)
            return 1
        (plan,) = plans
        reason = "prefill" if plan.prefill else next(filter(None, map(self.needs_host, (s.row for s in plan.decode))),
                                                      None)
        if reason is not None:
            self.refuse(reason)
            return 1
        n = want = min(self.steps, max(self.left(s) for s in plan.decode))
        sched = self.eng.sched
        last = lambda s, n: len(s.tokens) - 1 + s.inflight + min(n, self.left(s)) - 1  # noqa: E731
        while n > 1 and sum(sched.pages_short(s, last(s, n)) for s in plan.decode) > sched.allocator.num_free:
            n -= 1
        if n < want:
            self.stats["chain_cut_pages"] += 1
        if n > 1:
            for s in plan.decode:
                sched.reserve(s, last(s, n))
        return n

    def dispatch(self, plan, n: int, num_lp: int, state):
        """Dispatch a chain of up to n decode steps over the plan's rows (pages reserved) on the
        engine's device state (donated) -> (InFlight, the new state)."""
        eng = self.eng
        batch = eng.build([plan], 1, want_targets=False)
        remaining = np.zeros(batch.rows, np.int32)
        for s in plan.decode:
            remaining[s.slot] = self.left(s)
        waiting = bool(eng.sched.waiting)
        out, state = self.run(state, batch, remaining, n, waiting, num_lp)
        self.stats["chains"] += 1
        return InFlight([plan.decode], [[]], out, StepKind.CHAIN, steps=n, exit_on_finish=waiting), state

    def run(self, state, batch: PackedBatch, remaining: np.ndarray, n: int, exit_on_finish: bool, num_lp: int):
        """Run ``chained_decode`` on the engine's device state (donated) -> (ChainOutput, the new state)."""
        eng, one = self.eng, replicas.only(batch)
        lora = (("lora", len(one.lora_active)),) if one.lora_active is not None else ()
        eng.shapes_run.add((one.rows, one.table.shape[1], 0, 1, num_lp, -1, *lora, ("chain", self.steps)))
        args, kwargs = self.args(state, batch, remaining, n, exit_on_finish, num_lp)
        return self._fn(*args, **kwargs)

    def lower(self, state, batch: PackedBatch, remaining: np.ndarray, n: int, exit_on_finish: bool, num_lp: int):
        """``run``'s executable lowered on the same arguments (warm-up compiles it ahead of
        running it; the run then builds nothing)."""
        args, kwargs = self.args(state, batch, remaining, n, exit_on_finish, num_lp)
        return self._fn.lower(*args, **kwargs)

    def args(self, state, batch: PackedBatch, remaining: np.ndarray, n: int, exit_on_finish: bool, num_lp: int):
        """The (args, kwargs) ``run`` calls ``chained_decode`` with. batch: the engine's, on the
        replica axis (a chain runs the one replica of an engine without data parallelism)."""
        eng = self.eng
        args = (eng.weights, replicas.only(batch), state, remaining, np.int32(n), np.bool_(exit_on_finish))
        return args, dict(**({"lora": eng.lora.stacks} if eng.lora is not None else {}), cfg=eng.cfg,
                          num_logprobs=num_lp, kernels=eng.kernels)
