"""05.ring_forward: the forward of ring attention on ranks, a
:class:`~parlib.course.on_ranks.RankExercise` judged against single-device attention for
cp = 2 and 4 (causal and not, batch and heads above 1), then on two cp groups of 2 inside a
4-rank world, of consecutive ranks and not; with right numbers, on what a ring sends (cp - 1
blocks) and holds (one block at a time, never all of K and V)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from parlib.course.answers import plain_tensor
from parlib.course.on_ranks import (
    Case,
    Diagnosis,
    RankExercise,
    World,
    always,
    rank_error_is_stuck,
)
from parlib.course.registry import register
from parlib.strategies.context_ops import block_attention, merge_partials
from parlib.verify import close

SEED = 11
B, HEADS, SEQ, D = 2, 2, 8, 4  # SEQ splits into 2 and 4 chunks
SETTINGS = ("causal", "full")  # each launch runs both, causal first
P2P_OPS = {"send", "recv", "isend", "irecv", "barrier"}

RING_SOLUTION = '''\
def ring_attention_forward(q, k, v, group, causal):
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    size = q.shape[-2]                       # s / cp positions per rank
    send_to = dist.get_global_rank(group, (rank + 1) % cp)
    recv_from = dist.get_global_rank(group, (rank - 1) % cp)
    q_pos = torch.arange(rank * size, (rank + 1) * size)  # global positions
    kv = torch.stack([k, v])                 # (2, b, a, s/cp, d): one message
    out = lse = None
    for step in range(cp):
        if step < cp - 1:                    # start passing the block on...
            incoming = torch.empty_like(kv)
            works = dist.batch_isend_irecv([      # posted together: NCCL's way
                dist.P2POp(dist.isend, kv, send_to, group=group),
                dist.P2POp(dist.irecv, incoming, recv_from, group=group)])
        source = (rank - step) % cp          # ...while computing with it: whose block it is
        k_pos = torch.arange(source * size, (source + 1) * size)
        part = block_attention(q, kv[0], kv[1], q_pos if causal else None,
                               k_pos if causal else None)
        out, lse = part if out is None else merge_partials(out, lse, *part)
        if step < cp - 1:
            for w in works:
                w.wait()
            kv = incoming
    return out
'''


def _inputs(group_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole sequence's q, k, v (b, a, s, d) of one cp group (each group its own)."""
    gen = torch.Generator().manual_seed(SEED + group_index)
    return tuple(torch.randn(B, HEADS, SEQ, D, generator=gen) for _ in range(3))


def _layout_groups(layout: str, size: int) -> list[list[int]]:
    """The cp groups of a launch: the whole world, consecutive pairs ({0, 1}, {2, 3}) or
    pairs of every other rank ({0, 2}, {1, 3})."""
    if layout == "pairs":
        return [[r, r + 1] for r in range(0, size, 2)]
    if layout == "strided":
        return [list(range(first, size, 2)) for first in range(2)]
    return [list(range(size))]


def _groups(world: World) -> list[list[int]]:
    return _layout_groups(world.args[0] if world.args else "world", world.size)


