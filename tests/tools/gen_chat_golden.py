#!/usr/bin/env python3
"""gen_chat_golden.py - golden GLM chat renderings from Hugging Face transformers.

Renders a fixed set of OpenAI-style chat requests with the real GLM Jinja chat template
through transformers' own code path (PreTrainedTokenizerFast.apply_chat_template with
chat_template=<text>, tokenize=False; cross-checked against
transformers.utils.chat_template_utils.render_jinja_template, which apply_chat_template
calls) and writes tests/golden/chat/cases.jsonl: one JSON object per line,

    {"name": ..., "request": {...}, "expected": "<rendered prompt>"}

where "request" is exactly what `glmspark chat-template` reads on stdin (messages, tools,
add_generation_prompt, chat_template_kwargs.enable_thinking / clear_thinking) and the C
renderer (engine/shared/chat.c) must reproduce "expected" byte for byte. The first line is a
{"meta": ...} record naming the template and the transformers version.

The request is OpenAI-shaped: tool_calls[].function.arguments is a JSON *string*, as clients
send it. The GLM template iterates arguments.items(), so, like every server that serves GLM
(vLLM parses arguments before rendering), we json.loads() it (key order kept) before handing
the messages to transformers. That conversion is the only preprocessing.

Usage (on the machine where transformers is installed):
    gen_chat_golden.py --template GLM-4.7-Flash.jinja --out cases.jsonl
--local-jinja renders with a jinja2 environment configured like transformers' (for
development on a machine without transformers); its output is never a golden.

    gen_chat_golden.py --template T --diff-binary build/bin/glmspark [--n 400] [--local-jinja]
renders --n random requests (seeded: unicode whitespace, think tags in content, tool calls
with random JSON values including floats of every magnitude) with the reference and with
`glmspark chat-template --template glm47`, and reports every difference (exit status 1).
"""
import argparse
import copy
import json
import random
import subprocess
import sys

CALL_WEATHER = {
    "id": "call_1",
    "type": "function",
    "function": {
        "name": "get_weather",
        "arguments": json.dumps({"city": "Paris", "days": 3, "units": "metric"}),
    },
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather forecast for a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. \"Paris\""},
                    "days": {"type": "integer", "minimum": 1, "maximum": 10},
                    "units": {"type": "string", "enum": ["metric", "imperial"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Recherche sur le web — résultats en 中文 ok.\nSecond line\twith tab.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "filters": {"type": "object"},
                    "limit": {"type": "number", "default": 2.5},
                    "safe": {"type": "boolean", "default": True},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
    },
]


def user(text):
    return {"role": "user", "content": text}


def asst(content, **kw):
    m = {"role": "assistant", "content": content}
    m.update(kw)
    return m


def tool(call_id, content):
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def req(messages, tools=None, thinking=None, gen=True, clear_thinking=None):
    r = {"messages": messages}
    if tools is not None:
        r["tools"] = tools
    kwargs = {}
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    if clear_thinking is not None:
        kwargs["clear_thinking"] = clear_thinking
    if kwargs:
        r["chat_template_kwargs"] = kwargs
    r["add_generation_prompt"] = gen
    return r


def call(call_id, name, args):
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


