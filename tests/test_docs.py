"""The documentation holds together: every relative link of README.md, docs/ and examples/ reaches a file (and its
#anchor, as GitHub spells heading anchors), README lines stay within 120 characters, every `make TARGET` and
`qgrpo SUBCOMMAND` the Markdown names exists, every page of docs/ is on the map (docs/index.md), and nothing in the
repository points at notes outside it. Cheap: reads text files only."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINE = 120
GENERATED = {Path("docs/reference/config.md")}  # written from the schema: its table rows may run longer
# Folders that are not the project's own text: environments, caches, build output, run and benchmark output.
SKIP_DIRS = {".venv", "venv", ".git", "build", ".cache", "runs", "__pycache__", ".pytest_cache", "results"}
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yaml", ".yml", ".txt", ".json", ".jsonl", ".cfg", ".ini", ".sh"}
# Notes that live outside the repository: a reader of the repository cannot follow them. Spelled in two parts so
# that this file does not name them itself.
FORBIDDEN = ("../" + "shared", "shared/" + "FACTS", "FACTS" + ".md", "DESIGN" + ".md")

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# A reference-style link's target, `[label]: path/file.md#anchor` (a path: a "/", a ".md" or a "#"; the config
# reference's `[section]: words` lines are prose)
_REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?([^\s>]*(?:/|\.md|#)[^\s>]*)>?\s*$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_MAKE = re.compile(r"(?<![\w./-])make((?:\s+[A-Z_][A-Z0-9_]*=\S*)*)\s+([a-z][\w-]*)")
_QGRPO = re.compile(r"(?<![\w.~-])(?<!~/)qgrpo[ \t]+([a-z][\w-]*)")  # not the folder ~/qgrpo


@dataclass
class Page:
    """A Markdown file split into prose (inline code removed) and code (fenced blocks and inline code spans)."""

    path: Path
    lines: list[str]
    prose: list[tuple[int, str]] = field(default_factory=list)  # (line number, text without inline code)
    code: list[tuple[int, str]] = field(default_factory=list)  # (line number, code text)
    headings: list[str] = field(default_factory=list)


def parse(path: Path) -> Page:
    page = Page(path, path.read_text(encoding="utf-8").splitlines())
    fence = None
    for n, line in enumerate(page.lines, start=1):
        m = _FENCE.match(line)
        if fence is not None:
            if m and m.group(1) == fence:
                fence = None
            else:
                page.code.append((n, line))
            continue
        if m:
            fence = m.group(1)
            continue
        page.code += [(n, span.group(2)) for span in _INLINE_CODE.finditer(line)]
        page.prose.append((n, _INLINE_CODE.sub("", line)))
        if h := _HEADING.match(line):
            page.headings.append(h.group(2))
    return page


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link syntax reduced to its text, lower case, punctuation dropped (letters,
    digits, `_`, `-` and spaces stay), spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in parse(path).headings:
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def link_problems(path: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of `path` whose file, folder or #anchor does not exist, or that leaves `root`."""
    page, bad = parse(path), []
    for n, text in page.prose:
        for target in [m.group(1) for m in _LINK.finditer(text)] + [m.group(1) for m in [_REF_DEF.match(text)] if m]:
            if _SCHEME.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path.resolve()
            where = f"{path.relative_to(root)}:{n}: {target}"
            if not dest.is_relative_to(root.resolve()):
                bad.append(f"{where}: leaves the repository")
            elif not dest.exists():
                bad.append(f"{where}: no such file or folder")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(root.resolve())}")
    return bad


def markdown_files(root: Path = ROOT) -> list[Path]:
    files = [root / "README.md"]
    for top in ("docs", "examples"):
        files += sorted((root / top).rglob("*.md"))
    return [f for f in files if f.is_file()]


def project_text_files(root: Path = ROOT) -> list[Path]:
    out = []
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
        out += [Path(top, f) for f in sorted(files) if Path(f).suffix in TEXT_SUFFIXES or f in ("Makefile", "run")]
    return out


def make_targets(makefile: Path = ROOT / "Makefile") -> set[str]:
    targets = set()
    for line in makefile.read_text().splitlines():
        if m := re.match(r"^\.PHONY\s*:(.*)$", line):
            targets.update(m.group(1).split())
        elif (m := re.match(r"^([A-Za-z0-9_.-]+(?:\s+[A-Za-z0-9_.-]+)*)\s*:(?!=)", line)) and not line.startswith("\t"):
            targets.update(m.group(1).split())
    return targets


