"""The in-repo plugins are installed as real distributions with their entry points."""

from genartifact.host import PluginHost


def test_real_entry_points_are_installed():
    host = PluginHost({"contents": ["moe_routes", "selected_logprobs"], "targets": ["managed_fsspec"]})
    rows = {(r["kind"], r["name"]): r for r in host.listing()}
    assert rows[("contents", "moe_routes")]["dist"] == "genartifact-route-capture"
    assert rows[("contents", "selected_logprobs")]["dist"] == "genartifact-logprobs"
    assert rows[("contents", "moe_route_weights")]["dist"] == "genartifact-route-weights"
    assert rows[("contents", "top_logprobs")]["dist"] == "genartifact-top-logprobs"
    assert rows[("targets", "managed_fsspec")]["dist"] == "genartifact-fsspec-target"
    assert rows[("targets", "presigned_http_put")]["dist"] == "genartifact-http-put-target"
    assert [k for k, r in rows.items() if r["enabled"]] == [
        ("contents", "moe_routes"), ("contents", "selected_logprobs"), ("targets", "managed_fsspec")]
