"""Every snippet in docs/ runs.

Conventions (docs/README.md says the same to writers):
- ```python and ```bash blocks run, in page order, in one scratch folder per page that mirrors the
  repository (bin/, nanoflow/ … linked, schedules/ copied), so a page may build on its earlier
  blocks and nothing is written into the repository. A block preceded by `<!-- no-run -->` is
  shown only (commands that need S3, several processes or hours).
- ```toml blocks are loaded with `nanoflow.load_config`: a complete config (with [model] and
  [[data_stages]]) as it is, a fragment merged over schedules/tiny.toml (its stages replaced when
  the fragment has [[data_stages]]), so every key a page shows is a real, valid key. The quick test
  loads them alone (a path that an earlier block of the page creates may be missing then); the slow
  one loads them in page order, strictly.
- ```text blocks are output, never run. One right after a ```bash block that runs is that block's output and is
  compared with what it really prints (stdout and stderr): each shown line, in order, must be a line of it, where
  numbers may differ (times, speeds, losses vary by machine and CPU) but not a count of files, steps, stages,
  layers or heads, `...` or `…` stands for anything, and runs of spaces for any spacing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import REPO
from nanoflow import ConfigError, load_config
from nanoflow.interop.nanotron import to_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DOCS = REPO / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")   # README.md: the index
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
NO_RUN = "<!-- no-run -->"
NOT_MIRRORED = {".git", ".venv", "runs", "schedules", "__pycache__", ".pytest_cache", ".hypothesis", "build"}


def blocks(page: str) -> list[tuple[str, str, int, bool]]:
    """(language, code, line number, runs) of every fenced block of a page."""
    text = (DOCS / page).read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[:match.start()].rstrip().rsplit("\n", 1)[-1].strip()
        found.append((match.group(1), match.group(2), text.count("\n", 0, match.start()) + 1, before != NO_RUN))
    return found


def committed_entries() -> set[str]:
    """The repository's top-level files and folders that git tracks: only those are mirrored, so that what the
    user made in the checkout (runs/, hf/, an error.txt) is neither read by a page nor written through a link."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return {path.split("/", 1)[0] for path in listed.split("\0") if path}


def scratch(tmp_path: Path) -> Path:
    """A folder that looks like the repository: links to its committed files, a copy of schedules/ (fragments are
    written there)."""
    for name in sorted(committed_entries() - NOT_MIRRORED):
        (tmp_path / name).symlink_to(REPO / name)
    shutil.copytree(REPO / "schedules", tmp_path / "schedules")
    return tmp_path


def merge(base: dict, fragment: dict) -> dict:
    out = dict(base)
    for key, value in fragment.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def test_shown_output_may_differ_in_numbers_but_not_in_counts_or_words():
    printed = "train.log written\nexported step 4 to hf/tiny: 5 files, float32; tokenizer: bytes\nstep  2/12  loss 5.5530"
    assert output_differs("exported step 4 to hf/tiny: 5 files, float32; tokenizer: bytes", printed) is None
    assert output_differs("step 2/12 loss 4.1", printed) is None
    assert output_differs("exported step 4 to hf/tiny: 6 files, float32; tokenizer: bytes", printed) is not None
    assert output_differs("step 2/12 (pretrain) loss 5.5530", printed) is not None
    assert output_differs("exported ... 5 files, ...", printed) is None
    assert output_differs("step 2/12 loss 5.5530\ntrain.log written", printed) == "train.log written"  # order


def test_docs_pages_exist():
    assert {"stages.md", "resume.md", "s3.md", "parallelism.md", "data.md", "notebook.md"} <= set(PAGES)
    for page in PAGES:
        assert blocks(page), f"docs/{page} has no code block"
        for language, _, line, _ in blocks(page):
            assert language in ("python", "bash", "toml", "text"), f"docs/{page}:{line}: ```{language or '(none)'}"


