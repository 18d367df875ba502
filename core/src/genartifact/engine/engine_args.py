"""vLLM's own engine arguments for genartifact's engine commands (``generate``, ``serve``, ``bench run``).

The arguments are not re-declared here: they come from vLLM's ``AsyncEngineArgs.add_cli_args`` on vLLM's
``FlexibleArgumentParser`` — the very definitions ``vllm serve`` uses — so ``--tensor-parallel-size``/``-tp``,
``--data-parallel-size``, ``--distributed-executor-backend``, ``--dtype``, ``--max-num-seqs``,
``--enable-chunked-prefill``/``--no-enable-chunked-prefill``, ``--max-model-len 1k``, ``--max_num_seqs``
(underscores), dotted JSON arguments (``--compilation-config.mode 0``) … parse, convert and fail exactly as in
``vllm serve``.

How it fits the CLI without making ``genartifact --help`` slow (vLLM's parser needs ``import vllm``, seconds):
an engine command's own parser marks itself with :func:`accept_engine_args`; the CLI parses with
``parse_known_args`` and hands the left-over arguments to :func:`engine_kwargs`, which builds vLLM's parser only
then. Only arguments the user actually gave are returned (every vLLM default is ``SUPPRESS``ed), so
genartifact's CPU defaults (:data:`~genartifact.engine.vllm_adapter.DEFAULT_ENGINE_OPTIONS`) apply unless the
user overrides them, and vLLM's defaults apply to everything else.

Config file: an ``[engine]`` table carries the same arguments, keys spelled as in vLLM (``max_num_seqs`` or
``max-num-seqs``), values converted exactly as vLLM converts a YAML ``--config`` file (bool -> ``--key`` /
``--no-key``, list -> repeated values, table -> JSON), then parsed by the same parser. Precedence: genartifact
defaults < ``[engine]`` < command line.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from typing import Any

from genartifact.errors import ConfigError, GenartifactError

#: namespace attribute set by :func:`accept_engine_args` on engine commands' parsers
ENGINE_FLAG = "_genartifact_engine_args"
#: arguments that genartifact itself owns on engine commands (never taken from ``[engine]``)
OWNED = {"model"}

EPILOG = ("Engine arguments: every vLLM engine argument of `vllm serve` is accepted with vLLM's own definitions, "
          "e.g. --tensor-parallel-size/-tp N, --data-parallel-size N, --distributed-executor-backend {mp,ray,...}, "
          "--dtype, --max-model-len, --max-num-seqs, --max-num-batched-tokens, --[no-]enable-chunked-prefill, "
          "--enable-prefix-caching, --seed, --served-model-name (list them with `vllm serve --help=all`). "
          "A config file's [engine] table may carry them too (command line wins). genartifact's CPU defaults: "
          "dtype float32, enforce_eager, max_model_len 2048, skip_tokenizer_init.")


class EngineArgsError(GenartifactError):
    """An engine argument vLLM's parser refuses (unknown name, bad value, bad choice); the message is vLLM's."""


def accept_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Mark ``parser`` (an engine command's parser) as taking vLLM engine arguments; adds an epilog naming
    them. Imports nothing from vLLM. Returns ``parser``."""
    parser.set_defaults(**{ENGINE_FLAG: True})
    parser.epilog = EPILOG
    return parser


def takes_engine_args(ns: argparse.Namespace) -> bool:
    """Whether the parsed command was marked by :func:`accept_engine_args`."""
    return bool(getattr(ns, ENGINE_FLAG, False))


_PARSER: Any = None


def vllm_parser() -> Any:
    """vLLM's engine-argument parser (``FlexibleArgumentParser`` + ``AsyncEngineArgs.add_cli_args``) with every
    default suppressed, so a parse returns only what was given. Errors raise :class:`EngineArgsError` instead of
    exiting. Built once per process (imports vLLM: seconds)."""
    global _PARSER
    if _PARSER is None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        class _Parser(FlexibleArgumentParser):  # type: ignore[misc]
            def error(self, message: str) -> Any:
                raise EngineArgsError(f"engine argument: {message}")

        p = _Parser(prog="genartifact (vLLM engine arguments)", add_help=False)
        AsyncEngineArgs.add_cli_args(p)
        for action in p._actions:
            action.default = argparse.SUPPRESS
        _PARSER = p
    return _PARSER


def _parse(argv: Sequence[str], where: str) -> dict[str, Any]:
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        ns = vllm_parser().parse_args(list(argv))
    except EngineArgsError as e:
        raise EngineArgsError(f"{where}: {str(e).removeprefix('engine argument: ')}") from None
    except (ValueError, TypeError) as e:  # a type converter or the JSON machinery refusing a value
        raise EngineArgsError(f"{where}: {e}") from None
    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    return {k: v for k, v in vars(ns).items() if k in fields}


def table_to_argv(table: Mapping[str, Any], source: str = "[engine]") -> list[str]:
    """An ``[engine]`` table as vLLM command-line tokens, converted as vLLM's ``load_config_file`` converts a
    YAML config (``FlexibleArgumentParser.load_config_file``): ``true`` -> ``--key``, ``false`` -> ``--no-key``
    (a flag without a negative form is refused rather than silently dropped), list -> ``--key v1 v2``,
    table -> ``--key JSON``, else ``--key str(value)``. Raises :class:`ConfigError` for a key genartifact owns."""
    argv: list[str] = []
    options = vllm_parser()._option_string_actions
    for key, value in table.items():
        if key.replace("-", "_") in OWNED:
            raise ConfigError(f"{source}: {key!r} is not an [engine] key; give the model with --model")
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
            elif (no := f"--no-{key.replace('_', '-')}") in options:
                argv.append(no)
            else:
                raise ConfigError(f"{source}: {key} = false has no command-line form ({flag} has no --no- variant); "
                                  "leave it out")
        elif isinstance(value, list):
            if value:
                argv += [flag, *(json.dumps(v) if isinstance(v, dict | list) else str(v) for v in value)]
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


def engine_kwargs(table: Mapping[str, Any] | None, argv: Sequence[str], source: str = "[engine]") -> dict[str, Any]:
    """``AsyncEngineArgs`` keyword arguments the user gave: the config's ``[engine]`` table, then the command
    line's engine arguments (``argv``: what the genartifact parser left over) on top. Keys are ``EngineArgs``
    field names, values converted by vLLM's parser (e.g. ``--max-model-len 1k`` -> ``1024``,
    ``--served-model-name a b`` -> ``["a", "b"]``).

    Raises :class:`EngineArgsError` (unknown argument or invalid value, with vLLM's own message, prefixed by
    where it came from) or :class:`ConfigError` (a key genartifact owns in the table)."""
    out: dict[str, Any] = {}
    if table:
        out.update(_parse(table_to_argv(table, source), source))
    if argv:
        out.update(_parse(argv, "command line"))
    return out


def command_engine_kwargs(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    """:func:`engine_kwargs` for a parsed engine command: ``cfg.engine`` (the config's ``[engine]`` table) and
    ``args.engine_argv`` (set by the CLI). Raises as :func:`engine_kwargs`."""
    return engine_kwargs(getattr(cfg, "engine", None), getattr(args, "engine_argv", None) or [],
                         source=f"{getattr(cfg, 'source', 'config')} [engine]")
