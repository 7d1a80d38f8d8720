"""Generated text inside a hand-written markdown file: the block between two HTML comments is replaced,
the rest of the file is left as it is (BENCHMARKS.md holds the compile check's table and ``zoo doctor``'s
report this way)."""
from __future__ import annotations


def write_block(path: str, text: str, begin: str, end: str) -> None:
    """Replace the block between ``begin`` and ``end`` in ``path`` (appended when absent)."""
    with open(path) as f:
        doc = f.read()
    block = f"{begin}\n{text}\n{end}"
    if begin in doc and end in doc:
        doc = doc[:doc.index(begin)] + block + doc[doc.index(end) + len(end):]
    else:
        doc = doc.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(doc)
