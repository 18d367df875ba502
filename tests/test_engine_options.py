"""Engine-option adjustments made before an engine starts (no engine needed)."""

from __future__ import annotations


def test_cpu_mla_fallback_only_for_fp32_mla_on_amx(deepseek_model, qwen_model):
    """The AMX fallback touches only an fp32 MLA model on an AMX CPU with no backend chosen by the caller."""
    from genartifact.engine.vllm_adapter import cpu_mla_fallback

    base = {"model": str(deepseek_model), "dtype": "float32"}
    assert cpu_mla_fallback(dict(base), amx=True)["attention_backend"] == "CPU_MLA"
    assert "attention_backend" not in cpu_mla_fallback(dict(base), amx=False)
    assert "attention_backend" not in cpu_mla_fallback({**base, "dtype": "bfloat16"}, amx=True)
    assert cpu_mla_fallback({**base, "attention_backend": "AMX_MLA"}, amx=True)["attention_backend"] == "AMX_MLA"
    assert "attention_backend" not in cpu_mla_fallback({"model": str(qwen_model), "dtype": "float32"}, amx=True)
