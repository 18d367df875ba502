"""CLI commands (plugins, inspect, verify) and engine-option assembly, without an engine."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest
from genartifact import format as fmt
from genartifact.cli import main
from genartifact.engine.vllm_adapter import engine_options
from genartifact.engine.worker_ext import QUALNAME
from genartifact.host import PluginHost
from genartifact.session import ArtifactSession
from genartifact.spec import parse_request
from genartifact.types import Delta, ModelInfo


def write_artifact(tmp_path):
    inp = fmt.ArtifactInput(np.arange(6, dtype=np.uint32), 4, ["selected_logprobs"],
                            {"selected_logprobs": {"token_start": 4}},
                            [fmt.TensorPart("selected_logprobs.logprobs", np.array([-1.0, -np.inf], np.float32))])
    enc = fmt.encode(inp)
    p = tmp_path / "a.gart"
    p.write_bytes(enc.data)
    return p, enc


def test_plugins_json(capsys):
    assert main(["plugins", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["plugins"]
    assert out["problems"] == []
    assert {(r["kind"], r["name"], r["enabled"]) for r in rows} >= {
        ("contents", "moe_routes", True), ("contents", "selected_logprobs", True), ("targets", "managed_fsspec", True)}


def test_plugins_unknown_name_in_config_is_listed_as_a_problem(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[plugins]\ncontents = ["selected_logprob"]\n')
    assert main(["plugins", "--config", str(cfg)]) == 0  # the listing still works
    out = capsys.readouterr().out
    assert "contents  moe_routes" in out  # installed plugins are listed
    assert "problem: config [plugins].contents enables 'selected_logprob', which no installed" in out
    assert main(["plugins", "--check", "--config", str(cfg)]) == 1
    capsys.readouterr()
    cfg.write_text('[plugins\n')
    assert main(["plugins", "--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "contents  moe_routes" in out and "problem: config: " in out and "invalid TOML" in out
    assert main(["plugins", "--check", "--config", str(cfg)]) == 1


def test_inspect_and_verify(tmp_path, capsys):
    p, enc = write_artifact(tmp_path)
    assert main(["inspect", str(p), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["sha256"] == enc.sha256 and s["selected_logprobs"] == {"count": 2, "mean": -1.0, "neg_inf": 1}
    assert main(["verify", str(p), "--sha256", enc.sha256]) == 0
    assert main(["verify", str(p), "--sha256", "0" * 64]) == 1
    p.write_bytes(enc.data[:-3])
    assert main(["verify", str(p), "--sha256", enc.sha256]) == 1
    assert main(["inspect", str(p)]) == 2
    assert "truncated" in capsys.readouterr().err


def test_verify_receipts(tmp_path, capsys, monkeypatch):
    p, enc = write_artifact(tmp_path)
    (tmp_path / "store" / "runs").mkdir(parents=True)
    (tmp_path / "store" / "runs" / "a.gart").write_bytes(p.read_bytes())
    cfg = tmp_path / "c.toml"
    cfg.write_text('[plugins]\ntargets = ["managed_fsspec"]\n[targets.managed_fsspec.profiles.local]\n'
                   'url = "./store"\nallowed_prefixes = ["runs/"]\n')
    r = tmp_path / "receipts.jsonl"
    r.write_text(json.dumps({"index": 0, "state": "ready", "target": "managed_fsspec", "object_id": "local:runs/a.gart",
                             "sha256": enc.sha256, "byte_count": enc.byte_count}) + "\n"
                 + json.dumps({"index": 1, "state": "failed", "error_code": "delivery_failed"}) + "\n"
                 + json.dumps({"index": 2, "state": "ready", "object_id": "local:runs/a.gart", "sha256": enc.sha256,
                               "byte_count": enc.byte_count}) + "\n")
    assert main(["verify", "--receipts", str(r), "--config", str(cfg)]) == 1
    out = capsys.readouterr().out
    assert "1/3 receipts verified" in out and "#2: receipt has no 'target' kind" in out
    assert main(["inspect", "managed_fsspec:local:runs/a.gart", "--config", str(cfg), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sha256"] == enc.sha256
    # from another folder, without the run's config: the objects are not found, and the summary says why
    monkeypatch.chdir(tmp_path / "store")
    assert main(["verify", "--receipts", str(r)]) == 1
    out = capsys.readouterr().out
    assert "0/3 receipts verified" in out
    assert f"1 object(s) not found: object ids resolve against the config's folder ({tmp_path / 'store'}" in out


def test_read_back_of_a_target_kind_the_config_does_not_set_up_says_to_pass_its_config(monkeypatch, capsys):
    """``inspect KIND:OBJECT_ID`` of a kind whose factory needs settings, without the config that has them: the
    target's own error, plus which config was used and that ``--config`` is the fix."""
    import genartifact.host as host_mod
    from genartifact.errors import ConfigError
    from genartifact.testing import hookimpl, make_host

    class NeedsRoot:
        @hookimpl
        def genartifact_storage_target(self, kind, settings):
            if kind != "needs_root":
                return None
            if "root" not in settings:
                raise ConfigError("[targets.needs_root] root: required")

    host = make_host(targets={"needs_root": NeedsRoot()}, memory_target=False)
    monkeypatch.setattr(host_mod, "PluginHost", lambda cfg, **kw: host)
    from genartifact.cli import _target_for_kind

    with pytest.raises(ConfigError, match=r"root: required \(<embedded default> has no \[targets.needs_root\] "
                                          r"table: pass --config"):
        _target_for_kind("needs_root", None)