class _KeysHeld(TorchFunctionMode):
    """While active, the most key positions any torch call returned in one tensor: dim -2
    of keys or values (b, heads, keys, head_dim), the last dim of scores (b, heads, s/cp,
    keys). Above s/cp, the rank held more of K and V than the one block a ring holds."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.most = size, 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 4:
                keys = t.shape[-2] if t.shape[-1] == D else 0
                scores = t.shape[-1] if t.shape[-2] == self.size and t.shape[-1] != D else 0
                self.most = max(self.most, keys, scores)
        return out


def _held_and_sent(fn: Callable, args: tuple, size: int) -> tuple[Any, int, int, list[str]]:
    """The learner's output, the most key positions held at once, the bytes sent and the
    process-group calls, of one forward."""
    from parlib.measure import CommLog

    with CommLog(deep=True) as log, _KeysHeld(size) as held:
        got = fn(*args)
    # sends alone, or the send halves of batches (batch_isend_irecv, NCCL's way)
    sent = sum(r.predicted_sent or 0 for r in log.records
               if r.op in ("send", "batch_isend_irecv"))
    return got, held.most, sent, list(log.pg_calls)


def _ring_rank(fn: Callable, layout: str = "world") -> dict[str, Any]:
    """On every rank: the learner's forward on this rank's chunk of its group's sequence,
    causal and not, with the collectives it used, the bytes it sent and the most key
    positions it held at once."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    members = _layout_groups(layout, world)
    groups = [dist.new_group(m) if layout != "world" else dist.group.WORLD
              for m in members]  # every rank makes every group, in the same order
    index = next(i for i, m in enumerate(members) if rank in m)
    group = groups[index]
    r, cp = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = _inputs(index)
    size = SEQ // cp
    mine = slice(r * size, (r + 1) * size)
    report: dict[str, Any] = {"ops": set(), "cp": cp, "size": size,
                              "block_bytes": 2 * k[..., mine, :].nbytes}
    for setting in SETTINGS:
        args = (q[..., mine, :].clone(), k[..., mine, :].clone(), v[..., mine, :].clone(),
                group, setting == "causal")
        got, held, sent, calls = _held_and_sent(fn, args, size)
        report["ops"] |= set(calls)
        report[f"held_{setting}"], report[f"sent_{setting}"] = held, sent
        plain = plain_tensor(got)
        report[setting] = plain.detach().clone() if plain is not None else type(got).__name__
    report["ops"] = sorted(report["ops"])
    return report


def _simulate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, rank: int, *,
              held: Callable[[int, int], int], labelled: Callable[[int, int], int],
              steps: int, local: bool = False) -> torch.Tensor:
    """What a ring forward computes on ``rank`` when at step j it holds block held(r, j)
    but masks it as the positions of block labelled(r, j) (local: by positions within the
    chunk), over ``steps`` steps: the candidates of the common mistakes."""
    size = SEQ // cp

    def chunk(t: torch.Tensor, c: int) -> torch.Tensor:
        return t[..., c * size:(c + 1) * size, :]

    def pos(c: int) -> torch.Tensor:
        return torch.arange(size) if local else torch.arange(c * size, (c + 1) * size)

    out = lse = None
    for j in range(steps):
        part = block_attention(chunk(q, rank), chunk(k, held(rank, j)), chunk(v, held(rank, j)),
                               pos(rank), pos(labelled(rank, j)))
        out, lse = part if out is None else merge_partials(out, lse, *part)
    return out


def _reference(world: World) -> list[dict[str, Any]]:
    """Per global rank: single-device attention's rows of its chunk, causal and not, and the
    candidates of the mistakes (causal)."""
    per_rank: list[dict[str, Any]] = [{} for _ in range(world.size)]
    for index, members in enumerate(_groups(world)):
        q, k, v = _inputs(index)
        cp = len(members)
        size = SEQ // cp
        for r in range(cp):
            rows = slice(r * size, (r + 1) * size)
            back = {"held": lambda r, j: (r - j) % cp, "labelled": lambda r, j: (r - j) % cp}
            per_rank[members[r]] = {
                "causal": F.scaled_dot_product_attention(q, k, v, is_causal=True)[..., rows, :],
                "full": F.scaled_dot_product_attention(q, k, v)[..., rows, :],
                "reversed": _simulate(q, k, v, cp, r, held=lambda r, j: (r + j) % cp,
                                      labelled=back["labelled"], steps=cp),
                "wrong_source": _simulate(q, k, v, cp, r, held=back["held"],
                                          labelled=lambda r, j: (r - j - 1) % cp, steps=cp),
                "local": _simulate(q, k, v, cp, r, **back, steps=cp, local=True),
                "no_last": _simulate(q, k, v, cp, r, **back, steps=cp - 1) if cp > 1 else None,
            }
    return per_rank


def _problem(got: Any, want: torch.Tensor) -> str | None:
    if not isinstance(got, torch.Tensor):
        return "type"
    if got.shape != want.shape:
        return "shape"
    return None if close(got, want) else "values"


