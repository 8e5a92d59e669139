"""Outages of what the services lean on, as on Kubernetes where each service restarts on its own:
the kvstore, then Redis, killed (SIGKILL) under a serving stack and started again on the same port,
and the kvstore, Redis and the workers frozen (SIGSTOP: they accept connections and answer nothing,
as in a network partition).

While one is gone every request still answers, greedy-identical, and no other service dies: the
kvstore is a cache (a prompt whose blocks cannot be pushed or pulled is recomputed) and the index is
advice (a lookup that fails routes the request as a miss). Once it is back, the stack uses it again
without a restart of anything: blocks reach the new kvstore, block hashes the new Redis, and a
repeated prompt hits the cache again. A frozen Redis costs a request at most --index-timeout.

The stack: tests/outage_stack.py (every service a process of its own, a real redis-server).
"""
from __future__ import annotations

import time

import pytest

from chaos import CHAOS_SHORT, run_chaos
from outage_stack import STARTUP_S, Services, answer, outage_stack, timed_answers, until
from soak import QuietProbes, SoakConfig, check_quiet, table


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    with outage_stack(str(tmp_path_factory.mktemp("outages") / "services.log")) as s:
        yield s


async def _reference_and_healthy_time(services: Services, tag: str) -> tuple[str, float]:
    """The greedy answer, and how long a request takes while everything is up."""
    reference, _ = await answer(services.url, tag)
    t0 = time.monotonic()
    await answer(services.url, f"{tag}-timing")
    return reference, time.monotonic() - t0


@pytest.mark.timeout(STARTUP_S + 600)
async def test_kvstore_outage_recomputes_then_the_restarted_store_is_used(services: Services):
    reference, _ = await answer(services.url, "before")
    pushed = await services.sample("prefill-0", "kvmesh:worker_blocks_total", op="pushed")
    assert pushed > 0, "the healthy stack pushed no blocks to the kvstore"

    services.kvstore.popen.kill()
    services.kvstore.popen.wait()
    errors = await services.sample("prefill-0", "kvmesh:worker_transfer_errors_total", op="push")
    for salt in ("store-down-1", "store-down-2"):  # nothing cached under these: the whole prompt runs
        assert await answer(services.url, salt) == (reference, 0)
    assert await services.sample("prefill-0", "kvmesh:worker_transfer_errors_total", op="push") > errors, \
        "the prefill worker never missed the store"
    failures = services.log_lines("blocks failed")
    assert len(failures) <= 2, failures  # once an outage a worker, not once a request
    assert not services.others_alive(), services.others_alive()

    services.restart_kvstore()
    pushed = await services.sample("prefill-0", "kvmesh:worker_blocks_total", op="pushed")

    async def store_used_again():
        assert (await answer(services.url, f"store-back-{time.monotonic()}"))[0] == reference
        return await services.sample("prefill-0", "kvmesh:worker_blocks_total", op="pushed") > pushed

    await until("the prefill worker pushes to the restarted kvstore", store_used_again)
    assert not services.others_alive(), services.others_alive()
    assert not services.errors(), "\n".join(services.errors())


@pytest.mark.timeout(600)
async def test_redis_outage_routes_as_misses_then_the_restarted_index_fills_again(services: Services):
    import redis.asyncio as aredis

    reference, _ = await answer(services.url, "before-redis")
    r = aredis.Redis.from_url(services.redis.url)
    try:
        async def published():  # the holders (kvstore, workers) with entries: a holder's key exists once it published
            return set(await r.keys("kvmesh:holder:*"))

        before = await until("the stack's holders are in Redis", published)
        services.redis.crash()
        for salt in ("index-down-1", "index-down-1"):  # the second hits the worker's own pages
            text, _ = await answer(services.url, salt)
            assert text == reference
        assert not services.others_alive(), services.others_alive()

        services.redis.start(port=services.redis.port)  # empty: what was published is gone

        async def republished():  # by every holder, with no request to prompt it
            return before <= await published()

        await until("the holders republish what they held to the restarted Redis", republished)
    finally:
        await r.aclose()
    text, cached = await answer(services.url, "index-down-1")
    assert text == reference and cached > 0, (text, cached)
    assert not services.others_alive(), services.others_alive()
    outage_lines = services.log_lines("prefix index does not answer")
    assert 1 <= len(outage_lines) <= 3, outage_lines  # once a publishing service (kvstore, prefill, decode)
    assert not services.errors(), "\n".join(services.errors())


