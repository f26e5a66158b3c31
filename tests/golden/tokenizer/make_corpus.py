#!/usr/bin/env python3
"""make_corpus.py - write corpus.jsonl, our own tokenizer test corpus (one JSON string a line).

Every line is made here, by hand-written fragments and a seeded mixer: whitespace runs, tabs,
newlines and CRLF, digit runs, CJK, Arabic, emoji with ZWJ and skin tones, combining marks,
control characters, special-token strings inside text, code, long words and the empty string.
Deterministic: running it again rewrites the same file. Usage: make_corpus.py [OUT]
"""
import json
import os
import random
import sys

FRAGMENTS = [
    "", " ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r\n\r\n", " \n ", "\u00a0", "\u3000",
    "\u2009", "\u200b", "\ufeff", "Hello", "hello", "HELLO", " world", "world!", "It's", "they're",
    "I'LL", "we've", "don't", "0", "7", "42", "123", "1234", "12345678901234567890", "3.14159",
    "1,000,000", "٣٤٥", "①②③", "Ⅻ", "你好", "世界", "中文分词测试", "日本語のテキスト",
    "カタカナ", "ひらがな", "한국어", "مرحبا بالعالم", "السلام عليكم", "שלום", "Привет, мир",
    "Ελληνικά", "हिन्दी", "ไทย", "👍", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "👩🏿‍💻", "❤️", "🇩🇪",
    "e\u0301", "n\u0303", "a\u0308\u0304", "\u0041\u030a", "Å", "ﬁ", "Ⅸ", "ｆｕｌｌｗｉｄｔｈ",
    "\u0000", "\u0001", "\u001b[31m", "\u007f", "\u0085", "\u2028", "\u2029", "\u00ad",
    "<|endoftext|>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<|im_start|>",
    "<|im_end|>", "<s>", "</s>", "<unk>", "<|user|>", "<think>", "</think>", "[gMASK]", "<sop>",
    "<|endoftext|", "<|im_", "▁", "▁▁", "Ġ", "Ċ", "<0x41>", "def f(x):\n    return x * 2\n",
    "int main(void) { return 0; }", "for (i = 0; i < n; i++) {\n\tsum += a[i];\n}",
    "SELECT * FROM t WHERE id = 1;", "https://example.com/a?b=c&d=e#f", "user@example.org",
    "$HOME/.config", "C:\\Windows\\System32", "{\"key\": [1, 2, 3]}", "<div class=\"x\">",
    "---", "...", "!!!", "???", "''", "\"\"", "``", "~~", "@#$%^&*()", "(a+b)*c", "a_b_c",
    "snake_case_name", "CamelCaseName", "x86_64", "v1.2.3-rc4",
    "Pneumonoultramicroscopicsilicovolcanoconiosis",
    "Donaudampfschifffahrtselektrizitätenhauptbetriebswerkbauunterbeamtengesellschaft",
    "supercalifragilisticexpialidocious", "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "ababababababababababab", "The quick brown fox jumps over the lazy dog.",
    "naïve café résumé", "Straße", "İstanbul", "ǅ", "ß", "ŉ", "𝔾𝕠𝕠𝕕 𝕞𝕠𝕣𝕟𝕚𝕟𝕘", "𝑥² + 𝑦² = 𝑧²",
    "∀x∈ℝ: x²≥0", "½ ¼ ¾", "™ © ®", "€100", "¥500", "£3", "—", "–", "…", "«»", "“quoted”",
    "‘single’", "·", "•", "→", "♪♫", "⌘", "\U0001f600\U0001f601", "\U00010348", "\U000e0041",
]

