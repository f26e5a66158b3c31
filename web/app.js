// app.js - the glmspark web UI: sign in, compose, live job list, streaming job view.
//
// Routes live in the URL fragment: "#/" is the home view (compose + job list), "#/jobs/<id>"
// one job. The job view streams GET /v1/jobs/{id}/events with fetch (sse.js) and keeps, per
// job, {seq, content, reasoning, tool} in sessionStorage: after a reload or a dropped
// connection it shows what it had and asks for the rest with Last-Event-ID = the last applied
// seq, skipping any event whose id is not above it, so no text is lost or shown twice. State
// and figures come from polling GET /v1/jobs/{id} (every 2 s while the job is not final) and
// GET /v1/jobs (every 3 s on the home view). The model picker in the header lists GET /v1/models
// (read at sign-in and page load, when the tab is shown again, and after a model_not_found
// answer); the pick is kept in localStorage (models.js). All text from the server is set with
// textContent.

import { Api, ApiError, clearKey, describeError, loadKey, saveKey } from './api.js';
import { StreamHttpError, openEventStream } from './sse.js';
import { MODEL_SLOT, contextHint, modelList, pickModel } from './models.js';
import { applyChunk, fmtMs, fmtNum, fmtRate, fmtTime, isFinal, metricSum, newStreamState,
         parseMetrics, summarize } from './jobs.js';

const JOBS_POLL_MS = 3000;
const JOB_POLL_MS = 2000;
const METRICS_POLL_MS = 5000;
const PAGE = 20;
const STREAM_PREFIX = 'glmspark.stream.';
const PROMPT_PREFIX = 'glmspark.prompt.';

const $ = (id) => document.getElementById(id);
const store = window.sessionStorage;

let apiKey = loadKey(store);
const api = new Api({ getKey: () => apiKey });
let models = [];  // [{id, contextLen}] from the last GET /v1/models
let modelId = ''; // the picked model, sent as the "model" of every request

// ---------------------------------------------------------------------------
// Small helpers

function show(el, on) { el.hidden = !on; }

function setError(el, msg) {
  el.textContent = msg || '';
  el.hidden = !msg;
}

function announce(msg) {
  const a = $('announce');
  a.textContent = '';
  // A fresh text node after a tick makes screen readers speak a repeated message too.
  setTimeout(() => { a.textContent = msg; }, 50);
}

function banner(msg) { setError($('banner'), msg); }

function stateBadge(el, state) {
  el.textContent = state;
  el.className = `state state-${state}`;
}

function storeGet(k) {
  try { return JSON.parse(store.getItem(k) || 'null'); } catch (_) { return null; }
}

function storeSet(k, v) {
  try { store.setItem(k, JSON.stringify(v)); return true; } catch (_) { return false; }
}

// Preferences outlive the tab (localStorage), unlike the key and the streams; touching
// localStorage may throw (storage disabled), which only costs the preference.
function prefGet(k) {
  try { return window.localStorage.getItem(k) || ''; } catch (_) { return ''; }
}

function prefSet(k, v) {
  try { window.localStorage.setItem(k, v); } catch (_) { /* storage disabled */ }
}

// A poller that runs fn every ms while started, waiting for each run to finish.
function poller(fn, ms) {
  let timer = null;
  let on = false;
  const tick = async () => {
    timer = null;
    if (!on) return;
    try { await fn(); } finally { if (on) timer = setTimeout(tick, ms); }
  };
  return {
    start() { if (!on) { on = true; tick(); } },
    stop() { on = false; if (timer) clearTimeout(timer); timer = null; },
    now() { if (on) { if (timer) clearTimeout(timer); timer = null; tick(); } },
    get running() { return on; },
  };
}

// An API error that means the key is no longer good: sign out and say why.
function handleAuthError(err) {
  if (err instanceof ApiError && err.status === 401) {
    signOut(describeError(err));
    return true;
  }
  return false;
}

// ---------------------------------------------------------------------------
// Sign in / out

