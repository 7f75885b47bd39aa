"""Every snippet in the README and docs/ runs, every link resolves, every command and file a page names exists.

Conventions (docs/README.md says the same to writers):
- ```python and ```bash blocks run, in page order, in one scratch folder per page that mirrors the
  repository (bin/, nanoflow/ … linked, schedules/ copied), so a page may build on its earlier
  blocks and nothing is written into the repository. A block preceded by `<!-- no-run -->` is
  shown only (commands that need S3, several processes or hours).
- ```toml blocks are loaded with `nanoflow.load_config`: a complete config (with [model] and
  [[data_stages]]) as it is, a fragment merged over schedules/tiny.toml (its stages replaced when
  the fragment has [[data_stages]]), so every key a page shows is a real, valid key. The quick test
  loads them alone (a path that an earlier block of the page creates may be missing then); the slow
  one loads them in page order, strictly. A shown-only TOML block is still loaded by the quick test, its missing
  paths forgiven, so that its keys are real ones too.
- ```text blocks are output, never run. One right after a ```bash block that runs is that block's output and is
  compared with what it really prints (stdout and stderr): each shown line, in order, must be a line of it, where
  numbers may differ (times, speeds, losses vary by machine and CPU) but not a count of files, steps, stages,
  layers or heads, `...` or `…` stands for anything, runs of spaces for any spacing, and a table's rule (───) for
  a rule of any width.
- Every relative link of README.md and docs/*.md (images too) names a file of the repository, and a `#part` a
  heading of that file; docs/README.md lists every page; the `bin/…`, `tests/….py` and `nanoflow/….py` a page
  names exist; the README's Quickstart is what .ci/run runs, and its command table has every bin/ command.
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
# Pages whose blocks run, by their path in the repository: the README and docs/ (docs/README.md is the index).
PAGES = ["README.md"] + sorted(f"docs/{p.name}" for p in DOCS.glob("*.md") if p.name != "README.md")
LINKED = PAGES + ["docs/README.md"]   # pages whose links are checked
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
NO_RUN = "<!-- no-run -->"
NOT_MIRRORED = {".git", ".venv", "runs", "schedules", "__pycache__", ".pytest_cache", ".hypothesis", "build"}


def blocks(page: str) -> list[tuple[str, str, int, bool]]:
    """(language, code, line number, runs) of every fenced block of a page."""
    text = (REPO / page).read_text()
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
    table = "stage  time  tok/s\n─────  ─────  ─────\npretrain  26.6s  34"
    assert output_differs("stage  time  tok/s\n─────  ────  ─────\npretrain  1.8s  487", table) is None   # widths
    assert output_differs("stage  time  tok/s\n─────  ────", table) == "─────  ────"                  # columns


def test_docs_pages_exist():
    assert {f"docs/{name}.md" for name in ("stages", "resume", "s3", "parallelism", "data", "notebook", "design",
                                          "slurm", "config", "study")} <= set(PAGES)
    for page in PAGES:
        assert blocks(page), f"{page} has no code block"
        for language, _, line, _ in blocks(page):
            assert language in ("python", "bash", "toml", "text", "yaml"), f"{page}:{line}: ```{language or '(none)'}"


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
            pytest.fail(f"{page}:{line}: the TOML block does not load: {e}")


@pytest.mark.parametrize("page", PAGES)
def test_toml_blocks_load(page, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    folder = scratch(tmp_path)
    for n, (language, code, line, _) in enumerate(blocks(page)):
        if language == "toml":   # shown-only ones too: their paths may be missing, their keys must be real
            load_toml_block(folder, page, n, code, line, strict=False)


COUNT = re.compile(r"\b(\d[\d,]*) (files?|steps?|stages?|layers|heads)\b")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")


def shown_line_pattern(line: str) -> re.Pattern:
    """The regex a shown output line stands for (see the module docstring)."""
    pattern, at = "", 0
    for match in re.finditer(r"\.\.\.|…|\s+|─+|" + COUNT.pattern + "|" + NUMBER.pattern, line):
        pattern += re.escape(line[at:match.start()])
        text = match.group(0)
        if text in ("...", "…"):
            pattern += ".*"
        elif text.isspace():
            pattern += r"\s+"
        elif text.startswith("─"):   # a table's rule: its columns are as wide as the numbers below it
            pattern += "─+"
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
                return (f"{page}:{line}: the output shown is not what the block before prints: no line like "
                        f"{wrong!r} (in order) in\n{printed[-3000:]}")
        printed = None
        if language == "yaml":   # a file another tool reads (an lm-eval task): it must at least be YAML
            import yaml
            try:
                yaml.safe_load(code)
            except yaml.YAMLError as e:
                return f"{page}:{line}: the YAML block does not parse: {e}"
            continue
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
            result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return f"{page}:{line}: the {language} block ran over 600 s"
        if result.returncode != 0:
            return (f"{page}:{line}: the {language} block exits {result.returncode}\n"
                    f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}")
        printed = result.stdout + result.stderr if language == "bash" else None
    return None


@pytest.fixture(scope="module")
def page_results(tmp_path_factory) -> dict[str, str | None]:
    """Every page run at once, each in its own scratch folder (pages are independent; their blocks are not)."""
    folders = {page: scratch(tmp_path_factory.mktemp(page.removesuffix(".md").replace("/", "-"))) for page in PAGES}
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 1))) as pool:
        futures = {page: pool.submit(run_page, page, folder) for page, folder in folders.items()}
        return {page: future.result() for page, future in futures.items()}


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_code_blocks_run(page, page_results):
    if page_results[page] is not None:
        pytest.fail(page_results[page], pytrace=False)


# ---------------------------------------------------------------------------------------------------------------
# Links, named files and commands: what a reader follows from a page must be there.

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
NAMED = re.compile(r"(?<![\w./-])(bin/[A-Za-z][\w-]*|(?:tests|nanoflow)/[\w/]+\.py)")


def prose(page: str) -> str:
    """A page without its fenced blocks (a block's text is code or output, not links)."""
    return FENCE.sub("", (REPO / page).read_text())


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces
    as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading's get -1, -2 … as on GitHub."""
    found, counts = set(), {}
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", FENCE.sub("", path.read_text()), re.MULTILINE):
        base = slug(heading)
        found.add(f"{base}-{counts[base]}" if base in counts else base)
        counts[base] = counts.get(base, 0) + 1
    return found


def broken_links(page: str, text: str | None = None) -> list[str]:
    """The links of `page` (its prose, or `text` as if it were that page's) that lead nowhere."""
    found = []
    for target in LINK.findall(prose(page) if text is None else text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):      # https:, mailto: … are not the repository's
            continue
        file, _, part = target.partition("#")
        path = (REPO / page).parent / file if file else REPO / page
        if not path.exists():
            found.append(f"{page}: ({target}): no {os.path.relpath(path, REPO)}")
        elif part and (path.suffix != ".md" or part not in anchors(path)):
            found.append(f"{page}: ({target}): no heading #{part} in {file or page}")
    return found


def test_the_link_checker_finds_broken_links():
    assert slug("A stage's own learning rate") == "a-stages-own-learning-rate"
    assert slug("bin/prepare: writing token folders") == "binprepare-writing-token-folders"
    assert slug("Stage math (schedule.py) — the contract") == "stage-math-schedulepy--the-contract"
    assert anchors(REPO / "docs" / "resume.md") >= {"signals", "what-may-change-on-a-resume"}
    assert LINK.findall("see [a](x.md#y) and ![b](c.png), not `code`") == ["x.md#y", "c.png"]
    text = "[a](docs/nope.md) [b](docs/resume.md#nope) [c](docs/resume.md#signals) [d](#commands) [e](https://x.org)"
    assert broken_links("README.md", text) == ["README.md: (docs/nope.md): no docs/nope.md",
                                               "README.md: (docs/resume.md#nope): no heading #nope in docs/resume.md"]


@pytest.mark.parametrize("page", LINKED)
def test_relative_links_resolve(page):
    assert broken_links(page) == []


def test_every_page_is_in_the_index():
    listed = {target.partition("#")[0] for target in LINK.findall(prose("docs/README.md"))}
    assert {page.removeprefix("docs/") for page in PAGES if page.startswith("docs/")} - listed == set()


@pytest.mark.parametrize("page", LINKED)
def test_the_files_and_commands_a_page_names_exist(page):
    text = (REPO / page).read_text()
    assert NAMED.findall("bin/train, bin/verify-resume's, tests/unit/test_lr.py and nanoflow/io/store.py") == [
        "bin/train", "bin/verify-resume", "tests/unit/test_lr.py", "nanoflow/io/store.py"]
    assert sorted({name for name in NAMED.findall(text) if not (REPO / name).is_file()}) == []


def readme_section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def test_the_quickstart_is_what_ci_runs():
    shown = [code for language, code, _, _ in blocks("README.md") if language == "bash"
             and f"```bash\n{code}```" in readme_section("Quickstart")]
    assert len(shown) == 1, "the Quickstart has one bash block: its two commands"
    commands = shown[0].strip().splitlines()
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert len(commands) == 2 and commands == ci


def test_the_commands_table_has_every_command():
    table = readme_section("Commands")
    rows = re.findall(r"^\| `(bin/[\w-]+)", table, re.MULTILINE)
    assert sorted(rows) == sorted(f"bin/{p.name}" for p in (REPO / "bin").iterdir() if p.is_file())


def run_folders(page: str) -> set[str]:
    """The run folders (relative to the repository) that a page's runnable bash blocks train into: each bin/train
    (not --plan) writes its --set checkpoints.checkpoints_path, else its config file's own, relative to the file."""
    found = set()
    for language, code, _, runs in blocks(page):
        if language != "bash" or not runs:
            continue
        variables = {}
        for command in code.replace("\\\n", " ").splitlines():
            assigned = re.match(r"(\w+)='([^']*)'", command)   # run='checkpoints.checkpoints_path="../runs/x"'
            if assigned:
                variables[assigned.group(1)] = assigned.group(2)
            for name, value in variables.items():
                command = command.replace(f'"${name}"', value).replace(f"${name}", value)
            match = re.search(r"bin/train\s+(\S+\.toml)(.*)", command)
            if match is None or "--plan" in match.group(2) or command.lstrip().startswith("if "):   # if: it must fail
                continue
            config = Path(match.group(1))
            where = re.search(r"checkpoints\.checkpoints_path=\\?[\"']*([^\"'\\\s]+)", match.group(2))
            if where is not None:
                folder = where.group(1)
            else:
                source = REPO / config if (REPO / config).exists() else None
                if source is None:   # a config the page writes itself
                    continue
                folder = tomllib.loads(source.read_text())["checkpoints"]["checkpoints_path"]
            if "$" not in folder:
                found.add(os.path.normpath(config.parent / folder))
    return found


def test_no_two_pages_train_into_one_run_folder():
    """Pages followed in order in one checkout must not resume each other's runs: each example trains into a
    run folder of its own page (issue 30, item 25)."""
    pages: dict[str, list[str]] = {}
    for page in PAGES:
        for folder in run_folders(page):
            pages.setdefault(folder, []).append(page)
    assert {folder: users for folder, users in pages.items() if len(users) > 1} == {}
    assert run_folders("docs/resume.md") and run_folders("docs/stages.md")   # the parser finds them
