"""The README's C++ snippets come from examples/ (issue 28): every ```cpp block
introduced by "From [`examples/NAME`]" must be lines of that file, in order
(whitespace aside), and the quick start, the README's first C++ snippet, must
use kvlink::engine, the engine that gets every transport (shm on one host).
And the Mooncake drop-in section says one thing about metadata servers: that
they work.

    python3 test/docs/readme_snippets.py <source dir>
"""

import re
import sys
from pathlib import Path


def blocks(readme: str):
    """(example path or None, code lines) for each ```cpp block."""
    out, source, lines, inside = [], None, [], False
    for line in readme.splitlines():
        if inside:
            if line.strip() == "```":
                out.append((source, lines))
                inside, lines, source = False, [], None
            else:
                lines.append(line)
            continue
        m = re.search(r"From \[`(examples/[^`]+)`\]", line)
        if m:
            source = m.group(1)
        elif line.strip() == "```cpp":
            inside = True
        elif line.strip():
            source = None
    return out


def main() -> int:
    root = Path(sys.argv[1])
    found = blocks((root / "README.md").read_text())
    failures = []
    quoted = [(src, code) for src, code in found if src]
    if not quoted:
        failures.append("no README snippet names the example it comes from")
    for src, code in quoted:
        text = [l.strip() for l in (root / src).read_text().splitlines()]
        at = 0
        for line in (l.strip() for l in code):
            if line.startswith("// in a coroutine"):
                at = 0  # the coroutine may come earlier in the file
                continue
            if not line:
                continue
            try:
                at = text.index(line, at) + 1
            except ValueError:
                failures.append(f"{src}: the README quotes a line it does not have (in order): {line}")
                break
    first_src, first = found[0]
    if first_src != "examples/quick_start.cpp" or not any("kvlink::engine " in l for l in first):
        failures.append("the README's first C++ snippet is not examples/quick_start.cpp's "
                        "kvlink::engine")
    # One statement on metadata servers in the Mooncake drop-in: they work
    # (test/python/test_mooncake_metadata.py); none may say they give -1.
    readme = (root / "README.md").read_text()
    drop_in = readme[readme.find("### Mooncake drop-in"):]
    drop_in = drop_in[:drop_in.find("\n## ")]
    if re.search(r"metadata server[^.]*gives\s+-1\s+from\s+`initialize`", drop_in):
        failures.append("the Mooncake drop-in section says a metadata server gives -1 from "
                        "initialize (they work)")
    if "all work" not in drop_in:
        failures.append("the Mooncake drop-in section does not say that its metadata servers work")
    for f in failures:
        print("FAIL:", f)
    print(f"{len(quoted)} quoted snippet(s) checked")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