def test_missing_object(capsys):
    assert main(["inspect", "/nonexistent/x.gart"]) == 2
    assert "not found" in capsys.readouterr().err
    # a receipt's object id pasted without its kind: the error says to put the kind in front
    assert main(["verify", "local:runs/x.gart"]) == 2
    err = capsys.readouterr().err
    assert "needs its target kind" in err and "managed_fsspec:local:runs/x.gart" in err


@pytest.mark.parametrize("plugin_installed", [True, False])
def test_engine_options_defaults_and_plugin_hook(plugin_installed, capsys):
    from genartifact.logging import configure_logging

    configure_logging()
    host = PluginHost({"contents": ["moe_routes"]})
    opts = engine_options(host, "/m", {"max_num_batched_tokens": 64, "enable_prefix_caching": True},
                          plugin_installed=plugin_installed)
    # with the vllm.general_plugins entry point the extension slot stays free; without it, the fallback class
    assert opts.get("worker_extension_cls") == (None if plugin_installed else QUALNAME)
    assert opts["enable_prefix_caching"] is False  # route_capture's engine_options hook turns it off ...
    err = capsys.readouterr().err
    assert "prefix_caching_disabled" in err and "enable_prefix_caching" in err  # ... and says so
    assert opts["max_num_batched_tokens"] == 64 and opts["skip_tokenizer_init"] is True


def test_native_route_engine_keeps_prefix_caching():
    host = PluginHost({"contents": ["moe_routes"]})
    opts = engine_options(host, "/m", {"enable_return_routed_experts": True, "enable_prefix_caching": True})
    assert opts["enable_prefix_caching"] is True


def test_user_worker_extension_without_entry_point_turns_capture_off_and_keeps_prefix_caching(capsys):
    from genartifact.logging import configure_logging

    configure_logging()
    host = PluginHost({"contents": ["moe_routes"]})
    opts = engine_options(host, "/m", {"worker_extension_cls": "my.pkg.Ext", "enable_prefix_caching": True},
                          plugin_installed=False)
    assert opts["worker_extension_cls"] == "my.pkg.Ext"
    assert opts["enable_prefix_caching"] is True  # worker capture cannot run, so nothing is forced off
    assert "worker_extension_in_use" in capsys.readouterr().err and "my.pkg.Ext" in str(opts)


def test_user_worker_extension_with_entry_point_coexists(capsys):
    host = PluginHost({"contents": ["moe_routes"]})
    opts = engine_options(host, "/m", {"worker_extension_cls": "my.pkg.Ext"}, plugin_installed=True)
    assert opts["worker_extension_cls"] == "my.pkg.Ext" and opts["enable_prefix_caching"] is False
    assert "worker_extension_in_use" not in capsys.readouterr().err


def test_vllm_plugins_allow_list_excludes_the_entry_point(monkeypatch):
    from genartifact.engine.vllm_adapter import vllm_plugin_installed

    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    assert vllm_plugin_installed() is False