async function signIn(ev) {
  ev.preventDefault();
  const input = $('api-key');
  const key = input.value.trim();
  setError($('signin-error'), '');
  if (!key) {
    setError($('signin-error'), 'Enter your API key.');
    input.focus();
    return;
  }
  if (/\s/.test(key)) {
    setError($('signin-error'), 'An API key has no spaces in it. Check what was pasted.');
    input.focus();
    return;
  }
  const btn = $('signin-button');
  btn.disabled = true;
  const probe = new Api({ getKey: () => key });
  try {
    const models = await probe.models();
    apiKey = key;
    saveKey(store, key);
    input.value = '';
    setModels(models);
    banner('');
    enterApp();
  } catch (err) {
    setError($('signin-error'), describeError(err, 'Signing in'));
    input.focus();
  } finally {
    btn.disabled = false;
  }
}

function signOut(message) {
  apiKey = '';
  clearKey(store);
  for (let i = store.length - 1; i >= 0; i--) {
    const k = store.key(i);
    if (k && k.startsWith('glmspark.')) store.removeItem(k);
  }
  leaveJob();
  jobsPoll.stop();
  metricsPoll.stop();
  models = [];
  modelId = '';
  metricsOk = false;
  lastTokens = null;
  jobsShown = PAGE;
  $('model-select').replaceChildren();
  show($('model-box'), false);
  setModelNote('');
  $('jobs-body').textContent = '';
  show($('queue-stats'), false);
  show($('jobs-scope'), false);
  show($('sign-out'), false);
  show($('home'), false);
  show($('job'), false);
  show($('signin'), true);
  setError($('signin-error'), message || '');
  if (message) banner(''); // the sign-in form shows it, next to the field
  if (location.hash && location.hash !== '#/') history.replaceState(null, '', '#/');
  $('api-key').focus();
  if (!message) announce('Signed out.');
}

// ---------------------------------------------------------------------------
// Models

// The note above the compose form: why the picked model is not the one picked before, or that
// none is served. Spoken once when it changes, not at every refresh of the list.
function setModelNote(msg) {
  const el = $('model-note');
  const changed = el.textContent !== msg;
  setError(el, msg);
  if (changed && msg) announce(msg);
}

function showContext() {
  const hint = contextHint(models.find((m) => m.id === modelId));
  setError($('context-hint'), hint);
}

// Fills the picker from a GET /v1/models response: the remembered pick while it is listed
// (the current one when nothing is remembered), else the first model, said in the note.
function setModels(resp) {
  models = modelList(resp);
  const pick = pickModel(models, prefGet(MODEL_SLOT) || modelId);
  modelId = pick.id;
  const sel = $('model-select');
  sel.replaceChildren(...models.map((m) => {
    const o = document.createElement('option');
    o.value = m.id;
    o.textContent = m.id;
    return o;
  }));
  sel.value = modelId;
  sel.disabled = models.length === 0;
  show($('model-box'), true);
  showContext();
  if (!models.length) {
    setModelNote('No model is being served right now: a job cannot be submitted until an ' +
                 'engine serves one.');
  } else if (pick.missing) {
    setModelNote(`The model picked before, ${pick.missing}, is not being served now; ` +
                 `using ${modelId}.`);
  } else {
    setModelNote('');
  }
}

async function loadModels() {
  try {
    setModels(await api.models());
    return true;
  } catch (err) {
    if (!handleAuthError(err)) banner(describeError(err, 'Loading the model list'));
    return false;
  }
}

function pickFromSelect() {
  modelId = $('model-select').value;
  prefSet(MODEL_SLOT, modelId);
  setModelNote('');
  showContext();
}

function enterApp() {
  show($('signin'), false);
  show($('sign-out'), true);
  route();
}

// ---------------------------------------------------------------------------
// Compose

const NUM_FIELDS = [
  ['temperature', 'temperature', false], ['top-p', 'top_p', false], ['top-k', 'top_k', true],
  ['min-p', 'min_p', false], ['presence-penalty', 'presence_penalty', false],
  ['frequency-penalty', 'frequency_penalty', false],
  ['repetition-penalty', 'repetition_penalty', false], ['seed', 'seed', true],
  ['max-tokens', 'max_tokens', true],
];

function labelOf(input) {
  const l = document.querySelector(`label[for="${input.id}"]`);
  return l ? l.textContent.replace(/\(optional\)/, '').trim() : input.name;
}