def _first_wrong(case: Case) -> tuple[int, str] | None:
    for setting in SETTINGS:
        for rank, res in enumerate(case.results):
            if _problem(res[setting], case.reference[rank][setting]):
                return rank, setting
    return None


def _got(c: Case) -> Any:
    return c.report[c.step]


def _ref(c: Case) -> dict[str, Any]:
    return c.reference[c.rank]


def _is(key: str) -> Callable[[Case], bool]:
    """The causal output equals the candidate ``key`` of a mistake."""
    def when(c: Case) -> bool:
        want = _ref(c)[key]
        return (c.step == "causal" and want is not None
                and _problem(_got(c), _ref(c)["causal"]) == "values" and close(_got(c), want))
    return when


def _collectives(c: Case) -> list[str]:
    return sorted({op for res in c.results for op in res["ops"]} - P2P_OPS)


def _setting(c: Case) -> str:
    return "causal" if c.step == "causal" else "without a mask"


def _most(c: Case, key: str) -> tuple[int, int]:
    """(rank, value): the rank with the largest ``key_causal`` or ``key_full``."""
    values = [max(res[f"{key}_{s}"] for s in SETTINGS) for res in c.results]
    rank = max(range(len(values)), key=values.__getitem__)
    return rank, values[rank]


def _holds_all(c: Case) -> bool:
    rank, held = _most(c, "held")
    return held > c.results[rank]["size"]


def _holds_all_hint(c: Case) -> str:
    rank, held = _most(c, "held")
    size = c.results[rank]["size"]
    return (f"the output is right, but rank {rank} held the keys of {held} positions at once "
            f"(a ring holds one block, s/cp = {size}): your function keeps the blocks and "
            "attends over all of K and V at once. That is the all-gather variant, with its "
            "memory (every rank holds the whole sequence's K and V), whatever carried the "
            "blocks. Attend to each block as it arrives, fold the partial result into the "
            "running one (merge_partials), and keep only the block you hold")


def _sends_too_much(c: Case) -> bool:
    rank, sent = _most(c, "sent")
    res = c.results[rank]
    return sent > (res["cp"] - 1) * res["block_bytes"]


def _sends_too_much_hint(c: Case) -> str:
    rank, sent = _most(c, "sent")
    res = c.results[rank]
    return (f"the output is right, but rank {rank} sent {sent / res['block_bytes']:g} blocks "
            f"of K and V in one forward, not cp - 1 = {res['cp'] - 1}: its own block is "
            "there at step 0 and the last one arrives after cp - 1 transfers, so the last "
            "step sends nothing (05.ring_bytes counts cp - 1 per pass). A transfer more "
            f"costs {res['block_bytes']} bytes per rank and layer here for a block nobody "
            "uses")


