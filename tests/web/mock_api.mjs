// mock_api.mjs - a stand-in for nginx + glmspark-fcgi that the browser tests can use offline.
//
// Serves web/ with the security headers nginx sends (a strict Content-Security-Policy, so an
// inline script or style in the UI fails the test) and implements the jobs API
// item 2 the way the UI reads it: POST /v1/jobs (202 + id), GET /v1/jobs (own jobs; admin:
// all; paging with limit/after), GET /v1/jobs/{id}, GET /v1/jobs/{id}/events (SSE, id: = chunk
// seq from 0, resumable with Last-Event-ID, ": keep-alive" comments, ends with data: [DONE]),
// POST /v1/jobs/{id}/cancel, GET /v1/models (two models, each with its max_model_len; a job for
// a model not listed is a 404 model_not_found, as with no live engine serving it), GET /metrics
// (admin only), OpenAI error objects with 401/403/404/429/503. Each job "generates" a fixed
// script of chunks, one every tickMs, so a test knows the exact text to expect
// (expectedText()).
//
// Test controls (not part of the API): POST /__mock/queue_full {on}, POST /__mock/drop (close
// every open event stream mid-flight), GET /__mock/log (the Last-Event-ID of each events
// request), POST /__mock/pause {on} (stop generating), POST /__mock/models {ids} (serve only
// those of MODELS; {} restores all), GET /__mock/last_job_request (the body of the last
// POST /v1/jobs). Usage:
//   node tests/web/mock_api.mjs [--port N]       prints URL=http://127.0.0.1:N and key lines
// or import { startMock } from it.

import http from 'node:http';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const WEB = path.resolve(HERE, '../../web');
export const MODEL = 'glmspark-demo';
// What GET /v1/models lists, in this order (the UI picks the first by default).
export const MODELS = [
  { id: MODEL, max_model_len: 4096 },
  { id: 'glmspark-demo-b', max_model_len: 2048 },
];
export const KEYS = {
  'gsk_user_0123456789abcdef': { name: 'alice', scope: 'user' },
  'gsk_other_0123456789abcdef': { name: 'bob', scope: 'user' },
  'gsk_admin_0123456789abcdef': { name: 'ops', scope: 'admin' },
  'gsk_limited_0123456789abcd': { name: 'limited', scope: 'user', rpm: 0 },
};

const N_REASONING = 12;
// The chunks one job produces: N_REASONING reasoning chunks (thinking on), then content.
export function script(maxTokens, thinking = true) {
  const out = [];
  for (let i = 0; i < (thinking ? N_REASONING : 0); i++) out.push({ kind: 'reasoning', text: `think${i} ` });
  const n = Math.max(1, Math.min(maxTokens, 400));
  for (let i = 0; i < n; i++) out.push({ kind: 'content', text: `w${i}${i % 10 === 9 ? '\n' : ' '}` });
  return out;
}

export function expectedText(maxTokens, kind, thinking = true) {
  return script(maxTokens, thinking).filter((c) => c.kind === kind).map((c) => c.text).join('');
}

const MIME = { '.html': 'text/html; charset=utf-8', '.js': 'text/javascript; charset=utf-8',
               '.css': 'text/css; charset=utf-8', '.svg': 'image/svg+xml', '.md': 'text/plain' };

const SECURITY = {
  'Content-Security-Policy': "default-src 'self'; script-src 'self'; style-src 'self'; " +
    "img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
  'X-Content-Type-Options': 'nosniff',
  'Referrer-Policy': 'no-referrer',
  'X-Frame-Options': 'DENY',
};

function sendJson(res, status, obj, extra = {}) {
  const body = JSON.stringify(obj);
  res.writeHead(status, { 'Content-Type': 'application/json', 'Cache-Control': 'no-store', ...extra });
  res.end(body);
}

function sendError(res, status, type, code, message, extra) {
  sendJson(res, status, { error: { message, type, param: null, code } }, extra);
}