@pytest.mark.timeout(600)
async def test_a_frozen_redis_costs_a_request_at_most_the_index_timeout(services: Services):
    reference, healthy = await _reference_and_healthy_time(services, "before-freeze")
    timeouts = await services.sample("gateway", "kvmesh:prefix_index_errors_total", model_name="smollm2",
                                     reason="timeout")
    services.redis.freeze()
    try:
        answers = await timed_answers(services.url, "redis-frozen", 3)
        assert [text for text, _ in answers] == [reference] * 3
        # --index-timeout is 1 s; without it each lookup waited for redis-py's 5 s socket timeout
        assert max(took for _, took in answers) < healthy + 2.5, (answers, healthy)
        assert await services.sample("gateway", "kvmesh:prefix_index_errors_total", model_name="smollm2",
                                     reason="timeout") > timeouts
        assert not services.others_alive(), services.others_alive()
    finally:
        services.redis.thaw()

    async def gateway_routes_by_the_index_again():
        await answer(services.url, "after-thaw")
        return [line for line in services.log_lines("; routing by it") if "[gateway]" in line]

    await until("the gateway looks the index up again", gateway_routes_by_the_index_again)
    assert not services.errors(), "\n".join(services.errors())


@pytest.mark.timeout(600)
async def test_a_frozen_kvstore_costs_the_requests_in_flight_a_bounded_wait_and_the_rest_nothing(
        services: Services):
    reference, healthy = await _reference_and_healthy_time(services, "before-store-freeze")
    services.freeze_kvstore()
    try:
        answers = await timed_answers(services.url, "store-frozen", 3)
        assert [text for text, _ in answers] == [reference] * 3
        assert not services.others_alive(), services.others_alive()
    finally:
        services.thaw_kvstore()
    took = [t for _, t in answers]
    # the first waits for its put's deadline (5 s and its bytes), then the node is skipped until it
    # answers a health check: before, every request waited for a 30 s put and a 30 s get (61 s)
    assert took[0] < healthy + 8 and max(took[1:]) < healthy + 2.5, (took, healthy)
    await until("the prefill worker pushes to the kvstore again", services.pushes_again)
    assert not services.errors(), "\n".join(services.errors())


@pytest.mark.timeout(600)
async def test_a_frozen_worker_costs_the_request_in_flight_the_health_checks_then_is_routed_around(
        services: Services):
    import openai

    reference, healthy = await _reference_and_healthy_time(services, "before-worker-freeze")
    services.freeze("prefill")
    try:  # the decode worker prefills itself once the prefill worker is down
        answers = await timed_answers(services.url, "prefill-frozen", 2)
        assert [text for text, _ in answers] == [reference] * 2
    finally:
        services.thaw("prefill")
    took = [t for _, t in answers]
    # 3 health checks 2 s apart find it down; before, the call waited for gRPC's keepalive (80 s)
    assert took[0] < healthy + 12 and took[1] < healthy + 2.5, (took, healthy)

    services.freeze("decode")  # the only one: nobody can serve, and the client hears it
    try:
        t0 = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            await answer(services.url, "decode-frozen")
        assert e.value.status_code == 503 and time.monotonic() - t0 < 15, (e.value, time.monotonic() - t0)
    finally:
        services.thaw("decode")

    async def served_again():
        try:
            return (await answer(services.url, f"thawed-{time.monotonic()}"))[0] == reference
        except openai.APIStatusError:
            return False

    await until("both workers serve again", served_again)
    assert not services.errors(), "\n".join(services.errors())


@pytest.mark.timeout(900)
async def test_the_soak_rides_out_outages_one_after_another(services: Services):
    """tests/chaos.py: the kvstore frozen, Redis killed, the prefill worker frozen, the kvstore killed,
    each brought back, under the soak's mix; every request keeps the soak's rules (no 5xx, exactly
    its tokens) and afterwards nothing is held anywhere and the greedy answer is unchanged."""
    reference, _ = await answer(services.url, "before-chaos")
    report, done = await run_chaos(services, SoakConfig(seconds=45, clients=4, seed=5, max_model_len=512),
                                   CHAOS_SHORT)
    print(done, table(report), sep="\n")
    assert len(done) == len(CHAOS_SHORT), done
    assert not report.problems, "\n".join(report.problems)
    assert sum(n for (k, o), n in report.counts.items() if k == "chat" and o == "ok") > 0, report.counts
    held = await check_quiet(QuietProbes(services.metrics["gateway"],
                                         (services.metrics["prefill-0"], services.metrics["decode-0"]),
                                         (services.kvstore.health,)))
    assert not held, "\n".join(held)
    assert (await answer(services.url, "after-chaos"))[0] == reference
    assert not services.others_alive(), services.others_alive()
    assert not services.errors(), "\n".join(services.errors())
