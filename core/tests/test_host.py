"""Plugin host: discovery without import, selection by config, error messages, check_pending."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pluggy
import pytest
from genartifact.errors import DuplicatePluginError, PluginLoadError, UnknownPluginError
from genartifact.host import PluginHost, discover

hookimpl = pluggy.HookimplMarker("genartifact")


@dataclass
class FakeDist:
    name: str
    version: str


@dataclass
class FakeEP:
    name: str
    value: str
    dist: FakeDist
    loads: list

    def load(self):
        self.loads.append(self.name)
        mod = sys.modules.get(self.value)
        if mod is None:
            raise ModuleNotFoundError(f"No module named '{self.value}'")
        return mod


def make_module(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules[name] = mod
    return mod


@pytest.fixture
def source():
    loads: list[str] = []
    eps = {
        "genartifact.contents": [
            FakeEP("alpha", "fake_alpha", FakeDist("dist-a", "1.0"), loads),
            FakeEP("alpha", "fake_alpha", FakeDist("dist-a", "1.0"), loads),  # same dist twice
            FakeEP("beta", "fake_beta", FakeDist("dist-b", "2.0"), loads),
            FakeEP("broken", "fake_missing_module", FakeDist("dist-c", "0.3"), loads),
            FakeEP("typo-hook", "fake_typo", FakeDist("dist-d", "0.1"), loads),
        ],
        "genartifact.targets": [],
        "genartifact.probes": [],
    }

    class Producer:
        def __init__(self, name):
            self.name = name

        def admit(self, ctx): return 0
        def sampling_overrides(self, params): pass
        def on_delta(self, delta): pass
        async def collect(self, final): pass
        def finalize(self, final): return {}, []
        def retained_bytes(self): return 0
        def release(self): pass

    @hookimpl
    def genartifact_content_producer(name, model):
        return Producer(name) if name == "alpha" else None

    @hookimpl
    def genartifact_engine_options(options):
        options.setdefault("order", []).append("beta")

    @hookimpl
    def genartifact_captrue(name):  # misspelled hook
        return None

    make_module("fake_alpha", genartifact_content_producer=genartifact_content_producer)
    make_module("fake_beta", genartifact_engine_options=genartifact_engine_options)
    make_module("fake_typo", genartifact_captrue=genartifact_captrue)

    def src(group):
        return eps[group]

    src.loads = loads
    src.eps = eps
    return src


def test_discovery_imports_nothing_and_dedupes_same_dist(source):
    found = discover("contents", source)
    assert sorted(found) == ["alpha", "beta", "broken", "typo_hook"]
    assert source.loads == []


def test_only_selected_plugins_are_loaded_in_config_order(source):
    host = PluginHost({"contents": ["beta", "alpha"]}, source=source)
    assert [p.name for p in host.enabled["contents"]] == ["beta", "alpha"]
    assert source.loads == ["beta", "alpha"]
    p = host.hooks.content_producer(name="alpha", model=None)
    assert p.name == "alpha" and p.inner.name == "alpha" and p.info.dist == "dist-a"


def test_unknown_name_lists_installed_with_versions_and_suggests(source):
    with pytest.raises(UnknownPluginError) as e:
        PluginHost({"contents": ["alpah"]}, source=source)
    msg = str(e.value)
    assert "unknown content 'alpah'" in msg and "[plugins].contents" in msg
    assert "alpha (dist-a 1.0)" in msg and "beta (dist-b 2.0)" in msg
    assert "did you mean 'alpha'?" in msg
    assert source.loads == []


def test_two_distributions_claiming_one_name_is_an_error(source):
    source.eps["genartifact.contents"].append(FakeEP("beta", "other", FakeDist("dist-z", "9"), source.loads))
    with pytest.raises(DuplicatePluginError, match="dist-b 2.0.*dist-z 9"):
        PluginHost({"contents": ["alpha"]}, source=source)


def test_import_failure_names_plugin_distribution_version_and_cause(source):
    with pytest.raises(PluginLoadError, match=r"'broken' from dist-c 0.3 \(fake_missing_module\): ModuleNotFoundError"):
        PluginHost({"contents": ["broken"]}, source=source)


def test_unknown_hook_implementation_rejected_at_startup(source):
    with pytest.raises(PluginLoadError, match=r"typo_hook.*dist-d 0.1.*genartifact_captrue is not a genartifact "
                                              r"hook; did you mean"):
        PluginHost({"contents": ["typo-hook"]}, source=source)


def test_unknown_kind_rejected(source):
    with pytest.raises(UnknownPluginError, match="unknown plugin kind"):
        PluginHost({"widgets": ["x"]}, source=source)


def test_require_distinguishes_installed_but_disabled(source):
    host = PluginHost({"contents": ["alpha"]}, source=source)
    with pytest.raises(UnknownPluginError, match="installed .*but not enabled"):
        host.require("contents", "beta", "generation_artifact.contents")
    with pytest.raises(UnknownPluginError, match="unknown content 'gamma'"):
        host.require("contents", "gamma", "generation_artifact.contents")


def test_no_module_global_plugin_manager():
    import genartifact.host as h

    assert not any(isinstance(v, pluggy.PluginManager) for v in vars(h).values())


def test_import_genartifact_is_light():
    import subprocess

    code = "import sys, genartifact, genartifact.format, genartifact.session, genartifact.cli; print('vllm' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False False"
