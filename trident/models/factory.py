"""Local checkpoints for development, tests and the CPU demo (nothing is downloaded here).

``init_model(out, preset)`` writes a complete HF checkpoint: a byte-level BPE tokenizer trained on
the built-in tasks' text (digits split individually: with merged multi-digit tokens a tiny model
does not learn addition), a ChatML chat template with tool-call support, and a randomly
initialised Qwen2-architecture model. The result loads with ``from_pretrained`` in transformers
and in a vLLM server, exactly like a real checkpoint.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from trident.data.tasks import TASKS, generate_split
from trident.envs import demonstration_texts

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# ChatML, as Qwen2 uses it. Tools are listed in the system turn; an assistant turn may carry
# `tool_calls` rendered as <tool_call>{json}</tool_call>; tool results come back in a `tool` turn.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{% endif %}"
    "{{ 'You may call tools. Available tools:\\n<tools>\\n' }}"
    "{%- for tool in tools %}{{ tool | tojson + '\\n' }}{% endfor %}"
    '{{ \'</tools>\\nCall one with <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>.<|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if not (tools and loop.first and m.role == 'system') %}"
    "{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'tool' %}{{ '<tool_response>' + m.content + '</tool_response>' }}"
    "{%- else %}{{ m.content if m.content is string else '' }}"
    "{%- if m.tool_calls is defined and m.tool_calls %}"
    "{%- for call in m.tool_calls %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{{ '<tool_call>' + ({'name': fn.name, 'arguments': fn.arguments} | tojson) + '</tool_call>' }}"
    "{%- endfor %}{%- endif %}{%- endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

PRESETS: dict[str, dict[str, Any]] = {
    # ~0.9 M parameters: trains on 2 CPU cores in seconds per hundred steps.
    "tiny": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
    ),
    # ~25 M parameters: for GPU runs.
    "small": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=2048,
    ),
}


# Published architectures, as their model cards' config.json files give them (huggingface.co/
# Qwen/Qwen2.5-0.5B, -1.5B, -7B, Qwen/Qwen3-0.6B, meta-llama/Llama-3.2-1B): every field that
# shapes the network or its numerics. The token ids (bos/eos/pad) are not copied: they name the real
# tokenizer's tokens, and a checkpoint built here carries trident's tokenizer instead.
LIKE: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=32768,
        max_window_layers=24,
        sliding_window=32768,
        use_sliding_window=False,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        initializer_range=0.02,
        vocab_size=151936,
        torch_dtype="bfloat16",
    ),
    "qwen2.5-1.5b": dict(
        model_type="qwen2",
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=131072,
        max_window_layers=28,
        sliding_window=131072,
        use_sliding_window=False,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        initializer_range=0.02,
        vocab_size=151936,
        torch_dtype="bfloat16",
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        hidden_act="silu",
        max_position_embeddings=131072,
        max_window_layers=28,
        sliding_window=131072,
        use_sliding_window=False,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        vocab_size=152064,
        torch_dtype="bfloat16",
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=40960,
        max_window_layers=28,
        sliding_window=None,
        use_sliding_window=False,
        attention_bias=False,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_scaling=None,
        tie_word_embeddings=True,
        attention_dropout=0.0,
        initializer_range=0.02,
        vocab_size=151936,
        torch_dtype="bfloat16",
    ),
    "llama-3.2-1b": dict(
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=131072,
        attention_bias=False,
        mlp_bias=False,
        pretraining_tp=1,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        tie_word_embeddings=True,
        attention_dropout=0.0,
        initializer_range=0.02,
        vocab_size=128256,
        torch_dtype="bfloat16",
    ),
}
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _corpus(num_rows: int = 3000) -> list[str]:
    texts = []
    for task in TASKS.values():
        for row in generate_split(task, "train", num_rows // 2, seed=1234):
            texts.append(f"user\n{row['prompt']}")
            texts.append(f"assistant\n{task.solution(row)}")
    texts += ["system", "user", "assistant", "tool", "Answer:", '{"name": "calc", "arguments": {}}']
    texts += [
        "You may call tools. Available tools:",
        'Call one with {"name": NAME, "arguments": ARGS}.',
    ]
    texts += demonstration_texts()  # tool schemas and calls: fewer tokens per agentic prompt
    return texts


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer with single-digit tokens and the ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def init_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write tokenizer + config + random weights to ``out_dir``; returns the directory."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec = dict(PRESETS[preset])
    tokenizer = build_tokenizer(spec.pop("vocab_size"))
    bos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert isinstance(bos_id, int) and isinstance(eos_id, int) and isinstance(pad_id, int)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
        **spec,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "trident.json").write_text(json.dumps({"preset": preset, "seed": seed}) + "\n")
    return out


def hf_config(spec: dict[str, Any], layers: int | None = None):
    """The transformers config of a config.json's fields ``spec`` (``layers`` overrides
    ``num_hidden_layers``; ``torch_dtype``/``dtype`` is the checkpoint's dtype)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in spec.items() if k not in ("architectures", *_TOKEN_ID_KEYS)}
    if layers is not None:
        fields["num_hidden_layers"] = layers
        fields.pop("layer_types", None)  # per-layer lists follow the layer count
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError("the config has no model_type (a Hugging Face config.json has one)")
    return AutoConfig.for_model(model_type, **fields)


def init_from_config(
    out_dir: str | Path,
    spec: dict[str, Any],
    *,
    layers: int | None = None,
    dtype: str | None = None,
    seed: int = 0,
    tokenizer_vocab: int = 2048,
) -> Path:
    """Write a random-weight checkpoint of the architecture ``spec`` (a config.json's fields, e.g.
    ``LIKE[name]``) with trident's tokenizer (``tokenizer_vocab`` entries, the chat template):
    the vocabulary stays at the config's size, and ids past the tokenizer's never occur. The
    weights are in ``dtype`` (default: the config's, else float32), in safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = hf_config(spec, layers)
    tokenizer = build_tokenizer(tokenizer_vocab)
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"vocab_size {config.vocab_size} < the tokenizer's {len(tokenizer)}")
    bos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    eos_id, pad_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    config.bos_token_id, config.eos_token_id, config.pad_token_id = bos_id, eos_id, pad_id
    name = dtype or str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    config.dtype = name
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, name))
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    meta = {"architecture": config.model_type, "layers": config.num_hidden_layers, "seed": seed}
    (out / "trident.json").write_text(json.dumps(meta) + "\n")
    return out


def checkpoint_parameters(path: str | Path) -> int:
    """Parameters of a safetensors checkpoint, from the files' headers (nothing loaded)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():  # noqa: SIM118  # safe_open is not a mapping
                total += math.prod(st.get_slice(key).get_shape())
    return total


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