export function startMock({ port = 0, tickMs = 40 } = {}) {
  const jobs = new Map(); // id -> job
  const order = [];       // ids, oldest first
  const streams = new Set();
  const log = [];
  const ctl = { queueFull: false, paused: false, served: MODELS.map((m) => m.id),
                lastJobRequest: null };
  let nextId = 1;
  let tokensTotal = 0;

  // The job object exactly as fcgi/api_server.c job_object() writes it.
  function publicJob(j, withOutput = true) {
    const queued = order.filter((id) => jobs.get(id).state === 'queued');
    const s = (ms) => (ms ? ms / 1000 : null);
    const o = {
      id: j.id, object: 'job', state: j.state, kind: 'chat', model: j.model,
      attempts: j.attempts,
      queue_position: j.state === 'queued' ? queued.indexOf(j.id) + 1 : null,
      created_at: Math.floor(j.created / 1000),
      timings: {
        created_at: s(j.created), claimed_at: s(j.started), first_token_at: s(j.firstTok),
        finished_at: s(j.finished),
        ...(j.started ? { queue_wait_s: (j.started - j.created) / 1000 } : {}),
        ...(j.firstTok ? { ttft_s: (j.firstTok - j.started) / 1000 } : {}),
      },
      usage: { prompt_tokens: j.promptTokens, completion_tokens: j.produced.length,
               total_tokens: j.promptTokens + j.produced.length },
      max_tokens: j.maxTokens,
      finish_reason: j.finishReason,
      error: j.error,
    };
    if (withOutput) {
      o.output = {
        content: j.produced.filter((c) => c.kind === 'content').map((c) => c.text).join(''),
        reasoning_content: j.produced.filter((c) => c.kind === 'reasoning').map((c) => c.text).join(''),
        tool_calls: [],
      };
    }
    return o;
  }

  function wake(j) { for (const s of streams) if (s.job === j) s.pump(); }

  // The scheduler: one job runs at a time (like a 1-sequence engine), a chunk per tick.
  const timer = setInterval(() => {
    if (ctl.paused) return;
    let run = order.map((id) => jobs.get(id)).find((j) => j.state === 'running');
    if (!run) {
      run = order.map((id) => jobs.get(id)).find((j) => j.state === 'queued');
      if (!run) return;
      run.state = 'running';
      run.started = Date.now();
      run.attempts = 1;
    }
    if (run.cancel) {
      run.state = 'cancelled';
      run.finishReason = 'cancelled';
      run.finished = Date.now();
      wake(run);
      return;
    }
    const c = run.script[run.produced.length];
    if (run.failAt !== null && run.produced.length === run.failAt) {
      run.state = 'failed';
      run.error = 'the engine ran out of KV cache blocks';
      run.finishReason = 'error';
      run.finished = Date.now();
      wake(run);
      return;
    }
    if (c) {
      run.produced.push(c);
      tokensTotal++;
      if (!run.firstTok) run.firstTok = Date.now();
    }
    if (run.produced.length === run.script.length) {
      run.state = 'succeeded';
      run.finishReason = 'length';
      run.finished = Date.now();
    }
    wake(run);
  }, tickMs);

  function auth(req, res) {
    const h = req.headers.authorization || '';
    const m = /^Bearer (\S+)$/.exec(h);
    if (!m) {
      sendError(res, 401, 'invalid_request_error', 'missing_api_key', 'no API key: send it as "Authorization: Bearer <key>"');
      return null;
    }
    const k = KEYS[m[1]];
    if (!k) {
      sendError(res, 401, 'invalid_request_error', 'invalid_api_key', 'invalid or revoked API key');
      return null;
    }
    return k;
  }

  function readBody(req) {
    return new Promise((resolve, reject) => {
      const parts = [];
      req.on('data', (d) => parts.push(d));
      req.on('end', () => resolve(Buffer.concat(parts).toString('utf8')));
      req.on('error', reject);
    });
  }

  function serveStatic(req, res, pathname) {
    let rel = decodeURIComponent(pathname);
    if (rel === '/' || rel === '') rel = '/index.html';
    const file = path.resolve(WEB, '.' + rel);
    if (!file.startsWith(WEB + path.sep) || !fs.existsSync(file) || !fs.statSync(file).isFile()) {
      res.writeHead(404, { 'Content-Type': 'text/plain', ...SECURITY });
      res.end('not found');
      return;
    }
    res.writeHead(200, { 'Content-Type': MIME[path.extname(file)] || 'application/octet-stream',
                         'Cache-Control': 'no-cache', ...SECURITY });
    fs.createReadStream(file).pipe(res);
  }

  function events(req, res, j) {
    const h = req.headers['last-event-id'];
    log.push({ job: j.id, lastEventId: h === undefined ? null : h });
    let next = 0;
    if (h !== undefined && /^[0-9]+$/.test(h)) next = Number(h) + 1;
    res.writeHead(200, { 'Content-Type': 'text/event-stream', 'Cache-Control': 'no-store',
                         'X-Accel-Buffering': 'no' });
    res.write(': stream\n\n');
    const s = { job: j, res, done: false };
    s.pump = () => {
      if (s.done) return;
      while (next < j.produced.length) {
        const c = j.produced[next];
        res.write(`id: ${next}\ndata: ${JSON.stringify({ seq: next, kind: c.kind, text: c.text })}\n\n`);
        next++;
      }
      if (j.state === 'succeeded' || j.state === 'cancelled' || j.state === 'failed') {
        const u = { prompt_tokens: j.promptTokens, completion_tokens: j.produced.length,
                    total_tokens: j.promptTokens + j.produced.length };
        res.write(`data: ${JSON.stringify({ state: j.state, finish_reason: j.finishReason, usage: u,
                                             error: j.error })}\n\n`);
        res.write('data: [DONE]\n\n');
        s.done = true;
        streams.delete(s);
        res.end();
      }
    };
    const ka = setInterval(() => { if (!s.done) res.write(': keep-alive\n\n'); }, 1000);
    res.on('close', () => { clearInterval(ka); s.done = true; streams.delete(s); });
    streams.add(s);
    s.pump();
  }

  async function handle(req, res) {
    const url = new URL(req.url, 'http://x');
    const p = url.pathname;
    if (p.startsWith('/__mock/')) {
      if (p === '/__mock/log') return sendJson(res, 200, log);
      if (p === '/__mock/last_job_request') return sendJson(res, 200, ctl.lastJobRequest);
      const body = req.method === 'POST' ? JSON.parse((await readBody(req)) || '{}') : {};
      if (p === '/__mock/queue_full') { ctl.queueFull = Boolean(body.on); return sendJson(res, 200, ctl); }
      if (p === '/__mock/pause') { ctl.paused = Boolean(body.on); return sendJson(res, 200, ctl); }
      if (p === '/__mock/models') {
        const all = MODELS.map((m) => m.id);
        ctl.served = Array.isArray(body.ids) ? all.filter((id) => body.ids.includes(id)) : all;
        return sendJson(res, 200, ctl);
      }
      if (p === '/__mock/drop') {
        const n = streams.size;
        for (const s of [...streams]) { s.done = true; streams.delete(s); s.res.socket.destroy(); }
        return sendJson(res, 200, { dropped: n });
      }
      return sendError(res, 404, 'invalid_request_error', 'not_found', 'no such control');
    }
    if (!p.startsWith('/v1/') && p !== '/metrics') {
      if (url.searchParams.has('api_key') || url.searchParams.has('key')) {
        return sendError(res, 401, 'invalid_request_error', 'api_key_in_query',
                         'API keys are accepted only in the Authorization header, never in the URL');
      }
      return serveStatic(req, res, p);
    }
    const key = auth(req, res);
    if (!key) return;
    if (p === '/v1/models' && req.method === 'GET') {
      const data = MODELS.filter((m) => ctl.served.includes(m.id))
        .map((m) => ({ id: m.id, object: 'model', created: 0, owned_by: 'glmspark',
                       max_model_len: m.max_model_len }));
      return sendJson(res, 200, { object: 'list', data });
    }
    if (p === '/metrics') {
      if (key.scope !== 'admin') return sendError(res, 403, 'permission_error', 'insufficient_scope', 'Admin scope required.');
      const all = [...jobs.values()];
      res.writeHead(200, { 'Content-Type': 'text/plain; version=0.0.4' });
      return res.end([
        '# TYPE glmspark_queue_depth gauge',
        `glmspark_queue_depth ${all.filter((j) => j.state === 'queued').length}`,
        '# TYPE glmspark_jobs_running gauge',
        `glmspark_jobs_running ${all.filter((j) => j.state === 'running').length}`,
        '# TYPE glmspark_tokens_total counter',
        `glmspark_tokens_total ${tokensTotal}`,
        '# TYPE glmspark_ttft_seconds histogram',
        `glmspark_ttft_seconds_sum ${all.filter((j) => j.firstTok).reduce((a, j) => a + (j.firstTok - j.created) / 1000, 0)}`,
        `glmspark_ttft_seconds_count ${all.filter((j) => j.firstTok).length}`,
        '',
      ].join('\n'));
    }
    if (p === '/v1/jobs' && req.method === 'POST') {
      let body;
      try { body = JSON.parse(await readBody(req)); } catch (_) {
        return sendError(res, 400, 'invalid_request_error', 'invalid_json', 'The body is not valid JSON.');
      }
      if (!Array.isArray(body.messages) || body.messages.length === 0) {
        return sendError(res, 400, 'invalid_request_error', 'invalid_value', "'messages' must be a non-empty array.");
      }
      ctl.lastJobRequest = body;
      if (typeof body.model !== 'string') {
        return sendError(res, 400, 'invalid_request_error', null, "'model' is required and must be a string");
      }
      if (!ctl.served.includes(body.model)) {
        return sendError(res, 404, 'invalid_request_error', 'model_not_found',
                         `the model '${body.model}' is not served by any live engine`);
      }
      if (key.rpm === 0) {
        return sendError(res, 429, 'rate_limit_error', 'rate_limit_exceeded',
                         'this key is limited to 0 requests per minute', { 'Retry-After': '7' });
      }
      if (ctl.queueFull) {
        return sendError(res, 503, 'server_error', 'queue_full', 'the queue is full; retry later', { 'Retry-After': '5' });
      }
      const text = body.messages.map((m) => m.content).join(' ');
      const maxTokens = body.max_tokens || 64;
      const id = `job-${String(nextId++).padStart(32, '0')}`;
      const j = { id, owner: key.name, model: body.model, state: 'queued', created: Date.now(),
                  started: 0, firstTok: 0, finished: 0, attempts: 0, produced: [],
                  script: script(maxTokens, !(body.thinking && body.thinking.type === 'disabled')),
                  promptTokens: text.split(/\s+/).length, finishReason: null, error: null, maxTokens,
                  cancel: false, request: body, failAt: /\bFAIL\b/.test(text) ? 3 : null };
      jobs.set(id, j);
      order.push(id);
      return sendJson(res, 202, { id, object: 'job', state: 'queued', created_at: Math.floor(j.created / 1000),
                                  model: body.model, prompt_tokens: j.promptTokens, max_tokens: maxTokens });
    }
    if (p === '/v1/jobs' && req.method === 'GET') {
      const limit = Math.max(1, Math.min(100, Number(url.searchParams.get('limit')) || 20));
      const after = url.searchParams.get('after');
      let list = order.slice().reverse().map((id) => jobs.get(id))
        .filter((j) => key.scope === 'admin' || j.owner === key.name);
      if (after) {
        const i = list.findIndex((j) => j.id === after);
        list = i >= 0 ? list.slice(i + 1) : [];
      }
      const page = list.slice(0, limit);
      return sendJson(res, 200, { object: 'list', data: page.map((j) => publicJob(j, false)),
                                  has_more: list.length > limit });
    }
    const m = /^\/v1\/jobs\/([^/]+)(\/events|\/cancel)?$/.exec(p);
    if (m) {
      const j = jobs.get(decodeURIComponent(m[1]));
      if (!j || (key.scope !== 'admin' && j.owner !== key.name)) {
        return sendError(res, 404, 'invalid_request_error', 'job_not_found', `No job '${m[1]}'.`);
      }
      if (!m[2] && req.method === 'GET') return sendJson(res, 200, publicJob(j));
      if (m[2] === '/events' && req.method === 'GET') return events(req, res, j);
      if (m[2] === '/cancel' && req.method === 'POST') {
        if (j.state === 'queued') {
          j.state = 'cancelled';
          j.finishReason = 'cancelled';
          j.finished = Date.now();
          wake(j);
        } else if (j.state === 'running') {
          j.cancel = true;
        }
        return sendJson(res, 200, publicJob(j));
      }
    }
    return sendError(res, 404, 'invalid_request_error', 'not_found', `No route for ${req.method} ${p}.`);
  }

  const server = http.createServer((req, res) => {
    handle(req, res).catch((e) => {
      if (!res.headersSent) sendError(res, 500, 'server_error', 'internal', String(e));
      else res.end();
    });
  });
  return new Promise((resolve) => {
    server.listen(port, '127.0.0.1', () => {
      const url = `http://127.0.0.1:${server.address().port}`;
      resolve({
        url, jobs, log, ctl,
        close() {
          clearInterval(timer);
          for (const s of streams) s.res.socket.destroy();
          return new Promise((r) => server.close(() => r()));
        },
      });
    });
  });
}

if (process.argv[1] && fileURLToPath(import.meta.url) === path.resolve(process.argv[1])) {
  const i = process.argv.indexOf('--port');
  const port = i > 0 ? Number(process.argv[i + 1]) : 8080;
  startMock({ port }).then((m) => {
    console.log(`URL=${m.url}`);
    for (const [k, v] of Object.entries(KEYS)) console.log(`API_KEY_${v.name.toUpperCase()}=${k}`);
  });
}
