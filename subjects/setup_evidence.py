"""What a started server shows about its own set-up: each arm proves its claim before it is graded.

A row asks for a set-up (its argv, ``defaults_off``, the drafter); what the server actually runs is
read from the server itself, and the row records that, not the request:

- **speculation counters** from every place servers keep them (``subjects/served/counters.py``):
  ``/metrics`` (Prometheus ``*_total`` counters, any method label: ``SpecCounters.from_metrics``),
  ``/health`` (a JSON body with numeric ``*draft*`` / ``*accept*`` keys, e.g. vmlx's:
  ``health_counters``) and the usage / timings extensions of each answer (``SpecCounters.add_doc``);
- **the log**: a line saying speculation was switched off (a draft model disabled under continuous
  batching, a drafter ignored) makes the spec arm ``not-engaged`` with that line quoted, whatever
  the counters; a row's ``observe`` patterns (a setting it asked off, seen on) are quoted as "not in
  effect", so a cell is never blamed on a mechanism the server did not have;
- **what it reports**: its ``/health`` body and the model ids of ``/v1/models``;
- **its runtime**: the versions of Python, MLX and mlx-lm in the server's own interpreter (the row's
  virtualenv), not the grader's.

A spec arm whose speculation cannot be verified (no counters anywhere, nothing in the log) says so
in each of its cells (``unverified``); it is never silently graded as what it was meant to be.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from subjects.http_client import HttpClient, ServerDown, ServerError, get_json, model_ids, redact

# a log line saying the speculation asked for is not running
SPEC_OFF = re.compile(r"(?i)\b(draft|specul)\w*\b[^\n]{0,80}?\b(disabl\w*|ignor\w*|not (?:be )?used|turned off|"
                      r"unsupported|skipp\w*|falling back)")
RUNTIME_PACKAGES = ("mlx", "mlx-lm", "mlx-metal")


@dataclass
class Observed:
    """What one started server showed (the row's ``setup.servers[i].observed``)."""

    health: str | None = None  # its /health body, one line, bounded
    models: list[str] = field(default_factory=list)  # the ids its /v1/models lists
    spec_off: str | None = None  # the log line saying speculation is off
    not_in_effect: dict[str, str] = field(default_factory=dict)  # setting asked off -> the log line showing it on

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"health": self.health, "models": self.models}
        if self.spec_off:
            d["speculation_off_in_log"] = self.spec_off
        if self.not_in_effect:
            d["not_in_effect"] = dict(self.not_in_effect)
        return d



def observe(client: HttpClient, log_text: str = "", patterns: Sequence[tuple[str, str]] = ()) -> Observed:
    """What the server shows now: its /health body, its model ids, and in ``log_text`` a line saying
    speculation is off or a setting of ``patterns`` ((setting, regex of a line showing it ON)) on."""
    o = Observed()
    try:
        status, text = client.get("/health")
        o.health = f"HTTP {status} " + redact(" ".join(text.split()))[:200]
    except (ServerDown, ServerError) as exc:
        o.health = f"no answer: {exc}"
    o.models = [str(i)[:120] for i in model_ids(get_json(client, "/v1/models"))][:8]
    log_text = server_output(log_text)
    o.spec_off = log_line(log_text, SPEC_OFF)
    for setting, pattern in patterns:
        line = log_line(log_text, re.compile(pattern))
        if line:
            o.not_in_effect[setting] = line
    return o


def server_output(log_text: str) -> str:
    """``log_text`` without the command line the harness writes as a log's first line (``$ argv``): the
    argv is what was asked, not what the server says (vmlx's spec argv, ``--num-draft-tokens 3
    --no-continuous-batching --disable-block-disk-cache``, reads as "draft ... disabled")."""
    if log_text.startswith("$ "):
        return log_text.split("\n", 1)[1] if "\n" in log_text else ""
    return log_text


def log_line(text: str, pattern: re.Pattern[str]) -> str | None:
    """The first log line matching ``pattern``, stripped and bounded (secrets redacted)."""
    for ln in text.splitlines():
        if pattern.search(ln):
            return redact(ln.strip())[:240]
    return None


def runtime_versions(python: str, packages: Sequence[str] = RUNTIME_PACKAGES, timeout: float = 60) -> dict[str, str]:
    """The versions the server's own interpreter ``python`` runs: Python and each of ``packages``
    ("not installed" where absent); ``{"error": ...}`` when it cannot be asked."""
    code = ("import json, sys, importlib.metadata as m\n"
            "out = {'python': sys.version.split()[0]}\n"
            f"for p in {list(packages)!r}:\n"
            "    try: out[p] = m.version(p)\n"
            "    except m.PackageNotFoundError: out[p] = 'not installed'\n"
            "print(json.dumps(out))")
    try:
        res = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=timeout)
        doc = json.loads(res.stdout) if res.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        doc = None
    if not isinstance(doc, dict):
        return {"error": f"could not ask {python!r} for its versions"}
    return {str(k): str(v) for k, v in doc.items()}
