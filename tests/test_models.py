import pytest
import torch

from trident.models.factory import SPECIAL_TOKENS, count_parameters
from trident.models.load import encode_chat, load_causal_lm, load_tokenizer


def test_tokenizer_round_trip_and_single_digits(tiny_model):
    tok = load_tokenizer(tiny_model)
    for text in ["Answer: 12345", "37+45", "3 4 5 -> 17", "héllo wörld {}\n\t!"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    digits = tok.tokenize("Answer: 907")[-3:]
    assert digits == ["9", "0", "7"]  # one token per digit: what lets a tiny model learn addition
    for special in SPECIAL_TOKENS:
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    assert tok.eos_token == "<|im_end|>"


def test_chat_template_renders_chatml_with_tools(tiny_model):
    tok = load_tokenizer(tiny_model)
    messages = [
        {"role": "user", "content": "add 2 and 3"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
        },
        {"role": "tool", "content": "5"},
    ]
    tools = [{"type": "function", "function": {"name": "add"}}]
    text = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nYou may call tools.")
    assert (
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>\n' in text
    )
    assert "<|im_start|>tool\n<tool_response>5</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = encode_chat(tok, messages[:1])
    assert tok.decode(ids) == "<|im_start|>user\nadd 2 and 3<|im_end|>\n<|im_start|>assistant\n"


def test_model_init_loads_in_transformers_and_generates(tiny_model):
    model = load_causal_lm(tiny_model)
    tok = load_tokenizer(tiny_model)
    assert 0.5e6 < count_parameters(model) < 1.5e6
    assert model.config.architectures == ["Qwen2ForCausalLM"]
    ids = torch.tensor([encode_chat(tok, [{"role": "user", "content": "1+2"}])])
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4 or out[0, -1].item() == tok.eos_token_id


# The published config.json of each model card (huggingface.co/Qwen/Qwen2.5-0.5B, -1.5B, -7B,
# Qwen/Qwen3-0.6B, meta-llama/Llama-3.2-1B), typed here independently of trident's table:
# hidden, intermediate, layers, heads, KV heads, head dim, vocab, tied, max positions, rms eps,
# RoPE theta, RoPE scaling.
PUBLISHED = {
    "qwen2.5-0.5b": ("qwen2", 896, 4864, 24, 14, 2, 64, 151936, True, 32768, 1e-6, 1e6, None),
    "qwen2.5-1.5b": ("qwen2", 1536, 8960, 28, 12, 2, 128, 151936, True, 131072, 1e-6, 1e6, None),
    "qwen2.5-7b": ("qwen2", 3584, 18944, 28, 28, 4, 128, 152064, False, 131072, 1e-6, 1e6, None),
    "qwen3-0.6b": ("qwen3", 1024, 3072, 28, 16, 8, 128, 151936, True, 40960, 1e-6, 1e6, None),
    "llama-3.2-1b": (
        "llama", 2048, 8192, 16, 32, 8, 64, 128256, True, 131072, 1e-5, 5e5,
        {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_like_configs_are_the_published_ones(name):
    from trident.models.factory import LIKE, hf_config

    model_type, hidden, inter, layers, heads, kv, head_dim, vocab, tied, positions, eps, theta, scaling = PUBLISHED[name]  # fmt: skip
    config = hf_config(LIKE[name])
    assert config.model_type == model_type and str(config.dtype).endswith("bfloat16")
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (
        hidden, inter, layers,
    )  # fmt: skip
    assert (config.num_attention_heads, config.num_key_value_heads) == (heads, kv)
    assert (getattr(config, "head_dim", None) or hidden // heads) == head_dim
    assert (config.vocab_size, config.tie_word_embeddings) == (vocab, tied)
    assert (config.max_position_embeddings, config.rms_norm_eps) == (positions, eps)
    rope = dict(config.rope_parameters)
    assert rope.pop("rope_theta") == theta
    assert rope == (scaling or {"rope_type": "default"})
    assert hf_config(LIKE[name], layers=2).num_hidden_layers == 2


@pytest.mark.parametrize(("name", "billions"), [("qwen2.5-1.5b", 1.54), ("qwen2.5-7b", 7.62)])
def test_like_shapes_have_the_published_parameter_counts(name, billions):
    """The model cards' sizes (1.54 B, 7.62 B), counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trident.models.factory import LIKE, hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(LIKE[name]))
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions


def test_model_init_config_writes_a_loadable_real_architecture(tmp_path):
    """``--config`` (a Llama-3.2 config shrunk to a tiny width) writes a checkpoint of that
    architecture at its vocabulary with trident's tokenizer, in the chosen dtype, which loads
    through trident's loader and scores tokens (chunked and whole-grid logprobs agree)."""
    import json

    from tests.conftest import run_cli
    from trident.train.batch import Batch
    from trident.train.recompute import token_logprobs

    spec = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 5000, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 131072, "rope_scaling": {
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
        }, "tie_word_embeddings": True, "bos_token_id": 128000, "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(spec))
    out = tmp_path / "m"
    r = run_cli(
        "model", "init", "--config", str(tmp_path / "config.json"), "--layers", "2",
        "--dtype", "float32", str(out), timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "M parameters" in r.stdout
    written = json.loads((out / "config.json").read_text())
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "head_dim",
        "vocab_size",
    ):
        assert written[key] == spec[key], key
    assert written["num_hidden_layers"] == 2 and written["dtype"] == "float32"
    assert written["rope_parameters"]["rope_type"] == "llama3"

    tok = load_tokenizer(str(out))
    model = load_causal_lm(str(out))
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert model.get_input_embeddings().weight.shape == (5000, 64) and len(tok) < 5000
    assert written["eos_token_id"] == tok.eos_token_id  # trident's ids, not Llama's 128001

    ids = torch.tensor([encode_chat(tok, [{"role": "user", "content": "1+2"}]) + tok.encode("3")])
    zeros = torch.zeros(1, ids.shape[1] - 1)
    batch = Batch(ids, torch.ones_like(ids), zeros + 1, zeros, zeros.long())
    with torch.no_grad():
        whole, _ = token_logprobs(model, batch)
        chunked, _ = token_logprobs(model, batch, chunk_tokens=4)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
