"""The docs: the generated troubleshooting page is current, the nav names every page, the README
keeps its shape, every quick-start script in the README and the docs runs (on CPU), and every
quoted output (a ```text block after an ``<!-- output: NAME -->`` marker) is what the program
prints when the command the page gives is run: `QUOTES` runs each; numbers of seconds and GB/s
vary from run to run and are compared as N; a quoted line ``...`` stands for any lines.
``python tests/test_docs.py --write`` rewrites every quote from a run."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import deadline

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(DOCS))
import gen_troubleshooting  # noqa: E402

#: A quick start: a ```python title="x.py"``` fence whose preceding line gives its launch command.
FENCE = re.compile(r'(?P<before>[^\n]*)\n\n```python title="(?P<name>[\w.]+\.py)"\n'
                   r"(?P<code>.*?)\n```", re.S)
COMMAND = re.compile(r"`((?:torchrun --nproc_per_node (?P<n>\d+)|python(?P<pytest> -m pytest)?) "
                     r"(?P<script>[\w.]+\.py))`")


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _quick_starts() -> list[tuple[str, str, str, int]]:
    """(where, script name, code, processes) of every quick start in README.md and docs/
    (processes 0: a test file, run by pytest)."""
    found = []
    for path in [ROOT / "README.md", *_pages()]:
        for m in FENCE.finditer(path.read_text(encoding="utf-8")):
            cmd = COMMAND.search(m.group("before"))
            assert cmd is not None and cmd.group("script") == m.group("name"), (path, m.group(0))
            found.append((f"{path.relative_to(ROOT)}:{m.group('name')}", m.group("name"),
                          m.group("code"), 0 if cmd.group("pytest") else int(cmd.group("n") or 1)))
    return found


def test_the_troubleshooting_page_is_generated_from_the_current_data() -> None:
    committed = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    assert committed == gen_troubleshooting.render(), \
        "run `python docs/gen_troubleshooting.py` and commit docs/troubleshooting.md"


def test_the_page_names_every_cause_signature_remedy_and_rule() -> None:
    import tomllib

    from resilient_strategy.core.measures.probe import CAUSES

    page = gen_troubleshooting.render()
    core = gen_troubleshooting.CORE
    data = {name: tomllib.loads((core / name).read_text()) for name in
            ("signatures.toml", "remedies.toml", "known_issues.toml")}
    assert all(f"### `{c}`" in page for c in CAUSES if c)
    assert all(f"`{e['id']}`" in page for e in data["signatures.toml"]["signature"])
    assert all(f"`{e['id']}`" in page for e in data["remedies.toml"]["remedy"])
    assert all(f"### `{e['id']}`" in page for e in data["known_issues.toml"]["rule"])


def test_the_troubleshooting_page_shows_no_raw_placeholder() -> None:
    from resilient_strategy.core.knowledge.clauses import _MESSAGE_FACT

    page = gen_troubleshooting.render()
    assert _MESSAGE_FACT.findall(page) == []
    assert "NCCL_IB_HCA==mlx5_0,mlx5_1" in page  # a remedy's variable from a fact, filled


def test_a_signature_of_an_unknown_cause_is_still_listed(tmp_path: Path) -> None:
    for name in ("known_issues.toml", "remedies.toml"):
        shutil.copy(gen_troubleshooting.CORE / name, tmp_path)
    (tmp_path / "signatures.toml").write_text(
        '[[signature]]\nid = "new-thing"\ncause = "not_a_cause_yet"\nmatch = "boom"\n'
        'source = "https://github.com/NVIDIA/nccl/issues/342"\n')
    page = gen_troubleshooting.render(tmp_path)
    assert "#### `new-thing`" in page and "`boom`" in page


def test_every_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    nav = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    pages = {str(p.relative_to(DOCS)) for p in _pages()}
    assert nav == pages


def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.split()) < 1600
    first = re.search(r"\A# resilient_strategy\n\n```bash\n(.*?)\n```", text, re.S)
    assert first is not None
    doctor, tests = first.group(1).splitlines()
    assert doctor.endswith("python -m resilient_strategy doctor")
    # each command in an environment of its own; the default package index only
    assert doctor.split(" && ")[0] != tests.split(" && ")[0]
    assert "index-url" not in doctor + tests
    assert tests.rsplit("&& ", 1)[1] == "python -m pytest -q -n 2 --dist loadfile"
    # .ci/run runs README's lines themselves, read from README.md, not a copy of them
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'eval "$main_job"' in ci and 'eval "$test_job"' in ci
    # the other pytest steps: the network-namespace test bed and a local SLURM, which the main
    # command deselects (pyproject's addopts), and the load-sensitive tests again under two busy
    # loops (issue 47 item 4)
    others = [line for line in ci.splitlines() if line.startswith("python -m pytest")]
    bed = "python -m pytest -q -p no:xdist -m bed tests/test_testbed.py"
    loaded = "python -m pytest -q -p no:xdist $load_tests"
    assert {bed, loaded} <= set(others) <= {
        bed, loaded, "python -m pytest -q -p no:xdist -m slurm tests/test_slurm.py"}
    assert "python -c 'while 1: pass' &" in ci and "trap 'kill" in ci
    assert "mkdocs build --strict" in ci


def test_every_quick_start_fits_on_a_screen() -> None:
    starts = _quick_starts()
    assert {name for _, name, _, _ in starts} >= {
        "train.py", "train_keras.py", "train_lightning.py", "train_accelerate.py",
        "test_fallback.py"}
    assert all(len(code.splitlines()) <= 15 for _, _, code, _ in starts)


def _needs(code: str) -> str | None:
    for module in ("lightning", "accelerate", "tensorflow", "torch"):
        if re.search(rf"\b(import|from) {module}\b|\b{module} as\b|, {module}\b|"
                     rf"integrations\.{module}\b", code) \
                and importlib.util.find_spec(module) is None:
            return module
    return None


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize(("where", "name", "code", "nproc"), _quick_starts(),
                         ids=[w for w, *_ in _quick_starts()])
def test_the_quick_start_runs(where: str, name: str, code: str, nproc: int,
                              tmp_path: Path) -> None:
    missing = _needs(code)
    if missing:
        pytest.skip(f"{missing} is not installed")
    (tmp_path / name).write_text(code + "\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "RESILIENT_STRATEGY_CACHE_DIR": str(tmp_path / "cache"), "TF_CPP_MIN_LOG_LEVEL": "2",
           "CUDA_VISIBLE_DEVICES": ""}  # the CPU paths, also on a GPU machine
    env.pop("RESILIENT_STRATEGY_PROBE_FAULT", None)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name] if nproc == 0 \
        else [sys.executable, name] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
        "--standalone", name]  # a port it binds itself: none picked before, none shared
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=deadline(300))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "terminate called" not in out.stderr


# ----- quoted outputs (issue 47 item 3): what the page says a command prints, it prints -------
#: ``<!-- output: NAME -->``, then a ```text block: the output of `QUOTES`[NAME].
QUOTE = re.compile(r"<!-- output: (?P<name>[\w-]+) -->\n```text\n(?P<text>.*?)\n?```", re.S)
#: What varies from run to run, or from one machine without GPUs to another: a number of seconds
#: or of GB/s, the port torchrun picked, the build of the torch installed (CPU-only, or CUDA's).
_VARIES = re.compile(r"\b\d+(?:\.\d+)?(?= (?:s|GB/s)\b)|(?<=localhost:)\d+\b"
                     r"|(?<=; torch )\S+ \([^)]*\)")
#: README's first quick start (the one the quotes run).
TRAIN = next(code for where, _, code, _ in _quick_starts() if where == "README.md:train.py")
#: The decision-trace page's script: the quick start's decision, and its whole trace printed.
EXPLAIN = ("import resilient_strategy\n"
           "sel = resilient_strategy.resilient_strategy(framework=\"torch\", global_batch_size=256)\n"
           "sel.print(sel.explain(verbose=True))\n")
FAULT = {"RESILIENT_STRATEGY_PROBE_FAULT": "exit:1"}
#: name -> (the page it is quoted in, the script (None: README's doctor), processes, extra
#: environment, whether several processes print: the order of their lines is not compared)
QUOTES: dict[str, tuple[str, str | None, int, dict[str, str], bool]] = {
    "doctor-plan": ("README.md", None, 0, {}, False),
    "quick-start": ("docs/getting-started.md", TRAIN, 2, {}, True),
    "fallback": ("README.md", TRAIN, 2, FAULT, True),
    "fallback-trace": ("docs/how-to/decision-trace.md", EXPLAIN, 2, FAULT, True),
    "adoption-lines": ("docs/how-to/adopt-ddp.md", None, 0, {}, False),
}
#: quotes of a program of this repository's own, run as it is (not doctor, not a script above)
PROGRAMS: dict[str, list[str]] = {
    "adoption-lines": [sys.executable, str(ROOT / "benchmarks" / "adoption_lines.py")],
}


def _quotes(path: Path) -> dict[str, str]:
    return {m.group("name"): m.group("text") for m in QUOTE.finditer(path.read_text("utf-8"))}


def _printed(name: str, tmp: Path) -> list[str]:
    """What QUOTES[name]'s command prints on this machine: doctor's stdout from its plan for
    torch on; a torchrun's every process's stdout and this package's lines on stderr (its
    warnings), not torchrun's own."""
    _, code, nproc, extra, _ = QUOTES[name]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
           "RESILIENT_STRATEGY_CACHE_DIR": str(tmp / "cache"), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RESILIENT_STRATEGY_PROBE_FAULT", None)
    env.update(extra)
    if name in PROGRAMS:
        out = subprocess.run(PROGRAMS[name], cwd=tmp, env=env, capture_output=True, text=True,
                             timeout=deadline(60))
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return out.stdout.rstrip("\n").splitlines()
    if code is None:  # README's first command: doctor, its plan for torch (what it installs)
        argv = [sys.executable, "-m", "resilient_strategy", "doctor", "--framework", "torch"]
    else:
        (tmp / "train.py").write_text(code + "\n", encoding="utf-8")
        argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--standalone", "train.py"]
    out = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True,
                         timeout=deadline(300))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.rstrip("\n").splitlines()
    if code is None:
        return lines[lines.index("== torch =="):]
    return lines + [x for x in out.stderr.splitlines() if x.startswith("resilient_strategy")]


