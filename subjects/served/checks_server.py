"""The checks of the server itself: liveness, and speculation (judged by the grader over a whole arm).
"""

from __future__ import annotations

from subjects.http_client import ServerDown
from subjects.served.cells import Finding
from subjects.served.ctx import Ctx
from subjects.served.declare import Check, check, declare


@check("liveness", title="health")
def check_liveness(ctx: Ctx) -> str:
    with ctx.case("GET /health"):
        ok, why = ctx.client.healthy()
        if not ok:
            raise ServerDown(f"server not healthy: {why}")
    with ctx.case("GET /v1/models"):
        status, text = ctx.client.get("/v1/models")
        if status != 200:
            raise Finding(None, f"GET /v1/models: HTTP {status} {' '.join(text.split())[:80]}")
    return "/health (or /v1/models) and /v1/models answer"


# judged by the grader over a whole arm (the counters gathered over it): counters.speculation_cell
declare(Check("speculation", None, "speculated", server="arm"))