CASES = [
    ("plain", req([user("Hello")])),
    ("plain_thinking_on", req([user("Hello")], thinking=True)),
    ("plain_thinking_off", req([user("Hello")], thinking=False)),
    ("system", req([{"role": "system", "content": "You are a terse assistant."},
                    user("What is 2+2?")])),
    ("multi_turn", req([{"role": "system", "content": "Be brief."}, user("Hi"),
                        asst("Hello! How can I help?"), user("Tell me a joke."),
                        asst("Why did the GPU cross the road?"), user("Why?")])),
    ("multi_turn_thinking_off", req([user("Hi"), asst("Hello."), user("Bye")], thinking=False)),
    ("reasoning_before_last_user", req([
        user("What is 6*7?"),
        asst("42", reasoning_content="6 times 7 is 42."),
        user("And 6*8?")])),
    ("reasoning_after_last_user", req([
        user("What is the weather in Paris?"),
        asst("", reasoning_content="  I should call the tool.\n", tool_calls=[CALL_WEATHER]),
        tool("call_1", "{\"temp_c\": 18, \"sky\": \"cloudy\"}")], tools=TOOLS)),
    ("reasoning_kept_clear_thinking_false", req([
        user("Q1"), asst("A1", reasoning_content="R1"), user("Q2")], clear_thinking=False)),
    ("think_tags_in_content", req([
        user("Q"), asst("<think>\nhidden chain\n</think>\n\nThe answer."), user("Again")])),
    ("think_tags_in_content_last", req([
        user("Q"), asst("<think>\nvisible chain\n</think>\n\nThe answer.")], gen=False)),
    ("assistant_strip", req([user("x"), asst(" \n padded answer \t\n"), user("y")])),
    ("assistant_strip_unicode_space", req([user("x"), asst("\u3000wide\u00a0"), user("y")])),
    ("tools_only", req([user("Weather in Oslo?")], tools=TOOLS)),
    ("tools_thinking_off", req([user("Weather in Oslo?")], tools=TOOLS, thinking=False)),
    ("tool_call_string_number_object", req([
        user("Search for GPUs"),
        asst("Let me search.", tool_calls=[call("c1", "search", {
            "query": "H200 \"price\"\nnow", "limit": 10, "ratio": 0.25, "big": 1e21,
            "small": 1.5e-7, "whole": 2.0, "neg": -3,
            "filters": {"region": "EU", "years": [2024, 2025], "nested": {"ok": True, "s": "q\"\n\u0001\u00e9/", "p": 0.30000000000000004}},
            "safe": False, "none": None, "tags": ["a", "b\u00e9", "\u4e2d"],
            "empty_obj": {}, "empty_list": [], "ctrl": "a\u0001b\u007f"})])],
        tools=TOOLS, gen=False)),
    ("tool_call_then_result", req([
        user("Search for GPUs"),
        asst("", tool_calls=[call("c1", "search", {"query": "gpus"})]),
        tool("c1", "3 results"), asst("Found 3."), user("thanks")], tools=TOOLS)),
    ("multiple_tool_results", req([
        user("Weather in Paris and Oslo?"),
        asst("", reasoning_content="Two calls.", tool_calls=[
            call("a", "get_weather", {"city": "Paris"}),
            call("b", "get_weather", {"city": "Oslo", "days": 2})]),
        tool("a", "sunny"), tool("b", "snow \u2744\ufe0f")], tools=TOOLS)),
    ("tool_results_then_more_calls", req([
        user("Plan a trip"),
        asst("", tool_calls=[call("a", "get_weather", {"city": "Rome"})]),
        tool("a", "hot"),
        asst("Checking more.", reasoning_content="Need Oslo too.",
             tool_calls=[call("b", "get_weather", {"city": "Oslo"})]),
        tool("b", "cold")], tools=TOOLS, thinking=True)),
    ("unicode", req([{"role": "system", "content": "Réponds en français. 日本語もOK 👍🏽"},
                     user("Ça va? 👨‍👩‍👧 — «guillemets» and\ttabs\nnew\r\nlines"),
                     asst("Très bien ✓"), user("Ω≈ç√ and a zero-width\u200bjoiner")])),
    ("content_parts", req([
        {"role": "system", "content": [{"type": "text", "text": "Part A. "},
                                       {"type": "text", "text": "Part B."}]},
        {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                     {"type": "text", "text": "two parts"}]}])),
    ("no_generation_prompt", req([user("Hi"), asst("Hello there.")], gen=False)),
    ("special_strings_in_text", req([user("literal <|user|> and <think> tags </think>")])),
    ("empty_user", req([user("")])),
]


def openai_to_template(request):
    """The one preprocessing step: tool-call arguments from a JSON string to a dict."""
    msgs = copy.deepcopy(request["messages"])
    for m in msgs:
        for tc in m.get("tool_calls") or []:
            fn = tc.get("function", tc)
            if isinstance(fn.get("arguments"), str):
                fn["arguments"] = json.loads(fn["arguments"])
    return msgs


def template_kwargs(request):
    kw = dict(request.get("chat_template_kwargs") or {})
    return kw


def render_transformers(template, request):
    import transformers
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from transformers.utils.chat_template_utils import render_jinja_template

    msgs = openai_to_template(request)
    tools = request.get("tools")
    gen = request.get("add_generation_prompt", True)
    kw = template_kwargs(request)
    # A tokenizer object only to reach apply_chat_template; with tokenize=False its
    # vocabulary plays no part in the output.
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()))
    via_apply = tok.apply_chat_template(msgs, tools=tools, chat_template=template,
                                        tokenize=False, add_generation_prompt=gen, **kw)
    rendered, _ = render_jinja_template(conversations=[msgs], tools=tools,
                                        chat_template=template, add_generation_prompt=gen, **kw)
    via_render = rendered[0]
    if via_apply != via_render:
        raise SystemExit("apply_chat_template and render_jinja_template disagree")
    return via_apply, "transformers %s apply_chat_template" % transformers.__version__


def render_local_jinja(template, request):
    # Development only: mirrors transformers' environment (sandbox, trim_blocks,
    # lstrip_blocks, loopcontrols, its tojson filter).
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    t = env.from_string(template)
    out = t.render(messages=openai_to_template(request), tools=request.get("tools"),
                   add_generation_prompt=request.get("add_generation_prompt", True),
                   **template_kwargs(request))
    return out, "local jinja2 %s (development only, not a golden)" % jinja2.__version__


