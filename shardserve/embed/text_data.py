"""Real English text any Debian machine can have, for tests and benchmarks of the embedder.

Two sources, the first present is read (`source="auto"`):

- Debian's `fortunes` package (`apt-get install -y fortunes`): quotations, jokes and verse in
  /usr/share/games/fortunes, one file a topic, entries between lines holding `%`. Taken a file at a
  time in turn (files by name), so the first few hundred texts span every topic and every length.
- The package descriptions apt keeps (`apt-get update` fetches them): each package's one-line
  summary, as `apt-cache dumpavail` prints it, by package name.

Both orders are fixed by the data alone, so the same limit gives the same texts on every run.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

from shardserve.errors import ShardserveError

FORTUNES_DIR = Path("/usr/share/games/fortunes")

_OVERSTRIKE = re.compile(r".\x08")  # fortune's underlining and bold: "_\bx", "x\bx"
_SPACE = re.compile(r"\s+")


class TextDataMissing(ShardserveError):
    """Neither source is on this machine."""


def real_texts(limit: int | None = None, *, source: Literal["auto", "fortunes", "apt"] = "auto",
               fortunes_dir: Path = FORTUNES_DIR) -> list[str]:
    """The first `limit` distinct texts (all with None) of a source, in its fixed order.

    Arguments:
        limit: how many texts at most.
        source: "fortunes", "apt", or "auto" (fortunes when installed, else apt's descriptions).
        fortunes_dir: where the fortunes package put its files.
    """
    if source == "auto":
        source = "fortunes" if _fortune_files(fortunes_dir) else "apt"
    texts = fortunes(fortunes_dir) if source == "fortunes" else apt_descriptions()
    return list(itertools.islice(_distinct(texts), limit))


def fortunes(directory: Path = FORTUNES_DIR) -> Iterator[str]:
    """Every entry of every fortune file that reads as prose, on one line, the files taken in turn."""
    files = _fortune_files(directory)
    if not files:
        raise TextDataMissing(f"no fortune files in {directory}: apt-get install -y fortunes")
    per_file = [_entries(path.read_text(encoding="utf-8", errors="replace")) for path in files]
    for row in itertools.zip_longest(*per_file):
        yield from (text for text in row if text is not None)


def apt_descriptions() -> Iterator[str]:
    """The one-line summary of every package apt knows, by package name."""
    apt_cache = shutil.which("apt-cache")
    if apt_cache is None:
        raise TextDataMissing("neither fortunes nor apt-cache on this machine: on Debian, "
                              "apt-get install -y fortunes")
    dump = subprocess.run([apt_cache, "dumpavail"], capture_output=True, text=True, check=True).stdout
    summaries: dict[str, str] = {}
    for record in dump.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in record.splitlines() if ": " in line[:80]
                      and not line.startswith(" "))
        if "Package" in fields and "Description" in fields:
            summaries.setdefault(fields["Package"], _SPACE.sub(" ", fields["Description"]).strip())
    if not summaries:
        raise TextDataMissing("apt knows no package descriptions: apt-get update (or apt-get install -y "
                              "fortunes)")
    for name in sorted(summaries):
        yield summaries[name]


def _fortune_files(directory: Path) -> list[Path]:
    """The fortune text files (no `.dat` index, no `.u8` link to the same text), by name."""
    if not directory.is_dir():
        return []
    return sorted(path for path in directory.iterdir() if path.is_file() and "." not in path.name)


def _entries(content: str) -> Iterator[str]:
    for raw in re.split(r"^%$", content, flags=re.MULTILINE):
        text = _SPACE.sub(" ", _OVERSTRIKE.sub("", raw)).strip()
        if text and _is_prose(text):
            yield text


def _is_prose(text: str) -> bool:
    """Not ASCII art or a table: mostly letters and spaces."""
    return sum(c.isalpha() or c == " " for c in text) >= 0.75 * len(text)


def _distinct(texts: Iterable[str]) -> Iterator[str]:
    seen: set[str] = set()
    for text in texts:
        if text not in seen:
            seen.add(text)
            yield text


def main() -> None:
    """`python -m shardserve.embed.text_data [LIMIT]`: the texts, one a line (a `.txt` corpus for
    `shardserve build --text-column text --embedder ...`; make demo-text writes one so)."""
    import sys

    limit = int(sys.argv[1]) if len(sys.argv) > 1 else None
    sys.stdout.writelines(text + "\n" for text in real_texts(limit))


if __name__ == "__main__":
    main()
