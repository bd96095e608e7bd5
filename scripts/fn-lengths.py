#!/usr/bin/env python3
"""Non-test Rust functions longer than a limit, counted brace to brace (the line of a body's
opening brace through the line of its closing one).

    scripts/fn-lengths.py            functions over 120 lines under src/ and crates/*/src/
    scripts/fn-lengths.py 80 PATH..  over 80 lines, in the given files or directories
    scripts/fn-lengths.py --self-test  counts a small crate of hard cases and checks the counts

Test code is left out: files under tests/, `#[cfg(test)]` items (a `mod tests { .. }`, or a
`mod tests;` in a file of its own, among those given), files that begin `#![cfg(test)]`, and
functions marked `#[test]` or `#[tokio::test]`; `cfg(all(test, ..))` is test-only too. Exits 1
when one is found, so that a check can use it.
"""

import os
import re
import sys


RAW_STRING = re.compile(r'b?r(#*)"')
CHAR = re.compile(r"'(\\(u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'])'")
# Where a comment, string or char literal may begin; the text between is code, kept whole.
MAY_BEGIN = re.compile(r"[/\"'br]")


def code_of(text):
    """The text with comments, strings and char literals blanked (newlines kept), so that
    braces are counted in code only."""
    out = []
    i, n = 0, len(text)
    while i < n:
        m = MAY_BEGIN.search(text, i)
        if not m:
            out.append(text[i:])
            break
        out.append(text[i : m.start()])
        i = m.start()
        c = text[i]
        raw = RAW_STRING.match(text, i) if c in "br" else None
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
        elif raw and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            end = '"' + raw.group(1)
            j = text.find(end, raw.end())
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
        elif c == "'" and (char := CHAR.match(text, i)):
            # A char literal ('x', '\n', '\u{7f}'), not a lifetime ('a).
            out.append(" " * (char.end() - i))
            i = char.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


FN = re.compile(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)")
# An outer attribute that may make the item after it test-only: #[test], #[tokio::test(..)],
# or #[cfg(..)] (test-only where its predicate is: see test_only).
ATTR = re.compile(r"#\[\s*(?:test|tokio::test\b[^\]]*|cfg\s*\((?P<pred>[^\]]*)\))\s*\]")
# A file's own #![cfg(..)]: the whole file test-only where its predicate is.
INNER_CFG = re.compile(r"#!\[\s*cfg\s*\((?P<pred>[^\]]*)\)\s*\]")
# After such an attribute, a module in a file of its own (`#[cfg(test)] mod tests;`): other
# attributes and a visibility may come between.
MOD_DECL = re.compile(
    r"(?:\s*#\[[^\]]*\])*\s*(?:pub(?:\s*\([^)]*\))?\s+)?mod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;"
)


def test_only(pred):
    """Whether a cfg predicate holds only in a test build: `test`, or an `all(..)` of which
    one part is (`any(test, ..)` and `not(test)` hold outside tests too)."""
    pred = pred.strip()
    if pred == "test":
        return True
    m = re.fullmatch(r"all\s*\((.*)\)", pred, re.S)
    if not m:
        return False
    parts, depth, last = [], 0, 0
    for j, ch in enumerate(m.group(1)):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(m.group(1)[last:j])
            last = j + 1
    parts.append(m.group(1)[last:])
    return any(test_only(p) for p in parts)


def is_test_attr(m):
    return m.group("pred") is None or test_only(m.group("pred"))


def body_of(code, at, angles):
    """The position of the `{` that opens the body of the item whose header starts at `at`:
    the first at the header's own nesting; None where a `;` at that nesting ends the item
    first (a trait's method, `mod tests;`, a const). `angles`: `<..>` nest too (a signature's
    generics; not in a const's expression, where `<` may be a comparison or a shift)."""
    depth = 0
    for j in range(at, len(code)):
        ch = code[j]
        if ch in "([" or (angles and ch == "<"):
            depth += 1
        elif (ch in ")]" or (angles and ch == ">")) and depth > 0:
            # `->` is no closing angle bracket.
            if not (ch == ">" and code[j - 1] == "-"):
                depth -= 1
        elif ch == ";" and depth == 0:
            return None
        elif ch == "{" and depth == 0:
            return j
    return None


def code_of_file(path):
    with open(path, encoding="utf-8") as f:
        return code_of(f.read())


def test_module_paths(path, code):
    """The files (and folders) of the test-only modules `path` declares in files of their own:
    `#[cfg(test)] mod tests;` in a/mod.rs (or lib.rs, main.rs) is a/tests.rs or a/tests/,
    in a/b.rs it is a/b/tests.rs or a/b/tests/."""
    d, stem = os.path.split(path)
    stem = stem[: -len(".rs")]
    base = d if stem in ("mod", "lib", "main") else os.path.join(d, stem)
    out = []
    for m in ATTR.finditer(code):
        decl = MOD_DECL.match(code, m.end())
        if decl and is_test_attr(m):
            out.append(os.path.join(base, decl.group(1)))
    return out


