// test_sse.mjs - unit tests (node, no browser) of the UI's modules that touch no DOM:
// web/sse.js (the SSE parser and fetch-based stream reader), web/jobs.js (chunk folding,
// job figures, Prometheus parsing), web/api.js (errors and their messages) and web/models.js
// (the model list and which model is picked).
//
// The SSE cases follow the WHATWG HTML "event stream interpretation" rules; the stream
// reader is fed by a real node:http server on loopback, split at awkward byte boundaries
// (inside a CRLF, inside a UTF-8 character).
//
//   node --test tests/web/test_sse.mjs

import { test } from 'node:test';
import assert from 'node:assert/strict';
import http from 'node:http';

import { SseParser, StreamHttpError, openEventStream } from '../../web/sse.js';
import { applyChunk, fmtMs, metricSum, newStreamState, parseMetrics, summarize, toMs }
  from '../../web/jobs.js';
import { Api, ApiError, describeError, errorFromResponse } from '../../web/api.js';
import { contextHint, modelList, pickModel } from '../../web/models.js';

function parseAll(chunks) {
  const p = new SseParser();
  const out = [];
  for (const c of chunks) out.push(...p.push(c));
  return { out, p };
}

test('SSE: fields, comments, multi-line data, sticky ids', () => {
  const { out } = parseAll([
    ': keep-alive\n\n',
    'id: 0\ndata: {"a":1}\n\n',
    'data: line1\ndata: line2\n\n',    // no id: keeps the last one
    'event: ping\ndata:no-space\n\n',
    'id: 7\nretry: 3000\n\n',           // no data: not dispatched, but the id sticks
    'data\n\n',                        // field with no colon: empty data line
    'data: [DONE]\n\n',
  ]);
  assert.deepEqual(out, [
    { type: 'message', data: '{"a":1}', id: '0' },
    { type: 'message', data: 'line1\nline2', id: '0' },
    { type: 'ping', data: 'no-space', id: '0' },
    { type: 'message', data: '', id: '7' },
    { type: 'message', data: '[DONE]', id: '7' },
  ]);
});

test('SSE: CRLF, CR and LF line ends, split anywhere', () => {
  const text = 'id: 1\r\ndata: a\r\n\r\nid: 2\rdata: b\r\rid: 3\ndata: c\n\n';
  const want = [{ type: 'message', data: 'a', id: '1' }, { type: 'message', data: 'b', id: '2' },
                { type: 'message', data: 'c', id: '3' }];
  for (let cut = 0; cut <= text.length; cut++) {
    assert.deepEqual(parseAll([text.slice(0, cut), text.slice(cut)]).out, want, `cut at ${cut}`);
  }
  // One character at a time.
  assert.deepEqual(parseAll([...text]).out, want);
});

test('SSE: an id with NUL is ignored, retry only when numeric, unfinished event held', () => {
  const { out, p } = parseAll(['id: 5\ndata: x\n\nid: a\0b\nretry: soon\ndata: y\n\ndata: z']);
  assert.deepEqual(out.map((e) => e.id), ['5', '5']);
  assert.equal(p.retryMs, null);
  p.push('\nretry: 250\n\n');
  assert.equal(p.retryMs, 250);
});

// A loopback server that writes the given byte pieces with pauses, then ends.
function serve(handler) {
  return new Promise((resolve) => {
    const server = http.createServer(handler);
    server.listen(0, '127.0.0.1', () => resolve(server));
  });
}

test('openEventStream: headers sent, bytes split inside UTF-8 and CRLF, events in order', async () => {
  const body = Buffer.from('id: 0\r\ndata: {"seq":0,"kind":"content","text":"héllo 世界"}\r\n\r\n' +
                           ': keep-alive\n\nid: 1\ndata: [DONE]\n\n', 'utf8');
  let seen = null;
  const server = await serve(async (req, res) => {
    seen = req.headers;
    res.writeHead(200, { 'Content-Type': 'text/event-stream' });
    // Cut after every byte of the multi-byte characters and inside the CRLF.
    for (let i = 0; i < body.length; i += 3) {
      res.write(body.subarray(i, i + 3));
      await new Promise((r) => setTimeout(r, 1));
    }
    res.end();
  });
  try {
    const events = [];
    const r = await openEventStream({
      url: `http://127.0.0.1:${server.address().port}/v1/jobs/job-x/events`,
      headers: { Authorization: 'Bearer k' }, lastEventId: '41', onEvent: (e) => events.push(e),
    });
    assert.equal(r.ended, 'closed');
    assert.equal(seen.authorization, 'Bearer k');
    assert.equal(seen['last-event-id'], '41');
    assert.equal(seen.accept, 'text/event-stream');
    assert.deepEqual(events.map((e) => e.id), ['0', '1']);
    assert.equal(JSON.parse(events[0].data).text, 'héllo 世界');
    assert.equal(events[1].data, '[DONE]');
  } finally {
    server.close();
  }
});