// The chat-completions body from the form, or throws Error naming the bad field.
function buildRequest() {
  const system = $('system-prompt').value;
  const message = $('user-message').value;
  if (!message.trim()) {
    const e = new Error('Write a message first.');
    e.field = $('user-message');
    throw e;
  }
  const body = { messages: [] };
  if (modelId) body.model = modelId;
  if (system.trim()) body.messages.push({ role: 'system', content: system });
  body.messages.push({ role: 'user', content: message });
  for (const [id, name, integer] of NUM_FIELDS) {
    const input = $(id);
    if (input.validity.badInput || (input.value !== '' && !input.checkValidity())) {
      const e = new Error(`${labelOf(input)}: ${input.validationMessage || 'not a valid number'}.`);
      e.field = input;
      throw e;
    }
    if (input.value === '') continue;
    const v = Number(input.value);
    if (!Number.isFinite(v) || (integer && !Number.isInteger(v))) {
      const e = new Error(`${labelOf(input)} must be ${integer ? 'a whole number' : 'a number'}.`);
      e.field = input;
      throw e;
    }
    body[name] = v;
  }
  const thinking = $('thinking').checked;
  body.thinking = { type: thinking ? 'enabled' : 'disabled' };
  if ($('json-output').checked) {
    const text = $('json-schema').value.trim();
    if (!text) {
      body.response_format = { type: 'json_object' };
    } else {
      let schema;
      try {
        schema = JSON.parse(text);
      } catch (err) {
        const e = new Error(`JSON Schema: not valid JSON (${err.message}).`);
        e.field = $('json-schema');
        throw e;
      }
      if (!schema || typeof schema !== 'object' || Array.isArray(schema)) {
        const e = new Error('JSON Schema: must be a JSON object.');
        e.field = $('json-schema');
        throw e;
      }
      body.response_format = { type: 'json_schema', json_schema: { name: 'web', schema, strict: true } };
    }
  }
  return body;
}

async function submitJob(ev) {
  ev.preventDefault();
  setError($('compose-error'), '');
  let body;
  try {
    body = buildRequest();
  } catch (e) {
    setError($('compose-error'), e.message);
    if (e.field) e.field.focus();
    return;
  }
  const btn = $('submit-job');
  btn.disabled = true;
  try {
    if (!body.model) {
      // The list has not arrived yet (page load) or was empty: ask once more.
      await loadModels();
      if (!modelId) throw new Error('no model is being served right now');
      body.model = modelId;
    }
    const job = await api.createJob(body);
    if (!job || !job.id) throw new Error('the server returned no job id');
    storeSet(PROMPT_PREFIX + job.id, body.messages);
    $('user-message').value = '';
    announce('Job submitted.');
    location.hash = `#/jobs/${encodeURIComponent(job.id)}`;
  } catch (err) {
    if (err instanceof ApiError && err.code === 'model_not_found') {
      // The engine serving it went away since the list was read: read it again.
      const ok = await loadModels();
      if (!apiKey) return; // the key went bad meanwhile: signed out
      const now = ok && modelId && modelId !== body.model ? `; ${modelId} is picked now` : '';
      setError($('compose-error'),
               `The model ${body.model} is not being served now, so the job was not submitted. ` +
               `The list of models was refreshed${now}: check the model and submit again.`);
    } else if (!handleAuthError(err)) {
      setError($('compose-error'), describeError(err, 'Submitting the job'));
    }
  } finally {
    btn.disabled = false;
  }
}

// ---------------------------------------------------------------------------
// Job list (home)

let jobsShown = PAGE;
let jobsHasMore = false;

function cell(tr, text, label, cls) {
  const td = document.createElement('td');
  td.textContent = text;
  td.dataset.label = label;
  if (cls) td.className = cls;
  tr.appendChild(td);
  return td;
}