def _matches(quote: list[str], printed: list[str]) -> bool:
    """The quote's lines in order, each ``...`` any lines (none too), numbers that vary as N."""
    q = [_VARIES.sub("N", line) for line in quote]
    p = [_VARIES.sub("N", line) for line in printed]

    def at(i: int, j: int) -> bool:
        if i == len(q):
            return j == len(p)
        if q[i] == "...":
            return any(at(i + 1, k) for k in range(j, len(p) + 1))
        return j < len(p) and q[i] == p[j] and at(i + 1, j + 1)

    return at(0, 0)


def test_every_quoted_output_is_named_and_every_name_is_quoted_once() -> None:
    found = [(str(path.relative_to(ROOT)), name) for path in [ROOT / "README.md", *_pages()]
             for name in _quotes(path)]
    assert sorted(found) == sorted((page, name) for name, (page, *_) in QUOTES.items())


def test_what_ci_saw_readmes_first_command_print_is_checked_against_its_quote() -> None:
    quote = _quotes(ROOT / "README.md")["doctor-plan"]
    assert _check_printed("doctor-plan", "Successfully installed torch\nGPUs...\n" + quote)
    assert not _check_printed("doctor-plan", quote.replace("chose: CPU", "chose: gloo"))


def test_the_adoption_line_counts_quoted_are_the_scripts() -> None:
    """docs/how-to/adopt-ddp.md's table is what benchmarks/adoption_lines.py counts in the
    public-scripts suite (issue 43 item 5), in process (the slow test runs the program)."""
    spec = importlib.util.spec_from_file_location("adoption_lines",
                                                  ROOT / "benchmarks" / "adoption_lines.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    quote = _quotes(ROOT / QUOTES["adoption-lines"][0])["adoption-lines"]
    assert quote == module.render(module.table())
    assert len(module.table()) >= 4


def test_the_quote_matcher() -> None:
    assert _matches(["decided in 0.55 s", "..."], ["decided in 3.25 s", "a", "b"])
    assert _matches(["rendezvous localhost:41163."], ["rendezvous localhost:29500."])
    assert _matches(["Saw no GPU; torch 2.13.0+cpu (CPU-only build)."],
                    ["Saw no GPU; torch 2.13.0 (CUDA 12.8, NCCL 2.27.5)."])
    assert _matches(["a", "...", "c"], ["a", "c"]) and not _matches(["a"], ["a", "b"])
    assert not _matches(["on 2 CPU processes"], ["on 3 CPU processes"])


@pytest.mark.slow
@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(QUOTES))
def test_a_quoted_output_is_what_the_program_prints(name: str, tmp_path: Path) -> None:
    from resilient_strategy.machine.nvml import nvidia_present

    if nvidia_present():
        pytest.skip("the quotes are a machine's without GPUs")
    page, *_, any_order = QUOTES[name]
    quote = _quotes(ROOT / page)[name].splitlines()
    printed = _printed(name, tmp_path)
    if any_order:  # several processes print: each line compared, not their order
        assert sorted(_VARIES.sub("N", x) for x in quote) == sorted(
            _VARIES.sub("N", x) for x in printed), "\n".join(printed)
    else:
        assert _matches(quote, printed), "\n".join(printed)


