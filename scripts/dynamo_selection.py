"""Dynamo's standalone `SelectionService` (ai-dynamo-runtime, in process) with kvrelay servers
registered in it: what `tests/dynamo_router.py` and `benches/dynamo/ttft.py` share. A server is
any object with `name`, `base` (its HTTP address) and `info` (its `/v1/kv/info` answer)."""

import asyncio
import os
import time
import uuid

os.environ.setdefault("DYN_LOG", "error")

from dynamo._core import SelectionService  # noqa: E402


def fetch_payload(hint):
    """The `kv.fetch` action's payload of a Dynamo hint, or None."""
    for a in (hint or {}).get("actions", []):
        if a.get("action_type") == "kv.fetch":
            assert a.get("action_version") == "1.0", a
            return a["payload"]
    return None


class Router:
    """A Dynamo SelectionService and the kvrelay servers registered with it."""

    def __init__(self):
        self.svc = SelectionService(indexer_threads=1)

    async def register(self, server, worker_id, model_name=None):
        """Register `server` from its `/v1/kv/info` `dynamo` fields as they are (`model_name`
        overrides its model); every key given must come back in Dynamo's record."""
        d = server.info["dynamo"]
        reg = dict(d, worker_id=worker_id, endpoint=server.base)
        if model_name is not None:
            reg["model_name"] = model_name
        # JSON keys are strings; Dynamo takes the data-parallel rank as an integer
        reg["router_hint_source_control_endpoints"] = {
            int(k): v for k, v in d["router_hint_source_control_endpoints"].items()
        }
        rec = await self.svc.upsert_worker(reg)
        # upsert_worker ignores keys it does not know: every key given must come back
        for k, v in reg.items():
            got = rec.get(k)
            if k == "router_hint_source_control_endpoints":
                got, v = {str(a): b for a, b in (got or {}).items()}, {str(a): b for a, b in v.items()}
            if got != v:
                raise RuntimeError(f"{server.name}: Dynamo's record has {k}={got!r}, registered {v!r}")
        if rec.get("lifecycle") != "schedulable":
            raise RuntimeError(f"{server.name}: not schedulable: {rec}")
        return rec

    async def held(self, model, tokens, worker_id):
        """Blocks of `tokens` the router believes `worker_id` holds (any tier)."""
        sc = await self.svc.overlap_scores({"model_name": model, "token_ids": tokens})
        for w in sc["workers"]:
            if w["worker_id"] == worker_id:
                return max(w["device_blocks"], w["host_pinned_blocks"])
        return 0

    async def wait_held(self, model, tokens, worker_id, pred, what, timeout=30, step=0.02):
        """Wait (bounded) until `pred` holds of what the router shows of `worker_id`; returns
        that count and the seconds waited."""
        t0 = time.perf_counter()
        end = time.monotonic() + timeout
        while True:
            n = await self.held(model, tokens, worker_id)
            if pred(n):
                return n, time.perf_counter() - t0
            if time.monotonic() > end:
                raise AssertionError(f"{what}: the router shows {n} blocks of worker {worker_id} after {timeout} s")
            await asyncio.sleep(step)

    async def select(self, model, tokens, allowed=None):
        """`select_and_reserve` (restricted to `allowed` worker ids when given), then
        `free_reservation`: (the selection, seconds of both calls, seconds of the first)."""
        sid = "sel-" + uuid.uuid4().hex
        req = {"model_name": model, "selection_id": sid, "token_ids": tokens}
        if allowed is not None:
            req["allowed_worker_ids"] = allowed
        t0 = time.perf_counter()
        r = await self.svc.select_and_reserve(req)
        t1 = time.perf_counter()
        await self.svc.free_reservation(sid)
        return r, time.perf_counter() - t0, t1 - t0

    async def hint(self, model, tokens, target):
        """The hint a selection restricted to `target` carries (either spelling of the field)."""
        r, _, _ = await self.select(model, tokens, [target])
        assert r["worker_id"] == target, r
        return r.get("kv_hint") or r.get("router_hint")

    def close(self):
        self.svc.shutdown()