function renderJobs(jobs, showOwner, showModel) {
  const body = $('jobs-body');
  const now = Date.now();
  const rows = [];
  for (const j of jobs) {
    const s = summarize(j, now);
    const tr = document.createElement('tr');
    tr.dataset.jobId = s.id;
    const td = document.createElement('td');
    td.dataset.label = 'Job';
    const a = document.createElement('a');
    a.href = `#/jobs/${encodeURIComponent(s.id)}`;
    a.textContent = s.id;
    a.title = s.id;
    a.className = 'job-link';
    td.appendChild(a);
    tr.appendChild(td);
    const owner = cell(tr, s.owner || '–', 'Key', 'owner-col');
    owner.hidden = !showOwner;
    const st = cell(tr, '', 'State');
    const badge = document.createElement('span');
    stateBadge(badge, s.state);
    st.appendChild(badge);
    const model = cell(tr, s.model || '–', 'Model', 'model-col');
    model.hidden = !showModel;
    cell(tr, s.state === 'queued' ? fmtNum(s.queuePosition) : '–', 'Queue');
    cell(tr, fmtMs(s.ttftMs), 'TTFT');
    cell(tr, fmtRate(s.tokPerS), 'Tokens/s');
    cell(tr, fmtNum(s.tokens), 'Tokens');
    cell(tr, fmtNum(s.attempts), 'Attempts');
    cell(tr, fmtTime(s.createdMs, now), 'Created');
    rows.push(tr);
  }
  body.replaceChildren(...rows);
  show($('jobs-table'), jobs.length > 0);
  show($('jobs-empty'), jobs.length === 0);
  for (const th of document.querySelectorAll('th.owner-col')) th.hidden = !showOwner;
  for (const th of document.querySelectorAll('th.model-col')) th.hidden = !showModel;
  show($('jobs-more'), jobsHasMore);
}

function listOf(resp) {
  if (Array.isArray(resp)) return resp;
  if (resp && Array.isArray(resp.data)) return resp.data;
  if (resp && Array.isArray(resp.jobs)) return resp.jobs;
  return [];
}

async function refreshJobs() {
  try {
    const resp = await api.listJobs({ limit: Math.min(jobsShown, 100) });
    const jobs = listOf(resp);
    jobsHasMore = Boolean(resp && resp.has_more);
    const admin = Boolean(resp && (resp.scope === 'admin' || resp.all === true)) || metricsOk;
    const owners = new Set(jobs.map((j) => summarize(j).owner).filter(Boolean));
    // The owner column only when the API names owners and there is more than one to tell apart.
    const showOwner = owners.size > 0 && (admin || owners.size > 1);
    // Likewise the model column: when there is a choice of models, or jobs of several.
    const jobModels = new Set(jobs.map((j) => j.model).filter(Boolean));
    const showModel = models.length > 1 || jobModels.size > 1;
    const scope = $('jobs-scope');
    scope.textContent = admin ? 'all keys (admin)' : '';
    show(scope, admin);
    renderJobs(jobs, showOwner, showModel);
    setError($('jobs-error'), '');
  } catch (err) {
    if (!handleAuthError(err)) setError($('jobs-error'), describeError(err, 'Loading the jobs'));
  }
}

const jobsPoll = poller(refreshJobs, JOBS_POLL_MS);

function loadMore() {
  jobsShown += PAGE;
  jobsPoll.now();
}

// Queue figures from /metrics (shown when this key may read them: admin keys). A key that
// gets 403/404 is not asked again this session.
let lastTokens = null;
let metricsOk = false;
const METRICS_DENIED = 'glmspark.metricsDenied';
async function refreshMetrics() {
  if (store.getItem(METRICS_DENIED)) { metricsPoll.stop(); return; }
  let text;
  try {
    text = await api.metrics();
  } catch (err) {
    // Not handleAuthError: /metrics may be closed to API keys without the key being bad.
    metricsOk = false;
    show($('queue-stats'), false);
    if (err instanceof ApiError && [401, 403, 404].includes(err.status)) {
      store.setItem(METRICS_DENIED, '1');
      metricsPoll.stop();
    }
    return;
  }
  if (!metricsOk) { metricsOk = true; jobsPoll.now(); } // re-render as the admin's list
  const m = parseMetrics(text);
  const queued = metricSum(m, 'glmspark_queue_depth', 'glmspark_jobs_queued');
  const running = metricSum(m, 'glmspark_jobs_running', 'glmspark_running');
  const tokens = metricSum(m, 'glmspark_tokens_total', 'glmspark_generated_tokens_total',
                           'glmspark_completion_tokens_total');
  const ttftSum = metricSum(m, 'glmspark_ttft_seconds_sum', 'glmspark_time_to_first_token_seconds_sum');
  const ttftCount = metricSum(m, 'glmspark_ttft_seconds_count',
                              'glmspark_time_to_first_token_seconds_count');
  const now = performance.now();
  let rate = null;
  if (tokens !== null && lastTokens && now > lastTokens.t) {
    rate = Math.max(0, (tokens - lastTokens.v) / ((now - lastTokens.t) / 1000));
  }
  if (tokens !== null) lastTokens = { v: tokens, t: now };
  $('stat-queued').textContent = fmtNum(queued);
  $('stat-running').textContent = fmtNum(running);
  $('stat-throughput').textContent = rate === null ? '…' : fmtRate(rate);
  $('stat-ttft').textContent = ttftCount ? fmtMs((ttftSum / ttftCount) * 1000) : '–';
  show($('queue-stats'), queued !== null || running !== null || tokens !== null);
}

