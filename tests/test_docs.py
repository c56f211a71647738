"""The docs against the code: README.md and docs/*.md.

1. Every config key (the dataclass tree of megajax/config.py) has a row in docs/configuration.md, every row
   is a real key, and a default written as a literal matches the code; every dotted key named in the prose of
   any document exists (and a `key=value` there has a value of the key's type).
2. The shipped-config list in docs/configuration.md is exactly configs/**/*.yaml, and every config named
   anywhere in the docs exists.
3. The synopsis of the `megajax` command in README.md lists exactly the CLI's verbs and options; every
   command line in a ```bash fence parses with the CLI's own parser, and a `megajax train` / `bench` line
   (also `make train|bench ARGS=...` and the SLURM script's arguments) loads its config and plans
   (megajax.plan.make_plan) on the devices it asks for.
4. Every relative link resolves (file and heading), and README's map links every file of docs/.

The rules the docs follow are in docs/testing.md.

Nothing here compiles or runs a train step.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
import shlex
import typing
from pathlib import Path

import pytest
import yaml

from megajax import cli
from megajax.config import MESH_AXES, Config, _build, load_config, parse_override
from megajax.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CONFIG_DOC = ROOT / "docs" / "configuration.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
SECTIONS = tuple(f.name for f in dataclasses.fields(Config))
COMMAND_FENCES = {"bash", "sh", "shell", "console"}
# Shell variables a documented command line may use, and the value the test gives them.
SHELL_VARIABLES = {"i": "0"}
# Placeholder paths (`path/to/...`) a command line may name: the test creates each, as a real file, in the
# scratch directory the lines are planned from.
PLACEHOLDER_FILES = {"path/to/tokenizer.json": "byte_tokenizer_json"}


# ----------------------------------------------------------------------------------------------
# Reading the docs

def config_keys() -> dict[str, dataclasses.Field]:
    """Every dotted key of the config tree (sub-sections such as mesh.dcn are walked; an optional section
    such as model.vision is a key itself, and its fields are walked too), with its field."""
    out: dict[str, dataclasses.Field] = {}

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            section = [a for a in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(a)]
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
                continue
            out[f"{prefix}{f.name}"] = f
            if section:
                walk(section[0], f"{prefix}{f.name}.")
    walk(Config, "")
    return out


KEYS = config_keys()


def fences(text: str) -> list[tuple[str, int, list[str]]]:
    """(info string, line number of the opening fence, lines) of every fenced block."""
    out, current = [], None
    for n, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if current is None and stripped.startswith("```"):
            current = (stripped[3:].strip(), n, [])
        elif current is not None and stripped.startswith("```"):
            out.append(current)
            current = None
        elif current is not None:
            current[2].append(line)
    assert current is None, f"unclosed code fence opened at line {current[1]}"
    return out


def prose(text: str) -> str:
    """The text outside fenced blocks."""
    keep, inside = [], False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            inside = not inside
            continue
        if not inside:
            keep.append(line)
    return "\n".join(keep)


def code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", prose(text))


def logical_lines(lines: list[str]) -> list[str]:
    """Shell lines with backslash continuations joined."""
    out, pending = [], ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending:
        out.append(pending)
    return out


SHELL_OPERATORS = {"&", "&&", ";", "|", "||", ">", ">>", "<", "2>", "2>&1"}


def _until_operator(tokens: list[str]) -> list[str]:
    out = []
    for t in tokens:
        if t in SHELL_OPERATORS:
            break
        if t.endswith(";"):
            out.append(t[:-1])
            break
        out.append(t)
    return out


def _substitute(line: str, where: str) -> str:
    def var(m):
        name = m.group(1) or m.group(2)
        assert name in SHELL_VARIABLES, (f"{where}: shell variable ${name} in a documented command; give it a "
                                         f"value in SHELL_VARIABLES (tests/test_docs.py) or write the value")
        return SHELL_VARIABLES[name]
    return re.sub(r"\$(?:\{(\w+)\}|(\w+))", var, line)


def commands(path: Path) -> list[tuple[str, str, list[str]]]:
    """(where, verb, arguments) of every command line in the ```bash fences of `path`: `megajax VERB ...`
    (also behind environment assignments, or `.venv/bin/megajax`), `make train|bench ARGS=...`, and
    `sbatch scripts/slurm/train.sbatch ...` (arguments of megajax train)."""
    out = []
    for info, start, lines in fences(path.read_text()):
        if info not in COMMAND_FENCES:
            continue
        for offset, raw in enumerate(logical_lines(lines), 1):
            where = f"{path.relative_to(ROOT)}:{start + offset}"
            tokens = shlex.split(_substitute(raw, where), comments=True)
            for i, t in enumerate(tokens):
                if t == "megajax" or t.endswith("/megajax"):
                    rest = _until_operator(tokens[i + 1:])
                    # A simulated device count in the line's environment (XLA_FLAGS=...device_count=N).
                    env = re.search(r"device_count=(\d+)", " ".join(tokens[:i]))
                    out.append((where, rest[0] if rest else "", rest[1:], int(env.group(1)) if env else None))
                    break
                if t == "make" and i + 1 < len(tokens):
                    rest = _until_operator(tokens[i + 1:])
                    args = [a.split("=", 1)[1] for a in rest[1:] if a.startswith("ARGS=")]
                    out.append((where, f"make {rest[0]}", shlex.split(args[0]) if args else [], None))
                    break
                if t == "sbatch":
                    rest = _until_operator(tokens[i + 1:])
                    script = [j for j, a in enumerate(rest) if a.endswith("train.sbatch")]
                    assert script, f"{where}: an sbatch line without scripts/slurm/train.sbatch"
                    assert (ROOT / rest[script[0]]).is_file(), f"{where}: {rest[script[0]]} does not exist"
                    out.append((where, "train", rest[script[0] + 1:], None))
                    break
    return out


ALL_COMMANDS = [c for path in DOCS for c in commands(path)]


# ----------------------------------------------------------------------------------------------
# 1. Config keys

def config_rows() -> dict[str, str]:
    """key -> default cell of the key tables in docs/configuration.md."""
    rows: dict[str, str] = {}
    for line in CONFIG_DOC.read_text().splitlines():
        m = re.match(r"^\| `([a-z_]+(?:\.[a-z_0-9]+)+)` \| ([^|]*) \|", line)
        if m and m.group(1).split(".")[0] in SECTIONS:
            assert m.group(1) not in rows, f"docs/configuration.md: two rows for {m.group(1)}"
            rows[m.group(1)] = m.group(2).strip()
    return rows


def test_every_config_key_has_a_row_in_configuration_md():
    rows = config_rows()
    missing = sorted(set(KEYS) - set(rows))
    assert not missing, f"config keys without a row in docs/configuration.md: {missing}"
    unknown = sorted(set(rows) - set(KEYS))
    assert not unknown, f"docs/configuration.md has rows for keys megajax/config.py does not have: {unknown}"
    assert "`model.norm_eps`" in CONFIG_DOC.read_text()


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def test_literal_defaults_in_configuration_md_match_the_code():
    literal = 0
    for key, cell in config_rows().items():
        m = re.fullmatch(r"`([^`]*)`", cell)
        if not m:  # a default in words: derived at start
            continue
        literal += 1
        value, default = yaml.safe_load(m.group(1)), _default(KEYS[key])
        assert value == default and isinstance(value, bool) == isinstance(default, bool), (
            f"docs/configuration.md: {key} default {cell} but megajax/config.py has {default!r}")
    assert literal > 80  # most defaults are literals


def _key_exists(key: str) -> bool:
    if "*" in key or "<axis>" in key:
        pattern = key.replace("<axis>", "*")
        return any(fnmatch.fnmatchcase(k, pattern) for k in KEYS)
    return key in KEYS or any(k.startswith(key + ".") for k in KEYS)  # a key, or a sub-tree (mesh.dcn)


KEY_TOKEN = re.compile(r"^(" + "|".join(SECTIONS) + r")\.([A-Za-z0-9_.<>*]+)(=.*)?$")


def _is_placeholder(value: str) -> bool:
    return bool(re.fullmatch(r"[A-Z][A-Z0-9_]*|.*[<>].*|.*\.\.\..*", value))


def documented_keys() -> list[tuple[str, str, str | None]]:
    """(document, key, value or None) of every dotted config key in an inline code span outside fences."""
    out = []
    for path in DOCS:
        for span in code_spans(path.read_text()):
            whole = KEY_TOKEN.match(span)
            tokens = [span] if whole and span.count("=") == 1 else span.split()
            for token in tokens:
                m = KEY_TOKEN.match(token)
                if m:
                    key = f"{m.group(1)}.{m.group(2)}".rstrip(".")
                    out.append((path.name, key, m.group(3)[1:] if m.group(3) else None))
    return out


def test_every_key_named_in_the_docs_exists_and_takes_its_value():
    found = documented_keys()
    assert len(found) > 250
    bad = [(doc, key) for doc, key, _ in found if not _key_exists(key)]
    assert not bad, f"config keys named in the docs that megajax/config.py does not have: {bad}"
    wrong = []
    for doc, key, value in found:
        if value is None or "*" in key or "<" in key or _is_placeholder(value):
            continue
        for alternative in value.split("|") if "[" not in value else [value]:  # `key=a|b|c`: each one
            try:
                _build(Config, parse_override(f"{key}={alternative}"), "")
            except UserError as e:
                wrong.append((doc, f"{key}={value}", str(e)))
    assert not wrong, f"key=value spans in the docs that the config rejects: {wrong}"


def test_key_checks_catch_mistakes():
    assert not _key_exists("model.num_hedas") and not _key_exists("mesh.dcn.nodes") and not _key_exists("mesh.dc")
    assert _key_exists("mesh.dcn.<axis>") and _key_exists("model.moe_*") and _key_exists("model.norm_eps")
    with pytest.raises(UserError):
        _build(Config, parse_override("train.precision=fp9"), "")


# ----------------------------------------------------------------------------------------------
# 2. Shipped configs

SHIPPED = sorted(str(p.relative_to(ROOT / "configs").with_suffix("")) for p in (ROOT / "configs").rglob("*.yaml"))
CONFIG_NAME = re.compile(r"(?<![\w/.-])(?:configs/)?((?:model|mesh|recipes)/[A-Za-z0-9._-]*[A-Za-z0-9])")


def shipped_list() -> list[str]:
    text = CONFIG_DOC.read_text()
    section = text.split("## Shipped configs", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"`((?:model|mesh|recipes)/[^`]+)`", section)


def test_shipped_config_list_matches_configs_dir():
    listed = shipped_list()
    assert len(listed) == len(set(listed)), f"listed twice: {sorted(n for n in listed if listed.count(n) > 1)}"
    missing, extra = sorted(set(SHIPPED) - set(listed)), sorted(set(listed) - set(SHIPPED))
    assert not missing and not extra, (f"docs/configuration.md's shipped configs differ from configs/: missing "
                                       f"{missing}, not there {extra}")


def test_every_config_named_in_the_docs_exists():
    named = {(p.name, n.removesuffix(".yaml")) for p in DOCS for n in CONFIG_NAME.findall(p.read_text())}
    assert len(named) > 20
    missing = sorted((doc, n) for doc, n in named if n not in SHIPPED)
    assert not missing, f"configs named in the docs that configs/ does not hold: {missing}"
    assert CONFIG_NAME.findall("`model/llama3.1-8b`, configs/mesh/4x8-gpu.yaml and model/tiny.") == [
        "model/llama3.1-8b", "mesh/4x8-gpu.yaml", "model/tiny"]


# ----------------------------------------------------------------------------------------------
# 3. Command lines

def synopsis() -> dict[str, list[str]]:
    """verb -> the synopsis lines of README's `megajax` command section (its ```text block)."""
    text = README.read_text()
    section = text.split("## The `megajax` command", 1)[1].split("\n## ", 1)[0]
    blocks = [lines for info, _, lines in fences(section) if info == "text"]
    assert len(blocks) == 1, "README's command section needs exactly one ```text synopsis block"
    out: dict[str, list[str]] = {}
    for line in blocks[0]:
        words = line.split()
        assert words[0] == "megajax", line
        out.setdefault(words[1], []).append(line)
    return out


def test_synopsis_lists_every_verb_and_option_of_the_cli():
    parsers = cli.build_parser().get_default("subparsers")
    lines = synopsis()
    assert sorted(lines) == sorted(parsers), f"README verbs {sorted(lines)} vs the CLI's {sorted(parsers)}"
    for verb, parser in parsers.items():
        text = " ".join(lines[verb])
        options = {o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}
        shown = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
        assert shown == options, (f"README synopsis of megajax {verb}: missing {sorted(options - shown)}, "
                                  f"not options {sorted(shown - options)}")
        for a in parser._actions:  # its choices, all of them over the lines that give it (one form per line)
            if a.choices and a.option_strings and a.option_strings[0] != "-h":
                shown = re.findall(re.escape(a.option_strings[0]) + r" ([\w.|-]+)", text)
                assert shown and {c for s in shown for c in s.split("|")} == set(a.choices), (
                    f"README synopsis of megajax {verb} {a.option_strings[0]}: choices {sorted(a.choices)}")
        has_overrides = any(a.dest == "overrides" for a in parser._actions)
        assert ("key.sub=value" in text) == has_overrides, f"megajax {verb}: key=value overrides"


def test_command_lines_are_in_bash_fences():
    """A `megajax VERB` line outside ```bash fences (and the README synopsis) would escape the checks below."""
    verbs = set(cli.build_parser().get_default("subparsers"))
    stray = []
    for path in DOCS:
        for info, start, lines in fences(path.read_text()):
            if info in COMMAND_FENCES or (path == README and info == "text"):
                continue
            for n, line in enumerate(lines, start + 1):
                words = line.split()
                if len(words) > 1 and words[0].endswith("megajax") and words[1] in verbs:
                    stray.append(f"{path.relative_to(ROOT)}:{n}")
    assert not stray, f"command lines outside ```bash fences: {stray}"


# Configs written for GPU clusters: a line naming one plans on the devices its mesh names. Any other line
# must run as written on a CPU, which has one device unless the line sets mesh.cpu_devices.
GPU_CONFIGS = ("mesh/gpu-", "mesh/4x8-gpu", "mesh/mi300x", "recipes/")


def device_count(cfg: Config, args, simulated: int | None = None) -> int:
    """The devices a documented line runs on: --topology N, mesh.cpu_devices, the simulated count of its
    XLA_FLAGS (per process), the mesh's fixed sizes for a line naming a GPU config, else one CPU device."""
    if getattr(args, "topology", None):
        from megajax.perf.bench import parse_topology
        return parse_topology(args.topology)[0]
    if cfg.mesh.cpu_devices:
        return cfg.mesh.cpu_devices
    if simulated:
        return simulated * (cfg.distributed.num_processes or 1)
    if not any(c.startswith(GPU_CONFIGS) for c in (args.config or [])):
        return 1
    sizes = [getattr(cfg.mesh, a) for a in MESH_AXES]
    return math.prod(s for s in sizes if s != -1) * math.prod(getattr(cfg.mesh.dcn, a) for a in MESH_AXES)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A scratch directory holding the placeholder files the documented lines name."""
    from megajax.data import tokenizer
    root = tmp_path_factory.mktemp("docs-workspace")
    for rel, maker in PLACEHOLDER_FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(getattr(tokenizer, maker)())
    return root


def check_command(where: str, verb: str, args: list[str], simulated: int | None = None) -> str:
    """Parses (and for train/bench plans) one documented line; returns what was checked."""
    from megajax.plan import make_plan
    if verb.startswith("make "):
        target = verb.split()[1]
        assert re.search(rf"^{re.escape(target)}:", (ROOT / "Makefile").read_text(), re.MULTILINE), (
            f"{where}: no make target {target!r} in the Makefile")
        if target not in ("train", "bench"):
            return "make target"
        verb = target
    for a in args:
        value = a.split("=", 1)[-1]
        assert a != "..." and not _is_placeholder(value) or a.startswith("--"), (
            f"{where}: placeholder {a!r} in a ```bash line; write a runnable value (see docs/testing.md)")
        if "path/to/" in a:
            assert any(p in a for p in PLACEHOLDER_FILES), f"{where}: {a!r} is not in PLACEHOLDER_FILES"
    try:
        ns = cli.parse_args([verb, *args])
    except SystemExit:
        raise AssertionError(f"{where}: megajax {verb} {' '.join(args)}: argparse refuses it") from None
    if verb not in ("train", "bench"):
        return "parsed"
    variants = [list(ns.overrides)]
    if getattr(ns, "sweep", None):
        from megajax.perf.bench import parse_sweep
        key, values = parse_sweep(ns.sweep)
        variants = [[*ns.overrides, f"{key}={v}"] for v in values]
    for overrides in variants:
        try:
            cfg = load_config(ns.config, overrides)
            make_plan(cfg, device_count(cfg, ns, simulated))
        except UserError as e:
            raise AssertionError(f"{where}: megajax {verb} {' '.join(overrides)}: {e}") from None
    return "planned"


def test_documented_command_lines_parse_and_plan(workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    checked = [(where, check_command(where, verb, args, simulated)) for where, verb, args, simulated in ALL_COMMANDS]
    kinds = [k for _, k in checked]
    assert kinds.count("planned") >= 20 and kinds.count("parsed") >= 10, checked
    # The quick start is a contract: exactly `make train` and `make test`.
    quick = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    first = next(lines for info, _, lines in fences(quick) if info in COMMAND_FENCES)
    assert [shlex.split(line, comments=True) for line in first] == [["make", "train"], ["make", "test"]]


def test_command_checks_catch_mistakes(workspace, monkeypatch, capsys):
    monkeypatch.chdir(workspace)
    bad = [
        ("train", ["mesh.tensor=3", "mesh.cpu_devices=8"]),  # 3 does not divide 8 devices
        ("train", ["model.num_hedas=4"]),
        ("train", ["--config", "model/nope"]),
        ("train", ["mesh.pipeline=4", "parallel.virtual_stages=2"]),  # 4 layers in 8 chunks
        ("train", ["data.tokenizer=path/to/other.json"]),  # a placeholder the test does not provide
        ("train", ["data.tokenizer=PATH"]),  # a placeholder in a runnable line
        ("bench", ["--sweep", "train.global_batch=8,3", "mesh.cpu_devices=2"]),  # 3 does not split over 2
        ("export", ["--format", "onnx", "--checkpoint", "a", "--output", "b"]),
        ("generate", ["--checkpoint", "a", "--temprature", "1"]),
        ("make nope", []),
    ]
    for verb, args in bad:
        with pytest.raises(AssertionError):
            check_command("test", verb, args)
    assert check_command("test", "train", ["--config", "model/tiny", "mesh.cpu_devices=2"]) == "planned"
    with pytest.raises(AssertionError):  # on a CPU without simulated devices: one device
        check_command("test", "train", ["mesh.pipeline=4", "mesh.data=2", "train.micro_batch=1"])
    assert check_command("test", "train", ["mesh.pipeline=4", "mesh.data=2", "train.micro_batch=1"],
                         simulated=8) == "planned"
    assert check_command("test", "make train", ["train.steps=5"]) == "planned"
    assert check_command("test", "serve", ["--checkpoint", "runs/x", "--port", "0"]) == "parsed"
    with pytest.raises(AssertionError):
        _substitute("megajax train train.run_dir=$RUN", "test")


# ----------------------------------------------------------------------------------------------
# Links between the documents

def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#+ (.+)$", prose(path.read_text()), re.MULTILINE)}


def test_links_between_documents_resolve():
    assert _slug("Performance: `megajax bench`") == "performance-megajax-bench"
    broken, count = [], 0
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", prose(path.read_text())):
            if re.match(r"[a-z]+:", target):  # http:, mailto:
                continue
            count += 1
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert count > 40
    assert not broken, broken
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in re.findall(r"\]\((docs/[^)\s]+)\)",
                                                                                    README.read_text())}
    unlisted = sorted(p.name for p in DOCS[1:] if p.resolve() not in linked)
    assert not unlisted, f"docs/ files README's map does not link: {unlisted}"