def _code_names(code: Any) -> set[str]:
    """The names a function's code uses, its nested functions' included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def _named_rank_error(err: Any, world: World, fn: Callable) -> tuple[str, str] | None:
    """A rank's failure this question can name: a blocking send that waits for a receive
    its peer never posts, a neighbour outside the cp group, a hang only on groups of
    ranks that are not consecutive."""
    text = f"{err} {err.remote_traceback or ''}"
    code = getattr(fn, "__code__", None)
    if rank_error_is_stuck(err) and code is not None and "send" in _code_names(code):
        return ("blocking_send", f"the ranks got stuck ({world.size} ranks) and your function "
                "calls dist.send, which blocks until the peer receives: when every rank "
                "sends first, each waits in send for a neighbour that is itself waiting in "
                "send (gloo and NCCL alike). Start the send and the receive together, "
                "dist.isend and dist.irecv (or dist.batch_isend_irecv), compute, then wait() "
                "on both")
    if "not part of group" in text or "not part of the group" in text:
        return ("neighbour_outside_group", f"{_where_world(world)}: a rank named a neighbour "
                "outside its cp group. Neighbours are positions in the group, (r + 1) mod cp "
                "and (r - 1) mod cp, turned into global ranks by dist.get_global_rank(group, "
                "position): a group's ranks need not be consecutive, so adding to your own "
                "global rank lands outside it")
    if rank_error_is_stuck(err) and world.args == ("strided",):
        return ("not_consecutive", f"the ranks' sends and receives did not match "
                f"{_where_world(world)}, though they did on groups of consecutive ranks: "
                "take your place in the group from the group, dist.get_rank(group) (a "
                "global rank mod cp is it only when the group's ranks are consecutive), and "
                "name each neighbour by dist.get_global_rank(group, (r + 1) % cp)")
    return None


def _where_world(world: World) -> str:
    groups = " and ".join("{" + ", ".join(map(str, m)) + "}" for m in _groups(world))
    return f"on the cp groups {groups} of {world.size} ranks"


DIAGNOSES = (
    Diagnosis("ignores_group", lambda c: bool(c.setting.args),
              lambda c: f"rank {c.rank}'s result is wrong here, though right when the group is "
              "the whole world: take the rank and cp from the group "
              "(dist.get_rank(group), dist.get_world_size(group)), name the neighbours by "
              "their global ranks (dist.get_global_rank(group, r)) and pass group= to every "
              "send and receive"),
    Diagnosis("not_a_tensor", lambda c: _problem(_got(c), _ref(c)[c.step]) == "type",
              lambda c: f"rank {c.rank} returned {_got(c)}: return the attention output, a "
              "tensor (b, heads, s/cp, head_dim)"),
    Diagnosis("wrong_shape", lambda c: _problem(_got(c), _ref(c)[c.step]) == "shape",
              lambda c: f"rank {c.rank} returned shape {tuple(_got(c).shape)}, expected "
              f"{tuple(_ref(c)[c.step].shape)}: the output of this rank's queries only"),
    Diagnosis("wrong_neighbour", _is("reversed"),
              lambda c: f"rank {c.rank}'s causal output is what the blocks give when they "
              "travel the other way round the ring: at step j a rank holds the block of rank "
              "(r - j) mod cp only if it sends to (r + 1) mod cp and receives from "
              "(r - 1) mod cp"),
    Diagnosis("wrong_source", _is("wrong_source"),
              lambda c: f"rank {c.rank} masks each block with the positions of the next "
              "rank's chunk, the block still on its way: the block computed at step j (from "
              "0) came from rank (r - j) mod cp, so its keys are the positions from "
              "((r - j) mod cp) x s/cp on"),
    Diagnosis("mask_local_positions", _is("local"),
              lambda c: f"rank {c.rank} applies the causal mask by positions within the chunk "
              "(0 .. s/cp - 1) for every block: the mask compares global positions, so a "
              "block from an earlier rank is fully visible and one from a later rank fully "
              "masked"),
    Diagnosis("no_mask", lambda c: c.step == "causal" and isinstance(_got(c), torch.Tensor)
              and close(_got(c), _ref(c)["full"]),
              lambda c: f"rank {c.rank}'s causal output is attention without a mask: with "
              "causal=True, key j is visible to query i only when j <= i (global positions)"),
    Diagnosis("always_masked", lambda c: c.step == "full" and isinstance(_got(c), torch.Tensor)
              and close(_got(c), _ref(c)["causal"]),
              lambda c: f"rank {c.rank}'s output with causal=False is causal attention: "
              "apply the mask only when causal is True (block_attention's q_pos and k_pos "
              "None: every key visible)"),
    Diagnosis("last_block_missing", _is("no_last"),
              lambda c: f"rank {c.rank} leaves out the last block it receives: cp blocks in "
              "all (its own and cp - 1 received), the last one arriving after cp - 1 "
              "steps"),
    Diagnosis("wrong_output", always,
              lambda c: f"rank {c.rank}'s output ({_setting(c)}) differs from single-device "
              f"attention (max |difference| "
              f"{(_got(c) - _ref(c)[c.step]).abs().max().item():.3g})"),
    Diagnosis("collective_used", lambda c: bool(_collectives(c)),
              lambda c: f"the output is right, but your function called "
              f"{_collectives(c)[0]}: ring attention passes the K/V blocks with send and "
              "recv (isend/irecv) only, so no rank ever holds all of K and V", right=True),
    Diagnosis("all_gather_variant", _holds_all, _holds_all_hint, right=True),
    Diagnosis("extra_transfers", _sends_too_much, _sends_too_much_hint, right=True),
)

QUESTION = register(RankExercise(
    "05.ring_forward",
    probe=_ring_rank,
    worlds=[World(2), World(4),
            World(4, ("pairs",), "on the cp groups {{0, 1}} and {{2, 3}} of 4 ranks"),
            World(4, ("strided",), "on the cp groups {{0, 2}} and {{1, 3}} of 4 ranks")],
    reference=_reference,
    first_wrong=_first_wrong,
    diagnoses=DIAGNOSES,
    solution=RING_SOLUTION,
    backend="gloo",
    timeout=20.0,  # the ring itself takes well under a second: a hang is named soon
    rank_error=_named_rank_error,
    rank_error_names=("blocking_send", "neighbour_outside_group", "not_consecutive"),
    hang_hint="the ranks' sends and receives did not match{t} ({where}): every rank sends "
              "its block to the next rank and receives from the previous one, the same "
              "number of times (cp - 1), with tensors of the same size",
    timeout_hint="a send with no matching receive blocks forever: every rank sends to "
                 "(r + 1) mod cp and receives from (r - 1) mod cp, cp - 1 times",
    prompt="""
        Write ring_attention_forward(q, k, v, group, causal) -> Tensor. q, k, v
        (b, heads, s/cp, head_dim) are this rank's chunk r of the sequence (contiguous:
        positions r x s/cp to (r + 1) x s/cp - 1) in the cp ranks of `group`. Return the
        attention of this rank's queries over the whole sequence, causal (key j visible to
        query i when j <= i) or not. Pass the K/V blocks round the ring, a send to the next
        rank and a receive from the previous one posted together (dist.batch_isend_irecv),
        and merge each block's
        partial result with parlib's block_attention and merge_partials (or your merge from
        question 05.merge_partials). Checked on 2 and 4 ranks (batch 2, 2 heads), causal
        and not, against single-device attention, then on two cp groups of 2 inside a
        4-rank world, {0, 1} and {2, 3}, then {0, 2} and {1, 3} (rtol 1e-4); a right output
        must also come from a ring: cp - 1 transfers, one block of K and V held at a time.
    """,
    explanation="""
        Each rank keeps its queries. Its K and V travel round the ring: at step j (from 0)
        a rank holds the block of rank (r - j) mod cp, because every rank sends what it
        holds to (r + 1) mod cp and receives from (r - 1) mod cp. After cp - 1 transfers it
        has seen all cp blocks; the last one arrives after the last send, so the loop runs
        cp times and sends only cp - 1 times.

        Start the transfer of the held block (its send and the receive of the next, one
        dist.batch_isend_irecv), compute with it while it travels, then wait: the transfer
        hides behind the block's attention. Posting the pair as one batch is what NCCL
        needs: at cp = 2 both go to the same peer, and NCCL can deadlock on a separate send
        and receive to one peer (gloo also accepts dist.isend and dist.irecv posted apart).

        The causal mask compares global positions: the held block's keys are positions
        source x s/cp onwards, source = (r - j) mod cp. block_attention gives each block's
        (out, lse), fully masked rows as (0, -inf); merge_partials folds it into the running
        result. Peers are named by global rank (dist.get_global_rank), and group= goes to
        every call, so the function works on any cp group.
    """,
    after="""
        Each rank sends cp - 1 K/V blocks of 2 x b x s/cp x kv_dim elements per layer in
        forward: parlib.cost's ring_attention_sent_bytes_per_layer(..., passes=("forward",)).
    """,
))

__all__ = ["RING_SOLUTION"]
