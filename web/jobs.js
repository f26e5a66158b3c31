// jobs.js - job objects from the API turned into what the UI shows, and stream chunks applied.
//
// summarize() reads a job as GET /v1/jobs and /v1/jobs/{id} return it (fcgi/api_server.c
// job_object: state, queue_position, attempts, created_at, timings {created_at, claimed_at,
// first_token_at, finished_at, queue_wait_s, ttft_s}, usage, finish_reason, output, error)
// and computes the figures of the job list: queue wait, time to first token, tokens/s,
// tokens. Times may come as unix seconds, milliseconds or ISO strings. applyChunk() folds
// one SSE data payload into {seq, content, reasoning, tool, state, finishReason, usage, error}.
// No DOM use here: tests/web/test_sse.mjs runs it under node.

export const FINAL_STATES = new Set(['succeeded', 'failed', 'cancelled']);

export function isFinal(state) { return FINAL_STATES.has(state); }

// A time value as milliseconds since the epoch, or null.
export function toMs(v) {
  if (v === null || v === undefined || v === '') return null;
  if (typeof v === 'number') return v < 1e11 ? v * 1000 : v; // seconds vs. ms
  const n = Number(v);
  if (Number.isFinite(n)) return toMs(n);
  const t = Date.parse(v);
  return Number.isFinite(t) ? t : null;
}

function first(...vals) {
  for (const v of vals) if (v !== null && v !== undefined) return v;
  return null;
}

// {id, state, model, owner, queuePosition, attempts, createdMs, ttftMs, tokens, promptTokens,
//  cachedTokens, tokPerS, finishReason, errorMessage} for one job object; now: Date.now() for
//  running jobs.
export function summarize(job, now = Date.now()) {
  const t = job.timings || {};
  const u = job.usage || {};
  const createdMs = toMs(first(job.created_at, job.created, t.created_at));
  const startedMs = toMs(first(t.claimed_at, t.started_at, job.started_at));
  const firstTokMs = toMs(first(t.first_token_at, job.first_token_at));
  const finishedMs = toMs(first(t.finished_at, job.finished_at));
  // TTFT as the server measures it (first token - claim) when it says; else from the times.
  let ttftMs = typeof t.ttft_s === 'number' ? t.ttft_s * 1000 : first(t.ttft_ms);
  if (ttftMs === null && firstTokMs !== null) {
    const from = startedMs !== null ? startedMs : createdMs;
    if (from !== null) ttftMs = firstTokMs - from;
  }
  let waitMs = typeof t.queue_wait_s === 'number' ? t.queue_wait_s * 1000 : null;
  if (waitMs === null && startedMs !== null && createdMs !== null) waitMs = startedMs - createdMs;
  const tokens = first(u.completion_tokens, job.completion_tokens);
  let tokPerS = first(t.tokens_per_second);
  if (tokPerS === null && tokens !== null && firstTokMs !== null) {
    const end = finishedMs !== null ? finishedMs : now;
    const s = (end - firstTokMs) / 1000;
    if (s > 0 && tokens > 1) tokPerS = (tokens - 1) / s;
  }
  let err = job.error;
  if (err && typeof err === 'object') err = err.message || JSON.stringify(err);
  return {
    id: String(job.id),
    state: job.state || job.status || 'unknown',
    model: job.model || '',
    // owner: {name, prefix} from the API (a plain string is accepted too).
    owner: (job.owner && typeof job.owner === 'object'
      ? [job.owner.name, job.owner.prefix && `(${job.owner.prefix})`].filter(Boolean).join(' ')
      : first(job.owner, job.key_name, job.api_key_name, job.key_prefix)) || '',
    queuePosition: first(job.queue_position),
    attempts: first(job.attempts, job.attempt),
    createdMs,
    startedMs,
    waitMs,
    ttftMs,
    tokens,
    promptTokens: first(u.prompt_tokens, job.prompt_tokens),
    // Prompt tokens the engine reused from its prefix cache (OpenAI's usage field).
    cachedTokens: first(u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens),
    tokPerS,
    finishReason: job.finish_reason || '',
    errorMessage: err || '',
  };
}