const metricsPoll = poller(refreshMetrics, METRICS_POLL_MS);

// ---------------------------------------------------------------------------
// Job view

let view = null; // {id, st, abort, poll, final, saveTimer, ...} of the job shown

function renderStream(v) {
  $('job-output').textContent = v.st.content;
  $('job-reasoning').textContent = v.st.reasoning;
  show($('reasoning-box'), v.st.reasoning !== '');
  $('job-tool').textContent = v.st.tool;
  show($('tool-box'), v.st.tool !== '');
}

function saveStream(v, now) {
  const write = () => {
    v.saveTimer = null;
    if (!storeSet(STREAM_PREFIX + v.id, v.st)) store.removeItem(STREAM_PREFIX + v.id);
  };
  if (now) { if (v.saveTimer) clearTimeout(v.saveTimer); write(); return; }
  if (!v.saveTimer) v.saveTimer = setTimeout(write, 250);
}

function renderJobMeta(v, job) {
  const s = summarize(job);
  v.state = s.state;
  stateBadge($('job-state'), s.state);
  $('job-model').textContent = s.model || '–';
  $('job-queue').textContent = s.state === 'queued' ? fmtNum(s.queuePosition) : '–';
  $('job-wait').textContent = fmtMs(s.waitMs);
  $('job-ttft').textContent = fmtMs(s.ttftMs);
  $('job-rate').textContent = fmtRate(s.tokPerS);
  $('job-tokens').textContent = fmtNum(s.tokens);
  // Prompt tokens, and how many of them the engine's prefix cache served.
  $('job-prompt').textContent = s.promptTokens === null ? '–'
    : `${fmtNum(s.promptTokens)}${s.cachedTokens ? ` (${fmtNum(s.cachedTokens)} cached)` : ''}`;
  $('job-attempts').textContent = fmtNum(s.attempts);
  $('job-finish').textContent = s.finishReason || '–';
  show($('cancel-job'), !isFinal(s.state));
  if (v.connected) {
    const conn = $('job-conn');
    if (s.state === 'queued') {
      conn.textContent = `Waiting in the queue${s.queuePosition ? ` (position ${s.queuePosition})` : ''}; the output will appear here.`;
    } else if (s.state === 'running' && conn.textContent.startsWith('Waiting')) {
      conn.textContent = 'Streaming.';
    }
  }
  // A transient error of an earlier poll goes away once a poll succeeds; a failed cancel
  // (v.actionError) stays until the next click.
  if (s.state === 'failed') {
    setError($('job-error'), `The job failed: ${s.errorMessage || 'no reason given'}.`);
  } else {
    setError($('job-error'), v.actionError || (v.st.error ? `The job reported an error: ${v.st.error}` : ''));
  }
  const msgs = (job.request && job.request.messages) || storeGet(PROMPT_PREFIX + v.id);
  if (Array.isArray(msgs) && msgs.length) {
    $('job-prompt').textContent = msgs
      .map((m) => `${m.role}: ${typeof m.content === 'string' ? m.content : JSON.stringify(m.content)}`)
      .join('\n\n');
    show($('prompt-box'), true);
  }
}

// Takes the final output from the job row: the stored output is the truth once a job ends.
function adoptOutput(v, job) {
  const out = job.output || {};
  if (typeof out.content === 'string') v.st.content = out.content;
  const r = out.reasoning_content !== undefined ? out.reasoning_content : out.reasoning;
  if (typeof r === 'string') v.st.reasoning = r;
  if (Array.isArray(out.tool_calls) && out.tool_calls.length) {
    v.st.tool = out.tool_calls
      .map((tc) => `${(tc.function && tc.function.name) || '?'}(${(tc.function && tc.function.arguments) || ''})`)
      .join('\n');
  }
  renderStream(v);
}

