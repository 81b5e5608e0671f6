"""Write llama_cpp_splits.json: how llama.cpp itself splits test texts with each regex set.

    python tests/tokenizer/make_llama_cpp_splits.py [--llama-cpp DIR]

Compiles llama.cpp's src/unicode.cpp and src/unicode-data.cpp (from DIR, else from the
llama-cpp-python sdist that tests/data/fetch.py downloads) with a small driver that calls
`unicode_regex_split`, the function llama.cpp's BPE tokenizer splits text with, and runs it on
every regex set of llmrun.pretokenizers (llama.cpp's own strings) for each text: a fixed
multilingual one and random ones. Needs a C++17 compiler (c++, or $CXX).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SDIST = HERE.parent / "data" / "cache" / "downloads" / "llama_cpp_python-0.3.36.tar.gz"
SOURCES = ("unicode.cpp", "unicode.h", "unicode-data.cpp", "unicode-data.h")
SOURCE = "unicode_regex_split() of llama.cpp's src/unicode.cpp, as in llama-cpp-python 0.3.36"

DRIVER = r"""
#include "unicode.h"
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

static std::string slurp(const char * path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream buffer;
    buffer << in.rdbuf();
    return buffer.str();
}

static std::vector<std::string> fields(const std::string & s) {
    std::vector<std::string> out;
    size_t start = 0;
    for (size_t end; (end = s.find('\0', start)) != std::string::npos; start = end + 1) {
        out.push_back(s.substr(start, end - start));
    }
    return out;
}