# ----- the reference (issue 32): words for every public field, no raw Sphinx roles -------------
SRC = ROOT / "src" / "resilient_strategy"
#: Sphinx roles render literally under mkdocstrings: its cross-references ([name][path]) or
#: backticks instead.
ROLE = re.compile(r":(?:meth|attr|mod|func|class|data|exc|obj):`")


def test_no_docstring_uses_a_raw_sphinx_role() -> None:
    used = [f"{p.relative_to(ROOT)}:{n}" for p in sorted(SRC.rglob("*.py"))
            for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if ROLE.search(line)]
    assert used == []


@pytest.mark.parametrize(("module", "cls"), [("selection.py", "Selection"),
                                             ("core/call/options.py", "Launch")])
def test_every_public_field_and_member_of_the_reference_classes_has_words(
        module: str, cls: str) -> None:
    import ast

    tree = ast.parse((SRC / module).read_text(encoding="utf-8"))
    body = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls).body
    bare = []
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
            nxt = body[i + 1] if i + 1 < len(body) else None
            said = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                and isinstance(nxt.value.value, str) and nxt.value.value.strip()
        elif isinstance(node, ast.FunctionDef):
            name, said = node.name, bool((ast.get_docstring(node) or "").strip())
        else:
            continue
        if not name.startswith("_") and not said:
            bare.append(name)
    assert bare == []