async function refreshJob(v) {
  let job;
  try {
    job = await api.getJob(v.id, { signal: v.abort.signal });
  } catch (err) {
    if (err && err.name === 'AbortError') return null;
    if (handleAuthError(err)) return null;
    setError($('job-error'), describeError(err, 'Loading the job'));
    if (err instanceof ApiError && err.status === 404) stopJob(v, 'Not found.');
    return null;
  }
  if (view !== v) return null;
  renderJobMeta(v, job);
  if (isFinal(job.state) && !v.final) finishJob(v, job);
  return job;
}

function finishJob(v, job) {
  v.final = true;
  v.poll.stop();
  v.streamAbort.abort();
  adoptOutput(v, job);
  store.removeItem(STREAM_PREFIX + v.id);
  $('job-output').setAttribute('aria-busy', 'false');
  const verb = { succeeded: 'finished', failed: 'failed', cancelled: 'was cancelled' }[job.state];
  $('job-conn').textContent = `The job ${verb || job.state}.`;
  announce(`Job ${job.state}.`);
}

function stopJob(v, msg) {
  v.poll.stop();
  v.streamAbort.abort();
  $('job-conn').textContent = msg;
}

function sleep(ms, signal) {
  return new Promise((resolve) => {
    const t = setTimeout(resolve, ms);
    signal.addEventListener('abort', () => { clearTimeout(t); resolve(); }, { once: true });
  });
}

// Follows the job's event stream until [DONE], reconnecting with backoff and Last-Event-ID.
async function follow(v) {
  const signal = v.streamAbort.signal;
  let backoff = 500;
  let resumes = 0;
  while (!signal.aborted && !v.final) {
    let done = false;
    const from = v.st.seq;
    try {
      $('job-conn').textContent = from === ''
        ? 'Connecting to the stream…' : `Resuming after event ${from}…`;
      await openEventStream({
        url: api.eventsUrl(v.id),
        headers: api.authHeaders(),
        lastEventId: from,
        signal,
        onOpen: () => {
          backoff = 500;
          v.connected = true;
          $('job-output').setAttribute('aria-busy', 'true');
          $('job-conn').textContent = from === ''
            ? 'Streaming.' : `Streaming (resumed after event ${from}).`;
          if (from !== '') { resumes++; v.resumedFrom = from; }
        },
        onEvent: (ev) => {
          if (ev.data === '[DONE]') { done = true; v.streamAbort.abort(); return; }
          // Skip what was already applied: ids are the chunk sequence numbers.
          if (ev.id !== '' && v.st.seq !== '' && Number(ev.id) <= Number(v.st.seq)) return;
          let payload;
          try { payload = JSON.parse(ev.data); } catch (_) { return; }
          const changed = applyChunk(v.st, payload);
          if (ev.id !== '') v.st.seq = ev.id;
          if (payload.error) setError($('job-error'), `The job reported an error: ${v.st.error}`);
          if (changed) renderStream(v);
          saveStream(v, false);
        },
        fetchImpl: (...a) => window.fetch(...a),
      });
    } catch (err) {
      if (signal.aborted || (err && err.name === 'AbortError')) break;
      if (err instanceof StreamHttpError) {
        const e = new ApiError(err.status, (err.body && err.body.error) || {}, err.retryAfterS);
        if (handleAuthError(e)) return;
        if (err.status === 404 || err.status === 403) {
          setError($('job-error'), describeError(e, 'Streaming the job'));
          stopJob(v, 'Not streaming.');
          return;
        }
        if (err.retryAfterS) backoff = Math.max(backoff, err.retryAfterS * 1000);
      }
    }
    v.connected = false;
    if (done || v.final) break;
    if (signal.aborted) break;
    saveStream(v, true);
    $('job-conn').textContent =
      `Connection lost; reconnecting in ${Math.round(backoff / 100) / 10} s…`;
    await sleep(backoff, signal);
    backoff = Math.min(backoff * 2, 10000);
    // The job may have ended while we were away: the poll below settles it.
    if (!signal.aborted) await refreshJob(v);
  }
  saveStream(v, true);
  if (view === v && !v.final) {
    // [DONE] arrived (or the job ended): fetch the final row for state, usage and output.
    await refreshJob(v);
    if (!v.final && view === v) v.poll.now();
  }
  return resumes;
}

