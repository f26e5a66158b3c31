// api.js - the glmspark HTTP API as the UI uses it: fetch with the API key, errors as ApiError.
//
// The key lives in sessionStorage (one browser tab, gone when the tab closes) and travels only
// in the Authorization header; it never appears in a URL, a log line or the DOM. Every call
// returns parsed JSON or throws ApiError with the HTTP status, the OpenAI error object's
// type/code/message and Retry-After. describeError() turns an error into the sentence the user
// reads. No DOM use here, so node can import it (tests/web/test_sse.mjs).

const KEY_SLOT = 'glmspark.apiKey';

export function loadKey(storage) {
  try { return storage.getItem(KEY_SLOT) || ''; } catch (_) { return ''; }
}

export function saveKey(storage, key) {
  storage.setItem(KEY_SLOT, key);
}

export function clearKey(storage) {
  try { storage.removeItem(KEY_SLOT); } catch (_) { /* storage disabled */ }
}

export class ApiError extends Error {
  // status: HTTP status, 0 when the server could not be reached.
  constructor(status, { type = '', code = '', message = '', param = '' } = {}, retryAfterS = null) {
    super(message || (status ? `HTTP ${status}` : 'network error'));
    this.name = 'ApiError';
    this.status = status;
    this.type = type || '';
    this.code = code === null || code === undefined ? '' : String(code);
    this.param = param || '';
    this.retryAfterS = retryAfterS;
  }
}

function retryAfter(resp) {
  const v = resp.headers.get('Retry-After');
  if (!v) return null;
  const n = Number(v);
  if (Number.isFinite(n) && n >= 0) return Math.ceil(n);
  const t = Date.parse(v);
  return Number.isFinite(t) ? Math.max(0, Math.ceil((t - Date.now()) / 1000)) : null;
}

// Builds an ApiError from a non-2xx response whose body may or may not be JSON.
export async function errorFromResponse(resp) {
  let err = {};
  try {
    const body = await resp.json();
    if (body && typeof body.error === 'object' && body.error) err = body.error;
    else if (body && typeof body.error === 'string') err = { message: body.error };
  } catch (_) { /* not JSON (e.g. an nginx error page) */ }
  return new ApiError(resp.status, err, retryAfter(resp));
}

export class Api {
  // getKey: () => the current key. fetchImpl: fetch (tests may pass another).
  constructor({ getKey, baseUrl = '', fetchImpl }) {
    this.getKey = getKey;
    this.baseUrl = baseUrl;
    this.fetchImpl = fetchImpl || ((...a) => globalThis.fetch(...a));
  }

  authHeaders() {
    const key = this.getKey();
    return key ? { Authorization: `Bearer ${key}` } : {};
  }

  url(path) { return this.baseUrl + path; }

  // Sends one request; resolves to the parsed JSON body (null for an empty body).
  async request(method, path, body, { signal, accept = 'application/json' } = {}) {
    const headers = { Accept: accept, ...this.authHeaders() };
    const init = { method, headers, signal, cache: 'no-store' };
    if (body !== undefined) {
      headers['Content-Type'] = 'application/json';
      init.body = JSON.stringify(body);
    }
    let resp;
    try {
      resp = await this.fetchImpl(this.url(path), init);
    } catch (e) {
      if (e && e.name === 'AbortError') throw e;
      throw new ApiError(0, { message: 'The server could not be reached.' });
    }
    if (!resp.ok) throw await errorFromResponse(resp);
    if (accept !== 'application/json') return resp.text();
    const text = await resp.text();
    return text ? JSON.parse(text) : null;
  }

  models(opts) { return this.request('GET', '/v1/models', undefined, opts); }

  // Creates a job from a chat-completions body; resolves to the job (202, with its id).
  createJob(body, opts) { return this.request('POST', '/v1/jobs', body, opts); }

  // One page of jobs, newest first. after: the last id of the previous page.
  listJobs({ limit = 20, after = '' } = {}, opts) {
    const q = new URLSearchParams({ limit: String(limit) });
    if (after) q.set('after', after);
    return this.request('GET', `/v1/jobs?${q}`, undefined, opts);
  }

  getJob(id, opts) { return this.request('GET', `/v1/jobs/${encodeURIComponent(id)}`, undefined, opts); }

  cancelJob(id, opts) {
    return this.request('POST', `/v1/jobs/${encodeURIComponent(id)}/cancel`, undefined, opts);
  }

  eventsUrl(id) { return this.url(`/v1/jobs/${encodeURIComponent(id)}/events`); }

  metrics(opts) { return this.request('GET', '/metrics', undefined, { ...opts, accept: 'text/plain' }); }
}

// The sentence shown to the user for an error from any API call. what: the action, e.g.
// 'Submitting the job'.
export function describeError(err, what = 'The request') {
  if (!(err instanceof ApiError) && !(err && typeof err.status === 'number')) {
    return `${what} failed: ${err && err.message ? err.message : String(err)}`;
  }
  const detail = err.message && !/^HTTP \d+$/.test(err.message) ? ` (${err.message})` : '';
  const wait = err.retryAfterS !== null && err.retryAfterS !== undefined
    ? ` Try again in ${err.retryAfterS} s.` : ' Try again shortly.';
  switch (err.status) {
    case 0: return `${what} failed: the server could not be reached. Check the connection.`;
    case 400:
      if (err.code === 'context_length_exceeded') {
        return `The prompt is too long for the model's context${detail}.`;
      }
      return `${what} was refused as invalid${err.param ? ` (field ${err.param})` : ''}${detail}.`;
    case 401: return 'The API key was not accepted. Check the key and sign in again.';
    case 403: return `This API key is not allowed to do that${detail}.`;
    case 404:
      if (err.code === 'model_not_found') {
        return `${what} failed: no engine serves that model now${detail}. Pick another model.`;
      }
      return `Not found: it does not exist or belongs to another key${detail}.`;
    case 413: return `The request is too large${detail}.`;
    case 429:
      if (err.code === 'concurrency_limit_exceeded') {
        return `This key already has as many unfinished jobs as it may (${err.message}).${wait}`;
      }
      return `Rate limit reached for this key (${err.message}).${wait}`;
    case 503:
      if (err.code === 'queue_full') return `The queue is full.${wait}`;
      if (err.code === 'database_unavailable') return `The service is unavailable right now.${wait}`;
      return `The service is unavailable right now${detail}.${wait}`;
    default: return `${what} failed with HTTP ${err.status}${detail}.`;
  }
}
