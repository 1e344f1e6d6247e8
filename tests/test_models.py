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
