"""HTTP handlers: /v1/chat/completions, /v1/completions, /v1/models, /tokenize, /detokenize, /health, /metrics."""
from __future__ import annotations

import logging
import time
from contextlib import aclosing

from aiohttp import web

from kvmesh.gateway import prompts as P
from kvmesh.gateway import responses as R
from kvmesh.gateway import sse
from kvmesh.gateway.app import GATEWAY, Gateway
from kvmesh.gateway.dispatcher import merge, new_request_id
from kvmesh.gateway.json_body import read_json
from kvmesh.gateway.openai_api import ApiError, CommonRequest
from kvmesh.hashing import block_hashes

log = logging.getLogger("kvmesh.gateway")


def token_text(gw: Gateway, token_id: int) -> str:
    return gw.tokenizer.decode([token_id], skip_special_tokens=False)


async def _lookup(gw: Gateway, ids: tuple[int, ...], cache_salt: str):
    hashes = block_hashes(ids, gw.hash_context(cache_salt))
    if not hashes:
        return hashes, []
    return hashes, await gw.lookups.lookup(hashes)  # one round trip for the whole prompt; misses if it fails


async def _deltas(gw: Gateway, jobs: list[P.Job], common: CommonRequest, rid: str):
    """Merged deltas of every job's n choices (choice index = job * n + j)."""
    its = []
    for k, job in enumerate(jobs):
        hashes, holders = await _lookup(gw, job.ids, common.cache_salt)
        its.append(gw.dispatcher.run(rid, job.ids, hashes, holders, common.sampling, n=common.n,
                                     max_tokens=job.max_tokens, cache_salt=common.cache_salt,
                                     index_base=k * common.n))
    async with aclosing(merge(its)) as merged:  # closing us closes every worker stream now
        async for d in merged:
            yield d


class _Timing:
    """Request-level latency metrics and the waiting/running gauges."""

    def __init__(self, gw: Gateway) -> None:
        self.m = gw.metrics
        self.t0 = time.perf_counter()
        self.last: dict[int, float] = {}
        self.started = False
        self.m.lab(self.m.waiting).inc()

    def tokens(self, index: int, n_tokens: int) -> None:
        now = time.perf_counter()
        if not self.started:
            self.started = True
            self.m.lab(self.m.ttft).observe(now - self.t0)
            self.m.lab(self.m.waiting).dec()
            self.m.lab(self.m.running).inc()
        elif index in self.last and n_tokens:
            self.m.lab(self.m.itl).observe((now - self.last[index]) / n_tokens)
        self.last[index] = now
        self.m.lab(self.m.generation_tokens).inc(n_tokens)

    def finish(self, states: list[R.ChoiceState]) -> None:
        self.m.lab(self.m.running if self.started else self.m.waiting).dec()
        self.m.lab(self.m.e2e).observe(time.perf_counter() - self.t0)
        for s in states:
            if s.finish_reason:
                self.m.lab(self.m.request_success, finished_reason=s.finish_reason).inc()