ALPHABET = ["a", "b", " ", "\n", "\t", "\u3000", "\u00a0", "\x1c", "\x85", "\u00e9", "\u4e2d",
            "\U0001f600", "<think>", "</think>", "\"", "\\", "\x01", "{", "}", "\u2028", "x y",
            "\r\n"]


def random_request(rnd):
    def text(maxlen=6):
        return "".join(rnd.choice(ALPHABET) for _ in range(rnd.randint(0, maxlen)))

    def value(depth=0):
        r = rnd.random()
        if r < 0.25:
            return text()
        if r < 0.4:
            return rnd.randint(-10**12, 10**12)
        if r < 0.6:
            return rnd.choice([1, -1]) * rnd.random() * 10 ** rnd.randint(-30, 30)
        if r < 0.65:
            return rnd.choice([True, False, None])
        if r < 0.7:
            return float(rnd.randint(-10**6, 10**6))
        if depth < 2 and r < 0.85:
            return [value(depth + 1) for _ in range(rnd.randint(0, 3))]
        if depth < 2:
            return {text(3) or "k": value(depth + 1) for _ in range(rnd.randint(0, 3))}
        return text()

    messages, calls_open = [], False
    for _ in range(rnd.randint(1, 7)):
        role = rnd.choice(["user", "system", "assistant"] + (["tool"] if calls_open else []))
        if role == "assistant":
            m = asst(rnd.choice([text(), text(), [{"type": "text", "text": text()}]]))
            if rnd.random() < 0.5:
                m["reasoning_content"] = text()
            calls_open = rnd.random() < 0.5
            if calls_open:
                m["tool_calls"] = [
                    {"type": "function", "function": {"name": "f%d" % i, "arguments": json.dumps(
                        {"k%d" % j + text(2): value() for j in range(rnd.randint(0, 3))},
                        ensure_ascii=rnd.random() < 0.5)}}
                    for i in range(rnd.randint(1, 3))]
        elif role == "tool":
            m = tool("x", text())
        else:
            content = text() if rnd.random() < 0.8 else [{"type": "text", "text": text()}, text()]
            m = {"role": role, "content": content}
            calls_open = False
        messages.append(m)
    r = {"messages": messages}
    if rnd.random() < 0.3:
        r["tools"] = [{"type": "function", "function": {"name": "f", "description": text(),
                                                         "parameters": {"x": value()}}}]
    if rnd.random() < 0.5:
        r["chat_template_kwargs"] = {"enable_thinking": rnd.random() < 0.5}
    if rnd.random() < 0.2:
        r["chat_template_kwargs"] = {"clear_thinking": False}
    r["add_generation_prompt"] = rnd.random() < 0.8
    return r


def diff_binary(template, render, binary, n):
    rnd = random.Random(1234)
    bad = 0
    for i in range(n):
        request = random_request(rnd)
        want, source = render(template, request)
        p = subprocess.run([binary, "chat-template", "--template", "glm47"],
                           input=json.dumps(request).encode(), capture_output=True)
        got = p.stdout.decode("utf-8", "surrogateescape")
        if p.returncode != 0 or got != want:
            bad += 1
            if bad <= 5:
                print("case %d differs (exit %d) %s\nrequest %s\ngot  %r\nwant %r" % (
                    i, p.returncode, p.stderr.decode()[:300], json.dumps(request), got, want))
    print("%d random requests, %d differ (reference: %s)" % (n, bad, source))
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--template", required=True)
    ap.add_argument("--out")
    ap.add_argument("--local-jinja", action="store_true")
    ap.add_argument("--diff-binary")
    ap.add_argument("--n", type=int, default=400)
    args = ap.parse_args()
    with open(args.template, encoding="utf-8") as f:
        template = f.read()
    render = render_local_jinja if args.local_jinja else render_transformers
    if args.diff_binary:
        sys.exit(diff_binary(template, render, args.diff_binary, args.n))
    if not args.out:
        ap.error("--out is required")
    lines = []
    source = None
    for name, request in CASES:
        expected, source = render(template, request)
        lines.append(json.dumps({"name": name, "request": request, "expected": expected},
                                ensure_ascii=False))
    meta = {"meta": {"template": args.template.split("/")[-1], "renderer": source,
                     "n_cases": len(CASES)}}
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(json.dumps(meta) + "\n")
        for line in lines:
            f.write(line + "\n")
    print("wrote %d cases to %s (%s)" % (len(CASES), args.out, source), file=sys.stderr)


if __name__ == "__main__":
    main()