def subcommands() -> set[str]:
    """The subcommands `qgrpo --help` lists (argparse's `{train,submit,...}`)."""
    out = subprocess.run([sys.executable, "-m", "qgrpo", "--help"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"\{([a-z][\w,-]*)\}", out)
    assert m, f"no subcommand list in `qgrpo --help`:\n{out}"
    return set(m.group(1).split(","))


def named_commands(pattern: re.Pattern, group: int, files: list[Path]) -> list[tuple[str, str]]:
    """(where, name) for every command the code of these Markdown files names, e.g. `make train` -> train."""
    out = []
    for f in files:
        for n, code in parse(f).code:
            out += [(f"{f.relative_to(ROOT)}:{n}", m.group(group)) for m in pattern.finditer(code)]
    return out


# ---------------------------------------------------------------------------------------------------------------


def test_relative_links_and_anchors_resolve():
    bad = [b for f in markdown_files() for b in link_problems(f)]
    assert bad == [], "broken links:\n" + "\n".join(bad)


def test_the_link_check_can_fail(tmp_path):
    # A broken file link, a missing anchor, a link out of the tree and a good one: only the three are reported
    # (guards against a vacuous check). Links inside code are not links.
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## The `qgrpo check` command\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text("# Page\n\n[gone](gone.md) [no anchor](other.md#nope) [out](../../x.md)\n"
                    "[fine](other.md#the-qgrpo-check-command) [self](#page) `[code](gone.md)`\n"
                    "```\n[fenced](gone.md)\n```\n[ref]: other.md#gone\n[ok]: other.md#other-page\n")
    bad = link_problems(page, tmp_path)
    assert [b.split(": ", 2)[1] for b in bad] == ["gone.md", "other.md#nope", "../../x.md", "other.md#gone"], bad


def test_slugs_are_github_style():
    assert slug("Coming from MLX-GRPO") == "coming-from-mlx-grpo"
    assert slug("`qgrpo submit`") == "qgrpo-submit"
    assert slug("2. Your own task, step by step") == "2-your-own-task-step-by-step"
    assert slug("Is the gain real?") == "is-the-gain-real"
    assert slug("Torch and vLLM rollouts in the default job") == "torch-and-vllm-rollouts-in-the-default-job"


def test_readme_and_guides_keep_lines_short():
    long_lines = [f"{f.relative_to(ROOT)}:{n}: {len(line)} characters"
                  for f in markdown_files() if f.relative_to(ROOT) not in GENERATED
                  for n, line in enumerate(f.read_text().splitlines(), start=1) if len(line) > MAX_LINE]
    assert long_lines == [], f"lines over {MAX_LINE} characters:\n" + "\n".join(long_lines)


def test_every_guide_is_on_the_map():
    index = (ROOT / "docs" / "index.md").read_text()
    pages = [p.relative_to(ROOT / "docs").as_posix() for p in sorted((ROOT / "docs").rglob("*.md"))]
    missing = [p for p in pages if p != "index.md" and f"]({p}" not in index]
    assert missing == [], f"docs pages docs/index.md does not link: {missing}"


def test_make_targets_named_in_the_docs_exist():
    targets = make_targets()
    assert {"train", "test", "test-slow", "install-cuda"} <= targets, targets
    named = named_commands(_MAKE, 2, markdown_files())
    assert named, "no `make TARGET` found in the Markdown: the pattern is broken"
    bad = [f"{where}: make {name}" for where, name in named if name not in targets]
    assert bad == [], "make targets the Makefile does not have:\n" + "\n".join(bad)


def test_qgrpo_subcommands_named_in_the_docs_exist():
    commands = subcommands()
    assert {"train", "check", "submit", "eval", "report"} <= commands, commands
    named = named_commands(_QGRPO, 1, markdown_files())
    assert named, "no `qgrpo SUBCOMMAND` found in the Markdown: the pattern is broken"
    bad = [f"{where}: qgrpo {name}" for where, name in named if name not in commands]
    assert bad == [], "qgrpo subcommands that do not exist:\n" + "\n".join(bad)


def test_command_patterns_find_what_they_should():
    code = "make train CONFIG=x ARGS='-a'; make CONFIG=y test; .venv/bin/qgrpo check c; python -m qgrpo report r"
    assert [m.group(2) for m in _MAKE.finditer(code)] == ["train", "test"]
    other = "; from qgrpo.core import x; qgrpo: error; the project at ~/qgrpo on every node"
    assert [m.group(1) for m in _QGRPO.finditer(code + other)] == ["check", "report"]


def test_nothing_points_at_notes_outside_the_repository():
    bad = []
    for p in project_text_files():
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), start=1):
            bad += [f"{p.relative_to(ROOT)}:{n}: {word}" for word in FORBIDDEN if word in line]
    assert bad == [], "mentions of notes outside the repository:\n" + "\n".join(bad)