async def _generate(request: web.Request, gw: Gateway, jobs: list[P.Job], common: CommonRequest,
                    chat: bool, want_logprobs: bool, echo: bool) -> web.StreamResponse:
    if gw.active >= gw.cfg.max_num_requests:
        raise ApiError(429, f"the gateway is at --max-num-requests ({gw.cfg.max_num_requests}); "
                            "retry later", type="rate_limit_exceeded")
    gw.active += 1
    rid = new_request_id("chatcmpl" if chat else "cmpl")
    model, created = common.model, int(time.time())  # the name the client asked for
    n_choices = len(jobs) * common.n
    states = [R.ChoiceState(index=i) for i in range(n_choices)]
    timing = _Timing(gw)
    it = _deltas(gw, jobs, common, rid)
    try:
        if not common.stream:
            async for d in it:
                job = jobs[d.index // common.n]
                if job.score_only:
                    d.text, d.token_ids, d.logprobs = "", [], []
                timing.tokens(d.index, len(d.token_ids))
                states[d.index].add(d)
            for s in states:
                if jobs[s.index // common.n].score_only:
                    s.finish_reason = "length"
            return web.json_response(_final(gw, rid, model, jobs, states, common, chat,
                                             want_logprobs, echo))
        return await _stream(request, gw, it, rid, model, created, jobs, states, common, chat,
                             want_logprobs, echo, timing)
    finally:
        await it.aclose()  # closes every open gRPC call: the workers abort and free blocks
        gw.active -= 1
        timing.finish(states)


def _final(gw: Gateway, rid: str, model: str, jobs: list[P.Job], states: list[R.ChoiceState],
           common: CommonRequest, chat: bool, want_logprobs: bool, echo: bool) -> dict:
    tt = lambda t: token_text(gw, t)  # noqa: E731
    if chat:
        return R.chat_response(rid, model, states, want_logprobs, tt)
    choices = []
    for s in states:
        job = jobs[s.index // common.n]
        prefix = job.text if echo else ""
        lp = None
        if want_logprobs:
            lp = R.completion_logprobs(list(job.ids) if echo else None, s.prompt_logprobs,
                                       s.logprobs, tt)
        choices.append({"index": s.index, "text": prefix + s.text, "logprobs": lp,
                        "finish_reason": s.finish_reason or "stop"})
    # prompt usage counted once per prompt, as OpenAI does for n > 1
    firsts = [states[k * common.n] for k in range(len(jobs))]
    u = R.usage(sum(len(j.ids) for j in jobs), sum(len(s.token_ids) for s in states),
                sum(s.num_cached_tokens for s in firsts))
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": u}


async def _stream(request, gw, it, rid, model, created, jobs, states, common, chat, want_logprobs,
                  echo, timing) -> web.StreamResponse:
    tt = lambda t: token_text(gw, t)  # noqa: E731
    uf = common.include_usage
    try:
        first = await it.__anext__()  # errors before any output still get a proper status code
    except StopAsyncIteration:
        first = None
    resp = sse.new_stream()

    async def emit(d) -> None:
        s = states[d.index]
        was_new = s.num_prompt_tokens == 0 and d.num_prompt_tokens is not None
        offset = len(s.text) + (len(jobs[d.index // common.n].text) if echo and not was_new else 0)
        timing.tokens(d.index, len(d.token_ids))
        s.add(d)
        if chat:
            if d.text or d.logprobs:
                lp = R.chat_logprobs(d.logprobs, tt) if want_logprobs else None
                await resp.write(sse.event(R.chat_chunk(rid, model, created, d.index,
                                                        {"content": d.text}, logprobs=lp,
                                                        with_usage_field=uf)))
            if d.finish_reason:
                await resp.write(sse.event(R.chat_chunk(rid, model, created, d.index, {},
                                                        finish_reason=d.finish_reason,
                                                        with_usage_field=uf)))
            return
        job = jobs[d.index // common.n]
        text = (job.text if echo and was_new else "") + d.text
        lp = None
        if want_logprobs:
            lp = R.completion_logprobs(list(job.ids) if echo and was_new else None,
                                       d.prompt_logprobs, d.logprobs, tt, start_offset=offset)
        await resp.write(sse.event(R.completion_chunk(rid, model, created, d.index, text,
                                                      finish_reason=d.finish_reason, logprobs=lp,
                                                      with_usage_field=uf)))

    try:
        await sse.open_stream(request, resp)
        if chat:
            for s in states:  # OpenAI opens every choice with the role
                await resp.write(sse.event(R.chat_chunk(rid, model, created, s.index,
                                                        {"role": "assistant", "content": ""},
                                                        with_usage_field=uf)))
        try:
            if first is not None:
                await emit(first)
                async for d in it:
                    await emit(d)
            if uf:
                firsts = [states[k * common.n] for k in range(len(jobs))]
                u = R.usage(sum(len(j.ids) for j in jobs), sum(len(s.token_ids) for s in states),
                            sum(s.num_cached_tokens for s in firsts))
                obj = "chat.completion.chunk" if chat else "text_completion"
                await resp.write(sse.event(R.usage_chunk(rid, model, created, obj, u)))
        except ApiError as e:  # mid-stream failure: the status is sent already, so say it in-band
            await resp.write(sse.event(e.body()))
        await resp.write(sse.DONE)
        await resp.write_eof()
    except ConnectionResetError:
        # the client hung up while a chunk was on its way: its disconnect raced this write (else
        # handler cancellation stops us first). Nobody is left to answer: _generate's finally aborts
        # the workers' calls, and aiohttp drops the connection.
        log.debug("the client left during the stream of %s", rid)
    return resp


# ---------------------------------------------------------------------------------------------
async def chat_completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    async with P.body_slot(request):
        req, text = await P.prepared(request, P.chat_prompt, gw, await read_json(request, gw.in_thread))
        # the template already holds BOS where the model wants one
        ids = await P.encode_prompt(gw, text, req.common, "messages", add_special_tokens=False)
        job = P.make_job(gw, ids, text, req.common, "messages")
    return await _generate(request, gw, [job], req.common, chat=True,
                           want_logprobs=req.common.sampling.logprobs is not None, echo=False)


async def completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    async with P.body_slot(request):
        req = await P.prepared(request, P.completion_request, gw, await read_json(request, gw.in_thread))
        jobs = []
        for i, p in enumerate(req.prompts):
            param = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
            if isinstance(p, str):
                ids = await P.encode_prompt(gw, p, req.common, param, add_special_tokens=True)
                jobs.append(P.make_job(gw, ids, p, req.common, param))
            else:
                jobs.append(await P.prepared(request, P.ids_job, gw, p, req.common, param))  # no copy on the loop
    return await _generate(request, gw, jobs, req.common, chat=False,
                           want_logprobs=req.common.sampling.logprobs is not None, echo=req.echo)


def _model_card(gw: Gateway, name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "kvmesh", "root": gw.cfg.model,
            "parent": None, "max_model_len": gw.max_model_len}


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    return web.json_response({"object": "list", "data": [_model_card(gw, n) for n in gw.cfg.model_names]})


async def model(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    name = request.match_info["name"]
    gw.check_model(name)
    return web.json_response(_model_card(gw, name))


async def version(request: web.Request) -> web.Response:
    from kvmesh import __version__
    return web.json_response({"version": __version__})


async def tokenize(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    async with P.body_slot(request):
        req, text = await P.prepared(request, P.tokenize_input, gw, await read_json(request, gw.in_thread))
        ids = await P.encode(gw, text, add_special_tokens=req["add_special_tokens"])
        body = await P.tokenize_response(gw, req, ids)
        return web.Response(body=body, content_type="application/json", charset="utf-8")


async def detokenize(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    async with P.body_slot(request):
        body = await P.prepared(request, P.detokenized, gw, await read_json(request, gw.in_thread))
        return web.Response(body=body, content_type="application/json", charset="utf-8")


async def health(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    workers = {w.address: {"role": w.role, "healthy": w.healthy, "in_flight": w.in_flight}
               for w in gw.router.workers.values()}
    ok = bool(gw.router.healthy("decode"))
    return web.json_response({"status": "ok" if ok else "no healthy decode worker", "workers": workers},
                             status=200 if ok else 503)


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[GATEWAY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": content_type})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{name}", model)
    app.router.add_get("/version", version)
    app.router.add_get("/ping", health)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
