"""Plugin CLI commands (``genartifact.commands`` entry points, loaded only when run), one ``error:`` line per
error with exit 2 (3 for unexpected ones), ``--traceback``; a broken plugin is reported by ``plugins --check``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path


def make_dist(root: Path, name: str, module: str, source: str, eps: dict[str, dict[str, str]]) -> Path:
    """A minimal installed distribution (module + ``*.dist-info`` with entry points) under ``root``."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    di = root / f"{name.replace('-', '_')}-1.0.dist-info"
    di.mkdir(parents=True)
    (di / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (di / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in items.items()) for group, items in eps.items()))
    return root


CMD = '''
import pluggy
from genartifact.errors import GenartifactError

hookimpl = pluggy.HookimplMarker("genartifact")
IMPORTED = True


def run(args):
    if args.mode == "bad-input":
        raise GenartifactError("--mode bad-input: the plugin refused it")
    if args.mode == "bug":
        raise ZeroDivisionError("plugin bug")
    if args.mode == "flood":  # far more than a pipe holds
        for i in range(200_000):
            print(f"hello {args.who} {i}")
    print(f"hello {args.who}")
    return 0


@hookimpl
def genartifact_command(name, parser):
    if name != "hello":
        return None
    parser.add_argument("who")
    parser.add_argument("--mode", default="ok")
    return run
'''


def cli(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "genartifact.cli", *argv], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)


def test_plugin_command_runs_and_errors_are_one_line(tmp_path):
    make_dist(tmp_path, "hello-cmd", "hello_cmd", CMD, {"genartifact.commands": {"hello": "hello_cmd"}})
    r = cli(tmp_path, "--help")
    assert r.returncode == 0 and "hello" in r.stdout and "plugin command (hello-cmd 1.0)" in r.stdout
    r = cli(tmp_path, "hello", "world")
    assert (r.returncode, r.stdout) == (0, "hello world\n")
    r = cli(tmp_path, "hello", "x", "--mode", "bad-input")
    assert r.returncode == 2 and r.stderr == "error: --mode bad-input: the plugin refused it\n"
    r = cli(tmp_path, "hello", "x", "--mode", "bug")
    assert r.returncode == 3 and r.stderr.startswith("error: unexpected ZeroDivisionError: plugin bug")
    assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
    r = cli(tmp_path, "--traceback", "hello", "x", "--mode", "bug")
    assert r.returncode == 3 and "Traceback (most recent call last)" in r.stderr


def test_help_imports_no_plugin_command():
    code = ("import sys\nfrom genartifact.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('genartifact_')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_broken_plugins_are_listed_and_checked(tmp_path):
    make_dist(tmp_path, "broken-content", "broken_content", "import does_not_exist\n",
              {"genartifact.contents": {"broken": "broken_content"}})
    make_dist(tmp_path, "nohook-target", "nohook_target", "def genartifact_storage_target(kind, settings):\n    pass\n",
              {"genartifact.targets": {"nohook": "nohook_target"}})
    r = cli(tmp_path, "plugins")
    assert r.returncode == 0 and "broken" in r.stdout and "nohook" in r.stdout
    r = cli(tmp_path, "plugins", "--check")
    assert r.returncode == 1
    assert "contents 'broken' (broken-content 1.0): error importing content 'broken'" in r.stdout
    assert "ModuleNotFoundError" in r.stdout
    assert "genartifact_storage_target is not decorated with @hookimpl" in r.stdout


def test_bench_errors_are_genartifact_errors():
    from genartifact.errors import GenartifactError
    from genartifact_fpm_bench.artifact import MergeError
    from genartifact_fpm_bench.grid import GridError

    assert issubclass(MergeError, GenartifactError) and issubclass(GridError, GenartifactError)


def test_duplicate_plugin_names_are_listed_and_refused(tmp_path):
    make_dist(tmp_path, "rogue-routes", "rogue_routes", "", {"genartifact.contents": {"moe_routes": "rogue_routes"}})
    r = cli(tmp_path, "plugins")
    assert r.returncode == 0
    problems = [x for x in r.stdout.splitlines() if x.startswith("problem:") and "moe_routes" in x]
    assert problems and all("rogue-routes" in x and "genartifact-route-capture" in x and "uninstall one" in x
                            for x in problems)
    assert cli(tmp_path, "plugins", "--check").returncode == 1
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    r = cli(tmp_path, "generate", "--model", str(tmp_path), "--prompts", "p.jsonl")
    assert r.returncode == 2 and r.stderr.startswith("error: content 'moe_routes' is provided by two distributions")


def test_output_into_a_closed_pipe_exits_quietly(tmp_path):
    """`genartifact inspect --json | head`: the reader leaves early; the CLI exits 141 (128 + SIGPIPE, as a
    shell reports a tool killed by the broken pipe) without an error line or traceback."""
    make_dist(tmp_path, "hello-cmd", "hello_cmd", CMD, {"genartifact.commands": {"hello": "hello_cmd"}})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-m", "genartifact.cli", "hello", "w", "--mode", "flood"], env=env,
                         cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.read(100).startswith(b"hello w 0")
    p.stdout.close()
    _, err = p.communicate(timeout=120)
    assert p.returncode == 141 and err == b"", err[-500:]