test('openEventStream: no Last-Event-ID header on a first connection; HTTP errors carry the body', async () => {
  let lei = 'unset';
  const server = await serve((req, res) => {
    lei = req.headers['last-event-id'];
    res.writeHead(429, { 'Content-Type': 'application/json', 'Retry-After': '3' });
    res.end(JSON.stringify({ error: { message: 'slow down', type: 'rate_limit_error', code: 'rate_limit_exceeded' } }));
  });
  try {
    await assert.rejects(
      openEventStream({ url: `http://127.0.0.1:${server.address().port}/e`, onEvent: () => {} }),
      (e) => e instanceof StreamHttpError && e.status === 429 && e.retryAfterS === 3 &&
             e.body.error.code === 'rate_limit_exceeded');
    assert.equal(lei, undefined);
  } finally {
    server.close();
  }
});

test('applyChunk: jobs API chunks, the closing event, chat chunks, errors', () => {
  const st = newStreamState();
  assert.equal(applyChunk(st, { seq: 0, kind: 'reasoning', text: 'hmm ' }), true);
  assert.equal(applyChunk(st, { seq: 1, kind: 'content', text: 'Hi' }), true);
  assert.equal(applyChunk(st, { seq: 2, kind: 'tool', text: '{"name":"f"}' }), true);
  assert.equal(applyChunk(st, { seq: 3, kind: 'content', text: '' }), false);
  applyChunk(st, { state: 'succeeded', finish_reason: 'stop', usage: { completion_tokens: 3 }, error: null });
  assert.deepEqual([st.reasoning, st.content, st.tool, st.state, st.finishReason, st.error],
                   ['hmm ', 'Hi', '{"name":"f"}', 'succeeded', 'stop', '']);
  assert.equal(st.usage.completion_tokens, 3);
  applyChunk(st, { choices: [{ delta: { reasoning_content: 'r', content: '!' }, finish_reason: 'length' }] });
  assert.equal(st.content, 'Hi!');
  assert.equal(st.reasoning, 'hmm r');
  assert.equal(st.finishReason, 'length');
  applyChunk(st, { state: 'failed', finish_reason: null, error: 'out of memory' });
  assert.equal(st.error, 'out of memory');
  assert.equal(st.state, 'failed');
  applyChunk(st, { error: { message: 'boom', type: 'server_error' } });
  assert.equal(st.error, 'boom');
});

test('summarize: the figures of a job as fcgi returns it', () => {
  const job = {
    id: 'job-1', object: 'job', state: 'succeeded', attempts: 2, queue_position: null,
    created_at: 1000,
    timings: { created_at: 1000.0, claimed_at: 1000.5, first_token_at: 1001.0, finished_at: 1003.0,
               queue_wait_s: 0.5, ttft_s: 0.5 },
    usage: { prompt_tokens: 10, completion_tokens: 41, total_tokens: 51 },
    finish_reason: 'length', error: null,
  };
  const s = summarize(job);
  assert.equal(s.ttftMs, 500);
  assert.equal(s.waitMs, 500);
  assert.equal(s.tokens, 41);
  assert.equal(s.tokPerS, 20); // 40 tokens after the first, in 2 s
  assert.equal(s.attempts, 2);
  assert.equal(s.createdMs, 1000000);
  assert.deepEqual([s.promptTokens, s.cachedTokens], [10, null]);  // no prefix-cache figure
  const cached = summarize({ ...job, usage: { ...job.usage, prompt_tokens_details: { cached_tokens: 8 } } });
  assert.deepEqual([cached.promptTokens, cached.cachedTokens], [10, 8]);
  // Running: tokens/s up to now; queued: position; no timings yet: nulls.
  const run = summarize({ ...job, state: 'running', timings: { ...job.timings, finished_at: null } }, 1005000);
  assert.equal(run.tokPerS, 10);
  const q = summarize({ id: 'job-2', state: 'queued', queue_position: 3, attempts: 0, created_at: 5, timings: {} });
  assert.deepEqual([q.queuePosition, q.ttftMs, q.tokPerS, q.tokens], [3, null, null, null]);
  // The owner as fcgi gives it, {name, prefix}; a plain string (older servers, the mock) too.
  assert.equal(summarize({ ...job, owner: { name: 'alice', prefix: 'gsk_0123abcd' } }).owner, 'alice (gsk_0123abcd)');
  assert.equal(summarize({ ...job, owner: 'bob' }).owner, 'bob');
  assert.equal(s.owner, '');
  assert.equal(toMs('2026-11-30T15:00:00Z'), Date.UTC(2026, 10, 30, 15));
  assert.equal(fmtMs(1500), '1.50 s');
  assert.equal(fmtMs(null), '–');
});