HANDWRITTEN = [
    "",
    " ",
    "  leading and trailing spaces  ",
    "multiple     spaces     between     words",
    "tabs\tbetween\twords\t\t\tand more",
    "line one\nline two\nline three",
    "windows\r\nline\r\nendings\r\n",
    "\n\n\nleading newlines",
    "trailing newlines\n\n\n",
    " \t \n \r\n mixed whitespace \t\n",
    "0123456789",
    "12 345 6789 01234 567890",
    "Year 2024, 15:30:45, +1-555-0100",
    "pi ≈ 3.14159265358979323846264338327950288419716939937510",
    "我爱北京天安门。今天天气很好！",
    "混合English和中文123的句子",
    "東京は日本の首都です。カタカナとひらがな。",
    "مرحبا، كيف حالك؟ ١٢٣ ٤٥٦",
    "Family: 👨‍👩‍👧‍👦, wave 👋🏻👋🏼👋🏽👋🏾👋🏿, flag 🏴‍☠️",
    "Combining: e\u0301 a\u0300 o\u0302 u\u0308 n\u0303 c\u0327 Z\u0335\u0321\u0322",
    "Precomposed vs decomposed: \u00e9 / e\u0301, \u00c5 / A\u030a / \u212b",
    "Controls: \u0000\u0001\u0002\u0007\u0008\u000b\u000c\u000e\u001f\u007f end",
    "Escape \u001b[1;32mgreen\u001b[0m",
    "before<|endoftext|>after",
    "<|endoftext|><|endoftext|>",
    " <|endoftext|> spaced ",
    "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>Hi<｜Assistant｜>",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "<s>[INST] What is 2+2? [/INST] 4 </s>",
    "[gMASK]<sop><|system|>\nYou are GLM.<|user|>\nhi<|assistant|>\n<think></think>",
    "not a special: <|endoftext| and <|endof text|>",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "#include <stdio.h>\n\nint main(int argc, char **argv)\n{\n\tprintf(\"%d\\n\", argc);\n\treturn 0;\n}\n",
    "fn main() { let v: Vec<u32> = (0..10).map(|x| x * x).collect(); println!(\"{:?}\", v); }",
    "<html><body><p class='a'>Text &amp; more</p></body></html>",
    "{\"model\": \"glm\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"stream\": true}",
    "    indented with four spaces",
    "\tindented with a tab",
    "ALL CAPS SENTENCE WITH NUMBERS 123 AND SYMBOLS !@#",
    "it's they're we've I'm you'll he'd IT'S THEY'RE",
    "a" * 300,
    "ab" * 150,
    "x " * 100,
    "9" * 64,
    "😀" * 20,
    "中" * 50,
    "The " + "very " * 40 + "end.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor.",
    "Ünïcödé wïth dïäcrïtïcs everywhere: àáâãäåæçèéêëìíîïðñòóôõöøùúûüýþÿ",
    "ﬁﬂﬀﬃﬄ ligatures and ｆｕｌｌｗｉｄｔｈ ＡＢＣ １２３",
    "Ⅰ Ⅱ Ⅲ Ⅳ Ⅴ ① ② ③ ⑴ ⑵ ㈠ ㊀",
    "zero\u200bwidth\u200cnon\u200djoiner\u2060word\ufeffjoiner",
    "\u00a0nbsp\u00a0\u2002en\u2003em\u3000ideographic",
    "line\u2028separator\u2029paragraph\u0085nel",
    "Mixed 한국어 text with 日本語 and русский язык and ελληνικά.",
    "Hindi: नमस्ते दुनिया, Thai: สวัสดีชาวโลก, Tamil: வணக்கம்",
    "Math: ∑_{i=1}^{n} i = n(n+1)/2, ∫₀^∞ e^{-x} dx = 1",
    "Currency: $1,234.56 €99,99 ¥10000 ₹500 ₿0.001",
    "Emoji sequence: 🇺🇸🇬🇧🇯🇵 🧑‍🤝‍🧑 ❤️‍🔥 👁️‍🗨️ 🫶🏾",
    "URL: https://huggingface.co/docs/tokenizers/api/pre-tokenizers?x=1#split",
    "path/to/some_file.name.ext:123:45: error: expected ';'",
    "Tab\tseparated\tvalues\n1\t2\t3\n",
    "    ",
    "\t",
    "\n",
    "\r\n",
    "!",
    "a",
    "A",
    "é",
    "中",
    "🤗",
    "<|endoftext|>",
    "<｜end▁of▁sentence｜>",
    "▁leading meta space ▁▁ inside",
    "<0xE4><0xB8><0xAD> literal byte tokens",
]


def bench_text(out, mb):
    """A few MB of mixed text for the throughput benchmark: corpus lines mixed with seeded
    pseudo-words, numbers and code, so that most words are not simply repeated."""
    rng = random.Random(42)
    base = [json.loads(l) for l in open(os.path.join(os.path.dirname(__file__), "corpus.jsonl"))]
    letters = "etaoinshrdlcumwfgypbvkjxqz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 12))) for _ in range(20000)]
    total, parts = 0, []
    while total < mb * 1_000_000:
        kind = rng.random()
        if kind < 0.6:
            line = " ".join(rng.choice(words).capitalize() if rng.random() < 0.1 else rng.choice(words)
                            for _ in range(rng.randint(5, 30))) + rng.choice([".", ",", "!", "?", ":"])
        elif kind < 0.8:
            line = rng.choice(base).replace("\n", " ")
        elif kind < 0.9:
            line = f"x{rng.randint(0, 999)} = {rng.randint(0, 10**9)} * y_{rng.choice(words)} + {rng.random():.6f};"
        else:
            line = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 6))).replace("\n", " ")
        line = line.replace("\n", " ").replace("\r", " ")
        parts.append(line)
        total += len(line.encode("utf-8")) + 1
    with open(out, "w", encoding="utf-8") as fh:
        fh.write("\n".join(parts) + "\n")
    print(f"{total} bytes -> {out}")


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--bench":
        bench_text(sys.argv[2], float(sys.argv[3]))
        return
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "corpus.jsonl")
    rng = random.Random(20261130)
    lines = list(HANDWRITTEN)
    # Seeded mixes of fragments: pairs catch boundary effects between scripts and classes.
    for _ in range(220):
        k = rng.randint(2, 8)
        sep = rng.choice(["", "", " ", "  ", "\n", "\t", " \n"])
        lines.append(sep.join(rng.choice(FRAGMENTS) for _ in range(k)))
    # Every fragment alone and with a leading space.
    for f in FRAGMENTS:
        lines.append(f)
        lines.append(" " + f)
    with open(out, "w", encoding="utf-8") as fh:
        for s in lines:
            fh.write(json.dumps(s, ensure_ascii=True) + "\n")
    print(f"{len(lines)} lines -> {out}")


if __name__ == "__main__":
    main()