function leaveJob() {
  if (!view) return;
  const v = view;
  view = null;
  v.poll.stop();
  v.abort.abort();
  v.streamAbort.abort();
  if (!v.final) saveStream(v, true);
}

async function openJob(id) {
  leaveJob();
  const saved = storeGet(STREAM_PREFIX + id);
  const st = Object.assign(newStreamState(), saved || {});
  const v = { id, st, final: false, state: '', actionError: '', abort: new AbortController(),
              streamAbort: new AbortController(), saveTimer: null, connected: false };
  v.poll = poller(() => refreshJob(v), JOB_POLL_MS);
  view = v;
  $('job-id').textContent = id;
  stateBadge($('job-state'), '…');
  for (const k of ['job-model', 'job-queue', 'job-wait', 'job-ttft', 'job-rate', 'job-tokens',
                   'job-attempts', 'job-finish']) {
    $(k).textContent = '–';
  }
  setError($('job-error'), '');
  show($('prompt-box'), false);
  show($('cancel-job'), false);
  $('cancel-job').disabled = false;
  $('job-conn').textContent = saved ? `Restored up to event ${st.seq || 0}.` : '';
  renderStream(v);
  $('job-title').focus();
  const job = await refreshJob(v);
  if (view !== v || !job || v.final) return;
  v.poll.start();
  follow(v);
}

async function cancelJob() {
  const v = view;
  if (!v) return;
  const btn = $('cancel-job');
  btn.disabled = true;
  v.actionError = '';
  try {
    await api.cancelJob(v.id);
    $('job-conn').textContent = 'Cancel requested…';
    announce('Cancel requested.');
    v.poll.now();
  } catch (err) {
    btn.disabled = false;
    if (!handleAuthError(err)) {
      v.actionError = describeError(err, 'Cancelling the job');
      setError($('job-error'), v.actionError);
    }
  }
}

// ---------------------------------------------------------------------------
// Routing and start-up

function route() {
  if (!apiKey) {
    leaveJob();
    show($('home'), false);
    show($('job'), false);
    show($('signin'), true);
    return;
  }
  const m = /^#\/jobs\/(.+)$/.exec(location.hash);
  if (m) {
    const id = decodeURIComponent(m[1]);
    show($('home'), false);
    show($('job'), true);
    jobsPoll.stop();
    metricsPoll.stop();
    if (!view || view.id !== id) openJob(id);
  } else {
    leaveJob();
    show($('job'), false);
    show($('home'), true);
    jobsPoll.start();
    metricsPoll.start();
  }
}

function init() {
  $('signin-form').addEventListener('submit', signIn);
  $('sign-out').addEventListener('click', () => signOut(''));
  $('compose-form').addEventListener('submit', submitJob);
  const showSchema = () => show($('json-schema-box'), $('json-output').checked);
  $('json-output').addEventListener('change', showSchema);
  showSchema(); // a browser may restore the box's state on reload
  $('model-select').addEventListener('change', pickFromSelect);
  $('jobs-more').addEventListener('click', loadMore);
  $('cancel-job').addEventListener('click', cancelJob);
  window.addEventListener('hashchange', route);
  window.addEventListener('pagehide', () => { if (view && !view.final) saveStream(view, true); });
  window.addEventListener('online', () => {
    // Wake a stream waiting out its backoff; the loop reconnects at once.
    if (view && !view.final && !view.connected) {
      view.streamAbort.abort();
      view.streamAbort = new AbortController();
      follow(view);
    }
  });
  document.addEventListener('visibilitychange', () => {
    if (document.hidden) { jobsPoll.stop(); metricsPoll.stop(); return; }
    if (apiKey) loadModels(); // engines may have come or gone while the tab was hidden
    if (apiKey && !$('home').hidden) { jobsPoll.start(); metricsPoll.start(); }
  });
  if (apiKey) {
    loadModels();
    enterApp();
  } else {
    route();
    $('api-key').focus();
  }
}

init();
