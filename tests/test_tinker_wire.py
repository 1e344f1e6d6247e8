"""The Tinker codec against the pinned SDK's own converters: requests the SDK encodes decode to
the right Datums, and results trident encodes decode, with the SDK's deserializers, to the same
values."""

import json
import math

import numpy as np
import pytest
import torch
import zstandard
from tinker import types as sdk
from tinker._compat import model_dump
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from trident.tinker import wire
from trident.train.datum import AdamParams, LoraShape


def _sdk_body(data, loss_fn="cross_entropy", config=None, forward_only=False, seq_id=7):
    """The bytes ``AsyncTrainingResource.forward_backward`` POSTs for this call."""
    request = sdk.ForwardBackwardRequest(
        forward_backward_input=sdk.ForwardBackwardInput(
            data=data, loss_fn=loss_fn, loss_fn_config=config
        ),
        model_id="s1:train:0",
        seq_id=seq_id,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = forward_only
    return msg.SerializeToString()


def _datum(chunks, **inputs):
    return sdk.Datum(
        model_input=sdk.ModelInput(chunks=[sdk.EncodedTextChunk(tokens=c) for c in chunks]),
        loss_fn_inputs=inputs,
    )


def test_dense_ragged_request_decodes_to_datums():
    data = [
        _datum([[1, 2], [3]], target_tokens=[2, 3, 4], weights=[0.0, 0.5, 0.5]),
        _datum([[5, 6, 7, 8, 9]], target_tokens=[6, 7, 8, 9, 10], weights=[0.2] * 5),
    ]
    body = _sdk_body(data, config={"clip_low_threshold": 0.8}, forward_only=True)
    call = wire.decode_forward_backward(body)
    assert (call.model_id, call.seq_id, call.loss_fn) == ("s1:train:0", 7, "cross_entropy")
    assert call.forward_only and call.loss_fn_config == pytest.approx({"clip_low_threshold": 0.8})
    first, second = call.data
    assert first.input_tokens.tolist() == [1, 2, 3]  # chunks concatenated
    assert first.input_tokens.dtype == torch.int64
    assert first.loss_inputs["target_tokens"].tolist() == [2, 3, 4]
    assert first.loss_inputs["target_tokens"].dtype == torch.int64
    assert first.loss_inputs["weights"].dtype == torch.float32
    assert first.loss_inputs["weights"].tolist() == [0.0, 0.5, 0.5]
    assert second.input_tokens.tolist() == [5, 6, 7, 8, 9]
    assert second.loss_inputs["weights"].tolist() == pytest.approx([0.2] * 5)


def test_sparse_csr_and_zstd_request():
    # A 2-D target_tokens / weights (several targets per position) is sent as CSR by the SDK.
    targets = torch.zeros(6, 3, dtype=torch.int64)
    targets[1, 0], targets[4, 2] = 11, 12
    weights = torch.zeros(6, 3)
    weights[1, 0], weights[4, 2] = 0.25, 0.75
    datum = _datum([list(range(6))], target_tokens=targets, weights=weights)
    assert datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None  # really sparse
    body = zstandard.ZstdCompressor().compress(_sdk_body([datum]))  # as resources/training.py
    call = wire.decode_forward_backward(body, "zstd")
    (decoded,) = call.data
    assert torch.equal(decoded.loss_inputs["target_tokens"], targets)
    assert torch.equal(decoded.loss_inputs["weights"], weights)


def test_loss_config_v2_wins_and_bad_requests_are_named():
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=3, loss_fn="ppo")
    msg.loss_fn_config["clip_low_threshold"] = 0.1
    msg.loss_fn_config_v2["clip_low_threshold"].number = 0.7
    assert wire.decode_forward_backward(msg.SerializeToString()).loss_fn_config == pytest.approx(
        {"clip_low_threshold": 0.7}
    )

    image = sdk.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=4)
    datum = sdk.Datum(model_input=sdk.ModelInput(chunks=[image]), loss_fn_inputs={})
    with pytest.raises(wire.WireError, match=r"data\[0\]: a image chunk"):
        wire.decode_forward_backward(_sdk_body([datum]))
    # The off-by-one every server has shipped once: one target short of the input.
    short = _datum([[1, 2, 3]], target_tokens=[2, 3], weights=[1.0, 1.0])
    with pytest.raises(wire.WireError, match="2 values for 3 input tokens"):
        wire.decode_forward_backward(_sdk_body([short]))
    with pytest.raises(wire.WireError, match="seq_id"):
        wire.decode_forward_backward(_sdk_body([], seq_id=0))
    with pytest.raises(wire.WireError, match="not a ForwardBackwardRequest"):
        wire.decode_forward_backward(b"\xff\xff\xff")
    bad_dtype = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = bad_dtype.data.add()
    d.model_input.add().encoded_text.tokens = np.array([1], np.int32).tobytes()
    d.loss_fn_inputs["weights"].dtype = pb.DTYPE_BFLOAT16
    with pytest.raises(wire.WireError, match="DTYPE_BFLOAT16"):
        wire.decode_forward_backward(bad_dtype.SerializeToString())


