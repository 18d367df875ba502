"""moe_route_weights without an engine: settings, bf16 rounding, admission, collect checks, reader checks.
(The real-engine comparison with HF transformers' routers is tests/test_route_weights_engine.py.)"""

from __future__ import annotations

import asyncio
import importlib.metadata as md

import numpy as np
import pytest
from genartifact import format as fmt
from genartifact.errors import AdmissionError, ArtifactFormatError, CaptureError, ConfigError
from genartifact.testing import FakeEngine, model_info
from genartifact.types import AdmissionContext, FinalContext
from genartifact_route_weights import (
    MoeRouteWeights,
    MoeRouteWeightsReader,
    bf16_bits_to_f32,
    parse_settings,
    to_bf16_bits,
)

MODEL = model_info(worker_captures=["moe_routes", "moe_route_weights"])


def test_entry_point_declared():
    eps = {ep.name: ep for ep in md.entry_points(group="genartifact.contents")}
    assert eps["moe_route_weights"].value == "genartifact_route_weights"
    assert eps["moe_route_weights"].dist.name == "genartifact-route-weights"


@pytest.mark.parametrize("settings, want", [({}, "f32"), ({"dtype": "bf16", "base_dir": "/x"}, "bf16"),
                                            ({"dtype": "f32"}, "f32")])
def test_settings(settings, want):
    assert parse_settings(settings) == want


@pytest.mark.parametrize("settings, match", [({"dtype": "fp16"}, r"dtype='fp16' invalid; allowed: \['bf16', 'f32'\]"),
                                             ({"dtype": "float32"}, "allowed"),
                                             ({"dtype": ["f32"]}, r"dtype=\['f32'\] invalid; allowed"),
                                             ({"dtype": {"a": 1}}, r"dtype=\{'a': 1\} invalid; allowed"),
                                             ({"dtyp": "bf16"}, r"unknown key\(s\) \['dtyp'\]; allowed: \['dtype'\]")])
def test_bad_settings_name_the_field(settings, match):
    with pytest.raises(ConfigError, match=match):
        parse_settings(settings)


def test_bf16_rounding_equals_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.random(100_000, dtype=np.float32), rng.standard_normal(10_000).astype(np.float32) * 1e3,
                        np.array([0.0, 1.0, 0.5, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, 3.0e38], np.float32)])
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    got = to_bf16_bits(x)
    assert np.array_equal(got, want)
    back = bf16_bits_to_f32(got)
    assert np.array_equal(back, torch.from_numpy(x).to(torch.bfloat16).float().numpy())
    w = rng.random(1000, dtype=np.float32)  # 8 significant bits: half an ulp <= 2**-8 relative
    assert (np.abs(bf16_bits_to_f32(to_bf16_bits(w)) - w) <= np.abs(w) * 2.0**-8).all()


def admitted(dtype="f32", p=5, max_tokens=4, start=0, model=MODEL):
    pr = MoeRouteWeights(model, dtype)
    n = pr.admit(AdmissionContext(p, max_tokens, start, model, {}))
    params = {}
    pr.sampling_overrides(params)
    assert params["extra_args"]["genartifact_route_weights_capture_id"] == pr.capture_id
    return pr, n


@pytest.mark.parametrize("start", [0, 3])
@pytest.mark.fault("admission", "caller's extra_args carry genartifact_routes_start")
def test_a_callers_routes_start_in_extra_args_never_shifts_the_handed_over_rows(start):
    """A caller's ``extra_args["genartifact_routes_start"]`` (Python API, an RL framework's own extra_args) is
    replaced by the request's admitted start, or removed when that is 0: the worker hands rows over from the
    artifact's start, never the caller's (the artifact once failed ``capture_invalid`` with a shape mismatch)."""
    from genartifact_route_capture import MoeRoutes

    for pr in (MoeRoutes(MODEL), MoeRouteWeights(MODEL, "f32")):
        pr.admit(AdmissionContext(5, 4, start, MODEL, {}))
        params = {"extra_args": {"genartifact_routes_start": 2, "mine": 1}}
        pr.sampling_overrides(params)
        extra = params["extra_args"]
        assert extra.get("genartifact_routes_start", 0) == start and extra["mine"] == 1, type(pr).__name__


