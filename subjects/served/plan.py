"""The plan: each check's own prompts (first words distinct across checks), from the declarations'
``needs``, and the parameters the checks ask with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from subjects.served.declare import CHECKS
from subjects.served.reference import Reference, splits_utf8, token_at

BUDGETS = (1, 2, 5, 9, 17, 33)
MAX_BUDGET = max(BUDGETS)
TOP_K = 5
CONCURRENT = 4
SEED = 1234  # the seeded requests' seed (temperature SEED_TEMPERATURE)
SEED_TEMPERATURE = 1.0
SEED_BURSTS = 3  # the seeded request sent with its batch-mates this many times
CACHE_ROUNDS = 8  # the cache check's warm requests, each kind this many times: a 1-in-10 bug shows (1 - 0.9^24)
TOOL = "lookup"  # the one function the tool-call requests offer
REJECT_MAX_ACCEPT = 0.1  # the all-reject arm: more than this share of drafts accepted is not "all rejected"


@dataclass
class PromptInfo:
    text: str
    ids: tuple[int, ...]  # the text's encoding (a token-id prompt sends these)
    out: list[int]  # plain greedy output of the completions prompt built from ``text``, up to MAX_BUDGET, no EOS
    eos: bool  # plain decode ends on EOS within MAX_BUDGET




@dataclass
class Plan:
    """Each check's own prompts (first words distinct across all of them, so a prompt cache
    cannot carry one check's state into another), and the warm-up prompt."""

    by_check: dict[str, tuple[list[PromptInfo], list[PromptInfo]]]
    warmup: str
    notes: list[str] = field(default_factory=list)
    warmup_first: int | None = None  # plain decode's first token for the warm-up prompt (None: EOS)
    reencode: PromptInfo | None = None  # output whose text re-encodes to another token count

    def no_eos(self, check: str) -> list[PromptInfo]:
        return self.by_check.get(check, ([], []))[0]

    def eos(self, check: str) -> list[PromptInfo]:
        return self.by_check.get(check, ([], []))[1]


def make_plan(ref: Reference, checks: Sequence[str] = ()) -> Plan:
    """Classify ``ref.prompts`` by plain decode and give each check its own (always in
    declaration order, ``declare.CHECKS``, so ``--check X`` alone sends the same requests as a full
    run; ``checks`` is accepted for the callers' sake and changes nothing)."""
    infos: list[PromptInfo] = []
    firsts: set[str] = set()
    for p in ref.prompts:
        first = p.split()[0] if p.split() else p
        if first in firsts:
            continue  # a shared first word would let a prompt cache carry state across checks
        firsts.add(first)
        ids = tuple(ref.encode(p))
        out, hit = ref.greedy(tuple(ref.completion_ids(p)), MAX_BUDGET)  # what the server completes
        infos.append(PromptInfo(p, ids, list(out), bool(hit and len(out) >= 2)))
    if len(infos) < 2:
        raise ValueError("fewer than 2 usable prompts (each needs its own first word)")
    warm = infos.pop()
    no_eos = [i for i in infos if not i.eos and len(i.out) >= MAX_BUDGET]
    eos = [i for i in infos if i.eos]
    notes: list[str] = []
    # stream: prefer outputs that split a multi-byte character across tokens
    split = [i for i in no_eos if splits_utf8(ref, i.out[:24])]
    reenc = next((i for i in no_eos if len(ref.encode(ref.decode(i.out[:17]))) != len(ref.encode("")) + 17), None)
    pools = {"no_eos": list(no_eos), "eos": list(eos)}
    reused = {"no_eos": False, "eos": False}

    def take(kind: str, n: int, prefer: Sequence[PromptInfo] = ()) -> list[PromptInfo]:
        got: list[PromptInfo] = []
        for i in prefer:
            if i in pools[kind] and len(got) < n:
                pools[kind].remove(i)
                got.append(i)
        while len(got) < n and pools[kind]:
            got.append(pools[kind].pop(0))
        src = no_eos if kind == "no_eos" else eos
        k = 0
        while len(got) < n and src:
            got.append(src[k % len(src)])  # the pool ran out: shared with another check
            reused[kind] = True
            k += 1
        return got

    by_check: dict[str, tuple[list[PromptInfo], list[PromptInfo]]] = {}
    reenc_taken = take("no_eos", 1, [reenc]) if reenc is not None else []
    for c, decl in CHECKS.items():
        if decl.needs == (0, 0):
            continue
        n, e = decl.needs
        by_check[c] = (take("no_eos", n, split if c == "stream" else ()), take("eos", e))
    for kind, r in reused.items():
        if r:
            notes.append(f"too few {'EOS-ending' if kind == 'eos' else 'long'} prompts: some are shared by "
                         "two checks (a prompt cache can carry state between them)")
    if not eos:
        notes.append(f"no prompt reaches EOS within {MAX_BUDGET} tokens of plain decode")
    return Plan(by_check, warm.text, notes, reencode=reenc_taken[0] if reenc_taken else None,
                warmup_first=warm.out[0] if warm.out else None)

def stop_cases(ref: Reference, p: PromptInfo) -> list[tuple[str, str, int]]:
    """(stop string, kind, index of the token that completes it) in ``p``'s plain output."""
    ids = p.out
    text = ref.decode(ids)
    out: list[tuple[str, str, int]] = []
    for j in range(3, len(ids)):
        piece = ref.decode(ids[j : j + 1]).strip()
        if piece and piece not in ref.decode(ids[:j]) and "\ufffd" not in piece:
            out.append((piece, "a whole token", j))
            break
    for j in range(3, len(ids)):
        piece = ref.decode(ids[j : j + 1]).strip()
        if len(piece) >= 2 and "\ufffd" not in piece:
            inner = piece[1:] if len(piece) == 2 else piece[1:-1]
            first = text.find(inner)
            if first >= 0 and first > len(ref.decode(ids[:3])):
                k = token_at(ref, ids, first + len(inner) - 1)
                if ref.decode(ids[k : k + 1]).strip() != inner:
                    out.append((inner, "inside a token", k))
                    break
    return out

