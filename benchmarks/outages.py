"""What an outage of the kvstore or of Redis costs the requests, and how long the stack takes to use
the dependency again once it is back: a stack of service processes (tests/outage_stack.py: redis,
kvstore, prefill, decode, gateway; SmolLM2), sequential greedy chat requests, each under a fresh
cache salt so that every one computes its prompt and crosses the kvstore.

    .venv/bin/python benchmarks/outages.py [--requests 5] [--chaos-seconds 120 --clients 6]

Scenarios, one after the other: healthy; the kvstore killed (SIGKILL), then started again on its
port; the kvstore frozen (SIGSTOP: connections accepted, nothing answered, as in a partition),
then thawed; Redis killed, then started again empty; Redis frozen, then thawed; the prefill worker
frozen, then thawed. "back in" is from
the restart (or thaw) to the dependency in use again: the prefill worker's pushes land (kvstore),
every holder (kvstore, workers) has published to the restarted Redis, unprompted (kill), a
gateway lookup answers (freeze), the prefill worker pushes a prompt's blocks again (its freeze).

Then, with --chaos-seconds, the long variant of the CI's chaos soak (tests/chaos.py, CHAOS_LONG):
the soak's clients for that long while the kvstore, Redis and the prefill worker are frozen, killed
and brought back one after another; its table, and the problems if any rule broke (exit 1).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from chaos import CHAOS_LONG, run_chaos  # noqa: E402
from outage_stack import Services, answer, outage_stack, timed_answers, until  # noqa: E402
from soak import QuietProbes, SoakConfig, check_quiet, table  # noqa: E402


class Run:
    def __init__(self, services: Services, reference: str, n: int) -> None:
        self.s, self.reference, self.n = services, reference, n
        self.rows: list[str] = []

    async def timed(self, label: str) -> None:
        answers = await timed_answers(self.s.url, label, self.n)
        self.last = ([t for _, t in answers], sum(text == self.reference for text, _ in answers))

    def row(self, scenario: str, back_s: float | None) -> None:
        took, same = self.last
        s = sorted(took)
        self.rows.append(f"| {scenario} | {len(took)} | {s[len(s) // 2]:.2f} | {took[0]:.2f} | {max(took):.2f} | "
                         f"{same}/{len(took)} | " + ("-" if back_s is None else f"{back_s:.1f}") + " |")


async def holders_in_redis(url: str) -> set[bytes]:
    """The holders (kvstore, workers) with entries in Redis: a holder's key exists once it published."""
    import redis.asyncio as aredis
    r = aredis.Redis.from_url(url)
    try:
        return set(await r.keys("kvmesh:holder:*"))
    finally:
        await r.aclose()


async def chaos_soak(s: Services, seconds: float, clients: int) -> list[str]:
    """The long chaos soak; the problems found."""
    report, done = await run_chaos(s, SoakConfig(seconds=seconds, clients=clients, seed=11), CHAOS_LONG)
    print(f"\n## chaos soak: {seconds:g} s, {clients} clients; outages: {'; '.join(done)}")
    print(table(report))
    print(f"{sum(report.counts.values())} requests in {report.seconds:.0f} s")
    held = await check_quiet(QuietProbes(s.metrics["gateway"], (s.metrics["prefill-0"], s.metrics["decode-0"]),
                                         (s.kvstore.health,)))
    return report.problems + held + s.errors() + [f"{n} is dead" for n in s.others_alive()]


async def main_async(n: int, chaos_seconds: float, clients: int) -> int:
    with tempfile.TemporaryDirectory() as tmp, outage_stack(os.path.join(tmp, "services.log")) as s:
        reference, _ = await answer(s.url, "reference")
        run = Run(s, reference, n)
        await run.timed("healthy")
        run.row("healthy", None)

        s.kvstore.popen.kill()
        s.kvstore.popen.wait()
        await run.timed("kvstore-killed")
        t0 = time.monotonic()
        s.restart_kvstore()
        await until("pushes land in the restarted kvstore", s.pushes_again)
        run.row("kvstore killed, restarted", time.monotonic() - t0)

        s.freeze_kvstore()
        try:
            await run.timed("kvstore-frozen")
        finally:
            s.thaw_kvstore()
        t0 = time.monotonic()
        await until("pushes land in the thawed kvstore", s.pushes_again)
        run.row("kvstore frozen, thawed", time.monotonic() - t0)

        before = await until("holders in Redis", lambda: holders_in_redis(s.redis.url))
        s.redis.crash()
        await run.timed("redis-killed")
        t0 = time.monotonic()
        s.redis.start(port=s.redis.port)

        async def republished() -> bool:
            return before <= await holders_in_redis(s.redis.url)
        await until("every holder republished to the restarted Redis", republished)
        run.row("redis killed, restarted empty", time.monotonic() - t0)

        s.redis.freeze()
        try:
            await run.timed("redis-frozen")
        finally:
            s.redis.thaw()
        t0 = time.monotonic()
        errors = "kvmesh:prefix_index_errors_total"

        async def misses() -> list[float]:  # lookups routed as misses, by reason
            return [await s.sample("gateway", errors, model_name="smollm2", reason=r)
                    for r in ("error", "timeout", "skipped")]

        async def lookups_answer() -> bool:
            counts = await misses()
            await answer(s.url, f"lookup-{time.monotonic()}")
            return counts == await misses()
        await until("a lookup answers", lookups_answer)
        run.row("redis frozen, thawed", time.monotonic() - t0)

        s.freeze("prefill")
        try:
            await run.timed("prefill-frozen")
        finally:
            s.thaw("prefill")
        t0 = time.monotonic()
        await until("the prefill worker takes prompts again", s.pushes_again)
        run.row("prefill worker frozen, thawed", time.monotonic() - t0)

        print("| scenario | requests | p50 s | first s | max s | same greedy answer | back in s |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(run.rows))
        problems = s.errors()
        print("\nservice errors:", "\n".join(problems) if problems else "none")
        if chaos_seconds > 0:
            problems += await chaos_soak(s, chaos_seconds, clients)
            print("\nproblems:", "\n".join(problems) if problems else "none")
        return 1 if problems else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=5, help="sequential requests a scenario")
    ap.add_argument("--chaos-seconds", type=float, default=0.0, help="then a chaos soak this long (0: none)")
    ap.add_argument("--clients", type=int, default=6, help="the chaos soak's clients")
    args = ap.parse_args()
    sys.exit(asyncio.run(main_async(args.requests, args.chaos_seconds, args.clients)))


if __name__ == "__main__":
    main()