def test_admission_counts_worst_case_bytes():
    _, f32 = admitted("f32", p=5, max_tokens=4)
    _, bf16 = admitted("bf16", p=5, max_tokens=4)
    rows = 5 + 4 - 1
    assert f32 - bf16 == rows * 4 * 2 * 2  # 4 routers x top-2 x (4 - 2) bytes per row
    assert bf16 >= rows * 4 * 2 * 2
    _, later = admitted("f32", p=5, max_tokens=4, start=3)
    assert f32 - later == 3 * 4 * 2 * 4


def test_admission_refusals():
    with pytest.raises(AdmissionError, match="worker capture"):
        admitted(model=model_info())  # the engine's workers did not report a moe_route_weights capture
    with pytest.raises(AdmissionError, match="prefix"):
        admitted(model=model_info(worker_captures=["moe_route_weights"], enable_prefix_caching=True))


def fetch_engine(arr, missing=None, scales=None):
    def fetch(cid, start, end):
        d = np.ascontiguousarray(arr[:, start:end])
        r = {"shape": list(d.shape), "dtype": d.dtype.str, "data": d.tobytes(), "missing": missing}
        if scales is not None:
            r["router_scale"], r["output_scale"] = scales
        return r

    return FakeEngine({"moe_route_weights.fetch": fetch, "moe_route_weights.discard": lambda cid: True})


def test_collect_finalize_start_and_errors():
    full = np.full((4, 8, 2), 0.5, np.float32)
    pr, _ = admitted("bf16", p=5, max_tokens=4, start=2)
    fin = FinalContext(5, 4, engine=fetch_engine(full))
    asyncio.run(pr.collect(fin))
    sec, parts = pr.finalize(fin)
    assert sec["token_start"] == 2 and sec["dtype"] == "bf16" and sec["router_scale"] == [1.0] * 4
    assert parts[0].name == "moe_route_weights.weights" and parts[0].array.shape == (4, 6, 2)
    assert parts[0].array.dtype == np.uint16 and (bf16_bits_to_f32(parts[0].array) == 0.5).all()
    for arr, missing, match in [(full, [3, 2], "2 positions have no router weights"),
                                (np.full((4, 8, 2), np.nan, np.float32), None, "finite"),
                                (-full, None, ">= 0"), (full[:2], None, "shape")]:
        pr, _ = admitted()
        with pytest.raises(CaptureError, match=match):
            asyncio.run(pr.collect(FinalContext(5, 4, engine=fetch_engine(arr, missing))))
    pr, _ = admitted()
    with pytest.raises(CaptureError, match="no router weights"):
        pr.finalize(FinalContext(5, 4))
    with pytest.raises(CaptureError, match="admitted"):
        asyncio.run(pr.collect(FinalContext(5, 9, engine=fetch_engine(np.zeros((4, 20, 2), np.float32)))))


def encoded(contents, w, sec, p=3, c=2, routes_sec=None):
    sections = {"moe_route_weights": sec}
    parts = [fmt.TensorPart("moe_route_weights.weights", w)]
    if routes_sec is not None:
        sections["moe_routes"] = routes_sec
        parts.append(fmt.TensorPart("moe_routes.expert_ids", np.zeros((w.shape[0], w.shape[1], w.shape[2]), np.uint8)))
    return fmt.ArtifactInput(np.arange(p + c, dtype=np.uint32), p, contents, sections, parts)


def section(**kw):
    return {"token_start": 0, "router_ids": [0, 1], "top_k": 2, "dtype": "f32", "layout": "router_major",
            "router_scale": [1.0, 1.0], "output_scale": [1.0, 1.0], "source": "worker_capture", **kw}


