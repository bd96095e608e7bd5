#!/usr/bin/env python3
"""Fails naming each dependency a workspace crate declares but its code never names (issue 47:
a manifest lists what the code uses, nothing more). A dependency counts as used where the crate's
sources (src, tests, examples, benches, build.rs) name it as a path (`name::`), in a `use`, or in
`extern crate`. One kept for a reason other than its code (a feature of another crate's
dependency, say) carries `# kept: WHY` on its manifest line.
    python3 scripts/unused-deps.py   (run by scripts/test.sh)"""
import glob, os, re, sys

try:
    import tomllib
except ImportError:  # Python before 3.11
    sys.exit("unused-deps.py: needs Python 3.11 or later (tomllib) to read the manifests")

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
os.chdir(root)
members = ["."] + sorted(os.path.dirname(m) for m in glob.glob("crates/*/Cargo.toml"))
bad = []
for crate in members:
    manifest = os.path.join(crate, "Cargo.toml")
    text = open(manifest).read()
    kept = {m.group(1) for m in re.finditer(r"^([A-Za-z0-9_-]+)\s*[.=].*#\s*kept:", text, re.M)}
    spec = tomllib.loads(text)
    sources = []
    for part in ("src", "tests", "examples", "benches", "build.rs"):
        path = os.path.join(crate, part)
        if os.path.isfile(path):
            sources.append(path)
        for dirpath, _, files in os.walk(path):
            sources += [os.path.join(dirpath, f) for f in files if f.endswith(".rs")]
    code = "\n".join(open(f, errors="replace").read() for f in sources)
    for table in ("dependencies", "dev-dependencies", "build-dependencies"):
        for name in spec.get(table, {}):
            ident = re.escape(name.replace("-", "_"))
            if name in kept or re.search(
                rf"(?<![A-Za-z0-9_]){ident}::|\buse {ident}\b|\bextern crate {ident}\b", code
            ):
                continue
            bad.append(f"{manifest}: [{table}] {name} is never named by the crate's code")
if bad:
    print("unused dependencies (remove them, or mark the line `# kept: WHY`):", file=sys.stderr)
    print("\n".join("  " + b for b in bad), file=sys.stderr)
    sys.exit(1)
print(f"dependencies: every one of {len(members)} crates' dependencies is used")
