#!/usr/bin/env python3
"""gen_tokenizer_golden.py - golden ids from Hugging Face `tokenizers` for our C tokenizer.

Runs where `tokenizers` is installed (the H200 machine has 0.23.2). For each NAME=PATH it
writes into OUTDIR:
  NAME.golden.jsonl   one line per corpus line: ids without and with special tokens, and the
                      decode of the plain ids with skip_special_tokens off and on
  NAME.invalid.jsonl  the same for each invalid_utf8.hex line, decoded lossily (U+FFFD) first,
                      which is what a Python caller hands HF for such bytes
  NAME.decode.jsonl   decode goldens for seeded random id sequences (both skip modes)
With --bench FILE it also times single-threaded encoding of FILE and of a 256K-token prefix
and prints one JSON line per tokenizer ("bench": ...).

Usage: gen_tokenizer_golden.py [--bench FILE] OUTDIR CORPUS INVALID_HEX NAME=PATH...
Set RAYON_NUM_THREADS=1 and TOKENIZERS_PARALLELISM=false for the benchmark.
"""
import json
import random
import sys
import time

from tokenizers import Tokenizer


def golden_line(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    ids_special = tok.encode(text, add_special_tokens=True).ids
    return {
        "ids": ids,
        "ids_special": ids_special,
        "decoded": tok.decode(ids, skip_special_tokens=False),
        "decoded_skip": tok.decode(ids, skip_special_tokens=True),
    }


def bench(tok, name, path):
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    lines = text.split("\n")
    tok.encode("warm up", add_special_tokens=False)
    t0 = time.perf_counter()
    n_ids = len(tok.encode(text, add_special_tokens=False).ids)
    t_whole = time.perf_counter() - t0
    t0 = time.perf_counter()
    n_line_ids = 0
    for line in lines:
        n_line_ids += len(tok.encode(line, add_special_tokens=False).ids)
    t_lines = time.perf_counter() - t0
    # A 256K-token prompt: the shortest prefix of whole lines with at least 262144 ids.
    enc = tok.encode(text, add_special_tokens=False)
    cut = enc.offsets[min(262144, len(enc.offsets)) - 1][1]
    prompt = text[:cut]
    t0 = time.perf_counter()
    n_prompt = len(tok.encode(prompt, add_special_tokens=False).ids)
    t_prompt = time.perf_counter() - t0
    mb = len(text.encode("utf-8")) / 1e6
    print(json.dumps({"bench": name, "bytes": len(text.encode("utf-8")), "ids": n_ids,
                      "whole_s": round(t_whole, 4), "whole_MBps": round(mb / t_whole, 2),
                      "lines_s": round(t_lines, 4), "lines_MBps": round(mb / t_lines, 2),
                      "prompt_chars": cut, "prompt_bytes": len(prompt.encode("utf-8")),
                      "prompt_ids": n_prompt, "prompt_s": round(t_prompt, 4)}), flush=True)


def main():
    args = sys.argv[1:]
    bench_file = None
    if args and args[0] == "--bench":
        bench_file = args[1]
        args = args[2:]
    outdir, corpus, invalid = args[0], args[1], args[2]
    with open(corpus, encoding="utf-8") as fh:
        texts = [json.loads(line) for line in fh if line.strip()]
    with open(invalid) as fh:
        raws = [bytes.fromhex(line.strip()) for line in fh if line.strip()]
    for spec in args[3:]:
        name, path = spec.split("=", 1)
        tok = Tokenizer.from_file(path)
        with open(f"{outdir}/{name}.golden.jsonl", "w", encoding="utf-8") as out:
            for text in texts:
                out.write(json.dumps(golden_line(tok, text), ensure_ascii=True) + "\n")
        with open(f"{outdir}/{name}.invalid.jsonl", "w", encoding="utf-8") as out:
            for raw in raws:
                line = golden_line(tok, raw.decode("utf-8", errors="replace"))
                line["hex"] = raw.hex()
                out.write(json.dumps(line, ensure_ascii=True) + "\n")
        rng = random.Random(7)
        n_vocab = tok.get_vocab_size(with_added_tokens=True)
        with open(f"{outdir}/{name}.decode.jsonl", "w", encoding="utf-8") as out:
            for i in range(200):
                n = rng.randint(0, 12)
                if i % 4 == 0:  # bias towards low ids: byte tokens, specials, short pieces
                    ids = [rng.randrange(min(n_vocab, 300)) for _ in range(n)]
                else:
                    ids = [rng.randrange(n_vocab) for _ in range(n)]
                out.write(json.dumps({"ids": ids,
                                      "decoded": tok.decode(ids, skip_special_tokens=False),
                                      "decoded_skip": tok.decode(ids, skip_special_tokens=True)},
                                     ensure_ascii=True) + "\n")
        print(f"{name}: {len(texts)} lines, {len(raws)} invalid, 200 decodes", flush=True)
        if bench_file:
            bench(tok, name, bench_file)


if __name__ == "__main__":
    main()
