// sse.js - Server-Sent Events over fetch(), with resume by Last-Event-ID.
//
// EventSource cannot send an Authorization header, so the UI reads the event stream with
// fetch() and a ReadableStream reader and parses it here. SseParser follows the WHATWG
// "event stream interpretation" rules: lines end in CRLF, LF or CR; a line starting with ':'
// is a comment (the server's keep-alive); "data" lines of one event are joined with '\n'; an
// empty line dispatches the event; "id" sets the last event id (ignored if it contains NUL);
// "retry" sets the reconnection delay; an event whose data buffer is empty is not dispatched.
//
// openEventStream() does one connection; the caller (app.js) decides when to reconnect and
// passes the last id it has *applied*, so an event is never shown twice nor skipped.
// No DOM use here: tests/web/test_sse.mjs runs this module under node.

export class SseParser {
  constructor() {
    this.buffer = '';       // text not yet ending in a line break
    this.data = [];         // data lines of the event being built
    this.eventType = '';
    this.lastEventId = '';  // sticky across events, as the spec says
    this.retryMs = null;
    this.sawCr = false;     // previous chunk ended in CR: a following LF belongs to it
  }

  // Feeds decoded text; returns the events completed by it as
  // [{type, data, id}] where id is the last event id in force when the event was dispatched.
  push(text) {
    const events = [];
    let s = text;
    if (this.sawCr && s.startsWith('\n')) s = s.slice(1);
    this.sawCr = false;
    s = this.buffer + s;
    let start = 0;
    for (let i = 0; i < s.length; i++) {
      const c = s.charCodeAt(i);
      if (c !== 10 && c !== 13) continue;
      this.line(s.slice(start, i), events);
      if (c === 13) {
        if (i + 1 < s.length) {
          if (s.charCodeAt(i + 1) === 10) i++;
        } else {
          this.sawCr = true;
        }
      }
      start = i + 1;
    }
    this.buffer = s.slice(start);
    return events;
  }

  line(line, events) {
    if (line === '') {
      if (this.data.length > 0) {
        events.push({ type: this.eventType || 'message', data: this.data.join('\n'),
                      id: this.lastEventId });
      }
      this.data = [];
      this.eventType = '';
      return;
    }
    if (line.charCodeAt(0) === 58) return; // ':' comment / keep-alive
    const colon = line.indexOf(':');
    let field = line;
    let value = '';
    if (colon >= 0) {
      field = line.slice(0, colon);
      value = line.slice(colon + 1);
      if (value.startsWith(' ')) value = value.slice(1);
    }
    switch (field) {
      case 'data': this.data.push(value); break;
      case 'event': this.eventType = value; break;
      case 'id': if (!value.includes('\0')) this.lastEventId = value; break;
      case 'retry': if (/^[0-9]+$/.test(value)) this.retryMs = Number(value); break;
      default: break; // unknown fields are ignored
    }
  }
}

// Error for a stream response that was not a 200 event stream; status is the HTTP status
// (0 for a network failure) and body the parsed JSON error when the server sent one.
export class StreamHttpError extends Error {
  constructor(status, body, retryAfterS) {
    super((body && body.error && body.error.message) || `HTTP ${status}`);
    this.name = 'StreamHttpError';
    this.status = status;
    this.body = body;
    this.retryAfterS = retryAfterS;
  }
}

// Opens url with fetch and calls onEvent(event) for each SSE event until the server closes
// the stream or signal aborts. headers: extra request headers (Authorization). lastEventId:
// sent as Last-Event-ID when non-empty. Resolves to {ended: 'closed'} when the body ends;
// rejects with StreamHttpError for a non-2xx answer, or the fetch/read error (AbortError
// when aborted, TypeError when the connection drops).
export async function openEventStream({ url, headers = {}, lastEventId = '', signal,
                                        onEvent, onOpen, fetchImpl = globalThis.fetch }) {
  const h = { Accept: 'text/event-stream', 'Cache-Control': 'no-cache', ...headers };
  if (lastEventId !== '' && lastEventId !== null && lastEventId !== undefined) {
    h['Last-Event-ID'] = String(lastEventId);
  }
  const resp = await fetchImpl(url, { method: 'GET', headers: h, signal, cache: 'no-store' });
  if (!resp.ok) {
    let body = null;
    try { body = await resp.json(); } catch (_) { body = null; }
    const ra = Number(resp.headers.get('Retry-After'));
    throw new StreamHttpError(resp.status, body, Number.isFinite(ra) && ra > 0 ? ra : null);
  }
  if (onOpen) onOpen(resp);
  const parser = new SseParser();
  const reader = resp.body.getReader();
  const decoder = new TextDecoder('utf-8');
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      for (const ev of parser.push(decoder.decode(value, { stream: true }))) onEvent(ev);
    }
    const tail = decoder.decode();
    if (tail) for (const ev of parser.push(tail)) onEvent(ev);
  } finally {
    try { reader.releaseLock(); } catch (_) { /* already released */ }
  }
  return { ended: 'closed', retryMs: parser.retryMs };
}