def test_forward_backward_output_decodes_with_the_sdk():
    outputs = [
        {
            "logprobs": torch.tensor([-0.5, -1.25, -2.0]),
            "elementwise_loss": torch.tensor([0.0, 1.25, 2.0]),
        },
        {"logprobs": torch.tensor([-3.0]), "elementwise_loss": torch.tensor([3.0])},
        {"logprobs": torch.tensor([-0.125, -0.25]), "elementwise_loss": torch.tensor([0.5, 0.25])},
    ]
    decoded = deserialize_forward_backward_output(
        wire.encode_forward_backward_output(outputs, {"loss:sum": 6.5})
    )
    assert decoded.loss_fn_output_type == "ArrayRecord"
    assert decoded.metrics == {"loss:sum": 6.5}
    assert len(decoded.loss_fn_outputs) == 3
    for ours, theirs in zip(outputs, decoded.loss_fn_outputs, strict=True):
        assert set(theirs) == {"logprobs", "elementwise_loss"}
        for name, tensor in ours.items():
            assert theirs[name].dtype == "float32"
            assert theirs[name].shape == [len(tensor)]
            assert theirs[name].tolist() == tensor.tolist()
    empty = deserialize_forward_backward_output(
        wire.encode_forward_backward_output([], {"loss:sum": 0.0})
    )
    assert empty.loss_fn_outputs == [] and empty.metrics == {"loss:sum": 0.0}
    as_json = wire.forward_backward_output_json(outputs[:1], {"loss:sum": 1.0})
    assert json.loads(json.dumps(as_json))["loss_fn_outputs"][0]["logprobs"]["data"] == [
        -0.5,
        -1.25,
        -2.0,
    ]


def test_sample_response_decodes_with_the_sdk():
    sequences = [
        wire.SampledOutput(
            [7, 8, 9],
            [-0.5, -0.25, -1.0],
            "stop",
            topk=[[(7, -0.5), (3, -1.5)], [(8, -0.25)], None],
        ),
        wire.SampledOutput([4], None, "length"),
    ]
    body = wire.encode_sample_response(
        sequences,
        prompt_logprobs=[None, -2.5, -0.75],
        topk_prompt_logprobs=[None, [(1, -0.1), (2, -2.4)], [(5, -0.75)]],
    )
    decoded = deserialize_sample_response(body)
    first, second = decoded.sequences
    assert (first.stop_reason, first.tokens, first.logprobs) == (
        "stop",
        [7, 8, 9],
        [-0.5, -0.25, -1.0],
    )
    assert first.topk_logprobs == [[(7, -0.5), (3, -1.5)], [(8, -0.25)], None]
    assert (second.stop_reason, second.tokens, second.logprobs) == ("length", [4], None)
    assert second.topk_logprobs is None
    assert math.isnan(decoded.prompt_logprobs_np[0])
    assert decoded.prompt_logprobs == [None, -2.5, -0.75]
    assert decoded.topk_prompt_logprobs == [
        None,
        [(1, pytest.approx(-0.1)), (2, pytest.approx(-2.4))],
        [(5, -0.75)],
    ]
    plain = deserialize_sample_response(wire.encode_sample_response(sequences[1:]))
    assert plain.prompt_logprobs is None and plain.topk_prompt_logprobs is None


def _json(request) -> bytes:
    """The JSON body the SDK's resources POST for a request model."""
    return json.dumps(
        model_dump(request, exclude_unset=False, exclude_none=True, mode="json")
    ).encode()


def test_json_training_calls_decode_through_the_sdk_models():
    create = sdk.CreateModelRequest(
        session_id="s1",
        model_seq_id=2,
        base_model="tiny",
        lora_config=sdk.LoraConfig(rank=8, train_mlp=False),
    )
    call = wire.decode_call("create_model", _json(create), lora_alpha=16.0)
    assert (call.model_id, call.seq_id) == ("s1:train:2", 0)
    assert call.args["lora"] == LoraShape(
        rank=8, alpha=16.0, train_attn=True, train_mlp=False, train_unembed=True
    )
    full = sdk.CreateModelRequest(
        session_id="s1", model_seq_id=3, base_model="tiny", lora_config=sdk.LoraConfig(rank=0)
    )
    assert wire.decode_call("create_model", _json(full)).args["lora"] is None

    step = sdk.OptimStepRequest(
        optim_params=sdk.AdamParams(learning_rate=1e-3, eps=1e-8, grad_clip_norm=1.0),
        model_id="s1:train:2",
        seq_id=4,
    )
    call = wire.decode_call("optim_step", _json(step))
    assert (call.model_id, call.seq_id) == ("s1:train:2", 4)
    assert call.args == AdamParams(learning_rate=1e-3, eps=1e-8, grad_clip_norm=1.0)

    load = sdk.LoadWeightsRequest(
        session_id="s9", model_seq_id=0, path="tinker://r/weights/000002", optimizer=True
    )
    call = wire.decode_call("load_weights", _json(load))
    assert (call.model_id, call.seq_id, call.args["optimizer"]) == ("s9:train:0", 0, True)

    sampler = sdk.SaveWeightsForSamplerRequest(
        model_id="s1:train:2", seq_id=5, sampling_session_seq_id=0
    )
    call = wire.decode_call("save_weights_for_sampler", _json(sampler))
    assert (
        call.seq_id == 5 and call.args["sampling_session_seq_id"] == 0 and call.args["path"] is None
    )

    with pytest.raises(wire.WireError, match="seq_id"):
        wire.decode_call("save_weights", _json(sdk.SaveWeightsRequest(model_id="m", path="x")))
    with pytest.raises(wire.WireError, match="CreateModelRequest: base_model"):
        wire.decode_call("create_model", b'{"session_id": "s", "model_seq_id": 0}')