test('parseMetrics: gauges, counters with labels, histogram sums', () => {
  const m = parseMetrics([
    '# TYPE glmspark_queue_depth gauge', 'glmspark_queue_depth 4',
    'glmspark_jobs_total{state="succeeded"} 7', 'glmspark_jobs_total{state="failed"} 1',
    'glmspark_ttft_seconds_bucket{le="+Inf"} 3', 'glmspark_ttft_seconds_sum 1.5',
    'glmspark_rank_up{engine="a b",epoch="3",rank="0"} 1', '',
  ].join('\n'));
  assert.equal(metricSum(m, 'glmspark_queue_depth'), 4);
  assert.equal(metricSum(m, 'nope', 'glmspark_jobs_total'), 8);
  assert.equal(metricSum(m, 'glmspark_ttft_seconds_sum'), 1.5);
  assert.equal(m.glmspark_rank_up[0].labels.engine, 'a b');
  assert.equal(metricSum(m, 'absent'), null);
});

test('api: error bodies become ApiError and clear sentences', async () => {
  const resp = new Response(JSON.stringify({ error: { message: 'the queue is full; retry later',
    type: 'server_error', param: null, code: 'queue_full' } }), { status: 503, headers: { 'Retry-After': '5' } });
  const e = await errorFromResponse(resp);
  assert.equal(e.status, 503);
  assert.equal(e.code, 'queue_full');
  assert.equal(e.retryAfterS, 5);
  assert.equal(describeError(e), 'The queue is full. Try again in 5 s.');
  // nginx's own error page (not JSON) still gives a status.
  const html = await errorFromResponse(new Response('<html>429</html>', { status: 429 }));
  assert.match(describeError(html), /^Rate limit reached for this key/);
  assert.match(describeError(new ApiError(401, { code: 'invalid_api_key' })), /API key was not accepted/);
  assert.match(describeError(new ApiError(400, { code: 'context_length_exceeded', message: 'too long' })),
               /too long for the model's context/);
  assert.match(describeError(new ApiError(400, { param: 'top_p', message: 'bad' }), 'Submitting'),
               /^Submitting was refused as invalid \(field top_p\)/);
  assert.match(describeError(new ApiError(0, {})), /could not be reached/);
  assert.match(describeError(new ApiError(404, { code: 'model_not_found', message: 'no such model' }),
                             'Submitting the job'),
               /^Submitting the job failed: no engine serves that model now \(no such model\)/);
  assert.match(describeError(new ApiError(404, { code: 'job_not_found' })), /^Not found/);

  // The key goes only in the Authorization header.
  let got = null;
  const api = new Api({ getKey: () => 'gsk_secret', fetchImpl: async (url, init) => {
    got = { url, init };
    return new Response(JSON.stringify({ object: 'list', data: [] }), { status: 200 });
  } });
  await api.listJobs({ limit: 5, after: 'job-9' });
  assert.equal(got.url, '/v1/jobs?limit=5&after=job-9');
  assert.equal(got.init.headers.Authorization, 'Bearer gsk_secret');
  assert.ok(!got.url.includes('gsk_secret'));
});

test('models: the /v1/models list, and the remembered model picked while it is listed', () => {
  const resp = { object: 'list', data: [
    { id: 'glmspark-demo', object: 'model', owned_by: 'glmspark', max_model_len: 4096 },
    { id: 'glmspark-demo-b', object: 'model', owned_by: 'glmspark' },
    { id: 'glmspark-demo', object: 'model', max_model_len: 4096 }, // listed twice: once is kept
    { object: 'model' }, { id: '' }, null,                             // no id: skipped
    { id: 'odd', max_model_len: -1 }, { id: 'odder', max_model_len: '8192' },
  ] };
  const list = modelList(resp);
  assert.deepEqual(list, [{ id: 'glmspark-demo', contextLen: 4096 },
                          { id: 'glmspark-demo-b', contextLen: null },
                          { id: 'odd', contextLen: null }, { id: 'odder', contextLen: null }]);
  assert.deepEqual(modelList(null), []);
  assert.deepEqual(modelList({ object: 'list' }), []);

  // Nothing remembered: the first. Remembered and listed: that one.
  assert.deepEqual(pickModel(list, ''), { id: 'glmspark-demo', missing: '' });
  assert.deepEqual(pickModel(list, 'glmspark-demo-b'), { id: 'glmspark-demo-b', missing: '' });
  // Remembered but gone: the first, and which one is gone.
  assert.deepEqual(pickModel(list.slice(0, 1), 'glmspark-demo-b'),
                   { id: 'glmspark-demo', missing: 'glmspark-demo-b' });
  // Nothing served at all.
  assert.deepEqual(pickModel([], 'glmspark-demo'), { id: '', missing: 'glmspark-demo' });
  assert.deepEqual(pickModel([], ''), { id: '', missing: '' });

  assert.equal(contextHint(list[0]),
               'glmspark-demo reads at most 4096 tokens: the prompt and the answer together.');
  assert.equal(contextHint(list[1]), '');
  assert.equal(contextHint(undefined), '');
});