def long_fns(path, code, limit):
    line_of = lambda pos: code.count("\n", 0, pos) + 1
    found = []
    # Spans of test-only items: an item (its braces) right after #[cfg(test)] or #[test].
    test_spans = []
    for m in ATTR.finditer(code):
        body = body_of(code, m.end(), angles=False)
        if body is not None and is_test_attr(m):
            test_spans.append((m.start(), match_brace(code, body)))
    for m in FN.finditer(code):
        body = body_of(code, m.end(), angles=True)
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


def scan(roots, limit):
    """(path, line, name, lines) of each non-test function over `limit` lines under `roots`."""
    codes = {p: code_of_file(p) for p in rust_files(roots)}
    # Whole files of test code: a file that says so itself, or a test-only module's.
    test_files = {
        p
        for p, code in codes.items()
        if any(test_only(m.group("pred")) for m in INNER_CFG.finditer(code))
    }
    test_mods = [t for p, code in codes.items() for t in test_module_paths(p, code)]
    for p in codes:
        if any(p == t + ".rs" or p.startswith(t + os.sep) for t in test_mods):
            test_files.add(p)
    return [
        f for p, code in codes.items() if p not in test_files for f in long_fns(p, code, limit)
    ]


# The self-test's crate: file -> text, where `~N` stands for N lines of body. Its functions
# are named for what the count must do with them: `n<lines>_..` counted (that many lines),
# `test_..` left out.
SELF_TEST = {
    "lib.rs": """
#[cfg(test)]
mod a;
mod b;
#[cfg(test)]
#[allow(dead_code)]
pub(crate) mod fake;
#[cfg(any(test, feature = "x"))]
mod any_test;
mod inner;
fn n7_strings_comments_and_chars() {
    let a = "{{ \\" }";
    let b = r#"}} " }"#;
    let c = ['{', '\\'', b'{', '\\u{7d}'];
    // }
    /* } /* } */ } */
}
fn n5_generic<'a, T: Into<Vec<[u8; 4]>>>(t: &'a T) -> impl Fn() -> u8 + 'a
where
    T: Clone,
{
~3}
trait Tr {
    fn no_body(&self) -> u32;
}
#[test]
fn test_marked() {
~9}
#[tokio::test(flavor = "multi_thread")]
async fn test_tokio() {
~9}
#[cfg(all(unix, test))]
mod tests {
    fn test_in_module() {
~9    }
}
#[cfg(test)]
const SMALL: bool = 1 < 2;
fn n5_after_a_test_const(a: u8, b: u8) {
    if a > b {
    }
~1}
#[cfg(test)]
fn test_array_return() -> [u8; 4] {
~9}
#[cfg(not(test))]
fn n4_not_test() {
~2}
""",
    "a.rs": "fn test_module_file() {\n~9}\n",
    "a/deep.rs": "fn test_module_folder() {\n~9}\n",
    "fake.rs": "fn test_module_with_attributes() {\n~9}\n",
    "any_test.rs": "fn n4_any_test() {\n~2}\n",
    "inner.rs": "//! Test helpers.\n#![cfg(test)]\nfn test_inner_cfg() {\n~9}\n",
}


def self_test():
    """Counts SELF_TEST's crate: what is counted, and how many lines, is what names say."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for name, text in SELF_TEST.items():
            path = os.path.join(d, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            text = re.sub(r"~(\d+)", lambda m: "    let x = 1;\n" * int(m.group(1)), text)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        got = sorted((name, lines) for _, _, name, lines in scan([d], 0))
    want = sorted(
        (name, int(m.group(1)))
        for text in SELF_TEST.values()
        for name in FN.findall(text)
        for m in [re.match(r"n(\d+)_", name)]
        if m
    )
    if got != want:
        print(f"fn-lengths self-test: counted {got}, expected {want}", file=sys.stderr)
        return 1
    print(f"fn-lengths self-test: {len(want)} functions counted as expected", file=sys.stderr)
    return 0


def main():
    args = sys.argv[1:]
    if args == ["--self-test"]:
        return self_test()
    limit = 120
    if args and args[0].isdigit():
        limit = int(args.pop(0))
    if not args:
        os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    roots = args or ["src"] + sorted(
        os.path.join("crates", c, "src") for c in os.listdir("crates")
    )
    found = scan(roots, limit)
    for path, line, name, lines in sorted(found, key=lambda f: -f[3]):
        print(f"{lines:5} {path}:{line} {name}")
    print(f"{len(found)} non-test function(s) over {limit} lines", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