export function fmtMs(ms) {
  if (ms === null || ms === undefined || !Number.isFinite(ms)) return '–';
  if (ms < 1000) return `${Math.round(ms)} ms`;
  if (ms < 60000) return `${(ms / 1000).toFixed(ms < 10000 ? 2 : 1)} s`;
  return `${Math.floor(ms / 60000)} min ${Math.round((ms % 60000) / 1000)} s`;
}

export function fmtRate(r) {
  if (r === null || r === undefined || !Number.isFinite(r)) return '–';
  return r >= 100 ? r.toFixed(0) : r.toFixed(1);
}

export function fmtNum(n) {
  return n === null || n === undefined ? '–' : String(n);
}

export function fmtTime(ms, now = Date.now()) {
  if (ms === null) return '–';
  const d = new Date(ms);
  const sameDay = new Date(now).toDateString() === d.toDateString();
  return sameDay ? d.toLocaleTimeString() : d.toLocaleString();
}

// An empty stream state.
export function newStreamState() {
  return { seq: '', content: '', reasoning: '', tool: '', state: '', finishReason: '',
           usage: null, error: '' };
}

// Folds one SSE data payload into st (mutated) and returns true if the text changed.
// Accepts the jobs API's {seq, kind: content|reasoning|tool, text} chunk and its closing
// {state, finish_reason, usage, error} event, an OpenAI chat.completion.chunk
// (choices[].delta.{content, reasoning_content, reasoning, tool_calls}, finish_reason, usage)
// and an {error: {...}} event.
export function applyChunk(st, payload) {
  let changed = false;
  // The closing event of /v1/jobs/{id}/events: {state, finish_reason, usage, error}.
  if (typeof payload.state === 'string') st.state = payload.state;
  if (typeof payload.finish_reason === 'string') st.finishReason = payload.finish_reason;
  if (payload.error) {
    st.error = typeof payload.error === 'object'
      ? (payload.error.message || JSON.stringify(payload.error)) : String(payload.error);
    return true;
  }
  if (typeof payload.kind === 'string' && typeof payload.text === 'string') {
    if (payload.kind === 'reasoning') st.reasoning += payload.text;
    else if (payload.kind === 'tool') st.tool += payload.text;
    else st.content += payload.text;
    return payload.text !== '';
  }
  if (payload.usage) st.usage = payload.usage;
  for (const ch of payload.choices || []) {
    const d = ch.delta || ch.message || {};
    const r = first(d.reasoning_content, d.reasoning);
    if (typeof r === 'string' && r) { st.reasoning += r; changed = true; }
    if (typeof d.content === 'string' && d.content) { st.content += d.content; changed = true; }
    if (Array.isArray(d.tool_calls)) {
      for (const tc of d.tool_calls) {
        const f = tc.function || {};
        if (f.name) st.tool += `${st.tool ? '\n' : ''}${f.name}(`;
        if (typeof f.arguments === 'string') st.tool += f.arguments;
        changed = true;
      }
    }
    if (ch.finish_reason) st.finishReason = ch.finish_reason;
  }
  return changed;
}

// Parses the Prometheus text exposition into {name: [{labels, value}]}.
export function parseMetrics(text) {
  const out = {};
  for (const line of text.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const m = /^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)/.exec(line);
    if (!m) continue;
    const labels = {};
    if (m[2]) {
      for (const lm of m[2].slice(1, -1).matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) {
        labels[lm[1]] = lm[2];
      }
    }
    const v = Number(m[3]);
    (out[m[1]] = out[m[1]] || []).push({ labels, value: v });
  }
  return out;
}

// The sum of a metric's samples (all label sets), or null if absent. names: candidates.
export function metricSum(metrics, ...names) {
  for (const n of names) {
    if (metrics[n]) return metrics[n].reduce((a, s) => a + s.value, 0);
  }
  return null;
}