def test_the_entry_point_documents_its_returns_and_raises() -> None:
    from resilient_strategy.deciding.executor import resilient_strategy

    doc = resilient_strategy.__doc__ or ""
    assert "Returns:" in doc and "Raises:" in doc
    options = (DOCS / "reference" / "options.md").read_text(encoding="utf-8")
    block = options[options.index("::: resilient_strategy.deciding.executor.resilient_strategy"):]
    assert "show_root_heading: true" in block.split(":::")[1]  # the signature is rendered


def _write_quotes() -> None:
    """Rewrite every quote from a run of its command (the numbers of this run)."""
    import tempfile

    for name, (page, *_) in sorted(QUOTES.items()):
        path = ROOT / page
        with tempfile.TemporaryDirectory() as tmp:
            printed = "\n".join(_printed(name, Path(tmp)))
        text = path.read_text(encoding="utf-8")
        m = next(m for m in QUOTE.finditer(text) if m.group("name") == name)
        path.write_text(text[:m.start("text")] + printed + text[m.end("text"):],
                        encoding="utf-8")
        print(f"{page}: {name}")


def _check_printed(name: str, printed: str) -> bool:
    """Whether ``printed`` (README's first command's output, as .ci/run saw it) is the quote."""
    lines = printed.rstrip("\n").splitlines()
    lines = lines[lines.index("== torch =="):] if "== torch ==" in lines else lines
    return _matches(_quotes(ROOT / QUOTES[name][0])[name].splitlines(), lines)


def _main(argv: list[str]) -> None:
    if argv == ["--write"]:
        _write_quotes()
    elif argv[:1] == ["--check"] and len(argv) == 3 \
            and not _check_printed(argv[1], Path(argv[2]).read_text(encoding="utf-8")):
        sys.exit(f"{QUOTES[argv[1]][0]}'s quote {argv[1]!r} is not what was printed")


if __name__ == "__main__":
    _main(sys.argv[1:])
