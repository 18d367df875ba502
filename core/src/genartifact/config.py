"""TOML configuration: which plugins are enabled (ordered lists) and each target kind's server-side settings.

Resolution: ``--config PATH`` (before or after the subcommand) > ``GENARTIFACT_CONFIG`` > the embedded default
(:data:`DEFAULT_TOML`). The embedded default names the plugins the default install (``make demo``:
requirements-dev.txt) provides; it enables those of them that are installed, so a smaller install (core plus
some plugins) runs on the default without errors (``genartifact plugins`` notes the ones left out). A config
file is taken literally: a plugin it enables that is not installed is an error.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from genartifact.errors import ConfigError
from genartifact.host import KINDS

DEFAULT_TOML = """\
# genartifact embedded default configuration
[plugins]
contents = ["moe_routes", "selected_logprobs"]
targets = ["managed_fsspec"]
probes = []

[targets.managed_fsspec.profiles.local]
url = "./artifacts"
allowed_prefixes = ["runs/"]

[journal]
path = "./artifacts/journal.jsonl"   # delivery intents/outcomes for `genartifact reconcile`
"""


@dataclass(frozen=True)
class Config:
    """Parsed configuration. ``plugins``: kind -> ordered names; ``targets``: kind -> settings table;
    ``contents``: content name -> settings table (``[contents.<name>]``); ``base_dir``: directory relative
    paths in settings resolve against (the config file's directory, or the working directory for the
    embedded default)."""

    plugins: dict[str, list[str]]
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)
    base_dir: Path = field(default_factory=Path.cwd)
    source: str = "<embedded default>"
    journal_path: Path | None = None
    contents: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: the ``[engine]`` table: vLLM engine arguments (see :mod:`genartifact.engine.engine_args`), unparsed here
    engine: dict[str, Any] = field(default_factory=dict)
    #: embedded default only: kind -> default plugin names left out because no installed distribution has them
    not_installed: dict[str, list[str]] = field(default_factory=dict)

    def target_settings(self) -> dict[str, dict[str, Any]]:
        """Per enabled or configured target kind its settings table, with ``base_dir`` (str) added for
        resolving relative paths: every target gets it (``base_dir`` is a reserved settings key)."""
        kinds = {*self.targets, *(n.replace("-", "_") for n in self.plugins.get("targets", []))}
        return {k: {**self.targets.get(k, {}), "base_dir": str(self.base_dir)} for k in kinds}

    def content_settings(self) -> dict[str, dict[str, Any]]:
        """Per enabled or configured content its ``[contents.<name>]`` table plus ``base_dir`` (str)."""
        names = {*self.contents, *(n.replace("-", "_") for n in self.plugins.get("contents", []))}
        return {k: {**self.contents.get(k, {}), "base_dir": str(self.base_dir)} for k in names}

    def host(self, **kwargs: Any) -> Any:
        """A :class:`~genartifact.host.PluginHost` with this config's enabled plugins and content settings."""
        from genartifact.host import PluginHost

        return PluginHost(self.plugins, content_settings=self.content_settings(), **kwargs)

    def journal(self) -> Any:
        """The configured :class:`~genartifact.journal.DeliveryJournal`, or None."""
        from genartifact.journal import DeliveryJournal

        return DeliveryJournal(self.journal_path) if self.journal_path else None


def parse(text: str, *, source: str, base_dir: Path) -> Config:
    """Parse TOML text. Raises :class:`ConfigError` naming the bad key and allowed values."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: invalid TOML: {e}") from None
    extra = set(data) - {"plugins", "targets", "contents", "journal", "engine"}
    if extra:
        raise ConfigError(f"{source}: unknown top-level key(s) {sorted(extra)}; "
                          "allowed: ['contents', 'engine', 'journal', 'plugins', 'targets']")
    engine = data.get("engine", {})
    if not isinstance(engine, Mapping):
        raise ConfigError(f"{source}: [engine] must be a table of vLLM engine arguments")
    journal = data.get("journal", {})
    if not isinstance(journal, Mapping) or set(journal) - {"path"} or not isinstance(journal.get("path", ""), str):
        raise ConfigError(f"{source}: [journal] takes one key, path (string)")
    journal_path = (base_dir / journal["path"]).resolve() if journal.get("path") else None
    plugins_raw = data.get("plugins", {})
    if not isinstance(plugins_raw, Mapping):
        raise ConfigError(f"{source}: [plugins] must be a table")
    bad = set(plugins_raw) - set(KINDS)
    if bad:
        raise ConfigError(f"{source}: unknown key(s) {sorted(bad)} in [plugins]; allowed: {sorted(KINDS)}")
    plugins: dict[str, list[str]] = {}
    for kind in KINDS:
        names = plugins_raw.get(kind, [])
        if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(f"{source}: [plugins].{kind} must be a list of non-empty strings")
        norm = [n.strip().replace("-", "_") for n in names]
        if len(set(norm)) != len(norm):
            raise ConfigError(f"{source}: [plugins].{kind} lists a name twice: {names}")
        plugins[kind] = list(names)
    targets = data.get("targets", {})
    if not isinstance(targets, Mapping) or not all(isinstance(v, Mapping) for v in targets.values()):
        raise ConfigError(f"{source}: [targets.<kind>] entries must be tables")
    for k, v in targets.items():
        if "base_dir" in v:
            raise ConfigError(f"{source}: [targets.{k}].base_dir is reserved (set to the config file's directory)")
    contents = data.get("contents", {})
    if not isinstance(contents, Mapping) or not all(isinstance(v, Mapping) for v in contents.values()):
        raise ConfigError(f"{source}: [contents.<name>] entries must be tables")
    for k, v in contents.items():
        if "base_dir" in v:
            raise ConfigError(f"{source}: [contents.{k}].base_dir is reserved (set to the config file's directory)")
    return Config(plugins=plugins, targets={k.replace("-", "_"): dict(v) for k, v in targets.items()},
                  base_dir=base_dir, source=source, journal_path=journal_path,
                  contents={k.replace("-", "_"): dict(v) for k, v in contents.items()},
                  engine=dict(engine))


def load(path: str | os.PathLike[str] | None = None) -> Config:
    """Load the config from ``path``, else ``GENARTIFACT_CONFIG``, else the embedded default."""
    chosen = path or os.environ.get("GENARTIFACT_CONFIG")
    if not chosen:
        return installed_default(parse(DEFAULT_TOML, source="<embedded default>", base_dir=Path.cwd()))
    p = Path(chosen)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8") from None
    return parse(text, source=str(p), base_dir=p.resolve().parent)


def installed_default(cfg: Config, source: Any = None) -> Config:
    """``cfg`` (the parsed embedded default) with every plugin name no installed distribution provides left
    out of ``plugins`` and listed in ``not_installed`` (discovery only: nothing is imported). ``source``: the
    entry-point lookup (default ``importlib.metadata``). A broken install (two distributions claiming one name)
    keeps the name, so the error surfaces where the plugin is loaded."""
    from dataclasses import replace

    from genartifact.errors import DuplicatePluginError
    from genartifact.host import _default_source, discover, normalize

    plugins: dict[str, list[str]] = {}
    missing: dict[str, list[str]] = {}
    for kind, names in cfg.plugins.items():
        try:
            have = set(discover(kind, source or _default_source))
        except DuplicatePluginError:
            plugins[kind] = list(names)
            continue
        plugins[kind] = [n for n in names if normalize(n) in have]
        gone = [n for n in names if normalize(n) not in have]
        if gone:
            missing[kind] = gone
    return replace(cfg, plugins=plugins, not_installed=missing)
