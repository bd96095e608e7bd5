#!/usr/bin/env python3
"""Non-test Rust functions longer than a limit, counted brace to brace (the line of a body's
opening brace through the line of its closing one).

    scripts/fn-lengths.py            functions over 120 lines under src/ and crates/*/src/
    scripts/fn-lengths.py 80 PATH..  over 80 lines, in the given files or directories

Test code is left out: files under tests/, `#[cfg(test)]` items (a `mod tests`) and functions
marked `#[test]` or `#[tokio::test]`. Exits 1 when one is found, so that a check can use it.
"""

import os
import re
import sys


def code_of(text):
    """The text with comments, strings and char literals blanked (newlines kept), so that
    braces are counted in code only."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif re.match(r'b?r(#*)"', text[i:i + 260]) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'b?r(#*)"', text[i:])
            end = '"' + m.group(1)
            j = text.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            j += 1
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == "'":
            # A char literal ('x', '\n', '\u{7f}') or a lifetime ('a).
            m = re.match(r"'(\\(u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'])'", text[i:i + 12])
            if m:
                out.append(" " * m.end())
                i += m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


FN = re.compile(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)")
TEST_ATTR = re.compile(r"#\[(cfg\(test\)|test|tokio::test[^\]]*)\]")


def long_fns(path, limit):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    code = code_of(text)
    line_of = lambda pos: code.count("\n", 0, pos) + 1
    found = []
    # Spans of test-only items: an item (its braces) right after #[cfg(test)] or #[test].
    test_spans = []
    for m in TEST_ATTR.finditer(code):
        body = code.find("{", m.end())
        semi = code.find(";", m.end())
        if body < 0 or (0 <= semi < body):
            continue
        test_spans.append((m.start(), match_brace(code, body)))
    for m in FN.finditer(code):
        # The body's brace: the first `{` at the signature's own nesting, unless a `;` ends a
        # declaration without one (a trait's method).
        depth, j = 0, m.end()
        body = None
        while j < len(code):
            ch = code[j]
            if ch in "([<":
                depth += 1
            elif ch in ")]>" and depth > 0:
                # `->` is no closing angle bracket.
                if not (ch == ">" and code[j - 1] == "-"):
                    depth -= 1
            elif ch == ";" and depth == 0:
                break
            elif ch == "{" and depth == 0:
                body = j
                break
            j += 1
        if body is None:
            continue
        if any(a <= m.start() <= b for a, b in test_spans):
            continue
        end = match_brace(code, body)
        lines = line_of(end) - line_of(body) + 1
        if lines > limit:
            found.append((path, line_of(m.start()), m.group(1), lines))
    return found


def match_brace(code, at):
    depth = 0
    for j in range(at, len(code)):
        if code[j] == "{":
            depth += 1
        elif code[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(code) - 1


def rust_files(roots):
    for root in roots:
        if os.path.isfile(root):
            yield root
            continue
        for d, dirs, files in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in ("target", "tests"))
            for f in sorted(files):
                if f.endswith(".rs"):
                    yield os.path.join(d, f)


def main():
    args = sys.argv[1:]
    limit = 120
    if args and args[0].isdigit():
        limit = int(args.pop(0))
    if not args:
        os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    roots = args or ["src"] + sorted(
        os.path.join("crates", c, "src") for c in os.listdir("crates")
    )
    found = [f for p in rust_files(roots) for f in long_fns(p, limit)]
    for path, line, name, lines in sorted(found, key=lambda f: -f[3]):
        print(f"{lines:5} {path}:{line} {name}")
    print(f"{len(found)} non-test function(s) over {limit} lines", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