async def test_native_resend_keeps_only_latest_tensor(tmp_path):
    host = PluginHost({"contents": ["moe_routes"], "targets": ["managed_fsspec"]})
    cfg = {"model_type": "mixtral", "num_hidden_layers": 2, "num_local_experts": 8, "num_experts_per_tok": 2}
    model = ModelInfo("m", cfg, engine_options={"native_routed_experts": True})
    spec = {"format": "generation_artifact_v1", "contents": ["moe_routes"],
            "delivery": {"mode": "object_store", "target": {"kind": "managed_fsspec", "profile": "p", "object_key": "k"}}}
    settings = {"managed_fsspec": {"profiles": {"p": {"url": f"file://{tmp_path}", "allowed_prefixes": [""]}}}}
    s = ArtifactSession.for_request(host, parse_request(spec), model, settings)
    s.admit(2, 2)
    s.record(Delta([1, 2], [3], None, routed_experts=np.full((2, 2, 2), 1, np.int32)))
    s.record(Delta([1, 2], [4], None, routed_experts=np.full((3, 2, 2), 5, np.int64), finished=True))
    assert s.retained_bytes() == 4 * 4 + 3 * 2 * 2
    r = await s.finalize()
    art = fmt.decode((tmp_path / "k").read_bytes())
    assert r["state"] == "ready" and (art.routes() == 5).all() and art.routes().shape == (3, 2, 2)


def test_console_script_runs_without_engine():
    out = subprocess.run([sys.executable, "-m", "genartifact.cli", "plugins"], capture_output=True, text=True, check=True)
    assert "managed_fsspec" in out.stdout


@pytest.mark.parametrize("bad", ['{"prompt": 3}', "not json", '{"prompt": "x", "colour": 1}', ""])
def test_prompts_file_errors_name_the_line(tmp_path, bad):
    from genartifact.engine.job import read_prompts
    from genartifact.errors import RequestSpecError

    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n' + bad + "\n" if bad else "\n")
    with pytest.raises(RequestSpecError, match=r"p.jsonl(:2)?|no prompts"):
        read_prompts(f)


async def test_worker_calls_in_one_turn_are_coalesced_into_one_rpc():
    from genartifact.engine.vllm_adapter import VllmEngine

    class FakeLLM:
        def __init__(self):
            self.rpcs = []

        async def collective_rpc(self, name, args=()):
            self.rpcs.append(args)
            if args[0] == "batch":
                return [[f"w0:{a[0]}" for a in args[2]], [f"w1:{a[0]}" for a in args[2]]]
            arg = args[1] if len(args) > 1 else None
            return [f"w0:{arg}", f"w1:{arg}"]

    eng = VllmEngine(PluginHost({}), "/m")
    eng.llm = FakeLLM()
    got = await asyncio.gather(*(eng.worker_call("moe_routes.fetch", f"c{i}", 0, 5) for i in range(5)))
    assert got == [[f"w0:c{i}", f"w1:c{i}"] for i in range(5)]
    assert len(eng.llm.rpcs) == 1 and eng.llm.rpcs[0][:2] == ("batch", "moe_routes.fetch")
    assert await eng.worker_call("moe_routes.stats") == ["w0:None", "w1:None"]
    assert len(eng.llm.rpcs) == 2 and eng.llm.rpcs[1] == ("moe_routes.stats",)


def test_track_flagged_adds_new_and_drops_finished():
    from types import SimpleNamespace as NS

    from genartifact.engine.worker_ext import track_flagged

    flagged: dict[str, str] = {}
    step1 = NS(scheduled_new_reqs=[NS(req_id="a-1", sampling_params=NS(extra_args={"k": "cid-a"})),
                                   NS(req_id="b-2", sampling_params=NS(extra_args=None))], finished_req_ids=set())
    track_flagged(step1, "k", flagged)
    assert flagged == {"a-1": "cid-a"}
    track_flagged(NS(scheduled_new_reqs=[], finished_req_ids={"a-1"}), "k", flagged)
    assert flagged == {}


def test_requested_prefix_caching_turned_off_is_a_warning_naming_option_and_reason():
    import structlog
    from genartifact.engine.vllm_adapter import engine_options
    from genartifact.host import PluginHost

    host = PluginHost({"contents": ["moe_routes"], "targets": ["managed_fsspec"]})
    with structlog.testing.capture_logs() as logs:
        opts = engine_options(host, "/m", {"enable_prefix_caching": True})
    assert opts["enable_prefix_caching"] is False
    events = {e["event"]: e for e in logs}
    assert events["engine_option_overridden"]["option"] == "enable_prefix_caching"
    assert events["engine_option_overridden"]["requested"] is True
    assert "not recomputed" in events["prefix_caching_disabled"]["reason"]
    with structlog.testing.capture_logs() as logs:
        engine_options(host, "/m", {"enable_prefix_caching": False})
    assert not [e for e in logs if e["log_level"] == "warning"]