def test_reader_validation():
    from genartifact_route_capture import READER as ROUTES

    readers = {"moe_route_weights": MoeRouteWeightsReader(), "moe_routes": ROUTES}
    w = np.full((2, 4, 2), 0.5, np.float32)
    routes = {"token_start": 0, "router_ids": [0, 1], "expert_counts": [8, 8], "top_k": 2, "layout": "router_major"}
    art = fmt.decode(fmt.encode(encoded(["moe_routes", "moe_route_weights"], w, section(), routes_sec=routes),
                                readers=readers).data)
    assert art.content("moe_route_weights").shape == (4, 2, 2)
    bad = [
        (w, section(dtype="bf16"), "u16"),
        (w.astype(np.uint16), section(dtype="bf16", layout="x"), "layout"),
        (w, section(dtype="f16"), "allowed"),
        (w[:, :3], section(), "rows 3"),
        (w, section(router_ids=[1, 0]), "router_ids"),
        (w, section(top_k=3), "top_k"),
        (w, section(output_scale=[1.0]), "output_scale"),
        (w, section(router_scale=[1.0, "2"]), "router_scale"),
        (np.full((2, 4, 2), -0.5, np.float32), section(), ">= 0"),
        (np.full((2, 4, 2), np.inf, np.float32), section(), "finite"),
        (w, {k: v for k, v in section().items() if k != "router_scale"}, "keys"),
        (w, section(dtype=[]), "dtype"), (w, section(dtype=None), "dtype"), (w, section(token_start=None), "token_start"),
        (w, section(token_start=True), "token_start"), (w, section(router_ids="ab"), "router_ids"),
        (w, section(top_k=True), "top_k"), (w, section(output_scale=None), "output_scale"),
        (w, section(output_scale=[True, 1.0]), "output_scale"), (w, section(layout=[]), "layout"),
    ]
    for arr, sec, match in bad:
        with pytest.raises(ArtifactFormatError, match=match):
            fmt.encode(encoded(["moe_route_weights"], arr, sec), readers=readers)
    with pytest.raises(ArtifactFormatError, match="align 1:1 with moe_routes"):
        fmt.encode(encoded(["moe_routes", "moe_route_weights"], w, section(),
                           routes_sec={**routes, "router_ids": [0, 2]}), readers=readers)


def test_decode_needs_neither_vllm_nor_torch(tmp_path):
    """The reader is found by its entry point and imports no engine code: an artifact with the content decodes
    and views (bf16 widened) in a process where importing vllm or torch fails."""
    import subprocess
    import sys

    w = np.full((2, 4, 2), 0.5, np.float32)
    f = tmp_path / "a.gart"
    f.write_bytes(fmt.encode(encoded(["moe_route_weights"], to_bf16_bits(w), section(dtype="bf16"))).data)
    code = ("import sys; sys.modules['vllm'] = None; sys.modules['torch'] = None\n"
            "from genartifact import format as fmt\n"
            f"a = fmt.decode(open({str(f)!r}, 'rb').read())\n"
            "v = a.content('moe_route_weights'); s = a.content_summary('moe_route_weights')\n"
            "assert v.shape == (4, 2, 2) and float(v.max()) == 0.5 and s['dtype'] == 'bf16', (v, s)\n"
            "print('ok', sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch') and sys.modules[m]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok []", r.stdout + r.stderr


def test_plugins_check_names_a_bad_setting(tmp_path):
    """`genartifact plugins --check` builds the enabled producer from its settings: a bad dtype is reported
    (exit 1) before any run, naming the table, the field and the allowed values."""
    import subprocess
    import sys

    cfg = tmp_path / "c.toml"
    cfg.write_text('[plugins]\ncontents = ["moe_routes", "moe_route_weights"]\ntargets = []\n'
                   '[contents.moe_route_weights]\ndtype = "fp16"\n')
    r = subprocess.run([sys.executable, "-m", "genartifact.cli", "plugins", "--check", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and "[contents.moe_route_weights] dtype='fp16' invalid; allowed: ['bf16', 'f32']" in out, out


@pytest.mark.parametrize("given", [{}, {"enable_prefix_caching": True}, {"enable_prefix_caching": None}])
def test_engine_options_turn_prefix_caching_off_when_worker_capture_runs(given):
    from genartifact_route_weights import genartifact_engine_options

    opts = dict(given)
    genartifact_engine_options(options=opts, worker_capture=True)
    assert opts["enable_prefix_caching"] is False
    untouched = dict(given)
    genartifact_engine_options(options=untouched, worker_capture=False)  # no worker capture: nothing to protect
    assert untouched == given