// argv[1]: regexes, argv[2]: texts, each NUL-terminated. Prints each text's pieces but the
// empty ones, each NUL-terminated, and one more NUL after each text.
int main(int argc, char ** argv) {
    if (argc != 3) return 2;
    const auto regexes = fields(slurp(argv[1]));
    for (const auto & text : fields(slurp(argv[2]))) {
        for (const auto & piece : unicode_regex_split(text, regexes, false)) {
            if (!piece.empty()) {
                fwrite(piece.data(), 1, piece.size(), stdout);
                fputc(0, stdout);
            }
        }
        fputc(0, stdout);
    }
    return 0;
}
"""

# Code, numbers of many digits, CJK, emoji, contractions, cases, marks, newlines and tabs.
SAMPLE = (
    "Hello World! HelloWorld helloWORLD \u00c9COLE \u00c9cole \u0391\u03b2\u03b3\u0394\u03b5"
    "\u03b6 \u01c5ungla \u0130stanbul'da\n"
    "I'm you're they've she'll he'd IT'S We'RE don't 'quoted' rock'n'roll l'\u00e9t\u00e9\n"
    "def f(x):\n\treturn x**2  # comment\n"
    '    if a<=b and c!=d: print("ok") // path/to/file.py -> {"k": [1, 2]}\n'
    "1 12 123 1234 12345 123456 1234567 3.14159 1,000,000 \u00b2\u00b3 \u00bd "
    "\u0663\u0664\u0665 \u0967\u0968\u0969 \uff11\uff12\uff13 \u216b\n"
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \u4e2d\u6587\u6c49\u5b57 \u3400\u4db5 "
    "\U00020000\U0002a700 \ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8 \u3072\u3089\u304c\u306a "
    "\u30ab\u30bf\u30ab\u30ca \uff76\uff80\uff76\uff85 \u3007\u3005 \u3105\u3106 \uf900\n"
    "emoji \U0001f600\U0001f44d\U0001f3fd family \U0001f468\u200d\U0001f469\u200d\U0001f467 "
    "flags \U0001f1fa\U0001f1f8 \u2665\u263a\n"
    "\u00dcn\u00efc\u00f6d\u00e9 \u00dftra\u00dfe \u2014 \u201cquotes\u201d \u2018too\u2019 "
    "\u2026 \u00abguillemets\u00bb na\u00efve cafe\u0301 \u041f\u0440\u0438\u0432\u0435\u0442 "
    "\u043c\u0438\u0440\n"
    "   leading spaces\t\ttabs\r\nwindows\n\n\n \nblank lines  \u00a0 nbsp\u3000ideographic "
    "space  \n"
    "\u0939\u093f\u0928\u094d\u0926\u0940 \u09ac\u09be\u0982\u09b2\u09be "
    "\u0c24\u0c46\u0c32\u0c41\u0c17\u0c41 \u0e44\u0e17\u0e22 \u0639\u0631\u0628\u064a "
    "\u05e2\u05d1\u05e8\u05d9\u05ea \u10e5\u10d0\u10e0\u10d7\u10e3\u10da\u10d8\n"
    "<sentinel:12> IMGIMGABCZ x    y  z\n"
    "   trailing   "
)
# Random texts are drawn from these.
POOL = (
    list("aAbBzZ09'\u2019\"sStTdDlLmMvVrReE .,!?;:-_/\\()[]{}<>$+^~|`@#%&*=\t\n\r\x0b\x0c")
    + list("\u00a0\u3000\u2028\u0085\u1680\u200b\u00e9\u00c9\u00df\u03a3\u03c3\u03c2\u0414")
    + list("\u0434\u0130\u0131\u01c5\u65e5\u672c\u8a9e\u4e2d\u6587\u3400\U00020000\ud55c")
    + list("\uad6d\u3072\u30ab\uff76\u3007\u3005\u3105\uf900\u1100\u0301\u0308\u093f\u0e31")
    + list("\U0001f600\U0001f44d\U0001f3fd\u200d\u2665\u00b2\u00bd\u0663\u0967\uff11\u216b")
    + list("\u2026\u3002\uff0c\u3001\u0964")
    + ["IMGIMGABZ", "<sentinel:3>", "    ", "  ", "'s", "'LL", "1234567", "\n\n\n"]
)


def texts(count: int = 60, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    drawn = ["".join(rng.choice(POOL) for _ in range(rng.randrange(1, 40))) for _ in range(count)]
    return [SAMPLE, *drawn]


def sources(llama_cpp: Path | None, into: Path) -> Path:
    if llama_cpp is not None:
        return llama_cpp / "src"
    if not SDIST.is_file():
        sys.exit(f"{SDIST} is absent: run python tests/data/fetch.py, or give --llama-cpp DIR")
    prefix = "llama_cpp_python-0.3.36/vendor/llama.cpp/src/"
    with tarfile.open(SDIST) as tar:
        for name in SOURCES:
            member = tar.getmember(prefix + name)
            (into / name).write_bytes(tar.extractfile(member).read())
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-cpp", type=Path, help="a llama.cpp checkout")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parents[1]))
    from llmrun.pretokenizers import REGEX_SETS

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = sources(args.llama_cpp, tmp)
        (tmp / "driver.cpp").write_text(DRIVER)
        binary = tmp / "split"
        compiler = os.environ.get("CXX", "c++")
        cpp = [str(tmp / "driver.cpp"), str(src / "unicode.cpp"), str(src / "unicode-data.cpp")]
        subprocess.run(
            [compiler, "-O1", "-std=c++17", f"-I{src}", *cpp, "-o", str(binary)], check=True
        )
        cases = texts()
        (tmp / "texts").write_bytes(b"".join(t.encode() + b"\0" for t in cases))
        splits = {}
        for name, regexes in REGEX_SETS.items():
            (tmp / "regexes").write_bytes(b"".join(r.encode() + b"\0" for r in regexes))
            out = subprocess.run(
                [str(binary), str(tmp / "regexes"), str(tmp / "texts")],
                capture_output=True,
                check=True,
            ).stdout
            rows = [[]]
            for field in out.split(b"\0")[:-1]:
                if field:
                    rows[-1].append(len(field.decode()))
                else:
                    rows.append([])
            splits[name] = rows[:-1]
            assert len(splits[name]) == len(cases)
    # One line per text and per regex set, for readable diffs.
    lines = ["{", f'"source": {json.dumps(SOURCE)},', '"texts": [']
    lines += [json.dumps(t) + ("," if i < len(cases) - 1 else "") for i, t in enumerate(cases)]
    lines += ["],", '"piece_lengths": {']
    rows = [f"{json.dumps(name)}: {json.dumps(split)}" for name, split in splits.items()]
    lines += [row + ("," if i < len(rows) - 1 else "") for i, row in enumerate(rows)]
    lines += ["}", "}"]
    (HERE / "llama_cpp_splits.json").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