def load_toml_block(folder: Path, page: str, n: int, code: str, line: int, *, strict: bool = True) -> None:
    tiny = tomllib.loads((REPO / "schedules" / "tiny.toml").read_text())
    raw = tomllib.loads(code)
    complete = "model" in raw and "data_stages" in raw
    path = folder / "schedules" / f"_docs_{n}.toml"
    path.write_text(code if complete else to_toml(merge(tiny, raw)))
    try:
        load_config(path)
    except Exception as e:
        problems = [p for p in str(e).splitlines()[1:] if strict or not p.strip().endswith("does not exist")]
        if problems or not isinstance(e, ConfigError):
            pytest.fail(f"docs/{page}:{line}: the TOML block does not load: {e}")


@pytest.mark.parametrize("page", PAGES)
def test_toml_blocks_load(page, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    folder = scratch(tmp_path)
    for n, (language, code, line, runs) in enumerate(blocks(page)):
        if language == "toml" and runs:
            load_toml_block(folder, page, n, code, line, strict=False)


COUNT = re.compile(r"\b(\d[\d,]*) (files?|steps?|stages?|layers|heads)\b")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def shown_line_pattern(line: str) -> re.Pattern:
    """The regex a shown output line stands for (see the module docstring)."""
    pattern, at = "", 0
    for match in re.finditer(r"\.\.\.|…|\s+|" + COUNT.pattern + "|" + NUMBER.pattern, line):
        pattern += re.escape(line[at:match.start()])
        text = match.group(0)
        if text in ("...", "…"):
            pattern += ".*"
        elif text.isspace():
            pattern += r"\s+"
        elif COUNT.fullmatch(text):
            pattern += re.escape(text)
        else:
            pattern += NUMBER.pattern
        at = match.end()
    return re.compile(pattern + re.escape(line[at:]))


def output_differs(shown: str, printed: str) -> str | None:
    """None when every shown line is, in order, a line of what was printed; else the first that is not."""
    lines = [line.strip() for line in printed.splitlines()]
    at = 0
    for line in (line.strip() for line in shown.splitlines()):
        if not line:
            continue
        pattern = shown_line_pattern(line)
        found = next((i for i in range(at, len(lines)) if pattern.fullmatch(lines[i])), None)
        if found is None:
            return line
        at = found + 1
    return None


def run_page(page: str, folder: Path) -> str | None:
    """Run a page's blocks in order in `folder`; None, or what went wrong."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("WORLD_SIZE", None)
    printed = None   # what the last block that ran printed, when it was a bash block
    for n, (language, code, line, runs) in enumerate(blocks(page)):
        if language == "text" and printed is not None:
            wrong = output_differs(code, printed)
            if wrong is not None:
                return (f"docs/{page}:{line}: the output shown is not what the block before prints: no line like "
                        f"{wrong!r} (in order) in\n{printed[-3000:]}")
        printed = None
        if not runs or language not in ("python", "bash", "toml"):
            continue
        if language == "toml":
            try:
                load_toml_block(folder, page, n, code, line)
            except pytest.fail.Exception as e:
                return str(e)
            continue
        if language == "python":
            script = folder / f"_docs_{n}.py"
            script.write_text(code)
            command = [sys.executable, str(script)]
        else:
            command = ["bash", "-e", "-o", "pipefail", "-c", code]
        try:
            result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired:
            return f"docs/{page}:{line}: the {language} block ran over 180 s"
        if result.returncode != 0:
            return (f"docs/{page}:{line}: the {language} block exits {result.returncode}\n"
                    f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}")
        printed = result.stdout + result.stderr if language == "bash" else None
    return None


@pytest.fixture(scope="module")
def page_results(tmp_path_factory) -> dict[str, str | None]:
    """Every page run at once, each in its own scratch folder (pages are independent; their blocks are not)."""
    folders = {page: scratch(tmp_path_factory.mktemp(page.removesuffix(".md"))) for page in PAGES}
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 1))) as pool:
        futures = {page: pool.submit(run_page, page, folder) for page, folder in folders.items()}
        return {page: future.result() for page, future in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_code_blocks_run(page, page_results):
    if page_results[page] is not None:
        pytest.fail(page_results[page], pytrace=False)
