"""Engine commands take vLLM's own engine arguments (vLLM's definitions, parsed as `vllm serve` parses them),
from the command line and from a config's [engine] table; `genartifact --help` and `import genartifact` stay
free of vLLM. No engine is started here."""

from __future__ import annotations

import subprocess
import sys

import pytest
from genartifact import config as config_mod
from genartifact.cli import build_parser, main
from genartifact.engine.engine_args import EngineArgsError, command_engine_kwargs, engine_kwargs, takes_engine_args
from genartifact.errors import ConfigError

ENGINE_ARGV = ["-tp", "2", "--data-parallel-size", "2", "--distributed-executor-backend", "mp", "--dtype", "bfloat16",
               "--max-num-seqs", "8", "--enable-chunked-prefill", "--max_model_len", "1k", "--no-enable-prefix-caching",
               "--served-model-name", "a", "b", "--compilation-config.mode", "0", "--seed", "7"]


def vllm_serve_engine_args(model: str, argv: list[str]):
    """What `vllm serve MODEL ARGV` makes of the same arguments (vLLM's own serve parser)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    top = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(top.add_subparsers(dest="subparser"))
    ns = top.parse_args(["serve", model, *argv])
    ns.model = ns.model_tag
    return AsyncEngineArgs.from_cli_args(ns)


def test_import_and_top_level_help_do_not_import_vllm():
    code = ("import sys, contextlib, io\nimport genartifact\nfrom genartifact.cli import main\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n    main(['--help'])\n"
            "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    main(['generate', '--help'])\n"
            "assert '--tensor-parallel-size' in out.getvalue(), out.getvalue()\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize("cmd", [["generate", "--model", "m", "--prompts", "p.jsonl"], ["serve", "--model", "m"],
                                 ["bench", "run", "--model", "m", "--out", "o"]])
def test_engine_commands_take_exactly_what_vllm_serve_makes_of_the_arguments(cmd, qwen_model):
    k = 2 if cmd[0] == "bench" else 1  # engine arguments anywhere after the (sub)command, mixed with ours
    argv = [*cmd[:k], *ENGINE_ARGV[:4], *cmd[k:], *ENGINE_ARGV[4:]]
    args, extra = build_parser(argv).parse_known_args(argv)  # argv selects the plugin command to load
    assert takes_engine_args(args)
    ours = engine_kwargs(None, extra)
    assert set(ours) == {"tensor_parallel_size", "data_parallel_size", "distributed_executor_backend", "dtype",
                         "max_num_seqs", "enable_chunked_prefill", "max_model_len", "enable_prefix_caching",
                         "served_model_name", "compilation_config", "seed"}
    theirs = vllm_serve_engine_args(str(qwen_model), ENGINE_ARGV)
    for k, v in ours.items():
        assert getattr(theirs, k) == v, k
    assert ours["max_model_len"] == 1000 and ours["tensor_parallel_size"] == 2 and ours["served_model_name"] == ["a", "b"]


def test_non_engine_commands_still_refuse_unknown_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plugins", "--tensor-parallel-size", "2"])
    assert e.value.code == 2 and "unrecognized arguments: --tensor-parallel-size 2" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [(["--dtype", "float7"], "--dtype"), (["--bogus-flag"], "--bogus-flag"),
                                         (["--max-num-seqs", "many"], "--max-num-seqs")])
def test_bad_engine_arguments_fail_with_vllms_message_before_any_engine(tmp_path, capsys, argv, needle):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    rc = main(["generate", "--model", str(tmp_path), "--prompts", str(prompts), "--out", str(tmp_path / "r.jsonl"),
               *argv])
    err = capsys.readouterr().err
    assert rc == 2 and "command line" in err and needle in err, err
    assert not (tmp_path / "r.jsonl").exists()


def test_engine_table_in_config_and_command_line_precedence(tmp_path, qwen_model):
    cfg_path = tmp_path / "g.toml"
    cfg_path.write_text('[engine]\nmax_num_seqs = 4\nenable-chunked-prefill = false\nmax_model_len = "2k"\n'
                        'dtype = "float32"\nserved_model_name = ["x"]\ncompilation_config = {mode = 0}\n')
    cfg = config_mod.load(cfg_path)
    args, extra = build_parser().parse_known_args(["serve", "--model", "m", "--max-num-seqs", "6"])
    args.engine_argv = extra
    kw = command_engine_kwargs(cfg, args)
    assert kw == {"max_num_seqs": 6, "enable_chunked_prefill": False, "max_model_len": 2000, "dtype": "float32",
                  "served_model_name": ["x"], "compilation_config": vllm_serve_engine_args(
                      str(qwen_model), ["--compilation-config.mode", "0"]).compilation_config}


@pytest.mark.parametrize("table,err,needle", [
    ("model = 'x'", ConfigError, "--model"),
    ("max_num_seqs = 'lots'", EngineArgsError, "--max-num-seqs"),
    ("no_such_arg = 1", EngineArgsError, "--no-such-arg"),
    ("enable_log_requests = []", None, None),
])
def test_engine_table_errors_name_the_key(tmp_path, table, err, needle):
    cfg_path = tmp_path / "g.toml"
    cfg_path.write_text(f"[engine]\n{table}\n")
    cfg = config_mod.load(cfg_path)
    if err is None:
        assert engine_kwargs(cfg.engine, []) == {}  # an empty list is left out, as vLLM's YAML config does
        return
    with pytest.raises(err) as e:
        engine_kwargs(cfg.engine, [], source=f"{cfg_path} [engine]")
    assert needle in str(e.value) and "[engine]" in str(e.value)


def test_engine_table_must_be_a_table(tmp_path):
    cfg_path = tmp_path / "g.toml"
    cfg_path.write_text("engine = 3\n")
    with pytest.raises(ConfigError, match=r"\[engine\] must be a table"):
        config_mod.load(cfg_path)
