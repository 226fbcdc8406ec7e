"""The in-process adapters of issue 24 (mlx-flash, flyto-mlx), graded on fakes of their packages.

The third-party packages are not installed in the default environment, so each
test puts a small fake of the package's module into ``sys.modules`` with the
classes and methods the adapter drives (same names, same call shapes) over
the zoo ``llama`` target's own greedy continuation, and runs the adapter
through ``specparity.grading.engines.grade_mode``: the faithful fake passes every
check it supports, and each planted bug (budget overrun, EOS emitted, a round
that commits tokens its verify did not accept) is caught by its check with
the case named. The live runs are ``conformance/test_subjects.py -m subject``
in ``tox -e subject-<name>``.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from subjects import Mode
from subjects.base import SubjectCase

BUGS = (None, "overrun", "eos", "phantom")


def _continuation(model: Any, prompt: list[int], n: int) -> list[int]:
    from subjects.oracle_drafter import greedy_continuation

    return [int(t) for t in greedy_continuation(model, prompt, n)]


@dataclass
class LayerSkipConfig:  # the fields the adapter sets (mlx_flash_compress.layerskip.LayerSkipConfig)
    num_speculative_tokens: int = 5


def _fake_layerskip(bug: str | None) -> types.ModuleType:
    """``LayerSkipEngine`` with mlx-flash's shape: generate() returns prompt + output, the first
    token from the prefill, then rounds through ``self._verify_and_accept``; ``bug`` plants one defect."""
    import mlx.core as mx

    class LayerSkipEngine:
        def __init__(self, model: Any, tokenizer: Any, config: LayerSkipConfig) -> None:
            self.model, self.tokenizer, self.config = model, tokenizer, config
            self.stats: dict[str, Any] = {}
            self._seq: list[int] = []

        def _verify_and_accept(self, last: int, drafts: list[int], cache: Any) -> tuple[list[int], int]:
            pos = self._pos
            truth = self._seq[pos : pos + len(drafts) + 1]
            k = 0
            while k < len(drafts) and drafts[k] == truth[k]:
                k += 1
            new = list(drafts[:k]) + [truth[k]]
            if bug == "phantom" and k < len(drafts):  # commits a token its verify never accepted
                new = new + [truth[k + 1]]
            self.stats["total_verify_steps"] += 1
            self.stats["total_draft_tokens"] += len(drafts)
            self.stats["acceptance_counts"].append(k)
            return new, k

        def generate(self, prompt_tokens: Any, max_tokens: int = 100, callback: Any = None) -> Any:
            self.stats = {"total_draft_tokens": 0, "total_verify_steps": 0, "acceptance_counts": []}
            prompt = [int(t) for t in prompt_tokens.tolist()]
            K = self.config.num_speculative_tokens
            self._seq = _continuation(self.model, prompt, max_tokens + 2 * K + 4)
            eos = self.tokenizer.eos_token_id
            out = [self._seq[0]]
            self._pos = 1
            while len(out) < max_tokens and out[-1] != eos:
                drafts = list(self._seq[self._pos : self._pos + K])
                drafts[-1] = (drafts[-1] + 1) % 512  # one rejection per round
                new, _ = self._verify_and_accept(out[-1], drafts, None)
                if bug != "overrun":
                    new = new[: max_tokens - len(out)]
                if eos in new and bug != "eos":
                    new = new[: new.index(eos)]
                    out.extend(new)
                    break
                out.extend(new)
                self._pos += len(new)
            if bug != "eos" and out and out[-1] == eos:
                out.pop()
            return mx.array(prompt + out)

    mod = types.ModuleType("mlx_flash_compress.layerskip")
    mod.LayerSkipConfig = LayerSkipConfig  # type: ignore[attr-defined]
    mod.LayerSkipEngine = LayerSkipEngine  # type: ignore[attr-defined]
    return mod


@pytest.fixture
def fake_flash(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from subjects import mlx_flash

    def install(bug: str | None) -> None:
        pkg = types.ModuleType("mlx_flash_compress")
        monkeypatch.setitem(sys.modules, "mlx_flash_compress", pkg)
        monkeypatch.setitem(sys.modules, "mlx_flash_compress.layerskip", _fake_layerskip(bug))

    monkeypatch.setattr(mlx_flash, "version", lambda: "fake")
    yield install


def _grade(name: str, gen: Any, mode_name: str, mode: Mode) -> dict[str, Any]:
    from specparity.grading.engines import grade_mode

    return grade_mode(name, gen, mode_name, mode, dist_n=30)


def test_mlx_flash_adapter_passes_a_faithful_layerskip(fake_flash: Any) -> None:
    from subjects import mlx_flash

    fake_flash(None)
    mode = Mode(targets=("llama",), unsupported=mlx_flash.MODES["layerskip"].unsupported)
    res = _grade("mlx-flash", mlx_flash.generate, "layerskip", mode)
    got = {c: r.status for c, r in res.items()}
    assert got == {"identity": "pass", "mlx_lm": "unsupported", "budget": "pass", "eos": "pass",
                   "stop": "unsupported", "counters": "pass", "distribution": "unsupported"}, \
        {c: r.detail for c, r in res.items()}
    run = mlx_flash.generate(SubjectCase(target="llama", mode="layerskip", max_tokens=9, eos_ids=()))
    assert len(run.stream) == 9 and run.prefill_tokens == 1 and run.rounds
    assert sum(r.committed for r in run.rounds) + 1 == 9
    assert run.counters["rounds"] == len(run.rounds)
    assert run.counters["accepted"] == sum(r.accepted for r in run.rounds)


@pytest.mark.parametrize(("bug", "check", "needle"), [
    ("overrun", "budget", "tokens emitted"),
    ("eos", "eos", "EOS id"),
    ("phantom", "counters", "committed"),
])
def test_mlx_flash_adapter_catches_planted_bugs(fake_flash: Any, bug: str, check: str, needle: str) -> None:
    from subjects import mlx_flash

    fake_flash(bug)
    mode = Mode(targets=("llama",), unsupported=mlx_flash.MODES["layerskip"].unsupported)
    res = _grade("mlx-flash", mlx_flash.generate, "layerskip", mode)
    r = res[check]
    assert r.status == "fail" and needle in r.detail, (bug, r)
    assert r.case and r.case.startswith("layerskip:llama/"), r.case


def test_mlx_flash_rounds_accept_count_from_the_verified_path() -> None:
    from subjects.mlx_flash import _Rounds

    rec = _Rounds()
    rec.add([5, 6, 7], [5, 9], None)  # one accepted, then the correction
    rec.add([5, 6, 7], [5, 6, 7], None)  # all accepted, no bonus
    rec.add([5, 6, 7], [8, 6], None)  # nothing of the verified path, two committed: counters flags it
    rec.add([5, 6, 7], [5, 6, 1], 2)  # the engine's own count wins
    assert [(r.accepted, r.committed) for r in rec.rounds] == [(1, 2), (3, 3), (0, 2), (2, 3)]
    from subjects.base import SubjectRun
    from subjects.checks import counter_problems

    run = SubjectRun(stream=[5, 9, 5, 6, 7, 8, 6, 5, 6, 1], finish_reason=None, hooks=[], rounds=rec.rounds)
    assert counter_problems(run) == ["round 2: committed 2 > accepted 0 + 1"]


# ------------------------------------------------------------------ native-MTP conventions (issue 28)


def _planted_capture(hidden: str, concat: str, mask: bool, rows: str, n: int = 6) -> Any:
    """Head calls as an engine with the given conventions would make them: our native-mtp head
    over the zoo qwen35-native checkpoint, one row per call (the engine-side row bookkeeping)."""
    import numpy as np

    import zoo
    from specparity.grading.native_mtp_conventions import _hidden_rows, _our_parts, _replay
    from subjects.mtp_conventions import Capture, HeadCall

    model, parts, head, _ = _our_parts("qwen35-native")
    prompt = list(zoo.prompt("nat-00").token_ids)
    stream = _continuation(model, prompt, 2 * n + 2)
    seq = prompt + stream
    pre, post = _hidden_rows(model, seq, parts[2])
    src = pre if hidden == "pre-norm" else post
    # rows skipped as after an accepted draft, so head-cache offsets and sequence positions differ
    # by more than a uniform shift (which RoPE could not see)
    qs = [len(prompt) + i + i // 2 for i in range(n)]
    calls = [HeadCall(hidden=np.asarray(src[q])[None], tokens=[seq[q + 1]], offset=0 if rows == "fresh" else i,
                      logits=None, emitted_before=i) for i, q in enumerate(qs)]
    starts = [0] * n if rows == "fresh" else list(range(n)) if rows == "offset" else qs
    logits = _replay(head.blocks[0], parts, calls, starts, concat, mask)
    for c, lg in zip(calls, logits, strict=True):
        c.logits = lg
    cap = Capture(engine="planted", checkpoint="qwen35-native", prompt_ids=prompt, stream=stream)
    cap.calls = calls
    return cap


@pytest.mark.parametrize(("hidden", "concat", "mask", "rows"), [
    ("pre-norm", "e;h", False, "offset"),  # flyto-mlx 0.7.0's conventions
    ("post-norm", "e;h", False, "offset"),  # planted: the other hidden
    ("pre-norm", "h;e", False, "offset"),  # planted: concat order
    ("pre-norm", "e;h", True, "offset"),  # planted: position-0 mask
    ("pre-norm", "e;h", False, "sequence"),  # planted: rows at their sequence positions
    ("post-norm", "e;h", False, "fresh"),  # mtplx 2.12.2's: an empty head cache for every draft
])
def test_mtp_convention_measurement_names_the_planted_convention(hidden: str, concat: str, mask: bool,
                                                                 rows: str) -> None:
    from specparity.grading.native_mtp_conventions import measure
    from subjects.mtp_conventions import verdict

    cap = _planted_capture(hidden, concat, mask, rows)
    row = measure(cap, "qwen35-native")
    v = verdict(row)
    assert v["hidden"].startswith(hidden), v
    assert v["concat"].startswith(concat + " "), v
    assert v["mask_pos0"].startswith(str(mask).lower() + " "), v
    if rows == "fresh":
        assert v["rows/position"].startswith("no head history"), v
        return
    want = "head-cache positions" if rows == "offset" else "sequence positions"
    assert want in v["rows/position"] and f"({len(cap.calls)}/{len(cap.calls)} calls" in v["rows/position"], v
    assert v["identity"].startswith("pass"), v


def test_mtp_convention_verdict_reports_what_it_cannot_tell() -> None:
    import numpy as np

    from subjects.mtp_conventions import best_preset, match_hidden, verdict

    pre = np.arange(12, dtype=np.float32).reshape(3, 4)
    post = pre / 10
    assert match_hidden(pre[2], pre, post)[:2] == ("pre-norm", 2)
    assert match_hidden(post[1] + 1e-6, pre, post)[:2] == ("post-norm", 1)
    b = best_preset(np.zeros(3), {"a": np.zeros(3), "b": np.ones(3), "c": np.zeros(3)})
    assert b["match"] == ["a", "c"] and b["diffs"]["b"] == 1.0
    v = verdict({"hidden": {"match": ["pre-norm", "post-norm"], "token_offset_from_hidden_row": [1]},
                 "first_call": {"match": ["concat=e;h,mask_pos0=false", "concat=h;e,mask_pos0=true"],
                                "offset": 3, "diffs": {}},
                 "replay": {"x": {"calls_within": 2, "calls": 4}, "y": {"calls_within": 4, "calls": 4}},
                 "depth_layers": 2})
    assert v["hidden"].startswith("unmeasured") and v["concat"].startswith("unmeasured")
    assert v["rows/position"] == "y (4/4 calls)" and v["depth"].startswith("2 layers")


@pytest.mark.subject
@pytest.mark.parametrize(("engine", "module"), [("flyto-mlx", "omlx"), ("mtplx", "mtplx"),
                                                ("vllm-mlx", "vllm_mlx")])
def test_mtp_conventions_as_committed(engine: str, module: str) -> None:
    """Live (in the engine's environment): the measured conventions = the committed rows."""
    import importlib.util
    import json
    from pathlib import Path

    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{engine} is not installed here ({module})")
    from specparity.grading.native_mtp_conventions import grade

    committed = json.loads((Path(__file__).resolve().parents[1] / "docs" / "scoreboard"
                            / f"mtp-conventions-{engine}.json").read_text())
    got = grade(engine)
    assert [(r["checkpoint"], r.get("loads"), r.get("conventions")) for r in got["rows"]] == \
        [(r["checkpoint"], r.get("loads"), r.get("conventions")) for r in committed["rows"]]


@pytest.mark.subject
def test_flyto_patches_are_undone_after_each_call() -> None:
    """Live: the references of the grading job run on stock mlx-lm, so the classes flyto-mlx patches
    (mlx-lm's qwen3_5 model classes, GenerationBatch) are the stock ones again after a call."""
    import importlib

    from subjects import availability

    ok, why = availability("flyto-mlx-mtp")
    if not ok:
        pytest.skip(why)
    from subjects import flyto_mlx

    q = importlib.import_module("mlx_lm.models.qwen3_5")
    g = importlib.import_module("mlx_lm.generate")
    classes = (q.TextModel, q.Qwen3_5TextModel, q.GatedDeltaNet, q.DecoderLayer, g.GenerationBatch)
    before = [dict(vars(c)) for c in classes]
    run = flyto_mlx.generate(SubjectCase(target="qwen35", mode="mtp", max_tokens=6))
    assert run.counters["drafted"] > 0, run.counters  # the MTP cycle ran
    for c, b in zip(classes, before, strict=True):
        now = dict(vars(c))
        assert now.keys() == b.keys(), (c.__name__, sorted(now.keys() ^ b.keys()))
        assert all(now[k] is b[k] for k in b), c.__name__
