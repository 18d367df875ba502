"""Deterministic tiny MoE checkpoints (random init, seed 0) plus a BPE tokenizer trained on an embedded
corpus, saved as ``PreTrainedTokenizerFast``. No model hub is needed.

Families: ``qwen3_moe`` (4 layers, all MoE, 8 experts, top-2, head_dim 64 because vLLM's CPU attention
rejects 16), ``qwen3_moe_small`` (~45 M parameters, 6 layers, 16 experts, top-4; for benchmarks) and ``deepseek`` (DeepSeek-V3 style, MLA, dense first layer ``first_k_dense_replace=1``; the
CPU MLA backend needs kv_lora_rank 512 + rope 64).
"""

from __future__ import annotations

import os
from pathlib import Path

VOCAB = 512

CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
Once upon a time, in a small village near the mountains, there lived an old woman who kept bees.
Every morning she walked to the hives, listened to the humming, and counted the flowers in the field.
The children of the village liked to visit her, because she told stories about the river, the forest,
and the strange lights that sometimes appeared above the hills on cold winter nights.
Science is the patient work of asking questions and testing answers against the world.
Numbers such as 1, 2, 3, 10, 42, 100 and 2024 appear in many sentences, dates, and measurements.
Computers read text as tokens; a tokenizer splits words into smaller pieces that a model can learn.
In the city, trains arrive every ten minutes, and people hurry to work with coffee in their hands.
The weather today is sunny with a light breeze from the west, and tomorrow it may rain in the evening.
She said: "Where are you going?" He answered, "To the market, to buy bread, apples, and cheese."
Learning a language takes time. Reading books, writing letters, and speaking with friends all help.
The ocean is deep and blue; whales sing songs that travel for hundreds of miles under the water.
Mathematics describes patterns: lines, circles, triangles, and the relations between quantities.
History remembers kings and queens, but also farmers, sailors, builders, teachers, and poets.
"""

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]

#: A minimal role-tagged chat template (Jinja, transformers' ``apply_chat_template`` format).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def make_tokenizer(out_dir: str, vocab_size: int = VOCAB):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = CORPUS.splitlines() * 4
    tok.train_from_iterator(lines, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.model_max_length = 2048
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


QWEN_SIZES = {
    # name: hidden, intermediate, moe_intermediate, layers, heads, kv_heads, experts, top_k
    "qwen3_moe": (128, 128, 64, 4, 4, 2, 8, 2),
    # ~45 M parameters: steps long enough that per-step host overheads are no longer the whole story
    "qwen3_moe_small": (512, 1024, 256, 6, 8, 4, 16, 4),
}


def _qwen3_moe_config(mlp_only_layers: list[int], size: str = "qwen3_moe"):  # noqa: ANN202
    from transformers import Qwen3MoeConfig

    hidden, inter, moe_inter, layers, heads, kv, experts, top_k = QWEN_SIZES[size]
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        moe_intermediate_size=moe_inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_experts=experts,
        num_experts_per_tok=top_k,
        decoder_sparse_step=1,
        mlp_only_layers=list(mlp_only_layers),
        max_position_embeddings=2048,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    cfg.head_dim = 64  # CPU attention needs a supported head size (64 ok, 16 not)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


def _deepseek_config():
    from transformers import DeepseekV3Config

    # CPU_MLA backend only supports latent head size 576 = kv_lora_rank 512 + rope 64.
    cfg = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=64,
        v_head_dim=64,
        routed_scaling_factor=1.0,
        norm_topk_prob=True,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        num_mtp_layers=0,
    )
    # HF's DeepSeek-V3 router always has e_score_correction_bias; vLLM loads it only for noaux_tc routing
    cfg.topk_method = "noaux_tc"
    cfg.scoring_func = "sigmoid"
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    return cfg


FAMILIES = ("qwen3_moe", "qwen3_moe_small", "deepseek")


def make_tiny_model(out_dir: str | os.PathLike[str], family: str = "qwen3_moe") -> Path:
    """Write a tiny ``family`` checkpoint + tokenizer to ``out_dir`` (created); returns the path.

    Deterministic: ``torch.manual_seed(0)``, fixed configs and corpus. Raises ``ValueError`` for an
    unknown family (allowed: :data:`FAMILIES`).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"family {family!r} unknown; allowed: {list(FAMILIES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _qwen3_moe_config([], family) if family in QWEN_SIZES else _deepseek_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    make_tokenizer(str(out), cfg.vocab_size)
    return out
