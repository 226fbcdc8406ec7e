"""The batched throughput benchmark (``specparity.measure.bench_batched``): shape of its figures, never a timing.

It prints rows per second of each arm and the paired speedup with its interval; it refuses a
figure when a row's output differs between the batched and the serial arm (planted here).
"""

from __future__ import annotations

from typing import Any

import pytest

from specparity.measure import bench_batched as bb


def test_bench_reports_both_arms_and_a_paired_interval(capsys: pytest.CaptureFixture[str]) -> None:
    assert bb.main(["--drafter", "ngram", "--rows", "1,2", "--repeats", "2", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "| B | tokens | batched rows/s | serial rows/s |" in out, out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2, out
    res = bb.bench_batched(drafter="ngram", rows=(2,), repeats=2, max_tokens=4)
    r = res["table"][0]
    assert r["identical_outputs"] and len(r["batched_wall_s"]) == len(r["serial_wall_s"]) == 2
    assert r["speedup"]["low"] <= r["speedup"]["median"] <= r["speedup"]["high"]


def test_bench_refuses_rows_that_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.batched as eb

    real = eb.batch_generate

    def wrong(model: Any, reqs: Any, **kw: Any) -> Any:
        res = real(model, reqs, **kw)
        res.rows["r1"].output_ids[-1] += 1
        return res

    monkeypatch.setattr(eb, "batch_generate", wrong)
    with pytest.raises(RuntimeError, match="row r1 differs batched vs serial"):
        bb.bench_batched(drafter="ngram", rows=(2,), repeats=1, max_tokens=4)


def _exit(argv: list[str]) -> int:
    """``main``'s status: a parse-time refusal raises SystemExit(2) (argparse), the rest return."""
    try:
        return bb.main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def test_bad_arguments_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit(["--rows", "0", "--drafter", "ngram"]) == 2
    assert capsys.readouterr().err.startswith("bench_batched: error: ")


@pytest.mark.parametrize(("argv", "flag"), [
    (["--gamma", "5000"], "--gamma"),
    (["--seed", "-1"], "--seed"),
    (["--rows", "1,,2"], "--rows"),
    (["--rows", "100"], "--rows"),
    (["--rows", "0"], "--rows"),
    (["--repeats", "0"], "--repeats"),
    (["--max-tokens", "0"], "--max-tokens"),
])
def test_bad_values_name_their_flag_in_one_line(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bb, "bench_batched", lambda *a, **k: pytest.fail("measured despite a bad value"))
    assert _exit(["--drafter", "ngram", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"bench_batched: error: argument {flag}"), err


def test_rows_beyond_the_prompts_name_rows() -> None:
    import zoo

    n = len(zoo.prompts())
    if n >= bb.MAX_ROWS:
        pytest.skip("the zoo has as many prompts as the row limit")
    with pytest.raises(ValueError, match=r"^--rows"):
        bb.bench_batched(drafter="ngram", rows=(n + 1,), repeats=1, max_tokens=2)


def test_json_destination_is_checked_before_measuring(tmp_path: Any, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bb, "bench_batched", lambda *a, **k: pytest.fail("measured before refusing --json"))
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": true}')
    afile = tmp_path / "afile"
    afile.write_text("keep")
    for dest, says in ((afile / "out.json", "afile"), (tmp_path, "directory"), (foreign, "not a bench-batched JSON")):
        assert _exit(["--drafter", "ngram", "--json", str(dest)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("bench_batched: error: argument --json") and says in err, err
    assert foreign.read_text() == '{"mine": true}' and afile.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "notes.json"]


def test_json_a_users_file_appearing_before_the_lock_is_refused(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The file is checked again when claimed (it may appear after parsing): refused, untouched, no work."""
    import specparity.cli.args as sa

    monkeypatch.setattr(bb, "bench_batched", lambda *a, **k: pytest.fail("measured before refusing --json"))
    dest = tmp_path / "late.json"
    real = sa.output_file

    def late(ours: Any, what: str) -> Any:
        parse = real(ours, what)

        def wrapped(text: str) -> Any:
            got = parse(text)
            dest.write_text("a user's own file\n")  # appears between the parse and the claim
            return got
        return wrapped

    monkeypatch.setattr(sa, "output_file", late)
    assert _exit(["--drafter", "ngram", "--json", str(dest)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("bench_batched: error: ") and "late.json" in err, err
    assert dest.read_text() == "a user's own file\n"


def test_json_is_written_atomically_and_may_replace_its_own(tmp_path: Any, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import os

    out = tmp_path / "b.json"
    assert bb.main(["--drafter", "ngram", "--rows", "1", "--repeats", "1", "--max-tokens", "3", "--json",
                    str(out)]) == 0
    first = json.loads(out.read_text())
    assert first["kind"] == "bench-batched" and first["table"][0]["row_status"] == {"r0": "identical"}
    # its own file is replaced without --overwrite; a full disk leaves the old file whole, no temp behind
    real = os.replace

    def full(*_a: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    assert bb.main(["--drafter", "ngram", "--rows", "1", "--repeats", "1", "--max-tokens", "3", "--json",
                    str(out)]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert json.loads(out.read_text()) == first and sorted(p.name for p in tmp_path.iterdir()) == ["b.json"]
    monkeypatch.setattr(os, "replace", real)
    # an empty file is nobody's content: replaced
    empty = tmp_path / "e.json"
    empty.write_text("")
    assert bb.main(["--drafter", "ngram", "--rows", "1", "--repeats", "1", "--max-tokens", "3", "--json",
                    str(empty)]) == 0
    assert json.loads(empty.read_text())["kind"] == "bench-batched"


def test_a_logic_row_refuses_in_one_line_exit_1(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    import engine.batched as eb

    real = eb.batch_generate

    def wrong(model: Any, reqs: Any, **kw: Any) -> Any:
        res = real(model, reqs, **kw)
        rec = next(r for r in res.rows["r1"].records if r["type"] == "round" and r["emitted"])
        rec["emitted"] = [t + 1 for t in rec["emitted"]]
        res.rows["r1"].output_ids[0] += 1
        return res

    monkeypatch.setattr(eb, "batch_generate", wrong)
    assert bb.main(["--drafter", "ngram", "--rows", "2", "--repeats", "1", "--max-tokens", "4"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bench_batched:")]
    assert len(err) == 1 and "row r1" in err[0] and "round" in err[0] and "logic" in err[0], err


def test_profile_prints_the_phase_split(capsys: pytest.CaptureFixture[str]) -> None:
    assert bb.main(["--drafter", "ngram", "--rows", "2", "--repeats", "1", "--max-tokens", "4", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "Per-phase split" in out and "| forward |" in out and "| rollback |" in out, out
    assert "| r1 | identical | batch | per row: the NgramSource source drafts per row |" in out, out


@pytest.fixture
def nonexact_llama() -> Any:
    """The zoo llama the bench loads (``specparity.runners.load_model`` is cached: the same object)
    wrapped by the CPU double of a non-bit-exact backend (``engine.nonexact``, the issue-39 setting
    ``0.01:0:0.001``), unwrapped afterwards."""
    from engine.nonexact import emulate_nonexact, exact
    from specparity.measure.ab import resolve_target
    from specparity.runners import load_model

    model = load_model(str(resolve_target("llama")[1])).model
    emulate_nonexact(model, 0.01, seed=0, kv_scale=0.001)
    yield model
    exact(model)


def test_under_the_double_rows_read_identical_or_numerics(nonexact_llama: Any, tmp_path: Any,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Off a bit-exact backend every row goes through ``classify_row``: identical or ``numerics``, a
    figure, exit 0, never a traceback."""
    import json

    dest = tmp_path / "bb.json"
    assert bb.main(["--rows", "1,2,4", "--repeats", "1", "--max-tokens", "8", "--json", str(dest)]) == 0
    out = capsys.readouterr().out
    assert "| 4 |" in out and "Traceback" not in out, out
    for entry in json.loads(dest.read_text())["table"]:
        assert set(entry["row_status"].values()) <= {"identical", "numerics"}, entry["row_status"]


def test_under_the_double_a_planted_row_bug_is_logic_with_row_and_round(
        nonexact_llama: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Planted: row r1's batched run emits a token its own forward never gave at one round (a per-row
    bug: tokens in the row's record and output, as one row's state applied to another would).
    The double's bound does not explain it: ``logic``, one line naming the row and the round, exit 1."""
    import engine.batched as eb

    real = eb.batch_generate

    def wrong(model: Any, reqs: Any, **kw: Any) -> Any:
        res = real(model, reqs, **kw)
        rec = next(r for r in res.rows["r1"].records if r["type"] == "round" and r["index"] >= 1 and r["emitted"])
        rec["emitted"] = [(t + 7) % 256 for t in rec["emitted"]]
        return res

    monkeypatch.setattr(eb, "batch_generate", wrong)
    assert bb.main(["--rows", "2", "--repeats", "1", "--max-tokens", "12"]) == 1
    cap = capsys.readouterr()
    err = [line for line in cap.err.splitlines() if line.startswith("bench_batched:")]
    assert len(err) == 1 and "Traceback" not in cap.err, cap.err
    assert "row r1" in err[0] and "logic" in err[0] and "round " in err[0] and "no throughput figure" in err[0], err


@pytest.fixture
def nonexact_pair(nonexact_llama: Any) -> Any:
    """As ``SPECPARITY_EMULATE_NONEXACT=0.01:0:0.001`` does: the twin drafter wrapped too."""
    from engine.nonexact import emulate_nonexact, exact
    from specparity.measure.ab import resolve_drafter
    from specparity.runners import load_model

    drafter = load_model(str(resolve_drafter("llama", "twin"))).model
    emulate_nonexact(drafter, 0.01, seed=0, kv_scale=0.001)
    yield nonexact_llama, drafter
    exact(drafter)


def test_under_the_double_a_batched_drafters_flip_is_not_logic(nonexact_pair: Any,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    rc = bb.main(["--rows", "4", "--repeats", "1", "--max-tokens", "16"])
    err = capsys.readouterr().err
    assert rc == 0, err


def test_under_the_double_drafts_moved_by_the_drafter_batch_are_numerics_but_a_moved_output_is_logic(
        nonexact_pair: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A row that drafted in a drafter batch may propose other drafts than alone (the drafter's
    batched arithmetic): ``numerics`` while every emitted token equals the serial run's. Planted:
    once drafts moved, the row's output moves too (a last token changed) -> ``logic`` at the
    output, one line naming the row, exit 1."""
    import engine.batched as eb

    real = eb.batch_generate
    moved: list[str] = []

    def wrong(model: Any, reqs: Any, **kw: Any) -> Any:
        res = real(model, reqs, **kw)
        for rid, row in res.rows.items():
            if res.drafting.get(rid) == "batched" and row.output_ids:
                row.output_ids[-1] = (row.output_ids[-1] + 7) % 256
                moved.append(rid)
                break
        return res

    assert bb.main(["--rows", "4", "--repeats", "1", "--max-tokens", "16"]) == 0  # the unplanted run: figures
    capsys.readouterr()
    monkeypatch.setattr(eb, "batch_generate", wrong)
    assert bb.main(["--rows", "4", "--repeats", "1", "--max-tokens", "16"]) == 1
    cap = capsys.readouterr()
    err = [line for line in cap.err.splitlines() if line.startswith("bench_batched:")]
    assert moved and len(err) == 1 and "Traceback" not in cap.err, cap.err
    assert f"row {moved[0]}" in err[0] and "logic" in err[0], err
